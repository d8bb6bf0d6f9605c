"""``dynamiq bench train``'s set-up: its configuration, methods, data and learning rate.

Everything here is shared by the in-process runs (:mod:`dynamiq.bench.train_emulated`) and the
real DDP ranks (:mod:`dynamiq.bench.train_ranks`), so both train on the same batches with the
same schedule; the pieces it has in common with :mod:`dynamiq.bench.ddp_train` (text, windows,
loss, optimiser) come from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dynamiq.bench.ddp_train import ModelShape, adamw, doc_text, lm_loss, shard_windows, windows

__all__ = [
    "BASELINES",
    "DEFAULT_METHODS",
    "QUICK",
    "SCHEDULES",
    "TORCH_METHODS",
    "BenchTrainError",
    "TTAConfig",
    "evaluate",
    "make_optimizer",
    "method_label",
    "parse_methods",
    "set_lr",
    "text_splits",
    "threads",
    "train_batch",
    "val_batch",
]

#: the methods that are PyTorch's own (plain DDP and its hooks), not a codec of the dynamiq hook
TORCH_METHODS = ("fp32", "bf16", "powersgd")
#: every method of the benchmark, in table order
DEFAULT_METHODS = (*TORCH_METHODS, "mxfp8_e4m3", "mxfp4", "thc", "omnireduce", "dynamiq")
#: what the ``dynamiq`` codec's TTA is compared with (issue 6: the best of these)
BASELINES = ("bf16", "mxfp8_e4m3", "thc", "omnireduce")
#: hop schedules of the dynamiq hook
SCHEDULES = ("ring", "butterfly", "tree")


class BenchTrainError(RuntimeError):
    """A configuration or environment problem, reported to the user as one line."""


@dataclass(frozen=True)
class TTAConfig(ModelShape):
    """Model, data, optimiser, network and measurement settings of the benchmark.

    The defaults are the documented full run (docs/benchmarks.md): about 0.47M parameters,
    so a bf16 all-reduce of the gradients takes ~0.11 s at 100 Mbit/s on 4 ranks while a
    worker's forward and backward take ~10 ms of one core. The learning rate 1e-3 keeps the
    seeds' runs close (bf16's loss at step 250 varies by sigma 0.007 over 3 seeds; at 3e-3
    some seeds sit on a plateau near 3.3 nats for 50-100 steps and sigma is 0.14).
    """

    workers: int = 4
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 20
    steps: int = 250
    extra: float = 0.2
    eval_every: int = 10
    val_windows: int = 128
    val_fraction: float = 0.1
    bucket_cap_mb: float = 25.0
    error_feedback: bool = True
    schedule: str = "ring"
    powersgd_rank: int = 4
    powersgd_start: int = 10
    rate: str = "100mbit"
    delay_ms: float = 0.1
    timing_warmup: int = 3
    timing_steps: int = 20
    compute_steps: int = 5

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        ints = {
            "workers": 1,
            "d_model": 1,
            "n_layers": 1,
            "n_heads": 1,
            "seq_len": 2,
            "batch": 1,
            "warmup": 0,
            "steps": 1,
            "eval_every": 1,
            "val_windows": 1,
            "powersgd_rank": 1,
            "powersgd_start": 2,
            "timing_warmup": 0,
            "timing_steps": 1,
            "compute_steps": 0,
        }
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo} (got {v!r})")
        if self.workers > 64:
            raise ValueError(f"workers must be <= 64 (got {self.workers})")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model must be divisible by n_heads (got {self.d_model} and {self.n_heads})"
            )
        if self.steps % self.eval_every:
            raise ValueError(
                f"steps must be a multiple of eval_every (got {self.steps} and {self.eval_every})"
            )
        for name, low, high in (
            ("lr", 0.0, 1.0),
            ("extra", 0.0, 10.0),
            ("val_fraction", 0.0, 0.5),
            ("bucket_cap_mb", 0.0, 1024.0),
            ("delay_ms", 0.0, 10_000.0),
        ):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not (low < v <= high or (name in ("extra", "delay_ms") and v == 0)):
                raise ValueError(f"{name} must be a number in ({low}, {high}] (got {v!r})")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be 'ring', 'butterfly' or 'tree' (got {self.schedule!r})"
            )
        from dynamiq.bench.netns import parse_rate

        parse_rate(self.rate)

    @property
    def max_steps(self) -> int:
        """Steps every run trains: ``steps * (1 + extra)``, rounded up to an evaluation."""
        n = math.ceil(self.steps * (1 + self.extra))
        return -(-n // self.eval_every) * self.eval_every

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (the ``config`` of a result)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TTAConfig:
        """The inverse of :meth:`to_dict`."""
        return cls(**d)


#: ``--quick``: a tiny model, 2 workers, 30 steps (for tests and a first look)
QUICK = {
    "workers": 2,
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "seq_len": 16,
    "batch": 2,
    "warmup": 2,
    "steps": 20,
    "extra": 0.5,
    "eval_every": 5,
    "val_windows": 16,
    "powersgd_rank": 1,
    "powersgd_start": 3,
    "timing_warmup": 1,
    "timing_steps": 3,
    "compute_steps": 1,
}


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """Validated method names: ``fp32``, ``bf16``, ``powersgd`` or registered codec ids.

    >>> parse_methods("bf16, mxfp4")
    ['bf16', 'mxfp4']
    """
    from dynamiq.codecs import get_codec

    names = [m.strip() for m in text.split(",")] if isinstance(text, str) else list(text)
    names = [m for m in names if m]
    if not names:
        raise ValueError("methods must name at least one method")
    seen = set()
    for m in names:
        if m in seen:
            raise ValueError(f"method {m!r} is listed twice")
        seen.add(m)
        if m not in TORCH_METHODS:
            try:
                get_codec(m)
            except ValueError as exc:
                raise ValueError(
                    f"unknown method {m!r}: use fp32, bf16, powersgd or a codec id ({exc})"
                ) from None
    if "bf16" not in names:
        raise ValueError("methods must include bf16: its final validation loss is the target")
    return names


def method_label(method: str) -> str:
    """How a method is shown in tables and plots."""
    return {
        "fp32": "fp32 (plain DDP)",
        "bf16": "bf16_compress_hook",
        "powersgd": "powerSGD_hook",
    }.get(method, f"dynamiq hook: {method}")


# -- data -----------------------------------------------------------------------------------


def text_splits(cfg: TTAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(training text, held-out validation text) as uint8 tensors: the last
    ``val_fraction`` of CPython's documentation is the validation text."""
    data = doc_text()
    cut = int(data.numel() * (1 - cfg.val_fraction))
    train, val = data[:cut], data[cut:]
    need = cfg.seq_len + 2
    if train.numel() // cfg.workers < need or val.numel() < need:
        raise ValueError(f"the text is too short for {cfg.workers} workers of seq_len {need}")
    return train, val


def train_batch(
    train: torch.Tensor, cfg: TTAConfig, seed: int, step: int, rank: int
) -> torch.Tensor:
    """``cfg.batch`` windows of ``seq_len + 1`` bytes from worker ``rank``'s shard of the
    training text, drawn by a generator seeded with ``(seed, step, rank)``."""
    g_seed = (seed << 40) ^ (step << 12) ^ rank
    return shard_windows(train, rank, cfg.workers, cfg.seq_len, cfg.batch, g_seed)


def val_batch(val: torch.Tensor, cfg: TTAConfig) -> torch.Tensor:
    """``val_windows`` evenly spaced windows of the validation text (the same every run)."""
    starts = torch.linspace(0, val.numel() - cfg.seq_len - 2, cfg.val_windows).long()
    return windows(val, starts, cfg.seq_len)


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, chunk: int = 32) -> float:
    """Validation loss: the mean over equal chunks of windows of their mean loss."""
    losses = [float(lm_loss(model, val[i : i + chunk])) for i in range(0, val.shape[0], chunk)]
    sizes = [min(chunk, val.shape[0] - i) for i in range(0, val.shape[0], chunk)]
    return sum(v * s for v, s in zip(losses, sizes, strict=True)) / sum(sizes)


def make_optimizer(params: Sequence[torch.Tensor], cfg: TTAConfig) -> torch.optim.Optimizer:
    """AdamW (no weight decay); the learning rate is set per step by :func:`set_lr`."""
    return adamw(params, cfg.lr)


def set_lr(opt: torch.optim.Optimizer, cfg: TTAConfig, step: int) -> None:
    """Linear warm-up over ``warmup`` steps, then constant ``lr`` (no decay: a run's first
    ``n`` steps do not depend on how long it trains)."""
    lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup, 1))
    for group in opt.param_groups:
        group["lr"] = lr


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the body with ``n`` intra-op threads of torch, then restore the old number."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
