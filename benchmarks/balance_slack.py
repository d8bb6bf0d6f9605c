"""The pooled DynamiQ default with and without ``balance_slack`` on every model family, on
buffers small enough for the slack to bind (docs/benchmarks.md, "A chunk's slack").

    python benchmarks/balance_slack.py                       # -> stdout, one JSON row a cell
    python benchmarks/balance_slack.py --values 65536 --values 524288 --ranks 32

Rank ``r`` holds eval worker ``r``'s gradient of the family (``dynamiq.data.load_gradients``,
32 workers) at ``values`` coordinates drawn uniformly without replacement (seed 0, in index
order, as ``benchmarks/scale.py`` draws them); each cell is ``scale.cell`` (one
``simulate_schedule``, torch on one thread): vNMSE against the fp64 sum, bits/value, and the
worst round's largest / mean bytes a rank sends (over the ranks that send in it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks.*

from benchmarks.scale import cell
from dynamiq.data import FAMILIES, load_gradients

CONFIGS = {
    "mxfp8_e4m3": "mxfp8_e4m3",
    "dynamiq": "dynamiq",
    "dynamiq balance_slack=0": json.dumps({"id": "dynamiq", "balance_slack": 0}),
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
            pick = np.random.default_rng(0).choice(g.shape[1], size=values, replace=False)
            grads = g[:, torch.from_numpy(np.sort(pick))]
            for n in args.ranks or [8, 16, 32]:
                for schedule in args.schedule or ["ring", "butterfly"]:
                    row = {"family": family, "values": values, "ranks": n, "schedule": schedule}
                    base = None
                    for name, codec in CONFIGS.items():
                        got = cell(grads, codec, schedule, n)
                        base = base or got["vnmse"]
                        keep = ("vnmse", "round_balance", "bits_per_value")
                        row[name] = {k: got[k] for k in keep} | {"x_vs_mxfp8": base / got["vnmse"]}
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
