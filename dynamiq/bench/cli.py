"""The ``dynamiq`` command line (docs/design.md, "CLI").

``dynamiq codecs`` prints the codec table (id, bits/value, bound formula, unbiased);
``dynamiq demo`` prints it and measures every codec on the committed slice of real gradients;
``dynamiq compare`` and ``dynamiq bench kernels|cluster|train`` measure. Every command takes
``--json`` for machine-readable output, with identifier keys (:mod:`dynamiq.bench.args`).

Each subcommand's parser carries a ``check`` (its arguments, all of them, before any work:
data, models and clusters are built only after it passed) and a ``func`` (the work); an
argument error prints the subcommand's usage and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from dynamiq.bench.args import check_int, parse_codecs, parse_ints, parse_schedules, print_json
from dynamiq.codecs import HopContext, get_codec, list_codecs

__all__ = ["codec_table", "main", "markdown_table", "slice_errors"]


def format_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """Left-aligned text table of ``rows`` (dicts) restricted to ``columns``."""
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if (v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4)) else f"{v:.4g}"
    return str(v)


def codec_table() -> list[dict[str, Any]]:
    """One row per registered codec name."""
    rows = []
    for name in list_codecs():
        codec = get_codec(name)
        eb = codec.error_bound
        rows.append(
            {
                "id": name,
                "bits/value": codec.bits_per_value(),
                "unbiased": eb.unbiased,
                "bound |x̂ - x| <=": eb.formula,
            }
        )
    return rows


def slice_errors(grads: torch.Tensor, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Errors of each codec on real gradients ``grads`` ([workers, numel] fp32).

    * ``vnmse``: one-shot ``Σ‖x̂ - x‖² / Σ‖x‖²`` over the workers' gradients;
    * ``bound use``: the largest ``|x̂ - x| / max_abs_error(x)`` seen (<= 1: the bound holds);
    * ``chain vnmse``: the workers' gradients summed along a chain of ``chain hops`` fused
      ``reduce`` hops (decompress, add the next worker's gradient, recompress; what one chunk
      sees in a ring), against the fp64 sum.
    """
    rows = []
    workers, n = grads.shape
    exact = grads.double().sum(dim=0)
    for name in names or list_codecs():
        codec = get_codec(name)
        t0 = time.perf_counter()
        sq_err = sq = 0.0
        use = 0.0
        for w in range(workers):
            x = grads[w].contiguous()
            ctx = HopContext(rank=w, world_size=workers)
            y = codec.decode(codec.encode(x, ctx), n, ctx).double()
            err = (y - x.double()).abs()
            sq_err += float(err.square().sum())
            sq += float(x.double().square().sum())
            bound = codec.error_bound.max_abs_error(x, ctx)
            use = max(use, float((err / bound.clamp(min=1e-300)).max()))
        hops = workers - 1
        ctx = HopContext(hop=0, num_hops=workers, rank=0, world_size=workers)
        payload = codec.encode(grads[0].contiguous(), ctx)
        for k in range(1, workers):
            out_ctx = HopContext(
                hop=k, num_hops=workers, rank=k, contributions=k + 1, world_size=workers
            )
            payload = codec.reduce(payload, grads[k].contiguous(), ctx, out_ctx)
            ctx = out_ctx
        total = codec.decode(payload, n, ctx).double()
        chain = float((total - exact).square().sum() / exact.square().sum())
        rows.append(
            {
                "id": name,
                "bits/value": codec.bits_per_value(),
                "vnmse": sq_err / sq,
                "bound use": round(use, 4),
                "chain vnmse": chain,
                "chain hops": hops,
                "seconds": time.perf_counter() - t0,
            }
        )
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The codec table as Markdown (the generated part of docs/codecs.md)."""
    cols = list(rows[0])

    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(map(esc, cols)) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"`{v}`" if c.startswith("bound") or c == "id" else _fmt(v) for c, v in r.items()]
        lines.append("| " + " | ".join(map(esc, cells)) + " |")
    return "\n".join(lines)


def _print_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """JSON, Markdown or a text table, as the command's flags ask."""
    if args.json:
        print_json(rows)
    elif getattr(args, "markdown", False):
        print(markdown_table(rows))
    else:
        print(format_table(rows, list(rows[0])))


def _cmd_codecs(args: argparse.Namespace) -> int:
    _print_rows(codec_table(), args)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from dynamiq.bench.demo import multiprocess_allreduce
    from dynamiq.data import gradient_stats, load_slice

    t0 = time.perf_counter()
    quiet = args.json
    table = codec_table()
    grads = load_slice()
    stats = gradient_stats(grads)
    w, n = grads.shape
    if not quiet:
        print("dynamiq codecs\n")
        print(format_table(table, list(table[0])))
        print(
            f"\n1. A real compressed all-reduce: {args.world_size} processes on loopback "
            f"(torch.distributed, gloo), each holding {w // args.world_size} workers' real "
            f"gradients ({n * w // args.world_size} values); every rank ends with the sum.\n",
            flush=True,
        )
        _progress("spawning ranks ...")
    mp_rows = multiprocess_allreduce(grads, world_size=args.world_size)
    if not quiet:
        _progress("")
        cols = ["codec", "schedule", "bytes/rank", "vs fp32", "bits/value", "vnmse"]
        print(format_table(mp_rows, [*cols, "bit-identical", "seconds"]))
        print(
            f"\n2. Every codec on the same real gradients ({w} workers x {n} values, "
            f"per-worker kurtosis {stats['kurtosis']:.0f}, norm max/min "
            f"{stats['norm_max_min_ratio']:.2f}):\n",
            flush=True,
        )
    rows = []
    names = list_codecs()
    for i, name in enumerate(names):
        if not quiet:
            _progress(f"[{i + 1}/{len(names)}] {name}")
        rows.extend(slice_errors(grads, [name]))
    if not quiet:
        _progress("")
    held = all(r["bound use"] <= 1.0 for r in rows)
    same = all(r["bit-identical"] for r in mp_rows)
    if args.json:
        print_json({"codecs": table, "slice_stats": stats, "allreduce": mp_rows, "errors": rows})
        return 0 if held and same else 1
    print(format_table(rows, [c for c in rows[0] if c != "seconds"]))
    verdict = "every certified bound held" if held else "A CERTIFIED BOUND WAS EXCEEDED"
    print(f"\nbound use = max |x̂ - x| / bound: {verdict}")
    print(
        "ranks bit-identical: "
        + ("yes, for every codec and schedule" if same else "NO (a bug: please report it)")
    )
    print(
        f"\nNext: `dynamiq compare` (all codecs on the full data set), `dynamiq bench --help`, "
        f"docs/guide.md. ({time.perf_counter() - t0:.0f} s)"
    )
    return 0 if held and same else 1


def _progress(text: str) -> None:
    """One status line on stderr, overwritten by the next (cleared by an empty text)."""
    print("\r" + " " * 60 + "\r" + text, end="", file=sys.stderr, flush=True)


# -- argument checks: everything, before any work ---------------------------------------------


def _check_demo(args: argparse.Namespace) -> None:
    from dynamiq.data import load_slice

    workers = load_slice().shape[0]  # the committed slice (package data, 1 MB)
    check_int("--world-size", args.world_size, 2, workers)
    if workers % args.world_size:
        raise ValueError(
            f"--world-size must divide the slice's {workers} workers (got {args.world_size})"
        )


def _check_compare(args: argparse.Namespace) -> None:
    from dynamiq.data.corpus import SPLITS
    from dynamiq.data.gradients import DataConfig

    args.world_sizes = parse_ints(args.workers, "--workers", 1, DataConfig().max_workers)
    args.codec_specs = parse_codecs(args.codecs) or list_codecs()
    args.schedule_names = parse_schedules(args.schedules, args.world_sizes)
    check_int("--seeds", args.seeds, 1)
    check_int("--numel", args.numel, 0)
    if args.split not in SPLITS:
        raise ValueError(f"--split must be one of {', '.join(SPLITS)} (got {args.split!r})")
    if args.plot:
        _check_plot(args.plot)


def _check_plot(path: str) -> None:
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib (pip install 'dynamiq-allreduce[bench]')")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ValueError(f"--plot: directory {str(parent)!r} does not exist")


def _check_bench_kernels(args: argparse.Namespace) -> None:
    args.codec_specs = parse_codecs(args.codecs)
    if not args.codec_specs:
        raise ValueError("--codecs must name at least one codec")
    check_int("--numel", args.numel, 1)
    check_int("--iters", args.iters, 1)
    check_int("--burst", args.burst, 1)
    if args.device not in ("", "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (got {args.device!r})")
    if args.device == "cuda" and not _cuda():
        raise ValueError("--device cuda: no CUDA device is available")


def _no_check(args: argparse.Namespace) -> None:
    return None


# -- the commands -----------------------------------------------------------------------------


def _cmd_compare(args: argparse.Namespace) -> int:
    from dynamiq.bench.compare import compare_families

    rows = compare_families(
        args.family,
        args.codec_specs,
        args.schedule_names,
        args.world_sizes,
        range(args.seeds),
        split=args.split,
        numel=args.numel,
        progress=not args.quiet,
    )
    _print_rows(rows, args)
    if args.plot:
        from dynamiq.bench.plots import plot_compare

        out = plot_compare(rows, args.plot)
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from dynamiq.bench.kernels import bench_kernels

    device = args.device or ("cuda" if _cuda() else "cpu")
    rows = bench_kernels(
        args.codec_specs,
        args.numel,
        device,
        iters=args.iters,
        burst=args.burst,
        compile=args.compile,
        progress=not args.json,
        backend=args.backend,
    )
    _print_rows(rows, args)
    return 0 if all(r["bit-exact"] for r in rows) else 1


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# -- the parser -------------------------------------------------------------------------------

_CODECS_HELP = "list the registered codecs: bits/value, certified error bound, unbiased"
_DEMO_HELP = "a showcase: codec table, a real multi-process all-reduce, errors on real gradients"
_COMPARE_HELP = "vNMSE and bits/value of codecs x schedules x world sizes on real gradients"
_KERNELS_HELP = "fused reduce vs unfused vs the memory roofline"


def _add_codecs(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "codecs",
        description="Table of every registered codec: id, wire bits per value (1M values, "
        "all metadata counted), whether it is unbiased, and its certified per-element error "
        "bound.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--markdown", action="store_true", help="print a Markdown table (as in docs/codecs.md)"
    )
    p.set_defaults(func=_cmd_codecs, check=_no_check)
    return p


def _add_demo(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        description="Print the codec table; run a real compressed all-reduce of real "
        "transformer gradients across processes on loopback (torch.distributed, gloo) with "
        "several codecs and schedules (bytes sent, bits/value, vNMSE, bit-identical ranks); "
        "then encode the committed slice of real gradients with every codec: one-shot vNMSE, "
        "the largest fraction of the certified bound used, and the vNMSE of summing the "
        "workers along a chain of fused reduce hops (what one chunk sees in a ring).",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--world-size",
        type=int,
        default=4,
        help="processes in the real all-reduce (must divide the slice's 8 workers; default 4)",
    )
    p.set_defaults(func=_cmd_demo, check=_check_demo)
    return p


def _add_compare(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "compare",
        description="Simulate the all-reduce of the real-gradient data set (python -m "
        "dynamiq.data; generated and cached on first use, minutes) with every codec, schedule "
        "and world size, through the same engine that runs over torch.distributed. vNMSE is "
        "the median (and max) over seeds; a seed permutes which gradient each rank holds and "
        "seeds stochastic rounding. bits/value counts every byte sent.",
    )
    p.add_argument(
        "--codecs",
        default="",
        help="comma-separated codec ids, or a JSON list of ids and configs (default: all)",
    )
    p.add_argument("--schedules", default="ring,butterfly", help="comma-separated schedules")
    p.add_argument("--workers", default="4,8,16,32", help="comma-separated world sizes")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (median over them)")
    p.add_argument("--split", default="eval", help="gradient split: eval (default) or fit")
    from dynamiq.data.families import family_arg

    p.add_argument(
        "--family",
        default="lm",
        type=family_arg,
        help="model family: lm (default), mlm, digits, a comma-separated list, or all",
    )
    p.add_argument("--numel", type=int, default=0, help="use only the first N values (0: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--plot",
        default="",
        metavar="PNG",
        help="also write a PNG: vNMSE against bits/value, one panel per schedule and world "
        "size, one line per codec family (needs matplotlib)",
    )
    p.set_defaults(func=_cmd_compare, check=_check_compare)
    return p


def _add_bench_kernels(bsub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = bsub.add_parser(
        "kernels",
        help=_KERNELS_HELP,
        description="For each codec: the fused decompress-accumulate-recompress reduce "
        "(Triton on CUDA; the native C++ kernels on the CPU, or torch.compile with "
        "--compile) against the unfused decode + add + encode on the same device, and "
        "against the memory roofline (bytes the fused kernel must move / measured copy "
        "bandwidth), as ratios measured in one run. Exits 1 if the fused result is not bit-exact.",
    )
    p.add_argument("--codecs", default="int8,mxfp8_e4m3,mxfp4,int4,bf16", help="codec ids")
    p.add_argument("--numel", type=int, default=1 << 24, help="values per buffer (16M)")
    p.add_argument("--device", default="", help="cpu or cuda (default: cuda when present)")
    p.add_argument(
        "--iters", type=int, default=5, help="rounds; each times every path (median of rounds)"
    )
    p.add_argument(
        "--burst",
        type=int,
        default=3,
        help="consecutive timed calls of one path per round, after an untimed one (median)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "cpu", "triton", "reference"],
        help="kernel backend of the fused path: auto (Triton on CUDA, the native C++ kernels "
        "on the CPU where built), cpu (force the native kernels), triton, reference",
    )
    p.add_argument(
        "--compile", action="store_true", help="CPU: the opt-in torch.compile path instead"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_bench_kernels, check=_check_bench_kernels)
    return p


_PLAN_HELP = "predict all-reduce time, phases and bits/value on any cluster (cost model)"


def _plan_checked_later(args: argparse.Namespace) -> None:
    """``dynamiq plan`` checks its own arguments first thing, before any work
    (dynamiq/plan/cli.py)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``dynamiq`` parser; every leaf parser has ``func``, ``check`` and ``parser``."""
    from dynamiq.bench import cluster as _cluster
    from dynamiq.bench import train as _train
    from dynamiq.plan import cli as _plan

    commands = [
        ("codecs", _CODECS_HELP),
        ("demo", _DEMO_HELP),
        ("compare", _COMPARE_HELP),
        ("bench kernels", _KERNELS_HELP),
        ("bench cluster", _cluster.HELP),
        ("bench train", _train.HELP),
        ("plan", _PLAN_HELP),
        ("plan calibrate", "measure the cost model's parameters: kernel costs, the emulated links"),
    ]
    width = max(len(c) for c, _ in commands) + len("dynamiq ")
    parser = argparse.ArgumentParser(
        prog="dynamiq",
        description="Compressed multi-hop gradient all-reduce: codecs, kernels, benchmarks.",
        epilog="commands:\n"
        + "\n".join(f"  {'dynamiq ' + c:<{width}}  {h}" for c, h in commands)
        + "\n\n`dynamiq COMMAND --help` describes a command and its options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # the commands are listed once, in the epilog, with the `bench` ones
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="one of the commands below"
    )
    leaves = [_add_codecs(sub), _add_demo(sub), _add_compare(sub)]
    bench = sub.add_parser(
        "bench",
        description="Benchmarks whose results go into docs/benchmarks.md: kernels (fused "
        "reduce speed), cluster (all-reduce time on an emulated cluster), train (time to "
        "accuracy).",
    )
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    leaves.append(_add_bench_kernels(bsub))
    leaves.append(_cluster.add_parser(bsub))  # `dynamiq bench cluster` (dynamiq/bench/cluster.py)
    leaves.append(_train.add_parser(bsub))  # `dynamiq bench train` (dynamiq/bench/train.py)
    plan = _plan.add_parser(sub)  # `dynamiq plan` (dynamiq/plan/cli.py)
    plan.set_defaults(check=_plan_checked_later)
    leaves.append(plan)
    for leaf in leaves:
        leaf.set_defaults(parser=leaf)
    return parser


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """What ``parser.error`` prints (the subcommand's usage, then the error), as status 2."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynamiq`` console script."""
    args, extra = build_parser().parse_known_args(argv)
    command: argparse.ArgumentParser = args.parser
    if extra:
        return _usage_error(command, f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.check(args)
    except (ValueError, ImportError) as e:  # UnknownCodecError, ScheduleError: named problems
        return _usage_error(command, str(e))
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `dynamiq codecs | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
