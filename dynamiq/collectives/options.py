"""One frozen object for what every collective call is configured with (docs/collectives.md).

:class:`CollectiveOptions` is shared by :func:`~dynamiq.collectives.allreduce`,
:func:`~dynamiq.collectives.reduce_scatter`, :func:`~dynamiq.collectives.all_gather`,
:func:`~dynamiq.collectives.simulate_allreduce` and :class:`dynamiq.ddp.DynamiqState`. Each
takes ``options=`` and/or the same fields as keywords (:class:`OptionKeywords`); a keyword
given (not ``None``) replaces the field of ``options``::

    opts = CollectiveOptions(codec="mxfp8_e4m3", schedule="butterfly", timeout=60)
    allreduce(grad, options=opts, step=i)          # the same as every keyword spelled out

Fields left ``None`` take the calling function's default (documented there): ``codec``
(``"fp32"``; ``DynamiqState``: ``"mxfp8_e4m3"``), ``threshold`` (:data:`DEFAULT_THRESHOLD`;
``simulate_allreduce``, ``reduce_scatter``, ``all_gather``: 0) and ``return_bound``
(``False``; ``simulate_allreduce``: ``True``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from dynamiq.codecs import Codec, get_codec

from .schedules import Schedule, ScheduleError, list_schedules

__all__ = [
    "DEFAULT_THRESHOLD",
    "DEFAULT_VERIFY",
    "CollectiveOptions",
    "OptionKeywords",
    "merge_options",
]

#: Buffers with fewer elements than this go uncompressed (fp32) by default.
DEFAULT_THRESHOLD = 1024
#: Whether collectives check every message (``verify``) unless told otherwise (docs/benchmarks.md,
#: "Message integrity": its measured cost decides).
DEFAULT_VERIFY = False
_OPS = ("sum", "avg")


def op_name(op: Any) -> str:
    """``"sum"``/``"avg"`` from a string (any case) or ``torch.distributed.ReduceOp``."""
    name = op.lower() if isinstance(op, str) else str(op).rsplit(".", 1)[-1].lower()
    if name not in _OPS:
        raise ValueError(f"op must be one of 'sum', 'avg' or ReduceOp.SUM/AVG (got {op!r})")
    return name


@dataclass(frozen=True, kw_only=True)
class CollectiveOptions:
    """The configuration of a collective call; checked when made.

    Attributes:
        codec: a codec id (``"mxfp8_e4m3"``), a config dict or a :class:`~dynamiq.codecs.Codec`.
        schedule: ``"ring"``, ``"butterfly"``, ``"tree"``, ``"hierarchical"`` or a
            :class:`~dynamiq.collectives.Schedule`.
        schedule_options: keyword options of the schedule (e.g. ``ranks_per_node``).
        seed: seed of stochastic rounding and dithering (mixed with ``step`` and offsets).
        step: the training step (changes the dither from call to call).
        op: ``"sum"`` or ``"avg"`` (or ``torch.distributed.ReduceOp.SUM/AVG``); stored as
            the string.
        sub_chunk: elements per sub-chunk (rounded to the codecs' block sizes); the result
            does not depend on it, only the overlap of transfers and computation does.
        threshold: buffers with fewer elements go uncompressed (fp32).
        timeout: seconds to wait for a peer before raising ``PeerTimeoutError``.
        return_bound: compute the certified per-element bound of the result.
        verify: a checksum on every message over its bytes and identity, and the
            end-of-collective status exchange, so a corrupted, misrouted or reordered
            message raises ``IntegrityError`` on every rank (docs/reliability.md,
            "Integrity"); ``None``: the calling function's default, :data:`DEFAULT_VERIFY`.
    """

    codec: Codec | str | Mapping[str, Any] | None = None
    schedule: str | Schedule = "ring"
    schedule_options: Mapping[str, Any] | None = None
    seed: int = 0
    step: int = 0
    op: Any = "sum"
    sub_chunk: int = 1 << 18
    threshold: int | None = None
    timeout: float = 300.0
    return_bound: bool | None = None
    verify: bool | None = None

    def __post_init__(self) -> None:
        if self.codec is not None:
            get_codec(self.codec)  # an unknown id or a malformed config fails here
        if isinstance(self.schedule, str) and self.schedule not in list_schedules():
            known = ", ".join(list_schedules())
            raise ScheduleError(f"unknown schedule {self.schedule!r} (known: {known})")
        if not isinstance(self.schedule, (str, Schedule)):
            raise TypeError(
                f"schedule must be a name or a Schedule (got {type(self.schedule).__name__})"
            )
        object.__setattr__(self, "op", op_name(self.op))
        for name in ("seed", "step", "sub_chunk", "threshold"):
            value = getattr(self, name)
            if value is not None:
                minimum = {"sub_chunk": 1, "threshold": 0}.get(name)
                object.__setattr__(self, name, _check_int(name, value, minimum))
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds (got {self.timeout!r})")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds (got {self.timeout})")
        if self.schedule_options is not None and not isinstance(self.schedule_options, Mapping):
            raise TypeError(f"schedule_options must be a mapping (got {self.schedule_options!r})")
        if self.return_bound is not None and not isinstance(self.return_bound, bool):
            raise TypeError(f"return_bound must be True or False (got {self.return_bound!r})")
        if self.verify is not None and not isinstance(self.verify, bool):
            raise TypeError(f"verify must be True or False (got {self.verify!r})")

    def replace(self, **changes: Any) -> CollectiveOptions:
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value: Any, minimum: int | None) -> int:
    """``value`` as an int (anything with ``__index__``: NumPy integers too, not bools)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int (got {value!r})")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum} (got {value})")
    return value


class SeedlessKeywords(TypedDict, total=False):
    """:class:`OptionKeywords` but ``seed`` (a positional parameter of
    ``simulate_allreduce``)."""

    schedule_options: Mapping[str, Any] | None
    step: int | None
    op: Any
    sub_chunk: int | None
    threshold: int | None
    timeout: float | None
    return_bound: bool | None
    verify: bool | None


class OptionKeywords(SeedlessKeywords, total=False):
    """The fields of :class:`CollectiveOptions` that the collective functions also take as
    keywords (``codec`` and ``schedule`` are their positional parameters)."""

    seed: int | None


_FIELDS = frozenset(f.name for f in dataclasses.fields(CollectiveOptions))


def merge_options(where: str, options: CollectiveOptions | None, **given: Any) -> CollectiveOptions:
    """``options`` (default: all defaults) with every keyword of ``given`` that is not
    ``None``; an unknown keyword raises ``TypeError`` naming ``where`` (the function)."""
    unknown = sorted(set(given) - _FIELDS)
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(unknown)}")
    if options is not None and not isinstance(options, CollectiveOptions):
        raise TypeError(f"{where}(): options must be a CollectiveOptions (got {options!r})")
    changes = {k: v for k, v in given.items() if v is not None}
    base = options if options is not None else CollectiveOptions()
    return dataclasses.replace(base, **changes) if changes else base
