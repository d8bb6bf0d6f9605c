"""``dynamiq plan`` and ``dynamiq plan calibrate``: the command line (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from dynamiq.bench.netns import parse_rate
from dynamiq.codecs import UnknownCodecError
from dynamiq.collectives import get_schedule

from .api import break_even, predict
from .profiles import DEVICES, LINKS

__all__ = ["add_parser", "cmd_plan"]

_DEFAULT_CODECS = "fp32,bf16,mxfp8_e4m3,mxfp4,nvfp4,int8,thc,omnireduce,dynamiq"


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``plan`` (and ``plan calibrate``) to the ``dynamiq`` sub-commands."""
    p: argparse.ArgumentParser = sub.add_parser(
        "plan",
        description="Predict each codec x schedule's all-reduce on a cluster from an alpha-beta "
        "network model and measured kernel costs, replaying the engine's own plan (exact "
        "bytes; rounds, sub-chunks and overlap as the engine does them). Parameters come "
        "from microbenchmarks (`dynamiq plan calibrate`) or named profiles; see docs/plan.md.",
    )
    p.add_argument("--ranks", type=int, default=4, help="ranks (default 4)")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks per node (default 1: every rank "
        "its own node; > 1: those ranks talk over --intra-profile)",
    )
    p.add_argument(
        "--profile",
        default="emulated",
        choices=LINKS,
        help="inter-node link: emulated (this machine's `dynamiq bench cluster`, calibrated), "
        "ib100, ib400, nvlink4 (default emulated)",
    )
    p.add_argument("--intra-profile", default="nvlink4", help="intra-node link (default nvlink4)")
    p.add_argument(
        "--rate",
        default=None,
        help="link rate per direction, tc syntax "
        "(100mbit, 1gbit, 400gbit); default: the profile's (emulated: 100mbit)",
    )
    p.add_argument("--latency-us", type=float, default=None, help="override the link's alpha, us")
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="override the link's goodput / rate, in (0, 1]",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=DEVICES,
        help="kernel costs: cpu (calibrated), h100, h200 (default: cpu for the "
        "emulated profile, else h200)",
    )
    p.add_argument(
        "--kernel-table",
        default=None,
        metavar="FILE",
        help="kernel costs from "
        "JSON: `dynamiq plan calibrate --kernels`, `dynamiq bench kernels --json` or "
        "benchmarks/gpu_check.py output",
    )
    p.add_argument(
        "--network-table",
        default=None,
        metavar="FILE",
        help="the emulated link from `dynamiq plan calibrate --network` JSON",
    )
    p.add_argument(
        "--host-table",
        default=None,
        metavar="FILE",
        help="the CPU floor of ranks sharing this machine, from `dynamiq plan calibrate "
        "--host` JSON (emulated profile)",
    )
    p.add_argument(
        "--mem-bw",
        type=float,
        default=None,
        metavar="GBPS",
        help="kernel costs at the memory roofline of this bandwidth (GB/s) instead",
    )
    p.add_argument(
        "--call-overhead-us",
        type=float,
        default=None,
        help="per-kernel-call overhead, us (with --mem-bw; or overrides a table's)",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=None,
        help="CPU: cores the ranks of one machine share (default: this machine's)",
    )
    p.add_argument("--size-mib", type=float, default=64.0, help="fp32 bucket, MiB (default 64)")
    p.add_argument(
        "--codecs", default=_DEFAULT_CODECS, help=f"codec ids (default {_DEFAULT_CODECS})"
    )
    p.add_argument(
        "--schedules", default="ring,butterfly", help="schedules (default ring,butterfly)"
    )
    p.add_argument("--sub-chunk", type=int, default=1 << 18, help="values per piece (262144)")
    p.add_argument("--rounds", action="store_true", help="also print rank 0's rounds")
    p.add_argument(
        "--break-even",
        action="store_true",
        help="also print the break-even table "
        "(H100/H200 x 100/400 Gb/s InfiniBand x NVLink 4) for --ranks, --size-mib",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)
    psub = p.add_subparsers(dest="plan_command", metavar="calibrate")
    _add_calibrate(psub)
    return p


def _add_calibrate(psub: Any) -> None:
    """``dynamiq plan calibrate``'s parser."""
    c = psub.add_parser(
        "calibrate",
        help="measure the parameters: kernel costs on this CPU, the emulated links",
        description="Microbenchmarks for `dynamiq plan`: --kernels times every codec's "
        "encode, fused reduce and decode on this CPU (two sizes: per-call overhead and time "
        "per value); --network builds the emulated cluster (root) and measures a ping-pong "
        "(latency), a stream (goodput, isend time), exchanges and the engine's butterfly over "
        "2-64 MiB (the exchange curve; ~4 min at 100mbit,1gbit); --host runs every codec's "
        "all-reduce on --ranks local processes over loopback and records their CPU (the "
        "CPU floor of ranks sharing this machine). Prints JSON.",
    )
    c.add_argument("--kernels", action="store_true", help="time the kernels")
    c.add_argument("--network", action="store_true", help="measure the emulated links (root)")
    c.add_argument("--host", action="store_true", help="CPU of local ranks' all-reduces (loopback)")
    c.add_argument("--codecs", default=_DEFAULT_CODECS, help="codecs to time")
    c.add_argument(
        "--schedules", default="ring,butterfly", help="schedules (--host; ring,butterfly)"
    )
    c.add_argument("--size-mib", default="16,64", help="fp32 buckets, MiB (--host; default 16,64)")
    c.add_argument(
        "--procs",
        type=int,
        default=1,
        help="processes timing at once (the ranks sharing the cores; default 1)",
    )
    c.add_argument("--sub-chunk", type=int, default=1 << 18, help="values per piece (262144)")
    c.add_argument("--rate", default="100mbit,1gbit", help="rates to calibrate (network)")
    c.add_argument("--ranks", type=int, default=4, help="ranks of the emulated cluster (4)")
    c.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    c.set_defaults(func=cmd_calibrate)


def _fail(msg: str) -> int:
    print(f"dynamiq plan: {msg}", file=sys.stderr)
    return 2


def cmd_plan(args: argparse.Namespace) -> int:
    """``dynamiq plan``: exit 0, or 2 on bad arguments (named)."""
    if args.ranks < 2:
        return _fail(f"--ranks must be >= 2 (got {args.ranks})")
    if args.rate is not None:
        try:
            parse_rate(args.rate)
        except ValueError as exc:
            return _fail(f"--rate: {exc}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        return _fail(f"--efficiency must be in (0, 1] (got {args.efficiency})")
    if args.latency_us is not None and not args.latency_us >= 0:
        return _fail(f"--latency-us must be >= 0 (got {args.latency_us})")
    codecs, schedules = _split(args.codecs), _split(args.schedules)
    try:
        out = predict(
            args.ranks,
            codecs,
            schedules,
            size_mib=args.size_mib,
            sub_chunk=args.sub_chunk,
            profile=args.profile,
            rate=args.rate,
            latency_us=args.latency_us,
            efficiency=args.efficiency,
            ranks_per_node=args.ranks_per_node,
            intra_profile=args.intra_profile,
            device=args.device,
            kernel_table=args.kernel_table,
            network_table=args.network_table,
            host_table=args.host_table,
            mem_bw_gbps=args.mem_bw,
            call_overhead_us=args.call_overhead_us,
            cores=args.cores,
        )
        table = (
            break_even(codecs, args.ranks, args.size_mib, sub_chunk=args.sub_chunk)
            if args.break_even
            else None
        )
    except (ValueError, KeyError, UnknownCodecError) as exc:
        return _fail(str(exc).strip("'\""))
    if table is not None:
        out["break_even"] = table
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(text_report(out, args.rounds))
    return 0


def text_report(out: dict[str, Any], rounds: bool = False) -> str:
    """The predictions as terminal tables."""
    from dynamiq.bench.cli import format_table

    link = out["parameters"]["link"]
    head = (
        f"{out['config']['ranks']} ranks, {out['config']['size_mib']:g} MiB fp32; link "
        f"{link['rate_bps'] / 1e9:g} Gb/s, alpha {link['latency_s'] * 1e6:.0f} us, efficiency "
        f"{link['efficiency']:.3f} ({link['source']}); kernels: {out['parameters']['kernels']}"
    )
    if link.get("exchange_curve"):
        head += "\nexchange rounds' efficiency by their bytes: " + ", ".join(
            f"{b / 2**20:.3g} MiB {e:.3f}" for b, e in link["exchange_curve"]
        )
    cols = (
        "codec",
        "schedule",
        "seconds",
        "bits/value",
        "encode",
        "reduce",
        "decode",
        "send",
        "wait",
        "prologue",
    )
    rows = []
    for r in out["results"]:
        ph = r["phases"]
        rows.append(
            {
                "codec": r["codec"],
                "schedule": r["schedule"],
                "seconds": f"{r['seconds']:.4g}",
                "bits/value": f"{r['bits_per_value']:.3f}"
                + ("" if r["exact_bytes"] else " (bound)"),
                **{k: f"{ph[k]:.3g}" for k in cols[4:]},
            }
        )
    parts = [head, format_table(rows, cols)]
    if rounds:
        for r in out["results"]:
            rr = [
                {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in row.items()}
                for row in r["rounds"]
            ]
            parts.append(f"{r['codec']} {r['schedule']}, rank 0's rounds:")
            parts.append(format_table(rr, tuple(rr[0]) if rr else ()))
    if "break_even" in out:
        be = [
            {
                "device": b["device"],
                "link": b["link"],
                "codec": b["codec"],
                "speed-up vs bf16": f"{b['speedup_vs_bf16']:.2f}",
                "beats bf16 from": "never (<= 1 GiB)"
                if b["beats_bf16_from_mib"] is None
                else f"{b['beats_bf16_from_mib']:g} MiB",
            }
            for b in out["break_even"]
        ]
        parts.append("Break-even against an alpha-beta bf16 ring (NCCL-like), same ranks:")
        parts.append(format_table(be, tuple(be[0]) if be else ()))
    parts.append(
        "Phases: mean seconds per rank (encode, fused reduce, decode, isend calls, "
        "waiting for peers' data, prologue)."
    )
    return "\n\n".join(parts)


def _calibrate_args(
    args: argparse.Namespace,
) -> tuple[list[str], list[str], list[str], list[float]]:
    """``calibrate``'s codecs, rates, schedules and sizes, checked (``ValueError``)."""
    from dynamiq.codecs import get_codec

    if args.procs < 1:
        raise ValueError(f"--procs must be >= 1 (got {args.procs})")
    codecs = _split(args.codecs)
    for c in codecs:
        get_codec(c)
    rates = _split(args.rate)
    for r in rates:
        parse_rate(r)
    if (args.network or args.host) and not 2 <= args.ranks <= 64:
        raise ValueError(f"--ranks must be in 2..64 (got {args.ranks})")
    schedules = _split(args.schedules)
    for s in schedules:
        get_schedule(s, args.ranks)
    try:
        sizes = [float(v) for v in _split(args.size_mib)]
    except ValueError:
        sizes = []
    if not sizes or not all(v > 0 for v in sizes):
        raise ValueError(f"--size-mib must be positive MiB (got {args.size_mib!r})")
    return codecs, rates, schedules, sizes


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``dynamiq plan calibrate``: exit 0, 1 (a benchmark failed), 2 (bad arguments)."""
    if args.host and (args.kernels or args.network):
        return _fail("calibrate: --host is a table of its own: run it alone")
    if not (args.kernels or args.network or args.host):
        return _fail("calibrate: say what to measure: --kernels, --network and/or --host")
    try:
        codecs, rates, schedules, sizes = _calibrate_args(args)
    except (ValueError, UnknownCodecError) as exc:
        return _fail(f"calibrate: {exc}")
    result: dict[str, Any] = {}
    try:
        if args.host:
            from .calibrate import calibrate_host

            result = calibrate_host(codecs, schedules, args.ranks, sizes)
        if args.kernels:
            result = _kernels(codecs, args.sub_chunk, args.procs)
        if args.network:
            from dynamiq.bench.netns import NamespaceUnavailable

            from .calibrate import calibrate_network

            try:
                net = calibrate_network(rates, args.ranks)
            except NamespaceUnavailable as exc:
                return _fail(f"calibrate: cannot build the emulated cluster here: {exc}")
            result = {**result, "network": net} if args.kernels else net
    except RuntimeError as exc:
        print(f"dynamiq plan calibrate: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def _kernels(codecs: list[str], sub_chunk: int, procs: int) -> dict[str, Any]:
    from .calibrate import calibrate_kernels

    if procs == 1:
        return calibrate_kernels(codecs, sub_chunk)
    # ``procs`` copies at once, as ranks share the cores; each op's cost: the median copy's
    with tempfile.TemporaryDirectory(prefix="dynamiq-plan-") as tmp:
        outs = [os.path.join(tmp, f"{i}.json") for i in range(procs)]
        argv = [
            sys.executable,
            "-m",
            "dynamiq",
            "plan",
            "calibrate",
            "--kernels",
            "--codecs",
            ",".join(codecs),
            "--sub-chunk",
            str(sub_chunk),
        ]
        ps = [subprocess.Popen([*argv, "--out", o], stderr=subprocess.DEVNULL) for o in outs]
        if any(p.wait() != 0 for p in ps):
            raise RuntimeError("a kernel-timing process failed")
        tables = []
        for o in outs:
            with open(o) as f:
                tables.append(json.load(f))
    merged = tables[0]
    for name, row in merged["codecs"].items():
        for op in row:
            for k in ("overhead", "per_value"):
                row[op][k] = statistics.median(t["codecs"][name][op][k] for t in tables)
    merged["add"]["per_value"] = statistics.median(t["add"]["per_value"] for t in tables)
    merged["procs"] = procs
    return merged
