"""``python -m dynamiq.data``: generate (or load) both gradient splits and print their statistics.

Examples::

    python -m dynamiq.data                    # generate if missing, print stats
    python -m dynamiq.data --regenerate       # retrain and recompute everything
    python -m dynamiq.data --write-slice      # also rewrite dynamiq/data/slice.npz
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

from dynamiq.data import SPLITS, gradient_stats, load_slice
from dynamiq.data.gradients import (
    SLICE_WORKERS,
    DataConfig,
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamiq.data",
        description=(
            "Generate (or load from the cache) the real-gradient data set: a byte-level "
            "transformer trained on CPython's docs and stdlib sources, then one forward/backward "
            "per worker on disjoint text. Builds both splits ('eval' and 'fit') and prints their "
            "statistics."
        ),
        epilog="The cache directory defaults to $DYNAMIQ_CACHE, else ~/.cache/dynamiq.",
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
            "rewrite the committed slice dynamiq/data/slice.npz from the first "
            f"{SLICE_WORKERS} eval workers"
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
    cfg = DataConfig()
    cache_dir = default_cache_dir() if args.cache_dir is None else args.cache_dir
    columns: dict[str, dict[str, float]] = {}
    metas: dict[str, dict[str, Any]] = {}
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
        if split == "eval" and args.write_slice:
            path = Path(__file__).with_name("slice.npz")
            write_slice(grads, meta, path)
            print(f"wrote slice {path}")
        del grads
    wall = time.perf_counter() - t0
    try:
        slice_ = load_slice()
    except FileNotFoundError:
        print("no committed slice found (run with --write-slice to create it)")
    else:
        columns[f"slice ({slice_.shape[0]}x{slice_.shape[1]:,})"] = gradient_stats(slice_)

    meta = metas["eval"]
    train = meta["train"]
    corpus = meta["corpus"]
    print(f"cache directory: {cache_dir.resolve()}")
    for split in SPLITS:
        npy, _ = gradient_paths(cache_dir, split, cfg, cfg.build_corpus())
        print(f"  {split}: {npy.name}  ({metas[split]['workers']} workers)")
    print(f"model: {cfg.model}  ({meta['numel']:,} parameters)")
    print(
        f"corpus: {corpus['bytes']:,} bytes ({corpus['documents']} documents: "
        f"{corpus['pydoc_topics_bytes']:,} B pydoc topics + {corpus['stdlib_bytes']:,} B stdlib), "
        f"sha256 {corpus['sha256'][:16]}"
    )
    print(
        f"training: {cfg.train_steps} AdamW steps x {cfg.train_batch} seqs x "
        f"{cfg.model.seq_len} bytes, final loss {train['final_train_loss']:.4f} nats "
        f"(mean of last {train['final_train_loss_window']} steps; ln 256 = {math.log(256):.4f}), "
        f"trained in {train['train_seconds']:.1f}s"
    )
    for split in SPLITS:
        losses = metas[split]["worker_losses"]
        print(
            f"{split} worker losses: mean {sum(losses) / len(losses):.4f}, "
            f"min {min(losses):.4f}, max {max(losses):.4f}"
        )
    print(f"wall time this command: {wall:.1f}s")
    print()
    print(format_table(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
