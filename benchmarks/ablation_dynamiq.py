"""Ablation of the DynamiQ codec on every model family: each technique off in turn.

Per family, the eval split's first 8 workers and the first ``--values`` values of each
(``lm`` and ``mlm``: 2^20; ``digits``: all of its 548,746); ring and butterfly of 8, one seed;
bits/value counts everything sent (the prologue included). Variants: the default, then one
knob changed at a time: how the budget is pooled (the span design, spans of 256 pooled alone,
the bucket pooled with no balance cap, every chunk pooled alone, each rank's demand measured
at the codec's own bits instead of 2 bits below, the bytes shared in proportion to the demand
instead of by a water level), the variable bit-width, the level tables, the group scales, the
rounding and the hop slope.

    python benchmarks/ablation_dynamiq.py --family lm,mlm,digits --out docs/data/ablation.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import torch

from dynamiq.codecs import _dynamiq_pool
from dynamiq.collectives import simulate_allreduce
from dynamiq.data import load_gradients
from dynamiq.data.families import parse_families

BASE = {"id": "dynamiq"}
VARIANTS: dict[str, dict[str, Any]] = {
    "DynamiQ (default)": {},
    "span design (pooling=span, span=65536, super_group=1024, bits=4.7)": {
        "pooling": "span",
        "span": 65536,
        "super_group": 1024,
        "bits": 4.7,
    },
    "spans pooled alone (pooling=span)": {"pooling": "span", "bits": 4.6875},
    "bucket, no balance cap (balance=1e6)": {"balance": 1e6},
    "each chunk alone (balance=1, balance_slack=0)": {"balance": 1.0, "balance_slack": 0},
    "cap by balance alone (balance_slack=0)": {"balance_slack": 0},
    "demand at the codec's bits (DEMAND_OFFSET=0)": {"_demand_offset": 0.0},
    "bytes in proportion to the demand (the sharing before 12-03)": {"_proportional": True},
    "no variable bit-width (pooled=False)": {"pooled": False},
    "uniform levels (levels=uniform)": {"levels": "uniform"},
    "power-of-two group scales (scale_steps=1)": {"scale_steps": 1},
    "stochastic rounding": {"rounding": "stochastic"},
    "correlated rounding": {"rounding": "correlated"},
    "more bits to later hops (hop_slope=1)": {"hop_slope": 1.0},
}


@contextlib.contextmanager
def demand_offset(value: float | None) -> Iterator[None]:
    """Set the pooling module's DEMAND_OFFSET (an internal constant) for one variant."""
    saved = _dynamiq_pool.DEMAND_OFFSET
    if value is not None:
        _dynamiq_pool.DEMAND_OFFSET = value
    try:
        yield
    finally:
        _dynamiq_pool.DEMAND_OFFSET = saved


def proportional_share(
    demand: torch.Tensor, lens: torch.Tensor, first: list[int], total: torch.Tensor
) -> torch.Tensor:
    """The sharing before 2026-12-03 (commit c402a88's ``_distribute``): each segment's bytes
    in proportion to the demand (evenly in a segment demanding nothing), at most a byte a
    value; what the caps turn away shared again in proportion among the spans below theirs
    (up to 32 rounds), then one byte each, in span order, to the spans below their cap."""
    seg = torch.repeat_interleave(torch.arange(len(first) - 1), torch.tensor(first).diff())
    n_seg = total.numel()

    def per_seg(v: torch.Tensor) -> torch.Tensor:
        return _dynamiq_pool._segment_sum(v, seg, n_seg)

    want = per_seg(demand)
    weight = torch.where(want[seg] > 0, demand, lens)
    out = torch.minimum(weight * (8 * total)[seg] // per_seg(weight)[seg].clamp(min=1) // 8, lens)
    for _ in range(32):
        left = total - per_seg(out)
        w = torch.where(out < lens, weight, 0)
        tot = per_seg(w)
        more = torch.minimum(out + w * left[seg] // tot[seg].clamp(min=1), lens)
        if torch.equal(more, out):
            break
        out = more
    left = total - per_seg(out)
    room = (out < lens).to(torch.int64)
    cum = torch.cumsum(room, 0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), cum])[
        torch.searchsorted(seg, torch.arange(n_seg))
    ]
    return out + (room.bool() & (cum - before[seg] <= left[seg])).to(torch.int64)


@contextlib.contextmanager
def sharing(proportional: bool) -> Iterator[None]:
    """Share the bucket's bytes by :func:`proportional_share` for one variant."""
    saved = _dynamiq_pool._distribute
    if proportional:
        _dynamiq_pool._distribute = proportional_share
    try:
        yield
    finally:
        _dynamiq_pool._distribute = saved


def run(families: list[str], values: int) -> list[dict[str, Any]]:
    rows = []
    for fam in families:
        grads = load_gradients("eval", 8, family=fam, progress=False)
        g = grads[:, : min(values, grads.shape[1])].contiguous()
        for name, knobs in VARIANTS.items():
            knobs = dict(knobs)
            offset = knobs.pop("_demand_offset", None)
            proportional = knobs.pop("_proportional", False)
            codec = {**BASE, **knobs}
            row: dict[str, Any] = {"family": fam, "values": g.shape[1], "variant": name}
            with demand_offset(offset), sharing(proportional):
                for schedule in ("ring", "butterfly"):
                    res = simulate_allreduce(
                        list(g), codec, schedule, return_bound=False, sub_chunk=1 << 20
                    )
                    row[f"{schedule} 8 vNMSE"] = res.vnmse
                    row[f"{schedule} 8 bits/value"] = res.bits_per_value()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="lm,mlm,digits")
    ap.add_argument("--values", type=int, default=1 << 20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = run(parse_families(args.family), args.values)
    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
