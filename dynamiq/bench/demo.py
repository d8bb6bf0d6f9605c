"""``dynamiq demo``'s real multi-process part: a compressed all-reduce over torch.distributed.

Spawns ``world_size`` processes on loopback (gloo), gives each the real gradients of one or
more workers of the committed slice, and runs :func:`dynamiq.collectives.allreduce` with each
codec and schedule. Reports what a user wants to see: bytes each rank sent against fp32,
bits/value, vNMSE against the fp64 sum, whether every rank ended with bit-identical values, and
the wall time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["multiprocess_allreduce"]


def _rank_fn(
    rank: int, world: int, data: torch.Tensor, codecs: list[Any], schedules: list[str]
) -> list[dict[str, Any]]:
    from dynamiq.collectives import AllReduceStats, allreduce

    out = []
    for codec in codecs:
        for schedule in schedules:
            x = data[rank].clone()
            t0 = time.perf_counter()
            stats = allreduce(x, codec, schedule)
            seconds = time.perf_counter() - t0
            assert isinstance(stats, AllReduceStats)
            out.append(
                {
                    "codec": codec,
                    "schedule": schedule,
                    "bytes_sent": stats.bytes_sent,
                    "seconds": seconds,
                    "digest": hashlib.sha256(x.numpy().tobytes()).hexdigest(),
                    "result": x if rank == 0 else None,
                }
            )
    return out


def multiprocess_allreduce(
    grads: torch.Tensor,
    codecs: Sequence[Any] = ("fp32", "bf16", "mxfp8_e4m3", "int8", "dynamiq"),
    schedules: Sequence[str] = ("ring", "butterfly"),
    world_size: int = 4,
    *,
    timeout: float = 300.0,
) -> list[dict[str, Any]]:
    """All-reduce the rows of ``grads`` ([W, N], W a multiple of ``world_size``; rank r holds
    rows r, r + world_size, … concatenated) across ``world_size`` gloo processes.

    One row per (codec, schedule): ``bytes/rank``, ``vs fp32`` (bytes ratio against the
    fp32 all-reduce), ``bits/value``, ``vnmse`` against the fp64 sum, ``bit-identical``
    (every rank's result has the same bytes) and ``seconds`` (rank 0's wall time).
    """
    from dynamiq.testing.distributed import run_gloo

    w, n = grads.shape
    if world_size < 2 or w % world_size:
        raise ValueError(
            f"world_size must be >= 2 and divide the number of rows (got {world_size} for {w})"
        )
    data = grads.reshape(w // world_size, world_size, n).transpose(0, 1).reshape(world_size, -1)
    data = data.contiguous()
    exact = data.double().sum(dim=0)
    results = run_gloo(_rank_fn, world_size, data, list(codecs), list(schedules), timeout=timeout)
    bad = [(r, s, v) for r, (s, v) in enumerate(results) if s != "ok"]
    if bad:
        r, s, v = bad[0]
        raise RuntimeError(f"rank {r} of the demo all-reduce failed ({s}):\n{v}")
    per_rank = [v for _, v in results]
    numel = data.shape[1]
    rows = []
    fp32_bytes = None
    for i, first in enumerate(per_rank[0]):
        sent = sum(p[i]["bytes_sent"] for p in per_rank) / world_size
        if first["codec"] == "fp32" and fp32_bytes is None:
            fp32_bytes = sent
        y = first["result"].double()
        err = float((y - exact).square().sum() / exact.square().sum())
        carried = 2 * (world_size - 1) / world_size * numel
        rows.append(
            {
                "codec": first["codec"],
                "schedule": first["schedule"],
                "bytes/rank": int(sent),
                "bits/value": 8 * sent / carried,
                "vnmse": err,
                "bit-identical": len({p[i]["digest"] for p in per_rank}) == 1,
                "seconds": max(p[i]["seconds"] for p in per_rank),
            }
        )
    if fp32_bytes:
        for row in rows:
            row["vs fp32"] = f"{fp32_bytes / row['bytes/rank']:.2f}x smaller"
    return rows
