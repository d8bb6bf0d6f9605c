"""The pooled ``dynamiq`` default's bytes per round on DDP's 1 MiB first bucket, with and
without ``balance_slack`` (docs/benchmarks.md, "A chunk's slack").

    python benchmarks/round_balance_first_bucket.py      # one JSON row a cell, ~2 min

The same buffers as ``benchmarks/round_balance.py`` (its ``CONFIG``, 1024 workers), only
their first 262,144 values (each worker's eval-window gradient in DDP's bucket order), which
is all that bucket reads, so the 27 GB cache of the whole buffers is not needed; each cell as
``round_balance.cell`` computes it (``prologue_shared``, then ``round_nbytes``), at 8, 32,
128 and 1024 ranks, ring, butterfly and hierarchical (8 ranks a node).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

import benchmarks.round_balance as rbal
from dynamiq.codecs import get_codec
from dynamiq.collectives.balance import round_balance, round_nbytes
from dynamiq.collectives.simulator import prologue_shared
from dynamiq.data.gradients import _trained_model, default_cache_dir, worker_gradient

CONFIGS = ({"id": "dynamiq"}, {"id": "dynamiq", "balance_slack": 0})


def first_bucket() -> np.ndarray:
    """``[1024, 262144]``: each worker's first 262,144 gradient values in DDP's order."""
    cfg = rbal.CONFIG
    corpus = cfg.build_corpus()
    model, _ = _trained_model(cfg, corpus, default_cache_dir(), regenerate=False, progress=True)
    params = list(model.named_parameters())
    offsets, pos = {}, 0
    for name, p in params:
        offsets[name], pos = (pos, pos + p.numel()), pos + p.numel()
    order = np.concatenate([np.arange(*offsets[name]) for name, _ in reversed(params)])
    order = order[: rbal.FIRST_BUCKET]
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
    bufs, n_values = first_bucket(), rbal.FIRST_BUCKET
    for n in rbal.RANKS:
        for name in rbal.SCHEDULES:
            sched, _ = rbal._schedule(name, n)
            for config in CONFIGS:
                codec = get_codec(config)
                rows = (torch.from_numpy(np.array(bufs[r])) for r in range(n))
                shared = prologue_shared(codec, rows, sched)
                rb = round_nbytes(n_values, codec, sched, shared=shared, sub_chunk=rbal.SUB_CHUNK)
                worst, k = round_balance(rb, sched, return_round=True)
                live = np.array([sched.steps[r][k].send_to is not None for r in range(n)])
                row = rb[k][live]
                cell = {"ranks": n, "schedule": name, "balance_slack": codec.balance_slack}
                cell |= {"round_balance": worst, "largest": int(row.max())}
                print(json.dumps({**cell, "mean": float(row.mean())}), flush=True)


if __name__ == "__main__":
    main()
