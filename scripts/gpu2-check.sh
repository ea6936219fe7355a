#!/usr/bin/env bash
# Erase's data-parallel checks on GPUS GPUs of one host (2 unless GPUS says otherwise; 4
# or 8 give the paper's table), from a bundle made by scripts/gpu-bundle.sh: replicas
# bit-identical after 50 steps (early and end all-reduce, every dispatch mode), the fault
# paths (a crashed rank, a hung rank), then global QPS p50/p90 and NE of baseline /
# detached / erase on 1 GPU (batch 4096) and on GPUS GPUs (4096 per GPU) with early and
# end all-reduce, and the simulator's prediction. Writes logs to $OUT (default
# <bundle>/out<GPUS>) and prints a short table last. Every row carries its held-out NE
# (on the multi-GPU rows rank 0 evaluates its replica at the global batch).
#   bash gpu2-check.sh [BUNDLE]   (GPUS=2 STEPS=300 WARMUP=50 EVAL=200000
#                                  DISPATCH="blocking threaded graph")
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
n="${GPUS:-2}"
out="${OUT:-$bundle/out$n}"
steps="${STEPS:-300}"
warm="${WARMUP:-50}"
dispatches="${DISPATCH:-blocking threaded graph}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu"
exe="$bundle/erase-ctr"
summary=()
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
ngpu=$(nvidia-smi -L | wc -l)
[ "$ngpu" -ge "$n" ] || echo "only $ngpu GPU(s): the $n-GPU runs will fail"

common=(--device cuda --preset spec --eval-every 0 --eval-examples 4096 --collective-timeout 120)

# 1. replicas bit-identical after 50 steps
for d in $dispatches; do
  for ar in early end; do
    log="$out/identical-$d-$ar.log"
    timeout 300 "$exe" train --gpus "$n" "${common[@]}" --batch $((4096 * n)) --steps 50 --warmup 5 \
      --dispatch "$d" --allreduce "$ar" --collective-log "$out/collectives-$d-$ar" >"$log" 2>&1
    rc=$?
    same=$(grep -c "replicas bit-identical on all $n ranks" "$log")
    logs=identical
    for r in $(seq 1 $((n - 1))); do
      cmp -s "$out/collectives-$d-$ar/rank-0.log" "$out/collectives-$d-$ar/rank-$r.log" || logs=DIFFER
    done
    summary+=("replicas after 50 steps ($d, $ar all-reduce): rc $rc, $([ "$same" = 1 ] && echo bit-identical || echo 'NOT CONFIRMED'), collective logs $logs")
    grep -E 'error|panicked' "$log" | head -5
  done
done

# 1b. one rank of NCCL is plain training: the same losses as the single-process trainer
timeout 300 "$exe" train "${common[@]}" --batch 4096 --steps 50 --warmup 5 \
  --metrics "$out/plain-1gpu.jsonl" >"$out/plain-1gpu.log" 2>&1
plain=$(grep '"loss"' "$out/plain-1gpu.jsonl" | tail -1 | sed -E 's/.*"loss":([^,]+),.*/\1/' | awk '{printf "%.6f", $1}')
timeout 300 "$exe" train --gpus 1 "${common[@]}" --batch 4096 --steps 50 --warmup 5 >"$out/dp-1gpu.log" 2>&1
dp1=$(grep -oE 'last loss of its shard [0-9.]+' "$out/dp-1gpu.log" | awk '{print $NF}')
summary+=("1 NCCL rank vs plain training, last loss after 50 steps: $dp1 vs $plain ($([ -n "$plain" ] && [ "$dp1" = "$plain" ] && echo same || echo DIFFERENT))")

# 2. faults: a crashed rank is named; a hung rank makes rank 0's watchdog abort NCCL
t0=$(date +%s)
ERASE_FAIL_AT_STEP=1:5:abort timeout 120 "$exe" train --gpus "$n" "${common[@]}" --batch $((4096 * n)) --steps 20 \
  --collective-timeout 15 >"$out/fault-abort.log" 2>&1
summary+=("fault, rank 1 crashes at step 5: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$out/fault-abort.log" | cut -c1-160)")
t0=$(date +%s)
ERASE_FAIL_AT_STEP=1:5:hang timeout 120 "$exe" train --gpus "$n" "${common[@]}" --batch $((4096 * n)) --steps 20 \
  --collective-timeout 15 >"$out/fault-hang.log" 2>&1
summary+=("fault, rank 1 hangs at step 5: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$out/fault-hang.log" | cut -c1-200)")

# 3. throughput and NE: 1 GPU against n GPUs, early and end all-reduce (NE on EVAL
# held-out examples after the run, for the NE gap against baseline)
p90() { grep -oE 'p90 [0-9]+' "$1" | tail -1 | cut -d' ' -f2; }
p50() { grep -oE 'p50 [0-9]+' "$1" | tail -1 | cut -d' ' -f2; }
ne() { grep -oE 'NE [0-9.]+' "$1" | tail -1 | cut -d' ' -f2; }
timed=(--eval-examples "${EVAL:-200000}")
rows=()
for d in $dispatches; do
  for v in baseline detached erase; do
    one="$out/qps-1gpu-$v-$d.log"
    timeout 300 "$exe" train "${common[@]}" "${timed[@]}" --batch 4096 --variant "$v" --dispatch "$d" \
      --steps "$steps" --warmup "$warm" >"$one" 2>&1
    q1=$(p90 "$one"); m1=$(p50 "$one")
    row="$(printf '%-9s %-8s 1 GPU p50 %8s p90 %8s NE %s' "$v" "$d" "${m1:-?}" "${q1:-?}" "$(ne "$one")")"
    for ar in early end; do
      two="$out/qps-${n}gpu-$v-$d-$ar.log"
      timeout 300 "$exe" train --gpus "$n" "${common[@]}" "${timed[@]}" --batch $((4096 * n)) --variant "$v" \
        --dispatch "$d" --allreduce "$ar" --steps "$steps" --warmup "$warm" >"$two" 2>&1
      q2=$(p90 "$two"); m2=$(p50 "$two")
      eff="?"
      if [ -n "$q1" ] && [ -n "$q2" ]; then eff=$(awk -v a="$q2" -v b="$q1" -v n="$n" 'BEGIN{printf "%.1f", 100*a/(n*b)}'); fi
      row+="$(printf ' | %s GPUs %-5s p50 %8s p90 %8s (%s %%) NE %s' "$n" "$ar" "${m2:-?}" "${q2:-?}" "$eff" "$(ne "$two")")"
    done
    rows+=("$row")
  done
done

# 4. the simulator's prediction for the same sizes
"$exe" plan --preset spec --gpus "$n" >"$out/plan-${n}gpus.log" 2>&1
grep -A8 'predicted data-parallel steps' "$out/plan-${n}gpus.log"

echo
echo "== global examples/s (1 GPU: batch 4096; $n GPUs: global batch $((4096 * n)); scaling = p90($n) / ($n p90(1))) =="
for r in "${rows[@]}"; do echo "  $r"; done
echo
echo "== summary =="
for s in "${summary[@]}"; do echo "  $s"; done
