"""Could moving the engine's chunk cuts balance pooled DynamiQ's bytes? (issue 14)

For each family and world size: the uncapped pooled budgets of the eval split's gradients
(the first 2^21 values per worker; the demand all-reduced by max, as the prologue does), then
the largest chunk's bytes over the mean for the engine's even cut, and for the prologue's
re-cut (``_dynamiq_pool.recut``: the best cut whose chunks hold at most ``1 + slack`` times
the mean values, ``chunk_sizes``' measure) at several slacks (the shipped one is
``RECUT_SLACK``), with the values per chunk (largest over mean) each uses. One line per cell.

    python benchmarks/pool_cut_balance.py --family lm,mlm,digits
"""

from __future__ import annotations

import argparse
import math

import torch

from dynamiq.codecs import _dynamiq_pool as pool
from dynamiq.codecs import get_codec
from dynamiq.collectives.planning import chunk_bounds
from dynamiq.data import load_gradients
from dynamiq.data.families import parse_families

SPAN = 256
SLACKS = (0.05, 0.10, 0.25, 1.0)


def worst(sizes: list[int]) -> float:
    return max(sizes) / (sum(sizes) / len(sizes))


def cell(xs: list[torch.Tensor]) -> str:
    codec = get_codec("dynamiq")
    n_values, parts = xs[0].numel(), len(xs)
    regions = [(0, n_values)]
    stats = [pool.span_statistics(codec, x, r, regions) for r, x in enumerate(xs)]
    p = pool.shared_from_statistics(
        codec, torch.stack(stats).max(0).values, n_values, parts, regions
    )[pool.SHARED_KEY]
    total = torch.tensor([math.floor(codec.bits * n_values) // 8])
    whole = pool._distribute(p.demand, p.lens, [0, p.lens.numel()], total)
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), whole.cumsum(0)])

    def nbytes(bounds: list[tuple[int, int]]) -> list[int]:
        return [int(cum[-(-e // SPAN)] - cum[s // SPAN]) for s, e in bounds]

    line = [f"n={parts} even: bytes {worst(nbytes(chunk_bounds(n_values, parts, SPAN))):.3f}"]
    for slack in SLACKS:
        cut = pool.recut(codec, p.demand, p.lens, n_values, parts, SPAN, slack)
        vals = [e - s for s, e in cut]
        line.append(f"slack {slack}: bytes {worst(nbytes(cut)):.3f} values {worst(vals):.3f}")
    return " | ".join(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="lm,mlm,digits")
    ap.add_argument("--values", type=int, default=1 << 21)
    args = ap.parse_args()
    for fam in parse_families(args.family):
        grads = load_gradients("eval", 32, family=fam, progress=False)
        n_values = min(args.values, grads.shape[1])
        for parts in (8, 16, 32):
            xs = [grads[i, :n_values].contiguous() for i in range(parts)]
            print(f"{fam} {cell(xs)}", flush=True)


if __name__ == "__main__":
    main()
