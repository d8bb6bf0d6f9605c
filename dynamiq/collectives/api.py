"""Public collective API: :func:`allreduce` over torch.distributed and
:func:`simulate_allreduce` in one process (DESIGN.md, "Collectives")."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from dynamiq.codecs import Codec, get_codec
from dynamiq.codecs.base import FLOAT_DTYPES

from .engine import EngineResult, chunk_layout, plan_schedule, run_schedule
from .schedules import Schedule, get_schedule
from .simulator import simulate_schedule
from .transport import LocalCluster, TorchDistTransport, Transport, run_threads

__all__ = [
    "AllReduceHandle",
    "AllReduceStats",
    "Shard",
    "SimResult",
    "all_gather",
    "allreduce",
    "reduce_scatter",
    "simulate_allreduce",
]

#: Buffers with fewer elements than this go uncompressed (fp32) by default.
DEFAULT_THRESHOLD = 1024
_OPS = ("sum", "avg")


def _op_name(op: Any) -> str:
    """``"sum"``/``"avg"`` from a string (any case) or ``torch.distributed.ReduceOp``."""
    name = op.lower() if isinstance(op, str) else str(op).rsplit(".", 1)[-1].lower()
    if name not in _OPS:
        raise ValueError(f"op must be one of 'sum', 'avg' or ReduceOp.SUM/AVG (got {op!r})")
    return name


@dataclass
class AllReduceStats:
    """What one rank sent and received, and where its time went.

    ``bytes_sent``/``bytes_received`` count payloads and length headers; ``bound_bytes_sent``
    the certified bounds that travel beside them (``return_bound=True``); ``control_bytes_sent``
    the configuration handshake. ``seconds`` has one entry per phase (``agree``, ``encode``,
    ``reduce``, ``wait``, ``decode``, ``total``). ``bound`` is the certified per-element bound
    of the result (fp64), when asked.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bound_bytes_sent: int = 0
    control_bytes_sent: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    bound: torch.Tensor | None = None
    codec: str = ""
    schedule: str = ""

    @classmethod
    def from_result(cls, res: EngineResult, codec: Codec, schedule: Schedule) -> AllReduceStats:
        return cls(
            bytes_sent=res.bytes_sent,
            bytes_received=res.bytes_received,
            bound_bytes_sent=res.bound_bytes_sent,
            control_bytes_sent=res.control_bytes_sent,
            seconds=res.seconds,
            bound=res.bound,
            codec=repr(codec),
            schedule=schedule.name,
        )


@dataclass
class SimResult:
    """Result of :func:`simulate_allreduce`.

    ``outputs``: one fp32 tensor per rank (bit-identical); ``exact``: the fp64 sum;
    ``vnmse``: ``‖out - exact‖² / ‖exact‖²``; ``bytes_sent``: per rank; ``bound``: the certified
    per-element bound of ``|out - exact|`` (fp64); ``stats``: each rank's :class:`AllReduceStats`.
    """

    outputs: list[torch.Tensor]
    exact: torch.Tensor
    vnmse: float
    bytes_sent: list[int]
    bound: torch.Tensor | None
    stats: list[AllReduceStats]

    def bits_per_value(self) -> float:
        """8 × bytes sent ÷ values carried, averaged over ranks (payloads and headers)."""
        n = len(self.outputs)
        numel = self.exact.numel()
        if n == 1 or numel == 0:
            return 0.0
        return 8 * sum(self.bytes_sent) / n / (2 * (n - 1) / n * numel)


def _check_tensor(t: Any, name: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16 (got {t.dtype})")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _finish(
    tensor: torch.Tensor, res: EngineResult, op: str, world_size: int
) -> torch.Tensor | None:
    """Write the result into ``tensor`` (AVG divides; bf16/fp16 round), extending the bound."""
    out = res.output
    bound = res.bound
    if op == "avg":
        scaled = out / world_size
        if bound is not None:
            bound = bound / world_size + scaled.double().abs() * 2.0**-24 + 2.0**-150
        out = scaled
    if tensor.dtype != torch.float32:
        cast = out.to(tensor.dtype)
        if bound is not None:
            bound = bound + (cast.double() - out.double()).abs()
        out = cast.float()
    if out.data_ptr() != tensor.data_ptr():  # the engine may have worked in ``tensor`` itself
        tensor.view(-1).copy_(out)
    return bound


def _resolve(
    codec: Any, schedule: str | Schedule, world_size: int, numel: int, threshold: int, **kw: Any
) -> tuple[Codec, Schedule]:
    c = get_codec(codec)
    if numel < threshold:
        c = get_codec("fp32")
    return c, get_schedule(schedule, world_size, **kw)


class AllReduceHandle:
    """Returned by ``async_op=True``: ``wait()`` returns what the call would have returned
    (``allreduce``: the stats; ``reduce_scatter``: the Shard; ``all_gather``: the tensor and
    the stats), or raises its error."""

    def __init__(self, fn: Any):
        self._result: Any = None
        self._error: BaseException | None = None

        def body() -> None:
            try:
                self._result = fn()
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=body, daemon=True, name="dynamiq-allreduce")
        self._thread.start()

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"collective still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


def allreduce(
    tensor: torch.Tensor,
    codec: Any = "fp32",
    schedule: str | Schedule = "ring",
    group: Any = None,
    *,
    seed: int = 0,
    step: int = 0,
    op: Any = "sum",
    async_op: bool = False,
    return_bound: bool = False,
    sub_chunk: int = 1 << 18,
    threshold: int = DEFAULT_THRESHOLD,
    timeout: float = 300.0,
    transport: Transport | None = None,
    schedule_options: dict[str, Any] | None = None,
    residual: torch.Tensor | None = None,
) -> AllReduceStats | AllReduceHandle:
    """Compressed all-reduce of ``tensor`` in place over ``group`` (torch.distributed).

    ``codec``: an id, a config or a Codec; ``schedule``: a name (``ring``, ``butterfly``,
    ``tree``, ``hierarchical``) or a :class:`Schedule`; ``op``: ``"sum"`` or ``"avg"``.
    Every rank ends with bit-identical values. Tensors of any shape are reduced as their
    flattened contents. Buffers under ``threshold`` elements go uncompressed (fp32).
    A peer that dies or stalls raises :class:`PeerTimeoutError` within ``timeout`` seconds;
    ranks that disagree on the configuration raise :class:`ConfigMismatchError`.
    ``residual`` (fp32, same number of elements) accumulates what this rank's encodings lost
    (for error feedback; see :mod:`dynamiq.ddp`). An fp32 ``tensor`` is the engine's working
    buffer: if the collective fails its contents are undefined (as with torch.distributed).
    """
    _check_tensor(tensor)
    op = _op_name(op)
    tr = transport or TorchDistTransport(group)
    c, sched = _resolve(
        codec, schedule, tr.world_size, tensor.numel(), threshold, **(schedule_options or {})
    )

    def run() -> AllReduceStats:
        res = run_schedule(
            tr,
            tensor.reshape(-1),
            c,
            sched,
            seed=seed,
            step=step,
            sub_chunk=sub_chunk,
            return_bound=return_bound,
            timeout=timeout,
            descriptor={"op": op, "dtype": str(tensor.dtype)},
            residual=residual,
            inplace=True,  # the result goes to ``tensor`` anyway: no 2 copies of it
        )
        bound = _finish(tensor, res, op, tr.world_size)
        stats = AllReduceStats.from_result(res, c, sched)
        stats.bound = bound
        return stats

    if async_op:
        return AllReduceHandle(run)
    return run()


def simulate_allreduce(
    tensors: list[torch.Tensor],
    codec: Any = "fp32",
    schedule: str | Schedule = "ring",
    seed: int = 0,
    *,
    step: int = 0,
    op: Any = "sum",
    return_bound: bool = True,
    sub_chunk: int = 1 << 18,
    threshold: int = 0,
    timeout: float = 300.0,
    schedule_options: dict[str, Any] | None = None,
    engine: str = "batched",
) -> SimResult:
    """Run the all-reduce of ``tensors`` (one per simulated rank) in this process.

    ``engine="batched"`` (:mod:`dynamiq.collectives.simulator`) computes every rank's part of
    the engine round by round, one codec call per round where the codec allows: bit-identical
    to ``engine="threads"``, where the ranks are threads exchanging bytes through in-process
    mailboxes, running exactly the engine that runs over torch.distributed. Inputs are not
    modified.
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list, one tensor per rank")
    if engine not in ("batched", "threads"):
        raise ValueError(f"engine must be 'batched' or 'threads' (got {engine!r})")
    n = len(tensors)
    shapes = {tuple(t.shape) for t in tensors}
    for i, t in enumerate(tensors):
        _check_tensor(t, f"tensors[{i}]")
    if len(shapes) != 1:
        raise ValueError(f"all ranks' tensors must have the same shape (got {sorted(shapes)})")
    op = _op_name(op)
    c, sched = _resolve(
        codec, schedule, n, tensors[0].numel(), threshold, **(schedule_options or {})
    )
    outs = [t.detach().clone() for t in tensors]
    if engine == "batched":
        flat = [o.reshape(-1) for o in outs]
        run = simulate_schedule(
            flat, c, sched, seed=seed, step=step, sub_chunk=sub_chunk, return_bound=return_bound
        )
        results = run.results
    else:
        plan = plan_schedule(sched, c, seed=seed, step=step)
        cluster = LocalCluster(n)

        def rank(r: int) -> EngineResult:
            return run_schedule(
                cluster.transport(r),
                outs[r].reshape(-1),
                c,
                sched,
                seed=seed,
                step=step,
                sub_chunk=sub_chunk,
                return_bound=return_bound,
                timeout=timeout,
                plan=plan,
            )

        results = run_threads(n, rank, on_error=cluster.aborted.set)
    stats = []
    for r, res in enumerate(results):
        stats.append(AllReduceStats.from_result(res, c, sched))
        stats[-1].bound = _finish(outs[r], res, op, n)
    exact = torch.stack([t.reshape(-1).double() for t in tensors]).sum(dim=0)
    if op == "avg":
        exact = exact / n
    out0 = outs[0].reshape(-1).double()
    denom = float(exact.square().sum())
    vnmse = float((out0 - exact).square().sum()) / denom if denom > 0 else 0.0
    return SimResult(
        outputs=[o.reshape(-1).float() for o in outs],
        exact=exact,
        vnmse=vnmse,
        bytes_sent=[s.bytes_sent for s in stats],
        bound=stats[0].bound,
        stats=stats,
    )


@dataclass
class Shard:
    """What :func:`reduce_scatter` leaves a rank: the finished sums of the chunks it owns.

    ``values`` (fp32) concatenates the ranges ``ranges`` (``[start, end)`` element offsets of
    the flattened tensor, in order); ``numel`` is the full tensor's size. With ``ring`` and
    ``butterfly`` rank ``r`` owns chunk ``r``; with ``tree`` rank 0 owns everything.
    """

    values: torch.Tensor
    ranges: list[tuple[int, int]]
    numel: int
    stats: AllReduceStats | None = None


def _owned_ranges(
    sched: Schedule,
    codec: Codec,
    numel: int,
    sub_chunk: int,
    rank: int,
    chunk_bounds: list[tuple[int, int]] | None = None,
) -> tuple[list[int], list[tuple[int, int]]]:
    bounds, _ = chunk_layout(numel, sched, codec, sub_chunk, chunk_bounds)
    chunks = sched.owned_chunks(rank)
    return chunks, [bounds[c] for c in chunks]


def _bounds_by_chunk(sched: Schedule, by_rank: Any) -> list[tuple[int, int]]:
    """Per-chunk bounds from the range each rank must own (``by_rank[r]``): rank ``r``'s
    range becomes the bounds of the one chunk the schedule has it complete."""
    n = sched.world_size
    if len(by_rank) != n:
        raise ValueError(f"chunk_bounds needs one range per rank ({n}), got {len(by_rank)}")
    out: list[tuple[int, int] | None] = [None] * sched.num_chunks
    for r in range(n):
        owned = sched.owned_chunks(r)
        if sched.num_chunks != n or len(owned) != 1:
            raise ValueError(
                f"schedule {sched.name!r} cannot give rank r a caller-chosen range: its "
                f"{n} ranks complete {sched.num_chunks} chunks (rank {r} completes {owned}); "
                "use 'ring' or a power-of-two 'butterfly'"
            )
        a, b = by_rank[r]
        out[owned[0]] = (int(a), int(b))
    return [c for c in out if c is not None]


def reduce_scatter(
    tensor: torch.Tensor,
    codec: Any = "fp32",
    schedule: str | Schedule = "ring",
    group: Any = None,
    *,
    seed: int = 0,
    step: int = 0,
    op: Any = "sum",
    async_op: bool = False,
    sub_chunk: int = 1 << 18,
    timeout: float = 300.0,
    transport: Transport | None = None,
    schedule_options: dict[str, Any] | None = None,
    chunk_bounds: Any = None,
    residual: torch.Tensor | None = None,
    return_bound: bool = False,
) -> Shard | AllReduceHandle:
    """The reduce-scatter half: every rank gets the finished sum of the chunks it owns.

    The sums are the very values :func:`allreduce` would give (same codec, schedule, seed).
    ``tensor`` is not modified. ``async_op=True`` returns a handle whose ``wait()`` gives the
    Shard. ``chunk_bounds[r] = (start, end)`` fixes the range rank ``r`` ends with (together
    a partition of the tensor, e.g. FSDP's ``[r·S, (r+1)·S)``); only schedules in which
    every rank completes exactly one chunk allow it (``ring``, power-of-two ``butterfly``).
    ``residual`` as in :func:`allreduce`; ``return_bound=True`` puts the certified
    per-element bound of ``values`` (fp64, before ``avg``'s division) in ``stats.bound``.
    """
    _check_tensor(tensor)
    op = _op_name(op)
    tr = transport or TorchDistTransport(group)
    c = get_codec(codec)
    sched = get_schedule(schedule, tr.world_size, **(schedule_options or {}))
    numel = tensor.numel()
    per_chunk = None if chunk_bounds is None else _bounds_by_chunk(sched, chunk_bounds)
    chunks, ranges = _owned_ranges(sched, c, numel, sub_chunk, tr.rank, per_chunk)
    extra = {} if per_chunk is None else {"chunk_bounds": per_chunk}

    def run() -> Shard:
        res = run_schedule(
            tr,
            tensor.reshape(-1),
            c,
            sched,
            seed=seed,
            step=step,
            sub_chunk=sub_chunk,
            timeout=timeout,
            rounds=(0, sched.reduce_rounds),
            outputs=chunks,
            descriptor={
                "op": op,
                "dtype": str(tensor.dtype),
                "collective": "reduce_scatter",
                **extra,
            },
            residual=residual,
            chunk_bounds=per_chunk,
            return_bound=return_bound,
        )
        parts = [res.output[a:b] for a, b in ranges]
        values = torch.cat(parts) if parts else torch.empty(0)
        if op == "avg":
            values = values / tr.world_size
        stats = AllReduceStats.from_result(res, c, sched)
        if res.bound is not None:
            bparts = [res.bound[a:b] for a, b in ranges]
            stats.bound = torch.cat(bparts) if bparts else torch.empty(0, dtype=torch.float64)
        return Shard(values, ranges, numel, stats)

    return AllReduceHandle(run) if async_op else run()


def all_gather(
    shard: Shard,
    codec: Any = "fp32",
    schedule: str | Schedule = "ring",
    group: Any = None,
    *,
    seed: int = 0,
    step: int = 0,
    async_op: bool = False,
    sub_chunk: int = 1 << 18,
    timeout: float = 300.0,
    transport: Transport | None = None,
    schedule_options: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, AllReduceStats] | AllReduceHandle:
    """The all-gather half: every rank gets every rank's shard (fp32, flattened), encoded
    once by its owner and forwarded as bytes, so all ranks end bit-identical.

    ``shard`` holds this rank's owned ranges, laid out as :func:`reduce_scatter` returns them
    (same codec, schedule and ``sub_chunk``). ``async_op=True`` returns a handle whose
    ``wait()`` gives the pair.
    """
    tr = transport or TorchDistTransport(group)
    c = get_codec(codec)
    sched = get_schedule(schedule, tr.world_size, **(schedule_options or {}))
    _, ranges = _owned_ranges(sched, c, shard.numel, sub_chunk, tr.rank)
    if ranges != list(shard.ranges):
        raise ValueError(
            f"shard ranges {shard.ranges} are not the ranges rank {tr.rank} owns under this "
            f"codec, schedule and sub_chunk: {ranges}"
        )
    want = sum(b - a for a, b in ranges)
    if shard.values.numel() != want:
        raise ValueError(f"shard has {shard.values.numel()} values, its ranges hold {want}")
    full = torch.zeros(shard.numel, dtype=torch.float32, device=shard.values.device)
    pos = 0
    for a, b in ranges:
        full[a:b] = shard.values[pos : pos + b - a]
        pos += b - a

    def run() -> tuple[torch.Tensor, AllReduceStats]:
        res = run_schedule(
            tr,
            full,
            c,
            sched,
            seed=seed,
            step=step,
            sub_chunk=sub_chunk,
            timeout=timeout,
            rounds=(sched.reduce_rounds, sched.num_rounds),
            descriptor={"collective": "all_gather"},
        )
        return res.output, AllReduceStats.from_result(res, c, sched)

    return AllReduceHandle(run) if async_op else run()
