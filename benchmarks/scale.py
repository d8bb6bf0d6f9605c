"""Issue 13's scale table: vNMSE and bits/value at 128, 256 and 1024 ranks, on real gradients,
with the batched simulator (``dynamiq.collectives.simulator``).

    python benchmarks/scale.py                           # every cell (hours on 2 busy cores)
    python benchmarks/scale.py --ranks 128 --codec int8  # some cells
    python benchmarks/scale.py --report                  # the Markdown table from the JSON
    python benchmarks/scale.py --ranks 128 --codec dynamiq --schedule ring --profile --out X

Gradients: the byte-level transformer of ``dynamiq.data`` (CPython's docs and sources),
trained as ``dynamiq.data`` trains it but with the text cut for ``--workers`` (1024) disjoint
worker shards of the eval split (``DataConfig(max_workers=...)``: the trained weights are cached
beside the standard ones); each worker's gradient is computed as ``dynamiq.data`` computes it
and ``--values`` (2^16) coordinates are kept, drawn uniformly without replacement with a fixed
seed from all parameters (every layer type in its share). They are cached in the data cache
(``$DYNAMIQ_CACHE`` or ``~/.cache/dynamiq``). Rank ``r`` of a cell with ``n`` ranks holds
worker ``r``'s row.

Each cell is one ``simulate_schedule`` run with ``return_bound=False`` (the bounds are not
needed for vNMSE; they cost about as much as the run), torch on one thread. Recorded: vNMSE
against the fp64 sum, bits/value as ``SimResult.bits_per_value`` counts them, wall and CPU
seconds of the simulation and, apart, of building the schedule (once per schedule and rank
count, for all its codecs), the 1-minute load average before and after, the codec's
configuration, and the largest / mean bytes a rank sends in a round (over the ranks the schedule
has send in it; the worst round). Cells are appended to ``--out`` (JSON) as they finish; a
rerun skips the cells already there.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynamiq.codecs import get_codec
from dynamiq.collectives import Schedule, get_schedule
from dynamiq.collectives.balance import round_balance
from dynamiq.collectives.simulator import simulate_schedule
from dynamiq.data.gradients import DataConfig, default_cache_dir

CODECS = ("dynamiq", "mxfp8_e4m3", "int8", "mxfp4")
SCHEDULES = ("ring", "butterfly", "hierarchical")
RANKS = (128, 256, 1024)
RANKS_PER_NODE = 8
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "data" / "scale.json"


def gradients(
    workers: int, values: int, train_steps: int, worker_batch: int, progress: bool = True
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``[workers, values]`` real gradients (see the module docstring), cached, and where they
    come from."""
    from dynamiq.data.gradients import _hash, _trained_model, param_layout, worker_gradient

    cfg = DataConfig(max_workers=workers, train_steps=train_steps, worker_batch=worker_batch)
    root = default_cache_dir()
    corpus = cfg.build_corpus()
    path = root / f"scale-gradients-{_hash(cfg.to_dict())[:12]}-{workers}x{values}.npy"
    model, info = _trained_model(cfg, corpus, root, regenerate=False, progress=progress)
    source = {
        "model": dataclasses.asdict(cfg.model),
        "train_steps": train_steps,
        "worker_batch": worker_batch,
        "workers": workers,
        "values": values,
        "final_train_loss": info.get("final_train_loss"),
        "first_train_loss": (info.get("train_loss_curve") or [None])[0],
    }
    if path.exists():
        return torch.from_numpy(np.load(path)), source
    numel = sum(int(p["numel"]) for p in param_layout(model))
    idx = np.sort(np.random.default_rng(0).choice(numel, size=values, replace=False))
    out = np.empty((workers, values), dtype=np.float32)
    t0 = time.perf_counter()
    for w in range(workers):
        flat, _ = worker_gradient(cfg, model, corpus.worker_batch_tensor("eval", w))
        out[w] = flat[idx]
        if progress and (w % 64 == 0 or w == workers - 1):
            print(f"worker {w + 1}/{workers} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, out)
    tmp.replace(path)
    return torch.from_numpy(out), source


@functools.lru_cache(maxsize=1)
def built_schedule(schedule: str, n: int) -> tuple[Schedule, float, float]:
    """The schedule (built once for every codec of a row), and its wall and CPU seconds."""
    opts = {"ranks_per_node": RANKS_PER_NODE} if schedule == "hierarchical" else {}
    t0, c0 = time.perf_counter(), time.process_time()
    sched = get_schedule(schedule, n, **opts)
    return sched, time.perf_counter() - t0, time.process_time() - c0


def cell(grads: torch.Tensor, codec: str, schedule: str, n: int) -> dict[str, Any]:
    xs = [grads[r].contiguous() for r in range(n)]
    sched, s_wall, s_cpu = built_schedule(schedule, n)
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate_schedule(xs, get_codec(codec), sched, return_bound=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    exact = torch.stack([x.double() for x in xs]).sum(dim=0)
    err = run.results[0].output.double() - exact
    numel = grads.shape[1]
    sent = sum(r.bytes_sent for r in run.results)
    return {
        "codec": codec,
        "schedule": schedule,
        "ranks": n,
        "values": numel,
        "vnmse": float(err.square().sum() / exact.square().sum()),
        "bits_per_value": 8 * sent / n / (2 * (n - 1) / n * numel),
        "round_balance": round_balance(run.round_bytes, sched),
        "seconds": wall,
        "cpu_seconds": cpu,
        "schedule_seconds": s_wall,
        "schedule_cpu_seconds": s_cpu,
        "load": [load0, os.getloadavg()[0]],
        "codec_config": repr(get_codec(codec)),
        "phases": run.seconds,
    }


def _schedule_time(r: dict[str, Any]) -> str:
    if "schedule_seconds" not in r:  # older rows: the schedule's time is in the cell's
        return "(in the cell's)"
    return f"{r['schedule_seconds']:.0f} ({r['schedule_cpu_seconds']:.1f})"


def _load(r: dict[str, Any]) -> str:
    return f"{r['load'][0]:.0f}→{r['load'][1]:.0f}" if "load" in r else ""


def report(rows: list[dict[str, Any]]) -> str:
    """The table; for the ring, also the vNMSE that growth linear in ``n - 1`` from the
    fewest ranks measured predicts (the fewest of at least ``min(RANKS)`` where measured:
    smaller rings are the baselines of other comparisons)."""
    lines = [
        "| ranks | schedule | codec | vNMSE | ring: linear prediction | bits/value "
        "| largest/mean bytes per round | s (CPU s) | schedule s (CPU s) | load |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    key = {c: i for i, c in enumerate(CODECS)}
    base: dict[str, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: (r["ranks"] < min(RANKS), r["ranks"])):
        if r["schedule"] == "ring":
            base.setdefault(r["codec"], r)
    for r in sorted(rows, key=lambda r: (r["ranks"], r["schedule"], key.get(r["codec"], 9))):
        pred = ""
        b = base.get(r["codec"])
        if r["schedule"] == "ring" and b is not None and b["ranks"] < r["ranks"]:
            pred = f"{b['vnmse'] * (r['ranks'] - 1) / (b['ranks'] - 1):.3g}"
        lines.append(
            f"| {r['ranks']} | {r['schedule']} | `{r['codec']}` | {r['vnmse']:.3g} | {pred} | "
            f"{r['bits_per_value']:.3f} | {r['round_balance']:.2f} | "
            f"{r['seconds']:.0f} ({r['cpu_seconds']:.1f}) | {_schedule_time(r)} | "
            f"{_load(r)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, action="append", help=f"default {RANKS}")
    ap.add_argument("--codec", action="append", help=f"default {CODECS}")
    ap.add_argument("--schedule", action="append", help=f"default {SCHEDULES}")
    ap.add_argument("--workers", type=int, default=max(RANKS))
    ap.add_argument("--values", type=int, default=1 << 16)
    ap.add_argument("--train-steps", type=int, default=DataConfig().train_steps)
    ap.add_argument("--worker-batch", type=int, default=DataConfig().worker_batch)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--report", action="store_true", help="print the table from --out")
    ap.add_argument(
        "--profile", action="store_true", help="cProfile each cell (top 30 by cumulative time)"
    )
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = json.loads(args.out.read_text()) if args.out.exists() else []
    if args.report:
        print(report(rows))
        return 0
    torch.set_num_threads(1)
    grads, source = gradients(args.workers, args.values, args.train_steps, args.worker_batch)
    done = {
        (r["codec"], r["schedule"], r["ranks"], r["values"]) for r in rows if r["data"] == source
    }
    for n in args.ranks or RANKS:
        for schedule in args.schedule or SCHEDULES:
            for codec in args.codec or CODECS:
                if (codec, schedule, n, args.values) in done:
                    continue
                prof = cProfile.Profile() if args.profile else None
                if prof is not None:
                    prof.enable()
                row = cell(grads, codec, schedule, n)
                if prof is not None:
                    prof.disable()
                    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
                row["data"] = source
                rows.append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(rows, indent=1))
                brief = {k: v for k, v in row.items() if k not in ("phases", "data")}
                print(json.dumps(brief), flush=True)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
