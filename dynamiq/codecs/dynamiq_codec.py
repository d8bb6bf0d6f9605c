"""The DynamiQ codec (docs/design.md, "Codec sources"; docs/formats.md, "dynamiq"):
partial-sum-aware quantization for multi-hop all-reduce.

Wire unit: a **span** of ``span`` values (the codec's ``block_size``, aligned to global
offsets; 256 by default) made of **super-groups** of ``super_group`` values (256), each made
of **groups** of ``group`` values (16). Per span, the wire holds:

1. one scale per super-group: ``S = roundup_bf16(absmax)`` (bf16, 2 bytes);
2. one 4-bit code ``e`` per group: the group scale is ``s = S·2^-e``, the largest such
   power-of-two step below ``S`` that is still >= the group's absmax (``e`` in 0..15);
3. the groups' level indices, ``w_g`` bits each, packed back to back in the span's
   container of ``B`` bits (``ceil(B / 8)`` bytes).

**The budget ``B`` of a span**, known to both ends before any byte of it arrives:

* ``pooling="bucket"`` (default) inside a collective: the codec's :meth:`DynamiqCodec.prologue`
  (one exact all-reduce of a byte per span, :mod:`dynamiq.codecs._dynamiq_pool`) gives
  every rank the same per-span demand, and from it every rank derives the same budget of
  every span: the bucket's ``floor(bits_k · N)`` bits pooled over all its spans. In an
  all-reduce the prologue also moves the engine's chunk cuts to equal bytes (each chunk
  within 1.1 times the mean chunk's values), and every chunk holds at most ``balance``
  times the mean chunk's uniform share, or ``balance_slack`` bytes more than it where that
  is more (so every rank sends about as much in every round, and chunks of a few spans,
  whose rounds cost their latency, not their bytes, may still pool).
  Bytes per value (prologue included) stay
  ``bits_k + 80/span + 8/span`` bits: 4.964 by default (5.0 at most);
* ``pooling="span"``, or without the prologue's result (``ctx.shared``): ``floor(bits_k ·
  len)`` for a span of ``len`` values (the first version's design: pooled over the span only;
  ``span=65536, super_group=1024, bits=4.7`` is that version's default, wire-identical).

**Variable bit-width, no extra metadata.** The widths ``w_g`` are not sent: both sides derive
them from the integer scale codes by reverse water-filling over the span (the budget ``B``
is shared among its groups). The next bit of group ``g`` at width ``w`` is worth
``s_g^2 (D(w) - D(w+1))``, ``D`` the distortion of the fitted level tables measured on the fit
split; in integers, ``P[g, w] = 8 L_g + Q[w]`` with ``L_g = k floor(log2 S) - e_g`` (the
group scale's log2 in 1/k-bit units) and ``Q[w] = round(4k log2(D(w) - D(w+1)))``. Every bit
worth at least the lowest threshold that fits the budget is taken; the bits worth one less go
to the groups in index order while they fit. Integer arithmetic only: sender and receiver
agree on every device.

**Levels.** A width ``w >= 1`` has ``2^w`` levels in [-1, 1], symmetric: ``"fitted"``
(default) are Lloyd-Max tables fitted to normalised real partial sums of the ``fit`` split
(stretched to endpoints ±1 under stochastic rounding, so that rounding stays unbiased),
disjoint from the evaluation data (``benchmarks/fit_levels.py`` writes
``_dynamiq_levels.py``); ``"uniform"`` are evenly spaced with endpoints ±1. A value is
``level · s``; width 0 decodes to 0.

**Rounding.** ``"nearest"`` (lowest error per hop, biased), ``"stochastic"`` (between the
two neighbouring levels, unbiased, dither from the counter hash of (seed, step, hop, rank,
index)), or ``"correlated"``: the dither of coordinate ``j`` at hop ``k`` is ``u = (π_j(k) +
v) / H`` with ``π_j`` a per-coordinate cyclic shift of the ``H = ctx.num_hops`` hops (shared
by every hop and rank through the seed) and ``v`` uniform: each hop is unbiased, and the
errors of successive hops are stratified, so they partly cancel in the final sum.

**Partial-sum awareness.** ``hop_slope`` moves bits from early hops to late ones, whose
partial sums are larger: ``bits_k = bits + hop_slope · (k - (H - 1)/2) / max(H - 1, 1)``, so
the average over the hops stays ``bits`` (the wire size depends on ``ctx``, as allowed).

Non-finite input: a super-group holding NaN gets a NaN scale (written as the bf16 pattern
0xFFFF, what torch's CPU conversion writes), one holding ±Inf and no NaN an infinite scale
(0x7F80); either decodes to NaN. Non-finite values
never enter the prologue's statistics, so they do not move other spans' budgets. A finite
``|x|`` beyond ``max_input_abs`` (2^127) raises ``ValueError``: in a collective on every rank
(the prologue's all-reduce carries a flag), which also refuses inputs whose partial sums
could grow past it (``n·|x|max·(1 + 2^-7)^(n-1)``, ``n`` ranks).

**How the reference computes it** (the wire format above does not depend on this). The full
spans of a call are processed together as ``[spans, groups, group]`` tensors, in blocks of
about :data:`_BLOCK` values (the last, shorter span on its own, zero-padded to whole
super-groups), with one host read per block and no per-span loop:

* scales: ``roundup_bf16`` in integer arithmetic (round to nearest even, then one step up if
  that fell below), the codes ``e`` by comparing the 16 candidate group scales of each
  super-group with each group's absmax;
* the threshold ``tau`` of every span at once: a histogram of the span's group levels
  ``L_g`` (weighted by group size) and its suffix sums give ``cost(tau) = Σ_w Σ_{L >=
  ceil((tau - Q[w]) / 8)} size(L)`` for any ``tau``; the cost of every candidate between
  ``min P`` and ``max P + 1`` is evaluated at once (a bisection of fixed length when there are
  too many), and ``tau = min P + #{candidates over budget}`` since the cost only falls;
* the level of a value without a mask per width: a ``1/1024``-wide cell of ``[-1, 1]`` and
  the group's width index a table of the count of keys below the cell and of the next key
  (no width has two keys within three cells), and one comparison finishes the count. Nearest
  rounding counts precomputed round-up thresholds (the smallest fp32 value that the rounding
  arithmetic, ``(y - lower) / gap > 0.5``, sends up to each level, found by bisection over
  fp32 values: that arithmetic is monotone in ``y``), which is the code itself; stochastic
  rounding counts the levels below ``y`` (``searchsorted``) and divides as the first version
  did;
* packing: the codes of a group all have the group's width, so with ``group % 8 == 0`` every
  8 codes make exactly ``w`` whole bytes: one 64-bit word of shifted codes, whose bytes from
  ``w`` on are zero, so all 8 are added in place with one ``scatter_add`` (the bits are
  disjoint); unpacking reads the 8 bytes at each word's offset as one int64. Other group sizes
  place each code in its (at most) two bytes.

On the CPU, :mod:`dynamiq.kernels` runs CPU tensors of at least 4096 values through the
native C++ kernel (:mod:`dynamiq.kernels.cpu_native`, ``csrc/dynamiq_kernels.cpp``: the same
bytes, 15-20x faster than this reference). With ``DYNAMIQ_CPU_COMPILE=1`` instead, the block
functions ``_encode_rows``, ``_decode_rows`` and ``_reduce_rows`` are compiled by
``torch.compile`` (once per codec and operation, the number of spans symbolic) and take all
the full spans of a call at once.

The normative definition of the wire format is the readable, span-by-span reference
:mod:`dynamiq.codecs.dynamiq_reference` (the first version, which also takes the prologue's
budgets): this batched codec, its compiled block functions, the Triton and the native kernels
must all give its bytes, values and bounds (``tests/codecs/test_dynamiq_codec.py``, every
knob; ``tests/codecs/test_dynamiq_reference.py``, the default configuration under a
prologue).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from . import _dynamiq_pool as _pool
from ._dynamiq_levels import DISTORTION_FITTED, LEVELS
from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .formats import exponent_of
from .hashing import hash_keys, hash_u32, uniform_open01
from .registry import register_codec

if TYPE_CHECKING:
    from .dynamiq_wire import DynamiqWire

__all__ = ["DynamiqCodec", "level_table"]


def _priority(k: int) -> tuple[int, ...]:
    """round(4k log2(D(w) - D(w + 1))) for w = 0..7 (integers shared by both sides)."""
    d = DISTORTION_FITTED
    return tuple(round(4 * k * math.log2(d[w] - d[w + 1])) for w in range(8))


_PRIORITY = {k: _priority(k) for k in range(1, 5)}

_MAX_W = 8
_E_MAX = 15  # group codes are 4 bits
#: values per block of spans processed together by the reference (bounds its memory)
_BLOCK = 1 << 20
#: most (spans x thresholds) whose water-filling cost is evaluated at once (else: bisection)
_TAU_GRID = 1 << 16
#: cells per unit of the level lookup (``[-1, 1]`` has ``2 * _CELLS`` of them)
_CELLS = 1024
#: row stride of the level table (the widest table, 2^8 levels, and a +inf sentinel)
_ROW = (1 << _MAX_W) + 1
#: little-endian machines read the bytes of a 64-bit word by a view, others by shifts
_LITTLE = sys.byteorder == "little"


def level_table(kind: str, width: int) -> torch.Tensor:
    """The ``2^width`` levels (fp32, ascending, within [-1, 1]) of a width; empty for 0."""
    if width == 0:
        return torch.zeros(0)
    if kind == "fitted":
        half = torch.tensor(LEVELS[width], dtype=torch.float32)
        return torch.cat([-half.flip(0), half])
    n = 1 << width
    k = torch.arange(n, dtype=torch.float64)
    return (2 * k / (n - 1) - 1).float()


def _max_error_units(levels: torch.Tensor, stochastic: bool) -> float:
    """Largest |level - y| for y in [-1, 1] (nearest), or the largest gap (stochastic), in
    units of the group scale."""
    if levels.numel() == 0:
        return 1.0
    lv = levels.double()
    gaps = lv[1:] - lv[:-1] if lv.numel() > 1 else torch.zeros(1, dtype=torch.float64)
    ends = max(float(lv[0] + 1), float(1 - lv[-1]))
    inner = float(gaps.max()) if stochastic else float(gaps.max()) / 2
    return max(inner, ends)


@dataclass(frozen=True)
class RoundingTables:
    """The level tables of one configuration, laid out for batched lookups on one device.

    ``levels``: rows of ``_ROW`` entries, one per width ``w`` (flattened), ``levels[w, i]``
    level ``i`` (``levels[0, 0] = 0``, what width 0 decodes to). A value ``y`` in [-1, 1]
    falls in cell ``c = floor((y + 1) · _CELLS)``; ``base[w, c]`` counts the keys of width
    ``w`` below the cell, less a margin of one cell, and ``key[w, c]`` is the next key (+inf
    if none): since no width has two keys within three cells, the count of keys below ``y``
    is ``base + (key < y)`` (``<=`` for thresholds). Nearest rounding counts round-up
    thresholds (the smallest fp32 ``y`` that rounds up to each level but the first, found by
    bisection on the very fp32 arithmetic of rounding, which is monotone in ``y``): that is
    the code. Stochastic rounding counts the levels below ``y`` (the upper neighbour), then
    reads the neighbour below (``lower``) and the gap (``gap``) by the upper neighbour's
    flat index ``w · _ROW + hi``. ``units[w]``: ``m_w`` of the error bound.
    """

    levels: torch.Tensor  # [9 * _ROW] fp32
    base: torch.Tensor  # [9 * (2 * _CELLS + 1)] int32
    key: torch.Tensor  # [9 * (2 * _CELLS + 1)] fp32
    lower: torch.Tensor  # [9 * _ROW] fp32: lower[w, h] = levels[w, h - 1]
    gap: torch.Tensor  # [9 * _ROW] fp32: gap[w, h] = levels[w, h] - levels[w, h - 1]
    units: torch.Tensor  # [9] fp64


def _float_key(f: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 keys in the same order (both zeros: 0)."""
    b = f.view(torch.int32).to(torch.int64)
    return torch.where(b >= 0, b, -(b & 0x7FFFFFFF))


def _key_float(k: torch.Tensor) -> torch.Tensor:
    b = torch.where(k >= 0, k, (-k) | 0x80000000)
    return (b - ((b >> 31) << 32)).to(torch.int32).view(torch.float32)


def _round_up_points(lv: torch.Tensor) -> torch.Tensor:
    """For each gap ``(lv[i - 1], lv[i]]`` of a level table, the smallest fp32 ``y`` that
    nearest rounding sends up: ``fl(fl(y - lv[i - 1]) / fl(lv[i] - lv[i - 1])) > 0.5``."""
    lo, hi = lv[:-1], lv[1:]
    gap = hi - lo
    a, b = _float_key(lo), _float_key(hi)  # not up at lo (0), up at hi (1): bisect (a, b]
    while bool((b - a > 1).any()):
        mid = (a + b) >> 1
        up = (_key_float(mid) - lo) / gap > 0.5
        a, b = torch.where(up, a, mid), torch.where(up, mid, b)
    return _key_float(b)


@functools.lru_cache(maxsize=32)
def _tables(kind: str, stretched: bool, device: torch.device) -> RoundingTables:
    n_cells = 2 * _CELLS + 1
    levels = torch.full((_MAX_W + 1, _ROW), math.inf, dtype=torch.float32)
    lower = torch.zeros((_MAX_W + 1, _ROW), dtype=torch.float32)
    gap = torch.ones((_MAX_W + 1, _ROW), dtype=torch.float32)
    base = torch.zeros((_MAX_W + 1, n_cells), dtype=torch.int32)
    key = torch.full((_MAX_W + 1, n_cells), math.inf, dtype=torch.float32)
    levels[0, 0] = 0.0
    units = []
    # every point a value in cell c can be, with a margin of one cell for the fp32 rounding
    # of y + 1 (|error| <= 2^-23, far below a cell)
    lo_edge = torch.arange(n_cells, dtype=torch.float64) / _CELLS - 1 - 1 / _CELLS
    hi_edge = lo_edge + 3 / _CELLS
    for w in range(_MAX_W + 1):
        lv = level_table(kind, w)
        if stretched and lv.numel():
            lv = lv / lv.abs().max()
        units.append(_max_error_units(lv, stretched))
        if w == 0:
            continue
        n = lv.numel()
        levels[w, :n] = lv
        lower[w, 1:n] = lv[:-1]
        gap[w, 1:n] = lv[1:] - lv[:-1]
        keys = lv if stretched else _round_up_points(lv)
        kd = keys.double()
        # keys below the cell (levels: <, thresholds: <=; the margin makes both the same)
        first = torch.searchsorted(kd, lo_edge)
        if bool((torch.searchsorted(kd, hi_edge) - first > 1).any()):  # pragma: no cover
            raise AssertionError(f"level table {kind!r} width {w} has two keys in one cell")
        base[w] = first.to(torch.int32)
        padded = torch.cat([keys, torch.full((1,), math.inf)])
        key[w] = padded[first]
    return RoundingTables(
        levels=levels.reshape(-1).to(device),
        base=base.reshape(-1).to(device),
        key=key.reshape(-1).to(device),
        lower=lower.reshape(-1).to(device),
        gap=gap.reshape(-1).to(device),
        units=torch.tensor(units, dtype=torch.float64, device=device),
    )


@functools.lru_cache(maxsize=8)
def group_scale_tables(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each 4-bit group code ``e``: ``2^(-(e mod k)/k)`` and ``2^-(e div k)`` (fp32 on
    the CPU, ``k = scale_steps``): the group scale is ``fl32(S · steps[e]) · powers[e]``."""
    codes = range(_E_MAX + 1)
    steps = torch.tensor([2.0 ** (-(c % k) / k) for c in codes], dtype=torch.float32)
    powers = torch.tensor([2.0 ** -(c // k) for c in codes], dtype=torch.float32)
    return steps, powers


@functools.lru_cache(maxsize=32)
def _priority_tables(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q`` (int64 [8]) and ``count[i] = #{w: Q[w] >= min(Q) + i}`` for ``i`` in
    ``0 .. max(Q) - min(Q) + 1`` (the width of a group whose next bit would be worth less)."""
    q = _PRIORITY[k]
    lo, hi = min(q), max(q)
    count = [sum(qw >= lo + i for qw in q) for i in range(hi - lo + 2)]
    return torch.tensor(q, device=device), torch.tensor(count, device=device)


@register_codec
@dataclass(frozen=True, kw_only=True)
class DynamiqCodec(Codec):
    """Partial-sum-aware span quantizer (see the module docstring for the design).

    Error bound per element of a group with scale ``s`` (``S·2^-e``) and width ``w`` derived
    from the span's scale codes, ``m_w`` the largest distance from a point of [-1, 1] to its
    nearest level (nearest) or the largest level gap (stochastic, correlated)::

        w = 0:  |x̂ - x| <= absmax_g
        w > 0:  |x̂ - x| <= s · (m_w + 2^-22) + 2^-149

    (the ``2^-22`` covers the fp32 rounding of ``x / s`` and of ``level · s`` relative to
    ``s``; ``2^-149``, fp32's smallest subnormal, the absolute rounding of ``level · s`` where
    it is subnormal, whose spacing is fixed: a constant block of ``2^-133`` errs by
    ``3.51025e-42``, more than ``s · (m_w + 2^-22) = 3.50970e-42``). Elements of a super-group
    holding NaN or ±Inf have no bound (``inf``: they decode to NaN); the others keep theirs.
    """

    codec_id: ClassVar[str] = "dynamiq"
    kernel_family: ClassVar[str | None] = "dynamiq"  # dynamiq/kernels/_declared.py
    nonfinite: ClassVar[str] = (
        "A super-group holding NaN or ±Inf gets a NaN scale and decodes to NaN."
    )

    #: the absolute term of the bound (fp32's smallest subnormal; a ClassVar, not config)
    _bound_abs: ClassVar[float] = 2.0**-149

    bits: float = 4.62
    span: int = 256
    super_group: int = 256
    group: int = 16
    levels: str = "fitted"
    rounding: str = "nearest"
    hop_slope: float = 0.0
    pooled: bool = True
    scale_steps: int = 2
    pooling: str = "bucket"
    balance: float = 1.15
    balance_slack: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise TypeError(f"bits must be a number (got {type(self.bits).__name__})")
        if not 0.5 <= self.bits <= 8:
            raise ValueError(f"bits must be in 0.5..8 (got {self.bits})")
        check_int("group", self.group, 2, 256)
        check_int("super_group", self.super_group, self.group, 1 << 16)
        check_int("span", self.span, self.super_group, 1 << 20)
        if self.super_group % self.group or self.span % self.super_group:
            raise ValueError(
                f"span ({self.span}) must be a multiple of super_group ({self.super_group}), "
                f"itself a multiple of group ({self.group})"
            )
        check_choice("levels", self.levels, ("fitted", "uniform"))
        check_choice("rounding", self.rounding, ("nearest", "stochastic", "correlated"))
        check_choice("pooling", self.pooling, ("span", "bucket"))
        if isinstance(self.balance, bool) or not isinstance(self.balance, (int, float)):
            raise TypeError(f"balance must be a number (got {type(self.balance).__name__})")
        if not 1.0 <= self.balance <= 1e6:
            raise ValueError(f"balance must be in 1..1e6 (got {self.balance})")
        check_int("balance_slack", self.balance_slack, 0, 1 << 30)
        if not isinstance(self.hop_slope, (int, float)) or not 0 <= self.hop_slope <= 4:
            raise ValueError(f"hop_slope must be in 0..4 (got {self.hop_slope})")
        check_int("scale_steps", self.scale_steps, 1, 4)
        if not isinstance(self.pooled, bool):
            raise TypeError(f"pooled must be a bool (got {self.pooled!r})")

    @property
    def block_size(self) -> int:
        return self.span

    @property
    def bound_block(self) -> int:
        return self.super_group  # a NaN/Inf super-group is dead; the others keep their bounds

    def _levels(self, width: int) -> torch.Tensor:
        """The level table of a width; for stochastic and correlated rounding stretched to
        endpoints ±1, so that every value lies between two levels (unbiased rounding)."""
        lv = level_table(self.levels, width)
        if self.rounding != "nearest" and lv.numel():
            lv = lv / lv.abs().max()
        return lv

    def _tables(self, device: torch.device) -> RoundingTables:
        return _tables(self.levels, self.rounding != "nearest", device)

    def wire(self) -> DynamiqWire:
        """What a kernel reads to write and read this configuration's bytes: tables,
        priorities, budgets (:class:`~dynamiq.codecs.dynamiq_wire.DynamiqWire`; one per
        configuration)."""
        from .dynamiq_wire import wire_of

        return wire_of(self)

    @property
    def max_input_abs(self) -> float:
        return 2.0**127

    # -- sizes --------------------------------------------------------------------------

    def _bits_at(self, ctx: HopContext | None) -> float:
        if ctx is None or ctx.num_hops <= 1 or self.hop_slope == 0:
            return float(self.bits)
        rel = (ctx.hop - (ctx.num_hops - 1) / 2) / (ctx.num_hops - 1)
        return min(8.0, max(0.0, self.bits + self.hop_slope * rel))

    def _budget(self, length: int, ctx: HopContext | None) -> int:
        return math.floor(self._bits_at(ctx) * length)

    def _header_bytes(self, length: int) -> tuple[int, int]:
        """(bytes of the super-group scales, bytes of the group codes) of a span."""
        return 2 * -(-length // self.super_group), (-(-length // self.group) * 4 + 7) // 8

    def _span_bytes(self, length: int, ctx: HopContext | None) -> int:
        sb, eb = self._header_bytes(length)
        return sb + eb + (self._budget(length, ctx) + 7) // 8

    def _pool_shared(self, ctx: HopContext | None) -> Any:
        """``ctx.shared`` where the spans' budgets may come from a prologue's result."""
        if self.pooling != "bucket" or ctx is None:
            return None
        return ctx.shared

    def _pooled_bytes(self, numel: int, ctx: HopContext | None) -> torch.Tensor | None:
        """Container bytes of each span of ``numel`` values at ``ctx.offset`` from the
        prologue's result (int64, CPU), or ``None``: every span has the uniform budget."""
        shared = self._pool_shared(ctx)
        if shared is None:
            return None
        assert ctx is not None
        return _pool.chunk_budgets(self, shared, numel, ctx.offset, self._bits_at(ctx))

    def _pooled_total(self, numel: int, ctx: HopContext | None) -> int | None:
        """``int(_span_sizes(numel, budgets).sum())`` of the pooled budgets (the payload's
        bytes) from the pool's memoized prefix sums, without tensors; ``None`` as
        :meth:`_pooled_bytes`."""
        shared = self._pool_shared(ctx)
        if shared is None:
            return None
        assert ctx is not None
        pooled = _pool.chunk_bytes(self, shared, numel, ctx.offset, self._bits_at(ctx))
        if pooled is None:
            return None
        full, rest = divmod(numel, self.span)
        head = sum(self._header_bytes(self.span))
        last = sum(self._header_bytes(rest)) - head if rest else 0
        return pooled + (full + (1 if rest else 0)) * head + last

    def _pooled_kernel_args(
        self, numel: int, ctx: HopContext | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pooled spans' budgets (bits) and payload offsets the native kernels take
        (:func:`~dynamiq.codecs._dynamiq_pool.chunk_kernel_args`), or ``None``."""
        shared = self._pool_shared(ctx)
        if shared is None:
            return None
        assert ctx is not None
        return _pool.chunk_kernel_args(self, shared, numel, ctx.offset, self._bits_at(ctx))

    def _pooled_kernel_ptrs(
        self, numel: int, ctx: HopContext | None
    ) -> tuple[int, int, int] | None:
        """What ``dq_dyn_run`` takes for the pooled spans of ``numel > 0`` values
        (:func:`~dynamiq.codecs._dynamiq_pool.chunk_kernel_ptrs`), or ``None``."""
        shared = self._pool_shared(ctx)
        if shared is None:
            return None
        assert ctx is not None
        return _pool.chunk_kernel_ptrs(self, shared, numel, ctx.offset, self._bits_at(ctx))

    def shared_tensors(self, shared: Mapping[str, Any] | None) -> list[torch.Tensor]:
        """The prologue's pool as tensors (``[]`` without one:
        :func:`~dynamiq.codecs._dynamiq_pool.pool_tensors`)."""
        return _pool.pool_tensors(shared)

    def shared_from_tensors(self, tensors: list[torch.Tensor]) -> Mapping[str, Any] | None:
        return _pool.pool_from_tensors(tensors)

    def _span_budgets(self, numel: int, ctx: HopContext | None) -> torch.Tensor:
        """The budget (bits) of each span of ``numel`` values (int64, CPU)."""
        pooled = self._pooled_bytes(numel, ctx)
        if pooled is not None:
            return pooled * 8
        full, rest = divmod(numel, self.span)
        out = torch.full((full + (1 if rest else 0),), self._budget(self.span, ctx))
        if rest:
            out[-1] = self._budget(rest, ctx)
        return out

    def _span_sizes(self, numel: int, budgets: torch.Tensor) -> torch.Tensor:
        """Bytes of each span's payload (int64, CPU) for its budget (bits)."""
        rest = numel % self.span
        sizes = (budgets + 7) // 8 + sum(self._header_bytes(self.span))
        if rest:
            sizes[-1] += sum(self._header_bytes(rest)) - sum(self._header_bytes(self.span))
        return sizes

    def _span_offset_tensor(self, numel: int, budgets: torch.Tensor) -> torch.Tensor:
        """Byte offset of each span's payload (int64, CPU; ``len(budgets)``, the total not
        included): what the kernels take."""
        sizes = self._span_sizes(numel, budgets)
        return torch.cumsum(sizes, 0) - sizes

    def _span_offsets(self, numel: int, budgets: torch.Tensor) -> list[int]:
        """Byte offset of each span's payload, and the total (``len(budgets) + 1`` ints)."""
        return [0, *torch.cumsum(self._span_sizes(numel, budgets), 0).tolist()]

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        pooled = self._pooled_total(numel, ctx)
        if pooled is not None:
            return pooled
        full, rest = divmod(numel, self.span)
        return full * self._span_bytes(self.span, ctx) + (
            self._span_bytes(rest, ctx) if rest else 0
        )

    def check_range(self, x: torch.Tensor, ctx: HopContext | None) -> None:
        """Raise ``ValueError`` for a finite ``|x|`` beyond ``max_input_abs`` (its
        super-group's scale would round up to infinity). In a collective the prologue has
        checked every rank's input already (``ctx.shared`` holds its result): no pass here."""
        if ctx is not None and ctx.shared is not None and _pool.SHARED_KEY in ctx.shared:
            return
        if x.numel() == 0:
            return
        big = float(torch.where(torch.isfinite(x), x.abs(), 0).amax())
        if big > self.max_input_abs:
            raise ValueError(
                f"dynamiq: |x| = {big!r} exceeds max_input_abs={self.max_input_abs!r} (its "
                f"super-group scale would round up to infinity)"
            )

    # -- prologue: the bucket's statistics --------------------------------------------------

    def prologue(self, x: torch.Tensor, comm: Any) -> dict[str, Any] | None:
        """``pooling="bucket"``: agree on every span's demand by one exact all-reduce (max)
        of a byte a span, and check the input range on every rank (see
        :mod:`dynamiq.codecs._dynamiq_pool`); ``None`` for ``pooling="span"``. The chunks
        come from ``comm.chunks`` (the engine's), else the whole buffer is one region."""
        from dynamiq.collectives.handshake import allreduce_exact  # not at import: cycle

        chunks = getattr(comm, "chunks", None)
        stats = self.prologue_statistics(x, comm.rank, chunks)
        if stats is None:
            return None
        reduced = allreduce_exact(comm, stats, "max")
        align = getattr(comm, "recut_align", None)
        return self.prologue_result(reduced, x.numel(), comm.world_size, chunks, align)

    #: how :meth:`prologue` combines the ranks' :meth:`prologue_statistics` (the simulator
    #: reduces them in process, counting the bytes of the engine's ring)
    prologue_op: ClassVar[str] = "max"

    def prologue_statistics(
        self, x: torch.Tensor, rank: int, chunks: list[tuple[int, int]] | None
    ) -> torch.Tensor | None:
        """This rank's part of the prologue: its per-span demand and flags (integers);
        ``None`` for ``pooling="span"`` (no prologue)."""
        if self.pooling != "bucket":
            return None
        regions = _pool.regions_of(self, x.numel(), chunks)
        return _pool.span_statistics(self, x, rank, regions)

    def prologue_result(
        self,
        reduced: torch.Tensor,
        numel: int,
        world_size: int,
        chunks: list[tuple[int, int]] | None,
        recut_align: int | None = None,
    ) -> dict[str, Any]:
        """``HopContext.shared`` from the all-reduced statistics (raises ``ValueError`` on bad
        input of any rank); with ``recut_align`` (the engine's ``PrologueComm.recut_align``)
        it also holds the chunk bounds of equal bytes the engine then cuts by."""
        regions = _pool.regions_of(self, numel, chunks)
        parts = len(chunks) if chunks else 1
        return _pool.shared_from_statistics(
            self, reduced, numel, world_size, regions, recut_align, parts
        )

    def _blocks(self, numel: int, compiled_op: str | None = None) -> list[tuple[int, int, int]]:
        """``(first span, spans, length)`` of each block processed together: runs of full
        spans of about :data:`_BLOCK` values, then the short last span on its own. A compiled
        operation (unless its compilation failed) takes all the full spans at once: few,
        large parallel loops."""
        full, rest = divmod(numel, self.span)
        from dynamiq.kernels import _compiled  # not at import: the codecs come first

        whole = compiled_op is not None and not _compiled.failed(self, f"{compiled_op}_rows")
        per = max(1, full if whole else _BLOCK // self.span)
        out = [(a, min(per, full - a), self.span) for a in range(0, full, per)]
        if rest:
            out.append((full, 1, rest))
        return out

    def _padded(self, length: int) -> int:
        """A span's length padded to whole super-groups (the length of a block's rows)."""
        return -(-length // self.super_group) * self.super_group

    # -- statistics -----------------------------------------------------------------------

    def _stats(self, x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(super-group scales S [m, n_sg], group codes e [m, n_g], group absmax [m, n_g]) of
        ``m`` spans given as ``[m, n_g, group]`` fp32 values (zero-padded to super-groups)."""
        a_g = x3.abs().amax(dim=2)
        s_sg, e = self._scale_codes(a_g)
        return s_sg, e, a_g

    def _scale_codes(self, a_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S [m, n_sg], e [m, n_g]) from the group absmax ``[m, n_g]``."""
        m, n_g = a_g.shape
        per_sg = self.super_group // self.group
        a_sg = a_g.view(m, n_g // per_sg, per_sg).amax(dim=2)
        s_sg = _bf16_round_up(a_sg)
        # e: the largest code in 0..15 whose group scale s(S, e) is still >= a_g; s is
        # evaluated exactly as the decoder will, so s >= a_g holds for the chosen e
        codes = torch.arange(_E_MAX + 1, device=a_g.device)
        cand = self._group_scale(s_sg.unsqueeze(2), codes)  # [m, n_sg, 16]
        ok = cand.unsqueeze(2) >= a_g.view(m, n_g // per_sg, per_sg, 1)
        rank = torch.arange(1, _E_MAX + 2, dtype=torch.int32, device=a_g.device)
        e = (ok.to(torch.int32) * rank).amax(dim=3).view(m, n_g).to(torch.int64) - 1
        e = torch.where(a_g == 0, _E_MAX, e.clamp(0, _E_MAX))
        return s_sg, e

    def _per_group(self, t: torch.Tensor) -> torch.Tensor:
        """A per-super-group ``[m, n_sg]`` tensor repeated for each of its groups."""
        per_sg = self.super_group // self.group
        m, n_sg = t.shape
        return t.unsqueeze(2).expand(m, n_sg, per_sg).reshape(m, n_sg * per_sg)

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(super-group scales S [n_sg], group codes e [n_g], group absmax [n_g]) of one span
        of 1-D values."""
        n = x.numel()
        n_g = -(-n // self.group)
        xp = torch.zeros(self._padded(n), dtype=torch.float32, device=x.device)
        xp[:n] = x
        s_sg, e, a_g = self._stats(xp.view(1, -1, self.group))
        return s_sg[0], e[0, :n_g], a_g[0, :n_g]

    def _group_scale(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``fl32(S · 2^(-(e mod k)/k)) · 2^-(e div k)`` with ``k = scale_steps`` (fp32)."""
        steps, powers = group_scale_tables(self.scale_steps)
        # times an exact power of two: one rounding, as torch.ldexp
        return (s * _take(steps.to(s.device), e)) * _take(powers.to(s.device), e)

    def _widths(
        self, s_sg: torch.Tensor, e: torch.Tensor, length: int, budget: int
    ) -> torch.Tensor:
        """Bits per element of each group of one span (1-D scales and codes)."""
        n_g = e.numel()
        n_gp = self._padded(length) // self.group
        ep = torch.full((1, n_gp), _E_MAX, dtype=torch.int64, device=e.device)
        ep[0, :n_g] = e
        b = torch.tensor([[budget]], device=e.device)
        return self._widths_rows(s_sg.unsqueeze(0), ep, length, b)[0, :n_g]

    def _widths_rows(
        self, s_sg: torch.Tensor, e: torch.Tensor, length: int, budget: torch.Tensor
    ) -> torch.Tensor:
        """Bits per element of each group ``[m, n_g]`` of ``m`` spans of ``length`` values,
        from integer scale codes only (both sides): ``s_sg`` ``[m, n_sg]`` (non-finite scales
        already zeroed), ``e`` ``[m, n_g]`` (groups past ``length`` are padding: width 0),
        ``budget`` ``[m, 1]`` (int64: each span's bits)."""
        m, n_gp = e.shape
        g, k, dev = self.group, self.scale_steps, e.device
        start = torch.arange(n_gp, device=dev) * g
        sizes = (length - start).clamp(0, g)  # elements of each group (0: padding)
        level = k * self._per_group(exponent_of(s_sg)) - e  # log2 of s_g in 1/k bits
        live = (self._per_group(s_sg) > 0) & (sizes > 0)
        if not self.pooled:
            # ablation: every group gets the same width (no variable bit-width)
            flat = (budget // max(length, 1)).clamp(max=_MAX_W)
            return torch.where(live, flat, 0).to(torch.int64)
        # reverse water-filling by marginal gain: the next bit of group g at width w is worth
        # s_g^2 (D(w) - D(w + 1)), D the fitted tables' distortion; in integers, 4k log2 of it:
        # P[g, w] = 8 L_g + Q[w], decreasing in w; widths are the counts of P >= tau for the
        # smallest tau that fits the budget (tau in [min P, max P + 1] over live groups)
        q_list = _PRIORITY[k]
        q, count = _priority_tables(k, dev)
        big = 1 << 20
        any_live = live.any(dim=1)
        l_min = torch.where(live, level, big).amin(dim=1)
        l_max = torch.where(live, level, -big).amax(dim=1)
        l_min = torch.where(any_live, l_min, 0)
        l_max = torch.where(any_live, l_max, 0)
        # histogram of the live groups' levels (weighted by size), relative to the span's
        # lowest level, and its suffix sums: suf[j] = elements of the groups with L >= l_min+j
        n_bins = self._n_bins(l_max - l_min)
        rel = torch.where(live, level - l_min.unsqueeze(1), n_bins)
        hist = torch.zeros(m, n_bins + 1, dtype=torch.int64, device=dev)
        hist.scatter_add_(1, rel, torch.where(live, sizes, 0))
        suf = hist.flip(1).cumsum(1).flip(1)  # suf[:, n_bins] = 0 (padding weighs 0)
        # the smallest tau in [lo, hi] with cost <= budget, for all spans at once; a group of
        # level L takes its bit w at tau iff L >= ceil((tau - Q[w]) / 8)
        q_lo, q_hi = min(q_list), max(q_list)
        lo = 8 * l_min + q_lo
        hi = 8 * l_max + q_hi + 1  # cost(hi) = 0 <= budget
        n_tau = 8 * (n_bins - 1) + q_hi - q_lo + 2  # > hi - lo for every span

        def cost(tau: torch.Tensor) -> torch.Tensor:  # [m, t] thresholds -> [m, t] bits
            j = ((tau.unsqueeze(2) - q + 7) >> 3) - l_min.view(m, 1, 1)
            return torch.gather(suf, 1, j.clamp(0, n_bins).view(m, -1)).view(j.shape).sum(2)

        if m * n_tau <= _TAU_GRID:
            # every candidate: cost is non-increasing, so tau = lo + #{cost > budget}
            grid = lo.unsqueeze(1) + torch.arange(n_tau, device=dev)
            tau = lo + (cost(grid) > budget).sum(dim=1)
        else:
            # bisection, a fixed number of steps
            for _ in range(n_tau.bit_length()):
                mid = (lo + hi) >> 1  # floor((lo + hi) / 2)
                fits = cost(mid.unsqueeze(1)).squeeze(1) <= budget.squeeze(1)
                hi = torch.where(fits, mid, hi)
                lo = torch.where(fits, lo, mid + 1)
            tau = lo
        tau = tau.unsqueeze(1)
        # widths: how many Q[w] >= tau - 8 L (a table over the range of Q)
        prio0 = 8 * level
        w = _take(count, (tau - prio0 - q_lo).clamp(0, q_hi - q_lo + 1))
        w = torch.where(live, w, 0)
        # leftover bits: raise the groups whose next bit is worth tau - 1, in index order
        left = budget - (w * sizes).sum(dim=1, keepdim=True)
        nxt = prio0 + _take(q, w.clamp(max=_MAX_W - 1))
        rising = live & (w < _MAX_W) & (nxt == tau - 1)
        cum = torch.cumsum(torch.where(rising, sizes, 0), dim=1)
        return w + (rising & (cum <= left)).to(torch.int64)

    def _n_bins(self, level_range: torch.Tensor) -> int:
        """Histogram bins for the spans' ranges of group levels: the largest range present
        (one host read), or, while ``torch.compile`` traces, the largest possible (a bf16
        scale's exponent is in -133..127, a code in 0..15)."""
        if torch.compiler.is_compiling() or level_range.numel() == 0:
            return self.scale_steps * 260 + _E_MAX + 1
        return int(level_range.max()) + 1

    # -- encode / decode ----------------------------------------------------------------

    def _span_ctx_u(self, idx: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        """The dither of each coordinate (global indices ``idx``) at this hop."""
        v = uniform_open01(hash_u32(idx, hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)))
        if self.rounding == "stochastic" or ctx.num_hops <= 1:
            return v
        h = ctx.num_hops
        # per-coordinate cyclic shift of the hops, shared by all hops and ranks
        shift = hash_u32(idx, hash_keys(ctx.seed, ctx.step, 0xFFFFFFFF, 0xFFFFFFFF)) % h
        stratum = (shift + ctx.hop) % h
        # divided by a tensor: an IEEE division on every device (CUDA turns division by a
        # Python number into a multiplication by its reciprocal, a different rounding)
        num = stratum.to(torch.float32) + v
        return num / torch.full_like(num, float(h))

    def _dither(
        self, ctx: HopContext, first: int, m: int, length: int, device: torch.device
    ) -> torch.Tensor | None:
        """The dither ``[m, n_g, group]`` of spans ``first .. first + m`` (``None`` for
        nearest rounding); the padding of a short span gets values too (unused)."""
        if self.rounding == "nearest":
            return None
        n = m * self._padded(length)
        idx = torch.arange(n, device=device, dtype=torch.int64) + ctx.offset + first * self.span
        return self._span_ctx_u(idx, ctx).view(m, -1, self.group)

    def _rows(self, x: torch.Tensor, first: int, m: int, length: int) -> torch.Tensor:
        """Spans ``first .. first + m`` of the 1-D ``x`` as fp32 ``[m, n_g, group]``
        (the short last span zero-padded to whole super-groups)."""
        a = first * self.span
        if length == self.span:
            return x[a : a + m * length].view(m, -1, self.group).float()
        xp = torch.zeros(self._padded(length), dtype=torch.float32, device=x.device)
        xp[:length] = x[a : a + length]
        return xp.view(1, -1, self.group)

    def _run(self, op: str, compiled: bool, length: int) -> Callable[..., torch.Tensor]:
        """The block function ``_{op}_rows``; compiled when asked, for blocks of full spans
        (the short last span runs plain: one shape fewer to compile)."""
        fn = getattr(self, f"_{op}_rows")
        if not compiled or length != self.span:
            return fn
        from dynamiq.kernels import _compiled

        return functools.partial(_compiled.run, self, f"{op}_rows", dynamic_rows=True)

    def _encode(self, x: torch.Tensor, ctx: HopContext, *, compiled: bool = False) -> torch.Tensor:
        """The reference encode; ``compiled``: the CPU fast path's compiled block functions
        (what :mod:`dynamiq.kernels` asks for when ``DYNAMIQ_CPU_COMPILE=1``), same bytes."""
        n = x.numel()
        self.check_range(x, ctx)
        budgets = self._span_budgets(n, ctx)
        offs = self._span_offsets(n, budgets)
        out = torch.empty(offs[-1], dtype=torch.uint8, device=x.device)
        tables = self._tables(x.device)
        for first, m, length in self._blocks(n, "encode" if compiled else None):
            b = budgets[first : first + m]
            rows = self._run("encode", compiled, length)(
                self._rows(x, first, m, length),
                length,
                b.view(m, 1).to(x.device),
                (int(b.max()) + 7) // 8,
                tables,
                self._dither(ctx, first, m, length, x.device),
            )
            out[offs[first] : offs[first + m]] = _compact(rows, offs[first : first + m + 1])
        return out

    def _encode_rows(
        self,
        x3: torch.Tensor,
        length: int,
        budget: torch.Tensor,
        nbytes: int,
        tables: RoundingTables,
        u: torch.Tensor | None,
    ) -> torch.Tensor:
        """The wire bytes ``[m, header + nbytes]`` of ``m`` spans ``[m, n_g, group]`` (fp32)
        of ``length`` values each (padding zero), containers of ``budget`` ``[m, 1]`` bits
        each (zero bytes past a span's own container, up to ``nbytes``); ``u``: the dither
        (``None``: nearest)."""
        m, _, g = x3.shape
        n_g = -(-length // g)
        s_sg, e = self._scale_codes(x3.abs().amax(dim=2))
        w = self._widths_rows(torch.where(torch.isfinite(s_sg), s_sg, 0.0), e, length, budget)
        s3 = self._group_scale(self._per_group(s_sg), e).unsqueeze(2)
        safe = torch.where((s3 > 0) & torch.isfinite(s3), s3, 1.0)
        y = torch.where(s3 > 0, x3 / safe, 0.0).clamp(-1, 1)
        code = _quantize(y, w, tables, u)
        if length % g:  # the padding of the short last group packs as zeros
            code[:, n_g - 1, length - (n_g - 1) * g :] = 0
        sb, eb = self._header_bytes(length)
        bits16 = (s_sg.view(torch.int32) >> 16) & 0xFFFF  # the bf16 bit patterns
        header = torch.stack([bits16 & 255, bits16 >> 8], dim=2).view(m, sb)
        return torch.cat(
            [header.to(torch.uint8), _pack4(e[:, :n_g], eb), _pack_codes(code, w, nbytes)],
            dim=1,
        )

    def _decode(
        self, payload: torch.Tensor, numel: int, ctx: HopContext, *, compiled: bool = False
    ) -> torch.Tensor:
        """The reference decode (``compiled``: as for :meth:`_encode`)."""
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        tables = self._tables(payload.device)
        budgets = self._span_budgets(numel, ctx)
        offs = self._span_offsets(numel, budgets)
        for first, m, length in self._blocks(numel, "decode" if compiled else None):
            b = budgets[first : first + m]
            vals = self._run("decode", compiled, length)(
                _expand(
                    payload, offs[first : first + m + 1], (int(b.max()) + 7) // 8, self, length
                ),
                length,
                b.view(m, 1).to(payload.device),
                tables,
            )
            a = first * self.span
            out[a : a + m * length] = vals.view(m, -1)[:, :length].reshape(-1)
        return out

    def _decode_rows(
        self, p2: torch.Tensor, length: int, budget: torch.Tensor, tables: RoundingTables
    ) -> torch.Tensor:
        """Values ``[m, n_g, group]`` (fp32; padding included) of ``m`` spans of ``length``
        values from their wire bytes ``[m, header + container]`` (containers of ``budget``
        ``[m, 1]`` bits, zero past them)."""
        m = p2.shape[0]
        g = self.group
        n_g = -(-length // g)
        n_gp = self._padded(length) // g
        sb, eb = self._header_bytes(length)
        raw = p2[:, :sb].to(torch.int64)
        s_sg = _bf16_value(raw[:, 0::2] | (raw[:, 1::2] << 8))
        e = _unpack4(p2[:, sb : sb + eb], n_g)
        if n_g < n_gp:
            e = torch.cat([e, torch.full((m, n_gp - n_g), _E_MAX, device=p2.device)], dim=1)
        w = self._widths_rows(torch.where(torch.isfinite(s_sg), s_sg, 0.0), e, length, budget)
        s3 = self._group_scale(self._per_group(s_sg), e).unsqueeze(2)
        code = _unpack_codes(p2[:, sb + eb :], w, g)
        # width 0: code 0, row 0, level 0
        return _take(tables.levels, code + (w * _ROW).unsqueeze(2)) * s3

    def _reduce(
        self,
        payload: torch.Tensor,
        local: torch.Tensor,
        ctx: HopContext,
        out_ctx: HopContext,
        *,
        compiled: bool = False,
    ) -> torch.Tensor:
        """The fused decompress-accumulate-recompress, block by block (``compiled``: as for
        :meth:`_encode`): bit-identical to ``_encode(_decode(payload) + local, out_ctx)``."""
        numel = local.numel()
        dev = local.device
        b_in, b_out = self._span_budgets(numel, ctx), self._span_budgets(numel, out_ctx)
        offs_in, offs = self._span_offsets(numel, b_in), self._span_offsets(numel, b_out)
        out = torch.empty(offs[-1], dtype=torch.uint8, device=dev)
        tables = self._tables(dev)
        for first, m, length in self._blocks(numel, "reduce" if compiled else None):
            bi, bo = b_in[first : first + m], b_out[first : first + m]
            rows = self._run("reduce", compiled, length)(
                _expand(
                    payload, offs_in[first : first + m + 1], (int(bi.max()) + 7) // 8, self, length
                ),
                self._rows(local, first, m, length),
                length,
                bi.view(m, 1).to(dev),
                bo.view(m, 1).to(dev),
                (int(bo.max()) + 7) // 8,
                tables,
                self._dither(out_ctx, first, m, length, dev),
            )
            out[offs[first] : offs[first + m]] = _compact(rows, offs[first : first + m + 1])
        return out

    def _reduce_rows(
        self,
        p2: torch.Tensor,
        local3: torch.Tensor,
        length: int,
        budget_in: torch.Tensor,
        budget_out: torch.Tensor,
        nbytes_out: int,
        tables: RoundingTables,
        u: torch.Tensor | None,
    ) -> torch.Tensor:
        """``_encode_rows(_decode_rows(p2) + local3)`` for ``m`` spans (``local3`` fp32,
        padding zero)."""
        x3 = self._decode_rows(p2, length, budget_in, tables) + local3
        if torch.compiler.is_compiling():
            # store the partial sum once (the encode reads it twice: absmax, then rounding)
            torch._dynamo.graph_break()
        if length < x3.shape[1] * self.group:  # keep the padding zero
            x3.view(-1)[length:] = 0.0
        return self._encode_rows(x3, length, budget_out, nbytes_out, tables, u)

    # -- error bound --------------------------------------------------------------------

    @property
    def error_bound(self) -> ErrorBound:
        stochastic = self.rounding != "nearest"
        g = self.group

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            xf = x.float()
            units = self._tables(x.device).units
            out = torch.empty(xf.numel(), dtype=torch.float64, device=x.device)
            budgets = self._span_budgets(xf.numel(), ctx)
            for first, m, length in self._blocks(xf.numel()):
                x3 = self._rows(xf, first, m, length)
                s_sg, e, a_g = self._stats(x3)
                budget = budgets[first : first + m].view(m, 1).to(x.device)
                s_fin = torch.where(torch.isfinite(s_sg), s_sg, 0.0)
                w = self._widths_rows(s_fin, e, length, budget)
                s_g = self._group_scale(self._per_group(s_sg), e).double()
                b = s_g * (units[w] + 2.0**-22) + self._bound_abs
                b = torch.where(w == 0, a_g.double(), b)
                # a super-group holding NaN/Inf decodes to NaN: no bound there, and only there
                lost = self._per_group(~torch.isfinite(s_sg))
                b = torch.where(torch.isfinite(b) & ~lost, b, torch.inf)
                vals = b.unsqueeze(2).expand(m, b.shape[1], g).reshape(m, -1)[:, :length]
                a = first * self.span
                out[a : a + m * length] = vals.reshape(-1)
            return out

        def witness(numel: int) -> torch.Tensor:
            # equal group scales, so every group gets the same width; values sit where the
            # level table is farthest from its levels (a gap's midpoint, or a gap's edge)
            w = min(_MAX_W, max(1, int(self._bits_at(None))))
            lv = self._levels(w).double()
            gaps = lv[1:] - lv[:-1]
            i = int(gaps.argmax())
            point = float(lv[i] + gaps[i] / 2) if not stochastic else float(lv[i] + gaps[i] * 0.75)
            k = torch.arange(numel)
            x = torch.full((numel,), point, dtype=torch.float64)
            x[k % g == 0] = 1.0
            return x.float()

        formula = (
            "s·(m_w + 2^-22) + 2^-149 (w > 0), absmax_g (w = 0); s = S·2^-e, w from the span's "
            "scale codes"
        )
        return ErrorBound(
            formula=formula, unbiased=stochastic, max_abs=max_abs, witness=witness, var=None
        )


def _compact(rows: torch.Tensor, offs: list[int]) -> torch.Tensor:
    """Rows ``[m, width]`` of spans whose wire sizes are the differences of ``offs``
    (``m + 1`` byte offsets), each one's leading bytes, back to back."""
    m, width = rows.shape
    sizes = [b - a for a, b in itertools.pairwise(offs)]
    if min(sizes) == width:
        return rows.reshape(-1)
    keep = torch.arange(width, device=rows.device) < torch.tensor(sizes, device=rows.device).view(
        m, 1
    )
    return rows[keep]


def _expand(
    payload: torch.Tensor, offs: list[int], nbytes: int, codec: DynamiqCodec, length: int
) -> torch.Tensor:
    """The spans of ``payload[offs[0]:offs[-1]]`` as rows ``[m, header + nbytes]``, each
    zero past its own bytes (the inverse of :func:`_compact`)."""
    m = len(offs) - 1
    width = sum(codec._header_bytes(length)) + nbytes
    flat = payload[offs[0] : offs[-1]]
    sizes = [b - a for a, b in itertools.pairwise(offs)]
    if min(sizes) == width:
        return flat.view(m, width)
    keep = torch.arange(width, device=flat.device) < torch.tensor(sizes, device=flat.device).view(
        m, 1
    )
    rows = torch.zeros(m, width, dtype=torch.uint8, device=flat.device)
    rows[keep] = flat
    return rows


def _bf16_value(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int64 in 0..0xFFFF) as fp32 values (exact)."""
    v = bits << 16
    return (v - ((v >> 31) << 32)).to(torch.int32).view(torch.float32)


def _bf16_round_up(a: torch.Tensor) -> torch.Tensor:
    """``roundup_bf16`` of fp32 values >= 0 (or NaN), as fp32: the smallest bf16 >= ``a``
    (torch's round-to-nearest-even conversion, one step up if that fell below ``a``), in
    integer arithmetic: the fp32 bits rounded up to a multiple of 2^16. NaN gives the pattern
    0xFFFF (what torch's CPU conversion writes)."""
    b = a.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return _bf16_value(torch.where(torch.isnan(a), 0xFFFF, (b + 0xFFFF) >> 16))


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D table (``index_select``: the fastest gather on the CPU)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def _quantize(
    y: torch.Tensor, w: torch.Tensor, tables: RoundingTables, u: torch.Tensor | None
) -> torch.Tensor:
    """Level index (int32) of each ``y`` ``[m, n_g, group]`` in [-1, 1] in the table of its
    group's width ``w`` ``[m, n_g]`` (width 0: meaningless): nearest (ties to the lower
    level), or between the two neighbours with probability proportional to closeness
    (``u`` uniform). The same fp32 arithmetic as ``searchsorted`` on the width's table, then
    ``frac = (y - lower) / gap``, up if ``frac > 0.5`` (nearest) or ``u < frac``."""
    wq = w.clamp(min=1).to(torch.int32).unsqueeze(2)
    cell = ((y + 1.0) * _CELLS).to(torch.int32) + wq * (2 * _CELLS + 1)  # floor: y + 1 >= 0
    base = _take(tables.base, cell)
    key = _take(tables.key, cell)
    if u is None:
        return base + (key <= y)  # the round-up thresholds <= y
    # the levels < y (searchsorted), then the upper neighbour hi in 1 .. 2^w - 1
    row = wq * _ROW
    hi = row + torch.minimum((base + (key < y)).clamp(min=1), (1 << wq) - 1)
    # frac is in [0, 1] (the stretched tables end at ±1), so u < frac needs no clamp
    frac = (y - _take(tables.lower, hi)) / _take(tables.gap, hi)
    return hi - row - 1 + (u < frac)


def _pack4(e: torch.Tensor, nbytes: int) -> torch.Tensor:
    """4-bit codes ``[m, n]`` two to a byte (low nibble first) ``[m, nbytes]``."""
    m, n = e.shape
    pad = torch.zeros(m, 2 * nbytes, dtype=torch.int64, device=e.device)
    pad[:, :n] = e
    return (pad[:, 0::2] | (pad[:, 1::2] << 4)).to(torch.uint8)


def _unpack4(p: torch.Tensor, n: int) -> torch.Tensor:
    b = p.to(torch.int64)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(p.shape[0], -1)[:, :n]


def _pack_codes(code: torch.Tensor, w: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Codes ``[m, n_g, group]`` of widths ``w`` ``[m, n_g]`` back to back (LSB first) in
    containers ``[m, nbytes]``; codes of width-0 groups are ignored, padding codes are 0."""
    m, n_g, g = code.shape
    dev = code.device
    if g % 8 == 0:
        # every 8 codes of a group fill exactly w bytes: one 64-bit word each, whose bytes
        # from w on are 0, so all 8 bytes can be added in place (the bits are disjoint)
        nc = g // 8
        j8 = torch.arange(8, device=dev)
        shifted = code.to(torch.int64) << _shifts(w, g)
        word = shifted.view(m, n_g, nc, 8).sum(dim=3)
        word = torch.where(w.unsqueeze(2) > 0, word, 0)
        if _LITTLE:
            byte = word.view(torch.uint8)  # the word's bytes, least significant first
        else:
            byte = ((word.unsqueeze(3) >> (8 * j8)) & 255).to(torch.uint8)
        group_bytes = w * nc
        first = torch.cumsum(group_bytes, dim=1) - group_bytes  # each group's first byte
        # room past the container: 7 bytes of the last word, and the zero codes padding a
        # short last group (at most a group's worth of bytes)
        room = nbytes + g + 8
        row = torch.arange(m, device=dev).view(m, 1) * room
        chunk = (first + row).unsqueeze(2) + w.unsqueeze(2) * torch.arange(nc, device=dev)
        out = torch.zeros(m, room, dtype=torch.uint8, device=dev)
        out.view(-1).scatter_add_(0, (chunk.unsqueeze(3) + j8).view(-1), byte.reshape(-1))
        return out[:, :nbytes]
    # any group size: each code lands in (at most) two bytes, added (the bits are disjoint)
    bit = _bit_offsets(w, g)
    code = torch.where(w.unsqueeze(2) > 0, code.to(torch.int64), 0) << (bit & 7)
    at = (bit >> 3).clamp(max=nbytes).view(m, -1)
    out = torch.zeros(m, nbytes + 1, dtype=torch.int32, device=dev)
    out.scatter_add_(1, at, (code & 255).view(m, -1).to(torch.int32))
    out.scatter_add_(1, (at + 1).clamp(max=nbytes), (code >> 8).view(m, -1).to(torch.int32))
    return out[:, :nbytes].to(torch.uint8)


def _shifts(w: torch.Tensor, g: int) -> torch.Tensor:
    """``w · (i mod 8)`` for each code ``i`` of each group ``[m, n_g, g]`` (int64, contiguous:
    an operand broadcast along a middle dimension would make the shifts several times
    slower)."""
    table = _shift_table(g, w.device)
    return table.index_select(0, w.reshape(-1)).view(*w.shape, g)


@functools.lru_cache(maxsize=32)
def _shift_table(g: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(g, device=device) % 8
    return torch.arange(_MAX_W + 1, device=device).unsqueeze(1) * i


def _bit_offsets(w: torch.Tensor, g: int) -> torch.Tensor:
    """Bit position ``[m, n_g, g]`` of each code in its span's container."""
    bits = w * g
    first = torch.cumsum(bits, dim=1) - bits
    return first.unsqueeze(2) + w.unsqueeze(2) * torch.arange(g, device=w.device)


def _unpack_codes(body: torch.Tensor, w: torch.Tensor, g: int) -> torch.Tensor:
    """Codes ``[m, n_g, g]`` of widths ``w`` ``[m, n_g]`` from containers ``[m, nbytes]``
    (width-0 groups and bits past the container read as 0)."""
    m, n_g = w.shape
    nbytes = body.shape[1]
    dev = body.device
    mask = ((1 << w) - 1).unsqueeze(2)
    if g % 8 == 0 and _LITTLE:
        # every 8 codes of a group are exactly w bytes: read them as one 64-bit word
        nc = g // 8
        flat = torch.zeros(m * nbytes + 8, dtype=torch.uint8, device=dev)
        flat[: m * nbytes] = body.reshape(-1)
        window = flat.as_strided((m * nbytes + 1, 8), (1, 1))  # 8 bytes from each position
        group_bytes = w * nc
        first = torch.cumsum(group_bytes, dim=1) - group_bytes
        chunk = first.unsqueeze(2) + w.unsqueeze(2) * torch.arange(nc, device=dev)
        row = torch.arange(m, device=dev).view(m, 1, 1) * nbytes
        start = torch.where(chunk < nbytes, chunk + row, m * nbytes).view(-1)
        word = window.index_select(0, start).view(torch.int64).view(m, n_g, nc, 1)
        code = word.expand(m, n_g, nc, 8) >> _shifts(w, g).view(m, n_g, nc, 8)
        return code.view(m, n_g, g) & mask
    # any group size: each code is within two bytes
    bit = _bit_offsets(w, g)
    at = (bit >> 3).clamp(max=nbytes).view(m, -1)
    padded = torch.zeros(m, nbytes + 2, dtype=torch.int64, device=dev)
    padded[:, :nbytes] = body
    two = torch.gather(padded, 1, at) | (torch.gather(padded, 1, at + 1) << 8)
    return (two.view(m, n_g, g) >> (bit & 7)) & mask
