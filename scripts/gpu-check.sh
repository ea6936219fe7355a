#!/usr/bin/env bash
# Erase's GPU checks, from a bundle made by scripts/gpu-bundle.sh: the GPU test suite
# (sm_90a PTX, then the sm_80 PTX forced), compute-sanitizer memcheck and racecheck on
# the GEMM, attention and embedding-bag tests, the kernel benchmarks beside PyTorch's.
# Writes logs to $OUT (default <bundle>/out) and prints a short table last.
#   bash gpu-check.sh [BUNDLE] [--quick]
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
quick="${2:-}"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
export ERASE_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
summary=()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"

run_tests() { # label, env..., args...
  local label="$1"; shift
  env "$@" "$bundle/gpu-tests" --test-threads=1 --nocapture >"$out/tests-$label.log" 2>&1
  local rc=$?
  local ran passed failed
  ran=$(grep -o 'gpu test ran: ' "$out/tests-$label.log" | wc -l)
  passed=$(grep -oE '[0-9]+ passed' "$out/tests-$label.log" | tail -1)
  failed=$(grep -oE '[0-9]+ failed' "$out/tests-$label.log" | tail -1)
  grep -E 'panicked|FAILED|^test .* \.\.\. FAILED' "$out/tests-$label.log" | head -20
  summary+=("tests $label: rc $rc, $ran GPU tests ran, ${passed:-? passed}, ${failed:-? failed}")
}
run_tests sm90a ERASE_PTX=sm90a
run_tests sm80 ERASE_PTX=sm80


"$bundle/kernels-bench" --json "$out/kernels.jsonl" $quick >"$out/bench.log" 2>&1
summary+=("kernel benchmark: rc $?")
cat "$out/bench.log"
if python3 -c 'import torch' 2>/dev/null; then
  python3 "$bundle/torch_kernels.py" "$out/kernels.jsonl" >"$out/side_by_side.log" 2>&1
  summary+=("torch side by side: rc $?")
  cat "$out/side_by_side.log"
fi

if command -v compute-sanitizer >/dev/null && [ "$quick" != "--quick" ]; then
  for tool in memcheck racecheck; do
    ERASE_GPU_TEST_SMALL=1 timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$bundle/gpu-tests" --test-threads=1 sanitize >"$out/sanitizer-$tool.log" 2>&1
    rc=$?
    errs=$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$out/sanitizer-$tool.log" | tail -1)
    summary+=("compute-sanitizer $tool: rc $rc, ${errs:-no summary}")
  done
fi

echo
echo "== summary =="
for s in "${summary[@]}"; do echo "  $s"; done
