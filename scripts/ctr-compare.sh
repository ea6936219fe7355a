#!/usr/bin/env bash
# The spec's CTR model on the GPU beside the PyTorch anchor, in one call, from a bundle
# made by scripts/gpu-bundle.sh (which copies torch_ctr.py into it when ../shared has it).
# Same batch (4096), rows (100000), 50 warm-up + 250 timed steps, QPS from events on the
# main stream after each step's final join, NE after 300 steps on 200k held-out examples.
#   bash ctr-compare.sh [BUNDLE]
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
for side in 4 6; do
  "$bundle/erase-ctr" bench --device cuda --preset spec --dispatch blocking,threaded,graph \
    --warmup 50 --steps 250 --side-streams "$side" --eval-examples 200000 \
    --json "$out/erase-bench-side$side.json" 2>"$out/erase-bench-side$side.log" | tee "$out/erase-bench-side$side.txt"
done
if [ -f "$bundle/torch_ctr.py" ] && python3 -c 'import torch' 2>/dev/null; then
  run() { # name, args...
    local name="$1"; shift
    python3 "$bundle/torch_ctr.py" "$@" --json "$out/torch-$name.json" >"$out/torch-$name.log" 2>&1
    echo "torch $name: rc $? $(grep '^SUMMARY' "$out/torch-$name.log" | cut -c1-400)"
  }
  run baseline-graph --variant baseline --cuda-graph
  run detached-graph --variant detached --cuda-graph
  run erase-graph --variant erase --cuda-graph
fi
