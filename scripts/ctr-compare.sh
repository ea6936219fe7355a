#!/usr/bin/env bash
# The spec's CTR model on one GPU beside the PyTorch anchor in its strongest quick form,
# `torch_ctr.py --compile --cuda-graph` (torch.compile of every dense piece plus a
# whole-step CUDA graph), in one call, at batch 4096 and 16384. From a bundle made by
# scripts/gpu-bundle.sh (which copies torch_ctr.py into it when ../shared has it).
# Same rows (100000 a table), 50 warm-up + 250 timed steps, QPS from events on the main
# stream after each step's final join, NE after the 300 steps on 200k held-out examples.
# Writes every log and JSON to $OUT (default <bundle>/out) and the summary to
# $OUT/ctr-compare.json: per batch, every variant's p90 for both systems, Erase's MFU,
# and ratio_vs_torch_compile (Erase erase, graph dispatch, over the faster of PyTorch's
# compiled baseline and erase).
#   bash ctr-compare.sh [BUNDLE] [BATCHES]        BATCHES default "4096 16384"
#   MAX_AUTOTUNE=1 bash ctr-compare.sh ...        also --compile max-autotune-no-cudagraphs
#                                                 (about 9 minutes to compile on an H200)
#   SUMMARY_ONLY=1 bash ctr-compare.sh ...        no runs: the summary of the runs already
#                                                 in $OUT (batches run by separate calls)
#   DISPATCH=graph bash ctr-compare.sh ...        Erase's dispatch modes (default
#                                                 graph,blocking; the ratio is graph's)
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
batches="${2:-4096 16384}"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
build="$("$bundle/erase-ctr" --version 2>/dev/null | awk '{print $2}')"
[ -f "$bundle/BUILD" ] && build="$(cat "$bundle/BUILD")"
for b in $batches; do
  [ "${SUMMARY_ONLY:-0}" = 1 ] && break
  "$bundle/erase-ctr" bench --device cuda --preset spec --batch "$b" --dispatch "${DISPATCH:-graph,blocking}" \
    --warmup 50 --steps 250 --eval-examples 200000 --trace-steps 0 \
    --json "$out/erase-$b.json" 2>"$out/erase-$b.log" | tee "$out/erase-$b.txt"
  if [ -f "$bundle/torch_ctr.py" ] && python3 -c 'import torch' 2>/dev/null; then
    for v in baseline erase; do
      python3 "$bundle/torch_ctr.py" --variant "$v" --batch "$b" --compile --cuda-graph \
        --json "$out/torch-compile-$v-$b.json" >"$out/torch-compile-$v-$b.log" 2>&1
      echo "torch --compile --cuda-graph $v batch $b: rc $? $(grep '^SUMMARY' "$out/torch-compile-$v-$b.log" | cut -c1-300)"
      if [ "${MAX_AUTOTUNE:-0}" = 1 ] && [ "$b" = 4096 ]; then
        python3 "$bundle/torch_ctr.py" --variant "$v" --batch "$b" --compile max-autotune-no-cudagraphs \
          --cuda-graph --json "$out/torch-autotune-$v-$b.json" >"$out/torch-autotune-$v-$b.log" 2>&1
        echo "torch max-autotune $v batch $b: rc $?"
      fi
    done
  fi
done
BUILD="$build" OUTDIR="$out" BATCHES="$batches" python3 - <<'EOF'
import json, os, datetime
out, batches = os.environ["OUTDIR"], os.environ["BATCHES"].split()
summary = {}
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None
for b in batches:
    rows = load(f"{out}/erase-{b}.json") or []
    erase = {f"{r['variant']}_{r['dispatch']}": r["qps_p90"] for r in rows}
    mfu = {f"{r['variant']}_{r['dispatch']}": r.get("mfu_p90") for r in rows}
    ne = {f"{r['variant']}_{r['dispatch']}": r.get("ne") for r in rows}
    torch = {}
    for kind in ("compile", "autotune"):
        for v in ("baseline", "erase"):
            t = load(f"{out}/torch-{kind}-{v}-{b}.json")
            if t:
                torch[f"{v}_{kind}"] = {"qps_p90": t.get("qps_p90"), "ne": t.get("ne")}
    best = max([torch[k]["qps_p90"] for k in torch if k.endswith("_compile") and torch[k]["qps_p90"]] or [0])
    mine = erase.get("erase_graph")
    entry = {
        "erase_p90": erase, "erase_mfu_p90": mfu, "erase_ne": ne, "torch": torch,
        "ratio_vs_torch_compile": (mine / best) if mine and best else None,
        "build": os.environ.get("BUILD", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    auto = [torch[k]["qps_p90"] for k in torch if k.endswith("_autotune") and torch[k]["qps_p90"]]
    if auto and mine:
        entry["ratio_vs_torch_max_autotune"] = mine / max(auto)
    summary[f"batch_{b}"] = entry
json.dump(summary, open(f"{out}/ctr-compare.json", "w"), indent=1)
print("\n== Erase against torch.compile + CUDA graph (p90 examples/s) ==")
for k, e in summary.items():
    r = e["ratio_vs_torch_compile"]
    m = e["erase_mfu_p90"].get("erase_graph")
    ts = ", ".join("%s %.0f" % (n, t["qps_p90"]) for n, t in e["torch"].items() if t["qps_p90"])
    print("%s: Erase erase/graph %.0f, torch %s; ratio %s, MFU %s %%" % (
        k, e["erase_p90"].get("erase_graph", 0), ts,
        None if r is None else round(r, 3), None if m is None else round(100 * m, 1)))
EOF
