#!/usr/bin/env bash
# Builds everything the GPU checks need and puts it in one folder (default .device/):
# the erase-ctr binary, the GPU test binary, the kernel benchmark, the scripts, and the
# PyTorch anchors (scripts/torch_ctr.py and the zoo's twins). Copy the folder to a machine with an NVIDIA GPU
# (no Rust needed there) and run `bash <folder>/gpu-check.sh <folder>`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.device}"
cd "$root"
scripts/install-nvcc.sh >/dev/null
mkdir -p "$dest"
exe_of() { # the executable of target $1 that a cargo --message-format=json build reports
  # (not the crate's binaries, which cargo builds beside an integration test)
  python3 -c 'import json,sys
want=sys.argv[1]
p=[j.get("executable") for j in map(json.loads, (l for l in sys.stdin if l.startswith("{")))
   if j.get("reason")=="compiler-artifact" and j.get("target",{}).get("name")==want]
p=[x for x in p if x]
print(p[-1] if p else "")' "$1"
}
cargo build --release -j2 --bin erase-ctr
cp target/release/erase-ctr "$dest/"
t=$(cargo test --release -j2 --test gpu --no-run --message-format=json 2>/dev/null | exe_of gpu)
cp "$t" "$dest/gpu-tests"
b=$(cargo bench -j2 --bench kernels --no-run --message-format=json 2>/dev/null | exe_of kernels)
cp "$b" "$dest/kernels-bench"
cargo build --release -j2 --example mlp30 --example nanochat
cp target/release/examples/mlp30 target/release/examples/nanochat "$dest/"
strip "$dest/erase-ctr" "$dest/gpu-tests" "$dest/kernels-bench" "$dest/mlp30" "$dest/nanochat" 2>/dev/null || true
cp scripts/gpu-check.sh scripts/gpu2-check.sh scripts/nvtx-check.sh scripts/ctr-compare.sh scripts/examples-compare.sh \
  scripts/data-check.sh scripts/dp-check.sh scripts/zoo-compare.sh scripts/ab-bench.sh scripts/flags-bench.sh scripts/torch_kernels.py scripts/torch_ctr.py scripts/torch_zoo.py scripts/torch_profile.py \
  README.md "$dest/"
# the data samples and configs data-check.sh trains, and the build's name
mkdir -p "$dest/testdata" "$dest/configs"
cp tests/data/criteo_floats.tsv tests/data/avazu_sample.csv tests/data/multihot_sample.tsv "$dest/testdata/"
cp configs/*.toml "$dest/configs/"
git describe --always --dirty > "$dest/BUILD" 2>/dev/null || true
# the spec's anchors as ../shared has them, when this checkout has it beside it
for f in torch_ctr.py torch_mlp30.py; do
  if [ -f "../shared/anchors/$f" ]; then cp "../shared/anchors/$f" "$dest/"; fi
done
# MNIST for the mlp30 comparison, when this checkout has it beside it (never committed)
if [ -d ../shared/data/mnist ]; then mkdir -p "$dest/mnist" && cp ../shared/data/mnist/*-ubyte* "$dest/mnist/"; fi
du -sh "$dest"
