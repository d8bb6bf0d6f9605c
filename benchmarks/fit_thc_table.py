"""Fit THC's level table (``dynamiq.codecs.thc.DEFAULT_TABLE``) on real gradients.

    python benchmarks/fit_thc_table.py                 # the default: 16 levels, g = 30
    python benchmarks/fit_thc_table.py --levels 16 --g 62 --clip 0.5

Data: the ``fit`` split of ``dynamiq.data`` (text shards disjoint from the ``eval`` split the
benchmarks and the committed slice come from), at the slice's 32768 coordinates
(``load_slice_info()["indices"]``), in groups of ``--ranks`` workers: each group is one
all-reduce whose ranks agree on the scale ``S`` (the largest rotated ``|w|``), exactly as the
codec's prologue does. The positions ``y = clamp(w / (T·S), -1, 1) · g/2 + g/2`` of every
rank's rotated coordinates are pooled.

Objective: the expected stochastic-rounding variance ``Σ_y (y - lo)(hi - lo)`` of rounding each
``y`` to its neighbouring levels ``lo <= y <= hi``. Constraints: integer levels, ``0``, ``g/2``
(zero stays exact) and ``g`` included. An exact dynamic programme over the integer grid (cost
of an interval from prefix sums of the count, ``Σy`` and ``Σy²`` per unit cell) solves it.
Prints the table and the one-shot vNMSE it gives on the fit data and on the eval slice.
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import torch

from dynamiq.codecs.thc import ThcCodec, _Layout
from dynamiq.data import load_gradients, load_slice, load_slice_info


def positions(grads: torch.Tensor, g: int, clip: float, block: int) -> np.ndarray:
    """Pooled ``y`` of one group of ranks ([ranks, numel]) under an agreed scale."""
    codec = ThcCodec(block_size=block)
    lay = _Layout(grads.shape[1], block)
    w = torch.stack([codec._rotate(row.float().contiguous(), lay, 0) for row in grads])
    scale = float(w.abs().max()) * clip
    t = (w.double() / scale).clamp(-1, 1)
    return (t * (g / 2) + g / 2).numpy().reshape(-1)


def fit(y: np.ndarray, g: int, levels: int) -> tuple[float, tuple[int, ...]]:
    """Levels (integers, with 0, g/2, g) minimising Σ (y - lo)(hi - y)."""
    cells = np.clip(np.floor(y).astype(np.int64), 0, g - 1)
    prefix = [
        np.concatenate([[0.0], np.cumsum(np.bincount(cells, weights=wt, minlength=g))])
        for wt in (np.ones_like(y), y, y * y)
    ]

    def cost(a: int, b: int) -> float:
        n, s1, s2 = (p[b] - p[a] for p in prefix)
        return float(-s2 + (a + b) * s1 - a * b * n)

    def best_split(lo: int, hi: int, inner: int) -> tuple[float, tuple[int, ...]]:
        @functools.cache
        def best(a: int, k: int) -> tuple[float, tuple[int, ...]]:
            if k == 0:
                return cost(a, hi), ()
            out: tuple[float, tuple[int, ...]] = (float("inf"), ())
            for b in range(a + 1, hi - k + 1):
                c, rest = best(b, k - 1)
                if c + cost(a, b) < out[0]:
                    out = (c + cost(a, b), (b, *rest))
            return out

        return best(lo, inner)

    half, inner = g // 2, levels - 3
    result: tuple[float, tuple[int, ...]] = (float("inf"), ())
    for left in range(inner + 1):
        if left > half - 1 or inner - left > half - 1:
            continue
        c1, l1 = best_split(0, half, left)
        c2, l2 = best_split(half, g, inner - left)
        if c1 + c2 < result[0]:
            result = (c1 + c2, (0, *l1, half, *l2, g))
    return result


def one_shot_vnmse(grads: torch.Tensor, codec: ThcCodec) -> float:
    sq_err = sq = 0.0
    for w, row in enumerate(grads):
        from dynamiq.codecs import HopContext

        ctx = HopContext(rank=w, world_size=grads.shape[0])
        x = row.contiguous()
        y = codec.decode(codec.encode(x, ctx), x.numel(), ctx).double()
        sq_err += float((y - x.double()).square().sum())
        sq += float(x.double().square().sum())
    return sq_err / sq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=16)
    parser.add_argument("--g", type=int, default=30)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--block", type=int, default=1024)
    args = parser.parse_args()

    idx = load_slice_info()["indices"]
    full = load_gradients("fit", workers=32, progress=False)
    fit_rows = full[:, idx].float()
    groups = [fit_rows[i : i + args.ranks] for i in range(0, fit_rows.shape[0], args.ranks)]
    y = np.concatenate([positions(grp, args.g, args.clip, args.block) for grp in groups])
    _, table = fit(y, args.g, args.levels)
    codec = ThcCodec(table=table, clip=args.clip, block_size=args.block)
    report = {
        "table": list(table),
        "g": args.g,
        "clip": args.clip,
        "fit data": f"fit split, slice coordinates, {len(groups)} groups of {args.ranks} ranks",
        "one-shot vnmse (fit, standalone scale)": one_shot_vnmse(groups[0], codec),
        "one-shot vnmse (eval slice, standalone scale)": one_shot_vnmse(load_slice(), codec),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
