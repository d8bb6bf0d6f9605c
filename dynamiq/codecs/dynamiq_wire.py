"""DynamiQ's wire format as a kernel reads it (:meth:`DynamiqCodec.wire`).

Every number a kernel needs to write or read DynamiQ's bytes, public, so that a kernel (the
built-in Triton and native ones, or a plugin's) never reads the codec's internals: the level
and rounding tables, the width priorities, the group-scale steps, and per call the spans'
budgets and payload offsets (uniform, or pooled by the prologue's result in ``ctx.shared``).
What each means is docs/formats.md's "dynamiq"; the reference
(:mod:`dynamiq.codecs.dynamiq_codec`) computes with the same objects, so a kernel that reads
them agrees with it by construction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _dynamiq_pool as _pool
from .base import HopContext

if TYPE_CHECKING:
    from .dynamiq_codec import DynamiqCodec, RoundingTables

__all__ = ["DynamiqWire"]


@dataclass(frozen=True, eq=False)
class DynamiqWire:
    """The wire description of one DynamiQ configuration (built once per configuration:
    :meth:`DynamiqCodec.wire`).

    Static, per configuration:

    - ``tables``: the level and rounding-cell tables on the CPU
      (:class:`~dynamiq.codecs.dynamiq_codec.RoundingTables`);
    - ``priorities``: ``Q[w]`` for ``w = 0..7``, the integer worth of a group's bit ``w + 1``
      beside ``8 L_g`` (docs/formats.md, "the widths");
    - ``priority_counts``: ``count[i] = #{w: Q[w] >= min Q + i}`` for ``i`` in ``0 .. max Q -
      min Q + 1`` (int64): the width of a group whose next bit would be worth less;
    - ``group_steps``, ``group_powers``: for each 4-bit group code ``e``, ``2^(-(e mod k)/k)``
      and ``2^-(e div k)`` (fp32, ``k = scale_steps``): the group scale is ``fl32(S ·
      steps[e]) · powers[e]``.

    Per call: :meth:`budget`, :meth:`span_table`, :meth:`native_spans`, :meth:`memo`.
    """

    codec: DynamiqCodec
    tables: RoundingTables = field(repr=False)
    priorities: tuple[int, ...]
    priority_counts: torch.Tensor = field(repr=False)
    group_steps: torch.Tensor = field(repr=False)
    group_powers: torch.Tensor = field(repr=False)

    def levels(self, width: int) -> torch.Tensor:
        """The ``2^width`` levels of a width (fp64, ascending; stretched to ±1 under stochastic
        and correlated rounding)."""
        return self.codec._levels(width)

    def budget(self, length: int, ctx: HopContext | None) -> int:
        """The uniform budget (bits) of a span of ``length`` values at ``ctx``'s hop: what
        every span has without the prologue's result."""
        return self.codec._budget(length, ctx)

    def header_nbytes(self, length: int) -> int:
        """Bytes of a span's header (super-group scales and group codes)."""
        return sum(self.codec._header_bytes(length))

    def pooled(self, ctx: HopContext | None) -> bool:
        """Whether the spans' budgets come from the prologue's result in ``ctx.shared``."""
        return self.codec._pool_shared(ctx) is not None

    def span_table(self, numel: int, ctx: HopContext | None) -> torch.Tensor | None:
        """``[spans, 2]`` int64 on the CPU: each span's budget (bits) and its payload's byte
        offset, for ``numel`` values at ``ctx.offset`` with the prologue's result, or ``None``
        (every span has :meth:`budget`)."""
        pooled = self.codec._pooled_bytes(numel, ctx)
        if pooled is None:
            return None
        bits = pooled * 8
        return torch.stack([bits, self.codec._span_offset_tensor(numel, bits)], dim=1)

    def native_spans(self, numel: int, ctx: HopContext | None) -> tuple[int, int, int] | None:
        """The pooled spans as the native kernel takes them (the addresses of the first span's
        budget and start in tensors the prologue's result holds, and the start to subtract:
        :func:`~dynamiq.codecs._dynamiq_pool.chunk_kernel_ptrs`), or ``None`` (uniform)."""
        return self.codec._pooled_kernel_ptrs(numel, ctx)

    def memo(self, ctx: HopContext | None) -> dict[Any, Any] | None:
        """Where a kernel may memoize what depends on the prologue's result in ``ctx.shared``
        (it lives as long as that result), or ``None`` when nothing depends on it."""
        shared = self.codec._pool_shared(ctx)
        return None if shared is None else _pool.kernel_memo(shared)


@functools.lru_cache(maxsize=64)
def wire_of(codec: DynamiqCodec) -> DynamiqWire:
    from .dynamiq_codec import _priority_tables, group_scale_tables

    cpu = torch.device("cpu")
    q, counts = _priority_tables(codec.scale_steps, cpu)
    steps, powers = group_scale_tables(codec.scale_steps)
    return DynamiqWire(
        codec=codec,
        tables=codec._tables(cpu),
        priorities=tuple(int(v) for v in q.tolist()),
        priority_counts=counts,
        group_steps=steps,
        group_powers=powers,
    )
