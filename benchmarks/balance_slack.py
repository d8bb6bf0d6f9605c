"""The pooled DynamiQ default with and without ``balance_slack`` on every model family, on
buffers small enough for the slack to bind (docs/benchmarks.md, "A chunk's slack").

    python benchmarks/balance_slack.py                       # -> stdout, one JSON row a cell
    python benchmarks/balance_slack.py --values 65536 --values 524288 --ranks 32

Rank ``r`` holds eval worker ``r``'s gradient of the family (``dynamiq.data.load_gradients``,
32 workers) at ``values`` coordinates drawn uniformly without replacement (seed 0, in index
order, as ``benchmarks/scale.py`` draws them); one ``simulate_schedule`` a cell (torch on
one thread), vNMSE against the fp64 sum, and the worst round's largest / mean bytes a rank
sends (over the ranks that send in it).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from dynamiq.codecs import get_codec
from dynamiq.collectives import get_schedule
from dynamiq.collectives.balance import round_balance
from dynamiq.collectives.simulator import simulate_schedule
from dynamiq.data import FAMILIES, load_gradients

CONFIGS: dict[str, Any] = {
    "mxfp8_e4m3": "mxfp8_e4m3",
    "dynamiq": {"id": "dynamiq"},
    "dynamiq balance_slack=0": {"id": "dynamiq", "balance_slack": 0},
}


def cell(xs: list[torch.Tensor], name: str, schedule: str) -> dict[str, float]:
    n = len(xs)
    sched = get_schedule(schedule, n)
    run = simulate_schedule(xs, get_codec(CONFIGS[name]), sched, return_bound=False)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    err = run.results[0].output.double() - exact
    sent = sum(r.bytes_sent for r in run.results)
    return {
        "vnmse": float(err.square().sum() / exact.square().sum()),
        "round_balance": round_balance(run.round_bytes, sched),
        "bits_per_value": 8 * sent / n / (2 * (n - 1) / n * xs[0].numel()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=FAMILIES)
    ap.add_argument("--values", type=int, action="append")
    ap.add_argument("--ranks", type=int, action="append")
    ap.add_argument("--schedule", action="append")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for family in args.family or FAMILIES:
        g = load_gradients("eval", 32, family=family, progress=False)
        for values in args.values or [1 << 16]:
            for n in args.ranks or [8, 16, 32]:
                pick = np.random.default_rng(0).choice(g.shape[1], size=values, replace=False)
                idx = torch.from_numpy(np.sort(pick))
                xs = [g[r, idx].contiguous() for r in range(n)]
                for schedule in args.schedule or ["ring", "butterfly"]:
                    row = {"family": family, "values": values, "ranks": n, "schedule": schedule}
                    base = None
                    for name in CONFIGS:
                        got = cell(xs, name, schedule)
                        base = base or got["vnmse"]
                        row[name] = {**got, "x_vs_mxfp8": base / got["vnmse"]}
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
