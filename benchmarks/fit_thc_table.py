"""Fit THC's level table (``dynamiq.codecs.thc.DEFAULT_TABLE``) and choose its clamp ``T``
(``DEFAULT_NORM_CLIP``) on real gradients.

    python benchmarks/fit_thc_table.py                       # the default table
    python benchmarks/fit_thc_table.py --sweep 2,2.25,2.5    # T: table + ring vNMSE per value
    python benchmarks/fit_thc_table.py --scale max --clip 1 --block 1024 --scale-blocks 0

Data: the ``fit`` split of ``dynamiq.data`` (text shards disjoint from the ``eval`` split the
benchmarks and the committed slice come from), its first ``--numel`` values (0: all), in groups
of ``--ranks`` workers: each group is one all-reduce whose ranks agree on the scales exactly
as the codec's ``prologue`` does (per segment of ``--scale-blocks`` rotation blocks of
``--block`` values: the largest RMS or largest ``|w|`` of any rank, times ``T``). The positions
``y = clamp(w / R, -1, 1) · g/2 + g/2`` of every rank's rotated coordinates (one contribution)
are pooled.

Objective: the expected stochastic-rounding variance ``Σ_y (y - lo)(hi - y)`` of rounding each
``y`` to its neighbouring levels ``lo <= y <= hi``. Constraints: integer levels, ``0``, ``g/2``
(zero stays exact) and ``g`` included. An exact dynamic programme over the integer grid (cost
of an interval from prefix sums of the count, ``Σy`` and ``Σy²`` per unit cell) solves it.
Prints the table; with ``--sweep``, for each ``T`` its table and the vNMSE of ring all-reduces
of 8 and 32 fit-split workers (first ``--sweep-numel`` values, both variants, one seed,
``simulate_allreduce``).
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import torch

from dynamiq.codecs.thc import DEFAULT_NORM_CLIP, ThcCodec, ThcLayout
from dynamiq.collectives import simulate_allreduce
from dynamiq.data import load_gradients


def positions(grads: torch.Tensor, codec: ThcCodec) -> np.ndarray:
    """Pooled one-contribution positions ``y`` of one group of ranks ([ranks, numel]) under
    the scales their prologue agrees on."""
    lay = ThcLayout(grads.shape[1], codec.block_size)
    segs = codec._segments(lay, 0, grads.device)
    finite = torch.ones(lay.nblocks, dtype=torch.bool)
    ws, stats = [], []
    for row in grads:
        w = codec._rotate(row.float().contiguous(), lay, 0)
        ws.append(w)
        stats.append(codec._statistic(w, finite, lay, segs))
    r = codec._coord(codec._clip_ranges(torch.stack(stats).amax(dim=0)), segs, lay)
    return torch.cat([codec._positions(w, r, 1) for w in ws]).double().numpy()


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


def fitted_table(rows: torch.Tensor, codec: ThcCodec, ranks: int, levels: int) -> tuple[int, ...]:
    """The table fitted on ``rows`` ([workers, numel]) in groups of ``ranks``."""
    y = np.concatenate(
        [positions(rows[i : i + ranks], codec) for i in range(0, rows.shape[0], ranks)]
    )
    return fit(y, codec.g, levels)[1]


def ring_vnmse(rows: torch.Tensor, codec: ThcCodec, workers: int) -> tuple[float, float]:
    """vNMSE and bits/value of one simulated ring all-reduce of the first ``workers`` rows."""
    xs = [rows[i].contiguous() for i in range(workers)]
    res = simulate_allreduce(xs, codec, "ring", seed=0)
    return res.vnmse, res.bits_per_value()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=16)
    parser.add_argument("--g", type=int, default=30)
    parser.add_argument("--scale", default="norm", choices=("norm", "max"))
    parser.add_argument("--clip", type=float, default=None, help="T (default: the codec's)")
    parser.add_argument("--block", type=int, default=16384)
    parser.add_argument("--scale-blocks", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--numel", type=int, default=0, help="first N values (0: all)")
    parser.add_argument("--sweep", default="", help="comma-separated T values to compare")
    parser.add_argument("--sweep-numel", type=int, default=1 << 20)
    args = parser.parse_args()

    full = load_gradients("fit", workers=32, progress=False)
    rows = full[:, : args.numel] if args.numel else full
    uniform = (0, args.g // 2, args.g)  # any valid table: positions do not depend on it

    def codec_for(clip: float | None, table: tuple[int, ...], variant: str = "widen") -> ThcCodec:
        return ThcCodec(
            variant=variant,
            table=table,
            block_size=args.block,
            scale=args.scale,
            scale_blocks=args.scale_blocks,
            clip=clip,
        )

    clips = [float(v) for v in args.sweep.split(",") if v] or [args.clip]
    for clip in clips:
        table = fitted_table(rows, codec_for(clip, uniform), args.ranks, args.levels)
        report: dict[str, object] = {
            "table": list(table),
            "scale": args.scale,
            "clip": clip if clip is not None else codec_for(None, uniform).effective_clip,
            "block": args.block,
            "scale_blocks": args.scale_blocks,
            "fit data": f"fit split, {rows.shape[1]} values, groups of {args.ranks} ranks",
        }
        if args.sweep:
            head = full[:, : args.sweep_numel]
            for variant in ("widen", "requantize"):
                for n in (8, 32):
                    v, bits = ring_vnmse(head, codec_for(clip, table, variant), n)
                    report[f"ring {n} {variant}"] = {"vnmse": v, "bits/value": bits}
        print(json.dumps(report), flush=True)
    if not args.sweep and args.clip is None and args.scale == "norm":
        print(f"(DEFAULT_NORM_CLIP = {DEFAULT_NORM_CLIP})")


if __name__ == "__main__":
    main()
