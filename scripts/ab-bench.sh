#!/usr/bin/env bash
# A/B of two erase-ctr builds on one GPU, alternated in one call: `bench --preset spec
# --dispatch graph` (all three variants) with build A, then B, ROUNDS times, and each
# variant's median p90 per build with the ratio B/A. What a refactor must show: B within
# the noise of A (1 %).
#   bash ab-bench.sh A_BINARY B_BINARY [ROUNDS] [BATCH]      ROUNDS default 2, BATCH 4096
# Logs and the per-run JSON go to $OUT (default ./ab-out); the summary to $OUT/ab.json.
set -u
a="$1"; b="$2"; rounds="${3:-2}"; batch="${4:-4096}"
out="${OUT:-./ab-out}"
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for side in A B; do
    bin="$a"; [ "$side" = B ] && bin="$b"
    "$bin" bench --device cuda --preset spec --batch "$batch" --dispatch graph --warmup 50 --steps 250 \
      --eval-examples 20000 --trace-steps 0 --json "$out/ab-$side-$r.json" >"$out/ab-$side-$r.txt" 2>"$out/ab-$side-$r.log"
    echo "round $r build $side: rc $?"
  done
done
OUTDIR="$out" ROUNDS="$rounds" A="$a" B="$b" python3 - <<'EOF'
import json, os, statistics
out, rounds = os.environ["OUTDIR"], int(os.environ["ROUNDS"])
res = {"A": os.environ["A"], "B": os.environ["B"], "rounds": rounds, "variants": {}}
for v in ("baseline", "detached", "erase"):
    per = {}
    for side in ("A", "B"):
        xs = []
        for r in range(1, rounds + 1):
            try:
                rows = json.load(open(f"{out}/ab-{side}-{r}.json"))
            except (OSError, ValueError):
                continue
            xs += [x["qps_p90"] for x in rows if x["variant"] == v]
        per[side] = statistics.median(xs) if xs else None
    ratio = per["B"] / per["A"] if per["A"] and per["B"] else None
    res["variants"][v] = {"A_p90": per["A"], "B_p90": per["B"], "B_over_A": ratio}
    print("%-9s A %s  B %s  B/A %s" % (v, per["A"] and round(per["A"]), per["B"] and round(per["B"]),
                                      ratio and round(ratio, 4)))
json.dump(res, open(f"{out}/ab.json", "w"), indent=1)
EOF
