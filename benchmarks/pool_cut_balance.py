"""Could moving the engine's chunk cuts balance pooled DynamiQ's bytes? (issue 14)

For each family and world size: the uncapped pooled budgets of the eval split's gradients
(the first 2^21 values per worker; the demand all-reduced by max, as the prologue does), then
the largest chunk's bytes over the mean for the engine's even cut, and for cuts moved toward
equal bytes: the best cut whose chunks hold at most ``1 + slack`` times the mean values
(``chunk_sizes``' measure), with the values per chunk (largest over mean) it uses. One line
per cell.

    python benchmarks/pool_cut_balance.py --family lm,mlm,digits
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from dynamiq.codecs import _dynamiq_pool as pool
from dynamiq.codecs import get_codec
from dynamiq.collectives.planning import chunk_bounds
from dynamiq.data import load_gradients, parse_families

SPAN = 256
SLACKS = (0.05, 0.10, 0.25, 1.0)


def span_bytes(xs: list[torch.Tensor]) -> torch.Tensor:
    """Cumulative uncapped budget (bytes) at every span boundary of the default codec."""
    codec = get_codec("dynamiq")
    n_values = xs[0].numel()
    regions = [(0, n_values)]
    stats = [pool.span_statistics(codec, x, r, regions) for r, x in enumerate(xs)]
    agreed = torch.stack(stats).max(0).values
    shared = pool.shared_from_statistics(codec, agreed, n_values, len(xs), regions)
    p = shared[pool.SHARED_KEY]
    total = torch.tensor([math.floor(codec.bits * n_values) // 8])
    whole = pool._distribute(p.demand, p.lens, torch.zeros_like(p.lens), total)
    return torch.cat([torch.zeros(1, dtype=torch.int64), whole.cumsum(0)])


def worst(sizes: list[int]) -> float:
    return max(sizes) / (sum(sizes) / len(sizes))


def best_cuts(cum: torch.Tensor, n_values: int, parts: int, slack: float) -> list[int]:
    """The cut of least largest-chunk bytes among those whose chunks hold at most
    ``(1 + slack)`` times the mean values (whole spans): a binary search on the bytes, each
    tried by the greedy longest-chunk cover (optimal for a maximum on each chunk)."""
    spans = cum.numel() - 1
    cap = max(1, int((1 + slack) * n_values / parts) // SPAN)

    def cover(limit: int) -> list[int] | None:
        cuts, at = [0], 0
        while at < spans:
            reach = int(torch.searchsorted(cum, int(cum[at]) + limit, right=True)) - 1
            end = min(at + cap, reach, spans)
            if end <= at or len(cuts) > parts:
                return None
            cuts.append(end)
            at = end
        return cuts if len(cuts) <= parts + 1 else None

    lo, hi = 1, int(cum[-1])
    while lo < hi:
        mid = (lo + hi) // 2
        if cover(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    got = cover(lo)
    assert got is not None
    while len(got) < parts + 1:  # fewer chunks than parts: split the longest (never worse)
        i = max(range(len(got) - 1), key=lambda j: got[j + 1] - got[j])
        got.insert(i + 1, (got[i] + got[i + 1]) // 2)
    return [min(c * SPAN, n_values) for c in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="lm,mlm,digits")
    ap.add_argument("--values", type=int, default=1 << 21)
    args = ap.parse_args()
    for fam in parse_families(args.family):
        grads = load_gradients("eval", 32, family=fam, progress=False)
        n_values = min(args.values, grads.shape[1])
        for parts in (8, 16, 32):
            cum = span_bytes([grads[i, :n_values].contiguous() for i in range(parts)])

            def nbytes(bounds: list[tuple[int, int]], cum: torch.Tensor = cum) -> list[int]:
                return [int(cum[-(-e // SPAN)] - cum[s // SPAN]) for s, e in bounds]

            even = chunk_bounds(n_values, parts, SPAN)
            line = [f"{fam} n={parts} even: bytes {worst(nbytes(even)):.3f}"]
            for slack in SLACKS:
                b = list(itertools.pairwise(best_cuts(cum, n_values, parts, slack)))
                vals = [e - s for s, e in b]
                line.append(f"slack {slack}: bytes {worst(nbytes(b)):.3f} values {worst(vals):.3f}")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
