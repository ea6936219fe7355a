#!/usr/bin/env bash
# The model zoo (`--model dlrm|dcnv2|deepfm`) on one GPU beside its PyTorch twins
# (torch_zoo.py --compile --cuda-graph: torch.compile of every dense piece plus a
# whole-step CUDA graph), in one call, at batch 4096 (or BATCH), the same synthetic data,
# 50 warm-up + 250 timed steps, NE on 200k held-out examples. From a bundle made by
# scripts/gpu-bundle.sh. Writes every log and JSON to $OUT (default <bundle>/out) and the
# summary to $OUT/zoo-compare.json: per model, Erase's three variants (graph dispatch) and
# MFU, PyTorch's baseline and erase, and ratio_vs_torch_compile (Erase erase over the
# faster of PyTorch's two).
#   bash zoo-compare.sh [BUNDLE] [MODELS]        MODELS default "dlrm dcnv2 deepfm"
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
models="${2:-dlrm dcnv2 deepfm}"
batch="${BATCH:-4096}"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
build="$("$bundle/erase-ctr" --version 2>/dev/null | awk '{print $2}')"
[ -f "$bundle/BUILD" ] && build="$(cat "$bundle/BUILD")"
for m in $models; do
  "$bundle/erase-ctr" bench --device cuda --preset spec --model "$m" --batch "$batch" --dispatch graph \
    --warmup 50 --steps 250 --eval-examples 200000 --trace-steps 0 \
    --json "$out/zoo-erase-$m.json" 2>"$out/zoo-erase-$m.log" | tee "$out/zoo-erase-$m.txt"
  if [ -f "$bundle/torch_zoo.py" ] && python3 -c 'import torch' 2>/dev/null; then
    for v in baseline erase; do
      python3 "$bundle/torch_zoo.py" --model "$m" --variant "$v" --batch "$batch" --compile --cuda-graph \
        --json "$out/zoo-torch-$m-$v.json" >"$out/zoo-torch-$m-$v.log" 2>&1
      echo "torch_zoo $m $v: rc $? $(grep '^SUMMARY' "$out/zoo-torch-$m-$v.log" | cut -c1-300)"
    done
  fi
done
BUILD="$build" OUTDIR="$out" MODELS="$models" BATCH="$batch" python3 - <<'EOF'
import json, os, datetime
out, models = os.environ["OUTDIR"], os.environ["MODELS"].split()
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None
summary = {"batch": int(os.environ["BATCH"]), "build": os.environ.get("BUILD", ""),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "models": {}}
for m in models:
    rows = load(f"{out}/zoo-erase-{m}.json") or []
    erase = {r["variant"]: {"qps_p90": r["qps_p90"], "mfu_p90": r.get("mfu_p90"), "ne": r.get("ne")} for r in rows}
    torch = {}
    for v in ("baseline", "erase"):
        t = load(f"{out}/zoo-torch-{m}-{v}.json")
        if t:
            torch[v] = {"qps_p90": t.get("qps_p90"), "ne": t.get("ne"), "error": t.get("error")}
    best = max([t["qps_p90"] for t in torch.values() if t.get("qps_p90")] or [0])
    mine = erase.get("erase", {}).get("qps_p90")
    summary["models"][m] = {"erase": erase, "torch_compile_cuda_graph": torch,
                            "ratio_vs_torch_compile": (mine / best) if mine and best else None}
json.dump(summary, open(f"{out}/zoo-compare.json", "w"), indent=1)
print("\n== the zoo against torch.compile + CUDA graph (p90 examples/s, batch %d) ==" % summary["batch"])
for m, e in summary["models"].items():
    er = e["erase"]; t = e["torch_compile_cuda_graph"]
    fmt = lambda d, k: "%.0f" % d[k]["qps_p90"] if k in d and d[k].get("qps_p90") else "-"
    ne = lambda d, k: "%.4f" % d[k]["ne"] if k in d and d[k].get("ne") else "-"
    r = e["ratio_vs_torch_compile"]
    print("%-7s Erase baseline %s (NE %s) erase %s (NE %s, MFU %s) | torch baseline %s (NE %s) erase %s (NE %s) | ratio %s" % (
        m, fmt(er, "baseline"), ne(er, "baseline"), fmt(er, "erase"), ne(er, "erase"),
        "%.1f%%" % (100 * er["erase"]["mfu_p90"]) if er.get("erase", {}).get("mfu_p90") else "-",
        fmt(t, "baseline"), ne(t, "baseline"), fmt(t, "erase"), ne(t, "erase"),
        None if r is None else round(r, 3)))
EOF
