"""CPU time of the pooled DynamiQ codec against MXFP8 and the span design, one run.

On ``--numel`` values of real gradients (the ``lm`` family's eval rows, concatenated), the
native CPU kernels (``backend="cpu"``): the encode, decode and fused reduce of
``mxfp8_e4m3``, of the default ``dynamiq`` with its prologue's result in the context (pooled
budgets), and of the span design; and the prologue's local work (the per-span demand over the
whole buffer, and the budgets from it). Times are the minimum of ``--iters`` interleaved
runs; ratios are to MXFP8's reduce, and each operation's to MXFP8's same operation.

    python benchmarks/dynamiq_pool_speed.py --numel 16777216
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from dynamiq import kernels
from dynamiq.codecs import HopContext, get_codec
from dynamiq.codecs import _dynamiq_pool as pool
from dynamiq.collectives.handshake import local_prologues
from dynamiq.data import load_gradients


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = load_gradients("eval", 16, progress=False).reshape(-1)
    n = args.numel
    x, local = g[:n].contiguous(), g[n : 2 * n].contiguous()
    dq = get_codec("dynamiq")
    span = get_codec({"id": "dynamiq", "pooling": "span", "span": 65536, "super_group": 1024})
    mx = get_codec("mxfp8_e4m3")
    shared = local_prologues(dq, [x, local])[0][0]
    ctx = HopContext(shared=shared)
    payloads = {
        "mxfp8_e4m3": (mx, kernels.encode(mx, x, HopContext(), backend="cpu"), HopContext()),
        "dynamiq": (dq, kernels.encode(dq, x, ctx, backend="cpu"), ctx),
        "dynamiq span design": (
            span,
            kernels.encode(span, x, HopContext(), backend="cpu"),
            HopContext(),
        ),
    }
    regions = pool.regions_of(dq, n, None)

    def prologue_local() -> None:
        stats = pool.span_statistics(dq, x, 0, regions)
        p = pool.shared_from_statistics(dq, stats, n, 2, regions)[pool.SHARED_KEY]
        pool.span_budgets(p, dq.bits, dq.balance)

    jobs: dict[str, Callable[[], object]] = {}
    for name, (c, p, k) in payloads.items():
        jobs[f"{name} encode"] = lambda c=c, k=k: kernels.encode(c, x, k, backend="cpu")
        jobs[f"{name} decode"] = lambda c=c, p=p, k=k: kernels.decode(c, p, n, k, backend="cpu")
        jobs[name] = lambda c=c, p=p, k=k: kernels.reduce(c, p, local, k, k, backend="cpu")
    jobs["dynamiq prologue (local work)"] = prologue_local
    best = {name: float("inf") for name in jobs}
    for _ in range(args.iters):
        for name, fn in jobs.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    base = best["mxfp8_e4m3"]
    same_op = {}
    for name in jobs:
        op = name.rsplit(" ", 1)[-1] if name.endswith(("encode", "decode")) else None
        if name in payloads or op:
            ref = best[f"mxfp8_e4m3 {op}" if op else "mxfp8_e4m3"]
            same_op[name] = best[name] / ref
    out = {
        "numel": n,
        "threads": torch.get_num_threads(),
        "seconds": best,
        "ratio to mxfp8_e4m3 reduce": {k: v / base for k, v in best.items()},
        "ratio to mxfp8_e4m3 same operation": same_op,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
