"""The fault matrix: every fault of :mod:`dynamiq.testing.faults` over schedules × codecs ×
2–4 gloo ranks, with ``verify`` on and off (docs/reliability.md, "The fault matrix").

``python -m dynamiq.testing.faultmatrix [--worlds 2,3,4] [--json FILE]`` runs it all and
prints the summary table; :func:`run_matrix` is what the tests call (a subset of it in the
default run). Per world size and ``verify``, one set of processes runs every cell in turn
(the process group is reused while cells end cleanly; a fresh one follows a cell in which any
rank raised, as a gloo timeout closes the group's connections); a ``kill`` cell needs its own
processes (run with ``verify`` on only: the death comes before any check). Rank
:data:`VICTIM` is the faulty one; ``config`` runs it with another ``step``.

A cell's verdict (:func:`verdict`): ``correct`` (every rank returned the clean run's result),
``same error everywhere`` (every rank raised the same error: the status exchange carried the
cause), ``named error everywhere`` (every rank raised one of dynamiq's errors, some a
consequence such as a peer's timeout), ``error on some ranks``, ``WRONG`` (a rank returned
another result than the clean run) or ``DIVERGENT`` (ranks returned different results), and
``n/a`` where the fault did not strike (no header: fixed-size codec). A process that died by
a signal, or a rank slower than the timeout (+ the stall) + 2 s, is counted apart.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dynamiq.collectives.handshake import allreduce_steps

from .distributed import run_gloo
from .faults import FAULTS, KILLED, FaultyTransport

__all__ = ["CODECS", "SCENARIOS", "SCHEDULES", "Cell", "run_matrix", "summarize", "verdict"]

SCHEDULES = ("ring", "butterfly", "tree", "hierarchical")
#: the codecs, configured small (fast on 2 cores; each chunk two sub-chunks of 4096 values)
CODECS: dict[str, Any] = {
    "int8": "int8",
    "mxfp8_e4m3": "mxfp8_e4m3",
    "dynamiq": {"id": "dynamiq", "span": 4096},
    "thc": {"id": "thc", "block_size": 1024},
    "omnireduce": {"id": "omnireduce", "density": 0.5, "block_size": 64},
}
SCENARIOS = ("clean", *FAULTS, "config")
VICTIM = 1
SUB_CHUNK = 4096
#: the bit flipped: payload (bit 0 of its first byte), header (bit 7 of the length: another
#: size the codec can produce), bound (the lowest exponent bit: twice or half the bound),
#: prologue (bit 30 of a 4-byte value: the top exponent bit of THC's fp32 scale; bit 6 of
#: DynamiQ's int8 demand code: 64 units more or less)
_FLIP = {"payload": 0, "header": 7, "bound": 0, "prologue": 30}
_NAMED = (
    "IntegrityError",
    "PeerTimeoutError",
    "ConfigMismatchError",
    "ValueError",
    "TransportError",
)


@dataclass(frozen=True)
class Cell:
    world: int
    schedule: str
    codec: str
    fault: str  # one of SCENARIOS
    verify: bool


@dataclass
class Outcome:
    """One cell's result: per rank, ``"ok <digest>"`` or ``"<Error>: <text>"``, seconds."""

    cell: Cell
    ranks: list[str]
    seconds: list[float]
    applied: bool = True
    deaths: int = 0  # processes killed by a signal
    slow: int = 0  # ranks slower than the timeout (+ stall) + 2 s
    verdict: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- one rank --------------------------------------------------------------------------------


def _inputs(rank: int, cell: Cell) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + SCHEDULES.index(cell.schedule))
    return torch.randn(cell.world * 2 * SUB_CHUNK, generator=g) * (1 + rank)


def _schedule_options(cell: Cell) -> dict[str, Any]:
    if cell.schedule != "hierarchical":
        return {}
    return {"ranks_per_node": 3 if cell.world == 3 else 2}


def _strike_at(cell: Cell) -> int:
    """Which message the fault strikes: reorder the first two sub-chunks; the first message
    of DynamiQ's prologue all-reduce in its all-gather half (its reduce-scatter takes one
    message a step, :func:`~dynamiq.collectives.handshake.allreduce_steps`: only some ranks
    would see it), THC's first; else the second payload."""
    if cell.fault == "prologue":
        if cell.codec != "dynamiq":
            return 0
        return sum(1 for *_, reducing in allreduce_steps(cell.world, 1 << 20, VICTIM) if reducing)
    return 0 if cell.fault == "reorder" else 1


def _run_cell(rank: int, cell: Cell, group: Any, timeout: float) -> tuple[str, float, bool]:
    from dynamiq.collectives import allreduce
    from dynamiq.collectives.transport import TorchDistTransport

    tr: Any = TorchDistTransport(group)
    faulty = None
    if rank == VICTIM and cell.fault in FAULTS:
        flip = _FLIP.get(cell.fault, 0)
        at = _strike_at(cell)
        faulty = tr = FaultyTransport(
            tr, cell.fault, at=at, verify=cell.verify, stall=timeout + 1, flip=flip
        )
    x = _inputs(rank, cell)
    bound = cell.fault in ("clean", "bound")
    t0 = time.perf_counter()
    try:
        stats: Any = allreduce(
            x,
            CODECS[cell.codec],
            cell.schedule,
            transport=tr,
            threshold=0,
            timeout=timeout,
            sub_chunk=SUB_CHUNK,
            verify=cell.verify,
            return_bound=bound,
            step=1 if cell.fault == "config" and rank == VICTIM else 0,
            schedule_options=_schedule_options(cell),
        )
        h = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12]
        b = stats.bound
        hb = hashlib.sha256(b.numpy().tobytes()).hexdigest()[:12] if b is not None else "-"
        text = f"ok {h} {hb}"
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
    return text, time.perf_counter() - t0, faulty.applied if faulty is not None else True


def _job(rank: int, world: int, cells: list[Cell], timeout: float) -> list[tuple[str, float, bool]]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    out = []
    for i, cell in enumerate(cells):
        res = _run_cell(rank, cell, group, timeout)
        out.append(res)
        if i == len(cells) - 1:  # (after a kill the default group is broken too)
            break
        failed = torch.tensor([0 if res[0].startswith("ok") else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # on the default group: it is healthy
        if int(failed):
            group = dist.new_group(list(range(world)))
    return out


# -- the parent ------------------------------------------------------------------------------


def verdict(out: Outcome, clean: list[str] | None) -> str:
    """The cell's verdict from its ranks' outcomes (``clean``: the clean run's)."""
    ranks = [t for i, t in enumerate(out.ranks) if not (out.cell.fault == "kill" and i == VICTIM)]
    if not out.applied:
        return "n/a"
    oks = [t for t in ranks if t.startswith("ok")]
    if len(oks) == len(ranks):
        if len(set(oks)) > 1:
            return "DIVERGENT"
        want = clean[0] if clean else oks[0]
        same = oks[0].split()[1] == want.split()[1]
        if out.cell.fault == "bound":
            same = same and oks[0] == want
        return "correct" if same else "WRONG"
    if oks:
        return "error on some ranks"
    if all(t.split(":")[0] in _NAMED for t in ranks):
        return "same error everywhere" if len(set(ranks)) == 1 else "named error everywhere"
    return "other error"


def _spawn(world: int, cells: list[Cell], timeout: float) -> list[Outcome]:
    codes: list[int | None] = []
    budget = 60 + len(cells) * (2 * timeout + 4)
    results = run_gloo(_job, world, cells, timeout, timeout=budget, pg_timeout=120, exitcodes=codes)
    deaths = sum(1 for c in codes if c is not None and c < 0)
    outs = []
    for i, cell in enumerate(cells):
        texts, secs, applied = [], [], True
        for status, value in results:
            if cell.fault == "kill" and status != "ok":
                texts.append("killed")
                secs.append(0.0)
            elif status == "ok":
                texts.append(value[i][0])
                secs.append(value[i][1])
                applied = applied and value[i][2]
            else:
                texts.append(f"{status}: {str(value)[-300:]}")
                secs.append(float("inf"))
        stall = timeout + 1 if cell.fault == "stall" else 0.0
        slow = sum(1 for s in secs if s > timeout + stall + 2)
        outs.append(Outcome(cell, texts, secs, applied, deaths if i == 0 else 0, slow))
    if cells and cells[0].fault == "kill":
        outs[0].extra["exitcodes"] = codes
        outs[0].deaths = sum(1 for c in codes if c is not None and c < 0)
        victim_ok = codes[VICTIM] == KILLED
        outs[0].applied = victim_ok
    return outs


def run_matrix(
    worlds: Sequence[int] = (2, 3, 4),
    schedules: Sequence[str] = SCHEDULES,
    codecs: Sequence[str] = tuple(CODECS),
    faults: Sequence[str] = SCENARIOS,
    verify: Sequence[bool] = (True, False),
    timeout: float = 2.0,
    log: Any = None,
) -> list[Outcome]:
    """Run the cells of the matrix; each with its verdict set."""
    outs: list[Outcome] = []
    for world, v in itertools.product(worlds, verify):
        grid = list(itertools.product(schedules, codecs))
        cells = [Cell(world, s, c, f, v) for s, c in grid for f in faults if f != "kill"]
        clean_first = sorted(cells, key=lambda c: c.fault != "clean")
        batch = _spawn(world, clean_first, timeout)
        if "kill" in faults and v:  # (a death comes before any check: verify on only)
            for s, c in grid:
                batch += _spawn(world, [Cell(world, s, c, "kill", v)], timeout)
        clean = {(o.cell.schedule, o.cell.codec): o.ranks for o in batch if o.cell.fault == "clean"}
        for o in batch:
            o.verdict = verdict(o, clean.get((o.cell.schedule, o.cell.codec)))
            if log is not None:
                print(_line(o), file=log, flush=True)
        outs += batch
    return outs


def _line(o: Outcome) -> str:
    c = o.cell
    t = max((s for s in o.seconds if s != float("inf")), default=0.0)
    return (
        f"n={c.world} verify={int(c.verify)} {c.schedule:12s} {c.codec:10s} {c.fault:8s} "
        f"{o.verdict:22s} {t:5.2f}s deaths={o.deaths} slow={o.slow} | {o.ranks[0][:110]}"
    )


def summarize(outs: list[Outcome]) -> str:
    """A markdown table: per scenario and ``verify``, the cells by verdict and the slowest
    rank's time (max over cells); then the totals of signal deaths and slow ranks."""
    rows: dict[tuple[str, bool], Counter[str]] = defaultdict(Counter)
    worst: dict[tuple[str, bool], float] = defaultdict(float)
    for o in outs:
        key = (o.cell.fault, o.cell.verify)
        rows[key][o.verdict] += 1
        finite = [s for s in o.seconds if s != float("inf")]
        worst[key] = max(worst[key], max(finite, default=0.0))
    lines = ["| scenario | verify | cells by verdict | slowest rank (s) |", "|---|---|---|---|"]
    for f, v in itertools.product(SCENARIOS, (True, False)):
        if (f, v) in rows:
            got = ", ".join(f"{k}: {n}" for k, n in sorted(rows[(f, v)].items()))
            lines.append(f"| {f} | {'on' if v else 'off'} | {got} | {worst[(f, v)]:.1f} |")
    deaths = sum(o.deaths for o in outs)
    slow = sum(o.slow for o in outs)
    bad = sum(1 for o in outs if o.cell.verify and o.verdict in ("WRONG", "DIVERGENT"))
    lines.append("")
    lines.append(
        f"{len(outs)} cells; signal deaths: {deaths}; ranks past the timeout + 2 s: {slow}; "
        f"wrong or divergent with verify on: {bad}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynamiq.testing.faultmatrix")
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--faults", default=",".join(SCENARIOS))
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--json", help="write every cell's outcome here")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    outs = run_matrix(
        [int(w) for w in a.worlds.split(",")],
        a.schedules.split(","),
        a.codecs.split(","),
        a.faults.split(","),
        timeout=a.timeout,
        log=sys.stdout,
    )
    print(summarize(outs))
    print(f"wall time: {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(o) for o in outs], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
