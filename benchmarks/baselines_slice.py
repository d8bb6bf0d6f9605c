"""vNMSE and bits/value of the paper's baselines (THC, OmniReduce) on the committed slice of
real gradients (``dynamiq.data.load_slice()``, 8 workers × 32768 values).

    python benchmarks/baselines_slice.py                  # the default configurations
    python benchmarks/baselines_slice.py --seeds 0 1 2 --json

* one-shot vNMSE: ``Σ_w ‖x̂_w - x_w‖² / Σ_w ‖x_w‖²`` of each worker's gradient encoded and
  decoded once, in the context of the collective (THC: the 8 workers' agreed scales; OmniReduce:
  each worker's own selection rule), as the first hop of a ring does;
* all-reduce vNMSE: ``‖x̂ - x‖² / ‖x‖²`` of ``simulate_allreduce`` over the 8 workers against
  the fp64 sum (median and max over the seeds), with its ``bits_per_value()`` (payloads, length
  headers and prologue exchanges, over ``2(n-1)/n`` values per gradient value).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from dynamiq.codecs import HopContext, get_codec
from dynamiq.collectives import simulate_allreduce
from dynamiq.data import gradient_stats, load_slice

CONFIGS: list[dict[str, Any]] = [
    {"id": "thc"},
    {"id": "thc", "variant": "widen"},
    {"id": "omnireduce"},
    {"id": "omnireduce", "density": 0.25},
    {"id": "omnireduce", "density": 0.1},
]


class _Gather:
    """A prologue communicator over the in-memory ranks (to reproduce the agreed context)."""

    def __init__(self, rows: torch.Tensor, codec: Any):
        self.rows, self.codec = rows, codec

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        alone = _Alone()
        return [
            torch.tensor([next(iter(self.codec.prologue(r.contiguous(), alone).values()))])
            for r in self.rows
        ]


class _Alone:
    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]


def one_shot(grads: torch.Tensor, config: dict[str, Any]) -> float:
    codec = get_codec(config)
    n = grads.shape[0]
    sq_err = sq = 0.0
    for w in range(n):
        x = grads[w].contiguous()
        prologue = getattr(codec, "prologue", None)
        shared = None
        if prologue is not None:
            comm = _Gather(grads, codec) if config["id"] == "thc" else _Alone()
            shared = prologue(x, comm)
        ctx = HopContext(rank=w, world_size=n, num_hops=n, shared=shared)
        y = codec.decode(codec.encode(x, ctx), x.numel(), ctx).double()
        sq_err += float((y - x.double()).square().sum())
        sq += float(x.double().square().sum())
    return sq_err / sq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--schedules", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    grads = load_slice()
    xs = [row.contiguous() for row in grads]
    stats = gradient_stats(grads)
    rows = []
    for config in CONFIGS:
        row: dict[str, Any] = {
            "codec": json.dumps(config),
            "one-shot vnmse": one_shot(grads, config),
        }
        for schedule in args.schedules:
            runs = [simulate_allreduce(xs, config, schedule, seed=s) for s in args.seeds]
            vn = [r.vnmse for r in runs]
            row[f"{schedule} vnmse (median)"] = statistics.median(vn)
            row[f"{schedule} vnmse (max)"] = max(vn)
            row[f"{schedule} bits/value"] = statistics.median(r.bits_per_value() for r in runs)
        rows.append(row)
    if args.json:
        print(json.dumps({"slice": stats, "rows": rows}, indent=2))
        return
    keys = ["kurtosis", "norm_max_min_ratio", "zero_fraction", "absmax_over_rms"]
    print("slice:", ", ".join(f"{k} {stats[k]:.3g}" for k in keys))
    for row in rows:
        print(
            row["codec"],
            " | ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "codec"),
        )


if __name__ == "__main__":
    main()
