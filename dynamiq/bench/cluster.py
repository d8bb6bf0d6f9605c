"""``dynamiq bench cluster``: all-reduce time on an emulated bandwidth-limited cluster
(docs/design.md, "Measures": cluster speed is a ratio in one run).

``N`` ranks, each a process in its own network namespace (:class:`~dynamiq.bench.netns.
EmulatedCluster`), joined by a bridge through links shaped with ``tc`` to one rate in each
direction. gloo runs over those links. In one run, for each rate, every rank all-reduces the
same fp32 buffer with:

* PyTorch's own ``dist.all_reduce`` of the fp32 buffer, and of its bf16 cast (what
  ``bf16_compress_hook`` does with a bucket: cast, all-reduce, cast back);
* :func:`dynamiq.collectives.allreduce` with every codec × schedule asked for.

Each method runs ``warmup`` untimed then ``repeats`` timed all-reduces, each started together
after a barrier; a repeat's time is the slowest rank's, and the table gives the median over
repeats. With ``rotations`` R > 1 the whole list of methods runs R times in turn (A, B, A, B,
...), and each row pools its method's R × ``repeats`` calls: two methods whose difference is
smaller than the machine's drift over minutes are then sampled over the same minutes.
Beside it: the speed-up against PyTorch bf16 and fp32, the *ideal* speed-up against bf16
(16 bits ÷ the codec's bits per value on the wire), the bytes each rank's interface really
sent (the kernel's counters, read after the barriers around the timed repeats: payload plus
TCP/IP headers and ACKs) next to the engine's own accounting (``AllReduceStats``), the link
throughput they amount to, and where each rank's time went (the engine's phases:
``encode``, ``reduce`` — the fused decompress-accumulate-recompress —, ``decode``, ``wait`` —
for data from a peer, i.e. transfer and peers' lag —, ``prologue``, ``agree``; ``other`` is
the rest of the call).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dynamiq.bench.args import parse_codecs, print_json, split_list
from dynamiq.bench.netns import EmulatedCluster, NamespaceUnavailable, check_available, parse_rate

__all__ = [
    "DEFAULT_CODECS",
    "DEFAULT_SCHEDULES",
    "ClusterBenchConfig",
    "add_parser",
    "markdown_report",
    "run_cluster_bench",
    "run_workers",
    "text_report",
]

DEFAULT_CODECS = ("fp32", "bf16", "mxfp8_e4m3", "mxfp4", "int8", "thc", "omnireduce", "dynamiq")
DEFAULT_SCHEDULES = ("ring", "butterfly")
PHASES = ("prologue", "encode", "reduce", "decode", "wait", "agree")
_PORT = 29500  # free in any fresh namespace
_TORCH_BITS = {"fp32": 32, "bf16": 16}


@dataclass(frozen=True)
class ClusterBenchConfig:
    """What ``dynamiq bench cluster`` measures (see ``dynamiq bench cluster --help``)."""

    ranks: int = 4
    rates: tuple[str, ...] = ("100mbit",)
    delay_ms: float = 0.1
    numel: int = 16 << 20  # 64 MiB of fp32
    codecs: tuple[Any, ...] = DEFAULT_CODECS
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    baselines: tuple[str, ...] = ("fp32", "bf16")
    warmup: int = 1
    repeats: int = 3
    data: str = "real"
    seed: int = 0
    sub_chunk: int = 1 << 18
    threads: int = 1
    compile: bool = False
    timeout: float = 900.0
    sysctls: tuple[tuple[str, str], ...] = ()
    collective: str = "allreduce"
    verify: tuple[bool, ...] = (False,)  # each codec row with verify off and/or on
    rotations: int = 1  # the methods run this many times in turn, their calls pooled

    def __post_init__(self) -> None:
        if not 2 <= self.ranks <= 64:
            raise ValueError(f"ranks must be in 2..64 (got {self.ranks})")
        if not self.rates:
            raise ValueError("rates must name at least one rate")
        for r in self.rates:
            parse_rate(r)
        if self.numel < 1:
            raise ValueError(f"numel must be positive (got {self.numel})")
        self._check_methods()
        if self.rotations < 1:
            raise ValueError(f"rotations must be >= 1 (got {self.rotations})")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(
                f"warmup must be >= 0 and repeats >= 1 (got {self.warmup}, {self.repeats})"
            )
        if self.data not in ("real", "slice", "randn"):
            raise ValueError(f"data must be 'real', 'slice' or 'randn' (got {self.data!r})")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1 (got {self.threads})")
        EmulatedCluster(self.ranks, self.rates[0], self.delay_ms, sysctls=dict(self.sysctls))

    def _check_methods(self) -> None:
        """The codecs, schedules and baselines: known, and something to measure."""
        from dynamiq.codecs import get_codec
        from dynamiq.collectives import get_schedule

        for c in self.codecs:
            get_codec(c)  # raises UnknownCodecError naming the known ids
        for s in self.schedules:
            get_schedule(s, self.ranks)
        for b in self.baselines:
            if b not in _TORCH_BITS:
                raise ValueError(f"baselines must be among fp32, bf16 (got {b!r})")
        if self.collective not in ("allreduce", "reduce_scatter"):
            raise ValueError(
                f"collective must be 'allreduce' or 'reduce_scatter' (got {self.collective!r})"
            )
        if self.collective == "reduce_scatter":
            _check_reduce_scatter(self.ranks, self.numel, self.schedules)
        if not self.codecs and not self.baselines:
            raise ValueError("nothing to measure: no codecs and no baselines")
        if self.codecs and not self.schedules:
            raise ValueError("codecs need at least one schedule")


def _check_reduce_scatter(ranks: int, numel: int, schedules: Sequence[str]) -> None:
    """Reduce-scatter rows give rank ``r`` FSDP's range ``[r·S, (r+1)·S)``: ``numel`` must
    split evenly, and each schedule must let every rank own one caller-given range."""
    from dynamiq.collectives import get_schedule
    from dynamiq.collectives.api import _bounds_by_chunk

    if numel % ranks:
        raise ValueError(f"reduce_scatter: numel {numel} is not a multiple of ranks {ranks}")
    for s in schedules:
        _bounds_by_chunk(get_schedule(s, ranks), [(0, 0)] * ranks)


def _methods(cfg: ClusterBenchConfig) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"kind": "torch", "dtype": b, "label": f"pytorch gloo {b}"} for b in cfg.baselines
    ]
    for codec in cfg.codecs:
        name = codec if isinstance(codec, str) else json.dumps(codec, sort_keys=True)
        for sched, verify in itertools.product(cfg.schedules, cfg.verify):
            label = f"{name} {sched}" + (" verify" if verify else "")
            out.append(
                {
                    "kind": "dynamiq",
                    "codec": codec,
                    "schedule": sched,
                    "verify": verify,
                    "label": label,
                }
            )
    return out


def run_workers(
    cl: EmulatedCluster, spec: dict[str, Any], tmp: str, progress: bool = False
) -> list[dict[str, Any]]:
    """Run :mod:`dynamiq.bench._cluster_worker` on every rank of ``cl`` with ``spec`` (the
    methods and settings; written to ``tmp``, where the ranks also write their results) and
    return each rank's results. Raises ``RuntimeError`` with the failing rank's log."""
    defaults = {"warmup": 0, "repeats": 1, "sub_chunk": 1 << 18, "timeout": 120.0, "seed": 0}
    spec = {**defaults, "data": "randn", "threads": 1, "ifname": cl.ifname, **spec}
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    procs, logs = [], []
    for r in range(cl.n):
        log_path = os.path.join(tmp, f"rank{r}.log")
        logs.append(log_path)
        argv = [sys.executable, "-m", "dynamiq.bench._cluster_worker", "--rank", str(r)]
        argv += ["--world", str(cl.n), "--master", f"{cl.addresses[0]}:{_PORT}"]
        argv += ["--spec", spec_path, "--out", os.path.join(tmp, f"rank{r}.json")]
        # rank 0's progress lines go to our stderr; everything else to a log shown on failure
        err: Any = None if (r == 0 and progress) else open(log_path, "w")  # noqa: SIM115
        # c10d warns that the namespace cannot resolve its peers' host names: harmless
        env = {"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
        procs.append(cl.popen(r, argv, env=env, stdout=subprocess.DEVNULL, stderr=err))
        if err is not None:
            err.close()
    limit = float(spec["timeout"]) * 2 + 600
    deadline = time.monotonic() + limit
    failed: int | None = None
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None or all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"the ranks did not finish within {limit:.0f} s")
    if failed is not None:
        tail = ""
        with contextlib.suppress(OSError), open(logs[failed]) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(
            f"rank {failed} failed (exit {procs[failed].returncode}):\n"
            + (tail or ("(its messages are above)" if failed == 0 and progress else "(no log)"))
        )
    out = []
    for r in range(cl.n):
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _pooled(rank: dict[str, Any]) -> dict[str, Any]:
    """One rank's results with the rotations of each method merged, in first-run order:
    their calls' times, CPU times and stats one after the other, their byte counters summed
    (the rows divide them by the calls)."""
    merged: dict[str, dict[str, Any]] = {}
    for res in rank["results"]:
        key = json.dumps(res["method"], sort_keys=True, default=str)
        got = merged.get(key)
        if got is None:
            merged[key] = {**res, "counters": dict(res["counters"])}
            for field in ("times", "cpu_times", "stats"):
                merged[key][field] = list(res[field])
            continue
        for field in ("times", "cpu_times", "stats"):
            got[field] += res[field]
        for k, v in res["counters"].items():
            got["counters"][k] = got["counters"].get(k, 0) + v
    return {**rank, "results": list(merged.values())}


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _summarise(
    cfg: ClusterBenchConfig, rate: str, per_rank: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    n, numel = cfg.ranks, cfg.numel
    # values a rank sends in ring/butterfly (a reduce-scatter is half of an all-reduce)
    carried = (1 if cfg.collective == "reduce_scatter" else 2) * (n - 1) / n * numel
    rate_bps = parse_rate(rate)
    rows: list[dict[str, Any]] = []
    for k, _ in enumerate(per_rank[0]["results"]):
        results = [pr["results"][k] for pr in per_rank]
        method = results[0]["method"]
        reps = len(results[0]["times"])
        # a repeat lasts until its slowest rank is done
        per_repeat = [max(res["times"][i] for res in results) for i in range(reps)]
        seconds = _median(per_repeat)
        wire_tx = statistics.mean(res["counters"]["tx_bytes"] for res in results) / reps
        wire_rx = statistics.mean(res["counters"]["rx_bytes"] for res in results) / reps
        row: dict[str, Any] = {
            "rate": rate,
            "method": "pytorch"
            if method["kind"] == "torch"
            else ("dynamiq verify" if method.get("verify") else "dynamiq"),
            "codec": method.get("dtype") if method["kind"] == "torch" else method["codec"],
            "schedule": "gloo" if method["kind"] == "torch" else method["schedule"],
            "seconds": seconds,
            "seconds_min": min(per_repeat),
            "seconds_max": max(per_repeat),
            "repeats_s": per_repeat,  # each call's slowest rank, every rotation's
        }
        if method["kind"] == "torch":
            bits = float(_TORCH_BITS[method["dtype"]])
            ours = bits / 8 * carried
            row["accounting"] = "ring ideal"
            phases: dict[str, float] = {}
        else:
            sent = statistics.mean(
                s["bytes_sent"] + s["control_bytes_sent"] for res in results for s in res["stats"]
            )
            bits = (
                8
                * statistics.mean(s["bytes_sent"] for res in results for s in res["stats"])
                / carried
            )
            ours = sent
            row["accounting"] = "AllReduceStats"
            phases = {
                ph: statistics.mean(
                    _median([s["seconds"].get(ph, 0.0) for s in res["stats"]]) for res in results
                )
                for ph in (*PHASES, "total")
            }
        row["bits/value"] = bits
        row["ideal vs bf16"] = 16.0 / bits
        row["wire MB/rank"] = wire_tx / 1e6
        row["wire rx MB/rank"] = wire_rx / 1e6
        row["ours MB/rank"] = ours / 1e6
        row["wire/ours"] = wire_tx / ours if ours else float("nan")
        row["link use"] = wire_tx * 8 / seconds / rate_bps if seconds > 0 else float("nan")
        row["transfer floor s"] = wire_tx * 8 / rate_bps
        # CPU: what each rank's process used (all threads), and the time all ranks' CPU work
        # needs on this machine's cores even if it overlapped perfectly with the transfers
        cpu = statistics.mean(_median(res["cpu_times"]) for res in results)
        row["cpu s/rank"] = cpu
        row["cpu floor s"] = cpu * n / (os.cpu_count() or 1)
        if phases:
            total = phases.pop("total")
            for ph in PHASES:
                row[f"{ph} s"] = phases[ph]
            # per rank, time in the call but outside the engine's phases (result copy etc.)
            row["other s"] = max(
                0.0, statistics.mean(_median(res["times"]) for res in results) - total
            )
        rows.append(row)
    for base in ("bf16", "fp32"):
        ref = next((r for r in rows if r["method"] == "pytorch" and r["codec"] == base), None)
        for r in rows:
            r[f"vs pytorch {base}"] = ref["seconds"] / r["seconds"] if ref else None
    return rows


def run_cluster_bench(cfg: ClusterBenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns ``{"meta": …, "runs": [{"rate", "shaping", "rows"}]}``.

    Raises :class:`~dynamiq.bench.netns.NamespaceUnavailable` where namespaces are not
    permitted, ``RuntimeError`` if a rank fails.
    """
    check_available()
    if cfg.data == "real":
        from dynamiq.data import load_gradients

        load_gradients("eval", 32, progress=progress)  # generate once, before the ranks load it
    meta: dict[str, Any] = {
        "command": "dynamiq bench cluster",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}",
        "python": platform.python_version(),
        "load_before": list(os.getloadavg()),
    }
    import torch

    meta["torch"] = torch.__version__
    methods = _methods(cfg) * cfg.rotations
    runs = []
    for rate in cfg.rates:
        if progress:
            turns = f", {cfg.rotations} rotations" if cfg.rotations > 1 else ""
            print(
                f"{rate}: {cfg.ranks} ranks, {len(methods) // cfg.rotations} methods{turns}, "
                f"{cfg.numel * 4 / 2**20:g} MiB fp32, {cfg.warmup} warm-up + {cfg.repeats} "
                "timed each",
                file=sys.stderr,
                flush=True,
            )
        spec = {
            "methods": methods,
            "numel": cfg.numel,
            "data": cfg.data,
            "seed": cfg.seed,
            "warmup": cfg.warmup,
            "repeats": cfg.repeats,
            "sub_chunk": cfg.sub_chunk,
            "threads": cfg.threads,
            "compile": cfg.compile,
            "timeout": cfg.timeout,
            "collective": cfg.collective,
            "progress": progress,
            "tag": f"{rate} ",
        }
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        with EmulatedCluster(cfg.ranks, rate, cfg.delay_ms, sysctls=dict(cfg.sysctls)) as cl:
            spec["ifname"] = cl.ifname
            with tempfile.TemporaryDirectory(prefix="dynamiq-cluster-") as tmp:
                per_rank = run_workers(cl, spec, tmp, progress)
            shaping = dict(cl.shaping)
        runs.append(
            {
                "rate": rate,
                "shaping": shaping,
                "wall_seconds": time.perf_counter() - t0,
                # other processes compete with the ranks for the cores: say how busy it was
                "load_average_1min": [load0, os.getloadavg()[0]],
                "rows": _summarise(cfg, rate, [_pooled(pr) for pr in per_rank]),
            }
        )
    meta["load_after"] = list(os.getloadavg())
    return {"meta": meta, "runs": runs}


# -- reports ----------------------------------------------------------------------------------

_COLUMNS = (
    "method",
    "codec",
    "schedule",
    "seconds",
    "vs pytorch bf16",
    "vs pytorch fp32",
    "ideal vs bf16",
    "bits/value",
    "wire MB/rank",
    "ours MB/rank",
    "wire/ours",
    "link use",
    "transfer floor s",
    "cpu floor s",
    "encode s",
    "reduce s",
    "decode s",
    "wait s",
    "prologue s",
    "other s",
)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if not isinstance(v, str):
        return json.dumps(v, sort_keys=True)
    return v


def _shaping_line(run: dict[str, Any]) -> str:
    sh = run["shaping"]
    line = f"{run['rate']} per direction per rank, shaped with {sh.get('qdisc')}"
    if sh.get("delay_applied"):
        line += f", delay {sh.get('delay_ms')} ms per direction"
    else:
        line += f"; DELAY NOT APPLIED: {sh.get('delay_not_applied_because', 'unknown reason')}"
    tcp = sh.get("tcp") or {}
    if tcp:
        line += "; TCP: " + ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in tcp.items())
    if "load_average_1min" in run:
        a, b = run["load_average_1min"]
        line += f"; 1-min load average {a:.1f} at the start, {b:.1f} at the end"
    return line


def text_report(result: dict[str, Any]) -> str:
    """Terminal tables, one per rate."""
    from dynamiq.bench.cli import format_table

    parts = []
    for run in result["runs"]:
        rows = [{c: _cell(r.get(c)) for c in _COLUMNS} for r in run["rows"]]
        parts.append(_shaping_line(run))
        parts.append(format_table(rows, _COLUMNS))
    cfg = result["meta"]["config"]
    parts.append(_legend(cfg))
    return "\n\n".join(parts)


def _legend(cfg: dict[str, Any]) -> str:
    rs = cfg.get("collective") == "reduce_scatter"
    return (
        (
            "Reduce-scatter (rank r gets [r·S, (r+1)·S)): pytorch rows are gloo's "
            "reduce_scatter_tensor. "
            if rs
            else ""
        )
        + f"{cfg['ranks']} ranks, {cfg['numel'] * 4 / 2**20:g} MiB fp32 ({cfg['data']} data); "
        f"seconds: median over {cfg['repeats'] * cfg.get('rotations', 1)} repeats of the "
        "slowest rank. vs pytorch X: "
        "PyTorch's time / this time. ideal vs bf16: 16 / bits per value (bytes ratio). "
        "wire MB/rank: the interface's tx bytes per all-reduce (kernel counters), ours: "
        "AllReduceStats (pytorch rows: ring ideal). link use: wire bits / (time x rate). "
        "transfer floor: wire bits / rate; cpu floor: all ranks' CPU seconds / cores (each "
        "bounds the time from below). "
        "Phases (mean over ranks): encode, reduce (fused decompress-add-recompress), decode, "
        "wait (for a peer's data: transfer and peers' lag), prologue, other (rest of the call)."
    )


def markdown_report(result: dict[str, Any]) -> str:
    """The tables as Markdown (for docs/benchmarks.md)."""
    lines = []
    for run in result["runs"]:
        lines.append(f"**{_shaping_line(run)}**\n")
        lines.append("| " + " | ".join(_COLUMNS) + " |")
        lines.append("|" + "---|" * len(_COLUMNS))
        for r in run["rows"]:
            lines.append("| " + " | ".join(_cell(r.get(c)) for c in _COLUMNS) + " |")
        lines.append("")
    lines.append(_legend(result["meta"]["config"]))
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------


#: the one-line help of ``dynamiq bench cluster``
HELP = "all-reduce time on an emulated bandwidth-limited cluster (root; namespaces)"


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verify",
        choices=("off", "on", "both"),
        default="off",
        help="dynamiq rows with verify=True (per-message checksums and the status exchange), "
        "without, or both in the same run (default off)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _add_timing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed all-reduces per method (default 1)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed all-reduces per method; the table gives the median (default 3)",
    )
    p.add_argument(
        "--rotations",
        type=int,
        default=1,
        help="run the whole list of methods this many times in turn (A, B, A, B, ...) and "
        "pool each method's calls in its row: for differences below the machine's drift "
        "(default 1)",
    )


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    """Add ``cluster`` to the ``dynamiq bench`` sub-commands."""
    p: argparse.ArgumentParser = bsub.add_parser(
        "cluster",
        help=HELP,
        description="Build an emulated cluster on this machine: RANKS processes, each in its "
        "own network namespace, joined by a bridge through veth links shaped with tc to RATE "
        "in each direction (netem with the delay where the kernel has it, else tbf: rate "
        "only, and the output says the delay is missing). gloo runs over those links. Then "
        "time, in one run, PyTorch's own gloo all-reduce in fp32 and bf16 against dynamiq's "
        "allreduce with each codec and schedule, and report speed-ups, bytes on the wire "
        "(interface counters) beside dynamiq's accounting, and per-phase time. Needs root; "
        "exits 2 where namespaces are not permitted. The namespaces are removed at the end, "
        "on Ctrl-C and on failure.",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=4,
        help="number of ranks, one process and namespace each (default 4)",
    )
    p.add_argument(
        "--rate",
        default="100mbit",
        help="link rate per direction, tc syntax (100mbit, 1gbit); comma-separated for "
        "several runs, e.g. 100mbit,1gbit (default 100mbit)",
    )
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.1,
        help="delay added per link direction, ms (default 0.1; needs netem: with the tbf "
        "fallback it is not applied, and the output says so)",
    )
    p.add_argument(
        "--size-mib", type=float, default=64.0, help="fp32 buffer size in MiB (default 64)"
    )
    p.add_argument(
        "--codecs",
        default=",".join(DEFAULT_CODECS),
        help="dynamiq codecs: comma-separated ids, or a JSON list of ids and configs ('' for "
        f"none; default {','.join(DEFAULT_CODECS)})",
    )
    p.add_argument(
        "--schedules",
        default=",".join(DEFAULT_SCHEDULES),
        help="dynamiq schedules, comma-separated: ring, butterfly, tree, hierarchical "
        "(default ring,butterfly)",
    )
    p.add_argument(
        "--baselines",
        default="fp32,bf16",
        help="PyTorch dist.all_reduce dtypes to compare against: fp32, bf16 (the buffer cast "
        "to bf16, as bf16_compress_hook does); default fp32,bf16, '' for none",
    )
    _add_timing_args(p)
    p.add_argument(
        "--data",
        default="real",
        choices=("real", "slice", "randn"),
        help="buffer contents: real (the cached real eval gradients, one worker per rank; "
        "generated on first use, minutes), slice (the committed slice, tiled), randn",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --data randn (default 0)")
    p.add_argument(
        "--sub-chunk",
        type=int,
        default=1 << 18,
        help="values per pipelined piece in the engine (default 262144)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (default 1; the ranks share the machine's cores)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="ranks use the torch.compile CPU fast path of the codecs that have one "
        "(compiled in the warm-up)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds any rank may wait for a peer before failing (default 900)",
    )
    p.add_argument(
        "--sysctl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a net.* sysctl to set in every rank's namespace (repeatable), e.g. "
        "net.ipv4.tcp_slow_start_after_idle=0; default: the kernel's defaults, which the "
        "output records",
    )
    p.add_argument(
        "--collective",
        default="allreduce",
        choices=("allreduce", "reduce_scatter"),
        help="what to time: the all-reduce (default), or the reduce-scatter FSDP2 runs (rank "
        "r gets [r·S, (r+1)·S); PyTorch rows: gloo's reduce_scatter_tensor; schedules: ring, "
        "power-of-two butterfly)",
    )
    _add_output_args(p)
    p.set_defaults(func=cmd_cluster, check=check_args)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every argument of ``dynamiq bench cluster``, before anything is built: raises
    ``ValueError`` naming the problem; sets ``args.cluster_config``."""
    sysctls = []
    for item in args.sysctl:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--sysctl takes KEY=VALUE (got {item!r})")
        sysctls.append((key.strip(), value.strip()))
    if not (math.isfinite(args.size_mib) and args.size_mib > 0):
        raise ValueError(f"--size-mib must be a positive number (got {args.size_mib})")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds (got {args.timeout})")
    if args.sub_chunk < 1:
        raise ValueError(f"--sub-chunk must be >= 1 (got {args.sub_chunk})")
    args.cluster_config = ClusterBenchConfig(
        ranks=args.ranks,
        rates=tuple(split_list(args.rate)),
        delay_ms=args.delay_ms,
        numel=int(args.size_mib * 2**20) // 4,
        codecs=tuple(parse_codecs(args.codecs)),
        schedules=tuple(split_list(args.schedules)),
        baselines=tuple(split_list(args.baselines)),
        warmup=args.warmup,
        repeats=args.repeats,
        rotations=args.rotations,
        data=args.data,
        seed=args.seed,
        sub_chunk=args.sub_chunk,
        threads=args.threads,
        compile=args.compile,
        timeout=args.timeout,
        sysctls=tuple(sysctls),
        collective=args.collective,
        verify={"off": (False,), "on": (True,), "both": (False, True)}[args.verify],
    )


def cmd_cluster(args: argparse.Namespace) -> int:
    """``dynamiq bench cluster`` (arguments checked by :func:`check_args`): exit 0, 1 (a rank
    failed) or 2 (not permitted here)."""
    cfg = args.cluster_config
    try:
        check_available()
    except NamespaceUnavailable as exc:
        print(
            f"dynamiq bench cluster: cannot build the emulated cluster here: {exc}", file=sys.stderr
        )
        return 2
    try:
        result = run_cluster_bench(cfg, progress=not args.quiet)
    except NamespaceUnavailable as exc:
        print(f"dynamiq bench cluster: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"dynamiq bench cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "dynamiq bench cluster: interrupted; the emulated cluster was removed", file=sys.stderr
        )
        return 130
    if args.json:
        print_json(result)
    elif args.markdown:
        print(markdown_report(result))
    else:
        print(text_report(result))
    return 0
