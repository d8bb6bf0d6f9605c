"""A small, real DDP training job: a byte-level transformer on CPython's documentation.

Used by ``examples/train_ddp.py`` (under ``torchrun``) and by the tests (spawned gloo ranks).
Each rank draws its batches from its own disjoint shard of ``pydoc_data.topics``; the same seed
gives the same initial weights and the same batches on every run.

The pieces below :func:`train` (text, batches, loss, optimiser, hooks) are also those of
``dynamiq bench train`` (:mod:`dynamiq.bench.train`), which trains the same model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dynamiq.data.model import ModelConfig, build_model, lm_loss

__all__ = [
    "ModelShape",
    "TrainConfig",
    "TrainResult",
    "adamw",
    "bf16_hook_any_backend",
    "doc_text",
    "lm_loss",
    "param_checksum",
    "register_hook",
    "shard_windows",
    "train",
    "windows",
]


class ModelShape:
    """Mixin of a configuration with the model's ``d_model``, ``n_layers``, ``n_heads`` and
    ``seq_len`` fields."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int

    def model_config(self) -> ModelConfig:
        """The :class:`~dynamiq.data.model.ModelConfig` of these fields."""
        return ModelConfig(
            d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, seq_len=self.seq_len
        )


@dataclass(frozen=True)
class TrainConfig(ModelShape):
    """Model, data and optimiser settings of :func:`train`."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    batch: int = 8
    steps: int = 300
    lr: float = 3e-3
    seed: int = 0
    bucket_cap_mb: float = 0.25


@dataclass
class TrainResult:
    """Per-step training losses (this rank's batch), the hook's per-step stats, timing."""

    losses: list[float]
    seconds: float
    hook_stats: list[dict[str, Any]] = field(default_factory=list)
    param_checksum: float = 0.0


def doc_text() -> torch.Tensor:
    """CPython's documentation (``pydoc_data.topics``) as a uint8 tensor of bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The windows of ``seq_len + 1`` bytes of ``data`` at ``starts``, as int64
    ``[len(starts), seq_len + 1]``.

    >>> windows(torch.arange(10, dtype=torch.uint8), torch.tensor([0, 5]), 2).tolist()
    [[0, 1, 2], [5, 6, 7]]
    """
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1)
    return data[idx].long()


def shard_windows(
    data: torch.Tensor, rank: int, world: int, seq_len: int, batch: int, seed: int
) -> torch.Tensor:
    """``batch`` random windows (:func:`windows`) from shard ``rank`` of ``world`` equal
    shards of ``data``, their starts drawn by a generator seeded with ``seed``."""
    shard = data.numel() // world
    lo = rank * shard
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(lo, lo + shard - seq_len - 1, (batch,), generator=g)
    return windows(data, starts, seq_len)


def _batch(data: torch.Tensor, cfg: TrainConfig, rank: int, world: int, step: int) -> torch.Tensor:
    """``cfg.batch`` windows from this rank's shard, drawn by a (seed, step, rank) generator."""
    seed = cfg.seed * 1_000_003 + step * 131 + rank
    return shard_windows(data, rank, world, cfg.seq_len, cfg.batch, seed)


_loss = lm_loss  # the name the tests use


def adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The optimiser of both training jobs: AdamW without weight decay."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def param_checksum(params: Iterable[torch.Tensor]) -> float:
    """The sum of all parameter values (in fp64): equal weights give equal checksums."""
    return float(sum(p.detach().double().sum() for p in params))


def bf16_hook_any_backend(process_group: Any, bucket: Any) -> Any:
    """PyTorch's ``bf16_compress_hook`` under another name: DDP refuses that name unless
    NCCL (or XCCL) is the backend, though gloo sums bf16 on the CPU; the numerics are the
    hook's own."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


# DDP checks a hook's annotations as objects, not as the strings postponed annotations make
bf16_hook_any_backend.__annotations__ = {
    "process_group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_hook(ddp: DDP, hook: str | None, options: dict[str, Any] | None = None) -> Any:
    """Register a communication hook on ``ddp`` and return its state (None for none and
    ``"bf16"``). ``hook``: None (plain DDP), ``"dynamiq"`` (``options`` go to
    :class:`~dynamiq.ddp.DynamiqState`), ``"bf16"`` (PyTorch's ``bf16_compress_hook``, on any
    backend) or ``"powersgd"`` (``options`` go to PyTorch's ``PowerSGDState``)."""
    if hook is None:
        return None
    if hook == "dynamiq":
        from dynamiq.ddp import DynamiqState, dynamiq_hook

        state: Any = DynamiqState(**(options or {}))
        ddp.register_comm_hook(state, dynamiq_hook)
        return state
    if hook == "bf16":
        ddp.register_comm_hook(None, bf16_hook_any_backend)
        return None
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, **(options or {}))
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        return state
    raise ValueError(f"hook must be None, 'dynamiq', 'bf16' or 'powersgd' (got {hook!r})")


def train(
    rank: int,
    world: int,
    cfg: TrainConfig,
    hook: str | None = None,
    hook_options: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> TrainResult:
    """Train with DDP (process group already initialised). ``hook`` and ``hook_options``:
    see :func:`register_hook`."""
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    model = build_model(cfg.model_config(), cfg.seed).to(device=device, dtype=dtype)
    ddp = DDP(
        model,
        bucket_cap_mb=cfg.bucket_cap_mb,
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    state = register_hook(ddp, hook, hook_options)
    opt = adamw(ddp.parameters(), cfg.lr)
    data = doc_text()
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch = _batch(data, cfg, rank, world, step).to(device)
        loss = lm_loss(ddp, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    checksum = param_checksum(model.parameters())
    stats = list(state.stats) if hook == "dynamiq" else []
    if hook == "dynamiq":
        state.close()
    dist.barrier()
    return TrainResult(losses=losses, seconds=seconds, hook_stats=stats, param_checksum=checksum)
