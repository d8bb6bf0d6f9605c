"""The microbenchmarks behind ``dynamiq plan``'s parameters (``dynamiq plan calibrate``).

* :func:`calibrate_kernels`: each codec's ``encode``, fused ``reduce`` and ``decode`` on this
  machine, called as the engine calls them (the codec's methods, the dispatcher's default
  backend, a fresh output per call, one torch thread, each call on the next piece of a 64 MiB
  buffer as the engine walks through a bucket), at two sizes (the engine's sub-chunk and a
  quarter of it): a straight line through the two medians gives the per-call overhead and
  the time per value; ``prologue`` (THC's scale agreement) on the whole buffer; an fp32 add.
* :func:`calibrate_network`: an emulated cluster (:class:`~dynamiq.bench.netns.
  EmulatedCluster`) at each rate, and on it, with gloo and no codec
  (:mod:`dynamiq.plan._link_worker`): a ping-pong (α = half the median round trip), a
  stream from every rank to the next (all links busy at once; goodput ÷ rate is the link's
  efficiency, the time inside ``isend`` per byte the host's send cost), and two exchanges of
  the same bytes in halving/doubling rounds, one with a fixed partner and one whose partner
  changes every round, which says what changing partners costs on these links; that switching
  exchange again with every payload's receive posted only after its length header, as the
  engine moves payloads of data-dependent size (per piece, what the receiver's "ready" notice
  costs when it queues behind the receiver's own data to the same peer); the engine's own
  butterfly pattern (:func:`butterfly_rounds`, receives posted a round ahead) over a few
  buffer sizes, whose goodput by the bytes of a round is the exchange curve; the stream's
  process CPU per byte moved, there and on loopback (the kernel's work on the shaped links
  beyond what a host table measured on loopback holds).

* :func:`calibrate_host`: the CPU one all-reduce costs the ranks of this machine when the
  network costs next to nothing (gloo on loopback, no shaping): each codec × schedule at two
  sizes (:mod:`dynamiq.plan._host_worker`). With every rank on one machine no all-reduce ends
  before ``ranks × cpu / cores``, nor before its time on loopback (:func:`host_floor`),
  whatever the links.

The validation runs (``dynamiq bench cluster`` on the shaped links) never feed a parameter.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "calibrate_host",
    "calibrate_kernels",
    "calibrate_network",
    "host_cpu",
    "host_floor",
    "link_patterns",
]

_PORT = 29511


class _OneRank:
    """A one-rank ``PrologueComm`` (a prologue's all-gather returns the rank's own tensor)."""

    rank, world_size = 0, 1

    def allgather(self, tensor: Any) -> list[Any]:
        return [tensor]


def _median_call(fn: Any, burst: int) -> float:
    fn()
    ts = []
    for _ in range(burst):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def calibrate_kernels(
    codecs: Sequence[str],
    sub_chunk: int = 1 << 18,
    numel: int = 1 << 24,
    *,
    iters: int = 3,
    burst: int = 5,
    data: str = "slice",
    progress: bool = True,
) -> dict[str, Any]:
    """Per-call costs of every codec's operations on this machine's CPU (module docstring)."""
    import torch

    from dynamiq.codecs import get_codec

    torch.set_num_threads(1)
    if data == "slice":
        from dynamiq.data import load_slice

        first = load_slice()[0]
        big = first.repeat(-(-numel // first.numel()))[:numel].contiguous().float()
    else:
        big = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    other = big.roll(12345).contiguous()
    out: dict[str, Any] = {
        "kind": "dynamiq-plan-kernels",
        "device": "cpu",
        "date": _now(),
        "machine": _machine(),
        "torch_threads": 1,
        "sizes": [],
        "codecs": {},
    }
    for i, name in enumerate(codecs):
        row, at = _time_codec(get_codec(name), big, other, sub_chunk, iters, burst)
        out["codecs"][name] = row
        out["sizes"] = sorted({*at, *out["sizes"]})
        if progress:
            print(
                f"[{i + 1}/{len(codecs)}] {name:<12} "
                + " ".join(f"{op} {row[op]['seconds'][str(at[-1])] * 1e3:.2f} ms" for op in _OPS)
                + f" per {at[-1]} values",
                file=sys.stderr,
                flush=True,
            )
    m = sub_chunk
    a, b = big[:m].contiguous(), other[:m].contiguous()
    t_add = statistics.median(_median_call(lambda: a + b, burst) for _ in range(iters))
    out["add"] = {"overhead": 0.0, "per_value": t_add / m}
    t_copy = min(_median_call(lambda: big.clone(), 3) for _ in range(iters))
    out["copy_bandwidth_GBps"] = 2 * 4 * numel / t_copy / 1e9
    return out


_OPS = ("encode", "reduce", "decode")


def _time_codec(
    codec: Any, big: Any, other: Any, sub_chunk: int, iters: int, burst: int
) -> tuple[dict[str, Any], list[int]]:
    """One codec's row of :func:`calibrate_kernels` and the sizes it was timed at."""
    from dynamiq.codecs import HopContext

    align = codec.block_size
    large = max(align, sub_chunk // align * align)
    small = max(align, large // 4 // align * align)
    row: dict[str, Any] = {}
    shared = None
    prologue = getattr(codec, "prologue", None)
    if callable(prologue):
        t_pro = statistics.median(
            _median_call(lambda: prologue(big, _OneRank()), 1) for _ in range(iters)
        )
        shared = prologue(big, _OneRank())
        n = big.numel()
        row["prologue"] = {"overhead": 0.0, "per_value": t_pro / n, "seconds": {str(n): t_pro}}
    # a hop inside a 4-rank all-reduce: one contribution in, two out
    c_in = HopContext(hop=0, num_hops=2, contributions=1, world_size=4, shared=shared)
    c_out = HopContext(hop=1, num_hops=2, contributions=2, world_size=4, shared=shared)
    times: dict[str, dict[int, float]] = {op: {} for op in _OPS}
    for m in sorted({small, large}):
        pieces = _Pieces(codec, big, other, m, c_in)
        for op, fn in _ops(codec, pieces, c_in, c_out).items():
            times[op][m] = statistics.median(_median_call(fn, burst) for _ in range(iters))
    for op, by in times.items():
        row[op] = _line(by)
    return row, sorted({small, large})


class _Pieces:
    """Consecutive sub-chunks of ``m`` values of the whole buffer (and their encodings):
    each call takes the next one, as the engine walks through a bucket, so the data comes
    from memory, not from a cache that a 1 MiB piece timed again and again would sit in."""

    def __init__(self, codec: Any, big: Any, other: Any, m: int, ctx: Any):
        count = max(1, big.numel() // m)
        self.xs = [big[i * m : (i + 1) * m] for i in range(count)]
        self.ys = [other[i * m : (i + 1) * m] for i in range(count)]
        self.payloads = [codec.encode(x, ctx) for x in self.xs]
        self.m, self.i = m, -1

    def next(self) -> int:
        self.i = (self.i + 1) % len(self.xs)
        return self.i


def _ops(codec: Any, p: _Pieces, c_in: Any, c_out: Any) -> dict[str, Any]:
    """The three calls the engine makes, each on the next sub-chunk."""

    def encode() -> Any:
        return codec.encode(p.xs[p.next()], c_in)

    def reduce() -> Any:
        i = p.next()
        return codec.reduce(p.payloads[i], p.ys[i], c_in, c_out)

    def decode() -> Any:
        return codec.decode(p.payloads[p.next()], p.m, c_in)

    return {"encode": encode, "reduce": reduce, "decode": decode}


def _line(by_size: dict[int, float]) -> dict[str, Any]:
    from .costs import Cost

    sizes = sorted(by_size)
    if len(sizes) == 1:
        c = Cost(0.0, by_size[sizes[0]] / sizes[0])
    else:
        c = Cost.fit(sizes[0], by_size[sizes[0]], sizes[-1], by_size[sizes[-1]])
    return {
        "overhead": c.overhead,
        "per_value": c.per_value,
        "seconds": {str(k): v for k, v in by_size.items()},
    }


# -- the network ----------------------------------------------------------------------------------


def exchange_rounds(n: int, nbytes: int) -> list[tuple[int, int]]:
    """``(partner mask, bytes)`` of each round of the exchange patterns of ``n`` ranks: a
    recursive halving then doubling of ``nbytes`` over the largest power of two <= ``n``
    (butterfly's rounds: rank ``r`` exchanges with ``r ^ mask``)."""
    steps = (1 << (n.bit_length() - 1)).bit_length() - 1
    halving = [(1 << i, nbytes >> (i + 1)) for i in range(steps)]
    return halving + halving[::-1]


def exchange_sizes(n: int, nbytes: int) -> list[int]:
    """The bytes of each round of :func:`exchange_rounds`."""
    return [b for _, b in exchange_rounds(n, nbytes)]


#: repeats of each butterfly pattern of the network calibration
BUTTERFLY_REPEATS = 7


def butterfly_rounds(n: int, nbytes: int) -> list[tuple[int, int]]:
    """``(partner mask, bytes)`` of each round of the engine's butterfly over ``nbytes``: a
    recursive halving from the farthest partner in, then doubling back out, over the
    largest power of two <= ``n``; the two middle rounds (to the same partner, which the
    engine sends on without a pause) are one."""
    p = 1 << (n.bit_length() - 1)
    steps = p.bit_length() - 1
    halving = [(p >> (i + 1), nbytes >> (i + 1)) for i in range(steps)]
    rounds = halving + halving[::-1]
    mid = len(rounds) // 2
    if mid == 0:
        return rounds
    merged = (rounds[mid][0], rounds[mid - 1][1] + rounds[mid][1])
    return [*rounds[: mid - 1], merged, *rounds[mid + 1 :]]


def butterfly_pattern_name(nbytes: int) -> str:
    return f"butterfly_{nbytes}"


def link_patterns(
    n: int, nbytes: int, piece: int, butterfly_bytes: Sequence[int] = ()
) -> dict[str, list[list[list[list[int]]]]]:
    """Per pattern, per rank, its rounds, each a list of transfers ``[send_to, recv_from,
    nbytes, pieces]`` that run at once (:mod:`dynamiq.plan._link_worker`); with
    ``butterfly_bytes``, also the engine's butterfly over each of those buffer sizes
    (:func:`butterfly_rounds`; to run with its receives posted a round ahead)."""

    def pieces(b: int) -> int:
        return max(1, -(-b // piece))

    stream = [[[[(r + 1) % n, (r - 1) % n, nbytes, pieces(nbytes)]]] for r in range(n)]
    half = nbytes // 2
    two = [
        [
            [
                [(r + 1) % n, (r - 1) % n, half, pieces(half)],
                [(r + 2) % n, (r - 2) % n, half, pieces(half)],
            ]
        ]
        for r in range(n)
    ]
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    rounds = exchange_rounds(n, nbytes)
    switch, fixed = [], []
    for r in range(n):
        if r >= p:  # ranks beyond the power of two sit out
            switch.append([[[-1, -1, 0, 1]]] * len(rounds))
            fixed.append([[[-1, -1, 0, 1]]] * len(rounds))
            continue
        switch.append([[[r ^ m, r ^ m, b, pieces(b)]] for m, b in rounds])
        fixed.append([[[r ^ 1, r ^ 1, b, pieces(b)]] for _, b in rounds])
    # the same exchange, each payload's receive posted only after its length header (the
    # engine's data-dependent sizes)
    lockstep = [[[[*t, 1] if t[0] >= 0 else t for t in rnd] for rnd in rank] for rank in switch]
    out = {
        "stream": stream,
        "exchange_fixed_partner": fixed,
        "exchange_switch_partner": switch,
        "exchange_lockstep": lockstep,
    }
    if n >= 3:
        out["two_streams"] = two
    for size in butterfly_bytes:
        bf = [
            [[[r ^ m, r ^ m, b, pieces(b)]] for m, b in butterfly_rounds(n, size)]
            if r < p
            else [[[-1, -1, 0, 1]]] * len(butterfly_rounds(n, size))
            for r in range(n)
        ]
        out[butterfly_pattern_name(size)] = bf
    return out


class _Loopback:
    """``n`` ranks as processes of this machine on loopback (the launcher interface of
    :class:`~dynamiq.bench.netns.EmulatedCluster` that :func:`_run_ranks` uses)."""

    def __init__(self, n: int):
        self.n, self.addresses = n, ["127.0.0.1"]
        self._procs: list[subprocess.Popen[Any]] = []

    def popen(self, i: int, argv: list[str], env: dict[str, str], **kw: Any) -> Any:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, **kw)
        self._procs.append(proc)
        return proc

    def __enter__(self) -> _Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._procs:  # (a rank left behind by a failure: never outlive the run)
            if p.poll() is None:
                p.kill()
                p.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(
    cl: Any,
    spec: dict[str, Any],
    tmp: str,
    worker: str = "dynamiq.plan._link_worker",
    port: int = _PORT,
) -> list[dict[str, Any]]:
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    procs, logs = [], []
    for r in range(cl.n):
        log = os.path.join(tmp, f"rank{r}.log")
        logs.append(log)
        argv = [sys.executable, "-m", worker, "--rank", str(r)]
        argv += ["--world", str(cl.n), "--master", f"{cl.addresses[0]}:{port}"]
        argv += ["--spec", spec_path, "--out", os.path.join(tmp, f"rank{r}.json")]
        with open(log, "w") as err:
            env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
            procs.append(cl.popen(r, argv, env=env, stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + float(spec.get("timeout", 300)) * 2
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if bad is not None:
            tail = ""
            with contextlib.suppress(OSError), open(logs[bad]) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"rank {bad} of the benchmark ({worker}) failed:\n{tail}")
        if all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"the benchmark ({worker}) did not finish in time")
    out = []
    for r in range(cl.n):
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def calibrate_network(
    rates: Sequence[str],
    ranks: int = 4,
    *,
    nbytes: int | None = None,
    piece: int = 1 << 20,
    repeats: int = 3,
    delay_ms: float = 0.1,
    progress: bool = True,
    butterfly_mib: Sequence[float] = (2, 8, 32, 64),
) -> dict[str, Any]:
    """Latency, goodput and send cost of the emulated cluster's links at each rate (module
    docstring). ``nbytes`` per stream: default 1.5 s of the rate's line time;
    ``butterfly_mib``: the buffers of the engine's butterfly pattern, each run
    :data:`BUTTERFLY_REPEATS` times (its time varies more from run to run than a stream's)."""
    from dynamiq.bench.netns import EmulatedCluster, check_available, parse_rate

    check_available()
    out: dict[str, Any] = {
        "kind": "dynamiq-plan-network",
        "date": _now(),
        "machine": _machine(),
        "ranks": ranks,
        "piece_bytes": piece,
        "load_before": list(os.getloadavg()),
        "rates": {},
    }
    for rate in rates:
        bps = parse_rate(rate)
        size = nbytes or int(1.5 * bps / 8)
        sizes = [int(m * 2**20) for m in butterfly_mib]
        spec = {
            "pingpong_iters": 200,
            "pingpong_bytes": 8,
            "repeats": repeats,
            "patterns": link_patterns(ranks, size, piece, sizes),
            "ahead": [butterfly_pattern_name(b) for b in sizes],
            "repeats_of": {butterfly_pattern_name(b): BUTTERFLY_REPEATS for b in sizes},
            "timeout": 300,
        }
        with EmulatedCluster(ranks, rate, delay_ms) as cl, tempfile.TemporaryDirectory() as tmp:
            per_rank = _run_ranks(cl, spec, tmp)
            shaping = dict(cl.shaping)
        out["rates"][rate] = _summarise_links(per_rank, spec, size, bps, shaping)
        out["rates"][rate].update(_socket_cpu(per_rank, ranks, size, repeats))
        if progress:
            s = out["rates"][rate]
            print(
                f"{rate}: latency {s['latency_s'] * 1e6:.0f} us, efficiency "
                f"{s['efficiency']:.3f}, send {s['send_per_byte_s'] * 1e9:.2f} ns/byte, "
                f"switch/fixed {s['switch_over_fixed']:.3f}, two streams "
                f"{s['two_streams_efficiency']:.3f}, notice queue "
                f"{s['notice_queue_s'] * 1e3:.1f} ms, CPU beyond loopback "
                f"{s['extra_cpu_per_byte_s'] * 1e9:.2f} ns/byte, butterfly "
                + ", ".join(
                    f"{b / 2**20:.3g} MiB a round {e:.3f}" for b, e in s["butterfly_efficiency"]
                ),
                file=sys.stderr,
                flush=True,
            )
    out["load_after"] = list(os.getloadavg())
    return out


def _socket_cpu(
    shaped: list[dict[str, Any]], ranks: int, size: int, repeats: int
) -> dict[str, float]:
    """The CPU a rank spends per byte it moves (sends plus receives) in the stream
    pattern on the shaped links and on loopback (the same pattern, unshaped), and what the
    links cost beyond loopback: the kernel's network work on veth, bridge and qdisc, which a
    host table (measured on loopback) does not hold."""
    spec = {
        "pingpong_iters": 5,
        "pingpong_bytes": 8,
        "repeats": repeats,
        "patterns": {"stream": link_patterns(ranks, size, 1 << 20)["stream"]},
        "timeout": 300,
    }
    with _Loopback(ranks) as cl, tempfile.TemporaryDirectory(prefix="dynamiq-net-") as tmp:
        loop = _run_ranks(cl, spec, tmp, port=_free_port())

    def per_byte(per_rank: list[dict[str, Any]]) -> float:
        cpu = [statistics.median(pr["patterns"]["stream"]["cpu_seconds"]) for pr in per_rank]
        return statistics.median(cpu) / (2 * size)

    shaped_b, loop_b = per_byte(shaped), per_byte(loop)
    return {
        "cpu_per_byte_s": shaped_b,
        "loopback_cpu_per_byte_s": loop_b,
        "extra_cpu_per_byte_s": max(0.0, shaped_b - loop_b),
    }


def calibrate_host(
    codecs: Sequence[str],
    schedules: Sequence[str] = ("ring", "butterfly"),
    ranks: int = 4,
    sizes_mib: Sequence[float] = (16.0, 64.0),
    *,
    repeats: int = 3,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """The CPU that ``ranks`` processes of this machine spend in one all-reduce of each codec
    × schedule × size, the network taking next to nothing (gloo on loopback): per rank, the
    median over repeats of the process's CPU seconds (the engine, its kernels, gloo's threads
    and the system calls that move the bytes). With every rank on one machine, as on the
    emulated cluster, no all-reduce can end before ``ranks × cpu / cores``, nor before the
    time it takes on loopback (the median over repeats of the slowest rank's wall time, also
    recorded): the model's CPU floor, :func:`host_floor`. Nothing is shaped and no namespace
    is made: no root needed."""
    sizes = sorted({max(1, int(m * 2**20) // 4) for m in sizes_mib})
    spec = {
        "codecs": list(codecs),
        "schedules": list(schedules),
        "sizes": sizes,
        "repeats": repeats,
        "timeout": timeout,
    }
    with _Loopback(ranks) as cl, tempfile.TemporaryDirectory(prefix="dynamiq-host-") as tmp:
        port = _free_port()
        per_rank = _run_ranks(cl, spec, tmp, "dynamiq.plan._host_worker", port)
    out: dict[str, Any] = {
        "kind": "dynamiq-plan-host",
        "date": _now(),
        "machine": _machine(),
        "ranks": ranks,
        "cores": os.cpu_count() or 1,
        "torch_threads": 1,
        "sizes": sizes,
        "codecs": {},
    }
    for i, run in enumerate(per_rank[0]["runs"]):
        cpu = statistics.mean(statistics.median(pr["runs"][i]["cpu_s"]) for pr in per_rank)
        wall = statistics.median(
            max(pr["runs"][i]["wall_s"][k] for pr in per_rank) for k in range(len(run["wall_s"]))
        )
        row = out["codecs"].setdefault(str(run["codec"]), {}).setdefault(run["schedule"], {})
        row.setdefault("cpu_s_per_rank", {})[str(run["numel"])] = cpu
        row.setdefault("wall_s", {})[str(run["numel"])] = wall
    for by_sched in out["codecs"].values():
        for row in by_sched.values():
            line = _line({int(k): v for k, v in row["cpu_s_per_rank"].items()})
            row["overhead"], row["per_value"] = line["overhead"], line["per_value"]
    return out


def host_cpu(table: dict[str, Any], codec: str, schedule: str, numel: int) -> float | None:
    """CPU seconds per rank of ``codec`` × ``schedule`` at ``numel`` values (the line
    through a :func:`calibrate_host` table's sizes), or ``None`` where it has no such row."""
    row = table.get("codecs", {}).get(codec, {}).get(schedule)
    if row is None:
        return None
    return max(0.0, float(row["overhead"]) + float(row["per_value"]) * numel)


def host_floor(
    table: dict[str, Any], codec: str, schedule: str, numel: int, extra_cpu: float = 0.0
) -> float | None:
    """The least time ``codec`` × ``schedule`` needs at ``numel`` values on this host, from a
    :func:`calibrate_host` table: the larger of ``ranks × cpu / cores`` (the CPU per rank on
    the line through its sizes: the cores cannot do the work faster) and the all-reduce's own
    time on loopback (the line through its wall times: with links that cost next to nothing,
    what the host's scheduling of that work takes). ``extra_cpu``: CPU seconds per rank the
    target links cost beyond loopback, added to both (on the cores, ``ranks × extra / cores``
    more). ``None`` where the table has no such row."""
    row = table.get("codecs", {}).get(codec, {}).get(schedule)
    cpu = host_cpu(table, codec, schedule, numel)
    if row is None or cpu is None:
        return None
    share = int(table["ranks"]) / max(1, int(table["cores"]))
    floor = share * (cpu + extra_cpu)
    if row.get("wall_s"):  # the line through the loopback wall times
        line = _line({int(k): v for k, v in row["wall_s"].items()})
        wall = float(line["overhead"]) + float(line["per_value"]) * numel
        floor = max(floor, wall + share * extra_cpu)
    return floor


def _summarise_links(
    per_rank: list[dict[str, Any]], spec: dict[str, Any], size: int, bps: int, shaping: Any
) -> dict[str, Any]:
    def slowest(name: str) -> float:
        reps = len(per_rank[0]["patterns"][name]["seconds"])
        return statistics.median(
            max(pr["patterns"][name]["seconds"][i] for pr in per_rank) for i in range(reps)
        )

    stream_s = slowest("stream")
    fixed_s, switch_s = slowest("exchange_fixed_partner"), slowest("exchange_switch_partner")
    in_send = statistics.median(
        statistics.median(pr["patterns"]["stream"]["isend_seconds"]) for pr in per_rank
    )
    rtt = per_rank[0]["pingpong_rtt_median"]
    two_s = slowest("two_streams") if "two_streams" in per_rank[0]["patterns"] else stream_s
    lockstep_s = slowest("exchange_lockstep")
    pieces = sum(t[3] for rnd in spec["patterns"]["exchange_lockstep"][0] for t in rnd)
    return {
        "rate_bps": bps,
        "stream_bytes": size,
        "latency_s": rtt / 2,
        "stream_seconds": stream_s,
        "efficiency": min(1.0, 8 * size / stream_s / bps),
        "send_per_byte_s": in_send / size,
        "exchange_fixed_partner_seconds": fixed_s,
        "exchange_switch_partner_seconds": switch_s,
        "switch_over_fixed": switch_s / fixed_s,
        # the same exchange with each payload posted after its length header: what a piece's
        # "ready" notice costs while the link back to its sender carries the receiver's own
        # data (behind it, in its socket and the shaper's queue), per piece
        "exchange_lockstep_seconds": lockstep_s,
        "notice_queue_s": max(0.0, (lockstep_s - switch_s) / max(1, pieces)),
        # each direction of butterfly's pairwise exchanges (partners switching as in butterfly)
        "exchange_efficiency": exchange_efficiency(len(per_rank), size, switch_s, bps),
        # the same bytes to two peers at once: the efficiency of two connections sharing a link
        "two_streams_seconds": two_s,
        "two_streams_efficiency": min(1.0, 8 * (size // 2 * 2) / two_s / bps),
        # the engine's butterfly (receives posted a round ahead) over several buffers:
        # [bytes a round, goodput ÷ rate of each direction], by the round's bytes
        "butterfly_efficiency": butterfly_efficiency(per_rank, spec, bps, slowest),
        "shaping": shaping,
    }


def butterfly_efficiency(
    per_rank: list[dict[str, Any]], spec: dict[str, Any], bps: float, slowest: Any
) -> list[list[float]]:
    """``[mean bytes a round, goodput ÷ rate]`` of each butterfly pattern of the spec (its
    rounds back to back: every byte each way over the slowest rank's median time), sorted
    by the round's bytes."""
    n, out = len(per_rank), []
    for name in spec.get("ahead", ()):
        size = int(name.split("_")[1])
        sizes = [b for _, b in butterfly_rounds(n, size)]
        eff = min(1.0, 8 * sum(sizes) / slowest(name) / bps)
        out.append([sum(sizes) / len(sizes), eff])
    return sorted(out)


def exchange_efficiency(n: int, size: int, seconds: float, bps: float) -> float:
    """Goodput ÷ rate of each direction of an exchange pattern of ``n`` ranks that took
    ``seconds`` (its rounds back to back, :func:`exchange_sizes` of the stream's ``size``)."""
    return min(1.0, 8 * sum(exchange_sizes(n, size)) / seconds / bps)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}"
