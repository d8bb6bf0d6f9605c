"""``dynamiq.plan.predict``: resolve the parameters (profiles, tables, overrides) and predict
every codec × schedule; :func:`break_even` tabulates when each codec beats bf16."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from dynamiq.bench.netns import parse_rate
from dynamiq.codecs import get_codec
from dynamiq.collectives import get_schedule

from .calibrate import host_cpu, host_floor
from .costs import Cost, Host, KernelTable, Link
from .model import Cluster, simulate
from .profiles import DEVICES, LINKS, device_table, emulated_link, gpu_host, named_link

__all__ = ["Setup", "break_even", "predict", "resolve"]

_SIZES_MIB = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
Setup = tuple[Cluster, KernelTable, Host, dict[str, Any]]


def _rate_bps(rate: str | float) -> float:
    if isinstance(rate, (int, float)):
        if not rate > 0:
            raise ValueError(f"rate must be positive (got {rate})")
        return float(rate)
    return float(parse_rate(rate))


def _check(
    profile: str,
    intra_profile: str,
    device: str | None,
    cores: int | None,
    mem_bw_gbps: float | None,
    call_overhead_us: float | None,
) -> None:
    if profile not in LINKS:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(LINKS)})")
    if intra_profile not in LINKS or intra_profile == "emulated":
        raise ValueError(
            f"intra-node profile must be one of ib100, ib400, nvlink4 ({intra_profile!r})"
        )
    if device is not None and device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (known: {', '.join(DEVICES)})")
    if cores is not None and cores < 1:
        raise ValueError(f"cores must be >= 1 (got {cores})")
    if mem_bw_gbps is not None and not mem_bw_gbps > 0:
        raise ValueError(f"memory bandwidth must be positive (got {mem_bw_gbps} GB/s)")
    if call_overhead_us is not None and not call_overhead_us >= 0:
        raise ValueError(f"call overhead must be >= 0 us (got {call_overhead_us})")


def _inter_link(
    profile: str,
    rate: str | float | None,
    latency_us: float | None,
    efficiency: float | None,
    network_table: str | None,
) -> tuple[Link, dict[str, Any]]:
    """The link between nodes, and the emulated link's calibration (empty for a named one)."""
    calib: dict[str, Any] = {}
    if profile == "emulated":
        link, calib = emulated_link(
            _rate_bps(rate if rate is not None else "100mbit"), network_table
        )
        link = Link(
            link.rate_bps,
            link.latency_s,
            link.efficiency,
            link.source,
            float(calib.get("two_streams_efficiency") or link.efficiency),
            calib.get("exchange_efficiency"),
            float(calib.get("extra_cpu_per_byte_s") or 0.0),
            calib.get("notice_queue_s"),
            tuple((float(b), float(e)) for b, e in calib.get("butterfly_efficiency") or ()),
        )
    else:
        link = named_link(profile)
        if rate is not None:
            link = Link(
                _rate_bps(rate), link.latency_s, link.efficiency, link.source + ", rate given"
            )
    if latency_us is not None or efficiency is not None:
        link = Link(
            link.rate_bps,
            link.latency_s if latency_us is None else latency_us * 1e-6,
            link.efficiency if efficiency is None else efficiency,
            link.source + ", overridden",
            link.shared_efficiency if efficiency is None else efficiency,
            link.exchange_efficiency if efficiency is None else efficiency,
            link.cpu_per_byte_s,
            link.notice_queue_s,
            link.exchange_curve if efficiency is None else (),
        )
    return link, calib


def _kernel_table(
    device: str,
    kernel_table: str | None,
    mem_bw_gbps: float | None,
    call_overhead_us: float | None,
) -> KernelTable:
    if mem_bw_gbps is not None:
        return KernelTable(
            {},
            mem_bw_gbps * 1e9,
            (call_overhead_us or 0.0) * 1e-6,
            device,
            f"roofline {mem_bw_gbps:g} GB/s",
        )
    table = device_table(device, kernel_table)
    if call_overhead_us is not None:
        table.overhead = call_overhead_us * 1e-6
    return table


def _host(
    device: str,
    table: KernelTable,
    calib: dict[str, Any],
    ranks: int,
    profile: str,
    ranks_per_node: int,
    cores: int | None,
) -> Host:
    if device != "cpu":
        return gpu_host()
    n_cores = cores or os.cpu_count() or 1
    # ranks per machine: the emulated cluster puts every rank on this one
    on_host = ranks if profile == "emulated" else ranks_per_node
    # a table timed by P processes at once already has their sharing of the cores in it
    shared = max(1.0, on_host / n_cores) / max(1.0, table.procs / n_cores)
    return Host(
        send=Cost(0.0, float(calib.get("send_per_byte_s", 0.0))),
        add=table.add,
        cpu_slowdown=max(1.0, shared),
        lookahead=True,
        source=f"CPU engine: rounds overlap; {on_host} ranks on {n_cores} cores",
    )


# the keyword arguments are predict's (and the CLI's) user-facing options, passed through
def resolve(  # noqa: PLR0913
    ranks: int,
    *,
    profile: str = "emulated",
    rate: str | float | None = None,
    latency_us: float | None = None,
    efficiency: float | None = None,
    ranks_per_node: int = 1,
    intra_profile: str = "nvlink4",
    device: str | None = None,
    kernel_table: str | None = None,
    network_table: str | None = None,
    mem_bw_gbps: float | None = None,
    call_overhead_us: float | None = None,
    cores: int | None = None,
) -> Setup:
    """The cluster, kernel table and host a prediction uses, and where each came from."""
    _check(profile, intra_profile, device, cores, mem_bw_gbps, call_overhead_us)
    device = device or ("cpu" if profile == "emulated" else "h200")
    link, calib = _inter_link(profile, rate, latency_us, efficiency, network_table)
    intra = named_link(intra_profile) if ranks_per_node > 1 else None
    cluster = Cluster(ranks, link, ranks_per_node, intra)
    table = _kernel_table(device, kernel_table, mem_bw_gbps, call_overhead_us)
    host = _host(device, table, calib, ranks, profile, ranks_per_node, cores)
    sources = {
        "link": asdict(link),
        "intra_link": asdict(intra) if intra else None,
        "kernels": table.source,
        "host": asdict(host),
    }
    return cluster, table, host, sources


def _host_table(path: str | None, ranks: int, profile: str) -> dict[str, Any] | None:
    """A ``dynamiq plan calibrate --host`` table, checked: it applies to the emulated
    cluster (every rank on this machine) of as many ranks as it was measured with."""
    if path is None:
        return None
    import json

    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"host table {path}: {exc}") from exc
    if not isinstance(table, dict) or table.get("kind") != "dynamiq-plan-host":
        raise ValueError(f"{path}: not a `dynamiq plan calibrate --host` table")
    if profile != "emulated":
        raise ValueError(
            f"a host table is the CPU of ranks sharing one machine: it applies to the "
            f"emulated profile only (got profile {profile!r})"
        )
    if int(table["ranks"]) != ranks:
        raise ValueError(f"{path} was measured with {table['ranks']} ranks, not {ranks}")
    return table


def predict(
    ranks: int,
    codecs: Sequence[Any] = ("dynamiq",),
    schedules: Sequence[str] = ("ring",),
    *,
    size_mib: float = 64.0,
    sub_chunk: int = 1 << 18,
    host_table: str | None = None,
    **setup: Any,
) -> dict[str, Any]:
    """Predict each codec × schedule's all-reduce of ``size_mib`` MiB of fp32 on ``ranks``
    ranks; ``setup``: the keywords of :func:`resolve`. Returns ``{"config", "parameters",
    "results"}``, one result per codec × schedule with the predicted total ``seconds``, the
    phases, per-round times and bits/value (see :class:`~dynamiq.plan.model.Prediction`).

    ``host_table`` (``dynamiq plan calibrate --host``; the emulated profile): the ranks share
    this machine's cores, so a result's ``seconds`` is at least its ``cpu_floor_s``
    (:func:`~dynamiq.plan.calibrate.host_floor`: ``ranks × CPU per rank / cores`` or the
    loopback all-reduce's time, the larger) (``bound``: ``"cpu"`` where the floor decides,
    ``"schedule"`` where the simulated schedule does)."""
    if not size_mib > 0:
        raise ValueError(f"size must be positive (got {size_mib} MiB)")
    if sub_chunk < 1:
        raise ValueError(f"sub-chunk must be positive (got {sub_chunk})")
    if not codecs:
        raise ValueError("no codecs to predict")
    if not schedules:
        raise ValueError("no schedules to predict")
    for c in codecs:
        get_codec(c)  # UnknownCodecError names the known ids
    cluster, table, host, sources = resolve(ranks, **setup)
    hosts = _host_table(host_table, ranks, setup.get("profile", "emulated"))
    if hosts is not None:
        sources["host_table"] = {k: hosts[k] for k in ("date", "machine", "ranks", "cores")}
    # the hierarchical schedule's nodes are the cluster's
    g = cluster.ranks_per_node if cluster.ranks_per_node > 1 else 2
    scheds = [
        get_schedule(s, ranks, ranks_per_node=g) if s == "hierarchical" else get_schedule(s, ranks)
        for s in schedules
    ]
    numel = max(1, int(size_mib * 2**20) // 4)
    results = []
    for c in codecs:
        for s in scheds:
            if hosts is not None and host_cpu(hosts, str(c), s.name, numel) is not None:
                res = _shared_cores(c, s, cluster, numel, table, host, hosts, sub_chunk)
            else:
                p = simulate(
                    c, s, cluster, numel, table.get(c), host, sub_chunk=sub_chunk,
                    intra_costs=table.get,
                )  # fmt: skip
                res = p.as_dict()
            results.append(res)
    config = {"ranks": ranks, "size_mib": size_mib, "numel": numel, "sub_chunk": sub_chunk, **setup}
    if host_table is not None:
        config["host_table"] = host_table
    return {"config": config, "parameters": sources, "results": results}


def _shared_cores(
    c: Any,
    s: Any,
    cluster: Cluster,
    numel: int,
    table: KernelTable,
    host: Host,
    hosts: dict[str, Any],
    sub_chunk: int,
) -> dict[str, Any]:
    """One prediction with a host table: the ranks' CPU steps share the machine's cores (each
    kernel at its cost alone), every step also costs the engine's own work around it (the
    host table's CPU per rank beyond the kernels', spread over the rank's steps), and the
    result is at least the table's floor (:func:`~dynamiq.plan.calibrate.host_floor`). The
    links' own CPU beyond loopback's (``Link.cpu_per_byte_s`` × the bytes a rank sends and
    receives) counts in both: the table was measured on loopback."""
    cores = int(hosts["cores"])
    alone = table.alone(cores)
    pool = replace(host, cpu_slowdown=1.0, cores=cores, add=alone.add, step_overhead=0.0)
    kw: dict[str, Any] = {"sub_chunk": sub_chunk, "intra_costs": alone.get}
    first = simulate(c, s, cluster, numel, alone.get(c), pool, **kw)
    cpu = host_cpu(hosts, str(c), s.name, numel)
    assert cpu is not None
    sock = cluster.inter.cpu_per_byte_s * 2 * first.bytes_sent_per_rank
    extra = max(0.0, cpu + sock - first.cpu_seconds_per_rank) / max(1.0, first.cpu_steps_per_rank)
    pool = replace(pool, step_overhead=extra)
    res = simulate(c, s, cluster, numel, alone.get(c), pool, **kw).as_dict()
    floor = host_floor(hosts, str(c), s.name, numel, extra_cpu=sock)
    assert floor is not None
    res["cpu_floor_s"], res["schedule_s"], res["step_overhead_s"] = floor, res["seconds"], extra
    res["link_cpu_s"] = sock
    res["bound"] = "cpu" if floor > res["seconds"] else "schedule"
    res["seconds"] = max(floor, res["seconds"])
    return res


def _bf16_ideal(cluster: Cluster, numel: int) -> float:
    """NCCL-style bf16 ring all-reduce, α-β only: ``2(n-1)`` steps of ``2·numel/n`` bytes."""
    n = cluster.ranks
    worst = max((cluster.link(r, (r + 1) % n) for r in range(n)), key=lambda lk: lk.seconds(1.0))
    return 2 * (n - 1) * (worst.latency_s + worst.seconds(2 * numel / n))


def _speedup(
    c: str, schedule: str, cluster: Cluster, costs: Any, host: Host, mib: float, sub: int
) -> float:
    numel = int(mib * 2**20) // 4
    p = simulate(c, schedule, cluster, numel, costs, host, sub_chunk=sub)
    return _bf16_ideal(cluster, numel) / p.seconds


def _first_win(
    c: str, schedule: str, cluster: Cluster, costs: Any, host: Host, sizes: list[float], sub: int
) -> float | None:
    """The smallest of ``sizes`` at which ``c`` beats bf16, by bisection: a larger bucket
    spreads the same per-call and per-message overheads over more bytes, so the speed-up
    grows with the size (checked at the ends: None if it does not win at the largest)."""
    if not sizes or _speedup(c, schedule, cluster, costs, host, sizes[-1], sub) <= 1.0:
        return None
    lo, hi = -1, len(sizes) - 1  # sizes[hi] wins; sizes[lo] (lo >= 0) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _speedup(c, schedule, cluster, costs, host, sizes[mid], sub) > 1.0:
            hi = mid
        else:
            lo = mid
    return sizes[hi]


def break_even(
    codecs: Sequence[str],
    ranks: int = 8,
    size_mib: float = 64.0,
    schedule: str = "ring",
    sizes_mib: Sequence[float] = _SIZES_MIB,
    sub_chunk: int = 1 << 18,
) -> list[dict[str, Any]]:
    """For H100/H200 × 100/400 Gb/s InfiniBand × NVLink 4: each codec's speed-up over an
    α-β bf16 ring at ``size_mib``, and the smallest bucket of ``sizes_mib`` from which it is
    faster (None: at none of them). InfiniBand rows put one rank per node; NVLink rows put all
    ``ranks`` in one node."""
    rows = []
    for device in ("h100", "h200"):
        table = device_table(device)
        for link_name in ("ib100", "ib400", "nvlink4"):
            cluster = Cluster(ranks, named_link(link_name))
            host = gpu_host()
            for c in codecs:
                costs = table.get(c)
                wins = _first_win(c, schedule, cluster, costs, host, sorted(sizes_mib), sub_chunk)
                rows.append(
                    {
                        "device": device,
                        "link": link_name,
                        "codec": c,
                        "speedup_vs_bf16": _speedup(
                            c, schedule, cluster, costs, host, size_mib, sub_chunk
                        ),
                        "beats_bf16_from_mib": wins,
                    }
                )
    return rows
