"""The pooled ``dynamiq`` default's bytes per round on DDP's 1 MiB first bucket, with and
without ``balance_slack`` (docs/benchmarks.md, "A chunk's slack").

    python benchmarks/round_balance_first_bucket.py      # one JSON row a cell, ~2 min

The same buffers as ``benchmarks/round_balance.py`` (its ``CONFIG``, 1024 workers), only
their first 262,144 values (each worker's eval-window gradient in DDP's bucket order), which
is all that bucket reads, so the 27 GB cache of the whole buffers is not needed; each cell is
``round_balance.cell`` at 8, 32, 128 and 1024 ranks, ring, butterfly and hierarchical.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks.*

import benchmarks.round_balance as rbal
from dynamiq.data.gradients import _trained_model, default_cache_dir, worker_gradient

CODECS = ("dynamiq", json.dumps({"id": "dynamiq", "balance_slack": 0}))


def first_bucket() -> np.ndarray:
    """``[1024, 262144]``: each worker's first 262,144 gradient values in DDP's order."""
    cfg = rbal.CONFIG
    corpus = cfg.build_corpus()
    model, _ = _trained_model(cfg, corpus, default_cache_dir(), regenerate=False, progress=True)
    order = rbal.ddp_order(list(model.named_parameters()))[: rbal.FIRST_BUCKET]
    out = np.empty((rbal.WORKERS, rbal.FIRST_BUCKET), dtype=np.float32)
    t0 = time.perf_counter()
    for w in range(rbal.WORKERS):
        grad, _ = worker_gradient(cfg, model, corpus.worker_batch_tensor("eval", w))
        out[w] = np.asarray(grad)[order]
        if w % 128 == 0:
            print(f"worker {w} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def main() -> None:
    torch.set_num_threads(1)
    bufs = first_bucket()
    for n in rbal.RANKS:
        for name in rbal.SCHEDULES:
            sched, _ = rbal._schedule(name, n)
            for codec in CODECS:
                row = rbal.cell(bufs, codec, sched, rbal.FIRST_BUCKET)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
