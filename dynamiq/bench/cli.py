"""The ``dynamiq`` command line (DESIGN.md, "CLI").

``dynamiq codecs`` prints the codec table (id, bits/value, bound formula, unbiased);
``dynamiq demo`` prints it and measures every codec on the committed slice of real gradients.
Every command takes ``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from dynamiq.codecs import HopContext, UnknownCodecError, get_codec, list_codecs

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
    * ``chain vnmse``: the workers' gradients summed along a chain of ``reduce`` hops
      (decompress, add the next worker's gradient, recompress; what one chunk sees in a ring),
      against the fp64 sum.
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
                f"chain vnmse ({hops} hops)": chain,
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
        print(json.dumps(rows, indent=2))
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
        print(
            json.dumps(
                {
                    "codecs": table,
                    "slice_stats": stats,
                    "allreduce": mp_rows,
                    "errors": rows,
                },
                indent=2,
            )
        )
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


def _cmd_compare(args: argparse.Namespace) -> int:
    from dynamiq.bench.compare import compare_families

    workers = [int(w) for w in args.workers.split(",")]
    if args.codecs.lstrip().startswith("["):
        codecs = json.loads(args.codecs)  # a JSON list of ids and configs
    else:
        codecs = args.codecs.split(",") if args.codecs else list_codecs()
    rows = compare_families(
        args.family,
        codecs,
        args.schedules.split(","),
        workers,
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
    codecs = args.codecs.split(",")
    rows = bench_kernels(
        codecs,
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynamiq",
        description="Compressed multi-hop gradient all-reduce: codecs, kernels, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "codecs",
        help="list the registered codecs",
        description="Table of every registered codec: id, wire bits per value (1M values, "
        "all metadata counted), whether it is unbiased, and its certified per-element error "
        "bound.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--markdown", action="store_true", help="print a Markdown table (as in docs/codecs.md)"
    )
    p.set_defaults(func=_cmd_codecs)
    p = sub.add_parser(
        "demo",
        help="a short showcase: codec table, a real multi-process all-reduce, a comparison",
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
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser(
        "compare",
        help="vNMSE and bits/value of codecs x schedules x world sizes on real gradients",
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
    p.set_defaults(func=_cmd_compare)
    bench = sub.add_parser("bench", help="benchmarks (kernels)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = bsub.add_parser(
        "kernels",
        help="fused reduce vs unfused vs the memory roofline",
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
    p.set_defaults(func=_cmd_bench_kernels)
    from dynamiq.bench import cluster as _cluster

    _cluster.add_parser(bsub)  # `dynamiq bench cluster` (dynamiq/bench/cluster.py)
    from dynamiq.bench import train as _train

    _train.add_parser(bsub)  # `dynamiq bench train` (dynamiq/bench/train.py)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dynamiq`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `dynamiq codecs | head`
        sys.stderr.close()
        return 0
    except UnknownCodecError as e:  # a typo in --codecs: the message lists the known ids
        print(f"dynamiq: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
