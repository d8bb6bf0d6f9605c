"""DynamiQ pooled over the bucket against the span design and MXFP8, on every model family.

For each family (``lm``, ``mlm``, ``digits``: :mod:`dynamiq.data.families`), schedule (ring,
butterfly) and world size (4, 8, 16, 32), the engine's simulator all-reduces the eval split's
gradients of that many workers (the first ``--values`` per worker) with ``mxfp8_e4m3``, the
default ``dynamiq`` (pooled over the bucket, spans of 256) and the first version's span design
(``pooling="span"``, spans of 65536). Per cell: vNMSE, its ratio to MXFP8's, bits/value (every
byte sent, the prologue included), and the balance of the rounds: per round, the largest
bytes any rank sent over the mean over ranks, the worst round reported.

    python benchmarks/pooling.py --family lm,mlm,digits --values 2097152 \\
        --out docs/data/pooling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from dynamiq.codecs import get_codec
from dynamiq.collectives import simulate_allreduce
from dynamiq.data import load_gradients
from dynamiq.data.families import parse_families

CODECS: dict[str, dict[str, Any]] = {
    "mxfp8_e4m3": {"id": "mxfp8_e4m3"},
    "dynamiq": {"id": "dynamiq"},
    "dynamiq span design": {
        "id": "dynamiq",
        "bits": 4.7,
        "span": 65536,
        "super_group": 1024,
        "pooling": "span",
    },
}


def round_balance(res: Any) -> float:
    """The worst round's largest bytes sent by a rank over the mean over ranks."""
    worst = 1.0
    rounds = len(res.stats[0].round_bytes)
    for k in range(rounds):
        sent = [s.round_bytes[k] for s in res.stats]
        if sum(sent):
            worst = max(worst, max(sent) / statistics.mean(sent))
    return worst


def cell(xs: list[torch.Tensor], codec: Any, schedule: str) -> dict[str, float]:
    res = simulate_allreduce(xs, codec, schedule, seed=0, return_bound=False, sub_chunk=1 << 20)
    return {
        "vnmse": res.vnmse,
        "bits/value": res.bits_per_value(),
        "round balance": round_balance(res),
    }


def run(families: list[str], values: int, workers: list[int], schedules: list[str]) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    for fam in families:
        grads = load_gradients("eval", max(workers), family=fam, progress=False)
        n_values = min(values, grads.shape[1]) if values else grads.shape[1]
        for schedule in schedules:
            for n in workers:
                xs = [grads[i, :n_values].contiguous() for i in range(n)]
                row: dict[str, Any] = {
                    "family": fam,
                    "values": n_values,
                    "schedule": schedule,
                    "workers": n,
                }
                for name, cfg in CODECS.items():
                    row[name] = cell(xs, get_codec(cfg), schedule)
                base = row["mxfp8_e4m3"]["vnmse"]
                for name in CODECS:
                    row[name]["ratio to mxfp8"] = base / row[name]["vnmse"]
                rows.append(row)
                el = time.perf_counter() - t0
                d, s = row["dynamiq"], row["dynamiq span design"]
                print(
                    f"{fam:6s} {n_values:>8d} {schedule:9s} n={n:<3d} dynamiq {d['vnmse']:.3e} "
                    f"x{d['ratio to mxfp8']:.2f} {d['bits/value']:.3f} b/v bal "
                    f"{d['round balance']:.3f} | span x{s['ratio to mxfp8']:.2f} ({el:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="lm,mlm,digits")
    ap.add_argument("--values", type=int, default=1 << 21, help="values per worker (0: all)")
    ap.add_argument("--workers", default="4,8,16,32")
    ap.add_argument("--schedules", default="ring,butterfly")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = run(
        parse_families(args.family),
        args.values,
        [int(w) for w in args.workers.split(",")],
        args.schedules.split(","),
    )
    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
