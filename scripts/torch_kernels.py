#!/usr/bin/env python3
"""PyTorch's time for each benchmark that Erase's `benches/kernels.rs` ran, side by side.

    python3 scripts/torch_kernels.py ours.jsonl

Reads the JSON lines the kernel benchmark wrote (`--json FILE`), times the same work in
PyTorch on the same GPU (bf16 operands for GEMMs and attention, as the spec's mixed
precision; each GEMM with its separate epilogue), and prints both with the ratio. Each
PyTorch figure is the kernels' time: many calls replayed from one CUDA graph.
"""
import json
import sys

import torch
import torch.nn.functional as F


def timeit(fn, warmup=3, iters=20, reps=20):
    """Median µs·1e-3 of one call of fn: `reps` calls captured in one CUDA graph and
    replayed `iters` times, each replay timed with events, so that neither Python nor the
    launch reaches the figure (timed one eager call at a time, a GEMM of a few µs reads
    as the 30-60 µs of its launch path). Falls back to eager calls where capture fails."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run, per = g.replay, reps
    except RuntimeError:
        torch.cuda.synchronize()
        run, per = fn, 1
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per)
    times.sort()
    return times[len(times) // 2]


def torch_ms(t):
    dev = "cuda"
    bf = torch.bfloat16
    op = t["op"]
    if op == "gemm":
        m, n, k, kind = t["m"], t["n"], t["k"], t["kind"]
        if kind == "linear":
            x = torch.randn(m, k, device=dev, dtype=bf)
            w = torch.randn(n, k, device=dev, dtype=bf)
            b = torch.randn(n, device=dev, dtype=bf)
            return timeit(lambda: torch.matmul(x, w.t()) + b)
        if kind == "linear_add":
            # a residual connection: the fp32 residual added to the bf16 layer's output
            x = torch.randn(m, k, device=dev, dtype=bf)
            w = torch.randn(n, k, device=dev, dtype=bf)
            b = torch.randn(n, device=dev, dtype=bf)
            r = torch.randn(m, n, device=dev)
            return timeit(lambda: r + (torch.matmul(x, w.t()) + b))
        if kind == "dx":
            dy = torch.randn(m, n, device=dev, dtype=bf)
            w = torch.randn(n, k, device=dev, dtype=bf)
            return timeit(lambda: torch.matmul(dy, w))
        if kind == "dw":
            dy = torch.randn(m, n, device=dev, dtype=bf)
            x = torch.randn(m, k, device=dev, dtype=bf)
            # the weight gradient in fp32, as the spec keeps weight gradients
            return timeit(lambda: torch.matmul(dy.t(), x).float())
        a = torch.randn(m, k, device=dev, dtype=bf)
        b = torch.randn(k, n, device=dev, dtype=bf)
        return timeit(lambda: torch.matmul(a, b))
    if op == "sdpa":
        b, h, s, d = t["b"], t["h"], t["s"], t["d"]
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d, device=dev, dtype=bf)

        def fb():
            o = F.scaled_dot_product_attention(q, k, v)
            o.backward(g)

        return timeit(fb)
    if op == "embedding_bag":
        b, f, rows, d = t["b"], t["f"], t["rows"], t["d"]
        w = torch.randn(f * rows, d, device=dev)
        ids = torch.randint(0, f * rows, (b * f,), device=dev)
        offs = torch.arange(b * f, device=dev)
        return timeit(lambda: F.embedding_bag(ids, w, offs, mode="sum"))
    if op == "copy":
        x = torch.randn(t["n"], device=dev)
        y = torch.empty_like(x)
        return timeit(lambda: y.copy_(x))
    return None


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'benchmark':<58} {'erase µs':>10} {'torch µs':>10} {'torch/erase':>12}")
    out = []
    for r in rows:
        ms = torch_ms(r["torch"])
        ratio = (ms / r["ms"]) if (ms is not None and r["ms"] == r["ms"] and r["ms"] > 0) else float("nan")
        tus = f"{ms * 1e3:10.1f}" if ms is not None else f"{'-':>10}"
        print(f"{r['name']:<58} {r['ms'] * 1e3:10.1f} {tus} {ratio:12.2f}")
        out.append({**r, "torch_ms": ms})
    with open(sys.argv[1] + ".side_by_side.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
