#!/usr/bin/env bash
# The data-parallel trainer on real data, on the CUDA devices of one host (GPUS, default
# 1), from a bundle made by scripts/gpu-bundle.sh: a Criteo-layout file trained by
# `train --gpus N --dispatch graph` through each rank's loader thread, with a periodic
# held-out evaluation and --metrics; the same run killed after its checkpoint and
# resumed, which must end with the bits of the run that never stopped; then sharded
# tables (`--sharding row` and `table`, graph and blocking dispatch, killed and resumed). Logs go to $OUT
# (default <bundle>/out-dp); a short summary is printed last.
#   bash dp-check.sh [BUNDLE] [LINES]     LINES of the Criteo file, default 400000
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
lines="${2:-400000}"
n="${GPUS:-1}"
out="${OUT:-$bundle/out-dp}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
B="$bundle/erase-ctr"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
summary=()
"$B" data --write-criteo "$work/day.tsv" --lines "$lines" 2>&1 | tail -1
dp=(train --gpus "$n" --device cuda --preset spec --data "criteo:$work/day.tsv" --dispatch graph
  --steps 80 --eval-every 40 --eval-examples 20000 --collective-timeout 120)
fnv() { grep -o 'state fnv64 [0-9a-f]*' "$1" | head -1 | awk '{print $3}'; }
"$B" "${dp[@]}" --metrics "$out/metrics.jsonl" >"$out/whole.txt" 2>"$out/whole.log"
summary+=("$n CUDA rank(s), graph dispatch, 80 steps: rc $? state $(fnv "$out/whole.txt"); $(grep -c eval_step "$out/metrics.jsonl" 2>/dev/null) evaluations and $(grep -c '"step"' "$out/metrics.jsonl" 2>/dev/null) steps in --metrics; $(grep -E 'examples/s|held-out NE' "$out/whole.txt" | tr -s ' ' | tr '\n' ';')")
ERASE_FAIL_AT_STEP=0:60 "$B" "${dp[@]}" --checkpoint "$work/dp.st" --checkpoint-every 40 \
  >"$out/killed.txt" 2>"$out/killed.log"
summary+=("killed at step 60 (after the checkpoint of step 40): rc $? (non-zero expected)")
"$B" "${dp[@]}" --resume "$work/dp.st" >"$out/resumed.txt" 2>"$out/resumed.log"
rc=$?
a=$(fnv "$out/whole.txt"); b=$(fnv "$out/resumed.txt")
verdict="DIFFERENT bits"
[ -n "$a" ] && [ "$a" = "$b" ] && verdict="the same bits"
summary+=("resumed to 80: rc $rc state $b: $verdict as the run that never stopped")
# sharded tables: with one rank it holds every row, so its lookup (ids mapped into its
# storage, the owners' exchange) and its update of the rows it holds must end with the
# bits of replicated tables; with several, each rank stores only its rows and the bits
# differ from replicated in the grouping of a row's gradient sums
sharded() { # NAME FLAGS...: one sharded run, its state against the replicated one's
  local name="$1"; shift
  "$B" "${dp[@]}" "$@" >"$out/sharded-$name.txt" 2>"$out/sharded-$name.log"
  local rc=$? c v="other bits than"
  c=$(fnv "$out/sharded-$name.txt")
  [ -n "$c" ] && [ "$c" = "$a" ] && v="the same bits as"
  summary+=("$*: rc $rc state $c: $v replicated tables; $(grep -E 'examples/s' "$out/sharded-$name.txt" | sed 's/.*: //' | tr -s ' ')")
}
for mode in row table; do
  for dispatch in graph blocking threaded; do
    sharded "$mode-$dispatch" --sharding "$mode" --dispatch "$dispatch"
  done
done
sharded table-end --sharding table --allreduce end
ERASE_FAIL_AT_STEP=0:60 "$B" "${dp[@]}" --sharding row --checkpoint "$work/sh.st" --checkpoint-every 40 \
  >"$out/sharded-killed.txt" 2>"$out/sharded-killed.log"
summary+=("--sharding row killed at step 60: rc $? (non-zero expected)")
"$B" "${dp[@]}" --sharding row --resume "$work/sh.st" >"$out/sharded-resumed.txt" 2>"$out/sharded-resumed.log"
rc=$?
c=$(fnv "$out/sharded-row-graph.txt"); d=$(fnv "$out/sharded-resumed.txt")
v="DIFFERENT bits"
[ -n "$c" ] && [ "$c" = "$d" ] && v="the same bits"
summary+=("--sharding row resumed to 80: rc $rc state $d: $v as the sharded run that never stopped")
echo
echo "== summary =="
for s in "${summary[@]}"; do echo "  $s"; done
