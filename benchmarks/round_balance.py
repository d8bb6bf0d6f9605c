"""Issue 13 item 4 / issue 14 "Balance": the largest / mean bytes any rank sends per round, on
real gradients, for every registered codec's default, at 8, 32, 128 and 1024 ranks (ring,
butterfly, hierarchical with 8 ranks a node), for a 25 MB DDP bucket (6,553,600 values) and
DDP's 1 MiB first bucket (262,144 values).

    python benchmarks/round_balance.py --data          # build the buffers (cached, ~27 GB)
    python benchmarks/round_balance.py                 # every cell -> docs/data/round-balance.json
    python benchmarks/round_balance.py --ranks 1024 --codec dynamiq --numel 6553600
    python benchmarks/round_balance.py --report        # the Markdown table from the JSON

No cell holds every rank's buffer (1024 x 26 MB = 27 GB does not fit this machine); each gets
the exact per-round bytes from :mod:`dynamiq.collectives.balance`:

* codecs whose message sizes are known in advance (every built-in but OmniReduce):
  ``round_nbytes`` along the engine's plan, with the prologue's shared result where the
  prologue is an all-reduce of statistics (pooled ``dynamiq``'s span budgets and chunk bounds,
  ``nvfp4``'s tensor scale), reduced one rank's buffer at a time (``prologue_shared``); THC's
  prologue (an all-gather of segment scales) does not enter its sizes;
* ``omnireduce`` (sizes follow the data): ``omnireduce_round_nbytes``, which runs the plan on
  the fp32 partial sums (the codec is lossless at its default density 1) a group of chunks at
  a time, reading every rank's values of those chunks only.

``tests/collectives/test_balance.py`` checks both against ``simulate_schedule``'s
``round_bytes``, exactly, for every registered codec and schedule.

Buffers (real data, no noise): the byte-level transformer of ``benchmarks/scale.py``
(``DataConfig(max_workers=1024, train_steps=80, worker_batch=1)``, its cached weights). Rank
``w``'s buffer is worker ``w``'s gradient on its own eval-split window followed by its gradient
on its own fit-split window (disjoint text), each flattened in DDP's bucket order (parameters
in reverse registration order, each parameter's gradient contiguous), 2 x 3,323,648 values cut
to 6,553,600: the first 3,323,648 values are one whole step's gradient in DDP's order, the rest
a second step's. The 262,144-value buffer is its first 262,144 values: DDP's 1 MiB first bucket
(``head``, ``ln_f``, ``blocks.3.fc2``). Cached as a raw fp32 ``[1024, 6553600]`` file in the
data cache (``$DYNAMIQ_CACHE`` or ``~/.cache/dynamiq``), read one rank's row at a time.

At 8 ranks, ``dynamiq``, ``omnireduce``, ``nvfp4`` and ``int8`` are also simulated in full
(``simulate_schedule``, 8 x 26 MB) and their ``round_bytes`` compared
(``equals_simulate_schedule``).
Each cell records the worst round's largest / mean bytes over the ranks the schedule has send
in that round (``round_balance``), which round it is, the largest and mean bytes of that round,
the run's wall and CPU seconds, and the load average. A rerun skips cells already in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynamiq.codecs import get_codec, list_codecs
from dynamiq.collectives import Schedule, get_schedule
from dynamiq.collectives.balance import omnireduce_round_nbytes, round_balance, round_nbytes
from dynamiq.collectives.simulator import prologue_shared, simulate_schedule
from dynamiq.data.gradients import DataConfig, default_cache_dir

WORKERS = 1024
BUCKET = 6_553_600  # 25 MB of fp32: DDP's default bucket_cap_mb
FIRST_BUCKET = 262_144  # 1 MiB: DDP's first bucket
RANKS = (8, 32, 128, 1024)
SCHEDULES = ("ring", "butterfly", "hierarchical")
RANKS_PER_NODE = 8
SUB_CHUNK = 1 << 18  # the engine's default
#: the order cells run in (the issue's codecs first), then every other registered codec
FIRST = ("dynamiq", "omnireduce", "thc", "mxfp8_e4m3", "int8", "mxfp4", "nvfp4", "bf16")
#: cells also simulated in full (``simulate_schedule``) and compared, byte for byte
CHECK_RANKS, CHECK_CODECS = 8, ("dynamiq", "omnireduce", "nvfp4", "int8")
PRIORITY = (*FIRST, *(c for c in list_codecs() if c not in FIRST))
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "data" / "round-balance.json"
CONFIG = DataConfig(max_workers=WORKERS, train_steps=80, worker_batch=1)


def _paths() -> tuple[Path, Path]:
    from dynamiq.data.gradients import _hash

    stem = f"round-balance-buffers-v1-{_hash(CONFIG.to_dict())[:12]}-{WORKERS}x{BUCKET}"
    root = default_cache_dir()
    return root / f"{stem}.f32", root / f"{stem}.json"


def ddp_order(params: list[tuple[str, torch.nn.Parameter]]) -> np.ndarray:
    """Indices into the concatenated gradients of ``params`` (registration order) that put
    them in DDP's bucket order: parameters reversed, each one's gradient contiguous."""
    offsets, pos = {}, 0
    for name, p in params:
        offsets[name], pos = (pos, pos + p.numel()), pos + p.numel()
    return np.concatenate([np.arange(*offsets[name]) for name, _ in reversed(params)])


def build_buffers(progress: bool = True) -> dict[str, Any]:
    """Write the ``[WORKERS, BUCKET]`` buffers (module docstring) and their metadata (last)."""
    from dynamiq.data.gradients import _trained_model, worker_gradient

    raw, meta = _paths()
    corpus = CONFIG.build_corpus()
    model, info = _trained_model(
        CONFIG, corpus, default_cache_dir(), regenerate=False, progress=progress
    )
    params = list(model.named_parameters())
    per_step = sum(p.numel() for _, p in params)
    if 2 * per_step < BUCKET:
        raise RuntimeError(f"two steps of {per_step} values do not fill {BUCKET}")
    order = ddp_order(params)
    tmp = raw.with_suffix(".tmp")
    mm = np.memmap(tmp, dtype=np.float32, mode="w+", shape=(WORKERS, BUCKET))
    t0 = time.perf_counter()
    for w in range(WORKERS):
        a, _ = worker_gradient(CONFIG, model, corpus.worker_batch_tensor("eval", w))
        b, _ = worker_gradient(CONFIG, model, corpus.worker_batch_tensor("fit", w))
        mm[w] = np.concatenate([a[order], b[order]])[:BUCKET]
        if progress and (w % 64 == 0 or w == WORKERS - 1):
            print(
                f"worker {w + 1}/{WORKERS} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    mm.flush()
    del mm
    tmp.replace(raw)
    source = {
        "model": "byte-level transformer (dynamiq.data), benchmarks/scale.py's weights",
        "config": CONFIG.to_dict(),
        "values_per_step": per_step,
        "buffer": "worker w: DDP-order gradient on its eval window ++ on its fit window, cut",
        "final_train_loss": info.get("final_train_loss"),
        "first_train_loss": (info.get("train_loss_curve") or [None])[0],
        "seconds": time.perf_counter() - t0,
    }
    meta.write_text(json.dumps(source, indent=1))
    return source


def load_buffers() -> tuple[np.memmap, dict[str, Any]]:
    """The cached buffers (read-only memmap ``[WORKERS, BUCKET]``) and their metadata."""
    raw, meta = _paths()
    if not meta.exists():
        raise SystemExit(f"no buffers at {raw}: run `python benchmarks/round_balance.py --data`")
    mm = np.memmap(raw, dtype=np.float32, mode="r", shape=(WORKERS, BUCKET))
    return mm, json.loads(meta.read_text())


def _rows(mm: np.memmap, n: int, numel: int):
    for r in range(n):
        yield torch.from_numpy(np.array(mm[r, :numel]))


def _schedule(name: str, n: int) -> tuple[Schedule, float]:
    """The schedule, and the seconds it took to build (once for all of its cells)."""
    opts = {"ranks_per_node": RANKS_PER_NODE} if name == "hierarchical" else {}
    t0 = time.perf_counter()
    sched = get_schedule(name, n, **opts)
    return sched, time.perf_counter() - t0


def cell(mm: np.memmap, codec_id: str, sched: Schedule, numel: int) -> dict[str, Any]:
    """One cell's per-round bytes (exact) and their balance."""
    codec = get_codec(codec_id)
    n = sched.world_size
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    if codec_id == "omnireduce":
        rb = omnireduce_round_nbytes(
            lambda a, b: np.asarray(mm[:n, a:b]), numel, codec, sched, sub_chunk=SUB_CHUNK
        )
        method = "omnireduce_round_nbytes (fp32 sums, a group of chunks at a time)"
    else:
        shared = None
        method = "round_nbytes"
        if callable(getattr(codec, "prologue_statistics", None)):
            shared = prologue_shared(codec, _rows(mm, n, numel), sched)
            method += " + prologue_shared (one rank at a time)"
        rb = round_nbytes(numel, codec, sched, shared=shared, sub_chunk=SUB_CHUNK)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    checked = None
    if n <= CHECK_RANKS and codec_id in CHECK_CODECS:  # the full simulation, where it fits
        xs = list(_rows(mm, n, numel))
        sim = simulate_schedule(xs, codec, sched, sub_chunk=SUB_CHUNK, return_bound=False)
        checked = bool(np.array_equal(sim.round_bytes, rb))
        if not checked:
            raise AssertionError(f"{codec_id} {sched.name} {n}: the instrument is not exact")
    worst, k = round_balance(rb, sched, return_round=True)
    live = np.array([sched.steps[r][k].send_to is not None for r in range(n)])
    row = rb[k][live]
    return {
        "codec": codec_id,
        "schedule": sched.name.split("(")[0],  # hierarchical(g=8): ranks_per_node is 8
        "ranks": n,
        "values": numel,
        "round_balance": worst,
        "worst_round": int(k),
        "worst_round_largest_bytes": int(row.max()),
        "worst_round_mean_bytes": float(row.mean()),
        "bytes_sent_per_rank_mean": float(rb.sum() / n),
        "rounds": int(rb.shape[0]),
        "method": method,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "equals_simulate_schedule": checked,
        "load": [load0, os.getloadavg()[0]],
        "codec_config": repr(codec),
    }


#: the codecs with a column of their own in the report; the others share one (their worst)
COLUMNS = ("dynamiq", "omnireduce", "thc", "nvfp4", "nf4")


def report(rows: list[dict[str, Any]]) -> str:
    """One line per (values, ranks, schedule): the worst round's largest / mean bytes of
    :data:`COLUMNS`, the worst of every other codec (and which), the slowest cell's seconds."""
    by = {(r["values"], r["ranks"], r["schedule"], r["codec"]): r for r in rows}
    head = " | ".join(f"`{c}`" for c in COLUMNS)
    lines = [
        f"| values | ranks | schedule | {head} | every other codec (worst) | slowest: s (CPU s) |",
        "|---:|---:|---|" + "---:|" * len(COLUMNS) + "---:|---:|",
    ]
    keys = sorted(
        {(r["values"], r["ranks"], r["schedule"]) for r in rows},
        key=lambda k: (-k[0], k[1], SCHEDULES.index(k[2])),
    )
    for v, n, s in keys:
        here = [r for (v2, n2, s2, _c), r in by.items() if (v2, n2, s2) == (v, n, s)]
        vals = [
            f"{by[v, n, s, c]['round_balance']:.3f}" if (v, n, s, c) in by else "" for c in COLUMNS
        ]
        rest = [r for r in here if r["codec"] not in COLUMNS]
        worst = max(rest, key=lambda r: r["round_balance"], default=None)
        other = ""
        if worst is not None:
            tie = all(r["round_balance"] == worst["round_balance"] for r in rest)
            who = f"all {len(rest)}" if tie else f"`{worst['codec']}`, of {len(rest)}"
            other = f"{worst['round_balance']:.3f} ({who})"
        slow = max(here, key=lambda r: r["seconds"])
        secs = f"{slow['seconds']:.0f} ({slow['cpu_seconds']:.0f})"
        lines.append(f"| {v:,} | {n} | {s} | " + " | ".join(vals) + f" | {other} | {secs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", action="store_true", help="build the cached buffers and stop")
    ap.add_argument("--ranks", type=int, action="append", help=f"default {RANKS}")
    ap.add_argument("--codec", action="append", help="default: every registered codec")
    ap.add_argument("--schedule", action="append", help=f"default {SCHEDULES}")
    ap.add_argument("--numel", type=int, action="append", help=f"default {BUCKET}, {FIRST_BUCKET}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--report", action="store_true", help="print the table from --out")
    args = ap.parse_args(argv)
    if args.data:
        print(json.dumps(build_buffers()))
        return 0
    rows: list[dict[str, Any]] = json.loads(args.out.read_text()) if args.out.exists() else []
    if args.report:
        print(report(rows))
        return 0
    torch.set_num_threads(1)
    mm, source = load_buffers()
    done = {(r["codec"], r["schedule"], r["ranks"], r["values"]) for r in rows}
    for n in args.ranks or RANKS:
        for schedule in args.schedule or SCHEDULES:
            todo = [
                (numel, codec)
                for numel in args.numel or (BUCKET, FIRST_BUCKET)
                for codec in args.codec or PRIORITY
                if (codec, schedule, n, numel) not in done
            ]
            if not todo:
                continue
            sched, build = _schedule(schedule, n)
            for numel, codec in todo:
                row = cell(mm, codec, sched, numel)
                row["schedule_build_seconds"] = build
                row["data"] = source
                rows.append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(rows, indent=1))
                brief = {k: v for k, v in row.items() if k not in ("data", "codec_config")}
                print(json.dumps(brief), flush=True)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
