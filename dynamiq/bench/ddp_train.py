"""A small, real DDP training job: a byte-level transformer on CPython's documentation.

Used by ``examples/train_ddp.py`` (under ``torchrun``) and by the tests (spawned gloo ranks).
Each rank draws its batches from its own disjoint shard of ``pydoc_data.topics``; the same seed
gives the same initial weights and the same batches on every run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dynamiq.data.model import ModelConfig, build_model

__all__ = ["TrainConfig", "TrainResult", "doc_text", "train"]


@dataclass(frozen=True)
class TrainConfig:
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


def _batch(data: torch.Tensor, cfg: TrainConfig, rank: int, world: int, step: int) -> torch.Tensor:
    """``cfg.batch`` windows from this rank's shard, drawn by a (seed, step, rank) generator."""
    shard = data.numel() // world
    lo = rank * shard
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 131 + rank)
    starts = torch.randint(lo, lo + shard - cfg.seq_len - 1, (cfg.batch,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(cfg.seq_len + 1)
    return data[idx].long()


def train(
    rank: int,
    world: int,
    cfg: TrainConfig,
    hook: str | None = None,
    hook_options: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> TrainResult:
    """Train with DDP (process group already initialised). ``hook``: None (plain DDP),
    ``"dynamiq"`` (``hook_options`` go to :class:`~dynamiq.ddp.DynamiqState`), or one of
    PyTorch's ``"bf16"`` / ``"powersgd"`` hooks."""
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    mcfg = ModelConfig(
        d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, seq_len=cfg.seq_len
    )
    model = build_model(mcfg, cfg.seed).to(device=device, dtype=dtype)
    ddp = DDP(
        model,
        bucket_cap_mb=cfg.bucket_cap_mb,
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    state: Any = None
    if hook == "dynamiq":
        from dynamiq.ddp import DynamiqState, dynamiq_hook

        state = DynamiqState(**(hook_options or {}))
        ddp.register_comm_hook(state, dynamiq_hook)
    elif hook == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, **(hook_options or {}))
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    elif hook is not None:
        raise ValueError(f"hook must be None, 'dynamiq', 'bf16' or 'powersgd' (got {hook!r})")
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = doc_text()
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch = _batch(data, cfg, rank, world, step).to(device)
        loss = _loss(ddp, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    stats = list(state.stats) if hook == "dynamiq" else []
    if hook == "dynamiq":
        state.close()
    dist.barrier()
    return TrainResult(losses=losses, seconds=seconds, hook_stats=stats, param_checksum=checksum)


def _loss(ddp: DDP, batch: torch.Tensor) -> torch.Tensor:
    logits = ddp(batch[:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
    )
