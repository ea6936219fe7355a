#!/usr/bin/env bash
# The paper's two other experiments on the GPU, from a bundle made by scripts/gpu-bundle.sh:
# mlp30 (30 layers of 1024 on MNIST, batch 256) in the three modes beside torch_mlp30.py
# (when the bundle has it and PyTorch is installed), and nanochat's measured timeline.
#   bash examples-compare.sh [BUNDLE]        # MNIST in BUNDLE/mnist, or MNIST=PATH
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
out="${OUT:-$bundle/out}"
mnist="${MNIST:-$bundle/mnist}"
mkdir -p "$out"
"$bundle/mlp30" --device cuda --data "$mnist" --width 1024 --layers 30 --batch 256 \
  --mode conventional,detached,erase --steps 200 --warmup 30 --log-every 50 \
  >"$out/mlp30.log" 2>&1
echo "mlp30: rc $?"; tail -6 "$out/mlp30.log"
if [ -f "$bundle/torch_mlp30.py" ] && python3 -c 'import torch' 2>/dev/null; then
  python3 "$bundle/torch_mlp30.py" --steps 200 --warmup 30 --json "$out/torch-mlp30.json" \
    >"$out/torch-mlp30.log" 2>&1
  echo "torch_mlp30: rc $?"; tail -12 "$out/torch-mlp30.log"
fi
# nanochat at GPU sizes (6 blocks of width 512, 8 heads of 64, 1024 tokens, 16 sequences):
# the ERASE schedule with the occupancy rule (the attention backward runs alone) and without
for occ in on off; do
  "$bundle/nanochat" --device cuda --text "$bundle/README.md" --steps 30 --log-every 10 \
    --seq 1024 --width 512 --heads 8 --layers 6 --batch 16 --occupancy "$occ" \
    --timeline "$out/nanochat-occupancy-$occ.svg" --trace "$out/nanochat-occupancy-$occ.json" \
    >"$out/nanochat-occupancy-$occ.log" 2>&1
  echo "nanochat occupancy $occ: rc $?"; grep -E "measured|attention|median step|loss " "$out/nanochat-occupancy-$occ.log" | tail -10
done
"$bundle/nanochat" --device cuda --text "$bundle/README.md" --steps 30 --log-every 10 \
  --seq 1024 --width 512 --heads 8 --layers 6 --batch 16 --schedule serial >"$out/nanochat-serial.log" 2>&1
echo "nanochat serial: rc $?"; grep -E "median step" "$out/nanochat-serial.log"
