"""The native fused ``reduce`` of ``nvfp4`` against ``mxfp4``'s, ratios measured in one run
(issue 18: target within 2x).

Over ``--numel`` fp32 values, both codecs' ``reduce(payload, local)`` on the native CPU
kernels (``backend="cpu"``), in a collective's context (``nvfp4``: the prologue's agreed
absmax in ``ctx.shared``, no extra pass). Times are the minimum of ``--iters`` runs,
interleaved so that other load on the machine hurts both alike.

    python benchmarks/block_reduce.py --numel 16777216
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dynamiq.codecs import HopContext, get_codec
from dynamiq.codecs.blockfmt import TENSOR_AMAX_KEY, finite_absmax_bits
from dynamiq.kernels import reduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--codecs", default="mxfp4,nvfp4")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(args.numel, generator=g)
    b = torch.randn(args.numel, generator=g)
    shared = {TENSOR_AMAX_KEY: max(finite_absmax_bits(a), finite_absmax_bits(b))}
    ctx = HopContext(hop=0, num_hops=2, world_size=2, shared=shared)
    out_ctx = HopContext(hop=1, num_hops=2, world_size=2, contributions=2, shared=shared)
    jobs = []
    for name in args.codecs.split(","):
        codec = get_codec(name)
        jobs.append((name, codec, codec.encode(a, ctx)))
    best = {name: float("inf") for name, _, _ in jobs}
    for _ in range(args.iters):
        for name, codec, payload in jobs:
            t = time.perf_counter()
            reduce(codec, payload, b, ctx, out_ctx, backend="cpu")
            best[name] = min(best[name], time.perf_counter() - t)
    base = best[jobs[0][0]]
    rows = [
        {"codec": name, "seconds": round(best[name], 4), "ratio": round(best[name] / base, 3)}
        for name, _, _ in jobs
    ]
    load = os.getloadavg()
    out = {"numel": args.numel, "threads": torch.get_num_threads(), "loadavg": load, "rows": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
