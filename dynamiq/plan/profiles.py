"""Named links and devices for ``dynamiq plan``, and where each number comes from.

Links (one direction of one rank's link; :class:`~dynamiq.plan.costs.Link`):

* ``ib100``, ``ib400``: InfiniBand at 100 / 400 Gb/s, α = 5 µs, efficiency 0.9 — nominal
  line rates; α and the efficiency are assumptions typical of NCCL over one HCA per GPU,
  **not measured by this project**.
* ``nvlink4``: NVLink 4 (H100/H200), 450 GB/s per direction per GPU (3600 Gb/s), α = 3 µs,
  efficiency 0.8 — nominal; **not measured by this project**.
* ``emulated``: the emulated cluster of ``dynamiq bench cluster`` on the machine of
  docs/benchmarks.md, from ``dynamiq plan calibrate --network`` (the ping-pong's latency,
  the stream's goodput ÷ rate, the time inside ``isend`` per byte): the committed
  ``dynamiq/plan/data/emulated-network.json``, or the file given with ``--network-table``.
  Rates between calibrated ones take the nearest calibrated rate's latency and efficiency.

Devices (kernel costs; :class:`~dynamiq.plan.costs.KernelTable`):

* ``cpu``: ``dynamiq plan calibrate --kernels`` on that machine (one torch thread; committed as
  ``dynamiq/plan/data/cpu-kernels.json``), or ``--kernel-table``.
* ``h200``: ``benchmarks/gpu_check.py`` on a lent H200 (``docs/data/gpu-check-h200.json``,
  run 2; its timing section is ``dynamiq/plan/data/gpu-check-h200.json``): the fused reduce's
  host time per call on 64M values, its device time, and the copy bandwidth; encode and decode
  are scaled from the reduce by bytes (:func:`~dynamiq.plan.costs.table_from_reduce`).
* ``h100``: the H200 table with every per-value cost times 4.8 / 3.35 (the two GPUs' nominal
  HBM bandwidths, TB/s; per-call overheads unchanged) — an extrapolation, **no H100 was
  measured**.
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from typing import Any

from .costs import Host, KernelTable, Link, load_kernel_table

__all__ = [
    "DEVICES",
    "LINKS",
    "device_table",
    "emulated_link",
    "gpu_host",
    "load_json",
    "named_link",
]

LINKS = ("emulated", "ib100", "ib400", "nvlink4")
DEVICES = ("cpu", "h100", "h200")

_NOMINAL = {
    "ib100": Link(100e9, 5e-6, 0.9, "nominal 100 Gb/s InfiniBand (alpha, efficiency assumed)"),
    "ib400": Link(400e9, 5e-6, 0.9, "nominal 400 Gb/s InfiniBand (alpha, efficiency assumed)"),
    "nvlink4": Link(3600e9, 3e-6, 0.8, "nominal NVLink 4, 450 GB/s per direction (assumed)"),
}
_H100_OVER_H200 = 4.8 / 3.35  # nominal HBM bandwidth, H200 / H100


def load_json(path: str | None, packaged: str) -> tuple[Any, str]:
    """Parsed JSON of ``path``, or of the packaged file ``packaged``; and its name."""
    if path:
        if not os.path.isfile(path):
            raise ValueError(f"no such file: {path}")
        try:
            with open(path) as f:
                return json.load(f), path
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
    text = resources.files("dynamiq.plan").joinpath("data").joinpath(packaged).read_text()
    return json.loads(text), f"dynamiq/plan/data/{packaged}"


def named_link(name: str) -> Link:
    """A nominal link (``ib100``, ``ib400``, ``nvlink4``)."""
    if name not in _NOMINAL:
        raise ValueError(f"unknown link profile {name!r} (known: {', '.join(LINKS)})")
    return _NOMINAL[name]


def emulated_link(rate_bps: float, table: str | None = None) -> tuple[Link, dict[str, Any]]:
    """The emulated cluster's link at ``rate_bps`` from a network calibration, and the
    calibrated rate's summary (``send_per_byte_s``, ``two_streams_efficiency``,
    ``exchange_efficiency``...)."""
    data, name = load_json(table, "emulated-network.json")
    if not isinstance(data, dict) or data.get("kind") != "dynamiq-plan-network":
        raise ValueError(f"{name}: not a `dynamiq plan calibrate --network` result")
    rates = data["rates"]
    best = dict(min(rates.values(), key=lambda s: abs(math.log(s["rate_bps"] / rate_bps))))
    if "exchange_efficiency" not in best and "exchange_switch_partner_seconds" in best:
        from .calibrate import exchange_efficiency  # a table made before it was recorded

        best["exchange_efficiency"] = exchange_efficiency(
            int(data["ranks"]),
            int(best["stream_bytes"]),
            float(best["exchange_switch_partner_seconds"]),
            float(best["rate_bps"]),
        )
    link = Link(
        rate_bps,
        float(best["latency_s"]),
        float(best["efficiency"]),
        f"{name}: calibrated at {best['rate_bps'] / 1e6:g} Mbit/s ({data.get('date', '?')})",
    )
    return link, best


def device_table(device: str, table: str | None = None) -> KernelTable:
    """The kernel table of a named device (module docstring), or of the file ``table``."""
    if table:
        data, name = load_json(table, "")
        return load_kernel_table(data, name)
    if device == "cpu":
        data, name = load_json(None, "cpu-kernels.json")
        return load_kernel_table(data, name)
    if device in ("h200", "h100"):
        data, name = load_json(None, "gpu-check-h200.json")
        t = load_kernel_table(data, name)
        if device == "h100":
            return t.scaled(_H100_OVER_H200, f"{name} x 4.8/3.35 (H100, extrapolated)")
        return t
    raise ValueError(f"unknown device {device!r} (known: {', '.join(DEVICES)})")


def gpu_host() -> Host:
    """A GPU rank's host: rounds in lock-step (the CUDA engine), no modelled send cost."""
    return Host(lookahead=False, source="CUDA engine: lock-step rounds")
