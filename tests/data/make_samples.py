#!/usr/bin/env python3
"""Writes the small CTR samples the tests read, in the layouts users have:

- criteo_floats.tsv: Criteo's TSV layout (label, I1..I13, C1..C26) with the integer
  columns written as floats, as the samples exported through pandas write them
  (`260.0`, `-1.0`, empty where missing);
- avazu_sample.csv: Avazu's CSV layout (id, click, hour, C1, banner_pos, site_*, app_*,
  device_*, C14..C21): no dense features at all;
- multihot_sample.tsv: a log whose `genres` column holds a list of any length
  (`g1|g7|g9`).

The rows are generated here (a fixed seed, labels drawn from a planted logistic
model, so a model can learn them); they are not copies of any public data set.
Run from this folder: python3 make_samples.py
"""
import math
import random

rng = random.Random(20261201)


def sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def criteo(n):
    lines = []
    for _ in range(n):
        ints = []
        z = -1.2
        for k in range(13):
            if rng.random() < 0.15:
                ints.append("")
                continue
            v = int(rng.expovariate(1 / (5 + 20 * k)))
            if k == 1 and rng.random() < 0.2:
                v = -1
            if k == 0:
                z += 0.08 * min(v, 20)
            ints.append(f"{float(v):.1f}")
        cats = []
        for j in range(26):
            if rng.random() < 0.05:
                cats.append("")
                continue
            v = int(rng.paretovariate(1.2)) % (50 + 40 * j)
            if j == 2:
                z += 1.5 if v % 3 == 0 else -0.5
            cats.append(f"{(v * 2654435761 + j * 40503) & 0xFFFFFFFF:08x}")
        y = int(rng.random() < sigmoid(z))
        lines.append("\t".join([str(y)] + ints + cats))
    return "\n".join(lines) + "\n"


AVAZU = ["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain",
         "site_category", "app_id", "app_domain", "app_category", "device_id",
         "device_ip", "device_model", "device_type", "device_conn_type",
         "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"]


def avazu(n):
    lines = [",".join(AVAZU)]
    for i in range(n):
        row = {"id": str(10_000_000_000_000_000 + 7919 * i), "hour": f"141021{rng.randint(0, 23):02d}"}
        z = -1.6
        for c in AVAZU[3:]:
            v = int(rng.paretovariate(1.3)) % 60
            if c in ("site_id", "app_id", "device_id", "device_ip", "device_model", "site_domain", "app_domain"):
                row[c] = f"{(v * 2246822519) & 0xFFFFFFFF:08x}"
            else:
                row[c] = str(v)
            if c == "banner_pos":
                z += 1.8 if v == 1 else 0.0
            if c == "site_category" and v % 2 == 0:
                z += 0.7
        row["click"] = str(int(rng.random() < sigmoid(z)))
        lines.append(",".join(row[c] for c in AVAZU))
    return "\n".join(lines) + "\n"


def multihot(n):
    lines = ["label\tuser\titem\tgenres\tprice"]
    for _ in range(n):
        genres = rng.sample(range(18), rng.randint(0, 5))
        z = -1.4 + (1.6 if 3 in genres else 0.0) + (0.9 if 7 in genres else 0.0)
        price = rng.random() * 100
        y = int(rng.random() < sigmoid(z))
        lines.append(f"{y}\tu{rng.randint(0, 300)}\ti{rng.randint(0, 800)}\t"
                     + "|".join(f"g{g}" for g in genres) + f"\t{price:.1f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    open("criteo_floats.tsv", "w").write(criteo(1500))
    open("avazu_sample.csv", "w").write(avazu(1500))
    open("multihot_sample.tsv", "w").write(multihot(2000))
