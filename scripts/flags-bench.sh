#!/usr/bin/env bash
# Sets of erase-ctr flags against each other on one GPU, alternated in one call: for each
# batch, `bench --preset spec` with every flag set in turn, ROUNDS times, then each set's
# median p90 per variant and dispatch, and its ratio to the first set. How a switch is
# chosen by measurement: the sets alternate, so drift hits all of them alike.
#   bash flags-bench.sh BINARY ROUNDS "BATCHES" "DISPATCHES" "FLAGS_1" "FLAGS_2" ...
#   e.g. bash flags-bench.sh ./erase-ctr 2 "4096 16384" graph,blocking \
#          "--stream-priorities ranked" "--stream-priorities flat"
# Logs and the per-run JSON go to $OUT (default ./flags-out); the summary to
# $OUT/flags.json.
set -u
if [ $# -lt 5 ]; then
  echo "usage: flags-bench.sh BINARY ROUNDS \"BATCHES\" \"DISPATCHES\" \"FLAGS_1\" [\"FLAGS_2\" ...]" >&2
  exit 2
fi
bin="$1"; rounds="$2"; batches="$3"; dispatches="$4"; shift 4
out="${OUT:-./flags-out}"
mkdir -p "$out"
n=$#
for batch in $batches; do
  for r in $(seq 1 "$rounds"); do
    k=0
    for flags in "$@"; do
      k=$((k + 1))
      tag="b$batch-s$k-r$r"
      # shellcheck disable=SC2086
      "$bin" bench --device cuda --preset spec --batch "$batch" --dispatch "$dispatches" --warmup 50 \
        --steps 250 --eval-examples 20000 --trace-steps 0 $flags --json "$out/$tag.json" \
        >"$out/$tag.txt" 2>"$out/$tag.log"
      echo "batch $batch round $r set $k ($flags): rc $?"
    done
  done
done
OUTDIR="$out" ROUNDS="$rounds" BATCHES="$batches" NSETS="$n" SETS="$(printf '%s\n' "$@")" python3 - <<'EOF'
import json, os, statistics
out, rounds, nsets = os.environ["OUTDIR"], int(os.environ["ROUNDS"]), int(os.environ["NSETS"])
sets = os.environ["SETS"].split("\n")[:nsets]
res = {"sets": sets, "rounds": rounds, "batches": {}}
for batch in os.environ["BATCHES"].split():
    rows = {}
    for k in range(1, nsets + 1):
        for r in range(1, rounds + 1):
            try:
                runs = json.load(open(f"{out}/b{batch}-s{k}-r{r}.json"))
            except (OSError, ValueError):
                continue
            for x in runs:
                rows.setdefault((x["variant"], x["dispatch"]), {}).setdefault(k, []).append(x["qps_p90"])
    table = []
    for (v, d), per in sorted(rows.items()):
        first = statistics.median(per[1]) if 1 in per else None
        line = {"variant": v, "dispatch": d, "sets": []}
        for k in range(1, nsets + 1):
            xs = per.get(k, [])
            m = statistics.median(xs) if xs else None
            line["sets"].append({"runs": xs, "p90": m, "over_first": m / first if m and first else None})
        table.append(line)
        print("batch %s %-9s %-9s " % (batch, v, d) + "  ".join(
            "set%d %s (%s)" % (k + 1, s["p90"] and round(s["p90"]), s["over_first"] and round(s["over_first"], 4))
            for k, s in enumerate(line["sets"])))
    res["batches"][batch] = table
json.dump(res, open(f"{out}/flags.json", "w"), indent=1)
EOF
