"""THC's wire format as a kernel reads it (:meth:`ThcCodec.wire`).

The layout of a payload (blocks, segments sharing one scale), the agreed or local segment
ranges, the divisor of a value holding ``k`` gradients and the rotation's hash keys: public,
so that a kernel never reads the codec's internals. What each means is docs/formats.md's
"thc"; the reference (:mod:`dynamiq.codecs.thc`) computes with the same functions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import HopContext

if TYPE_CHECKING:
    from .thc import ThcCodec, ThcLayout, ThcSegments

__all__ = ["ThcWire"]


@dataclass(frozen=True, eq=False)
class ThcWire:
    """The wire description of one THC configuration (one per configuration:
    :meth:`ThcCodec.wire`). ``rotation_keys``: the counter-hash keys of the rotation's signs
    (:func:`~dynamiq.codecs.thc.rotation_keys`, which the reference's rotation uses)."""

    codec: ThcCodec
    rotation_keys: tuple[int, int]

    def check_contributions(self, k: int) -> None:
        """``ValueError`` where ``k`` contributions would make the integer sums inexact."""
        self.codec._check_contributions(k)

    def layout(self, numel: int) -> ThcLayout:
        """The blocks of ``numel`` values (full blocks, then a tail at a power-of-two size)."""
        return self.codec._layout(numel)

    def nsegments(self, lay: ThcLayout, offset: int) -> int:
        """Segment scales the payload of ``lay`` at global ``offset`` carries."""
        return self.codec._nsegments(lay, offset)

    def segments(self, lay: ThcLayout, offset: int, device: torch.device) -> ThcSegments:
        """Each block's segment, the first segment's global index, the count."""
        return self.codec._segments(lay, offset, device)

    def agreed_scales(
        self, ctx: HopContext, segs: ThcSegments, device: torch.device
    ) -> torch.Tensor | None:
        """The segments' scales ``S`` the prologue agreed on (``ctx.shared``; fp64 of fp32
        values), ``None`` without them; ``TypeError``/``ValueError`` for malformed ones."""
        return self.codec._agreed(ctx, segs, device)

    def clip_ranges(self, scales: torch.Tensor) -> torch.Tensor:
        """``R = fl32(T · S)`` per segment, saturated (fp64 of fp32 values)."""
        return self.codec._clip_ranges(scales)

    def ranges(
        self, ctx: HopContext, rotated: torch.Tensor, finite: torch.Tensor, lay: ThcLayout
    ) -> torch.Tensor:
        """The segments' ranges, agreed or from the local statistic of the ``rotated``
        coordinates over the ``finite`` blocks (what a first encode pass computes)."""
        return self.codec._ranges(ctx, rotated, finite, lay)[0]

    def divisor(self, ranges: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        """``(R_div, c)`` of a value holding ``k`` gradients (per segment)."""
        return self.codec._divisor(ranges, k)


@functools.lru_cache(maxsize=64)
def wire_of(codec: ThcCodec) -> ThcWire:
    from .thc import rotation_keys

    return ThcWire(codec=codec, rotation_keys=rotation_keys(codec.rotation_seed))
