#!/usr/bin/env bash
# Real-data checks on a GPU machine, from a bundle made by scripts/gpu-bundle.sh: the
# parse rate on 1, 2, 4, 8 and all cores against the training rate; the spec's model
# trained on a Criteo-layout file through the loader (graph dispatch), checkpointed and
# resumed; and the repository's samples (Criteo with float integers, Avazu with no dense
# features, multi-hot lists sum- and mean-pooled, mixed table sizes) trained on the GPU
# and on the CPU side by side. Logs and JSON go to $OUT (default <bundle>/out).
#   bash data-check.sh [BUNDLE] [LINES]       LINES of the Criteo file, default 4000000
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
lines="${2:-4000000}"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
B="$bundle/erase-ctr"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
summary=()

"$B" data --write-criteo "$work/day.tsv" --lines "$lines" 2>&1 | tail -1
"$B" data --data "criteo:$work/day.tsv" --threads 1,2,4,8,all --json "$out/parse.json" \
  | tee "$out/parse.txt"
summary+=("parse: $(grep -E '^ *[0-9]+ threads?' "$out/parse.txt" | sed 's/ in .*: / /' | tr '\n' ';')")

# through the loader, graph dispatch, a checkpoint every 100 steps, then a resume
"$B" train --device cuda --preset spec --data "criteo:$work/day.tsv" --steps 200 --eval-every 0 \
  --eval-examples 100000 --checkpoint "$work/k.st" --checkpoint-every 100 \
  >"$out/loader.txt" 2>"$out/loader.log"
summary+=("loader run: rc $? $(grep -E 'examples/s|NE  final' "$out/loader.txt" | tr -s ' ' | tr '\n' ';')")
"$B" train --device cuda --preset spec --data "criteo:$work/day.tsv" --steps 300 --eval-every 0 \
  --eval-examples 100000 --resume "$work/k.st" >"$out/resume.txt" 2>"$out/resume.log"
summary+=("resume to 300: rc $? $(grep -E 'NE  final' "$out/resume.txt" | tr -s ' ')")

# the samples, GPU beside CPU (the same steps; bf16 GEMMs on the GPU, so close, not equal)
run_both() { # name, args...
  local name="$1"; shift
  for dev in cuda cpu; do
    "$B" train --device "$dev" --batch 64 --rows 2000 --steps 40 --eval-every 0 --eval-examples 1000 \
      "$@" >"$out/sample-$name-$dev.txt" 2>"$out/sample-$name-$dev.log"
    local rc=$?
    summary+=("sample $name on $dev: rc $rc $(grep -E 'NE  final' "$out/sample-$name-$dev.txt" | tr -s ' ')")
  done
}
d="$bundle/testdata"
run_both criteo-floats --data "criteo:$d/criteo_floats.tsv"
run_both avazu --config "$bundle/configs/avazu.toml" --batch 64 --rows 2000 --data "tsv:$d/avazu_sample.csv"
run_both multihot-mean --config "$bundle/configs/multihot.toml" --data "tsv:$d/multihot_sample.tsv"
run_both mixed-sizes --rows 100000 --table-rows C1=3,C2=1000 --data "criteo:$d/criteo_floats.tsv"

echo
echo "== summary =="
for s in "${summary[@]}"; do echo "  $s"; done
