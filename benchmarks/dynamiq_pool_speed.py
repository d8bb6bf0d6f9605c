"""CPU time of the pooled DynamiQ codec against MXFP8 and the span design, one run.

On ``--numel`` values of real gradients (the ``lm`` family's eval rows, concatenated), the
native CPU kernels (``backend="cpu"``): the encode, decode and fused reduce of
``mxfp8_e4m3``, of the default ``dynamiq`` with its prologue's result in the context (pooled
budgets), and of the span design; and the prologue's local work (the per-span demand over the
whole buffer, and the budgets from it). Times are the minimum of ``--iters`` interleaved
runs; ratios are to MXFP8's reduce, and each operation's to MXFP8's same operation.

    python benchmarks/dynamiq_pool_speed.py --numel 16777216

``--phases``: instead, the prologue's local work phase by phase, on ``--numel`` values of
every model family's eval gradients (rank 0 of a ring of ``--ranks``: its statistics, the
result from the statistics (checks, the re-cut to equal bytes), the budgets, and the kernel
arguments of every piece the engine encodes), then the same at the bucket size
``dynamiq bench train`` uses (``--bucket``); milliseconds of CPU time (``process_time``),
minima of ``--iters``. With
``--simulate``, also one in-process all-reduce of ``--ranks`` ranks
(``simulate_allreduce``, the same data; ``--engine``: batched, or the engine on threads) of
the pooled default and of the span design, and their ratio. The phases use the codec's API
only, so the script also times older trees.
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

SPAN_DESIGN = {"id": "dynamiq", "pooling": "span"}


def _best(fn: Callable[[], object], iters: int) -> float:
    """The least CPU time of this process (``time.process_time``: the machine is shared, and
    torch runs on the threads set) of ``iters`` calls of ``fn``."""
    out = float("inf")
    for _ in range(iters):
        t = time.process_time()
        fn()
        out = min(out, time.process_time() - t)
    return out


def prologue_phases(x: torch.Tensor, ranks: int, iters: int) -> dict[str, float]:
    """Milliseconds of each phase of rank 0's prologue on ``x`` (a ring of ``ranks``)."""
    from dynamiq.collectives import get_schedule
    from dynamiq.collectives.planning import chunk_layout, layout_align

    dq = get_codec("dynamiq")
    n, sched = x.numel(), get_schedule("ring", ranks)
    chunks, _ = chunk_layout(n, sched, dq, 1 << 62)
    align = layout_align(sched, dq)
    stats = dq.prologue_statistics(x, 0, chunks)
    assert stats is not None

    def result() -> dict:
        return dq.prologue_result(stats, n, ranks, chunks, align)

    def budgets() -> dict:
        got = result()
        pool.span_budgets(got[pool.SHARED_KEY], dq.bits, dq.balance, dq.balance_slack)
        return got

    shared = result()
    bounds = shared.get("dynamiq.chunk_bounds", chunks)
    pieces = chunk_layout(n, sched, dq, 1 << 18, bounds)[1]  # the engine's sub-chunks

    def kernel_args() -> None:  # a fresh result each time: nothing memoized yet
        sh = budgets()
        for piece in pieces:
            for a, b in piece:
                ctx = HopContext(shared=sh, offset=a)
                dq._pooled_kernel_ptrs(b - a, ctx)

    t_stats = _best(lambda: dq.prologue_statistics(x, 0, chunks), iters)
    t_result, t_budgets, t_args = (_best(f, iters) for f in (result, budgets, kernel_args))
    ms = {
        "statistics (demand, flags)": t_stats,
        "result (checks, re-cut)": t_result,
        "budgets": t_budgets - t_result,
        "kernel arguments (every piece)": t_args - t_budgets,
    }
    ms["total"] = sum(ms.values())
    return {k: round(1e3 * v, 2) for k, v in ms.items()}


def simulated_ratio(xs: list[torch.Tensor], iters: int, engine: str) -> dict[str, float]:
    """CPU seconds of one in-process all-reduce (``simulate_allreduce``, ring; ``engine``:
    the batched simulator, or the engine itself on threads) of the pooled default and of the
    span design, and their ratio."""
    from dynamiq.collectives import simulate_allreduce

    def run(codec: object) -> object:
        return simulate_allreduce(xs, codec, "ring", seed=0, return_bound=False, engine=engine)

    sec = {
        name: _best(lambda c=c: run(c), iters)
        for name, c in (("dynamiq", "dynamiq"), ("span design", SPAN_DESIGN))
    }
    ratio = sec["dynamiq"] / sec["span design"]
    return {**{k: round(v, 3) for k, v in sec.items()}, "ratio": round(ratio, 3)}


def phases_main(args: argparse.Namespace) -> None:
    from dynamiq.data import FAMILIES

    out: dict[str, object] = {"numel": args.numel, "bucket": args.bucket, "ranks": args.ranks}
    out["threads"] = torch.get_num_threads()
    for family in args.families.split(",") if args.families else FAMILIES:
        g = load_gradients("eval", 16, family=family, progress=False).reshape(-1)
        g = g.repeat(-(-args.numel * args.ranks // g.numel()))  # (digits: fewer values)
        x = g[: args.numel].contiguous()
        out[family] = prologue_phases(x, args.ranks, args.iters)
        out[f"{family} bucket"] = prologue_phases(x[: args.bucket].clone(), args.ranks, args.iters)
        if args.simulate:
            xs = [g[r * args.numel : (r + 1) * args.numel].clone() for r in range(args.ranks)]
            key = f"{family} simulate_allreduce ({args.engine})"
            out[key] = simulated_ratio(xs, max(1, args.iters // 3), args.engine)
    print(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--phases", action="store_true", help="the prologue, phase by phase")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=700_000, help="values of a bench-train bucket")
    ap.add_argument("--simulate", action="store_true", help="with --phases: pooled / span")
    ap.add_argument("--engine", choices=("batched", "threads"), default="batched")
    ap.add_argument("--families", default="", help="with --phases: these only (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.phases:
        phases_main(args)
        return
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
        pool.span_budgets(p, dq.bits, dq.balance, dq.balance_slack)

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
