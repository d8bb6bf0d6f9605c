"""THC, Tensor Homomorphic Compression (NSDI 2024), as the codec ``thc`` (spec/baselines.md,
"THC").

Recipe, per block of ``d = block_size`` values (a power of two; a short last block of ``r``
values is zero-padded to the next power of two ``d_r >= r``):

1. **Rotate**: ``w = H · (D ⊙ x)`` with ``H`` the unnormalised ``d × d`` Walsh–Hadamard matrix
   (entries ±1, computed by ``log2 d`` add/subtract stages) and ``D`` a ±1 diagonal drawn from
   the counter hash of ``(rotation_seed, global index)`` (``dynamiq.codecs.hashing``). ``D``
   depends neither on the rank nor on the hop: every rank and every hop rotates a given index
   identically, so rotated values add up across ranks. ``D``'s seed is part of the codec's
   config rather than ``ctx.seed``: the engine's ``prologue(x, comm)`` hook gets no context,
   and the agreed scale must be measured under the very rotation the encoder applies. (The
   classical ``1/√d`` normalisation is folded into the scale; decoding divides by ``d``, an
   exact power of two.)
2. **Scale**: every rank agrees on one global scale ``S`` in the codec's ``prologue``: the
   largest ``|w|`` of any rank's gradient (an all-gather of one fp32 per rank). The range of one
   contribution is ``R = fl32(T · S)`` with ``T = clip`` (default 1: with the agreed ``S`` a
   rank's own gradient is never clamped). Encoded outside a collective (``ctx.shared`` without
   ``"thc_scale"``), ``S`` falls back to the payload's own largest ``|w|`` divided by
   ``ctx.contributions`` (rounded up to fp32). ``R`` travels in the payload's header. (An
   ``all_gather`` alone runs the prologue on finished sums, so its ``S`` is already a sum's
   and the range ``k·R`` is ``k`` times wider than needed: correct, but coarser.)
3. **Map** a value holding ``k = ctx.contributions`` gradients to the integer domain
   ``y = fl(fl(w / R) · g/2) + k·g/2``, clamped to ``[0, k·g]`` (``g = table[-1]``, the fine
   grid's granularity).
4. **Quantize** with stochastic rounding (hash dither of ``(seed, step, hop, rank, global
   index)``, unbiased) to integers:

   * one contribution (``k = 1``): to the two neighbouring entries of ``table``, a small
     non-uniform set of integers ``0 = table[0] < … < table[-1] = g`` containing ``g/2`` (so
     zero is exact); the wire carries the entry's index in ``bits = ceil(log2 len(table))``
     bits. This is stochastic rounding to the fine grid composed with the table map, in one
     step (rounding to the grid first and then to the table keeps the mean but adds
     variance). The default table (16 entries, ``g = 30``) was fitted to real gradients by
     ``benchmarks/fit_thc_table.py`` (minimum stochastic-rounding variance on the ``fit``
     split, disjoint from the evaluation data);
   * ``variant="widen"``, ``k >= 2``: to the integer grid itself; the wire carries the integer
     sum in ``width(k) = ceil(log2(k·g + 1))`` bits, so the size grows along a ring but is
     fixed per hop (``encoded_nbytes`` depends on ``ctx.contributions``);
   * ``variant="requantize"``, ``k >= 2``: ``y / k`` to the table; the wire keeps ``bits`` bits
     per value and the value is ``k · table[index]``.

**Homomorphic reduce.** ``reduce(payload, local, ctx, out_ctx)``: ``payload`` holds the
integers ``Y`` of ``ctx.contributions`` gradients, ``local`` is this rank's raw value holding
``m = out_ctx.contributions - ctx.contributions`` gradients; the result holds
``out_ctx.contributions``. Without decoding the payload (no inverse rotation, no table
inverse beyond index → integer), ``local`` is rotated and mapped with ``k = m`` and **added to
the integers**, and the sum is rounded once with ``out_ctx``'s dither: to the integer grid
(``widen``: integer adds, width ``width(k_out)``) or, divided by ``k_out``, to the table
(``requantize``). Blocks where this is not possible fall back to re-encoding
``decode(payload) + local`` with ``out_ctx``: when ``out_ctx.shared`` has no agreed scale or
the payload was encoded with another range, when ``m < 1``, or in a block where ``local``
would be clamped (``max |w_local| > m·R``; with the agreed scale and ``clip = 1`` a rank's own
gradient never is) or which holds NaN/Inf. Either way the result decodes within
``max_abs_error(decode(payload) + local, out_ctx)`` of it. ``decode`` returns the de-rotated,
de-scaled sum ``x̂ = D ⊙ H · ((2Y - k·g) · R/g) / d``.

**Error bound** per element of a block (``d_b`` its transform size, ``L = log2 d_b``,
``u = 2^-24``, ``γ = L·u / (1 - L·u)``, ``w`` the fp32 rotation of the encoded value ``x``)::

    |x̂ - x| <= (2R/g) · mean_j G_j                     (stochastic rounding)
             + mean_j max(|w_j| - k·R, 0)               (clamping; 0 when T = 1 and the
                                                         scale is agreed or local)
             + γ · max(‖x_b‖_1, 2^ceil(L/2) · k·R) + (12u + 2γ) · k·R + u·|x_i| + tiny
                                                        (fp32 rotation, scaling, decoding)

with ``G_j`` the width of the table interval holding ``y_j`` (0 when ``y_j`` is a table entry)
for ``k = 1``; ``1`` (``widen``) or ``k · max gap`` (``requantize``) for ``k >= 2`` (these also
cover the homomorphic ``reduce``, whose rounding positions the bound cannot see). Since
``x̂ - x = D ⊙ H · (ŵ - w) / d`` and ``|H_ij| = 1``, the rounding errors of the ``d_b``
coordinates add up in the worst case: the bound is their mean, reached when they all point
the same way (the witness builds such a block from the known dither). Typical errors are far
smaller: ``variance`` is ``(2R/g)² / d_b² · Σ_j f_j(1 - f_j) G_j²`` (``f_j`` the position in
the interval; ``G²/4`` for ``k >= 2``) plus the deterministic terms.

Wire layout (little-endian): ``R`` as fp32 (4 bytes); a bitmap of the blocks holding NaN/Inf
(``ceil(blocks / 8)`` bytes, block ``b`` in bit ``b % 8`` of byte ``b // 8``); the codes of the
``nfull · d + d_r`` rotated coordinates, packed densely (``dynamiq.codecs.packing``) at
``bits`` (table indices) or ``width(k)`` (``widen``, ``k >= 2``) bits each. An empty input
encodes to 0 bytes.

Non-finite input: a block holding NaN or ±Inf is flagged in the bitmap (its codes encode zero,
and it does not enter the scale) and decodes to NaN; other blocks are unaffected. Finite
inputs up to ``max_input_abs = 2^(127 - log2 block_size)`` are accepted (so the rotation cannot
overflow); beyond it ``encode`` raises ``ValueError``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .hashing import hash_keys, hash_u32, uniform_open01
from .packing import pack_bits, packed_nbytes, unpack_bits
from .registry import register_codec

__all__ = ["DEFAULT_TABLE", "SHARED_KEY", "ThcCodec", "fwht"]

#: The default table: 16 integers of the fine grid 0..30 (4-bit indices), fitted by
#: ``benchmarks/fit_thc_table.py`` on the ``fit`` split of the real gradients.
DEFAULT_TABLE: tuple[int, ...] = (0, 6, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 25, 30)

#: The key of the agreed scale in ``HopContext.shared`` (what :meth:`ThcCodec.prologue` returns).
SHARED_KEY = "thc_scale"

VARIANTS = ("requantize", "widen")
_U = 2.0**-24
_MAX_GRID = 1 << 23  # k·g below this keeps 2Y - k·g exact in fp32
_ROTATION_HOP = 0xFFFFFFFF  # no HopContext has this hop: the rotation's hash never meets a dither


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
    h = 1
    while h < d:
        v = x.reshape(rows, d // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).reshape(rows, d)
        h *= 2
    return x


@dataclass(frozen=True)
class _Layout:
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
        sizes = torch.tensor(self.sizes(), dtype=torch.int64, device=per_block.device)
        return per_block.repeat_interleave(sizes)

    def per_elem(self, per_block: torch.Tensor) -> torch.Tensor:
        return per_block.repeat_interleave(self.d)[: self.numel]

    def nonfinite_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Which blocks of ``x`` (``numel`` values) hold NaN or ±Inf."""
        bad = torch.zeros(self.nblocks * self.d, dtype=torch.bool, device=x.device)
        bad[: self.numel] = ~torch.isfinite(x)
        return bad.view(self.nblocks, self.d).any(dim=1)


def _roundup_f32(q: float) -> float:
    """The smallest fp32 value >= ``q`` (q >= 0, finite)."""
    f = np.float32(q)
    return float(f if float(f) >= q else np.nextafter(f, np.float32(np.inf)))


def _peak(w: torch.Tensor, finite: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """The largest ``|w|`` over the finite blocks (fp32, 0-dim; 0 when there are none)."""
    if lay.ncodes == 0:
        return w.new_zeros(())
    absmax = lay.block_stat(w.abs(), lambda v: v.amax(dim=1))
    return torch.where(finite, absmax, 0.0).max()


@register_codec
@dataclass(frozen=True, kw_only=True)
class ThcCodec(Codec):
    """THC: randomized Hadamard rotation, one agreed scale, stochastic rounding to a small
    integer table; partial sums aggregate by adding integers (``homomorphic``).

    Config: ``variant`` (``"requantize"``: fixed width, the sum re-quantized to the table at
    every hop; ``"widen"``: integer sums, ``ceil(log2(k·g + 1))`` bits after ``k``
    contributions), ``table`` (sorted integers ``0 .. g`` containing ``g/2``, at most 256),
    ``block_size`` (rotation size, a power of two), ``clip`` (``T`` in ``(0, 1]``: the range of
    one contribution as a fraction of the agreed scale) and ``rotation_seed`` (the seed of the
    ±1 diagonal, shared by all ranks). The formulas are in the module docstring and
    ``docs/codecs.md``.

    >>> codec = ThcCodec()
    >>> x = torch.linspace(-1, 1, 2048)
    >>> payload = codec.encode(x)  # R (4 bytes), NaN bitmap (1), 2048 4-bit codes (1024)
    >>> payload.numel(), codec.encoded_nbytes(2048, HopContext(contributions=8))
    (1029, 1029)
    >>> ThcCodec(variant="widen").encoded_nbytes(2048, HopContext(contributions=8))  # 8 bits
    2053
    >>> err = (codec.decode(payload, 2048) - x).abs()
    >>> bool((err <= codec.error_bound.max_abs_error(x)).all())
    True
    """

    codec_id: ClassVar[str] = "thc"
    homomorphic: ClassVar[bool] = True
    nonfinite: ClassVar[str] = (
        "A block holding NaN or ±Inf is flagged in the payload's bitmap and decodes to NaN; it "
        "does not enter the scale, so other blocks are unaffected."
    )

    variant: str = "requantize"
    table: tuple[int, ...] = DEFAULT_TABLE
    block_size: int = 1024
    clip: float = 1.0
    rotation_seed: int = 0

    def __post_init__(self) -> None:
        check_choice("variant", self.variant, VARIANTS)
        if not isinstance(self.table, (tuple, list)):
            raise TypeError(f"table must be a sequence of ints (got {type(self.table).__name__})")
        for v in self.table:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"table must hold ints (got {v!r})")
        table = tuple(self.table)
        object.__setattr__(self, "table", table)
        if not 3 <= len(table) <= 256:
            raise ValueError(f"table must have 3..256 entries (got {len(table)})")
        if any(b <= a for a, b in itertools.pairwise(table)):
            raise ValueError(f"table must be strictly increasing (got {table})")
        g = table[-1]
        if table[0] != 0 or g % 2 or g > 4096:
            raise ValueError(f"table must run from 0 to an even g <= 4096 (got {table[0]} .. {g})")
        if g // 2 not in table:
            raise ValueError(f"table must contain g/2 = {g // 2}, so that zero is exact")
        check_int("block_size", self.block_size, 1, 1 << 16)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (got {self.block_size})")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)):
            raise TypeError(f"clip must be a float (got {type(self.clip).__name__})")
        if not 0.0 < float(self.clip) <= 1.0:
            raise ValueError(f"clip must be in (0, 1] (got {self.clip})")
        object.__setattr__(self, "clip", float(self.clip))
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
    def max_input_abs(self) -> float:
        return 2.0 ** (127 - (self.block_size.bit_length() - 1))

    def width(self, contributions: int = 1) -> int:
        """Bits per code of a payload holding ``contributions`` gradients."""
        self._check_contributions(contributions)
        if self.variant == "widen" and contributions > 1:
            return (contributions * self.g).bit_length()
        return self.bits

    def _check_contributions(self, k: int) -> None:
        if k * self.g >= _MAX_GRID:
            raise ValueError(
                f"thc: contributions × g must be < 2^23 (got {k} × {self.g}); "
                "the integer sums would no longer be exact in fp32"
            )

    def _layout(self, numel: int) -> _Layout:
        return _Layout(numel, self.block_size)

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        if numel == 0:
            return 0
        lay = self._layout(numel)
        k = ctx.contributions if ctx is not None else 1
        return 4 + -(-lay.nblocks // 8) + packed_nbytes(lay.ncodes, self.width(k))

    # -- the pieces -------------------------------------------------------------------------

    def _signs(self, lay: _Layout, offset: int, device: torch.device) -> torch.Tensor:
        """The ±1 diagonal ``D`` at the ``ncodes`` coordinates from global index ``offset``."""
        keys = hash_keys(self.rotation_seed, 0, _ROTATION_HOP, 0)
        idx = torch.arange(lay.ncodes, device=device, dtype=torch.int64) + offset
        return 1.0 - 2.0 * (hash_u32(idx, keys) >> 31).to(torch.float32)

    def _rotate(self, x: torch.Tensor, lay: _Layout, offset: int) -> torch.Tensor:
        """``w = H · (D ⊙ x)`` per block (fp32, ``ncodes`` coordinates)."""
        padded = torch.zeros(lay.ncodes, dtype=torch.float32, device=x.device)
        padded[: lay.numel] = x
        padded = padded * self._signs(lay, offset, x.device)
        return lay.block_stat(padded, fwht)

    def _unrotate(self, w: torch.Tensor, lay: _Layout, offset: int) -> torch.Tensor:
        """``D ⊙ H · w`` per block, the first ``numel`` values (``w`` already divided by d)."""
        v = lay.block_stat(w, fwht) * self._signs(lay, offset, w.device)
        return v[: lay.numel]

    def _range(self, ctx: HopContext, w: torch.Tensor, finite: torch.Tensor, lay: _Layout) -> float:
        """``R = fl32(T · S)``: ``S`` agreed (``ctx.shared``) or local (largest ``|w|`` of the
        finite blocks over ``contributions``, rounded up)."""
        scale = _shared_scale(ctx)
        if scale is None:
            amax = float(_peak(w, finite, lay))
            k = ctx.contributions
            scale = amax if k == 1 else _roundup_f32(amax / k)
        return self._clip_range(scale)

    def _clip_range(self, scale: float) -> float:
        return float(np.float32(scale) * np.float32(self.clip))  # host scalars: IEEE fp32

    def _positions(self, w: torch.Tensor, k: int, r: float) -> torch.Tensor:
        """``y = clamp(fl(fl(w / R) · g/2) + k·g/2, 0, k·g)`` (fp32)."""
        # divisions are tensor by tensor: correctly rounded on every device (a scalar
        # divisor may become a multiplication by its reciprocal)
        t = w / torch.full_like(w, r)
        t = torch.where(w == 0, 0.0, t)  # R = 0 only when every finite w is 0
        y = t * float(self.g // 2) + float(k * (self.g // 2))
        return y.clamp(0.0, float(k * self.g))

    def _dither(self, ctx: HopContext, n: int, device: torch.device) -> torch.Tensor:
        keys = hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
        idx = torch.arange(n, device=device, dtype=torch.int64) + ctx.offset
        return uniform_open01(hash_u32(idx, keys))

    def _table_interval(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index ``i`` and entries ``lo = table[i] <= y <= hi = table[i + 1]`` (y in [0, g])."""
        table = torch.tensor(self.table, dtype=torch.float32, device=y.device)
        i = (torch.searchsorted(table, y, right=True) - 1).clamp(0, len(self.table) - 2)
        return i, table[i], table[i + 1]

    def _quantize(self, y: torch.Tensor, k: int, u: torch.Tensor) -> torch.Tensor:
        """Wire codes of positions ``y`` (``k`` contributions), by stochastic rounding."""
        if self.variant == "widen" and k > 1:
            lo = torch.floor(y)
            return (lo + (u < y - lo).float()).to(torch.int64)
        q = y if k == 1 else y / torch.full_like(y, float(k))
        i, lo, hi = self._table_interval(q)
        return i + (u < (q - lo) / (hi - lo)).to(torch.int64)

    def _levels(self, codes: torch.Tensor, k: int) -> torch.Tensor:
        """Integers ``Y`` (fp32) from wire codes of a payload holding ``k`` gradients."""
        if self.variant == "widen" and k > 1:
            return codes.to(torch.float32)
        if bool((codes >= len(self.table)).any()):
            raise ValueError(f"thc: corrupt payload: a table index is >= {len(self.table)}")
        table = torch.tensor(self.table, dtype=torch.float32, device=codes.device)
        return table[codes.long()] * float(k)

    def _pack(self, r: float, flags: torch.Tensor, codes: torch.Tensor, k: int) -> torch.Tensor:
        head = torch.tensor([r], dtype=torch.float32, device=codes.device).view(torch.uint8)
        width = self.width(k)
        wire = codes.to(torch.uint8) if width <= 8 else codes
        return torch.cat([head, pack_bits(flags.to(torch.uint8), 1), pack_bits(wire, width)])

    def _unpack(
        self, payload: torch.Tensor, lay: _Layout, k: int
    ) -> tuple[float, torch.Tensor, torch.Tensor]:
        r = float(payload[:4].clone().view(torch.float32)[0])
        nf = -(-lay.nblocks // 8)
        flags = unpack_bits(payload[4 : 4 + nf], 1, lay.nblocks).bool()
        codes = unpack_bits(payload[4 + nf :], self.width(k), lay.ncodes).to(torch.int64)
        return r, flags, codes

    def _prepare(self, x: torch.Tensor, lay: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values with NaN/Inf blocks zeroed, and the finite-block mask; checks the range."""
        xf = x.float()
        bad = lay.nonfinite_blocks(xf)
        xz = torch.where(lay.per_elem(bad), 0.0, xf)
        big = float(xz.abs().max()) if xz.numel() else 0.0
        if big > self.max_input_abs:
            raise ValueError(
                f"thc: |x| = {big!r} exceeds max_input_abs={self.max_input_abs!r} (the "
                f"rotation over {self.block_size} values could overflow fp32)"
            )
        return xz, ~bad

    # -- prologue: the agreed scale ---------------------------------------------------------

    def prologue(self, x: torch.Tensor, comm: _Comm) -> dict[str, float]:
        """Agree on the global scale: the largest rotated ``|w|`` over every rank's (finite
        blocks of) ``x``, by an all-gather of one fp32 per rank. ``x`` is the rank's whole
        buffer, its element ``i`` at global index ``i`` (the engine's layout)."""
        flat = x.detach().reshape(-1)
        lay = self._layout(flat.numel())
        xz, finite = self._prepare(flat, lay)
        local = _peak(self._rotate(xz, lay, 0), finite, lay)
        gathered = comm.allgather(local.reshape(1))
        return {SHARED_KEY: float(torch.cat([t.reshape(-1) for t in gathered]).max())}

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
        r = self._range(ctx, w, finite, lay)
        y = self._positions(w, k, r)
        codes = self._quantize(y, k, self._dither(ctx, lay.ncodes, x.device))
        return self._pack(r, ~finite, codes, k)

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=payload.device)
        k = ctx.contributions
        lay = self._layout(numel)
        r, flags, codes = self._unpack(payload, lay, k)
        levels = self._levels(codes, k)
        per_g = float(np.float32(r) / np.float32(self.g))  # fl32(R / g), IEEE on the host
        inv_d = [2.0 ** -(size.bit_length() - 1) for size in lay.sizes()]
        c = lay.per_coord(torch.tensor(inv_d, device=payload.device) * per_g)  # R/g/d_b
        w = (2.0 * levels - float(k * self.g)) * c
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
        r_in, flags_in, codes_in = self._unpack(payload, lay, k_in)
        scale = _shared_scale(out_ctx)
        r_out = None if scale is None else self._clip_range(scale)
        fits = torch.zeros(lay.nblocks, dtype=torch.bool, device=local.device)
        codes = codes_in
        if r_out is not None and r_out == r_in and m >= 1:
            # the homomorphic path: rotate local, add to the payload's integers, round once
            lz, finite = self._prepare(local, lay)
            w = self._rotate(lz, lay, out_ctx.offset)
            peak = lay.block_stat(w.abs().double(), lambda v: v.amax(dim=1))
            fits = finite & ~flags_in & (peak <= m * r_in)
            y = self._levels(codes_in, k_in) + self._positions(w, m, r_in)
            codes = self._quantize(y, k_out, self._dither(out_ctx, lay.ncodes, local.device))
        if bool(fits.all()):
            return self._pack(r_in, fits.new_zeros(lay.nblocks), codes, k_out)
        # the rest: re-encode decode(payload) + local (the whole payload without an agreed range)
        again = self._encode(self._decode(payload, n, ctx) + local.float(), out_ctx)
        r, flags, slow = self._unpack(again, lay, k_out)
        keep = lay.per_coord(fits)
        return self._pack(r, flags & ~fits, torch.where(keep, codes, slow), k_out)

    # -- error bound ------------------------------------------------------------------------

    def _bound_terms(
        self, x: torch.Tensor, ctx: HopContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Layout]:
        """Per block: the rounding term ``(2R/g)·mean G``, the deterministic terms (clamping and
        fp32 slack) and the rounding variance; NaN for blocks holding NaN/Inf."""
        k = ctx.contributions
        self._check_contributions(k)
        lay = self._layout(x.numel())
        xz, finite = self._prepare(x, lay)
        w = self._rotate(xz, lay, ctx.offset)
        r = self._range(ctx, w, finite, lay)
        y = self._positions(w, k, r)
        if k == 1:
            _, lo, hi = self._table_interval(y)
            gap = torch.where((y == lo) | (y == hi), 0.0, hi - lo).double()
            frac = ((y - lo) / (hi - lo)).double()
            var = frac * (1 - frac) * gap.square()
        else:
            table = self.table
            widest = max(b - a for a, b in itertools.pairwise(table))
            gap = torch.full_like(y, 1.0 if self.variant == "widen" else float(k * widest))
            gap = gap.double()
            var = gap.square() / 4
        sizes = torch.tensor(lay.sizes(), dtype=torch.float64, device=x.device)
        nlog = torch.log2(sizes)
        gamma = nlog * _U / (1 - nlog * _U)
        unit = 2.0 * r / self.g
        kr = k * r
        mean_gap = lay.block_stat(gap, lambda v: v.mean(dim=1))
        clamp = lay.block_stat((w.double().abs() - kr).clamp(min=0.0), lambda v: v.mean(dim=1))
        l1 = torch.zeros(lay.nblocks, dtype=torch.float64, device=x.device)
        l1.index_add_(0, torch.arange(lay.numel, device=x.device) // lay.d, xz.double().abs())
        root = torch.exp2(torch.ceil(nlog / 2))
        slack = (
            gamma * (1 + 2.0**-10) * torch.maximum(l1, root * kr)
            + (12 * _U + 2 * gamma) * kr
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
        wide = "1" if self.variant == "widen" else f"k·{widest}"
        formula = (
            f"(2R/g)·mean_j G_j + mean_j max(|w_j| - kR, 0) + fp32 slack, R = {self.clip:g}·S, "
            f"g = {self.g}, G_j = table gap at y_j (k = 1), {wide} (k > 1)"
        )
        unbiased = self.clip == 1.0
        return ErrorBound(
            formula=formula,
            unbiased=unbiased,
            max_abs=max_abs,
            witness=self._witness,
            var=var,
        )

    def _witness(self, numel: int) -> torch.Tensor:
        """Blocks whose rounding errors all point the same way at the block's first element.

        Rotated coordinates are integers ``|w_j| <= 2^11`` (so ``x = D ⊙ H·w / d`` and its
        rotation are exact in fp32), one of them ``-2^11`` (it fixes ``S``); each other ``w_j``
        sits in the table's widest interval just past the default context's dither ``u_j``, so
        it rounds up, losing ``1 - f_j ≈ 1 - u_j`` of the gap, or at ``0`` (a table entry, no
        error and no bound) where ``u_j >= 1/2``.
        """
        lay = self._layout(numel)
        x = torch.zeros(numel, dtype=torch.float64)
        if lay.nfull == 0:
            return torch.linspace(-1.0, 1.0, numel)
        d, top = self.block_size, 2**11
        ctx = HopContext()
        r = self._clip_range(float(top))  # the local scale: the block's largest |w|
        cand = torch.arange(-top, top + 1, dtype=torch.float32)
        y = self._positions(cand, 1, r)
        table = self.table
        i = max(range(len(table) - 1), key=lambda j: table[j + 1] - table[j])
        lo, hi = float(table[i]), float(table[i + 1])
        inside = (y > lo) & (y < hi)
        cand, y = cand[inside], y[inside]
        frac = (y - lo) / (hi - lo)  # as _quantize computes it
        u = self._dither(ctx, lay.ncodes, x.device)
        signs = self._signs(lay, 0, x.device).double()
        h = fwht(torch.eye(d, dtype=torch.float64))
        for b in range(lay.nfull):
            ub = u[b * d : (b + 1) * d]
            # smallest f > u_j: rounds up (u < f), error (1 - f) of the gap
            pos = torch.searchsorted(frac.contiguous(), ub, right=True)
            ok = (pos < frac.numel()) & (ub < 0.5)
            pick = cand[pos.clamp(max=frac.numel() - 1)]
            wb = torch.where(ok, pick, 0.0).double()
            wb[int(torch.argmax(ub))] = -float(top)
            x[b * d : (b + 1) * d] = (h @ wb) / d * signs[b * d : (b + 1) * d]
        return x.float()


def _shared_scale(ctx: HopContext) -> float | None:
    shared: Mapping[str, Any] | None = ctx.shared
    if shared is None or SHARED_KEY not in shared:
        return None
    s = float(shared[SHARED_KEY])
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"thc: ctx.shared[{SHARED_KEY!r}] must be finite and >= 0 (got {s!r})")
    return float(torch.tensor(s, dtype=torch.float32))
