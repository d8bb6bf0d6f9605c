""":func:`~dynamiq.collectives.allreduce` inside ``torch.compile``: one ``torch.library`` op.

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


@dataclass(frozen=True)
class _Call:
    """One traced call's configuration: everything but the tensors."""

    codec: Any
    schedule: Any
    group_name: str | None
    transport: Any
    options: CollectiveOptions | None
    keywords: dict[str, Any]


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


def _call_key(
    codec: Any,
    schedule: Any,
    group: Any,
    options: CollectiveOptions | None,
    async_op: bool,
    transport: Any,
    keywords: dict[str, Any],
) -> str:
    """Check a traced call's configuration and remember it: the key the graph holds."""
    if async_op:
        raise ValueError(
            "allreduce(async_op=True) cannot run inside torch.compile: the graph's op returns "
            "when the sum is done (call it synchronously, or outside the compiled region)"
        )
    opts = merge_options("allreduce", options, codec=codec, schedule=schedule, **keywords)
    from .api import _resolve

    group = getattr(group, "real_obj", group)  # dynamo hands a wrapper of the traced group
    if transport is not None:
        world = transport.world_size
    else:
        world = int(initialized_dist().get_world_size(group))
    _resolve(opts, world, 0, 0)  # the codec and the schedule: a bad one raises now
    call = _Call(codec, schedule, _group_name(group), transport, options, dict(keywords))
    with _LOCK:
        key = f"allreduce#{len(_CALLS)}"
        _CALLS[key] = call
    return key


# dynamo runs it while tracing and puts its result in the graph as a constant (what
# torch.compiler.assume_constant_result marks, without importing dynamo here)
_call_key._dynamo_marked_constant = True  # type: ignore[attr-defined]


def allreduce(tensor: torch.Tensor, residual: torch.Tensor | None, *config: Any) -> None:
    """What :func:`~dynamiq.collectives.allreduce` is while dynamo traces it (``config``:
    :func:`_call_key`'s arguments)."""
    key = _call_key(*config)
    torch.ops.dynamiq.allreduce_.default(tensor, residual, key)


def _allreduce_impl(tensor: torch.Tensor, residual: torch.Tensor | None, call: str) -> None:
    got = _CALLS.get(call)
    if got is None:
        raise RuntimeError(
            f"dynamiq::allreduce_ was given the call {call!r}, which this process never traced: "
            "a graph holding dynamiq's collectives runs only in the process that compiled it"
        )
    from .api import allreduce as eager

    group = None
    if got.group_name is not None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(got.group_name)  # type: ignore[arg-type]  # a str
    eager(
        tensor,
        got.codec,
        got.schedule,
        group,
        options=got.options,
        transport=got.transport,
        residual=residual,
        **got.keywords,
    )


def _allreduce_fake(tensor: torch.Tensor, residual: torch.Tensor | None, call: str) -> None:
    return None


_LIB.impl("allreduce_", _allreduce_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamiq::allreduce_", _allreduce_fake, lib=_LIB)
torch.fx.node.has_side_effect(torch.ops.dynamiq.allreduce_.default)
