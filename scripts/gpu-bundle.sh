#!/usr/bin/env bash
# Builds everything the GPU checks need and puts it in one folder (default .device/):
# the erase-ctr binary, the GPU test binary, the kernel benchmark, the scripts, and the
# PyTorch anchor if ../shared has it. Copy the folder to a machine with an NVIDIA GPU
# (no Rust needed there) and run `bash <folder>/gpu-check.sh <folder>`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.device}"
cd "$root"
scripts/install-nvcc.sh >/dev/null
mkdir -p "$dest"
exe_of() { # the executable a cargo --message-format=json build reports last
  python3 -c 'import json,sys
p=[json.loads(l).get("executable") for l in sys.stdin if l.startswith("{")]
p=[x for x in p if x]
print(p[-1] if p else "")'
}
cargo build --release -j2 --bin erase-ctr
cp target/release/erase-ctr "$dest/"
t=$(cargo test --release -j2 --test gpu --no-run --message-format=json 2>/dev/null | exe_of)
cp "$t" "$dest/gpu-tests"
b=$(cargo bench -j2 --bench kernels --no-run --message-format=json 2>/dev/null | exe_of)
cp "$b" "$dest/kernels-bench"
strip "$dest/erase-ctr" "$dest/gpu-tests" "$dest/kernels-bench" 2>/dev/null || true
cp scripts/gpu-check.sh scripts/gpu2-check.sh scripts/ctr-compare.sh scripts/torch_kernels.py "$dest/"
if [ -f ../shared/anchors/torch_ctr.py ]; then cp ../shared/anchors/torch_ctr.py "$dest/"; fi
du -sh "$dest"
