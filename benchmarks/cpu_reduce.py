"""CPU fast path of the fused ``reduce`` (issue 3's CPU numbers), ratios measured in one run.

For each codec, over ``--numel`` fp32 values: (a) the unfused reference, decode + add +
encode; (b) the fused ``reduce`` through the dispatcher with the compiled CPU path
(``torch.compile`` of the reference; compile time excluded, reported apart); (c) a plain
``torch.add`` of two fp32 tensors of the same length. Times are the minimum of ``--iters``
runs, interleaved so that other load on the machine hurts all alike. (b) is checked bit for
bit against (a).

    python benchmarks/cpu_reduce.py --numel 16777216 --codecs int8,mxfp8_e4m3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dynamiq.codecs import HopContext, get_codec
from dynamiq.kernels import _compiled, reduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--codecs", default="int8,mxfp8_e4m3,int4,mxfp4")
    args = parser.parse_args()
    n = args.numel
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, generator=g)
    b = torch.randn(n, generator=g)
    rows = []
    for name in args.codecs.split(","):
        codec = get_codec(name)
        ctx = HopContext(hop=0, num_hops=2)
        out_ctx = HopContext(hop=1, num_hops=2, contributions=2)
        payload = codec.encode(a, ctx)

        def unfused(codec=codec, payload=payload, ctx=ctx, out_ctx=out_ctx) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return codec._encode(codec._decode(payload, n, ctx) + b, out_ctx)

        def fused(codec=codec, payload=payload, ctx=ctx, out_ctx=out_ctx) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return reduce(codec, payload, b, ctx, out_ctx, backend="auto")

        _compiled.set_cpu_compile(True)
        t0 = time.perf_counter()
        first = fused()
        compile_s = time.perf_counter() - t0
        exact = bool(torch.equal(first, unfused()))
        best = {"unfused": float("inf"), "fused": float("inf"), "torch.add": float("inf")}
        for _ in range(args.iters):
            for key, fn in (
                ("unfused", unfused),
                ("fused", fused),
                ("torch.add", lambda: torch.add(a, b)),
            ):
                t = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t)
        _compiled.set_cpu_compile(None)
        rows.append(
            {
                "codec": name,
                "numel": n,
                "bit-exact": exact,
                "compile+first s": round(compile_s, 2),
                "unfused s": best["unfused"],
                "fused s": best["fused"],
                "torch.add s": best["torch.add"],
                "fused speed-up over unfused": best["unfused"] / best["fused"],
                "fused / torch.add time": best["fused"] / best["torch.add"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
