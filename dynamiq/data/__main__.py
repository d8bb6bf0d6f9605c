"""``python -m dynamiq.data``: generate (or load) both gradient splits and print their statistics.

Examples::

    python -m dynamiq.data                    # family lm: generate if missing, print stats
    python -m dynamiq.data --family mlm       # the masked-LM encoder (--family digits: conv net)
    python -m dynamiq.data --family all       # every family, one after the other
    python -m dynamiq.data --regenerate       # retrain and recompute everything
    python -m dynamiq.data --write-slice      # also rewrite the family's committed slice
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dynamiq.data import gradient_stats, load_slice, slice_file
from dynamiq.data.corpus import SPLITS
from dynamiq.data.families import FAMILIES, Family, family_arg, family_config
from dynamiq.data.gradients import (
    SLICE_WORKERS,
    default_cache_dir,
    generate,
    gradient_paths,
    load_or_generate,
    write_slice,
)

_ROWS: tuple[tuple[str, str], ...] = (
    ("workers", "workers"),
    ("numel", "values per worker"),
    ("kurtosis", "kurtosis per worker (mean)"),
    ("excess_kurtosis", "excess kurtosis per worker"),
    ("sum_kurtosis", "kurtosis of summed grad"),
    ("sum_excess_kurtosis", "excess kurtosis of sum"),
    ("norm_min", "worker L2 norm min"),
    ("norm_max", "worker L2 norm max"),
    ("norm_mean", "worker L2 norm mean"),
    ("norm_max_min_ratio", "norm max/min"),
    ("norm_cv", "norm coeff. of variation"),
    ("zero_fraction", "fraction exact zeros"),
    ("absmax_over_rms", "absmax/RMS per worker"),
    ("sum_absmax_over_rms", "absmax/RMS of sum"),
)


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == int(value) and abs(value) >= 1:
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.4g}"


def format_table(columns: dict[str, dict[str, float]]) -> str:
    """Markdown table: one row per statistic, one column per data set."""
    header = "| statistic | " + " | ".join(columns) + " |"
    rule = "|---|" + "---:|" * len(columns)
    lines = [header, rule]
    for key, label in _ROWS:
        lines.append(
            f"| {label} | " + " | ".join(_fmt(stats[key]) for stats in columns.values()) + " |"
        )
    return "\n".join(lines)


def layer_mix(layout: list[dict[str, Any]], grads: torch.Tensor) -> list[dict[str, Any]]:
    """Per role (parameter name without its ``blocks.<i>.`` prefix): tensors, values, the
    share of all values, gradient RMS and the per-worker kurtosis of those columns (fp64)."""
    roles: dict[str, list[dict[str, Any]]] = {}
    for p in layout:
        parts = str(p["name"]).split(".")
        role = ".".join(parts[2:]) if parts[0] == "blocks" else str(p["name"])
        roles.setdefault(role, []).append(p)
    total = sum(int(p["numel"]) for p in layout)
    rows = []
    for role, params in roles.items():
        cols = torch.cat(
            [grads[:, int(p["offset"]) : int(p["offset"]) + int(p["numel"])] for p in params], 1
        )
        st = gradient_stats(cols)
        numel = int(cols.shape[1])
        rows.append(
            {
                "role": role,
                "tensors": len(params),
                "values": numel,
                "share": numel / total,
                "rms": float(torch.sqrt((cols.double() ** 2).mean())),
                "kurtosis": st["kurtosis"],
            }
        )
    return rows


def format_mix(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`layer_mix`."""
    lines = [
        "| parameters | tensors | values | share | gradient RMS | kurtosis per worker |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['role']} | {r['tensors']} | {r['values']:,} | {r['share']:.2%} | "
            f"{r['rms']:.3g} | {_fmt(r['kurtosis'])} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamiq.data",
        description=(
            "Generate (or load from the cache) a real-gradient data set: a model trained from "
            "scratch on data that ships with a package, then one forward/backward per worker "
            "on a disjoint shard. Families: lm (byte-level causal transformer on CPython's docs "
            "and stdlib sources; the default), mlm (BERT-style masked-LM encoder on the same "
            "text), digits (conv net on scikit-learn's bundled digits). Builds both splits "
            "('eval' and 'fit') and prints their statistics."
        ),
        epilog="The cache directory defaults to $DYNAMIQ_CACHE, else ~/.cache/dynamiq.",
    )
    parser.add_argument(
        "--family",
        default=FAMILIES[0],
        type=family_arg,
        help=f"{', '.join(FAMILIES)}, a comma-separated list or 'all' (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=32,
        help="workers (gradient rows) per split (default: %(default)s)",
    )
    parser.add_argument(
        "--regenerate",
        action="store_true",
        help="retrain and recompute even if a cache entry exists",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache directory (default: $DYNAMIQ_CACHE or ~/.cache/dynamiq)",
    )
    parser.add_argument(
        "--write-slice",
        action="store_true",
        help=(
            "rewrite the family's committed slice (dynamiq/data/slice.npz for lm, "
            f"slice-<family>.npz otherwise) from the first {SLICE_WORKERS} eval workers"
        ),
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice, usually one per core)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1 (got {args.workers})")
    if args.write_slice and args.workers < SLICE_WORKERS:
        parser.error(
            f"--workers must be >= {SLICE_WORKERS} with --write-slice (got {args.workers})"
        )
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1 (got {args.threads})")
        torch.set_num_threads(args.threads)
    families: list[str] = args.family
    cache_dir = default_cache_dir() if args.cache_dir is None else args.cache_dir
    for name in families:
        cfg = family_config(name)
        if args.workers > cfg.max_workers:
            parser.error(
                f"--workers must be <= {cfg.max_workers} for family {name} (got {args.workers})"
            )
    for name in families:
        _run_family(family_config(name), args, cache_dir)
    return 0


def _run_family(cfg: Family, args: argparse.Namespace, cache_dir: Path) -> None:
    """Generate or load both splits of one family; print its summary and statistics."""
    columns: dict[str, dict[str, float]] = {}
    metas: dict[str, dict[str, Any]] = {}
    mix: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for split in SPLITS:
        if args.regenerate and split != SPLITS[0]:
            # The model was retrained for the first split; recompute this split's
            # gradients at those weights instead of training again.
            grads, meta = generate(
                split, args.workers, cfg, cache_dir=cache_dir, progress=not args.quiet
            )
        else:
            grads, meta = load_or_generate(
                split,
                args.workers,
                cfg,
                cache_dir=cache_dir,
                regenerate=args.regenerate,
                progress=not args.quiet,
            )
        metas[split] = meta
        columns[f"{split} ({grads.shape[0]}x{grads.shape[1]:,})"] = gradient_stats(
            torch.from_numpy(grads)
        )
        if split == "eval":
            mix = layer_mix(meta["params"], torch.from_numpy(grads))
            if args.write_slice:
                path = Path(__file__).with_name(slice_file(cfg.name))
                write_slice(grads, meta, path, cfg, extras=cfg.name != "lm")
                print(f"wrote slice {path}")
        del grads
    wall = time.perf_counter() - t0
    try:
        slice_ = load_slice(cfg.name)
    except FileNotFoundError:
        print("no committed slice found (run with --write-slice to create it)")
    else:
        columns[f"slice ({slice_.shape[0]}x{slice_.shape[1]:,})"] = gradient_stats(slice_)
    _print_summary(cfg, metas, cache_dir, wall)
    print()
    print(format_table(columns))
    print()
    print(format_mix(mix))
    print()


def _print_summary(
    cfg: Family, metas: dict[str, dict[str, Any]], cache_dir: Path, wall: float
) -> None:
    meta = metas["eval"]
    train = meta["train"]
    data = meta["data"]
    curve = train["train_loss_curve"]
    source = cfg.build_source()
    print(f"family {cfg.name}: cache directory {cache_dir.resolve()}")
    for split in SPLITS:
        npy, _ = gradient_paths(cache_dir, split, cfg, source)
        print(f"  {split}: {npy.name}  ({metas[split]['workers']} workers)")
    print(f"config: {cfg}  ({meta['numel']:,} parameters)")
    if "documents" in data:
        print(
            f"corpus: {data['bytes']:,} bytes ({data['documents']} documents: "
            f"{data['pydoc_topics_bytes']:,} B pydoc topics + {data['stdlib_bytes']:,} B "
            f"stdlib), sha256 {data['sha256'][:16]}"
        )
    else:
        print(f"data: {data}")
    window = max(1, len(curve) // 20)
    marks = sorted({0, len(curve) // 4, len(curve) // 2, 3 * len(curve) // 4, len(curve) - 1})
    print(
        f"training: {cfg.train_steps} AdamW steps x batch {cfg.train_batch}, loss (nats) "
        + ", ".join(f"step {i + 1}: {curve[i]:.4f}" for i in marks)
        + f"; final {train['final_train_loss']:.4f} (mean of last "
        f"{train['final_train_loss_window']} steps; first {window}: "
        f"{sum(curve[:window]) / window:.4f}); trained in {train['train_seconds']:.1f}s"
    )
    for split in SPLITS:
        losses = metas[split]["worker_losses"]
        print(
            f"{split} worker losses: mean {sum(losses) / len(losses):.4f}, "
            f"min {min(losses):.4f}, max {max(losses):.4f}"
        )
    print(f"wall time this family: {wall:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
