#!/usr/bin/env python3
"""PyTorch twins of erase-ctr's model zoo (`--model dlrm|dcnv2|deepfm`), for the speed
comparison of scripts/zoo-compare.sh.

    python3 torch_zoo.py --model {dlrm,dcnv2,deepfm} --variant {baseline,erase}
        [--compile [MODE]] [--cuda-graph] [--batch 4096 --steps 250 --warmup 50 --rows 100000]
        [--json out.json]

The data, the embedding tables and their optimizer are those of the spec's CTR anchor,
torch_ctr.py, which must lie beside this script (scripts/gpu-bundle.sh puts both into the
bundle): the same synthetic examples (26 fields, 13 dense features, the teacher), one
concatenated fp32 table with row-wise Adagrad (lr 0.01) on the touched rows, fused Adam
(lr 1e-3) on the dense parameters, GEMMs under bf16 autocast. Only the dense model differs,
and it is the one erase-ctr builds for the same name at `--preset spec` (src/model/zoo.rs):

  dlrm    bottom 13-256-128-64 (a block), dot interaction of the 26 fields and the bottom's
          output (351 pairs), concatenated with the bottom's output, top 415-512-256-1.
  dcnv2   embedding dim 128; bottom 13-512-256-128 (a block); three low-rank cross layers
          x_{l+1} = x0 * (V_l(U_l x_l) + c_l) + x_l of rank 512 over the 27 x 128 features (a
          block); top 3456-1024-1024-512-256-1.
  deepfm  the dense features projected to one more field (Linear 13-64); first-order term
          Linear(1728, 1); FM second-order term (the sum of the 351 pairwise dots); the deep
          MLP 1728-1024-512 (a block) and Linear(512, 1); the logit is their sum.

Variants. baseline: one graph, the main BCE loss. erase: each block's output is detached
where the rest of the model reads it and gets a head Linear(width, 1) + BCE (weight 1); the
block's forward and backward run on a side stream of their own, right after its forward,
while the main stream goes on (the schedule torch_ctr.py's docstring explains). With
--compile each dense piece is one torch.compile graph (the baseline's forward and loss; each
block with its head and loss; the rest of the model with the main loss); with --cuda-graph
the whole step is captured into one CUDA graph after 3 eager steps.

Reports p50/p90 examples/s from CUDA events around each step, and NE and AUC on 200k
held-out examples after the warm-up and timed steps; the last line is `SUMMARY {json}`.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import torch_ctr as anchor  # noqa: E402 - the spec's anchor: data and shared helpers
except ImportError as e:
    raise SystemExit(f"torch_zoo.py needs torch_ctr.py beside it ({e}); scripts/gpu-bundle.sh copies it")

NUM_DENSE = anchor.NUM_DENSE
NUM_SPARSE = anchor.NUM_SPARSE


lin = anchor.lin  # Linear with the anchor's init (uniform ±1/sqrt(in), zero bias)


def mlp(dims, last_relu):
    return anchor.MLP(dims, last_relu=last_relu)


def pairwise(E, idx):
    """The dots of every pair i < j of E's fields, [B, F(F-1)/2]."""
    return torch.bmm(E, E.transpose(1, 2)).flatten(1).index_select(1, idx)


def pair_index(fields, device):
    li, lj = torch.triu_indices(fields, fields, offset=1)
    return (li * fields + lj).to(torch.int64).to(device)


class Dlrm(nn.Module):
    dim = 64

    def __init__(self, device):
        super().__init__()
        d = self.dim
        self.bottom = mlp([NUM_DENSE, 256, 128, d], True)
        self.register_buffer("idx", pair_index(NUM_SPARSE + 1, device), persistent=False)
        pairs = self.idx.numel()
        self.top = mlp([pairs + d, 512, 256, 1], False)
        self.blocks = ["bottom"]
        self.head_in = {"bottom": d}

    def block(self, name, x):
        return self.bottom(x["dense"])

    def rest(self, pooled, outs):
        b = outs["bottom"]
        E = torch.cat([pooled, b.unsqueeze(1)], 1)
        z = torch.cat([pairwise(E, self.idx), b], 1)
        return self.top(z).squeeze(1)


class DcnV2(nn.Module):
    dim = 128

    def __init__(self, device, rank=512, layers=3):
        super().__init__()
        d = self.dim
        width = (NUM_SPARSE + 1) * d
        self.bottom = mlp([NUM_DENSE, 512, 256, d], True)
        self.U = nn.ModuleList([lin(width, rank) for _ in range(layers)])
        self.V = nn.ModuleList([lin(rank, width) for _ in range(layers)])
        self.top = mlp([width, 1024, 1024, 512, 256, 1], False)
        self.blocks = ["bottom", "cross"]
        self.head_in = {"bottom": d, "cross": width}

    def block(self, name, x):
        if name == "bottom":
            return self.bottom(x["dense"])
        x0 = torch.cat([x["pooled"], x["bottom"].unsqueeze(1)], 1).flatten(1)
        xl = x0
        for U, V in zip(self.U, self.V):
            xl = x0 * V(U(xl)) + xl
        return xl

    def rest(self, pooled, outs):
        return self.top(outs["cross"]).squeeze(1)


class DeepFm(nn.Module):
    dim = 64

    def __init__(self, device):
        super().__init__()
        d = self.dim
        fields = NUM_SPARSE + 1
        self.proj = lin(NUM_DENSE, d)
        self.register_buffer("idx", pair_index(fields, device), persistent=False)
        self.first = lin(fields * d, 1)
        self.deep = mlp([fields * d, 1024, 512], True)
        self.out = lin(512, 1)
        self.blocks = ["deep"]
        self.head_in = {"deep": 512}

    def fields(self, pooled, dense):
        return torch.cat([pooled, self.proj(dense).unsqueeze(1)], 1)

    def block(self, name, x):
        return self.deep(x["E"].flatten(1))

    def rest(self, pooled, outs):
        E = outs["E"]
        fm = self.first(E.flatten(1)).squeeze(1) + pairwise(E, self.idx).sum(1)
        return fm + self.out(outs["deep"]).squeeze(1)


MODELS = {"dlrm": Dlrm, "dcnv2": DcnV2, "deepfm": DeepFm}


class ZooTrainer:
    EMB_LR = 0.01
    EMB_EPS = 1e-8

    def __init__(self, model, variant, device, rows, batch, seed, graph=False, compile_mode=None):
        self.variant, self.device, self.B = variant, device, batch
        self.hot = 1  # one id per field (torch_ctr.evaluate reads it)
        torch.manual_seed(seed)
        self.model = MODELS[model](device).to(device)
        m = self.model
        self.dim = m.dim
        self.heads = nn.ModuleDict({n: lin(m.head_in[n], 1) for n in m.blocks}).to(device) \
            if variant != "baseline" else None
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        nrows = NUM_SPARSE * rows
        bound = 1.0 / math.sqrt(rows)
        self.W = torch.empty(nrows, self.dim, device=device).uniform_(-bound, bound, generator=g)
        self.acc = torch.zeros(nrows, device=device)
        self.G = torch.zeros(nrows, self.dim, device=device)
        self.offsets = torch.arange(0, batch * NUM_SPARSE, dtype=torch.int64, device=device)
        self.params = list(m.parameters()) + (list(self.heads.parameters()) if self.heads else [])
        self.opt = torch.optim.Adam(self.params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True,
                                    capturable=graph)
        self.streams = {n: torch.cuda.Stream(device=device) for n in m.blocks} if variant == "erase" else {}
        wrap = (lambda f: f) if compile_mode is None else \
            (lambda f: torch.compile(f, mode=compile_mode, dynamic=False, fullgraph=True))

        def autocast():
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        self.autocast = autocast

        def base_fwd(pooled, dense, label):
            with autocast():
                logit = self.logit(pooled, dense)
            return F.binary_cross_entropy_with_logits(logit.float(), label)

        def block_fwd(name):
            def f(x, label):
                with autocast():
                    o = m.block(name, x)
                    h = self.heads[name](o).squeeze(1)
                return o, F.binary_cross_entropy_with_logits(h.float(), label)
            return f

        def rest_fwd(pooled, outs, label):
            with autocast():
                logit = m.rest(pooled, outs)
            return F.binary_cross_entropy_with_logits(logit.float(), label)

        def fields_fwd(pooled, dense):
            with autocast():
                return m.fields(pooled, dense)

        self.base_fwd = wrap(base_fwd)
        self.block_fwd = {n: wrap(block_fwd(n)) for n in m.blocks}
        self.rest_fwd = wrap(rest_fwd)
        self.fields_fwd = wrap(fields_fwd) if hasattr(m, "fields") else None

    def logit(self, pooled, dense):
        """The whole model, undetached (baseline's forward and prediction)."""
        m = self.model
        outs = {"dense": dense, "pooled": pooled}
        if hasattr(m, "fields"):
            outs["E"] = m.fields(pooled, dense)
        for n in m.blocks:
            outs[n] = m.block(n, outs)
        return m.rest(pooled, outs)

    def lookup(self, ids, B):
        with torch.no_grad():
            offsets = self.offsets if B == self.B else \
                torch.arange(0, B * NUM_SPARSE, dtype=torch.int64, device=self.device)
            return F.embedding_bag(ids, self.W, offsets, mode="sum").view(B, NUM_SPARSE, self.dim)

    def forward_backward(self, ids, dense, label):
        m = self.model
        B = dense.shape[0]
        pooled = self.lookup(ids, B)
        if self.variant == "baseline":
            pooled.requires_grad_()
            main = self.base_fwd(pooled, dense, label)
            main.backward()
            return main.detach(), pooled.grad
        # erase: blocks in order, each on its own stream; the rest on the main stream
        M = torch.cuda.current_stream(self.device)
        leaves = []  # every leaf that stands for the pooled bags (or deepfm's fields E)

        def leaf(t):
            x = t.detach().requires_grad_()
            leaves.append(x)
            return x
        E = None
        if self.fields_fwd is not None:  # deepfm: E's gradient is summed, then run through proj
            pooled.requires_grad_()
            E = self.fields_fwd(pooled, dense)
        outs = {"dense": dense}
        for n in m.blocks:
            S = self.streams[n]
            S.wait_stream(M)
            with torch.cuda.stream(S):
                x = dict(outs)
                if E is not None:
                    x["E"] = leaf(E)
                else:
                    x["pooled"] = leaf(pooled)
                o, aux = self.block_fwd[n](x, label)
            M.wait_stream(S)
            with torch.cuda.stream(S):
                aux.backward()
            outs[n] = o.detach()
        if E is not None:
            outs["E"] = leaf(E)
            main = self.rest_fwd(None, outs, label)
        else:
            main = self.rest_fwd(leaf(pooled), outs, label)
        main.backward()
        for S in self.streams.values():
            M.wait_stream(S)
        grads = [x.grad for x in leaves if x.grad is not None]
        g = grads[0]
        for x in grads[1:]:
            g = g + x
        if E is not None:
            E.backward(g)
            return main.detach(), pooled.grad
        return main.detach(), g

    def emb_update(self, ids, gbag):
        vals = gbag.reshape(-1, self.dim)
        G = self.G
        G.index_add_(0, ids, vals)
        g = G.index_select(0, ids)
        st = self.acc.index_select(0, ids) + g.pow(2).mean(1)
        self.acc.index_copy_(0, ids, st)
        w = self.W.index_select(0, ids) - self.EMB_LR * g / (st.sqrt() + self.EMB_EPS).unsqueeze(1)
        self.W.index_copy_(0, ids, w)
        G.index_fill_(0, ids, 0.0)

    def train_step(self, ids, dense, label):
        self.opt.zero_grad(set_to_none=True)
        main, gbag = self.forward_backward(ids, dense, label)
        self.emb_update(ids, gbag)
        self.opt.step()
        return main

    @torch.no_grad()
    def predict(self, ids, dense):
        pooled = self.lookup(ids, dense.shape[0])
        with self.autocast():
            return self.logit(pooled, dense).float()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--variant", choices=["baseline", "erase"], required=True)
    ap.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                    help="torch.compile each dense piece (MODE: default, max-autotune-no-cudagraphs, ...)")
    ap.add_argument("--cuda-graph", action="store_true", help="capture the whole step in one CUDA graph")
    ap.add_argument("--steps", type=int, default=250, help="timed steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=100_000, help="rows per embedding table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=200_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_zoo.py measures on a CUDA device; none is visible")
    t_start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    def log(msg):
        print(f"[torch_zoo {args.model} {args.variant} {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    anchor.rng_selftest(device)
    data = anchor.SyntheticCTR(args.rows, args.data_seed, device)
    total = args.warmup + args.steps
    batches = [data.examples(1, s * args.batch, args.batch) for s in range(total)]
    ev = data.examples(2, 0, args.eval_n)
    del data
    log(f"data ready: {total} batches, eval {args.eval_n}")
    tr = ZooTrainer(args.model, args.variant, device, args.rows, args.batch, args.seed,
                    graph=args.cuda_graph, compile_mode=args.compile)
    losses = torch.zeros(total, device=device)
    if args.cuda_graph:
        cap = torch.cuda.Stream(device=device)
        static = {k: v.clone() for k, v in batches[0].items()}

        def load(s):
            for k, v in batches[s].items():
                static[k].copy_(v, non_blocking=True)
        n_eager = min(3, total)
        cap.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(cap):
            for s in range(n_eager):
                load(s)
                losses[s].copy_(tr.train_step(**static))
        torch.cuda.current_stream(device).wait_stream(cap)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=cap):
            static_loss = tr.train_step(**static)
        torch.cuda.synchronize(device)
        log("captured the step into one CUDA graph")

        def step(s):
            load(s)
            graph.replay()
            losses[s].copy_(static_loss)
        first = n_eager
    else:
        def step(s):
            losses[s].copy_(tr.train_step(**batches[s]))
        first = 0
    for s in range(first, args.warmup):
        step(s)
    torch.cuda.synchronize(device)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    evs[0].record()
    for i in range(args.steps):
        step(args.warmup + i)
        evs[i + 1].record()
    torch.cuda.synchronize(device)
    tms = [evs[i].elapsed_time(evs[i + 1]) for i in range(args.steps)]
    qps = [args.batch / (t / 1e3) for t in tms]
    out = {"script": "torch_zoo.py", "model": args.model, "variant": args.variant, "compile": args.compile,
           "cuda_graph": bool(args.cuda_graph), "batch": args.batch, "steps": args.steps,
           "warmup": args.warmup, "rows": args.rows, "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device),
           "dense_params": sum(p.numel() for p in tr.params),
           "step_ms_p50": anchor.pct(tms, 50), "qps_p50": anchor.pct(qps, 50), "qps_p90": anchor.pct(qps, 90),
           "qps_mean": args.steps * args.batch / (sum(tms) / 1e3)}
    ls = losses.cpu().numpy()
    out["nonfinite_loss"] = not bool(np.isfinite(ls).all())
    out["final_train_loss_mean_last10"] = float(ls[-10:].mean())
    out.update(anchor.evaluate(tr, ev))
    log(f"p90 {out['qps_p90']:.0f} ex/s, NE {out['ne']:.5f}, AUC {out['auc']:.5f}")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json)
    print("SUMMARY " + json.dumps({k: out[k] for k in ("model", "variant", "compile", "cuda_graph", "qps_p50",
                                                     "qps_p90", "ne", "auc")}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - leave a JSON that says what failed
        if "--json" in sys.argv:
            i = sys.argv.index("--json")
            if i + 1 < len(sys.argv):
                with open(sys.argv[i + 1], "w") as f:
                    json.dump({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, f)
        raise
