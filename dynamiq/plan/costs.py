"""The parameters of ``dynamiq plan``: links (α-β), kernel costs, and where each comes from.

* :class:`Link`: one direction of one rank's link: ``rate_bps`` (line rate), ``latency_s``
  (α: a message's one-way latency, which also delays the receiver's "ready" notice gloo
  waits for before it moves a byte) and ``efficiency`` (goodput ÷ line rate: framing, TCP's
  acknowledgements, the shaper's overhead). A message of ``B`` bytes holds the sender's
  uplink and the receiver's downlink for ``8·B / (rate_bps·efficiency)`` seconds;
  ``shared_efficiency`` replaces ``efficiency`` for a message queued behind one to another
  peer (two TCP connections then share the link: measured by the calibration's two streams),
  and ``exchange_efficiency`` for a message of a round in which the rank sends to the peer it
  receives from (butterfly's pairwise exchanges, measured by the calibration's exchange whose
  partners switch as butterfly's do: on the emulated cluster 7-15 % slower per byte than a
  one-way stream); ``exchange_curve`` replaces that with the efficiency by the bytes of the
  round (the calibration's butterfly patterns: switching partners costs a large round little
  and a round of a few socket buffers' worth much). ``notice_queue_s``: the "ready" notice
  of a receive posted after its message was sent (a payload of data-dependent size, posted
  after its length header) travels behind the receiver's own data to the sender, in that
  direction's socket and shaper queues, for at most this long (measured by the calibration's
  lock-step exchange, per piece: 52 ms at 100 Mbit/s and 8 ms at 1 Gbit/s on the emulated
  cluster; None: it never waits).
* :class:`Cost`: ``overhead + per_value · numel`` seconds for one call of a kernel on
  ``numel`` values; :class:`CodecCost` has one for ``encode``, the fused ``reduce``,
  ``decode`` and a codec's ``prologue`` (on the whole buffer).
* :class:`KernelTable`: a :class:`CodecCost` per codec id, from a measured table:
  ``dynamiq plan calibrate --kernels`` (every operation timed, on this machine), ``dynamiq
  bench kernels --json`` or ``benchmarks/gpu_check.py``'s JSON (the fused ``reduce`` only:
  ``encode`` and ``decode`` are scaled from it by the bytes each moves, see
  :func:`table_from_reduce`), or a device's memory bandwidth alone (the roofline,
  :func:`roofline_cost`).

:class:`Host` adds what the engine's host does besides the kernels: the time spent in
``isend`` per message (gloo's TCP send path; measured by the calibration's stream), a slow-down
of every CPU step when ranks share cores (the emulated cluster: ``ranks / cores``) or, with a
host table, a pool of ``cores`` the ranks' CPU steps share and the engine's own work per
step, and whether rounds overlap (the CPU engine's look-ahead; CUDA runs rounds in
lock-step).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynamiq.codecs import get_codec

__all__ = [
    "CodecCost",
    "Cost",
    "Host",
    "KernelTable",
    "Link",
    "load_kernel_table",
    "payload_bytes_per_value",
    "roofline_cost",
    "table_from_reduce",
]


@dataclass(frozen=True)
class Link:
    """One direction of a rank's link (see the module docstring)."""

    rate_bps: float
    latency_s: float = 0.0
    efficiency: float = 1.0
    source: str = "given"
    #: goodput ÷ rate while two connections share the link (None: ``efficiency``)
    shared_efficiency: float | None = None
    #: goodput ÷ rate of each direction while two ranks exchange (None: ``efficiency``)
    exchange_efficiency: float | None = None
    #: CPU seconds a rank spends per byte it sends or receives on this link beyond what
    #: loopback costs (the kernel's network work; the emulated cluster's calibration)
    cpu_per_byte_s: float = 0.0
    #: the longest a receiver's "ready" notice queues behind its own data to the sender
    #: (the calibration's lock-step exchange; None: never)
    notice_queue_s: float | None = None
    #: ``((bytes a round, efficiency), ...)``, ascending: the exchange's goodput ÷ rate by
    #: the bytes of its round (the calibration's butterfly patterns); where given it replaces
    #: ``exchange_efficiency`` (log-linear between the points, flat beyond them)
    exchange_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.rate_bps > 0 and math.isfinite(self.rate_bps)):
            raise ValueError(f"link rate must be a positive number of bits/s (got {self.rate_bps})")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be >= 0 s (got {self.latency_s})")
        for e in (self.efficiency, self.shared_efficiency or 1.0, self.exchange_efficiency or 1.0):
            if not 0 < e <= 1:
                raise ValueError(f"link efficiency must be in (0, 1] (got {e})")
        if not (self.cpu_per_byte_s >= 0 and math.isfinite(self.cpu_per_byte_s)):
            raise ValueError(f"link CPU per byte must be >= 0 s (got {self.cpu_per_byte_s})")
        q = self.notice_queue_s
        if q is not None and not (q >= 0 and math.isfinite(q)):
            raise ValueError(f"link notice queue time must be >= 0 s (got {q})")
        sizes = [b for b, _ in self.exchange_curve]
        if any(not (b > 0 and math.isfinite(b)) for b in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(
                f"the exchange curve's round bytes must be positive and ascending (got {sizes})"
            )
        for _, e in self.exchange_curve:
            if not 0 < e <= 1:
                raise ValueError(f"link efficiency must be in (0, 1] (got {e})")

    def exchange_at(self, round_bytes: float | None) -> float | None:
        """The exchange's efficiency for a round of ``round_bytes`` (the curve where given,
        else ``exchange_efficiency``)."""
        curve = self.exchange_curve
        if not curve or round_bytes is None or round_bytes <= 0:
            return self.exchange_efficiency
        if round_bytes <= curve[0][0]:
            return curve[0][1]
        for (b0, e0), (b1, e1) in itertools.pairwise(curve):
            if round_bytes <= b1:
                w = math.log(round_bytes / b0) / math.log(b1 / b0)
                return e0 + w * (e1 - e0)
        return curve[-1][1]

    @property
    def bytes_per_s(self) -> float:
        """Goodput, bytes per second."""
        return self.rate_bps * self.efficiency / 8.0

    def seconds(
        self,
        nbytes: float,
        shared: bool = False,
        exchange: bool = False,
        round_bytes: float | None = None,
    ) -> float:
        """Wire time of ``nbytes`` (no latency); ``shared``: while another connection uses
        the link too; ``exchange``: while the receiver sends to the sender, in a round of
        ``round_bytes`` (the exchange curve's efficiency there replaces the link's; the
        lower of it and the shared one where both hold)."""
        eff = self.efficiency
        if shared and self.shared_efficiency:
            eff = self.shared_efficiency
        ex = self.exchange_at(round_bytes) if exchange else None
        if ex and self.exchange_curve and round_bytes:
            eff = min(self.shared_efficiency or ex, ex) if shared else ex
        elif ex:
            eff = min(eff, ex)
        return 8.0 * nbytes / (self.rate_bps * eff)


@dataclass(frozen=True)
class Cost:
    """``overhead + per_value · numel`` seconds per call (0 for an empty call)."""

    overhead: float = 0.0
    per_value: float = 0.0

    def __call__(self, numel: int) -> float:
        return self.overhead + self.per_value * numel if numel > 0 else 0.0

    @staticmethod
    def fit(n_small: int, t_small: float, n_large: int, t_large: float) -> Cost:
        """The line through two timings (overhead clamped at 0, slope at >= 0)."""
        slope = max(0.0, (t_large - t_small) / (n_large - n_small))
        return Cost(max(0.0, t_large - slope * n_large), slope)


@dataclass(frozen=True)
class CodecCost:
    """Per-call costs of one codec's operations (``prologue``: on the whole buffer)."""

    encode: Cost
    reduce: Cost
    decode: Cost
    prologue: Cost = Cost()
    source: str = ""


@dataclass(frozen=True)
class Host:
    """What the engine's host adds to the kernels (see the module docstring)."""

    send: Cost = Cost()  # per isend call: overhead + per byte
    add: Cost = Cost()  # fp32 add of two slices (the "keep" sum), per value
    cpu_slowdown: float = 1.0
    lookahead: bool = True
    source: str = ""
    #: the ranks' CPU steps share this many cores (a step waits for a free one); None: every
    #: rank has its own (``cpu_slowdown`` then stands for the sharing)
    cores: int | None = None
    #: seconds added to every CPU step: the engine's own work around each call (its Python,
    #: fresh buffers), measured with ``dynamiq plan calibrate --host``
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        if not self.cpu_slowdown >= 1.0:
            raise ValueError(f"cpu_slowdown must be >= 1 (got {self.cpu_slowdown})")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1 (got {self.cores})")
        if not self.step_overhead >= 0.0:
            raise ValueError(f"step_overhead must be >= 0 s (got {self.step_overhead})")


def payload_bytes_per_value(codec: Any, numel: int = 1 << 18) -> float:
    """Payload bytes per value of ``codec`` on ``numel`` values (an upper bound where the size
    depends on the data: the codec's ``bits_per_value``)."""
    c = get_codec(codec)
    n = c.encoded_nbytes(numel)
    if n is None:
        return c.bits_per_value(numel) / 8.0
    return n / numel


def roofline_cost(codec: Any, bandwidth_Bps: float, overhead: float = 0.0) -> CodecCost:
    """Each operation at the memory roofline: the bytes it must move (fp32 in or out, the
    payload in and/or out) over ``bandwidth_Bps``, plus ``overhead`` per call."""
    if not bandwidth_Bps > 0:
        raise ValueError(f"memory bandwidth must be positive (got {bandwidth_Bps})")
    p = payload_bytes_per_value(codec)
    return CodecCost(
        encode=Cost(overhead, (4 + p) / bandwidth_Bps),
        reduce=Cost(overhead, (4 + 2 * p) / bandwidth_Bps),
        decode=Cost(overhead, (4 + p) / bandwidth_Bps),
        source=f"roofline at {bandwidth_Bps / 1e9:.0f} GB/s",
    )


def table_from_reduce(
    codec: Any, reduce_seconds: float, numel: int, overhead: float, source: str
) -> CodecCost:
    """A codec's costs from its fused ``reduce`` alone (``reduce_seconds`` per call on
    ``numel`` values, ``overhead`` of it per call): ``encode`` and ``decode`` move
    ``4 + p`` bytes per value against the reduce's ``4 + 2p`` (``p``: payload bytes per
    value), and are taken to run at the reduce's bytes per second."""
    p = payload_bytes_per_value(codec)
    per = max(0.0, reduce_seconds - overhead) / numel
    red = Cost(overhead, per)
    one_way = Cost(overhead, per * (4 + p) / (4 + 2 * p))
    return CodecCost(one_way, red, one_way, source=source)


@dataclass
class KernelTable:
    """A :class:`CodecCost` per codec id; codecs it lacks cost the roofline of
    ``bandwidth_Bps`` (if known) with ``overhead`` per call."""

    costs: dict[str, CodecCost] = field(default_factory=dict)
    bandwidth_Bps: float | None = None
    overhead: float = 0.0
    device: str = ""
    source: str = ""
    add: Cost = field(default_factory=Cost)  # an fp32 add of two slices (a "keep" sum)
    procs: int = 1  # processes timing at once when it was measured (the CPU shared by them)

    def get(self, codec: Any) -> CodecCost:
        key = _codec_key(codec)
        if key in self.costs:
            return self.costs[key]
        if self.bandwidth_Bps is None:
            known = ", ".join(sorted(self.costs)) or "none"
            raise KeyError(
                f"the kernel table ({self.source or 'given'}) has no costs for codec {key!r} "
                f"and no memory bandwidth to estimate them (it has: {known})"
            )
        return roofline_cost(codec, self.bandwidth_Bps, self.overhead)

    def scaled(self, factor: float, source: str) -> KernelTable:
        """Every per-value cost times ``factor`` (another device's memory bandwidth ratio);
        per-call overheads unchanged."""

        def s(c: Cost) -> Cost:
            return Cost(c.overhead, c.per_value * factor)

        costs = {
            k: CodecCost(s(v.encode), s(v.reduce), s(v.decode), s(v.prologue), source)
            for k, v in self.costs.items()
        }
        bw = self.bandwidth_Bps / factor if self.bandwidth_Bps else None
        return KernelTable(costs, bw, self.overhead, self.device, source, s(self.add), self.procs)

    def alone(self, cores: int) -> KernelTable:
        """The costs of one process alone: a table timed by ``procs`` processes at once on
        ``cores`` cores has every cost ``procs / cores`` times that (at least 1)."""
        f = 1.0 / max(1.0, self.procs / cores)

        def s(c: Cost) -> Cost:
            return Cost(c.overhead * f, c.per_value * f)

        costs = {
            k: CodecCost(s(v.encode), s(v.reduce), s(v.decode), s(v.prologue), v.source)
            for k, v in self.costs.items()
        }
        return KernelTable(
            costs, self.bandwidth_Bps, self.overhead * f, self.device, self.source, s(self.add), 1
        )


def _codec_key(codec: Any) -> str:
    if isinstance(codec, str):
        return codec
    if isinstance(codec, Mapping):
        return json.dumps(dict(codec), sort_keys=True)
    return json.dumps(get_codec(codec).get_config(), sort_keys=True)


# -- loading measured tables ------------------------------------------------------------------


def load_kernel_table(data: Any, source: str = "") -> KernelTable:
    """A :class:`KernelTable` from parsed JSON: ``dynamiq plan calibrate --kernels`` output,
    ``dynamiq bench kernels --json`` (a list of rows), or ``benchmarks/gpu_check.py``'s file
    (its ``timing``; with several runs, the last). Raises ``ValueError`` on anything else."""
    if isinstance(data, dict) and data.get("kind") == "dynamiq-plan-kernels":
        return _from_calibration(data, source)
    if isinstance(data, list) and data and isinstance(data[0], dict) and "fused s" in data[0]:
        return _from_bench_kernels(data, source)
    if isinstance(data, dict):
        runs = sorted(k for k in data if k.startswith("run_") and isinstance(data[k], dict))
        top = data[runs[-1]] if runs else data
        if isinstance(top.get("timing"), dict) and "codecs" in top["timing"]:
            return _from_gpu_check(top, source)
    raise ValueError(
        f"{source or 'the kernel table'}: not a kernel table (expected the JSON of "
        "`dynamiq plan calibrate --kernels`, `dynamiq bench kernels --json` or "
        "benchmarks/gpu_check.py)"
    )


def _cost(d: Mapping[str, Any]) -> Cost:
    return Cost(float(d["overhead"]), float(d["per_value"]))


def _from_calibration(data: dict[str, Any], source: str) -> KernelTable:
    costs = {}
    for name, row in data["codecs"].items():
        costs[name] = CodecCost(
            _cost(row["encode"]),
            _cost(row["reduce"]),
            _cost(row["decode"]),
            _cost(row["prologue"]) if row.get("prologue") else Cost(),
            source=source or "calibration",
        )
    bw = data.get("copy_bandwidth_GBps")
    add = _cost(data["add"]) if data.get("add") else Cost()
    return KernelTable(
        costs,
        float(bw) * 1e9 if bw else None,
        0.0,
        data.get("device", ""),
        source,
        add,
        int(data.get("procs", 1)),
    )


def _from_bench_kernels(rows: list[dict[str, Any]], source: str) -> KernelTable:
    costs = {}
    bw = None
    for row in rows:
        name = row["codec"]
        p = payload_bytes_per_value(name)
        # bytes moved = 2 payloads + 4 bytes per value: recover the buffer's length
        numel = max(1, round(float(row["bytes moved"]) / (4 + 2 * p)))
        costs[name] = table_from_reduce(name, float(row["fused s"]), numel, 0.0, source)
        bw = float(row.get("copy bandwidth GB/s", 0.0)) * 1e9 or bw
    return KernelTable(costs, bw, 0.0, "", source or "dynamiq bench kernels")


def _from_gpu_check(run: dict[str, Any], source: str) -> KernelTable:
    timing = run["timing"]
    numel = int(timing["numel"])
    costs = {}
    overheads = []
    for name, row in timing["codecs"].items():
        # calls back to back, as the engine makes them: the burst's time per call; its
        # excess over the device time is the host's share of a call (launches, syncs)
        host = float(row.get("fused_burst_seconds") or row["fused_seconds"])
        dev = row.get("fused_device_seconds")
        over = max(0.0, host - float(dev)) if dev else 0.0
        overheads.append(over)
        costs[name] = table_from_reduce(name, host, numel, over, source or "gpu_check")
    bw = float(timing.get("copy_device_bandwidth_gbs") or timing["copy_bandwidth_gbs"]) * 1e9
    over = sorted(overheads)[len(overheads) // 2] if overheads else 0.0
    device = str(run.get("environment", {}).get("gpu", "cuda"))
    return KernelTable(costs, bw, over, device, source or "gpu_check")
