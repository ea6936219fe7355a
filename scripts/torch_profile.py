#!/usr/bin/env python3
"""Where PyTorch's step spends its GPU time: the kernels of one of the PyTorch twins
(the spec's CTR model from torch_ctr.py, or a zoo model from torch_zoo.py), compiled as
the anchor compiles them, summed over a few profiled steps after warm-up.

    python3 torch_profile.py --model spec|dcnv2|dlrm|deepfm [--variant baseline|erase]
        [--batch 4096] [--compile default] [--steps 5] [--top 40]

Prints the kernels longest first (µs a step, launches a step, share of the step's kernel
time) and the step's total kernel time: the figures to set beside `erase-ctr bench
--kernels N` of the same model. No CUDA graph (the profiler sees the same kernels either
way; their launch gaps are not counted).
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_ctr as anchor  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="spec")
    ap.add_argument("--variant", default="baseline", choices=["baseline", "erase"])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--compile", default="default", help="torch.compile mode, or 'none' for eager")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_profile.py profiles a CUDA device; none is visible")
    device = torch.device("cuda", torch.cuda.current_device())
    mode = None if args.compile == "none" else args.compile
    data = anchor.SyntheticCTR(args.rows, 0, device)
    n = args.warmup + args.steps
    batches = [data.examples(1, s * args.batch, args.batch) for s in range(n)]
    del data
    if args.model == "spec":
        tr = anchor.Trainer(args.variant, "blocking", device, args.rows, args.batch, 0,
                            compile_mode=mode)
    else:
        import torch_zoo
        tr = torch_zoo.ZooTrainer(args.model, args.variant, device, args.rows, args.batch, 0,
                                  compile_mode=mode)
    for s in range(args.warmup):
        tr.train_step(**batches[s])
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in range(args.warmup, n):
            tr.train_step(**batches[s])
        torch.cuda.synchronize(device)
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "device_time", None)
        if us is None:
            us = e.cuda_time
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += us
        r[1] += 1
    total = sum(r[0] for r in rows.values()) / args.steps
    print(f"torch {args.model} {args.variant} batch {args.batch} compile {args.compile}: "
          f"kernels add up to {total:.1f} µs a step ({args.steps} steps profiled)")
    for name, (us, k) in sorted(rows.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {us / args.steps:8.1f} µs {k / args.steps:5.1f}x {100 * us / args.steps / total:5.1f}%  "
              f"{name[:150]}")


if __name__ == "__main__":
    main()
