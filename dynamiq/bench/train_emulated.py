"""``dynamiq bench train``'s convergence runs: data-parallel training in one process, each
all-reduce method's exact numerics (the module docstring of :mod:`dynamiq.bench.train`, item 1).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dynamiq.bench.ddp_train import lm_loss
from dynamiq.bench.train_setup import (
    TTAConfig,
    evaluate,
    make_optimizer,
    set_lr,
    text_splits,
    threads,
    train_batch,
    val_batch,
)
from dynamiq.data.model import build_model

__all__ = ["RunResult", "dynamiq_options", "train_inprocess"]

_MB = 1024 * 1024


def dynamiq_options(method: str, cfg: TTAConfig, seed: int) -> dict[str, Any]:
    """The :class:`~dynamiq.ddp.DynamiqState` options of codec ``method``'s runs."""
    return {
        "codec": method,
        "schedule": cfg.schedule,
        "error_feedback": cfg.error_feedback,
        "seed": seed,
    }


class _Bucket:
    """What :func:`dynamiq.ddp.dynamiq_hook` reads of a ``dist.GradBucket``."""

    __slots__ = ("_buffer", "_index", "_last")

    def __init__(self, buffer: torch.Tensor, index: int, last: bool):
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


_PATCH_LOCK = threading.Lock()


def _local_hook_states(method: str, cfg: TTAConfig, seed: int) -> list[Any]:
    """``cfg.workers`` :class:`~dynamiq.ddp.DynamiqState` objects whose transport is an
    in-process :class:`~dynamiq.collectives.transport.LocalCluster` rank instead of
    torch.distributed (``DynamiqState`` builds a ``TorchDistTransport`` from its process
    group; here the "group" is the local transport itself)."""
    from unittest import mock

    from dynamiq import ddp
    from dynamiq.collectives.transport import LocalCluster

    cluster = LocalCluster(cfg.workers)
    with _PATCH_LOCK, mock.patch.object(ddp, "TorchDistTransport", lambda group: group):
        return [
            ddp.DynamiqState(
                process_group=cluster.transport(r), **dynamiq_options(method, cfg, seed)
            )
            for r in range(cfg.workers)
        ]


class _Reducer:
    """Averages one bucket over the workers: ``reduce(index, grads, is_last) -> fp32``."""

    def __init__(self, method: str, cfg: TTAConfig, seed: int):
        self.method = method
        self.world = cfg.workers
        self.states: list[Any] = []
        if method not in ("fp32", "bf16"):
            self.states = _local_hook_states(method, cfg, seed)

    def reduce(self, index: int, grads: list[torch.Tensor], is_last: bool) -> torch.Tensor:
        w = self.world
        if self.method == "fp32":
            # DDP scales each gradient by 1/W, gloo sums: the correctly rounded sum
            return torch.stack([g * (1.0 / w) for g in grads]).double().sum(0).float()
        if self.method == "bf16":
            # default_hooks._compress_hook: buffer.to(bf16).div_(W), all_reduce (bf16 adds)
            parts = [g.to(torch.bfloat16).div_(w) for g in grads]
            acc = parts[0].clone()
            for p in parts[1:]:
                acc += p
            return acc.float()
        from dynamiq.ddp import dynamiq_hook

        futs = [
            dynamiq_hook(s, _Bucket(g, index, is_last))  # type: ignore[arg-type]
            for s, g in zip(self.states, grads, strict=True)
        ]
        outs = [f.wait() for f in futs]
        return outs[0].float()

    def bytes_per_step(self, numel: int) -> float:
        """Payload bytes one rank sends per step (ring accounting for fp32 and bf16)."""
        if self.states:
            stats = [s.stats for s in self.states]
            per = [sum(r["bytes_sent"] for r in st) / max(len(st), 1) for st in stats]
            return sum(per) / len(per)
        width = 4 if self.method == "fp32" else 2
        return 2 * (self.world - 1) / self.world * numel * width

    def close(self) -> None:
        for s in self.states:
            s.close()


def _rebuilt_buckets(
    params: Sequence[torch.Tensor], ready: Sequence[int], cap_mb: float
) -> list[list[int]]:
    """The buckets DDP rebuilds after its first step: parameters in the order their
    gradients became ready, cut at ``bucket_cap_mb`` (the first bucket too, since the cap
    is given explicitly)."""
    import torch.distributed as dist

    if sorted(ready) != list(range(len(params))):
        raise RuntimeError("not every parameter's gradient became ready in the first step")
    cap = int(cap_mb * _MB)
    indices, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in ready], [cap, cap], [False] * len(ready), list(ready)
    )
    return [list(b) for b in indices]


def flat_grad(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A copy of the parameters' gradients, flattened in parameter order."""
    return torch.cat([p.grad.reshape(-1) for p in params]).clone()  # type: ignore[union-attr]


@dataclass
class RunResult:
    """One training run: validation curve ``[(step, loss)]`` (step 0 = initial weights),
    training losses (worker 0's batch), seconds, payload bytes per step per rank, and
    (when asked) the averaged gradients of the first steps."""

    method: str
    seed: int
    curve: list[tuple[int, float]]
    train_losses: list[float]
    seconds: float
    bytes_per_step: float | None = None
    grads: list[torch.Tensor] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _record_grad_order(params: list[torch.nn.Parameter], ready: list[int]) -> list[Any]:
    """Hooks appending each parameter's index to ``ready`` when its gradient is complete (the
    order DDP rebuilds its buckets in)."""
    return [
        p.register_post_accumulate_grad_hook(lambda _p, i=i, ready=ready: ready.append(i))
        for i, p in enumerate(params)
    ]


def _workers_backward(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    buckets: list[list[int]],
    batches: Iterable[Any],
    handles: list[Any],
    losses: list[float],
) -> list[list[torch.Tensor]]:
    """Every worker's backward on its batch, in order: per worker, its flattened gradient of
    each bucket. Worker 0's loss goes to ``losses``; the hooks are removed after worker 0."""
    flat: list[list[torch.Tensor]] = []
    for w, batch in enumerate(batches):
        for p in params:
            p.grad = None
        loss = lm_loss(model, batch)
        loss.backward()
        if w == 0:
            losses.append(float(loss.detach()))
            for h in handles:
                h.remove()
        flat.append(
            [torch.cat([params[i].grad.reshape(-1) for i in b]) for b in buckets]  # type: ignore[union-attr]
        )
    return flat


def _apply_reduced(
    reducer: _Reducer,
    params: list[torch.nn.Parameter],
    buckets: list[list[int]],
    flat: list[list[torch.Tensor]],
) -> None:
    """Reduce each bucket over the workers and set the parameters' gradients to the result."""
    for bi, b in enumerate(buckets):
        avg = reducer.reduce(bi, [f[bi] for f in flat], bi == len(buckets) - 1)
        off = 0
        for i in b:
            n = params[i].numel()
            params[i].grad = avg[off : off + n].view_as(params[i])
            off += n


def train_inprocess(
    method: str,
    cfg: TTAConfig,
    seed: int,
    *,
    steps: int | None = None,
    capture_grads: int = 0,
    progress: Callable[[int, float | None], None] | None = None,
) -> RunResult:
    """Train with ``cfg.workers`` data-parallel workers in this process, reducing DDP's
    buckets with ``method``'s exact numerics (see the module docstring).

    The model runs on one intra-op thread, as every rank of
    :func:`~dynamiq.bench.train_ranks.train_ddp` does, so a worker's gradient is
    bit-identical to that rank's; the dynamiq hook's ranks run on threads of their own.
    ``capture_grads``: keep the averaged gradient (flattened in parameter order) of that
    many first steps."""
    if method == "powersgd":
        raise ValueError("powersgd has no in-process emulation: use train_ddp over gloo")
    steps = cfg.max_steps if steps is None else steps
    train, val_text = text_splits(cfg)
    val = val_batch(val_text, cfg)
    with threads(1):
        model = build_model(cfg.model_config(), seed)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, cfg)
        reducer = _Reducer(method, cfg, seed)
        buckets = [list(range(len(params)))]  # step 0: one bucket, in parameter order
        numel = sum(p.numel() for p in params)
        curve = [(0, evaluate(model, val))]
        losses: list[float] = []
        grads_out: list[torch.Tensor] = []
        t0 = time.perf_counter()
        try:
            for step in range(steps):
                set_lr(opt, cfg, step)
                ready: list[int] = []
                handles = _record_grad_order(params, ready) if step == 0 else []
                batches = (train_batch(train, cfg, seed, step, w) for w in range(cfg.workers))
                flat = _workers_backward(model, params, buckets, batches, handles, losses)
                _apply_reduced(reducer, params, buckets, flat)
                if step < capture_grads:
                    grads_out.append(flat_grad(params))
                opt.step()
                if step == 0:
                    buckets = _rebuilt_buckets(params, ready, cfg.bucket_cap_mb)
                if (step + 1) % cfg.eval_every == 0:
                    curve.append((step + 1, evaluate(model, val)))
                if progress is not None:
                    progress(step + 1, curve[-1][1])
        finally:
            reducer.close()
        seconds = time.perf_counter() - t0
    if not all(math.isfinite(v) for _, v in curve):
        curve = [(s, v if math.isfinite(v) else float("inf")) for s, v in curve]
    return RunResult(
        method=method,
        seed=seed,
        curve=curve,
        train_losses=losses,
        seconds=seconds,
        bytes_per_step=reducer.bytes_per_step(numel),
        grads=grads_out,
        extra={"buckets": [len(b) for b in buckets], "numel": numel},
    )
