""":func:`~dynamiq.collectives.allreduce` (and the halves, below) inside ``torch.compile``:
one ``torch.library`` op.

The engine is host-driven (byte buffers, ``.item()``, clocks, threads), so dynamo cannot trace
it; instead, while dynamo traces :func:`~dynamiq.collectives.allreduce`, the call becomes one
op of the graph,

* ``dynamiq::allreduce_(Tensor(a!) tensor, Tensor(b!)? residual, str call) -> ()``

which mutates ``tensor`` (and the error-feedback ``residual``) in place, like the eager call,
and runs the eager call when the graph runs: the same bytes, bit for bit. What is not a tensor
(the codec, the schedule, the process group or transport, the options) is fixed when dynamo
traces the call: :func:`_call_key` runs then, checks the configuration (a bad one raises
while compiling, not in the middle of the graph), remembers it under a key of this process,
and the graph holds the key (a string). Dynamo guards on what the key was made from (a codec
or a transport object by identity, a process group by recompiling for another), so a graph
never runs a call it was not traced for. A process group is remembered by its name and looked
up when the graph runs.

Inside ``torch.compile`` the call returns ``None`` (the graph has no way to return the
:class:`~dynamiq.collectives.AllReduceStats`); ``async_op=True`` is refused there. The op is
marked as having side effects, so no compiler drops it, and every rank compiles the same
program, so the ranks issue their collectives in the same order.

:func:`~dynamiq.collectives.reduce_scatter` and :func:`~dynamiq.collectives.all_gather` are

* ``dynamiq::reduce_scatter_(Tensor tensor, Tensor(a!) out, Tensor(b!)? residual, str call)
  -> ()`` (``out``: the shard's values) and ``dynamiq::all_gather_(Tensor values, Tensor(a!)
  out, str call) -> ()`` (``out``: the gathered buffer),

the same way, for a size that is static while dynamo traces: the ``Shard``'s ranges follow
from the size, so :func:`_half_key` takes it and returns them with the key, and the graph
allocates ``out`` (ops that only mutate, as ``allreduce_``: inductor takes them; the Shard's
and all_gather's stats are ``None``). A size dynamo has made symbolic cannot be an argument of a
constant result: dynamo then breaks the graph at the key and runs it eagerly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .options import CollectiveOptions, merge_options
from .transport import initialized_dist

__all__: list[str] = []

_LIB = torch.library.Library("dynamiq", "FRAGMENT")
_LIB.define("allreduce_(Tensor(a!) tensor, Tensor(b!)? residual, str call) -> ()")
_LIB.define("reduce_scatter_(Tensor tensor, Tensor(a!) out, Tensor(b!)? residual, str call) -> ()")
_LIB.define("all_gather_(Tensor values, Tensor(a!) out, str call) -> ()")


@dataclass(frozen=True)
class _Call:
    """One traced call's configuration: everything but the tensors."""

    codec: Any
    schedule: Any
    group_name: str | None
    transport: Any
    options: CollectiveOptions | None
    keywords: dict[str, Any]
    #: reduce_scatter / all_gather: the buffer's size, this rank's ranges, ``chunk_bounds``
    numel: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    chunk_bounds: Any = None


_CALLS: dict[str, _Call] = {}
_LOCK = threading.Lock()


def _group_name(group: Any) -> str | None:
    """The name a process group is found by when the graph runs (``None``: the default)."""
    if group is None:
        return None
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None (got {type(group).__name__})"
        )
    return name


def _remember(
    collective: str,
    config: tuple[Any, ...],
    numel: int = 0,
    chunk_bounds: Any = None,
    ranges: Any = None,
) -> tuple[str, tuple[tuple[int, int], ...]]:
    """Check a traced call's configuration (``config``: :func:`_call_key`'s arguments) and
    remember it under a new key; for the halves, this rank's ranges of ``numel`` values
    (given ``ranges``, all_gather's shard, must be those)."""
    codec, schedule, group, options, async_op, transport, keywords = config
    if async_op:
        raise ValueError(
            f"{collective}(async_op=True) cannot run inside torch.compile: the graph's op "
            "returns when the collective is done (call it synchronously, or outside the "
            "compiled region)"
        )
    opts = merge_options(collective, options, codec=codec, schedule=schedule, **keywords)
    from .api import _bounds_by_chunk, _owned_ranges, _resolve

    group = getattr(group, "real_obj", group)  # dynamo hands a wrapper of the traced group
    if transport is not None:
        world, rank = transport.world_size, transport.rank
    else:
        dist = initialized_dist()
        world, rank = int(dist.get_world_size(group)), int(dist.get_rank(group))
    # the codec and the schedule: a bad one raises now
    c, sched = _resolve(opts, world, numel, 0)
    mine: tuple[tuple[int, int], ...] = ()
    if collective != "allreduce":
        per_chunk = None if chunk_bounds is None else _bounds_by_chunk(sched, chunk_bounds)
        mine = tuple(_owned_ranges(sched, c, numel, opts.sub_chunk, rank, per_chunk)[1])
        if ranges is not None and tuple(map(tuple, ranges)) != mine:
            raise ValueError(
                f"shard ranges {list(ranges)} are not the ranges rank {rank} owns under this "
                f"codec, schedule and sub_chunk: {list(mine)}"
            )
    call = _Call(
        codec,
        schedule,
        _group_name(group),
        transport,
        options,
        dict(keywords),
        numel,
        mine,
        chunk_bounds,
    )
    with _LOCK:
        key = f"{collective}#{len(_CALLS)}"
        _CALLS[key] = call
    return key, mine


def _call_key(
    codec: Any,
    schedule: Any,
    group: Any,
    options: CollectiveOptions | None,
    async_op: bool,
    transport: Any,
    keywords: dict[str, Any],
) -> str:
    """Check a traced allreduce's configuration and remember it: the key the graph holds."""
    config = (codec, schedule, group, options, async_op, transport, keywords)
    return _remember("allreduce", config)[0]


def _half_key(
    collective: str, numel: int, chunk_bounds: Any, ranges: Any, *config: Any
) -> tuple[str, tuple[tuple[int, int], ...]]:
    """:func:`_call_key` for ``reduce_scatter`` and ``all_gather``: the key and this rank's
    ranges of the buffer's ``numel`` values (a size dynamo has made symbolic cannot be
    one: then dynamo breaks the graph there and the call runs eagerly)."""
    return _remember(collective, config, numel, chunk_bounds, ranges)


# dynamo runs it while tracing and puts its result in the graph as a constant (what
# torch.compiler.assume_constant_result marks, without importing dynamo here)
_call_key._dynamo_marked_constant = True  # type: ignore[attr-defined]
_half_key._dynamo_marked_constant = True  # type: ignore[attr-defined]


def allreduce(tensor: torch.Tensor, residual: torch.Tensor | None, *config: Any) -> None:
    """What :func:`~dynamiq.collectives.allreduce` is while dynamo traces it (``config``:
    :func:`_call_key`'s arguments)."""
    key = _call_key(*config)
    torch.ops.dynamiq.allreduce_.default(tensor, residual, key)


def reduce_scatter(
    tensor: torch.Tensor, residual: torch.Tensor | None, chunk_bounds: Any, *config: Any
) -> Any:
    """What :func:`~dynamiq.collectives.reduce_scatter` is while dynamo traces it: the op
    gives the shard's values; its ranges are fixed by the size (no stats)."""
    from .api import Shard

    numel = tensor.numel()
    key, ranges = _half_key("reduce_scatter", numel, chunk_bounds, None, *config)
    values = tensor.new_empty(sum(b - a for a, b in ranges), dtype=torch.float32)
    torch.ops.dynamiq.reduce_scatter_.default(tensor, values, residual, key)
    return Shard(values, list(ranges), numel, None)


def all_gather(shard: Any, *config: Any) -> tuple[torch.Tensor, None]:
    """What :func:`~dynamiq.collectives.all_gather` is while dynamo traces it (no stats)."""
    key, _ = _half_key("all_gather", shard.numel, None, shard.ranges, *config)
    out = shard.values.new_empty(shard.numel, dtype=torch.float32)
    torch.ops.dynamiq.all_gather_.default(shard.values, out, key)
    return out, None


def _traced(call: str, op: str) -> tuple[_Call, Any]:
    """The remembered call ``call`` and its process group (``None``: the default)."""
    got = _CALLS.get(call)
    if got is None:
        raise RuntimeError(
            f"dynamiq::{op} was given the call {call!r}, which this process never traced: "
            "a graph holding dynamiq's collectives runs only in the process that compiled it"
        )
    group = None
    if got.group_name is not None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(got.group_name)  # type: ignore[arg-type]  # a str
    return got, group


def _eager_call(got: _Call, group: Any, fn: Any, first: Any, **extra: Any) -> Any:
    """``fn`` (the eager collective) on ``first`` with the remembered configuration."""
    return fn(
        first,
        got.codec,
        got.schedule,
        group,
        options=got.options,
        transport=got.transport,
        **extra,
        **got.keywords,
    )


def _allreduce_impl(tensor: torch.Tensor, residual: torch.Tensor | None, call: str) -> None:
    from .api import allreduce

    _eager_call(*_traced(call, "allreduce_"), allreduce, tensor, residual=residual)


def _allreduce_fake(tensor: torch.Tensor, residual: torch.Tensor | None, call: str) -> None:
    return None


def _reduce_scatter_impl(
    tensor: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, call: str
) -> None:
    from .api import reduce_scatter

    got, group = _traced(call, "reduce_scatter_")
    bounds = got.chunk_bounds
    shard = _eager_call(got, group, reduce_scatter, tensor, chunk_bounds=bounds, residual=residual)
    out.copy_(shard.values)


def _reduce_scatter_fake(
    tensor: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, call: str
) -> None:
    return None


def _all_gather_impl(values: torch.Tensor, out: torch.Tensor, call: str) -> None:
    from .api import Shard, all_gather

    got, group = _traced(call, "all_gather_")
    full, _ = _eager_call(got, group, all_gather, Shard(values, list(got.ranges), got.numel))
    out.copy_(full)


def _all_gather_fake(values: torch.Tensor, out: torch.Tensor, call: str) -> None:
    return None


_LIB.impl("allreduce_", _allreduce_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamiq::allreduce_", _allreduce_fake, lib=_LIB)
_LIB.impl("reduce_scatter_", _reduce_scatter_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamiq::reduce_scatter_", _reduce_scatter_fake, lib=_LIB)
_LIB.impl("all_gather_", _all_gather_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamiq::all_gather_", _all_gather_fake, lib=_LIB)
for _op in ("allreduce_", "reduce_scatter_", "all_gather_"):
    torch.fx.node.has_side_effect(getattr(torch.ops.dynamiq, _op).default)
