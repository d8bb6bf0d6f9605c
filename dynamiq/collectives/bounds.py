"""Certified bounds along a path of encodings and fp32 additions (docs/collectives.md,
"Composing the certified bound").

Every value a collective handles carries a per-element bound ``β`` on its distance from the
exact sum of the gradients it holds (``β = 0`` for a rank's own gradient). Two steps change it:

* encoding ``v`` with a codec and a context: ``β + codec.error_bound.max_abs_error(v, ctx)``
  (:func:`encoding_bound`);
* an fp32 addition ``v = fl(a + b)``: ``β_a + β_b + |v|·2^-24·(1 + 2^-20) + 2^-150``
  (:func:`addition_bound`; the last two terms are :func:`fp32_add_slack`).

These are the functions the engine composes its bounds with (:mod:`dynamiq.collectives.engine`),
so a custom collective that uses them gets the engine's bound on the same path, bit for bit.

On the wire a bound travels beside its payload as one fp64 per group of ``max(bound_block, 32)``
elements, the group's maximum (:func:`pack_bound`, :func:`unpack_bound`): the receiver keeps
what it got, so every rank ends with the same bound.
"""

from __future__ import annotations

import torch

from dynamiq.codecs import Codec, HopContext

__all__ = [
    "ADD_REL",
    "TINY",
    "addition_bound",
    "encoding_bound",
    "fp32_add_slack",
]

#: ``|fl(a + b) - (a + b)| <= |fl(a + b)| · ADD_REL + TINY`` for fp32 ``a``, ``b`` (round to
#: nearest: half an ulp relative to the result, widened a little for the fp64 evaluation).
ADD_REL = 2.0**-24 * (1 + 2.0**-20)
#: The absolute part of the fp32 addition slack (half the smallest subnormal's spacing).
TINY = 2.0**-150


def fp32_add_slack(total: torch.Tensor) -> torch.Tensor:
    """The rounding error an fp32 addition that gave ``total`` may have made (fp64, per
    element): ``|total| · ADD_REL + TINY``."""
    return total.double().abs() * ADD_REL + TINY


def addition_bound(total: torch.Tensor, *held: torch.Tensor | float) -> torch.Tensor:
    """Bound of ``total = fl(a + b)`` (an fp32 addition of values whose bounds are ``held``):
    the sum of the ``held`` bounds, in order, plus :func:`fp32_add_slack` (fp64, per
    element).

    ``held`` are fp64 per-element bounds, or ``0.0`` for an exact addend (a rank's own
    gradient). Summing ``k`` values takes ``k - 1`` additions: compose one per addition."""
    if not held:
        raise ValueError("addition_bound needs the bound of at least one addend")
    acc: torch.Tensor | float = held[0]
    for b in held[1:]:
        acc = acc + b
    return acc + fp32_add_slack(total)


def encoding_bound(
    codec: Codec, value: torch.Tensor, ctx: HopContext, held: torch.Tensor | None = None
) -> torch.Tensor:
    """Bound of ``decode(encode(value, ctx), ctx)``: the bound ``held`` of ``value`` (0 when
    omitted: a rank's own gradient) plus the codec's certified encoding error for ``value``
    under ``ctx`` (fp64, per element). ``ctx`` must be the context the encoding used: with its
    global ``offset`` and the ``shared`` result of the codec's prologue."""
    err = codec.error_bound.max_abs_error(value, ctx)
    return err if held is None else held + err


# -- the bound on the wire ---------------------------------------------------------------------


def group_size(codec: Codec) -> int:
    """Elements per fp64 of a bound on the wire (a NaN/Inf spoils the bounds of its
    ``bound_block`` only)."""
    return max(codec.bound_block, 32)


def num_groups(numel: int, codec: Codec) -> int:
    """fp64 values of the wire bound of ``numel`` elements."""
    return -(-numel // group_size(codec))


def pack_bound(bound: torch.Tensor, group: int) -> torch.Tensor:
    """One fp64 per ``group`` elements: the group's largest bound."""
    n = bound.numel()
    ng = -(-n // group)
    padded = torch.zeros(ng * group, dtype=torch.float64, device=bound.device)
    padded[:n] = bound
    return padded.view(ng, group).amax(dim=1) if ng else padded[:0]


def unpack_bound(groups: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """The per-element bound of ``n`` elements a packed bound stands for."""
    return groups.repeat_interleave(group)[:n]
