# mypy: allow-untyped-defs
"""Triton kernels of the DynamiQ codec for spans of one super-group (the default: ``span =
super_group = 256``, ``group = 16``): many spans per program, one pass over the values.

Same bytes and values as :mod:`dynamiq.kernels.dynamiq` (its docstring: the wire layout and
every rule of the reference) and so as the reference; what differs is the schedule. That
module runs one program per span, which walks the span's groups three times because a span of
64K values does not fit on chip; a span of 256 does, so here a program holds ``P`` whole
spans as one tile ``[8, octets, P, groups]`` (``groups = span / group``, ``octets = group /
8``; the element axes first, so that a thread holds one group and a warp's lanes whole spans:
:func:`_octets`) and everything per span is a vector over the tile's ``P`` axis:

1. (reduce) the incoming headers: every group's level, then the threshold ``tau`` of every
   span at once by a bisection of a fixed number of steps (the cost of a threshold is a
   table lookup a group: the count of a group's bits at ``tau - 8 L``), the widths and bit
   offsets, the decoded values;
2. the values (decoded + local) stay in registers: group absmax, super-group scales, group
   codes (binary lifting over the 16 candidate scales, which never rise with the code),
   levels and the outgoing ``tau``;
3. quantize through the reference's own cell tables (``codec.wire().tables``: the keys below each
   1/1024 cell of ``[-1, 1]`` and the next key, so one comparison finishes the count; no
   search over the levels), and pack.

Measured without a GPU (``benchmarks/sass_executed.py``, sm_90): about 121 executed SASS
instructions a value for the fused reduce (239 with the spans first, the octets' lanes
converted through shared memory and a program-wide test ending the searches), against at
least 1,660 for the span-a-program kernel.

**Packing by octets.** With ``group % 8 == 0`` every group starts on a byte (its bit offset is
a sum of ``group * w`` bits) and each 8 of its codes fill exactly ``w`` bytes, LSB first: the
octet's codes shifted into one 64-bit word, whose low ``w`` bytes are stored. No prefix sum
over the values, no scratch memory, no carried byte. Unpacking reads the octet's ``w`` bytes
back into the word. The last group of a short last span has fewer codes: its last octet
stores the bytes its codes reach, and the rest of the container is zeroed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.dynamiq_codec import DynamiqCodec

from ._common import hash_u32, load_f32, tile_elems, uniform_open01, value_view
from ._stats import record_launch
from .dynamiq import DEAD, NAN_SCALE, NEVER, _group_scale, _Launch, _level_of, _Plan, _table_cpu
from .dynamiq import STEPS_AT as SPAN_STEPS_AT

#: the fp32 table (:func:`_tables`): per width ``w`` (rows of ``ROW``) the levels, the lower
#: neighbour and the gap of each level; per width (rows of ``NCELL``) the next key after each
#: cell; then the scale steps
ROW: tl.constexpr = tl.constexpr(257)
NCELL: tl.constexpr = tl.constexpr(2049)
LOWER_AT: tl.constexpr = tl.constexpr(9 * 257)
GAP_AT: tl.constexpr = tl.constexpr(2 * 9 * 257)
KEY_AT: tl.constexpr = tl.constexpr(3 * 9 * 257)
STEPS_AT: tl.constexpr = tl.constexpr(3 * 9 * 257 + 9 * 2049)
#: the int32 table: the width at each priority offset ``tau - 8 L - min Q`` (``COUNT``
#: entries at most), then per width the keys below each cell
COUNT: tl.constexpr = tl.constexpr(512)
BASE_AT: tl.constexpr = tl.constexpr(512)

__all__ = ["decode_into", "eligible", "encode_into"]


def eligible(codec: DynamiqCodec) -> bool:
    """Whether these kernels take ``codec``: a span of one super-group of at most 2,048 values
    (a program holds whole spans) and 2 to 64 groups, ``group`` a power of two >= 8."""
    g, span = codec.group, codec.span
    ngs = span // g
    return (
        span == codec.super_group
        and span <= 2048
        and g >= 8
        and g & (g - 1) == 0
        and 2 <= ngs <= 64
        and ngs & (ngs - 1) == 0
    )


# -- the tile ---------------------------------------------------------------------------------


@triton.jit
def _x4(t):
    """``[P, groups]`` -> ``[1, 1, P, groups]``."""
    return t[None, None, :, :]


@triton.jit
def _spans(numel, P: tl.constexpr, SPAN: tl.constexpr, G: tl.constexpr, NGS: tl.constexpr):
    """The program's first value (an int64 scalar) and its spans ``[P]``: index (int64),
    first value from the program's (int32), values (0 past the end), whether each is the
    last, header bytes; group sizes ``[P, NGS]``."""
    pid = tl.program_id(0).to(tl.int64)
    first = pid * (P * SPAN)
    # the values from `first` on, capped past this program's (so only a real last span is)
    rem = tl.minimum(numel - first, P * SPAN + 1).to(tl.int32)
    local = tl.arange(0, P) * SPAN
    n = tl.minimum(tl.maximum(rem - local, 0), SPAN)
    last = local + SPAN >= rem
    ng = (n + G - 1) // G
    hbytes = 2 + (ng * 4 + 7) // 8
    gsize = tl.minimum(tl.maximum(n[:, None] - tl.arange(0, NGS)[None, :] * G, 0), G)
    return first, pid * P + tl.arange(0, P), local, n, last, hbytes, gsize


@triton.jit
def _site(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    base_ptr, pool_ptr, span, n, last, span_bytes, b_full, b_last, POOL: tl.constexpr
):  # fmt: skip
    """Each span's payload ``[P]`` and its container bits (0 past the end): at multiples of
    ``span_bytes`` with the uniform budgets, or (``POOL``) the pooled table's row ``[bits,
    byte offset]``."""
    if POOL:
        bits = tl.load(pool_ptr + 2 * span, mask=n > 0, other=0).to(tl.int32)
        ptr = base_ptr + tl.load(pool_ptr + 2 * span + 1, mask=n > 0, other=0)
    else:
        bits = tl.where(last, b_last, b_full)
        ptr = base_ptr + span * span_bytes
    return ptr, tl.where(n > 0, bits, 0)


@triton.jit
def _bits(p, t, itab, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """Bits of groups of priority base ``p = 8 L`` at threshold ``t``: ``#{w: p + Q[w] >=
    t}``, from the table of counts (``Q`` falls with ``w``)."""
    return tl.load(itab + tl.minimum(tl.maximum(t - p - QMIN, 0), QMAX - QMIN + 1))


@triton.jit
def _read_header(ptr, n, gsize, tab_ptr, K: tl.constexpr, NGS: tl.constexpr):
    """Of every group ``[P, NGS]`` of the spans' headers: level (``DEAD`` if not live),
    whether live, and the group scale."""
    live_span = n > 0
    s16 = tl.load(ptr, mask=live_span, other=0).to(tl.int32)
    s16 |= tl.load(ptr + 1, mask=live_span, other=0).to(tl.int32) << 8
    g = tl.arange(0, NGS)[None, :]
    greal = gsize > 0
    e = tl.load(ptr[:, None] + 2 + (g >> 1), mask=greal, other=0).to(tl.int32)
    e = (e >> ((g & 1) * 4)) & 15
    lvl, live = _level_of(s16[:, None], e, K)
    live = live & greal
    scale = _group_scale(
        (s16 << 16).to(tl.float32, bitcast=True)[:, None], e, tab_ptr + STEPS_AT, K
    )
    return tl.where(live, lvl, DEAD), live, scale


@triton.jit
def _search_rows(lvl, live, gsize, budget, itab, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """``(tau, leftover)`` of every span ``[P]`` (the threshold of
    :func:`dynamiq.kernels.dynamiq._search`, every span at once, by bisection): the smallest
    threshold in ``[8 Lmin + min Q, 8 Lmax + max Q + 1]`` whose cost fits the budget (the
    cost falls as ``tau`` grows), and the bits it leaves; ``NEVER`` without live groups.

    A fixed number of steps, unrolled, with no program-wide test of whether every span has
    converged (a reduction across the warps, through shared memory, every step): a span is
    one super-group, so its live groups' levels ``K floor(log2 S) - e`` differ by at most 15
    (``e`` is 4 bits), its range ``hi - lo`` is at most ``D = 8 * 15 + max Q - min Q + 1``,
    and a step takes a range ``d`` to at most ``floor(d / 2)``: ``D.bit_length()`` steps
    leave ``lo == hi``. Further steps change nothing (``hi`` always fits, so ``mid = hi``
    fits again)."""
    D: tl.constexpr = 8 * 15 + QMAX - QMIN + 1
    tl.static_assert(D < 1024, "the search's range needs more than 10 steps")
    lmin = tl.min(tl.where(live, lvl, 1 << 20), axis=1)
    lmax = tl.max(tl.where(live, lvl, -(1 << 20)), axis=1)
    any_live = lmin <= lmax
    lo = tl.where(any_live, 8 * lmin + QMIN, 0)
    hi = tl.where(any_live, 8 * lmax + QMAX + 1, 0)
    used = tl.zeros_like(lo)  # the cost at hi (none above the largest priority)
    p = 8 * lvl
    for i in tl.static_range(10):
        if (D >> i) > 0:  # (compile time: D.bit_length() steps)
            mid = (lo + hi) >> 1  # lo <= mid < hi where lo < hi; mid = hi where they met
            cost = tl.sum(_bits(p, mid[:, None], itab, QMIN, QMAX) * gsize, axis=1)
            fits = cost <= budget
            hi = tl.where(fits, mid, hi)
            used = tl.where(fits, cost, used)
            lo = tl.where(fits, lo, mid + 1)
    return tl.where(any_live, lo, NEVER), budget - used


@triton.jit
def _widths(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    lvl, live, gsize, n, budget, itab, Q, POOLED: tl.constexpr, QMIN: tl.constexpr,
    QMAX: tl.constexpr,
):  # fmt: skip
    """Every group's width and bit offset in its span's body ``[P, NGS]``: water-filling
    (``POOLED``: the threshold, then the bits worth ``tau - 1`` in index order while they
    fit), or the span's budget over its values."""
    if POOLED:
        tau, left = _search_rows(lvl, live, gsize, budget, itab, QMIN, QMAX)
        p = 8 * lvl
        t = tau[:, None]
        wb = _bits(p, t, itab, QMIN, QMAX)
        # Q[min(wb, 7)]: the priority of the next bit
        qn = tl.where(wb == 0, Q[0], tl.where(wb == 1, Q[1], tl.where(wb == 2, Q[2], Q[3])))
        qn = tl.where(wb >= 4, tl.where(wb == 4, Q[4], tl.where(wb == 5, Q[5], Q[6])), qn)
        qn = tl.where(wb >= 7, Q[7], qn)
        rising = live & (wb < 8) & (p + qn == t - 1)
        cum = tl.cumsum(tl.where(rising, gsize, 0), axis=1)
        w = tl.where(live, wb + (rising & (cum <= left[:, None])).to(tl.int32), 0)
    else:
        flat = tl.minimum(budget // tl.maximum(n, 1), 8)
        w = tl.where(live, flat[:, None], 0)
    nbits = w * gsize
    return w, tl.cumsum(nbits, axis=1) - nbits


@triton.jit
def _octets(gsize, NO: tl.constexpr):
    """Element axes: octet ``[1, NO, 1, 1]``, position in it ``[8, 1, 1, 1]``, and whether
    each element ``[8, NO, P, NGS]`` is a real value of its group. The element axes come
    first: Triton's default layout gives a thread the leading axes whole and spreads the
    trailing ones over the lanes and warps, so a thread holds one group (its reductions and
    its octets' words in registers) and a warp's lanes whole spans (no shared memory)."""
    o = tl.arange(0, NO)[None, :, None, None]
    # the position's contiguity hidden from Triton's axis analysis (which does not know that a
    # program id is >= 0; LLVM does, and folds the product): the loads and stores indexed by
    # it then keep this layout instead of one with the lanes along the octet, converted to and
    # from it through shared memory
    unit = (tl.program_id(0) >= 0).to(tl.int32)
    j = tl.arange(0, 8)[:, None, None, None] * unit
    return o, j, (o * 8 + j) < _x4(gsize)


@triton.jit
def _value_index(local, o, j, G: tl.constexpr, NGS: tl.constexpr):
    """Each element's index ``[8, NO, P, NGS]`` from the program's first value."""
    return _x4(local[:, None] + tl.arange(0, NGS)[None, :] * G) + o * 8 + j


@triton.jit
def _x_index(local, o, j, G: tl.constexpr, NGS: tl.constexpr, XCOAL: tl.constexpr):
    """:func:`_value_index` for reading and writing the values (``XCOAL``: with the octet
    position's contiguity visible, so that Triton reads and writes them with the lanes along
    the octet and converts them to the compute layout through shared memory: the default,
    :data:`X_COALESCED`)."""
    if XCOAL:
        return _value_index(local, o, tl.arange(0, 8)[:, None, None, None], G, NGS)
    return _value_index(local, o, j, G, NGS)


@triton.jit
def _unpack_octets(body, nbody, off, w, scale, gsize, tab_ptr, NO: tl.constexpr):
    """Decoded fp32 values ``[8, NO, P, NGS]`` of the spans' bodies (``body`` ``[P]``
    pointers, ``nbody`` bytes): each octet's bytes into one word, its codes out of it,
    ``level * s`` (``0 * s`` for width 0, so a NaN or Inf scale decodes to NaN)."""
    o, j, real = _octets(gsize, NO)
    w4 = _x4(w)
    at = _x4(off >> 3) + o * w4  # the octet's first byte
    nb4 = nbody[None, None, :, None]
    m = (j < w4) & (o * 8 < _x4(gsize)) & (at + j < nb4)
    byte = tl.load(body[None, None, :, None] + at + j, mask=m, other=0).to(tl.int64)
    word = tl.sum(byte << (8 * j).to(tl.int64), axis=0)
    code = ((word[None, :, :, :] >> (j * w4).to(tl.int64)) & ((1 << w4) - 1)).to(tl.int32)
    # (values past a short last group's end decode to a level too: nothing reads them)
    level = tl.load(tab_ptr + w4 * ROW + code, mask=w4 > 0, other=0.0)
    return level * _x4(scale), real


@triton.jit
def _pack(body, nbody, off, w, code, gsize, NO: tl.constexpr):
    """Store the codes ``[8, NO, P, NGS]``: each octet's into one word, its low bytes (those
    its codes reach) into the body; then zeros to the end of each container."""
    o, j, _ = _octets(gsize, NO)
    w4 = _x4(w)
    word = tl.sum(code.to(tl.int64) << (j * w4).to(tl.int64), axis=0)
    at = _x4(off >> 3) + o * w4
    ncodes = tl.minimum(tl.maximum(_x4(gsize) - 8 * o, 0), 8)
    # the bits of the octet's real codes only (a short last group's tail quantized to
    # something): 2^nb - 1 in two shifts, so that nb = 64 wraps to all ones
    o3 = tl.arange(0, NO)[:, None, None]
    real3 = tl.minimum(tl.maximum(gsize[None, :, :] - 8 * o3, 0), 8)
    nb = (w[None, :, :] * real3).to(tl.int64)
    half = nb >> 1
    word = word & (((tl.full(nb.shape, 1, tl.int64) << half) << (nb - half)) - 1)
    m = (8 * j < w4 * ncodes) & (at + j < nbody[None, None, :, None])
    byte = (word[None, :, :, :] >> (8 * j).to(tl.int64)) & 0xFF
    tl.store(body[None, None, :, None] + at + j, byte.to(tl.uint8), mask=m)
    used = (tl.sum(w * gsize, axis=1) + 7) >> 3
    zb = tl.arange(0, 16)[None, :]
    for z in range(0, tl.max(nbody - used, axis=0), 16):
        i = used[:, None] + z + zb
        tl.store(body[:, None] + i, tl.zeros_like(i).to(tl.uint8), mask=i < nbody[:, None])


@triton.jit
def _incoming(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    in_ptr, pool_ptr, span, n, last, hbytes, gsize, span_bytes, b_full, b_last, tab_ptr,
    itab, POOL: tl.constexpr, K: tl.constexpr, NGS: tl.constexpr, NO: tl.constexpr,
    POOLED: tl.constexpr, Q, QMIN: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    """The decoded values ``[8, NO, P, NGS]`` of the spans of a payload, and which are real."""
    ptr, bits = _site(in_ptr, pool_ptr, span, n, last, span_bytes, b_full, b_last, POOL)
    lvl, live, scale = _read_header(ptr, n, gsize, tab_ptr, K, NGS)
    w, off = _widths(lvl, live, gsize, n, bits, itab, Q, POOLED, QMIN, QMAX)
    return _unpack_octets(ptr + hbytes, (bits + 7) // 8, off, w, scale, gsize, tab_ptr, NO)


@triton.jit
def _statistics(v, real, gsize, tab_ptr, K: tl.constexpr):
    """Of the values ``[8, NO, P, NGS]``: each span's scale (bf16 bits ``[P]``: the smallest
    bf16 >= the absmax, ``NAN_SCALE`` for NaN) and each group's code (the largest whose
    scale is still >= its absmax; 15 for an all-zero group), level, liveness and scale."""
    mag = tl.where(real, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    ag = tl.max(tl.max(mag, axis=0), axis=0)  # integer max: NaN > Inf > finite
    amax = tl.max(ag, axis=1)
    s16 = tl.where(amax > 0x7F800000, NAN_SCALE, (amax + 0xFFFF) >> 16)
    s = (s16 << 16).to(tl.float32, bitcast=True)[:, None]
    # the candidate group scales do not rise with the code: the largest code whose scale is
    # still >= the absmax (0 if none) by binary lifting over the 16 codes
    af = ag.to(tl.float32, bitcast=True)
    e = tl.zeros_like(ag)
    for b in tl.static_range(4):
        t = e + (8 >> b)
        e = tl.where(_group_scale(s, t, tab_ptr + STEPS_AT, K) >= af, t, e)
    greal = gsize > 0
    e = tl.where(greal, tl.where(ag == 0, 15, e), 0)
    lvl, live = _level_of(s16[:, None], e, K)
    live = live & greal
    return s16, e, tl.where(live, lvl, DEAD), live, _group_scale(s, e, tab_ptr + STEPS_AT, K)


@triton.jit
def _write_header(out, s16, e, gsize, P: tl.constexpr, NGS: tl.constexpr):
    """Each span's scale (2 bytes) and group codes (two a byte, low nibble first)."""
    ng = tl.sum((gsize > 0).to(tl.int32), axis=1)
    tl.store(out, (s16 & 0xFF).to(tl.uint8), mask=ng > 0)
    tl.store(out + 1, (s16 >> 8).to(tl.uint8), mask=ng > 0)
    pair = tl.reshape(e, [P, NGS // 2, 2]) << (tl.arange(0, 2)[None, None, :] * 4)
    pr = tl.arange(0, NGS // 2)[None, :]
    nib = tl.sum(pair, axis=2)
    tl.store(out[:, None] + 2 + pr, nib.to(tl.uint8), mask=2 * pr < ng[:, None])


@triton.jit
def _quantize(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    v, scale, w, ftab, itab, idx, key0, key1, ckey0, ckey1, hop, num_hops, MODE: tl.constexpr
):  # fmt: skip
    """Level index of each value in its width's table (``_quantize`` of the reference): the
    cell ``floor((y + 1) * 1024)`` of ``y = x / s`` gives the keys below it and the next
    key; nearest rounding counts round-up thresholds (the code), a dither ``u`` counts the
    levels below ``y`` (the upper neighbour) and goes up when ``u < (y - lower) / gap``; 0
    where the width is 0."""
    m = w > 0
    y = tl.math.div_rn(v, tl.where(m, scale, 1.0))
    y = tl.where(m, tl.minimum(tl.maximum(y, -1.0), 1.0), 0.0)
    wq = tl.maximum(w, 1)
    cell = ((y + 1.0) * 1024.0).to(tl.int32) + wq * NCELL  # floor: y + 1 >= 0
    base = tl.load(itab + BASE_AT + cell, mask=m, other=0)
    key = tl.load(ftab + KEY_AT + cell, mask=m, other=0.0)
    if MODE == 0:
        code = base + (key <= y).to(tl.int32)
    else:
        row = wq * ROW
        hi = row + tl.minimum(tl.maximum(base + (key < y).to(tl.int32), 1), (1 << wq) - 1)
        lower = tl.load(ftab + LOWER_AT + hi, mask=m, other=0.0)
        gap = tl.load(ftab + GAP_AT + hi, mask=m, other=1.0)
        frac = tl.math.div_rn(y - lower, gap)
        u = uniform_open01(hash_u32(idx, key0, key1))
        if MODE == 2:
            # correlated: u = (stratum + v) / H, stratum = (per-coordinate shift + hop) mod H
            shift = hash_u32(idx, ckey0, ckey1).to(tl.int64) % num_hops
            stratum = (shift + hop) % num_hops
            u = tl.math.div_rn(stratum.to(tl.float32) + u, num_hops.to(tl.float32))
        code = hi - row - 1 + (u < frac).to(tl.int32)
    return tl.where(m, code, 0)


@triton.jit(do_not_specialize=["offset", "key0", "key1", "ckey0", "ckey1", "hop", "num_hops"])
def _dqt_encode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    x_ptr, in_ptr, out_ptr, ftab, itab, in_pool_ptr, out_pool_ptr,
    numel, in_span_bytes, out_span_bytes, in_budget, in_budget_last, out_budget,
    out_budget_last, offset, key0, key1, ckey0, ckey1, hop, num_hops,
    FUSED: tl.constexpr, POOL_IN: tl.constexpr, POOL_OUT: tl.constexpr,
    IN_KIND: tl.constexpr, SPAN: tl.constexpr, G: tl.constexpr, NGS: tl.constexpr,
    NO: tl.constexpr, P: tl.constexpr, K: tl.constexpr, POOLED: tl.constexpr,
    MODE: tl.constexpr, Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr,
    Q3: tl.constexpr, Q4: tl.constexpr, Q5: tl.constexpr, Q6: tl.constexpr,
    Q7: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, XCOAL: tl.constexpr,
):  # fmt: skip
    """Encode (or, ``FUSED``, reduce: decode the incoming spans and add ``x``) ``P`` spans
    (the sizes and hop context of :func:`dynamiq.kernels.dynamiq._dq_encode_kernel`; the
    tables of :func:`_tables`); bytes moved per value: ``x`` once, each payload once."""
    first, span, local, n, last, hbytes, gsize = _spans(numel, P, SPAN, G, NGS)
    Q = (Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7)
    o, j, real = _octets(gsize, NO)
    el = _value_index(local, o, j, G, NGS)  # from `first`
    v = load_f32(x_ptr + first, _x_index(local, o, j, G, NGS, XCOAL), real, IN_KIND)
    if FUSED:
        dec, _ = _incoming(
            in_ptr, in_pool_ptr, span, n, last, hbytes, gsize, in_span_bytes, in_budget,
            in_budget_last, ftab, itab, POOL_IN, K, NGS, NO, POOLED, Q, QMIN, QMAX,
        )  # fmt: skip
        v = dec + v
    out, bits = _site(
        out_ptr, out_pool_ptr, span, n, last, out_span_bytes, out_budget, out_budget_last,
        POOL_OUT,
    )  # fmt: skip
    s16, e, lvl, live, scale = _statistics(v, real, gsize, ftab, K)
    _write_header(out, s16, e, gsize, P, NGS)
    w, off = _widths(lvl, live, gsize, n, bits, itab, Q, POOLED, QMIN, QMAX)
    # the widths per group, broadcast (a mask per value here would make every step of the
    # quantizer per value: the divisor's select, the width's tests); what a group's values past
    # its end (a short last group) quantize to is masked off in the packed words (_pack)
    code = _quantize(
        v, _x4(scale), _x4(w), ftab, itab, offset + first + el, key0, key1, ckey0, ckey1, hop,
        num_hops, MODE,
    )  # fmt: skip
    _pack(out + hbytes, (bits + 7) // 8, off, w, code, gsize, NO)


@triton.jit
def _dqt_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    in_ptr, out_ptr, ftab, itab, in_pool_ptr, numel, in_span_bytes, in_budget,
    in_budget_last, POOL_IN: tl.constexpr, SPAN: tl.constexpr, G: tl.constexpr,
    NGS: tl.constexpr, NO: tl.constexpr, P: tl.constexpr, K: tl.constexpr,
    POOLED: tl.constexpr, Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr,
    Q3: tl.constexpr, Q4: tl.constexpr, Q5: tl.constexpr, Q6: tl.constexpr,
    Q7: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, XCOAL: tl.constexpr,
):  # fmt: skip
    """Decode ``P`` spans into fp32 values."""
    first, span, local, n, last, hbytes, gsize = _spans(numel, P, SPAN, G, NGS)
    Q = (Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7)
    v, real = _incoming(
        in_ptr, in_pool_ptr, span, n, last, hbytes, gsize, in_span_bytes, in_budget,
        in_budget_last, ftab, itab, POOL_IN, K, NGS, NO, POOLED, Q, QMIN, QMAX,
    )  # fmt: skip
    o, j, _ = _octets(gsize, NO)
    tl.store(out_ptr + first + _x_index(local, o, j, G, NGS, XCOAL), v, mask=real)


# -- launchers --------------------------------------------------------------------------------


#: read and write the values (``x``, the decoded output) coalesced, the lanes along the
#: octet, through a layout conversion (about 3 instructions a value), rather than in the
#: compute layout, where a thread's 4-byte loads lie 64 bytes apart (16 cache lines a warp's
#: load instead of 4: L1 may bound the kernel). The same bytes either way;
#: ``benchmarks/gpu_check.py`` times both
X_COALESCED = True


def _meta(codec: DynamiqCodec, device: torch.device) -> dict[str, int]:
    """Compile-time parameters: the geometry, the priorities, spans per program."""
    q = codec.wire().priorities
    spans = triton.next_power_of_2(max(1, tile_elems(device) // codec.span))
    return {
        "SPAN": codec.span,
        "G": codec.group,
        "NGS": codec.span // codec.group,
        "NO": codec.group // 8,
        "P": spans,
        "K": codec.scale_steps,
        "POOLED": codec.pooled,
        **{f"Q{w}": q[w] for w in range(8)},
        "QMIN": min(q),
        "QMAX": max(q),
        "XCOAL": X_COALESCED,
    }


@functools.lru_cache(maxsize=64)
def _tables(codec: DynamiqCodec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' two tables, from the reference's own (``codec.wire().tables``: levels, lower
    neighbours, gaps, the next key after each cell, the keys below it) and priorities: fp32
    ``[levels | lower | gap | key | steps]`` and int32 ``[widths by priority offset |
    base]`` (the layout of ``ROW``, ``NCELL`` and the ``*_AT`` constants)."""
    wire = codec.wire()
    t = wire.tables
    steps = _table_cpu(codec)[int(SPAN_STEPS_AT) :]  # the span kernel's scale steps
    ftab = torch.cat([t.levels, t.lower, t.gap, t.key, steps])
    counts = wire.priority_counts  # the reference's widths by offset
    count = torch.zeros(int(COUNT), dtype=torch.int32)
    count[: counts.numel()] = counts
    itab = torch.cat([count, t.base])
    k = codec.scale_steps
    assert ftab.numel() == int(STEPS_AT) + k and itab.numel() == int(BASE_AT) + 9 * int(NCELL)
    return ftab.to(device), itab.to(device)


def _grid(numel: int, meta: dict[str, int]) -> tuple[int]:
    return (triton.cdiv(triton.cdiv(numel, meta["SPAN"]), meta["P"]),)


def encode_into(
    codec: DynamiqCodec,
    values: torch.Tensor,
    incoming: torch.Tensor | None,
    out: torch.Tensor,
    la: _Launch,
    out_ctx: HopContext,
) -> None:
    """``codec.encode(values, out_ctx)`` into ``out`` (the payload's bytes), or with
    ``incoming`` the reduce of :func:`dynamiq.kernels.dynamiq.reduce`: one launch, each value
    read once. ``la``: the call's layouts, keys and tables (``dynamiq.kernels.dynamiq._launch``)."""
    fused = incoming is not None
    meta = _meta(codec, values.device)
    xv, kind = value_view(values)
    ftab, itab = _tables(codec, values.device)
    in_pool = la.in_pool if la.in_pool is not None else itab
    out_pool = la.out_pool if la.out_pool is not None else itab
    _dqt_encode_kernel[_grid(values.numel(), meta)](
        xv, incoming if fused else out, out, ftab, itab, in_pool, out_pool,
        *la.sizes(values.numel(), out_ctx), IN_KIND=kind, **la.flags(fused), **meta,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_dqt_encode_kernel")


def decode_into(
    codec: DynamiqCodec,
    payload: torch.Tensor,
    out: torch.Tensor,
    plan: _Plan,
    pool: torch.Tensor | None,
) -> None:
    """``codec.decode(payload, out.numel(), ctx)`` into ``out``: one launch (``plan``: the
    payload's layout, ``pool`` its pooled table or ``None``)."""
    numel = out.numel()
    meta = _meta(codec, payload.device)
    ftab, itab = _tables(codec, payload.device)
    _dqt_decode_kernel[_grid(numel, meta)](
        payload, out, ftab, itab, pool if pool is not None else itab, numel, plan.span_bytes,
        plan.budget, plan.budget_last, POOL_IN=pool is not None, **meta,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_dqt_decode_kernel")
