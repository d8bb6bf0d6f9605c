"""Ablation of the DynamiQ codec on a subset of the real gradients: each technique off in turn.

The subset: the eval split's first 8 workers, four runs of 262,144 values taken across the
model (offsets 0, 800,000, 1,900,000 and 3,000,000), so that one run takes seconds. Ring and
butterfly of 8, one seed; bits/value counts everything sent. The full-size comparison is
``dynamiq compare`` (docs/benchmarks.md).

    python benchmarks/ablation_dynamiq.py
"""

from __future__ import annotations

import json

import torch

from dynamiq.collectives import simulate_allreduce
from dynamiq.data import load_gradients

BASE = {"id": "dynamiq"}
VARIANTS = {
    "DynamiQ (default)": {},
    "no variable bit-width (pooled=False)": {"pooled": False},
    "uniform levels (levels=uniform)": {"levels": "uniform"},
    "power-of-two group scales (scale_steps=1)": {"scale_steps": 1},
    "small span (span=4096)": {"span": 4096},
    "stochastic rounding": {"rounding": "stochastic"},
    "correlated rounding": {"rounding": "correlated"},
    "more bits to later hops (hop_slope=1)": {"hop_slope": 1.0},
}


def main() -> None:
    grads = load_gradients("eval", 8)
    idx = torch.cat([torch.arange(s, s + 262144) for s in (0, 800_000, 1_900_000, 3_000_000)])
    g = grads[:, idx].contiguous()
    rows = []
    for name, knobs in VARIANTS.items():
        codec = {**BASE, **knobs}
        row: dict[str, object] = {"variant": name, "config": knobs}
        for schedule in ("ring", "butterfly"):
            res = simulate_allreduce(list(g), codec, schedule, return_bound=False)
            row[f"{schedule} 8 vNMSE"] = res.vnmse
            row[f"{schedule} 8 bits/value"] = res.bits_per_value()
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
