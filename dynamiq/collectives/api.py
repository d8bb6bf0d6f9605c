"""Public collective API: :func:`allreduce`, :func:`reduce_scatter` and :func:`all_gather` over
torch.distributed, :func:`simulate_allreduce` in one process (docs/collectives.md).

Every function takes its configuration as a :class:`~dynamiq.collectives.options.
CollectiveOptions` (``options=``), as keywords of the same names, or both (a keyword given
replaces the field). ``async_op=True`` returns an :class:`AllReduceHandle` whose ``wait()``
gives what the synchronous call returns; any number may be in flight on one group, each
matched to its own messages (:class:`~dynamiq.collectives.transport.Channel`: tagged on gloo,
run one at a time in issue order on NCCL), each giving what it would give alone.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

import torch

from dynamiq.codecs import Codec, get_codec
from dynamiq.codecs.base import FLOAT_DTYPES

from . import traced
from .engine import EngineResult, RunConfig, ScheduleRun
from .options import (
    DEFAULT_THRESHOLD,
    DEFAULT_VERIFY,
    CollectiveOptions,
    OptionKeywords,
    SeedlessKeywords,
    merge_options,
)
from .planning import chunk_layout, plan_schedule
from .schedules import Schedule, get_schedule
from .simulator import simulate_schedule
from .transport import LocalCluster, TorchDistTransport, Transport, run_threads

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_THRESHOLD",
    "AllReduceHandle",
    "AllReduceStats",
    "Shard",
    "SimResult",
    "all_gather",
    "allreduce",
    "reduce_scatter",
    "simulate_allreduce",
]

T = TypeVar("T")


@dataclass
class AllReduceStats:
    """What one rank sent and received, and where its time went.

    ``bytes_sent``/``bytes_received`` count payloads and length headers (and a codec
    prologue's exchange); ``bound_bytes_sent`` the certified bounds that travel beside them
    (``return_bound=True``); ``control_bytes_sent`` the configuration handshake.
    ``round_bytes[k]``: the payload and header bytes this rank sent in round ``k`` (0 in a
    round it sends nothing). ``seconds`` has one entry per phase (``agree``, ``encode``,
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
    round_bytes: list[int] = field(default_factory=list)

    @property
    def max_round_bytes(self) -> int:
        """The most bytes this rank sent in any one round (0 without rounds)."""
        return max(self.round_bytes, default=0)

    @property
    def mean_round_bytes(self) -> float:
        """The bytes this rank sent per round, averaged over the rounds of the run."""
        return sum(self.round_bytes) / len(self.round_bytes) if self.round_bytes else 0.0

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
            round_bytes=list(res.round_bytes),
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

    @property
    def max_round_bytes(self) -> int:
        """The most bytes any rank sent in any one round."""
        return max((s.max_round_bytes for s in self.stats), default=0)

    @property
    def mean_round_bytes(self) -> float:
        """The bytes a rank sent per round, averaged over every rank and round."""
        cells = [b for s in self.stats for b in s.round_bytes]
        return sum(cells) / len(cells) if cells else 0.0


@dataclass
class Shard:
    """What :func:`reduce_scatter` leaves a rank: the finished sums of the chunks it owns.

    ``values`` (fp32) concatenates the ranges ``ranges`` (``[start, end)`` element offsets of
    the flattened tensor, in order); ``numel`` is the full tensor's size. With ``ring`` and
    ``butterfly`` rank ``r`` owns chunk ``r``; with ``tree`` rank 0 owns everything.
    ``stats.bound`` is the certified bound of ``values`` (``return_bound=True``).
    """

    values: torch.Tensor
    ranges: list[tuple[int, int]]
    numel: int
    stats: AllReduceStats | None = None


class AllReduceHandle(Generic[T]):
    """Returned by ``async_op=True``: ``wait()`` returns what the call would have returned
    (``allreduce``: the stats; ``reduce_scatter``: the Shard; ``all_gather``: the tensor and
    the stats), or raises its error."""

    def __init__(self, fn: Callable[[], T]):
        self._result: T | None = None
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

    def wait(self, timeout: float | None = None) -> T:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"collective still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set by body() without an error


# -- shared steps ------------------------------------------------------------------------------


F = TypeVar("F", bound=Callable[..., Any])


def _eager(fn: F) -> F:
    """``fn`` as ``torch.compile`` meets it: a graph break, and ``fn`` run eagerly, dynamo off
    inside (the engine is host-driven: byte buffers, ``.item()``, clocks, threads, none of it
    for dynamo to trace); outside ``torch.compile`` a plain call (dynamo is not imported)."""
    disabled: list[Any] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, reason=_EAGER_REASON))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]


_EAGER_REASON = "dynamiq's collectives run eagerly (host-driven)"


def _check_tensor(t: Any, name: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16 (got {t.dtype})")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _resolve(
    opts: CollectiveOptions, world_size: int, numel: int, threshold: int
) -> tuple[Codec, Schedule]:
    """The codec (fp32 under the threshold; ``threshold``: the function's default) and the
    schedule for ``world_size`` ranks."""
    c = get_codec(opts.codec if opts.codec is not None else "fp32")
    if numel < (opts.threshold if opts.threshold is not None else threshold):
        c = get_codec("fp32")
    return c, get_schedule(opts.schedule, world_size, **(opts.schedule_options or {}))


def _config(opts: CollectiveOptions, return_bound: bool, **run: Any) -> RunConfig:
    """The engine's configuration for ``opts`` (``return_bound``: the function's default)."""
    bound = opts.return_bound if opts.return_bound is not None else return_bound
    return RunConfig(
        seed=opts.seed,
        step=opts.step,
        sub_chunk=opts.sub_chunk,
        return_bound=bound,
        timeout=opts.timeout,
        verify=opts.verify if opts.verify is not None else DEFAULT_VERIFY,
        **run,
    )


def _divide(
    out: torch.Tensor, bound: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``op="avg"``: ``fl(out / n)`` and its bound."""
    scaled = out / n
    if bound is not None:
        bound = bound / n + scaled.double().abs() * 2.0**-24 + 2.0**-150
    return scaled, bound


def _finish(
    tensor: torch.Tensor, res: EngineResult, op: str, world_size: int
) -> torch.Tensor | None:
    """Write the result into ``tensor`` (AVG divides; bf16/fp16 round), extending the bound."""
    out, bound = res.output, res.bound
    if op == "avg":
        out, bound = _divide(out, bound, world_size)
    if tensor.dtype != torch.float32:
        cast = out.to(tensor.dtype)
        if bound is not None:
            bound = bound + (cast.double() - out.double()).abs()
        out = cast.float()
    if out.data_ptr() != tensor.data_ptr():  # the engine may have worked in ``tensor`` itself
        tensor.view(-1).copy_(out)
    return bound


def _transport(transport: Transport | None, group: Any) -> tuple[Transport, bool]:
    """The transport to run on, and whether this call made it (and closes it)."""
    if transport is not None:
        return transport, False
    return TorchDistTransport(group), True


def _launch(fn: Callable[[], T], async_op: bool) -> T | AllReduceHandle[T]:
    return AllReduceHandle(fn) if async_op else fn()


# -- allreduce ---------------------------------------------------------------------------------


@overload
def allreduce(
    tensor: torch.Tensor,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: Literal[False] = ...,
    transport: Transport | None = ...,
    residual: torch.Tensor | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> AllReduceStats: ...
@overload
def allreduce(
    tensor: torch.Tensor,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: Literal[True],
    transport: Transport | None = ...,
    residual: torch.Tensor | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> AllReduceHandle[AllReduceStats]: ...
@overload
def allreduce(
    tensor: torch.Tensor,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: bool,
    transport: Transport | None = ...,
    residual: torch.Tensor | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> AllReduceStats | AllReduceHandle[AllReduceStats]: ...
def allreduce(
    tensor: torch.Tensor,
    codec: Any = None,
    schedule: str | Schedule | None = None,
    group: Any = None,
    *,
    options: CollectiveOptions | None = None,
    async_op: bool = False,
    transport: Transport | None = None,
    residual: torch.Tensor | None = None,
    **keywords: Unpack[OptionKeywords],
) -> AllReduceStats | AllReduceHandle[AllReduceStats]:
    """Compressed all-reduce of ``tensor`` in place over ``group`` (torch.distributed).

    ``codec``: an id, a config or a Codec (default ``"fp32"``); ``schedule``: a name
    (``ring``, ``butterfly``, ``tree``, ``hierarchical``) or a :class:`Schedule`; the other
    options (``seed``, ``step``, ``op``, ``sub_chunk``, ``threshold`` (default
    :data:`DEFAULT_THRESHOLD`), ``timeout``, ``return_bound``, ``schedule_options``) as
    keywords or in ``options`` (:class:`~dynamiq.collectives.options.CollectiveOptions`).
    Every rank ends with bit-identical values. Tensors of any shape are reduced as their
    flattened contents. Buffers under ``threshold`` elements go uncompressed (fp32).
    A peer that dies or stalls raises :class:`PeerTimeoutError` within ``timeout`` seconds;
    ranks that disagree on the configuration raise :class:`ConfigMismatchError`.
    ``residual`` (fp32, same number of elements) accumulates what this rank's encodings lost
    (for error feedback; see :mod:`dynamiq.ddp`). An fp32 ``tensor`` is the engine's working
    buffer: if the collective fails its contents are undefined (as with torch.distributed).
    ``transport`` replaces the torch.distributed one (``group`` is then unused). Inside
    ``torch.compile`` the call is one op of the graph and returns ``None``
    (:mod:`dynamiq.collectives.traced`).
    """
    _check_tensor(tensor)
    if torch.compiler.is_compiling():
        config = (codec, schedule, group, options, async_op, transport, keywords)
        return traced.allreduce(tensor, residual, *config)  # type: ignore[func-returns-value, return-value]
    opts = merge_options("allreduce", options, codec=codec, schedule=schedule, **keywords)
    tr, owned = _transport(transport, group)
    c, sched = _resolve(opts, tr.world_size, tensor.numel(), DEFAULT_THRESHOLD)
    # the result goes to ``tensor`` anyway: the engine works in it (no 2 copies of it)
    desc = {"op": opts.op, "dtype": str(tensor.dtype)}
    cfg = _config(opts, False, descriptor=desc, inplace=True)

    # numbered now, in issue order (the same on every rank), whatever thread runs it
    job = ScheduleRun(tr, tensor.reshape(-1), c, sched, cfg, residual=residual)

    def run() -> AllReduceStats:
        try:
            res = job.run()
        finally:
            if owned:
                tr.close()
        stats = AllReduceStats.from_result(res, c, sched)
        stats.bound = _finish(tensor, res, opts.op, tr.world_size)
        return stats

    return _launch(run, async_op)


# -- the simulator -----------------------------------------------------------------------------


@_eager
def simulate_allreduce(
    tensors: list[torch.Tensor],
    codec: Any = None,
    schedule: str | Schedule | None = None,
    seed: int | None = None,
    *,
    options: CollectiveOptions | None = None,
    engine: str = "batched",
    **keywords: Unpack[SeedlessKeywords],
) -> SimResult:
    """Run the all-reduce of ``tensors`` (one per simulated rank) in this process.

    ``engine="batched"`` (:mod:`dynamiq.collectives.simulator`) computes every rank's part of
    the engine round by round, one codec call per round where the codec allows: bit-identical
    to ``engine="threads"``, where the ranks are threads exchanging bytes through in-process
    mailboxes, running exactly the engine that runs over torch.distributed. Inputs are not
    modified. The options are those of :func:`allreduce`, except that ``threshold`` defaults
    to 0 (every buffer compressed) and ``return_bound`` to ``True``; ``verify`` checks the
    messages of ``engine="threads"`` (the batched engine sends none).
    """
    if engine not in ("batched", "threads"):
        raise ValueError(f"engine must be 'batched' or 'threads' (got {engine!r})")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list, one tensor per rank")
    n = len(tensors)
    shapes = {tuple(t.shape) for t in tensors}
    for i, t in enumerate(tensors):
        _check_tensor(t, f"tensors[{i}]")
    if len(shapes) != 1:
        raise ValueError(f"all ranks' tensors must have the same shape (got {sorted(shapes)})")
    opts = merge_options(
        "simulate_allreduce", options, codec=codec, schedule=schedule, seed=seed, **keywords
    )
    c, sched = _resolve(opts, n, tensors[0].numel(), 0)
    cfg = _config(opts, True)
    outs = [t.detach().clone() for t in tensors]
    if engine == "batched":
        flat = [o.reshape(-1) for o in outs]
        results = simulate_schedule(
            flat,
            c,
            sched,
            seed=cfg.seed,
            step=cfg.step,
            sub_chunk=cfg.sub_chunk,
            return_bound=cfg.return_bound,
        ).results
    else:
        plan = plan_schedule(sched, c, seed=opts.seed, step=opts.step)
        cluster = LocalCluster(n)

        def rank(r: int) -> EngineResult:
            tr = cluster.transport(r)
            return ScheduleRun(tr, outs[r].reshape(-1), c, sched, cfg, plan=plan).run()

        results = run_threads(n, rank, on_error=cluster.aborted.set)
    stats = []
    for r, res in enumerate(results):
        stats.append(AllReduceStats.from_result(res, c, sched))
        stats[-1].bound = _finish(outs[r], res, opts.op, n)
    exact = torch.stack([t.reshape(-1).double() for t in tensors]).sum(dim=0)
    if opts.op == "avg":
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


# -- the two halves ----------------------------------------------------------------------------


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


def _gather_ranges(
    t: torch.Tensor | None, ranges: list[tuple[int, int]], like: torch.Tensor
) -> torch.Tensor | None:
    if t is None:
        return None
    parts = [t[a:b] for a, b in ranges]
    return torch.cat(parts) if parts else torch.empty(0, dtype=t.dtype, device=like.device)


@overload
def reduce_scatter(
    tensor: torch.Tensor,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: Literal[False] = ...,
    transport: Transport | None = ...,
    chunk_bounds: Sequence[tuple[int, int]] | None = ...,
    residual: torch.Tensor | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> Shard: ...
@overload
def reduce_scatter(
    tensor: torch.Tensor,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: Literal[True],
    transport: Transport | None = ...,
    chunk_bounds: Sequence[tuple[int, int]] | None = ...,
    residual: torch.Tensor | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> AllReduceHandle[Shard]: ...
@overload
def reduce_scatter(
    tensor: torch.Tensor,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: bool,
    transport: Transport | None = ...,
    chunk_bounds: Sequence[tuple[int, int]] | None = ...,
    residual: torch.Tensor | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> Shard | AllReduceHandle[Shard]: ...
# per-call data beside the options: the caller-given layout (FSDP2) and error feedback
def reduce_scatter(  # noqa: PLR0913
    tensor: torch.Tensor,
    codec: Any = None,
    schedule: str | Schedule | None = None,
    group: Any = None,
    *,
    options: CollectiveOptions | None = None,
    async_op: bool = False,
    transport: Transport | None = None,
    chunk_bounds: Sequence[tuple[int, int]] | None = None,
    residual: torch.Tensor | None = None,
    **keywords: Unpack[OptionKeywords],
) -> Shard | AllReduceHandle[Shard]:
    """The reduce-scatter half: every rank gets the finished sum of the chunks it owns.

    The sums are the very values :func:`allreduce` would give (same codec, schedule, seed,
    options). ``tensor`` is not modified. ``threshold`` defaults to 0. ``async_op=True``
    returns a handle whose ``wait()`` gives the Shard. ``chunk_bounds[r] = (start, end)``
    fixes the range rank ``r`` ends with (together a partition of the tensor, e.g. FSDP's
    ``[r·S, (r+1)·S)``); only schedules in which every rank completes exactly one chunk allow
    it (``ring``, power-of-two ``butterfly``). ``residual`` as in :func:`allreduce`.
    Inside ``torch.compile`` the call is one op of the graph for a static size (the Shard's
    ``stats`` then ``None``; a size dynamo made symbolic breaks the graph there), see
    :mod:`dynamiq.collectives.traced`.
    """
    _check_tensor(tensor)
    if torch.compiler.is_compiling():
        config = (codec, schedule, group, options, async_op, transport, keywords)
        return traced.reduce_scatter(tensor, residual, chunk_bounds, *config)
    opts = merge_options("reduce_scatter", options, codec=codec, schedule=schedule, **keywords)
    tr, owned = _transport(transport, group)
    numel = tensor.numel()
    c, sched = _resolve(opts, tr.world_size, numel, 0)
    per_chunk = None if chunk_bounds is None else _bounds_by_chunk(sched, chunk_bounds)
    chunks, ranges = _owned_ranges(sched, c, numel, opts.sub_chunk, tr.rank, per_chunk)
    desc: dict[str, Any] = {
        "op": opts.op,
        "dtype": str(tensor.dtype),
        "collective": "reduce_scatter",
    }
    if per_chunk is not None:
        desc["chunk_bounds"] = per_chunk
    cfg = _config(
        opts,
        False,
        descriptor=desc,
        rounds=(0, sched.reduce_rounds),
        outputs=chunks,
        chunk_bounds=per_chunk,
    )

    job = ScheduleRun(tr, tensor.reshape(-1), c, sched, cfg, residual=residual)  # issued now

    def run() -> Shard:
        try:
            res = job.run()
        finally:
            if owned:
                tr.close()
        values = _gather_ranges(res.output, ranges, tensor)
        bound = _gather_ranges(res.bound, ranges, tensor)
        assert values is not None
        if opts.op == "avg":
            values, bound = _divide(values, bound, tr.world_size)
        stats = AllReduceStats.from_result(res, c, sched)
        stats.bound = bound
        return Shard(values, ranges, numel, stats)

    return _launch(run, async_op)


@overload
def all_gather(
    shard: Shard,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: Literal[False] = ...,
    transport: Transport | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> tuple[torch.Tensor, AllReduceStats]: ...
@overload
def all_gather(
    shard: Shard,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: Literal[True],
    transport: Transport | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> AllReduceHandle[tuple[torch.Tensor, AllReduceStats]]: ...
@overload
def all_gather(
    shard: Shard,
    codec: Any = ...,
    schedule: str | Schedule | None = ...,
    group: Any = ...,
    *,
    options: CollectiveOptions | None = ...,
    async_op: bool,
    transport: Transport | None = ...,
    **keywords: Unpack[OptionKeywords],
) -> tuple[torch.Tensor, AllReduceStats] | AllReduceHandle[tuple[torch.Tensor, AllReduceStats]]: ...
def all_gather(
    shard: Shard,
    codec: Any = None,
    schedule: str | Schedule | None = None,
    group: Any = None,
    *,
    options: CollectiveOptions | None = None,
    async_op: bool = False,
    transport: Transport | None = None,
    **keywords: Unpack[OptionKeywords],
) -> tuple[torch.Tensor, AllReduceStats] | AllReduceHandle[tuple[torch.Tensor, AllReduceStats]]:
    """The all-gather half: every rank gets every rank's shard (fp32, flattened), encoded
    once by its owner and forwarded as bytes, so all ranks end bit-identical.

    ``shard`` holds this rank's owned ranges, laid out as :func:`reduce_scatter` returns them
    (same codec, schedule and ``sub_chunk``). ``op`` is not used (the shards are finished
    sums); ``threshold`` defaults to 0; the bound (``return_bound=True``) is the distance
    from the gathered shards. ``async_op=True`` returns a handle whose ``wait()`` gives the
    pair. Inside ``torch.compile`` the call is one op of the graph and the stats are
    ``None`` (as for :func:`reduce_scatter`).
    """
    if torch.compiler.is_compiling():
        config = (codec, schedule, group, options, async_op, transport, keywords)
        return traced.all_gather(shard, *config)  # type: ignore[return-value]
    opts = merge_options("all_gather", options, codec=codec, schedule=schedule, **keywords)
    tr, owned = _transport(transport, group)
    c, sched = _resolve(opts, tr.world_size, shard.numel, 0)
    _, ranges = _owned_ranges(sched, c, shard.numel, opts.sub_chunk, tr.rank)
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
    rounds = (sched.reduce_rounds, sched.num_rounds)
    cfg = _config(opts, False, descriptor={"collective": "all_gather"}, rounds=rounds)

    job = ScheduleRun(tr, full, c, sched, cfg)  # issued now

    def run() -> tuple[torch.Tensor, AllReduceStats]:
        try:
            res = job.run()
        finally:
            if owned:
                tr.close()
        return res.output, AllReduceStats.from_result(res, c, sched)

    return _launch(run, async_op)
