"""THC, Tensor Homomorphic Compression (NSDI 2024), as the codec ``thc`` (docs/design.md,
"Codec sources").

Recipe, per block of ``d = block_size`` values (a power of two, default 16384; a short last
block of ``r`` values is zero-padded to the next power of two ``d_r >= r``):

1. **Rotate**: ``w = H · (D ⊙ x)`` with ``H`` the unnormalised ``d × d`` Walsh–Hadamard matrix
   (entries ±1, computed by ``log2 d`` add/subtract stages) and ``D`` a ±1 diagonal drawn from
   the counter hash of ``(rotation_seed, global index)`` (``dynamiq.codecs.hashing``). ``D``
   depends neither on the rank nor on the hop: every rank and every hop rotates a given index
   identically, so rotated values add up across ranks. ``D``'s seed is part of the codec's
   config rather than ``ctx.seed``: the engine's ``prologue(x, comm)`` hook gets no context,
   and the agreed scale must be measured under the very rotation the encoder applies. (The
   classical ``1/√d`` normalisation is folded into the scale; decoding divides by ``d``, an
   exact power of two.)
2. **Scale**: the buffer is cut into *segments* of ``scale_blocks`` consecutive blocks, counted
   from global index 0 (``scale_blocks = 0``: one segment, the whole buffer). Every rank
   agrees on one scale ``S`` per segment in the codec's ``prologue``, by an all-gather of one
   fp32 per segment and rank (the engine counts those bytes), then the maximum over ranks of

   * ``scale="norm"`` (THC's recipe, the default): the RMS of the segment's rotated
     coordinates ``sqrt(Σ w_j² / n)`` (``n`` the segment's transform coordinates, padding
     included; computed in fp64, rounded up to fp32) — THC's "max norm" ``‖x‖ · √(d/n)``;
   * ``scale="max"``: the largest ``|w_j|`` of the segment.

   The range of one contribution is ``R = fl32(T · S)`` (at most ``2^127``) with ``T = clip``:
   by default ``1`` for ``"max"`` (nothing is ever clamped: unbiased) and
   ``DEFAULT_NORM_CLIP`` (fitted on the ``fit`` split) for ``"norm"``, where THC clamps the
   rare coordinates beyond ``T`` standard deviations (biased; THC's error feedback, optional
   in dynamiq's DDP hook, absorbs it). Encoded outside a collective (``ctx.shared`` without
   ``"thc_scale"``), ``S`` is the payload's own statistic per segment divided by ``κ_k`` (the
   range growth below) and rounded up to fp32. One ``R`` per segment the payload touches
   travels in its header. With ``"max"`` and ``T = 1`` no single gradient is ever clamped
   (``unbiased``); a ``requantize`` sum is clamped only beyond ``k^growth · R`` (never with
   ``growth = 1``). (An ``all_gather`` alone runs the prologue on finished sums, so its ``S``
   is already a sum's and the range ``κ_k · R`` is wider than needed: correct, but coarser.)
3. **Map** a value holding ``k = ctx.contributions`` gradients to ``[0, c·g]`` (``g =
   table[-1]``, the fine grid's granularity): ``y = clamp(fl(fl(w / R_div) · g/2) + c·g/2, 0,
   c·g)`` (clamping ``|w|`` beyond the value's range ``κ_k · R``) with

   * ``variant="widen"``: ``R_div = R``, ``c = k`` (range ``κ_k = k``: integer sums);
   * ``variant="requantize"``: ``R_div = R_k = min(roundup32(R · ρ_k), 2^127)``, ``c = 1``,
     ``ρ_k = fl32(k^growth)`` (range ``κ_k = ρ_k``; ``growth`` 0.5 by default: a sum of ``k``
     weakly correlated gradients spreads like ``√k``, so ranges growing like ``k`` waste
     most of the 16 levels after a few hops; ``growth = 1`` never clamps a sum).

4. **Quantize** with stochastic rounding (hash dither of ``(seed, step, hop, rank, global
   index)``, unbiased) to integers:

   * one contribution (``k = 1``) and every ``requantize`` value: to the two neighbouring
     entries of ``table``, a small non-uniform set of integers ``0 = table[0] < … < table[-1]
     = g`` containing ``g/2`` (so zero is exact); the wire carries the entry's index in
     ``bits = ceil(log2 len(table))`` bits. This is stochastic rounding to the fine grid
     composed with the table map, in one step (rounding to the grid first and then to the
     table keeps the mean but adds variance). The default table (16 entries, ``g = 30``) was
     fitted by ``benchmarks/fit_thc_table.py`` (minimum stochastic-rounding variance of the
     default configuration's positions on the ``fit`` split, disjoint from the evaluation
     data);
   * ``variant="widen"``, ``k >= 2``: to the integer grid itself; the wire carries the integer
     sum in ``width(k) = ceil(log2(k·g + 1))`` bits, so the size grows along a ring but is
     fixed per hop (``encoded_nbytes`` depends on ``ctx.contributions``).

**Homomorphic reduce.** ``reduce(payload, local, ctx, out_ctx)``: ``payload`` holds the
integers ``Y`` of ``ctx.contributions = k_in`` gradients, ``local`` is this rank's raw value
holding ``m = out_ctx.contributions - k_in`` gradients; the result holds ``k_out =
out_ctx.contributions``. Without decoding the payload (no inverse rotation, no table inverse
beyond index → integer), ``local`` is rotated, mapped **without clamping**, added to the
payload's integers, and the sum is clamped to its range and rounded once with ``out_ctx``'s
dither: ``widen``: ``Y + fl(fl(w/R)·g/2) + m·g/2`` (integer adds) to the integer grid of width
``width(k_out)``; ``requantize``: ``fl((Y - g/2) · fl32(R_kin / R_kout)) + (fl(fl(w/R_kout)·
g/2) + g/2)`` to the table. Blocks where this is not possible fall back to re-encoding
``decode(payload) + local`` with ``out_ctx``: when ``out_ctx.shared`` has no agreed scale or
the payload's segment was encoded with another range, when ``m < 1``, or in a block which
holds NaN/Inf. Either way the result decodes within ``max_abs_error(decode(payload) + local,
out_ctx)`` of it. ``decode`` returns the de-rotated, de-scaled value ``x̂ = D ⊙ H · ((2Y -
c·g) · R_div/g) / d``.

**Error bound** per element of a block (``d_b`` its transform size, ``L = log2 d_b``,
``u = 2^-24``, ``γ = L·u / (1 - L·u)``, ``w`` the fp32 rotation of the encoded value ``x``,
``K = c · R_div`` the value's range)::

    |x̂ - x| <= (2 R_div/g) · mean_j G_j                 (stochastic rounding)
             + mean_j max(|w_j| - K, 0)                  (clamping)
             + γ · max(‖x_b‖_1, 2^ceil(L/2) · K) + (16u + 2γ) · K + u·|x_i| + tiny
                                                         (fp32 rotation, scaling, decoding)

with ``G_j`` the width of the table interval holding ``y_j`` (0 when ``y_j`` is a table entry)
for ``k = 1``; ``1`` (``widen``) or the table's widest gap (``requantize``) for ``k >= 2``
(these also cover the homomorphic ``reduce``, whose rounding positions the bound cannot see).
Since ``x̂ - x = D ⊙ H · (ŵ - w) / d`` and ``|H_ij| = 1``, the errors of the ``d_b``
coordinates add up in the worst case: the bound is their mean, reached when they all point
the same way (the witness builds such a block from the known dither). Typical errors are far
smaller: ``variance`` is ``(2 R_div/g)² / d_b² · Σ_j f_j(1 - f_j) G_j²`` (``f_j`` the
position in the interval; ``G²/4`` for ``k >= 2``) plus the deterministic terms.

Wire layout (little-endian): one ``R`` per segment the payload touches, as fp32 (``4 · nseg``
bytes: segments are global, so ``nseg`` depends on ``ctx.offset``; 1 when ``scale_blocks =
0``); a bitmap of the blocks holding NaN/Inf (``ceil(blocks / 8)`` bytes, block ``b`` in bit
``b % 8`` of byte ``b // 8``); the codes of the ``nfull · d + d_r`` rotated coordinates,
packed densely (``dynamiq.codecs.packing``) at ``bits`` (table indices) or ``width(k)``
(``widen``, ``k >= 2``) bits each. An empty input encodes to 0 bytes.

Non-finite input: a block holding NaN or ±Inf is flagged in the bitmap (its codes encode zero,
and it does not enter the scale) and decodes to NaN; other blocks are unaffected. Finite
inputs up to ``max_input_abs = 2^(127 - log2 block_size - max(0, ceil(log2 T)))`` are
accepted (so neither the rotation nor ``T · S`` can overflow); beyond it ``encode`` raises
``ValueError``.

Measured (``docs/benchmarks.md``, "THC as a fair baseline"): the first version agreed on one
scale, the largest rotated ``|w|`` of the whole buffer, and grew the ``requantize`` range like
``k``; on real gradients (per-layer RMS differing by 15×, outlier rows) most blocks then used a
few levels around zero and ``requantize`` compounded ``k``-fold coarser rounding at every hop
(vNMSE above 1 on rings of 8 and more). Per-segment norm scales with THC's clamp and ``√k``
range growth are this version's defaults.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .hashing import hash_keys, hash_u32, uniform_open01
from .packing import pack_bits, packed_nbytes, unpack_bits
from .registry import register_codec

if TYPE_CHECKING:
    from .thc_wire import ThcWire

__all__ = [
    "DEFAULT_GROWTH",
    "DEFAULT_NORM_CLIP",
    "DEFAULT_TABLE",
    "SHARED_KEY",
    "ThcCodec",
    "fwht",
]

#: The default table: 16 integers of the fine grid 0..30 (4-bit indices), fitted by
#: ``benchmarks/fit_thc_table.py`` on the ``fit`` split of the real gradients under the
#: default scale (``"norm"``, one segment per block of 16384, ``T = DEFAULT_NORM_CLIP``).
DEFAULT_TABLE: tuple[int, ...] = (0, 3, 6, 8, 10, 12, 14, 15, 16, 17, 18, 20, 22, 24, 27, 30)

#: ``T`` of ``scale="norm"`` when ``clip`` is not given: the clamp in standard deviations of
#: the agreed RMS, chosen on the ``fit`` split (``benchmarks/fit_thc_table.py --sweep``).
DEFAULT_NORM_CLIP = 2.25

#: ``growth`` of ``variant="requantize"`` when not given: a ``k``-sum spans ``k^0.5 · R``.
DEFAULT_GROWTH = 0.5

#: The key of the agreed scales in ``HopContext.shared`` (what :meth:`ThcCodec.prologue`
#: returns): a tuple of one fp32 value per segment of the buffer (a single number applies to
#: every segment).
SHARED_KEY = "thc_scale"

VARIANTS = ("requantize", "widen")
SCALES = ("norm", "max")
_U = 2.0**-24
_MAX_GRID = 1 << 23  # k·g below this keeps 2Y - k·g exact in fp32
_MAX_RANGE = 2.0**127  # ranges saturate here, so decoded values stay finite
_ROTATION_HOP = 0xFFFFFFFF  # no HopContext has this hop: the rotation's hash never meets a dither
#: signs of the rotation cached per (rotation_seed, device) for global indices below this
#: (int8: at most 64 MiB per seed and device)
_SIGN_CACHE_MAX = 1 << 26
_SIGN_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}
_SIGN_LOCK = threading.Lock()


def rotation_keys(seed: int) -> tuple[int, int]:
    """The counter-hash keys of the rotation's signs for ``rotation_seed``: step 0 and a hop
    no :class:`HopContext` has, so they never meet a dither's."""
    return hash_keys(seed, 0, _ROTATION_HOP, 0)


def _hash_signs(seed: int, start: int, end: int, device: torch.device) -> torch.Tensor:
    """``±1`` (fp32) of the global indices ``start .. end - 1`` from the counter hash."""
    keys = rotation_keys(seed)
    idx = torch.arange(start, end, device=device, dtype=torch.int64)
    return 1.0 - 2.0 * (hash_u32(idx, keys) >> 31).to(torch.float32)


class _Comm(Protocol):
    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform of each row of ``x`` (``[rows, d]``, ``d`` a power
    of two): ``log2 d`` stages of ``(a, b) -> (a + b, a - b)``, in the same order for any number
    of rows.

    >>> fwht(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])).tolist()
    [[1.0, 1.0, 1.0, 1.0], [10.0, -2.0, -4.0, 0.0]]
    """
    rows, d = x.shape
    x = x.contiguous()
    # two buffers used in turn (the input is never written): each stage writes a + b and
    # a - b straight into place, no stacked temporaries
    bufs = (torch.empty_like(x), torch.empty_like(x)) if d > 2 else (torch.empty_like(x),)
    h, stage = 1, 0
    while h < d:
        v = x.view(rows, d // (2 * h), 2, h)
        out = bufs[stage % len(bufs)]
        o = out.view(rows, d // (2 * h), 2, h)
        torch.add(v[:, :, 0, :], v[:, :, 1, :], out=o[:, :, 0, :])
        torch.sub(v[:, :, 0, :], v[:, :, 1, :], out=o[:, :, 1, :])
        x = out
        h, stage = 2 * h, stage + 1
    return x


@dataclass(frozen=True)
class ThcLayout:
    """Blocks of ``numel`` values: ``nfull`` full ones of ``d``, then a tail of ``tail`` values
    transformed at size ``tail_d`` (the next power of two; 0 when there is no tail)."""

    numel: int
    d: int

    @property
    def nfull(self) -> int:
        return self.numel // self.d

    @property
    def tail(self) -> int:
        return self.numel % self.d

    @property
    def tail_d(self) -> int:
        return 1 << (self.tail - 1).bit_length() if self.tail else 0

    @property
    def nblocks(self) -> int:
        return self.nfull + (self.tail > 0)

    @property
    def ncodes(self) -> int:
        return self.nfull * self.d + self.tail_d

    def sizes(self) -> list[int]:
        """Transform size of each block."""
        return [self.d] * self.nfull + ([self.tail_d] if self.tail else [])

    def block_stat(
        self, v: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn`` of the ``[rows, size]`` view of the blocks of coordinates ``v`` (a row
        reduction, or a row transform), flattened."""
        head = self.nfull * self.d
        parts = [fn(v[:head].reshape(self.nfull, self.d)).reshape(-1)] if self.nfull else []
        if self.tail:
            parts.append(fn(v[head:].reshape(1, self.tail_d)).reshape(-1))
        return torch.cat(parts) if parts else v.new_zeros(0)

    def per_coord(self, per_block: torch.Tensor) -> torch.Tensor:
        """A per-block value at each of the block's ``sizes()`` coordinates."""
        head = per_block[: self.nfull, None].expand(self.nfull, self.d).reshape(-1)
        if not self.tail:
            return head
        return torch.cat([head, per_block[self.nfull :].expand(self.tail_d)])

    def per_elem(self, per_block: torch.Tensor) -> torch.Tensor:
        """A per-block value at each of the block's elements (the first ``numel``)."""
        return per_block[:, None].expand(self.nblocks, self.d).reshape(-1)[: self.numel]

    def nonfinite_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Which blocks of ``x`` (``numel`` values) hold NaN or ±Inf."""
        bad = torch.zeros(self.nblocks * self.d, dtype=torch.bool, device=x.device)
        bad[: self.numel] = ~torch.isfinite(x)
        return bad.view(self.nblocks, self.d).any(dim=1)


@dataclass(frozen=True)
class ThcSegments:
    """The segments (groups of blocks sharing one scale) of a payload: ``of_block`` the local
    segment of each block (int64), ``first`` the global index of segment 0, ``count``."""

    of_block: torch.Tensor
    first: int
    count: int


def _roundup_f32(v: torch.Tensor) -> torch.Tensor:
    """The smallest fp32 values >= ``v`` (fp64, >= 0, finite), as fp64."""
    f = v.float()
    f = torch.where(f.double() < v, torch.nextafter(f, torch.full_like(f, math.inf)), f)
    return f.double()


def _fl32(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp64) rounded to the nearest fp32, as fp64."""
    return v.float().double()


def _checked_table(table: Any) -> tuple[int, ...]:
    """``table`` as a tuple, checked: ints from 0 to an even ``g <= 4096``, strictly
    increasing, holding ``g / 2``."""
    if not isinstance(table, (tuple, list)):
        raise TypeError(f"table must be a sequence of ints (got {type(table).__name__})")
    for v in table:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"table must hold ints (got {v!r})")
    table = tuple(table)
    if not 3 <= len(table) <= 256:
        raise ValueError(f"table must have 3..256 entries (got {len(table)})")
    if any(b <= a for a, b in itertools.pairwise(table)):
        raise ValueError(f"table must be strictly increasing (got {table})")
    g = table[-1]
    if table[0] != 0 or g % 2 or g > 4096:
        raise ValueError(f"table must run from 0 to an even g <= 4096 (got {table[0]} .. {g})")
    if g // 2 not in table:
        raise ValueError(f"table must contain g/2 = {g // 2}, so that zero is exact")
    return table


def _checked_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or None (got {type(value).__name__})")
    return float(value)


@register_codec
@dataclass(frozen=True, kw_only=True)
class ThcCodec(Codec):
    """THC: randomized Hadamard rotation, agreed scales, stochastic rounding to a small integer
    table; partial sums aggregate by adding integers (``homomorphic``).

    Config: ``variant`` (``"requantize"``: fixed width, the sum re-quantized to the table at
    every hop; ``"widen"``: integer sums, ``ceil(log2(k·g + 1))`` bits after ``k``
    contributions), ``table`` (sorted integers ``0 .. g`` containing ``g/2``, at most 256),
    ``block_size`` (rotation size, a power of two), ``scale`` (``"norm"``: the agreed RMS of
    the rotated coordinates, THC's max norm; ``"max"``: the agreed largest ``|w|``),
    ``scale_blocks`` (blocks per agreed scale; 0: one scale for the whole buffer), ``clip``
    (``T``: the range of one contribution in units of the agreed scale; ``None``: 1 for
    ``"max"``, in ``(0, 1]``, and :data:`DEFAULT_NORM_CLIP` for ``"norm"``), ``growth``
    (``requantize`` only: a ``k``-sum spans ``k^growth`` ranges; ``None``:
    :data:`DEFAULT_GROWTH`) and ``rotation_seed`` (the seed of the ±1 diagonal, shared by all
    ranks). The formulas are in the module docstring and ``docs/codecs.md``.

    >>> codec = ThcCodec(block_size=1024)
    >>> x = torch.linspace(-1, 1, 2048)
    >>> payload = codec.encode(x)  # R (4 bytes) per block, NaN bitmap (1), 2048 4-bit codes
    >>> payload.numel(), codec.encoded_nbytes(2048, HopContext(contributions=8))
    (1033, 1033)
    >>> ThcCodec(block_size=1024, variant="widen").encoded_nbytes(2048, HopContext(contributions=8))
    2057
    >>> err = (codec.decode(payload, 2048) - x).abs()
    >>> bool((err <= codec.error_bound.max_abs_error(x)).all())
    True
    """

    codec_id: ClassVar[str] = "thc"
    kernel_family: ClassVar[str | None] = "thc"  # dynamiq/kernels/_declared.py
    homomorphic: ClassVar[bool] = True
    nonfinite: ClassVar[str] = (
        "A block holding NaN or ±Inf is flagged in the payload's bitmap and decodes to NaN; it "
        "does not enter the scale, so other blocks are unaffected."
    )

    variant: str = "requantize"
    table: tuple[int, ...] = DEFAULT_TABLE
    block_size: int = 16384
    scale: str = "norm"
    scale_blocks: int = 1
    clip: float | None = None
    growth: float | None = None
    rotation_seed: int = 0

    def __post_init__(self) -> None:
        check_choice("variant", self.variant, VARIANTS)
        object.__setattr__(self, "table", _checked_table(self.table))
        check_int("block_size", self.block_size, 1, 1 << 16)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (got {self.block_size})")
        check_choice("scale", self.scale, SCALES)
        check_int("scale_blocks", self.scale_blocks, 0, 1 << 30)
        if self.clip is not None:
            hi = 1.0 if self.scale == "max" else 65536.0
            clip = _checked_float("clip", self.clip)
            if not 0.0 < clip <= hi:
                raise ValueError(
                    f"clip must be in (0, {hi:g}] with scale={self.scale!r} (got {self.clip})"
                )
            object.__setattr__(self, "clip", clip)
        if self.growth is not None:
            growth = _checked_float("growth", self.growth)
            if not 0.0 <= growth <= 1.0:
                raise ValueError(f"growth must be in [0, 1] (got {self.growth})")
            if self.variant == "widen" and growth != 1.0:
                raise ValueError(
                    "growth applies to variant='requantize' only: widen's integer sums span "
                    f"k·R (got growth={self.growth})"
                )
            object.__setattr__(self, "growth", growth)
        check_int("rotation_seed", self.rotation_seed, 0, 2**63 - 1)

    # -- geometry ---------------------------------------------------------------------------

    @property
    def g(self) -> int:
        """Granularity of the fine grid: the largest table entry."""
        return self.table[-1]

    @property
    def bits(self) -> int:
        """Width of a table index."""
        return max(1, (len(self.table) - 1).bit_length())

    @property
    def effective_clip(self) -> float:
        """``T``: ``clip``, or its default for ``scale``."""
        if self.clip is not None:
            return self.clip
        return 1.0 if self.scale == "max" else DEFAULT_NORM_CLIP

    @property
    def effective_growth(self) -> float:
        """The exponent of a sum's range: 1 for ``widen``; ``growth`` (or its default)."""
        if self.variant == "widen":
            return 1.0
        return DEFAULT_GROWTH if self.growth is None else self.growth

    @property
    def max_input_abs(self) -> float:
        t_exp = max(0, math.ceil(math.log2(self.effective_clip)))
        return 2.0 ** (127 - (self.block_size.bit_length() - 1) - t_exp)

    def width(self, contributions: int = 1) -> int:
        """Bits per code of a payload holding ``contributions`` gradients."""
        self._check_contributions(contributions)
        if self.variant == "widen" and contributions > 1:
            return (contributions * self.g).bit_length()
        return self.bits

    def rho(self, contributions: int) -> float:
        """``ρ_k = fl32(k^growth)``: the range of a ``requantize`` sum of ``k`` gradients in
        ranges of one (``k`` for ``widen``)."""
        if self.variant == "widen":
            return float(contributions)
        return float(np.float32(contributions**self.effective_growth))

    def _check_contributions(self, k: int) -> None:
        if k * self.g >= _MAX_GRID:
            raise ValueError(
                f"thc: contributions × g must be < 2^23 (got {k} × {self.g}); "
                "the integer sums would no longer be exact in fp32"
            )

    def _layout(self, numel: int) -> ThcLayout:
        return ThcLayout(numel, self.block_size)

    def wire(self) -> ThcWire:
        """What a kernel reads to write and read this configuration's bytes
        (:class:`~dynamiq.codecs.thc_wire.ThcWire`; one per configuration)."""
        from .thc_wire import wire_of

        return wire_of(self)

    def _span(self) -> int | None:
        """Values per segment (``None``: the whole buffer is one segment)."""
        return self.scale_blocks * self.block_size if self.scale_blocks else None

    def _nsegments(self, lay: ThcLayout, offset: int) -> int:
        span = self._span()
        if lay.nblocks == 0:
            return 0
        if span is None:
            return 1
        return (offset + (lay.nblocks - 1) * lay.d) // span - offset // span + 1

    def _segments(self, lay: ThcLayout, offset: int, device: torch.device) -> ThcSegments:
        span = self._span()
        blocks = torch.arange(lay.nblocks, dtype=torch.int64, device=device)
        if span is None:
            return ThcSegments(torch.zeros_like(blocks), 0, self._nsegments(lay, offset))
        first = offset // span
        return ThcSegments(
            (offset + blocks * lay.d) // span - first, first, self._nsegments(lay, offset)
        )

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        if numel == 0:
            return 0
        lay = self._layout(numel)
        k = ctx.contributions if ctx is not None else 1
        offset = ctx.offset if ctx is not None else 0
        return (
            4 * self._nsegments(lay, offset)
            + -(-lay.nblocks // 8)
            + packed_nbytes(lay.ncodes, self.width(k))
        )

    # -- the pieces -------------------------------------------------------------------------

    def _signs(self, lay: ThcLayout, offset: int, device: torch.device) -> torch.Tensor:
        """The ±1 diagonal ``D`` at the ``ncodes`` coordinates from global index ``offset``
        (from a per-process cache of the signs of the indices below :data:`_SIGN_CACHE_MAX`:
        they depend on ``rotation_seed`` and the index only, and hashing them is most of a
        rotation's time)."""
        end = offset + lay.ncodes
        if end > _SIGN_CACHE_MAX:
            return _hash_signs(self.rotation_seed, offset, end, device)
        key = (self.rotation_seed, device)
        with _SIGN_LOCK:
            cached = _SIGN_CACHE.get(key)
            if cached is None or cached.numel() < end:
                size = min(_SIGN_CACHE_MAX, max(end, 2 * (0 if cached is None else cached.numel())))
                cached = _hash_signs(self.rotation_seed, 0, size, device).to(torch.int8)
                _SIGN_CACHE[key] = cached
        return cached[offset:end].to(torch.float32)

    def _rotate(self, x: torch.Tensor, lay: ThcLayout, offset: int) -> torch.Tensor:
        """``w = H · (D ⊙ x)`` per block (fp32, ``ncodes`` coordinates)."""
        padded = torch.zeros(lay.ncodes, dtype=torch.float32, device=x.device)
        padded[: lay.numel] = x
        padded = padded * self._signs(lay, offset, x.device)
        return lay.block_stat(padded, fwht)

    def _unrotate(self, w: torch.Tensor, lay: ThcLayout, offset: int) -> torch.Tensor:
        """``D ⊙ H · w`` per block, the first ``numel`` values (``w`` already divided by d)."""
        v = lay.block_stat(w, fwht) * self._signs(lay, offset, w.device)
        return v[: lay.numel]

    def _statistic(
        self, w: torch.Tensor, finite: torch.Tensor, lay: ThcLayout, segs: ThcSegments
    ) -> torch.Tensor:
        """Per segment, over its finite blocks: the RMS (``"norm"``, rounded up to fp32) or
        the largest ``|w|`` (``"max"``) of the rotated coordinates ``w``; fp64, 0 for a
        segment without finite blocks."""
        out = torch.zeros(segs.count, dtype=torch.float64, device=w.device)
        if segs.count == 0:
            return out
        if self.scale == "max":
            peak = lay.block_stat(w.abs(), lambda v: v.amax(dim=1)).double()
            return out.scatter_reduce_(0, segs.of_block, torch.where(finite, peak, 0.0), "amax")
        sumsq = lay.block_stat(w.double().square(), lambda v: v.sum(dim=1))
        sizes = torch.tensor(lay.sizes(), dtype=torch.float64, device=w.device)
        total = out.index_add(0, segs.of_block, torch.where(finite, sumsq, 0.0))
        count = out.index_add(0, segs.of_block, torch.where(finite, sizes, 0.0))
        return _roundup_f32((total / count.clamp(min=1.0)).sqrt())

    def _agreed(
        self, ctx: HopContext, segs: ThcSegments, device: torch.device
    ) -> torch.Tensor | None:
        """The agreed ``S`` of the payload's segments (fp64 of fp32 values), or ``None``."""
        shared: Mapping[str, Any] | None = ctx.shared
        if shared is None or SHARED_KEY not in shared:
            return None
        value = shared[SHARED_KEY]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scales = [float(value)] * segs.count
        else:
            try:
                seq = [float(v) for v in value]
            except TypeError:
                raise TypeError(
                    f"thc: ctx.shared[{SHARED_KEY!r}] must be a number or a sequence of numbers "
                    f"(got {type(value).__name__})"
                ) from None
            if segs.first + segs.count > len(seq):
                raise ValueError(
                    f"thc: ctx.shared[{SHARED_KEY!r}] holds {len(seq)} segment scales but the "
                    f"chunk at offset {ctx.offset} needs segments {segs.first} .. "
                    f"{segs.first + segs.count - 1} (did the prologue run on this buffer?)"
                )
            scales = seq[segs.first : segs.first + segs.count]
        s = torch.tensor(scales, dtype=torch.float64, device=device)
        if not bool((torch.isfinite(s) & (s >= 0)).all()):
            raise ValueError(
                f"thc: ctx.shared[{SHARED_KEY!r}] must be finite and >= 0 (got {value!r})"
            )
        return _fl32(s)

    def _ranges(
        self, ctx: HopContext, w: torch.Tensor, finite: torch.Tensor, lay: ThcLayout
    ) -> tuple[torch.Tensor, ThcSegments]:
        """``R = fl32(T · S)`` per segment (fp64 of fp32 values), ``S`` agreed
        (``ctx.shared``) or local (the statistic over ``κ_k``, rounded up)."""
        segs = self._segments(lay, ctx.offset, w.device)
        scale = self._agreed(ctx, segs, w.device)
        if scale is None:
            scale = self._statistic(w, finite, lay, segs)
            kappa = self.rho(ctx.contributions)
            if kappa != 1.0:
                scale = _roundup_f32(scale / kappa)
        return self._clip_ranges(scale), segs

    def _clip_ranges(self, scale: torch.Tensor) -> torch.Tensor:
        t = float(np.float32(self.effective_clip))
        return _fl32(scale * t).clamp(max=_MAX_RANGE)  # fp64 product of fp32s: exact

    def _divisor(self, r: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        """``(R_div, c)`` of a value holding ``k`` gradients: ``(R, k)`` (``widen``) or
        ``(R_k, 1)`` (``requantize``), per segment."""
        if self.variant == "widen":
            return r, k
        rho = self.rho(k)
        if rho == 1.0:
            return r, 1
        return _roundup_f32(r * rho).clamp(max=_MAX_RANGE), 1

    def _positions(
        self, w: torch.Tensor, r_div: torch.Tensor, c: int, clamp: bool = True
    ) -> torch.Tensor:
        """``y = clamp(fl(fl(w / R_div) · g/2) + c·g/2, 0, c·g)`` (fp32; ``r_div`` per
        coordinate, fp32)."""
        # divisions are tensor by tensor: correctly rounded on every device (a scalar
        # divisor may become a multiplication by its reciprocal)
        t = torch.where(w == 0, 0.0, w / r_div)  # R = 0 only when every finite w is 0
        y = t * float(self.g // 2) + float(c * (self.g // 2))
        return y.clamp(0.0, float(c * self.g)) if clamp else y

    def _coord(self, per_segment: torch.Tensor, segs: ThcSegments, lay: ThcLayout) -> torch.Tensor:
        """A per-segment value at every coordinate, as fp32."""
        return lay.per_coord(per_segment[segs.of_block].float())

    def _dither(self, ctx: HopContext, n: int, device: torch.device) -> torch.Tensor:
        keys = hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
        idx = torch.arange(n, device=device, dtype=torch.int64) + ctx.offset
        return uniform_open01(hash_u32(idx, keys))

    def _table_interval(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index ``i`` and entries ``lo = table[i] <= y <= hi = table[i + 1]`` (y in [0, g]):
        the interval of the unit cell ``floor(y)`` (table entries are integers)."""
        table = torch.tensor(self.table, dtype=torch.float32, device=y.device)
        cells = torch.arange(self.g + 1, dtype=torch.float32, device=y.device)
        lut = (torch.searchsorted(table, cells, right=True) - 1).clamp(0, len(self.table) - 2)
        i = lut[torch.floor(y).to(torch.int64).clamp(0, self.g)]
        return i, table[i], table[i + 1]

    def _quantize(self, y: torch.Tensor, k: int, u: torch.Tensor) -> torch.Tensor:
        """Wire codes of positions ``y`` (``k`` contributions), by stochastic rounding."""
        if self.variant == "widen" and k > 1:
            lo = torch.floor(y)
            return (lo + (u < y - lo).float()).to(torch.int64)
        i, lo, hi = self._table_interval(y)
        return i + (u < (y - lo) / (hi - lo)).to(torch.int64)

    def _levels(self, codes: torch.Tensor, k: int) -> torch.Tensor:
        """Integers ``Y`` (fp32) from wire codes of a payload holding ``k`` gradients."""
        if self.variant == "widen" and k > 1:
            return codes.to(torch.float32)
        if bool((codes >= len(self.table)).any()):
            raise ValueError(f"thc: corrupt payload: a table index is >= {len(self.table)}")
        table = torch.tensor(self.table, dtype=torch.float32, device=codes.device)
        return table[codes.long()]

    def _pack(
        self, r: torch.Tensor, flags: torch.Tensor, codes: torch.Tensor, k: int
    ) -> torch.Tensor:
        head = r.float().contiguous().view(torch.uint8)
        width = self.width(k)
        wire = codes.to(torch.uint8) if width <= 8 else codes
        return torch.cat([head, pack_bits(flags.to(torch.uint8), 1), pack_bits(wire, width)])

    def _unpack(
        self, payload: torch.Tensor, lay: ThcLayout, ctx: HopContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nseg = self._nsegments(lay, ctx.offset)
        r = payload[: 4 * nseg].clone().view(torch.float32).double()
        if not bool((torch.isfinite(r) & (r >= 0)).all()):
            raise ValueError("thc: corrupt payload: a segment range is negative or not finite")
        nf = -(-lay.nblocks // 8)
        flags = unpack_bits(payload[4 * nseg : 4 * nseg + nf], 1, lay.nblocks).bool()
        codes = unpack_bits(payload[4 * nseg + nf :], self.width(ctx.contributions), lay.ncodes)
        return r, flags, codes.to(torch.int64)

    def _prepare(self, x: torch.Tensor, lay: ThcLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values with NaN/Inf blocks zeroed, and the finite-block mask; checks the range."""
        xf = x.float()
        bad = lay.nonfinite_blocks(xf)
        xz = torch.where(lay.per_elem(bad), 0.0, xf)
        big = float(xz.abs().max()) if xz.numel() else 0.0
        if big > self.max_input_abs:
            raise ValueError(
                f"thc: |x| = {big!r} exceeds max_input_abs={self.max_input_abs!r} (the "
                f"rotation over {self.block_size} values or the clip T = "
                f"{self.effective_clip:g} could overflow fp32)"
            )
        return xz, ~bad

    # -- prologue: the agreed scales --------------------------------------------------------

    def prologue(self, x: torch.Tensor, comm: _Comm) -> dict[str, tuple[float, ...]]:
        """Agree on the scale of every segment: the largest statistic (RMS or largest
        ``|w|``, see ``scale``) of any rank's (finite blocks of) ``x``, by an all-gather of one
        fp32 per segment. ``x`` is the rank's whole buffer, its element ``i`` at global index
        ``i`` (the engine's layout)."""
        flat = x.detach().reshape(-1)
        lay = self._layout(flat.numel())
        if lay.numel == 0:
            return {SHARED_KEY: ()}
        xz, finite = self._prepare(flat, lay)
        segs = self._segments(lay, 0, flat.device)
        local = self._statistic(self._rotate(xz, lay, 0), finite, lay, segs).float()
        gathered = comm.allgather(local)
        agreed = torch.stack([t.reshape(-1) for t in gathered]).amax(dim=0)
        return {SHARED_KEY: tuple(float(v) for v in agreed.cpu())}

    # -- encode / decode / reduce -----------------------------------------------------------

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        k = ctx.contributions
        self._check_contributions(k)
        lay = self._layout(n)
        xz, finite = self._prepare(x, lay)
        w = self._rotate(xz, lay, ctx.offset)
        r, segs = self._ranges(ctx, w, finite, lay)
        r_div, c = self._divisor(r, k)
        y = self._positions(w, self._coord(r_div, segs, lay), c)
        codes = self._quantize(y, k, self._dither(ctx, lay.ncodes, x.device))
        return self._pack(r, ~finite, codes, k)

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=payload.device)
        k = ctx.contributions
        lay = self._layout(numel)
        r, flags, codes = self._unpack(payload, lay, ctx)
        segs = self._segments(lay, ctx.offset, payload.device)
        r_div, c = self._divisor(r, k)
        # fl32(R_div / g) per segment (an fp32 division), times 1/d_b (a power of two)
        per_g = r_div.float() / torch.full_like(r_div, float(self.g), dtype=torch.float32)
        inv_d = torch.tensor(
            [2.0 ** -(size.bit_length() - 1) for size in lay.sizes()],
            dtype=torch.float32,
            device=payload.device,
        )
        scale = lay.per_coord(per_g[segs.of_block] * inv_d)
        w = (2.0 * self._levels(codes, k) - float(c * self.g)) * scale
        x = self._unrotate(w, lay, ctx.offset)
        return torch.where(lay.per_elem(flags), torch.nan, x)

    def _reduce(
        self, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
    ) -> torch.Tensor:
        n = local.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=local.device)
        k_in, k_out = ctx.contributions, out_ctx.contributions
        self._check_contributions(k_in)
        self._check_contributions(k_out)
        m = k_out - k_in
        lay = self._layout(n)
        r_in, flags_in, codes_in = self._unpack(payload, lay, ctx)
        segs = self._segments(lay, out_ctx.offset, local.device)
        agreed = self._agreed(out_ctx, segs, local.device)
        fits = torch.zeros(lay.nblocks, dtype=torch.bool, device=local.device)
        codes = codes_in
        r_out = r_in
        if agreed is not None and m >= 1 and ctx.offset == out_ctx.offset:
            # the homomorphic path: rotate local, add to the payload's integers, clamp the
            # sum to its range and round once
            r_out = self._clip_ranges(agreed)
            lz, finite = self._prepare(local, lay)
            fits = finite & ~flags_in & (r_in == r_out)[segs.of_block]
            w = self._rotate(lz, lay, out_ctx.offset)
            levels = self._levels(codes_in, k_in)
            if self.variant == "widen":
                r_c = self._coord(r_out, segs, lay)
                y = levels + self._positions(w, r_c, m, clamp=False)
                y = y.clamp(0.0, float(k_out * self.g))
            else:
                r_kin, _ = self._divisor(r_out, k_in)
                r_kout, _ = self._divisor(r_out, k_out)
                a = torch.where(r_kout > 0, r_kin.float() / r_kout.float(), 0.0)
                half = float(self.g // 2)
                y = (levels - half) * self._coord(a, segs, lay) + self._positions(
                    w, self._coord(r_kout, segs, lay), 1, clamp=False
                )
                y = y.clamp(0.0, float(self.g))
            codes = self._quantize(y, k_out, self._dither(out_ctx, lay.ncodes, local.device))
        if bool(fits.all()):
            return self._pack(r_out, fits.new_zeros(lay.nblocks), codes, k_out)
        # the rest: re-encode decode(payload) + local (the whole payload without an agreed range)
        again = self._encode(self._decode(payload, n, ctx) + local.float(), out_ctx)
        r, flags, slow = self._unpack(again, lay, out_ctx)
        keep = lay.per_coord(fits)
        return self._pack(r, flags & ~fits, torch.where(keep, codes, slow), k_out)

    # -- error bound ------------------------------------------------------------------------

    def _bound_terms(
        self, x: torch.Tensor, ctx: HopContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ThcLayout]:
        """Per block: the rounding term ``(2 R_div/g)·mean G``, the deterministic terms
        (clamping and fp32 slack) and the rounding variance; NaN for blocks holding NaN/Inf."""
        k = ctx.contributions
        self._check_contributions(k)
        lay = self._layout(x.numel())
        xz, finite = self._prepare(x, lay)
        w = self._rotate(xz, lay, ctx.offset)
        r, segs = self._ranges(ctx, w, finite, lay)
        r_div, c = self._divisor(r, k)
        y = self._positions(w, self._coord(r_div, segs, lay), c)
        if k == 1 or self.variant == "requantize":
            _, lo, hi = self._table_interval(y)
            if k == 1:
                gap = torch.where((y == lo) | (y == hi), 0.0, hi - lo).double()
                frac = ((y - lo) / (hi - lo)).double()
                var = frac * (1 - frac) * gap.square()
            else:
                widest = max(b - a for a, b in itertools.pairwise(self.table))
                gap = torch.full_like(y, float(widest), dtype=torch.float64)
                var = gap.square() / 4
        else:
            gap = torch.ones_like(y, dtype=torch.float64)
            var = gap / 4
        sizes = torch.tensor(lay.sizes(), dtype=torch.float64, device=x.device)
        nlog = torch.log2(sizes)
        gamma = nlog * _U / (1 - nlog * _U)
        rb = r_div[segs.of_block]  # per block
        unit = 2.0 * rb / self.g
        kr = c * rb  # the value's range
        mean_gap = lay.block_stat(gap, lambda v: v.mean(dim=1))
        over = (w.double().abs() - lay.per_coord(kr)).clamp(min=0.0)
        clamp = lay.block_stat(over, lambda v: v.mean(dim=1))
        l1 = torch.zeros(lay.nblocks, dtype=torch.float64, device=x.device)
        l1.index_add_(0, torch.arange(lay.numel, device=x.device) // lay.d, xz.double().abs())
        root = torch.exp2(torch.ceil(nlog / 2))
        slack = (
            gamma * (1 + 2.0**-10) * torch.maximum(l1, root * kr)
            + (16 * _U + 2 * gamma) * kr
            + sizes * (k * self.g + 1) * 2.0**-148
            + kr * 2.0**-100
        )
        rounding = unit * mean_gap
        det = clamp + slack + rounding * 2.0**-23  # the dither's 2^-24 grid: a tiny bias
        variance = unit**2 * lay.block_stat(var, lambda v: v.sum(dim=1)) / sizes.square()
        nan = torch.tensor(torch.nan, dtype=torch.float64, device=x.device)
        rounding = torch.where(finite, rounding, nan)
        return rounding, torch.where(finite, det, nan), variance, lay

    @property
    def error_bound(self) -> ErrorBound:
        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            if x.numel() == 0:
                return torch.zeros(0, dtype=torch.float64, device=x.device)
            rounding, det, _, lay = self._bound_terms(x, ctx)
            per = (rounding + det) * (1 + 2.0**-20)
            return lay.per_elem(per) + x.double().abs() * (_U * (1 + 2.0**-20)) + 2.0**-149

        def var(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            if x.numel() == 0:
                return torch.zeros(0, dtype=torch.float64, device=x.device)
            rounding, det, variance, lay = self._bound_terms(x, ctx)
            per = torch.where(torch.isnan(rounding), rounding, variance.sqrt() + det)
            sd = lay.per_elem(per) * (1 + 2.0**-20) + x.double().abs() * _U * (1 + 2.0**-20)
            return (sd + 2.0**-149).square()

        widest = max(b - a for a, b in itertools.pairwise(self.table))
        t = self.effective_clip
        stat = "RMS" if self.scale == "norm" else "max"
        if self.variant == "widen":
            rng, wide = "K = k·R", "1"
        else:
            rng, wide = f"K = R_k = k^{self.effective_growth:g}·R", f"{widest}"
        formula = (
            f"(2K/(c·g))·mean_j G_j + mean_j max(|w_j| - K, 0) + fp32 slack, {rng}, "
            f"R = {t:g}·S, S = agreed {stat} of |w| per {self.scale_blocks or 'all'} block(s), "
            f"g = {self.g}, G_j = table gap at y_j (k = 1), {wide} (k > 1)"
        )
        return ErrorBound(
            formula=formula,
            unbiased=self.scale == "max" and t == 1.0,
            max_abs=max_abs,
            witness=self._witness,
            var=var,
        )

    def _witness(self, numel: int) -> torch.Tensor:
        """Blocks whose errors all point the same way at the block's first element.

        Rotated coordinates are integers ``|w_j| <= top = 2^min(11, 24 - log2 d)`` (so
        ``x = D ⊙ H·w / d`` and its rotation are exact in fp32). Where the default context's
        dither ``u_j < 1/2``, ``w_j`` sits in the table's widest interval just past ``u_j``,
        so it rounds up, losing ``1 - f_j ≈ 1 - u_j`` of the gap; elsewhere ``w_j = 0`` (a
        table entry, no error and no bound). The range: ``"max"``: one ``-top`` per block
        (it fixes ``S``, and ``T < 1`` clamps it upwards); ``"norm"``: the segment's RMS is
        steered to ``R/T`` with ``R = top/4`` by *ballast* coordinates ``w_j < -R``, clamped
        upwards (errors the bound's clamping term counts exactly), a few fixed-point passes
        making the picks consistent with the range they produce.
        """
        lay = self._layout(numel)
        if lay.nblocks == 0:
            return torch.zeros(0)
        cpu = torch.device("cpu")
        top = 2.0 ** min(11, 24 - (self.block_size.bit_length() - 1))
        segs = self._segments(lay, 0, cpu)
        u = self._dither(HopContext(), lay.ncodes, cpu)
        # a tail block that is zero-padded cannot take any rotated values: it stays zero
        usable = lay.per_coord(
            torch.tensor([True] * lay.nfull + [lay.tail == lay.tail_d] * (lay.tail > 0))
        )
        rounds = usable & (u < 0.5)
        free = usable & ~rounds  # where the max-mode spike or the norm-mode ballast goes
        table = self.table
        i = max(range(len(table) - 1), key=lambda j: table[j + 1] - table[j])
        lo, hi = float(table[i]), float(table[i + 1])
        cand = torch.arange(-top, top + 1, dtype=torch.float32)

        def picks(r_seg: torch.Tensor) -> torch.Tensor:
            """Rounding coordinates for the ranges ``r_seg``: the smallest fraction > u_j."""
            r_c = self._coord(r_seg, segs, lay)
            out = torch.zeros(lay.ncodes, dtype=torch.float64)
            for rv in torch.unique(r_c[rounds]):
                at = (r_c == rv) & rounds
                y = self._positions(cand, torch.full_like(cand, float(rv)), 1)
                inside = (y > lo) & (y < hi)
                frac = (y[inside] - lo) / (hi - lo)  # as _quantize computes it
                if frac.numel() == 0:
                    continue
                frac, order = torch.sort(frac, stable=True)
                cs = cand[inside][order]
                pos = torch.searchsorted(frac, u[at], right=True)
                ok = pos < frac.numel()
                out[at] = torch.where(ok, cs[pos.clamp(max=frac.numel() - 1)].double(), 0.0)
            return out

        t = self.effective_clip
        starts = [0, *itertools.accumulate(lay.sizes())]
        if self.scale == "max":
            w = picks(_fl32(torch.full((segs.count,), top, dtype=torch.float64) * t))
            for a, b in itertools.pairwise(starts):  # one -top per usable block
                if bool(free[a:b].any()):
                    w[a + int(torch.argmax(torch.where(free[a:b], u[a:b], -1.0)))] = -top
        else:
            count = torch.zeros(segs.count, dtype=torch.float64).index_add_(
                0, segs.of_block, torch.tensor(lay.sizes(), dtype=torch.float64)
            )
            target = count * (top / 4 / t) ** 2  # sum of squares giving R = top/4
            seg_c = lay.per_coord(segs.of_block)
            r_seg = torch.full((segs.count,), top / 4, dtype=torch.float64)
            w = torch.zeros(lay.ncodes, dtype=torch.float64)
            for _ in range(12):
                w = picks(r_seg)
                for s in range(segs.count):
                    at = (seg_c == s).nonzero().reshape(-1)
                    # rounding coordinates take at most half the sum of squares
                    w[at[w[at].square().cumsum(0) > target[s] / 2]] = 0.0
                    need = float(target[s] - w[at].square().sum())
                    slots = at[free[at]]
                    nb = min(int(need // top**2), slots.numel())
                    w[slots[:nb]] = -top
                    rest = need - nb * top**2
                    if nb < slots.numel() and rest > 0:
                        w[slots[nb]] = -float(min(top, math.floor(math.sqrt(rest))))
                finite = torch.ones(lay.nblocks, dtype=torch.bool)
                new = self._clip_ranges(self._statistic(w.float(), finite, lay, segs))
                if torch.equal(new, r_seg):
                    break
                r_seg = new
        sizes = lay.per_coord(torch.tensor(lay.sizes(), dtype=torch.float64))
        x = lay.block_stat(w, fwht) / sizes * self._signs(lay, 0, cpu).double()
        return x[:numel].float()
