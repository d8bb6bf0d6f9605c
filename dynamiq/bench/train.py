"""``dynamiq bench train``: time-to-accuracy of gradient all-reduce methods (issue 6, item 3).

A byte-level transformer (:mod:`dynamiq.data.model`) learns CPython's documentation
(``pydoc_data.topics``; the last ``val_fraction`` of the text is held out for validation, the
rest is cut into one disjoint shard per worker) with ``W`` data-parallel workers, once per
all-reduce *method*:

* ``fp32`` — plain DDP (gloo's fp32 all-reduce of the averaged gradients);
* ``bf16`` — PyTorch's ``bf16_compress_hook``;
* ``powersgd`` — PyTorch's ``powerSGD_hook`` (error feedback and warm start on);
* any codec id (``mxfp8_e4m3``, ``mxfp4``, ``thc``, ``omnireduce``, ``dynamiq``, ...) — the
  dynamiq DDP hook (:func:`dynamiq.ddp.dynamiq_hook`, ring schedule, error feedback on unless
  ``error_feedback=False``).

What is measured (DESIGN.md, "Measures"):

1. **Convergence**, in one process with each method's exact numerics: one model replica (all
   workers hold identical weights after every step), each worker's gradient from its own
   batches, then DDP's buckets (the same layout DDP builds: one bucket at step 0, rebuilt
   from the order gradients became ready) reduced by the method: ``fp32`` as the correctly
   rounded sum of ``g_w / W``; ``bf16`` as the hook does it (cast, divide, sum in bf16, cast
   back; summed in rank order, gloo's ring may add in another order for ``W > 2``); codecs
   through :func:`dynamiq.ddp.dynamiq_hook` itself, on ``W`` in-process ranks. PowerSGD's
   numerics are not emulated: it trains with real DDP over gloo on loopback. The validation
   loss is recorded every ``eval_every`` steps.
2. **Step time** of real DDP (gloo, the real hooks) on the emulated cluster
   (:class:`dynamiq.bench.netns.EmulatedCluster`: one network namespace per rank, links shaped
   with ``tc``), the mean over ``timing_steps`` steps after ``timing_warmup``; beside it the
   compute-only time (forward, backward and optimiser step without communication), the
   hook's codec time (encode, reduce, decode) and the bytes on the wire per step, read from
   each rank's interface.
3. **Time to accuracy** per seed: the target is the ``bf16`` run's validation loss at step
   ``steps`` (the same seed's run); steps to target = the first evaluated step whose validation
   loss is at or below it (every method trains ``steps * (1 + extra)`` steps, with the same
   constant learning rate after warm-up, so a slightly slower method can still reach it);
   TTA = steps to target x mean step time. The final loss compared is each method's
   validation loss at step ``steps``.
4. **Validation** of that model: ``bf16`` and ``dynamiq`` trained for real on the cluster
   until the first seed's target is reached; the measured training time against the
   prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import platform
import random
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dynamiq.bench.ddp_train import doc_text
from dynamiq.data.model import ModelConfig, build_model

__all__ = [
    "BASELINES",
    "DEFAULT_METHODS",
    "BenchTrainError",
    "TTAConfig",
    "add_parser",
    "evaluate",
    "run_benchmark",
    "train_batch",
    "train_ddp",
    "train_inprocess",
    "val_batch",
]

#: every method of the benchmark, in table order
DEFAULT_METHODS = (
    "fp32",
    "bf16",
    "powersgd",
    "mxfp8_e4m3",
    "mxfp4",
    "thc",
    "omnireduce",
    "dynamiq",
)
#: what the ``dynamiq`` codec's TTA is compared with (issue 6: the best of these)
BASELINES = ("bf16", "mxfp8_e4m3", "thc", "omnireduce")
_TORCH_METHODS = ("fp32", "bf16", "powersgd")
_MB = 1024 * 1024


class BenchTrainError(RuntimeError):
    """A configuration or environment problem, reported to the user as one line."""


# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class TTAConfig:
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
        if self.schedule not in ("ring", "butterfly", "tree"):
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

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, seq_len=self.seq_len
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TTAConfig:
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
    """Validated method names: ``fp32``, ``bf16``, ``powersgd`` or registered codec ids."""
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
        if m not in _TORCH_METHODS:
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
    shard = train.numel() // cfg.workers
    lo = rank * shard
    g = torch.Generator().manual_seed((seed << 40) ^ (step << 12) ^ rank)
    starts = torch.randint(lo, lo + shard - cfg.seq_len - 1, (cfg.batch,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(cfg.seq_len + 1)
    return train[idx].long()


def val_batch(val: torch.Tensor, cfg: TTAConfig) -> torch.Tensor:
    """``val_windows`` evenly spaced windows of the validation text (the same every run)."""
    starts = torch.linspace(0, val.numel() - cfg.seq_len - 2, cfg.val_windows).long()
    idx = starts.unsqueeze(1) + torch.arange(cfg.seq_len + 1)
    return val[idx].long()


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of a ``[batch, seq_len + 1]`` byte tensor."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, chunk: int = 32) -> float:
    """Validation loss: the mean over equal chunks of windows of their mean loss."""
    losses = [float(lm_loss(model, val[i : i + chunk])) for i in range(0, val.shape[0], chunk)]
    sizes = [min(chunk, val.shape[0] - i) for i in range(0, val.shape[0], chunk)]
    return sum(v * s for v, s in zip(losses, sizes, strict=True)) / sum(sizes)


def make_optimizer(params: Sequence[torch.Tensor], cfg: TTAConfig) -> torch.optim.Optimizer:
    """AdamW (no weight decay); the learning rate is set per step by :func:`set_lr`."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)


def set_lr(opt: torch.optim.Optimizer, cfg: TTAConfig, step: int) -> None:
    """Linear warm-up over ``warmup`` steps, then constant ``lr`` (no decay: a run's first
    ``n`` steps do not depend on how long it trains)."""
    lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup, 1))
    for group in opt.param_groups:
        group["lr"] = lr


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# -- in-process all-reduce with each method's numerics -------------------------------------


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


def _local_hook_states(
    codec: str, world: int, seed: int, error_feedback: bool, schedule: str = "ring"
) -> list[Any]:
    """``world`` :class:`~dynamiq.ddp.DynamiqState` objects whose transport is an in-process
    :class:`~dynamiq.collectives.transport.LocalCluster` rank instead of torch.distributed
    (``DynamiqState`` builds a ``TorchDistTransport`` from its process group; here the "group"
    is the local transport itself)."""
    from unittest import mock

    from dynamiq import ddp
    from dynamiq.collectives.transport import LocalCluster

    cluster = LocalCluster(world)
    with _PATCH_LOCK, mock.patch.object(ddp, "TorchDistTransport", lambda group: group):
        return [
            ddp.DynamiqState(
                codec=codec,
                schedule=schedule,
                process_group=cluster.transport(r),
                error_feedback=error_feedback,
                seed=seed,
            )
            for r in range(world)
        ]


class _Reducer:
    """Averages one bucket over the workers: ``reduce(index, grads, is_last) -> fp32``."""

    def __init__(self, method: str, cfg: TTAConfig, seed: int):
        self.method = method
        self.world = cfg.workers
        self.states: list[Any] = []
        if method not in ("fp32", "bf16"):
            self.states = _local_hook_states(
                method, cfg.workers, seed, cfg.error_feedback, cfg.schedule
            )

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

    The model runs on one intra-op thread, as every rank of :func:`train_ddp` does, so a
    worker's gradient is bit-identical to that rank's; the dynamiq hook's ranks run on
    threads of their own. ``capture_grads``: keep the averaged gradient (flattened in
    parameter order) of that many first steps."""
    if method == "powersgd":
        raise ValueError("powersgd has no in-process emulation: use train_ddp over gloo")
    steps = cfg.max_steps if steps is None else steps
    train, val_text = text_splits(cfg)
    val = val_batch(val_text, cfg)
    with _threads(1):
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
                handles = []
                if step == 0:
                    for i, p in enumerate(params):
                        handles.append(
                            p.register_post_accumulate_grad_hook(
                                lambda _p, i=i, ready=ready: ready.append(i)
                            )
                        )
                flat: list[list[torch.Tensor]] = []
                for w in range(cfg.workers):
                    for p in params:
                        p.grad = None
                    loss = lm_loss(model, train_batch(train, cfg, seed, step, w))
                    loss.backward()
                    if w == 0:
                        losses.append(float(loss.detach()))
                        for h in handles:
                            h.remove()
                    flat.append(
                        [torch.cat([params[i].grad.reshape(-1) for i in b]) for b in buckets]  # type: ignore[union-attr]
                    )
                for bi, b in enumerate(buckets):
                    avg = reducer.reduce(
                        bi, [flat[w][bi] for w in range(cfg.workers)], bi == len(buckets) - 1
                    )
                    off = 0
                    for i in b:
                        n = params[i].numel()
                        params[i].grad = avg[off : off + n].view_as(params[i])
                        off += n
                if step < capture_grads:
                    grads_out.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())  # type: ignore[union-attr]
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


# -- real DDP (loopback gloo or the emulated cluster) ---------------------------------------


def _bf16_hook() -> Callable[..., Any]:
    """PyTorch's ``bf16_compress_hook`` under another name: DDP refuses that name unless
    NCCL (or XCCL) is the backend, though gloo sums bf16 on the CPU; the numerics are the
    hook's own. (Annotations are set as objects, which DDP checks.)"""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16_hook_any_backend(process_group: Any, bucket: Any) -> Any:
        return default_hooks.bf16_compress_hook(process_group, bucket)

    bf16_hook_any_backend.__annotations__ = {
        "process_group": dist.ProcessGroup,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return bf16_hook_any_backend


def _register_hook(ddp: Any, method: str, cfg: TTAConfig, seed: int) -> Any:
    """Register ``method``'s communication hook on ``ddp``; return its state (or None)."""
    if method == "fp32":
        return None
    if method == "bf16":
        ddp.register_comm_hook(None, _bf16_hook())
        return None
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        ps_state = ps.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start,
            random_seed=seed,
        )
        ddp.register_comm_hook(ps_state, ps.powerSGD_hook)
        return ps_state
    from dynamiq.ddp import DynamiqState, dynamiq_hook

    state = DynamiqState(
        codec=method, schedule=cfg.schedule, error_feedback=cfg.error_feedback, seed=seed
    )
    ddp.register_comm_hook(state, dynamiq_hook)
    return state


def _iface_of(address: str) -> str | None:
    """The name of this network namespace's interface holding IPv4 ``address``."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(res[20:24]) == address:
            return name
    return None


def _iface_bytes(name: str | None) -> tuple[int, int] | None:
    """(tx, rx) bytes of interface ``name`` in this process's network namespace."""
    if name is None:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            iface, rest = line.split(":", 1)
            if iface.strip() == name:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    return None


def _status(path: str | None, **info: Any) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)


def train_ddp(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Real DDP training runs on an initialised gloo group, one per ``spec["runs"]`` entry.

    A run: ``method``, ``seed``, ``steps``; optional ``eval_every`` (rank 0 evaluates and
    says when to stop), ``target`` (stop at the first evaluation at or below it),
    ``timing_warmup`` (steps left out of the mean step time), ``compute_steps`` (extra
    forward/backward/optimiser steps without communication, timed, at the end),
    ``capture_grads``. Returns one dict per run (rank 0's holds the curve).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = TTAConfig.from_dict(spec["cfg"])
    iface = spec.get("iface")
    train, val_text = text_splits(cfg)
    val = val_batch(val_text, cfg)
    out = []
    for k, run in enumerate(spec["runs"]):
        method, seed, steps = run["method"], int(run["seed"]), int(run["steps"])
        eval_every = int(run.get("eval_every", 0))
        target = run.get("target")
        warm = int(run.get("timing_warmup", 0))
        model = build_model(cfg.model_config(), seed)
        ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb)
        state = _register_hook(ddp, method, cfg, seed)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, cfg)
        curve = [(0, evaluate(model, val))] if (eval_every and rank == 0) else []
        times: list[float] = []
        losses: list[float] = []
        grads: list[torch.Tensor] = []
        reached = None
        dist.barrier()
        net0 = None
        for step in range(steps):
            if step == warm:
                net0 = _iface_bytes(iface)
            t0 = time.perf_counter()
            set_lr(opt, cfg, step)
            batch = train_batch(train, cfg, seed, step, rank)
            loss = lm_loss(ddp, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if step < int(run.get("capture_grads", 0)):
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())  # type: ignore[union-attr]
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            if eval_every and (step + 1) % eval_every == 0:
                stop = torch.zeros(1)
                if rank == 0:
                    v = evaluate(model, val)
                    curve.append((step + 1, v))
                    if target is not None and v <= target:
                        stop[0] = 1
                    _status(
                        spec.get("status"),
                        run=k,
                        runs=len(spec["runs"]),
                        method=method,
                        step=step + 1,
                        steps=steps,
                        val=v,
                    )
                dist.broadcast(stop, 0)
                if stop[0]:
                    reached = step + 1
                    break
            elif rank == 0 and (step + 1) % 5 == 0:
                _status(
                    spec.get("status"),
                    run=k,
                    runs=len(spec["runs"]),
                    method=method,
                    step=step + 1,
                    steps=steps,
                )
        net1 = _iface_bytes(iface)
        done = len(times)
        compute: list[float] = []
        if run.get("compute_steps"):
            dist.barrier()
            for j in range(int(run["compute_steps"])):
                t0 = time.perf_counter()
                with ddp.no_sync():
                    batch = train_batch(train, cfg, seed, steps + j, rank)
                    opt.zero_grad(set_to_none=True)
                    lm_loss(ddp, batch).backward()
                opt.step()
                compute.append(time.perf_counter() - t0)
        phases: dict[str, float] = {}
        payload = None
        if method not in _TORCH_METHODS and state is not None:
            timed = [r for r in state.stats if r["step"] >= warm]
            for r in timed:
                for key, v in r["seconds"].items():
                    phases[key] = phases.get(key, 0.0) + v / len(timed)
            if timed:
                payload = sum(r["bytes_sent"] for r in timed) / len(timed)
            state.close()
        wire = None
        if net0 is not None and net1 is not None and done > warm:
            wire = {
                "tx": (net1[0] - net0[0]) / (done - warm),
                "rx": (net1[1] - net0[1]) / (done - warm),
            }
        out.append(
            {
                "method": method,
                "seed": seed,
                "rank": rank,
                "curve": curve,
                "losses": losses,
                "step_times": times,
                "timed_mean": statistics.fmean(times[warm:]) if done > warm else None,
                "compute_mean": statistics.fmean(compute) if compute else None,
                "phases": phases,
                "payload_bytes_per_step": payload,
                "wire_bytes_per_step": wire,
                "reached": reached,
                "grads": grads,
                "checksum": float(sum(p.detach().double().sum() for p in params)),
            }
        )
        dist.barrier()
        del ddp
    return out


def _loopback_job(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``run_gloo`` entry point (module level, so spawned processes can import it)."""
    return train_ddp(rank, world, spec)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """One rank in a namespace of the emulated cluster: ``SPEC RANK OUT`` (JSON files)."""
    spec_path, rank_s, out_path = list(sys.argv[1:] if argv is None else argv)
    rank = int(rank_s)
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(spec["world"])
    log = open(f"{out_path}.log", "w")  # noqa: SIM115 - stays open for the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        spec["iface"] = _iface_of(spec["addresses"][rank])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{spec['addresses'][0]}:{spec['port']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=float(spec.get("pg_timeout", 300))),
        )
        try:
            res = train_ddp(rank, world, spec)
        finally:
            dist.destroy_process_group()
        payload: Any = {"status": "ok", "runs": _jsonable(res)}
    except BaseException as exc:
        payload = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        payload["traceback"] = traceback.format_exc()
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, out_path)
    return 0 if payload["status"] == "ok" else 1


def _jsonable(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "grads"} for r in runs]


class _Progress:
    """Progress on stderr: an updating line on a terminal (at most 4 updates a second),
    only the finished lines otherwise; nothing when off."""

    def __init__(self, on: bool):
        self.on = on and sys.stderr is not None
        self.tty = self.on and sys.stderr.isatty()
        self.width = 0
        self.last = 0.0

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.tty and now - self.last >= 0.25:
            self.last = now
            pad = max(self.width - len(text), 0)
            print("\r" + text + " " * pad, end="", file=sys.stderr, flush=True)
            self.width = len(text)

    def line(self, text: str) -> None:
        if self.on:
            if self.tty:
                print("\r" + " " * self.width + "\r", end="", file=sys.stderr)
            print(text, file=sys.stderr, flush=True)
            self.width = 0


def _poll_status(path: str, show: _Progress, label: str) -> None:
    try:
        with open(path) as f:
            st = json.load(f)
    except (OSError, ValueError):
        return
    val = f" val {st['val']:.4f}" if "val" in st else ""
    show(
        f"{label}: run {st['run'] + 1}/{st['runs']} {st['method']} "
        f"step {st['step']}/{st['steps']}{val}"
    )


def _run_loopback(
    spec: dict[str, Any], world: int, show: _Progress, label: str, timeout: float
) -> list[list[dict[str, Any]]]:
    """All runs of ``spec`` on ``world`` gloo ranks over loopback (spawned processes)."""
    from dynamiq.testing.distributed import run_gloo

    with tempfile.TemporaryDirectory(prefix="dynamiq-train-") as tmp:
        spec = {**spec, "status": os.path.join(tmp, "status.json")}
        box: dict[str, Any] = {}

        def go() -> None:
            box["res"] = run_gloo(_loopback_job, world, spec, timeout=timeout, pg_timeout=300)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.5)
            _poll_status(spec["status"], show, label)
        results = box.get("res")
    if results is None:
        raise BenchTrainError(f"{label}: the gloo ranks did not start")
    bad = [(r, v) for r, (s, v) in enumerate(results) if s != "ok"]
    if bad:
        rank, err = bad[0]
        raise BenchTrainError(f"{label}: rank {rank} failed: {err or 'no result in time'}")
    return [v for _, v in results]


def _run_cluster(
    cl: Any, spec: dict[str, Any], world: int, show: _Progress, label: str, timeout: float
) -> list[list[dict[str, Any]]]:
    """All runs of ``spec`` on ``world`` ranks, one per namespace of the cluster ``cl``."""
    with tempfile.TemporaryDirectory(prefix="dynamiq-train-") as tmp:
        spec = {
            **spec,
            "world": world,
            "addresses": list(cl.addresses),
            "port": random.randint(20000, 60000),
            "status": os.path.join(tmp, "status.json"),
        }
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        cmd = "import sys; from dynamiq.bench.train import worker_main; sys.exit(worker_main())"
        env = {"OMP_NUM_THREADS": "1"}
        procs = [
            cl.popen(
                r,
                [sys.executable, "-c", cmd, spec_path, str(r), outs[r]],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise BenchTrainError(f"{label}: no result within {timeout:g} s")
                if any(p.poll() not in (None, 0) for p in procs):
                    failed_at = failed_at or now
                    if now - failed_at > 10:  # the others are stuck waiting for it
                        break
                time.sleep(0.5)
                _poll_status(spec["status"], show, label)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for r in range(world):
            try:
                with open(outs[r]) as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                log = ""
                with contextlib.suppress(OSError):
                    log = Path(f"{outs[r]}.log").read_text()[-2000:]
                results.append({"status": "error", "error": f"no result; log: {log}"})
    for r, res in enumerate(results):
        if res["status"] != "ok":
            raise BenchTrainError(f"{label}: rank {r} failed: {res['error']}")
    return [res["runs"] for res in results]


# -- the benchmark --------------------------------------------------------------------------


def _steps_to(curve: Sequence[Sequence[float]], target: float) -> int | None:
    """The first evaluated step (after step 0) whose validation loss is <= ``target``."""
    for step, v in curve:
        if step > 0 and v <= target:
            return int(step)
    return None


def _at(curve: Sequence[Sequence[float]], step: int) -> float:
    for s, v in curve:
        if s == step:
            return float(v)
    raise KeyError(step)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, {platform.platform()}"


def run_benchmark(
    cfg: TTAConfig,
    methods: Sequence[str] = DEFAULT_METHODS,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    network: str = "cluster",
    validate: bool = True,
    progress: bool = True,
    timeout: float = 7200.0,
    convergence_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Convergence, step time, TTA and validation, as described in the module docstring.

    ``network``: ``"cluster"`` (the emulated cluster: needs root and network namespaces),
    ``"loopback"`` (real DDP over gloo on 127.0.0.1: no shaping, so step times are compute
    and codec only) or ``"none"`` (convergence only). ``convergence_from``: the result of an
    earlier run with the same model, data and optimiser settings, methods and seeds, whose
    validation curves are reused (to measure step times on another network without
    training again). Returns a JSON-safe dict.
    """
    cfg.validate()
    names = parse_methods(methods)
    seed_list = list(seeds)
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds must be distinct and at least one (got {seed_list})")
    if network not in ("cluster", "loopback", "none"):
        raise ValueError(f"network must be 'cluster', 'loopback' or 'none' (got {network!r})")
    cluster: Any = None
    if network == "cluster":
        from dynamiq.bench.netns import EmulatedCluster, NamespaceUnavailable, check_available

        try:
            check_available()
        except NamespaceUnavailable as exc:
            raise BenchTrainError(
                f"the emulated cluster is not available here: {exc}. Use --network loopback "
                "(step times without a shaped network) or --network none (convergence only)"
            ) from None
        cluster = EmulatedCluster(cfg.workers, rate=cfg.rate, delay_ms=cfg.delay_ms)
    show = _Progress(progress)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": _machine(),
        "config": cfg.to_dict(),
        "methods": names,
        "seeds": seed_list,
        "network": network,
        "max_steps": cfg.max_steps,
    }
    seconds: dict[str, float] = {}

    # 1. convergence
    t0 = time.perf_counter()
    if convergence_from is None:
        runs = _convergence(cfg, names, seed_list, show, timeout)
    else:
        runs = _saved_convergence(convergence_from, cfg, names, seed_list)
        result["convergence_reused_from"] = convergence_from.get("date")
    seconds["convergence"] = time.perf_counter() - t0
    targets = {s: _at(runs["bf16"][s].curve, cfg.steps) for s in seed_list}
    result["target"], conv = _convergence_summary(cfg, names, seed_list, runs, targets)
    result["convergence"] = conv

    # 2. step time and 4. validation, in one multi-rank job on the network
    timing: dict[str, Any] = {}
    validation: dict[str, Any] | None = None
    if network != "none":
        t0 = time.perf_counter()
        val_methods = ["bf16", "dynamiq"] if (validate and "dynamiq" in names) else []
        per_rank = _network_runs(
            cfg, names, seed_list[0], targets[seed_list[0]], val_methods, cluster, show, timeout
        )
        if cluster is not None:
            result["shaping"] = per_rank.pop()
        timing = _timing_summary(names, per_rank)
        if val_methods:
            validation = _validation_summary(
                names, val_methods, per_rank, conv, timing, seed_list[0], targets
            )
        seconds["network"] = time.perf_counter() - t0
    result["step_time"] = timing
    result["validation"] = validation

    # 3. TTA
    rate = None
    if network == "cluster":
        from dynamiq.bench.netns import parse_rate

        rate = parse_rate(cfg.rate)
    rows = _tta_rows(names, seed_list, conv, timing, rate)
    result["tta"] = rows
    result["verdict"] = _verdict(rows, conv, result["target"]["tolerance"], validation)
    seconds["total"] = time.perf_counter() - t_start
    result["seconds"] = seconds
    return result


def _convergence(
    cfg: TTAConfig, methods: list[str], seeds: list[int], show: _Progress, timeout: float
) -> dict[str, dict[int, RunResult]]:
    """Every method's validation curves: in process, PowerSGD over loopback gloo."""
    runs: dict[str, dict[int, RunResult]] = {m: {} for m in methods}
    for m in methods:
        if m == "powersgd":
            continue
        for s in seeds:
            label = f"convergence {m} seed {s}"

            def tick(step: int, val: float | None, label: str = label) -> None:
                show(f"{label}: step {step}/{cfg.max_steps} val {val:.4f}")

            run = train_inprocess(m, cfg, s, progress=tick)
            runs[m][s] = run
            final = _at(run.curve, cfg.steps)
            show.line(f"{label}: val loss at step {cfg.steps} {final:.4f} ({run.seconds:.0f} s)")
    if "powersgd" in methods:
        jobs = [
            {"method": "powersgd", "seed": s, "steps": cfg.max_steps, "eval_every": cfg.eval_every}
            for s in seeds
        ]
        t0 = time.perf_counter()
        label = "convergence powersgd (gloo, loopback)"
        per_rank = _run_loopback(
            {"cfg": cfg.to_dict(), "runs": jobs}, cfg.workers, show, label, timeout
        )
        for s, r in zip(seeds, per_rank[0], strict=True):
            runs["powersgd"][s] = RunResult(
                method="powersgd",
                seed=s,
                curve=[(int(a), float(b)) for a, b in r["curve"]],
                train_losses=r["losses"],
                seconds=(time.perf_counter() - t0) / len(seeds),
            )
            final = _at(runs["powersgd"][s].curve, cfg.steps)
            show.line(f"convergence powersgd seed {s}: val loss at step {cfg.steps} {final:.4f}")
    return runs


#: settings that do not change the training trajectories (only where and how time is taken)
_TIMING_FIELDS = ("rate", "delay_ms", "timing_warmup", "timing_steps", "compute_steps")


def _saved_convergence(
    saved: dict[str, Any], cfg: TTAConfig, methods: list[str], seeds: list[int]
) -> dict[str, dict[int, RunResult]]:
    """The validation curves of an earlier result, checked to belong to this configuration."""
    try:
        old = {k: v for k, v in saved["config"].items() if k not in _TIMING_FIELDS}
        conv = saved["convergence"]
    except (KeyError, TypeError, AttributeError):
        raise ValueError("the saved result has no 'config' and 'convergence'") from None
    new = {k: v for k, v in cfg.to_dict().items() if k not in _TIMING_FIELDS}
    diff = sorted(k for k in new if old.get(k) != new[k])
    if diff:
        k = diff[0]
        raise ValueError(
            f"the saved result was trained with {k}={old.get(k)!r}, this run asks for "
            f"{k}={new[k]!r}: its convergence cannot be reused"
        )
    runs: dict[str, dict[int, RunResult]] = {}
    for m in methods:
        if m not in conv:
            raise ValueError(f"the saved result has no convergence runs of {m!r}")
        runs[m] = {}
        for s in seeds:
            per = conv[m]["seeds"].get(str(s))
            if per is None:
                raise ValueError(f"the saved result has no seed {s} of {m!r}")
            runs[m][s] = RunResult(
                method=m,
                seed=s,
                curve=[(int(a), float(b)) for a, b in per["curve"]],
                train_losses=[],
                seconds=float(per["seconds"]),
                bytes_per_step=per["payload_bytes_per_step"],
            )
    return runs


def _convergence_summary(
    cfg: TTAConfig,
    methods: list[str],
    seeds: list[int],
    runs: dict[str, dict[int, RunResult]],
    targets: dict[int, float],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the target and tolerance, per method: curves, finals, steps to target)."""
    finals_bf16 = [targets[s] for s in seeds]
    bf16_mean = statistics.fmean(finals_bf16)
    bf16_std = statistics.stdev(finals_bf16) if len(seeds) > 1 else 0.0
    tolerance = max(0.001 * bf16_mean, 2 * bf16_std)
    conv: dict[str, Any] = {}
    for m in methods:
        per: dict[str, Any] = {}
        for s in seeds:
            run = runs[m][s]
            per[str(s)] = {
                "curve": [[int(a), float(b)] for a, b in run.curve],
                "final": _at(run.curve, cfg.steps),
                "last": run.curve[-1][1],
                "steps_to_target": _steps_to(run.curve, targets[s]),
                "seconds": run.seconds,
                "payload_bytes_per_step": run.bytes_per_step,
            }
        finals = [per[str(s)]["final"] for s in seeds]
        mean = statistics.fmean(finals)
        conv[m] = {
            "seeds": per,
            "final_mean": mean,
            "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_vs_bf16": mean - bf16_mean,
            "within_tolerance": abs(mean - bf16_mean) <= tolerance,
        }
    target = {
        "rule": "per seed: the bf16 run's validation loss at step `steps` (same seed)",
        "per_seed": {str(s): targets[s] for s in seeds},
        "bf16_final_mean": bf16_mean,
        "bf16_final_std": bf16_std,
        "tolerance": tolerance,
        "tolerance_rule": "max(0.1% of bf16's mean final loss, 2 sigma of bf16's finals)",
    }
    return target, conv


def _network_runs(
    cfg: TTAConfig,
    methods: list[str],
    seed: int,
    target: float,
    val_methods: list[str],
    cluster: Any,
    show: _Progress,
    timeout: float,
) -> list[Any]:
    """One multi-rank job: a timing run per method, then the validation runs to ``target``.

    Returns per rank the list of run results (and, on the cluster, its shaping last)."""
    jobs: list[dict[str, Any]] = []
    for m in methods:
        warm = cfg.timing_warmup + (cfg.powersgd_start if m == "powersgd" else 0)
        jobs.append(
            {
                "method": m,
                "seed": seed,
                "steps": warm + cfg.timing_steps,
                "timing_warmup": warm,
                "compute_steps": cfg.compute_steps,
            }
        )
    for m in val_methods:
        jobs.append(
            {
                "method": m,
                "seed": seed,
                "steps": cfg.max_steps,
                "eval_every": cfg.eval_every,
                "target": target,
            }
        )
    spec = {"cfg": cfg.to_dict(), "runs": jobs}
    if cluster is None:
        out: list[Any] = _run_loopback(spec, cfg.workers, show, "loopback", timeout)
    else:
        with cluster as cl:
            out = list(_run_cluster(cl, spec, cfg.workers, show, "cluster", timeout))
            out.append(dict(cl.shaping))
    show.line("step time and validation runs: done")
    return out


def _timing_summary(methods: list[str], per_rank: list[Any]) -> dict[str, Any]:
    """Per method: mean step time (rank 0 and every rank), compute time, hook phases,
    payload and wire bytes per step."""
    timing: dict[str, Any] = {}
    for i, m in enumerate(methods):
        r0 = per_rank[0][i]
        wires = [pr[i]["wire_bytes_per_step"] for pr in per_rank]
        timing[m] = {
            "step_seconds": r0["timed_mean"],
            "step_seconds_ranks": [pr[i]["timed_mean"] for pr in per_rank],
            "step_seconds_all": r0["step_times"],
            "compute_seconds": r0["compute_mean"],
            "hook_phases": r0["phases"],
            "payload_bytes_per_step": r0["payload_bytes_per_step"],
            "wire_tx_bytes_per_step": (
                statistics.fmean(w["tx"] for w in wires) if all(wires) else None
            ),
        }
    return timing


def _validation_summary(
    methods: list[str],
    val_methods: list[str],
    per_rank: list[Any],
    conv: dict[str, Any],
    timing: dict[str, Any],
    seed: int,
    targets: dict[int, float],
) -> dict[str, Any]:
    """Measured training time to the target against steps-to-target x step time."""
    validation: dict[str, Any] = {}
    for j, m in enumerate(val_methods):
        r0 = per_rank[0][len(methods) + j]
        predicted_steps = conv[m]["seeds"][str(seed)]["steps_to_target"]
        step_t = timing[m]["step_seconds"]
        reached = r0["reached"]
        measured = sum(r0["step_times"]) if reached else None
        predicted = predicted_steps * step_t if predicted_steps else None
        validation[m] = {
            "seed": seed,
            "target": targets[seed],
            "steps_measured": reached,
            "steps_predicted": predicted_steps,
            "tta_measured": measured,
            "tta_predicted": predicted,
            "error": (measured / predicted - 1) if (measured and predicted) else None,
            "curve": r0["curve"],
            "mean_step_seconds": statistics.fmean(r0["step_times"]),
        }
    return validation


def _tta_rows(
    methods: list[str],
    seeds: list[int],
    conv: dict[str, Any],
    timing: dict[str, Any],
    rate_bps: int | None = None,
) -> list[dict[str, Any]]:
    """One row per method: finals, steps to target, step time, TTA per seed and mean.

    With ``rate_bps`` (the cluster's link rate) also the *wire-bound* step, a projection
    rather than a measurement: compute time + the bytes this rank put on its link / the
    rate, i.e. the step if encoding, reducing and decoding cost nothing and transfers were
    perfectly pipelined; and the TTA that step would give."""
    rows = []
    for m in methods:
        c = conv[m]
        steps = [c["seeds"][str(s)]["steps_to_target"] for s in seeds]
        t = timing.get(m, {})
        step_t = t.get("step_seconds")
        ttas = [n * step_t if (n is not None and step_t) else None for n in steps]
        got = [x for x in ttas if x is not None]
        payload = (
            t.get("payload_bytes_per_step")
            if m == "powersgd"
            else statistics.fmean(c["seeds"][str(s)]["payload_bytes_per_step"] for s in seeds)
        )
        rows.append(
            {
                "method": m,
                "label": method_label(m),
                "final_mean": c["final_mean"],
                "final_std": c["final_std"],
                "final_vs_bf16": c["final_vs_bf16"],
                "steps_to_target": steps,
                "step_seconds": step_t,
                "compute_seconds": t.get("compute_seconds"),
                "wire_tx_bytes_per_step": t.get("wire_tx_bytes_per_step"),
                "payload_bytes_per_step": payload,
                "tta_seconds": ttas,
                "tta_mean": statistics.fmean(got) if (got and len(got) == len(seeds)) else None,
            }
        )
        wire, comp = t.get("wire_tx_bytes_per_step"), t.get("compute_seconds")
        ideal = comp + wire * 8 / rate_bps if (rate_bps and wire and comp) else None
        rows[-1]["wire_bound_step_seconds"] = ideal
        all_reached = all(n is not None for n in steps)
        rows[-1]["wire_bound_tta_mean"] = (
            statistics.fmean(n * ideal for n in steps if n is not None)
            if (ideal and all_reached)
            else None
        )
    bf = next(r for r in rows if r["method"] == "bf16")
    for r in rows:
        ok = bf["tta_mean"] and r["tta_mean"]
        r["tta_speedup_vs_bf16"] = bf["tta_mean"] / r["tta_mean"] if ok else None
    return rows


def _verdict(
    rows: list[dict[str, Any]],
    conv: dict[str, Any],
    tolerance: float,
    validation: dict[str, Any] | None,
) -> dict[str, Any]:
    """The issue's numbers: dynamiq's TTA against the best baseline, its final loss
    against bf16's, and the validation error."""
    out: dict[str, Any] = {}
    by = {r["method"]: r for r in rows}
    if "dynamiq" in by:
        base = [by[m] for m in BASELINES if m in by]
        timed = [r for r in base if r["tta_mean"] is not None]
        d = by["dynamiq"]["tta_mean"]
        if timed and d is not None:
            best = min(timed, key=lambda r: r["tta_mean"])
            out["best_baseline"] = best["method"]
            out["tta_speedup_vs_best_baseline"] = best["tta_mean"] / d
            out["tta_target_met"] = best["tta_mean"] / d >= 1.3
        wb = [r for r in base if r["wire_bound_tta_mean"] is not None]
        dw = by["dynamiq"]["wire_bound_tta_mean"]
        if wb and dw is not None:
            best_w = min(wb, key=lambda r: r["wire_bound_tta_mean"])
            out["wire_bound_best_baseline"] = best_w["method"]
            out["wire_bound_tta_speedup_vs_best_baseline"] = best_w["wire_bound_tta_mean"] / dw
        out["final_loss_gap"] = conv["dynamiq"]["final_vs_bf16"]
        out["final_loss_tolerance"] = tolerance
        out["final_loss_met"] = bool(conv["dynamiq"]["within_tolerance"])
    if validation:
        errs = {m: v["error"] for m, v in validation.items()}
        out["validation_errors"] = errs
        out["validation_met"] = all(e is not None and abs(e) <= 0.15 for e in errs.values())
    return out


# -- output ---------------------------------------------------------------------------------


def _fmt_steps(steps: Sequence[int | None]) -> str:
    return "/".join("-" if s is None else str(s) for s in steps)


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The terminal table: one row per method."""
    out = []
    for r in result["tta"]:
        wire = r["wire_tx_bytes_per_step"]
        out.append(
            {
                "method": r["label"],
                "final val loss": f"{r['final_mean']:.4f} ± {r['final_std']:.4f}",
                "vs bf16": f"{r['final_vs_bf16']:+.4f}",
                "steps to target": _fmt_steps(r["steps_to_target"]),
                "step (s)": "-" if r["step_seconds"] is None else f"{r['step_seconds']:.3f}",
                "compute (s)": "-"
                if r["compute_seconds"] is None
                else f"{r['compute_seconds']:.3f}",
                "wire MB/step": "-" if wire is None else f"{wire / 1e6:.3f}",
                "wire-bound step (s)": "-"
                if r["wire_bound_step_seconds"] is None
                else f"{r['wire_bound_step_seconds']:.3f}",
                "TTA (s)": "-" if r["tta_mean"] is None else f"{r['tta_mean']:.1f}",
                "TTA vs bf16": "-"
                if r["tta_speedup_vs_bf16"] is None
                else f"{r['tta_speedup_vs_bf16']:.2f}x",
            }
        )
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The verdict as sentences."""
    t = result["target"]
    v = result["verdict"]
    lines = [
        f"target: per seed, bf16's validation loss at step {result['config']['steps']} "
        f"(mean {t['bf16_final_mean']:.4f}, sigma {t['bf16_final_std']:.4f}); every run "
        f"trains {result['max_steps']} steps; '-' = not reached",
    ]
    if "tta_speedup_vs_best_baseline" in v:
        lines.append(
            f"dynamiq TTA vs best of {', '.join(BASELINES)} ({v['best_baseline']}): "
            f"{v['tta_speedup_vs_best_baseline']:.2f}x (goal >= 1.3x: "
            f"{'met' if v['tta_target_met'] else 'NOT met'})"
        )
    elif "final_loss_gap" in v:
        lines.append("dynamiq TTA: not available (no step times, or a target not reached)")
    if "wire_bound_tta_speedup_vs_best_baseline" in v:
        lines.append(
            "projection, not a measurement: with steps at compute + wire bytes / link rate "
            "(codec work free, transfers perfectly pipelined), dynamiq's TTA vs the best "
            f"baseline ({v['wire_bound_best_baseline']}) would be "
            f"{v['wire_bound_tta_speedup_vs_best_baseline']:.2f}x"
        )
    if "final_loss_gap" in v:
        lines.append(
            f"dynamiq final loss vs bf16: {v['final_loss_gap']:+.4f} (tolerance "
            f"{v['final_loss_tolerance']:.4f}: {'met' if v['final_loss_met'] else 'NOT met'})"
        )
    if result.get("validation"):
        parts = []
        for m, val in result["validation"].items():
            if val["error"] is None:
                parts.append(f"{m}: target not reached in the real run")
            else:
                parts.append(
                    f"{m}: measured {val['tta_measured']:.1f} s vs predicted "
                    f"{val['tta_predicted']:.1f} s ({val['error']:+.1%}; steps "
                    f"{val['steps_measured']} vs {val['steps_predicted']})"
                )
        ok = "met" if v.get("validation_met") else "NOT met"
        lines.append(
            f"validation on the {result['network']} (within 15%: {ok}): " + "; ".join(parts)
        )
    return lines


def _style(method: str, i: int) -> dict[str, Any]:
    """Line style of a method: its own colour; dynamiq thick, PyTorch's hooks dashed."""
    style: dict[str, Any] = {"color": f"C{i % 10}", "lw": 1.3, "label": method_label(method)}
    if method == "dynamiq":
        style["lw"] = 2.4
    elif method in _TORCH_METHODS:
        style["ls"] = "--"
    return style


def plot_curves(result: dict[str, Any], path: Path) -> None:
    """Left: validation loss against step, mean over seeds. Right: each run's validation
    loss minus the same seed's bf16 run's, mean over seeds with the min-max band."""
    from dynamiq.bench.plots import require_matplotlib

    plt = require_matplotlib()
    fig, (ax, ad) = plt.subplots(1, 2, figsize=(12, 4.6))
    conv = result["convergence"]
    seeds = [str(s) for s in result["seeds"]]

    def curve(m: str, s: str) -> dict[int, float]:
        return {int(a): float(b) for a, b in conv[m]["seeds"][s]["curve"] if int(a) > 0}

    base = {s: curve("bf16", s) for s in seeds}
    lo, hi = math.inf, -math.inf
    diff_points: list[tuple[int, float]] = []
    for i, m in enumerate(result["methods"]):
        curves = {s: curve(m, s) for s in seeds}
        steps = sorted(set.intersection(*(set(c) for c in curves.values())))
        mean = [statistics.fmean(curves[s][t] for s in seeds) for t in steps]
        ax.plot(steps, mean, **_style(m, i))
        finite = [x for x in mean if math.isfinite(x)]
        if finite:
            lo = min(lo, min(finite))
            hi = max(hi, finite[len(finite) // 3])
        both = [t for t in steps if all(t in base[s] for s in seeds)]
        diffs = [[curves[s][t] - base[s][t] for s in seeds] for t in both]
        diff_points += [(t, y) for t, d in zip(both, diffs, strict=True) for y in d]
        style = _style(m, i)
        ad.plot(both, [statistics.fmean(d) for d in diffs], **style)
        if m != "bf16" and len(seeds) > 1:
            ad.fill_between(
                both,
                [min(d) for d in diffs],
                [max(d) for d in diffs],
                color=style["color"],
                alpha=0.12,
            )
    tgt = result["target"]["bf16_final_mean"]
    ax.axhline(tgt, color="k", ls=":", lw=0.8, label="target (bf16 at the budget, mean)")
    for a in (ax, ad):
        a.axvline(result["config"]["steps"], color="k", ls=":", lw=0.8)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    if math.isfinite(lo) and hi > lo:
        ax.set_ylim(lo - 0.05 * (hi - lo), hi)
    tol = result["target"]["tolerance"]
    ad.axhspan(-tol, tol, color="k", alpha=0.07, label=f"final-loss tolerance (±{tol:.3g})")
    ax.set_ylabel("validation loss (nats/byte)")
    ad.set_ylabel("validation loss - same seed's bf16")
    c = result["config"]
    ax.set_title(
        f"{c['workers']} workers, d_model {c['d_model']}, {c['n_layers']} layers, "
        f"lr {c['lr']:g}: mean of {len(seeds)} seeds",
        fontsize=10,
    )
    ad.set_title("against bf16_compress_hook (band: min-max over seeds)", fontsize=10)
    ax.legend(fontsize=7)
    ad.legend(fontsize=7, loc="upper right")
    late = [y for x, y in diff_points if x >= result["config"]["steps"] // 3 and math.isfinite(y)]
    if late:
        span = max(abs(min(late)), abs(max(late)), 2 * tol)
        ad.set_ylim(-1.2 * span, 1.2 * span)
    ad.set_xlim(left=result["config"]["steps"] // 5)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_tta(result: dict[str, Any], path: Path) -> None:
    """TTA per method (mean over seeds, min-max whiskers) and where a step's time goes."""
    from dynamiq.bench.plots import require_matplotlib

    plt = require_matplotlib()
    rows = [r for r in result["tta"] if r["step_seconds"] is not None]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8))
    labels = [r["label"] for r in rows]
    y = list(range(len(rows)))
    for i, r in enumerate(rows):
        got = [t for t in r["tta_seconds"] if t is not None]
        if r["tta_mean"] is not None:
            a1.barh(i, r["tta_mean"], color="C0" if r["method"] != "dynamiq" else "C3")
            a1.errorbar(
                r["tta_mean"],
                i,
                xerr=[[r["tta_mean"] - min(got)], [max(got) - r["tta_mean"]]],
                color="k",
                capsize=3,
                lw=0.8,
            )
            a1.text(max(got), i, f"  {r['tta_mean']:.3g} s", va="center", fontsize=8)
        else:
            a1.text(0, i, " target not reached by every seed", va="center", fontsize=8)
    a1.set_yticks(y, labels, fontsize=8)
    a1.invert_yaxis()
    a1.set_xlabel("time to bf16's final validation loss (s)")
    a1.set_title(f"TTA on the {result['network']}", fontsize=10)
    comp = [r["compute_seconds"] or 0.0 for r in rows]
    codec = []
    for r in rows:
        ph = result["step_time"][r["method"]]["hook_phases"]
        codec.append(sum(ph.get(k, 0.0) for k in ("encode", "reduce", "decode")))
    rest = [max(r["step_seconds"] - c - k, 0.0) for r, c, k in zip(rows, comp, codec, strict=True)]
    a2.barh(y, comp, color="C2", label="compute (fwd, bwd, optimiser)")
    a2.barh(y, codec, left=comp, color="C1", label="codec CPU (encode, reduce, decode)")
    left = [c + k for c, k in zip(comp, codec, strict=True)]
    a2.barh(y, rest, left=left, color="C7", label="rest: transfer, waiting")
    a2.set_yticks(y, [""] * len(y))
    a2.invert_yaxis()
    a2.set_xlabel("seconds per step (rank 0)")
    a2.set_title("where a step's time goes", fontsize=10)
    a2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``train`` to the ``dynamiq bench`` sub-commands."""
    d = TTAConfig()
    p: argparse.ArgumentParser = sub.add_parser(
        "train",
        help="time-to-accuracy: training convergence x step time on the emulated cluster",
        description=(
            "Time to accuracy of gradient all-reduce methods. A byte-level transformer learns "
            "CPython's documentation with W data-parallel workers for each method: fp32 "
            "(plain DDP), bf16 (PyTorch's bf16_compress_hook), powersgd (PyTorch's "
            "powerSGD_hook) or a codec id (the dynamiq DDP hook). Convergence comes from "
            "in-process training with each method's exact numerics (PowerSGD: real DDP over "
            "gloo on loopback); step time from real DDP on the emulated cluster (one network "
            "namespace per rank, links shaped with tc; needs root). TTA = steps to the bf16 "
            "run's final validation loss x step time. Finally bf16 and dynamiq train for "
            "real on the cluster to that loss, to check the prediction. Progress goes to "
            "stderr; the table (or --json) to stdout; PNGs and results.json to --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated: fp32, bf16, powersgd or codec ids (must include bf16)",
    )
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    p.add_argument("--workers", type=int, default=d.workers, help="data-parallel workers W")
    p.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        help="bf16's training budget: its validation loss here is the target",
    )
    p.add_argument(
        "--extra",
        type=float,
        default=d.extra,
        help="every run trains steps x (1 + extra), so slower methods can reach the target",
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evals")
    p.add_argument("--val-windows", type=int, default=d.val_windows, help="validation windows")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width")
    p.add_argument("--layers", type=int, default=d.n_layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.n_heads, help="attention heads")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="bytes per window")
    p.add_argument("--batch", type=int, default=d.batch, help="windows per worker per step")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (constant)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument(
        "--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="DDP bucket size cap (MiB)"
    )
    p.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="run the dynamiq hook without error feedback",
    )
    p.add_argument(
        "--schedule",
        choices=("ring", "butterfly", "tree"),
        default=d.schedule,
        help="hop schedule of the dynamiq hook (fp32 and bf16 use gloo's own all-reduce)",
    )
    p.add_argument(
        "--powersgd-rank", type=int, default=d.powersgd_rank, help="PowerSGD matrix rank"
    )
    p.add_argument(
        "--powersgd-start",
        type=int,
        default=d.powersgd_start,
        help="PowerSGD compresses from this step (plain all-reduce before)",
    )
    p.add_argument(
        "--network",
        choices=("cluster", "loopback", "none"),
        default="cluster",
        help="where step time is measured: the emulated cluster (root), gloo on loopback "
        "(no shaping), or nowhere (convergence only, no TTA)",
    )
    p.add_argument("--rate", default=d.rate, help="link rate of the emulated cluster (tc)")
    p.add_argument("--delay-ms", type=float, default=d.delay_ms, help="link delay (ms)")
    p.add_argument(
        "--timing-warmup", type=int, default=d.timing_warmup, help="untimed steps per method"
    )
    p.add_argument(
        "--timing-steps", type=int, default=d.timing_steps, help="timed steps per method"
    )
    p.add_argument(
        "--no-validate",
        action="store_true",
        help="skip the real end-to-end runs of bf16 and dynamiq to the target",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 2 workers, 30 steps, 2 seeds (tests; overrides the sizes above)",
    )
    p.add_argument(
        "--out",
        default="dynamiq-bench-train",
        help="directory for results.json, loss_curves.png and tta.png ('' for none)",
    )
    p.add_argument(
        "--convergence-from",
        default="",
        metavar="JSON",
        help="reuse the validation curves of an earlier results.json (same model, data, "
        "optimiser, methods and seeds) and only measure step times, e.g. at another --rate",
    )
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per multi-rank job")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_cmd)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[TTAConfig, int]:
    """The configuration and number of seeds the command line asks for."""
    kw: dict[str, Any] = {
        "workers": args.workers,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
        "warmup": args.warmup,
        "steps": args.steps,
        "extra": args.extra,
        "eval_every": args.eval_every,
        "val_windows": args.val_windows,
        "bucket_cap_mb": args.bucket_cap_mb,
        "error_feedback": not args.no_error_feedback,
        "schedule": args.schedule,
        "powersgd_rank": args.powersgd_rank,
        "powersgd_start": args.powersgd_start,
        "rate": args.rate,
        "delay_ms": args.delay_ms,
        "timing_warmup": args.timing_warmup,
        "timing_steps": args.timing_steps,
    }
    seeds = args.seeds
    if args.quick:
        kw.update(QUICK)
        seeds = min(seeds, 2)
    cfg = TTAConfig(**kw)
    cfg.validate()
    if isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds must be >= 1 (got {seeds})")
    return cfg, seeds


def _cmd(args: argparse.Namespace) -> int:
    from dynamiq.bench.cli import format_table

    try:
        cfg, nseeds = config_from_args(args)
        methods = parse_methods(args.methods)
        saved = None
        if args.convergence_from:
            try:
                saved = json.loads(Path(args.convergence_from).read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read --convergence-from: {exc}") from None
        result = run_benchmark(
            cfg,
            methods,
            range(nseeds),
            network=args.network,
            validate=not args.no_validate,
            progress=not args.quiet,
            timeout=args.timeout,
            convergence_from=saved,
        )
    except (ValueError, BenchTrainError) as exc:
        print(f"dynamiq bench train: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        plot_curves(result, out / "loss_curves.png")
        files = ["results.json", "loss_curves.png"]
        if result["step_time"]:
            plot_tta(result, out / "tta.png")
            files.append("tta.png")
        result["files"] = [str(out / f) for f in files]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        rows = table_rows(result)
        print(format_table(rows, list(rows[0])))
        print()
        for line in summary_lines(result):
            print(line)
        if args.out:
            print(f"written: {', '.join(result['files'])}")
    return 0
