# mypy: allow-untyped-defs
"""Triton kernels of the DynamiQ codec (``dynamiq``: every ``span``, ``super_group``, ``group``,
``levels``, ``rounding``, ``hop_slope``, ``pooled`` and ``scale_steps``).

Reference: :class:`dynamiq.codecs.dynamiq_codec.DynamiqCodec` (``_encode``, ``_decode``, and
``_reduce`` = ``_encode(_decode(payload, ctx) + local.float(), out_ctx)``); the wire layout of
a span is its module docstring's (bf16 super-group scales, 4-bit group codes, then the codes of
varying widths back to back, LSB first, in a container of ``floor(bits_k * len)`` bits).
Bit-exact with it:

* the super-group scale is the smallest bf16 ``>= absmax``: ``(bits + 0xffff) >> 16`` on the
  fp32 bits of the absmax, which is the integer max of the magnitude bits (NaN > Inf >
  finite, so NaN is never dropped); a NaN scale is written as the reference's ``0xffff``;
* group codes compare the 16 candidate group scales ``fl32(S * step[e mod k]) * 2^-(e div
  k)`` (the reference's products, in its order) with the group absmax;
* the widths come from the same integer water-filling over the span: the smallest threshold
  ``tau`` whose cost fits the budget (each pass over the span's group levels ``L = k *
  floor(log2 S) - e`` costs 16 thresholds and narrows the bracket to one sixteenth), then
  the leftover bits to the groups whose next bit is worth ``tau - 1``, in index order (a
  running prefix sum);
* levels are looked up in the reference's own fp32 tables (a binary search for
  ``searchsorted``), ``x / s`` and the rounding fraction use ``div_rn``, the dither is the
  shared counter hash (:mod:`dynamiq.kernels._common`), and no FMA is contracted.

One program per span, three passes over its groups in order (tiles ``[BSG, CG, GP]``: ``BSG``
super-groups by ``CG`` groups by the group size padded to ``GP``, or one super-group cut into
``NCH`` chunks of ``CG`` groups):

1. (reduce) the incoming header: group levels into a scratch row, then its ``tau`` and
   leftover;
2. statistics: the values (decoded incoming + local) give the group absmax (scratch) and the
   super-group scales (written to the output header); then the group codes (output header)
   and levels (scratch), and the outgoing ``tau`` and leftover;
3. the values again: widths and bit offsets by running prefix sums, quantize, pack.

Packing variable widths without atomics: a code starting at bit ``p`` adds ``code << (p mod
8)`` to byte ``p div 8``'s run; a prefix sum over the tile, the sum at each run's last lane
written to a scratch row, and each output byte ``(run_k & 0xff) | (run_{k-1} >> 8)`` (the
previous run's spill); the byte a tile ends in is carried into the next tile.

The values are read twice (statistics, then quantize): the widths of a span depend on all of
its scales, and a span (64K values) does not fit on chip.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.codecs.hashing import hash_keys

from ._common import hash_u32, load_f32, tile_elems, uniform_open01, value_view
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]

#: widths are 0..8 bits
_MAX_W = 8
#: the fp32 table: the levels of width w at [2^w - 2, 2^(w+1) - 2), then the scale steps
STEPS_AT: tl.constexpr = tl.constexpr((1 << (_MAX_W + 1)) - 2)
#: the group level of a group that gets no bits (its scale is zero or not finite)
DEAD: tl.constexpr = tl.constexpr(-(1 << 26))
#: a threshold no group reaches (a span without live groups)
NEVER: tl.constexpr = tl.constexpr(1 << 30)
#: the bf16 pattern of a NaN super-group scale: the reference's (``_bf16_round_up``), the
#: pattern torch's CPU fp32 -> bf16 conversion writes, on every device
NAN_SCALE: tl.constexpr = tl.constexpr(0xFFFF)


# -- header and group scales ------------------------------------------------------------------
# (few nested @triton.jit calls: each one costs the interpreter milliseconds)


@triton.jit
def _load_s16(hdr_ptr, sg, mask):
    """bf16 bits (int32) of the super-group scales ``sg`` of a span header (0 where masked)."""
    lo = tl.load(hdr_ptr + 2 * sg, mask=mask, other=0).to(tl.int32)
    hi = tl.load(hdr_ptr + 2 * sg + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 8)


@triton.jit
def _group_scale(s, e, steps_ptr, K: tl.constexpr):
    """``fl32(S * step[e mod K]) * 2^-(e div K)`` (``_group_scale`` of the reference), the
    ``K`` scale steps at ``steps_ptr``."""
    step = tl.load(steps_ptr + e % K)
    return (s * step) * ((127 - e // K) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _level_of(s16, e, K: tl.constexpr):
    """Group level ``L = K * floor(log2 S) - e`` (``DEAD`` unless ``0 < S < inf``) and
    whether the group is live; ``floor(log2 S)`` of a bf16 subnormal from the exponent of
    its mantissa converted to fp32 (exact)."""
    live = (s16 > 0) & (s16 < 0x7F80)
    eb = (s16 >> 7) & 0xFF
    sub = (((s16 & 0x7F).to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 260
    lvl = K * tl.where(eb > 0, eb - 127, sub) - e
    return tl.where(live, lvl, DEAD), live


@triton.jit
def _group_meta(hdr_ptr, ebase, g, mask, tab_ptr, PER_SG: tl.constexpr, K: tl.constexpr):
    """Of groups ``g`` of a span header: level ``L`` (``DEAD`` if not live), whether live
    (masked groups read ``S = 0``: not live), and the group scale."""
    s16 = _load_s16(hdr_ptr, g // PER_SG, mask)
    e = tl.load(hdr_ptr + ebase + (g >> 1), mask=mask, other=0).to(tl.int32)
    e = (e >> ((g & 1) * 4)) & 15
    lvl, live = _level_of(s16, e, K)
    s = (s16 << 16).to(tl.float32, bitcast=True)
    return lvl, live, _group_scale(s, e, tab_ptr + STEPS_AT, K)


# -- water-filling ----------------------------------------------------------------------------
# ``Q``: the tuple of the integer priorities ``(Q0, ..., Q7)`` of the next bit at widths 0..7


@triton.jit
def _bits_at(p, t, Q):
    """Bits of groups of level ``p / 8`` at threshold ``t``: how many of the priorities
    ``p + Q[w]`` of their bits reach ``t``."""
    cnt = (p + Q[0] >= t).to(tl.int32) + (p + Q[1] >= t).to(tl.int32)
    cnt += (p + Q[2] >= t).to(tl.int32) + (p + Q[3] >= t).to(tl.int32)
    cnt += (p + Q[4] >= t).to(tl.int32) + (p + Q[5] >= t).to(tl.int32)
    cnt += (p + Q[6] >= t).to(tl.int32) + (p + Q[7] >= t).to(tl.int32)
    return cnt


@triton.jit
def _cost(lvl_ptr, ng, n, tau, G: tl.constexpr, Q, NT: tl.constexpr, BLK: tl.constexpr):
    """Bits the span's groups take at each of the thresholds ``tau`` ``[NT]`` (group levels
    from a scratch row)."""
    acc = tl.zeros([NT], dtype=tl.int32)
    t = tau[None, :]
    for gb in range(0, ng, BLK):
        g = gb + tl.arange(0, BLK)
        m = g < ng
        cnt = _bits_at(8 * tl.load(lvl_ptr + g, mask=m, other=DEAD)[:, None], t, Q)
        size = tl.where(m, tl.minimum(n - g * G, G), 0)
        acc += tl.sum(cnt * size[:, None], axis=0)
    return acc


@triton.jit
def _search(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    lvl_ptr,
    ng,
    n,
    budget,
    lmin,
    lmax,
    any_live,
    G: tl.constexpr,
    Q,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    NT: tl.constexpr,
    BLK: tl.constexpr,
):
    """``(tau, leftover)``: the smallest threshold in ``[8 Lmin + min Q, 8 Lmax + max Q + 1]``
    whose cost fits the budget (the cost falls as ``tau`` grows: the reference's binary
    search finds the same one), and the bits it leaves; ``NEVER`` without live groups.
    Each pass costs ``NT`` thresholds at once and keeps the bracket between two of them."""
    lo = tl.where(any_live, 8 * lmin + QMIN, 0)
    hi = tl.where(any_live, 8 * lmax + QMAX + 1, 0)
    used = tl.full([], 0, tl.int32)  # the cost at hi (none above the largest priority)
    i = tl.arange(0, NT)
    while lo < hi:
        cand = lo + ((hi - lo) * (i + 1)) // (NT + 1)  # lo <= cand < hi, non-decreasing
        cost = _cost(lvl_ptr, ng, n, cand, G, Q, NT, BLK)
        first = tl.min(tl.where(cost <= budget, i, NT), axis=0)  # the fitting ones: a suffix
        hi = tl.where(first < NT, tl.sum(tl.where(i == first, cand, 0), axis=0), hi)
        used = tl.where(first < NT, tl.sum(tl.where(i == first, cost, 0), axis=0), used)
        lo = tl.where(first > 0, tl.sum(tl.where(i == first - 1, cand, 0), axis=0) + 1, lo)
    return tl.where(any_live, lo, NEVER), budget - used


@triton.jit
def _header_allocation(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    hdr_ptr,
    lvl_ptr,
    tab_ptr,
    nsg,
    ng,
    n,
    budget,
    G: tl.constexpr,
    PER_SG: tl.constexpr,
    K: tl.constexpr,
    Q,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    NT: tl.constexpr,
    BLK: tl.constexpr,
):
    """``(tau, leftover)`` of a received pooled span: the levels of its groups from its
    header into a scratch row, then :func:`_search` over them."""
    lmin = tl.full([], 1 << 20, tl.int32)
    lmax = tl.full([], -(1 << 20), tl.int32)
    for gb in range(0, ng, BLK):
        g = gb + tl.arange(0, BLK)
        m = g < ng
        lvl, live, _ = _group_meta(hdr_ptr, 2 * nsg, g, m, tab_ptr, PER_SG, K)
        tl.store(lvl_ptr + g, lvl, mask=m)
        lmin = tl.minimum(lmin, tl.min(tl.where(live, lvl, 1 << 20), axis=0))
        lmax = tl.maximum(lmax, tl.max(tl.where(live, lvl, -(1 << 20)), axis=0))
    tl.debug_barrier()
    return _search(lvl_ptr, ng, n, budget, lmin, lmax, lmin <= lmax, G, Q, QMIN, QMAX, NT, BLK)


@triton.jit
def _tile_widths(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    hdr_ptr,
    ebase,
    tab_ptr,
    g,
    greal,
    size,
    tau,
    left,
    flat,
    rise_c,
    bit_c,
    K: tl.constexpr,
    PER_SG: tl.constexpr,
    POOLED: tl.constexpr,
    Q,
    BSG: tl.constexpr,
    CG: tl.constexpr,
):
    """Scales, widths and bit offsets of a tile's groups ``[BSG, CG]`` (in index order) from
    their span header, carrying the leftover prefix ``rise_c`` and the bit offset ``bit_c``
    from the previous tiles."""
    lvl, live, scale = _group_meta(hdr_ptr, ebase, g, greal, tab_ptr, PER_SG, K)
    if POOLED:
        p = 8 * lvl
        wb = _bits_at(p, tau, Q)
        # Q[min(wb, 7)]: the priority of the next bit
        qn = tl.where(wb == 0, Q[0], tl.where(wb == 1, Q[1], tl.where(wb == 2, Q[2], Q[3])))
        qn = tl.where(wb >= 4, tl.where(wb == 4, Q[4], tl.where(wb == 5, Q[5], Q[6])), qn)
        qn = tl.where(wb >= 7, Q[7], qn)
        rising = live & (wb < 8) & (p + qn == tau - 1)
        rs = tl.where(rising, size, 0)
        cum = tl.reshape(tl.cumsum(tl.reshape(rs, [BSG * CG]), 0), [BSG, CG]) + rise_c
        w = tl.where(live, wb + (rising & (cum <= left)).to(tl.int32), 0)
        rise_c = rise_c + tl.sum(tl.sum(rs, axis=1), axis=0)
    else:
        w = tl.where(live, flat, 0)
    nbits = w * size
    incl = tl.reshape(tl.cumsum(tl.reshape(nbits, [BSG * CG]), 0), [BSG, CG])
    off = incl - nbits + bit_c
    bit_c = bit_c + tl.sum(tl.sum(nbits, axis=1), axis=0)
    return scale, w, off, rise_c, bit_c


# -- spans and tiles --------------------------------------------------------------------------


@triton.jit
def _map_span(numel, SPAN: tl.constexpr, SG: tl.constexpr, G: tl.constexpr):
    """Map program -> one span: its index (int64), first element, values, whether it is the
    last span, its groups, super-groups, the offset of its group codes and its header bytes."""
    span = tl.program_id(0).to(tl.int64)
    start = span * SPAN
    n = tl.minimum(numel - start, SPAN).to(tl.int32)
    last = start + SPAN >= numel
    ng = (n + G - 1) // G
    nsg = (n + SG - 1) // SG
    ebase = 2 * nsg
    return span, start, n, last, ng, nsg, ebase, ebase + (ng * 4 + 7) // 8


@triton.jit
def _span_site(base_ptr, pool_ptr, span, span_bytes, b_full, b_last, POOL: tl.constexpr):
    """A span's payload and its container bits (full span, last span): at multiples of
    ``span_bytes`` with the uniform budgets, or (POOL) from the pooled table's row
    ``[budget bits, byte offset]``."""
    ptr = base_ptr + span * span_bytes
    bf = b_full
    bl = b_last
    if POOL:
        b = tl.load(pool_ptr + 2 * span).to(tl.int32)
        ptr = base_ptr + tl.load(pool_ptr + 2 * span + 1)
        bf = b
        bl = b
    return ptr, bf, bl


@triton.jit
def _span_body(span_ptr, hbytes, last, budget_full, budget_last, n):
    """The body of a span payload: its container bits (the last span's may differ), its first
    byte, its bytes, and the width of every live group when not pooled."""
    budget = tl.where(last, budget_last, budget_full)
    flat = tl.minimum(budget // tl.maximum(n, 1), 8)
    return budget, span_ptr + hbytes, (budget + 7) // 8, flat


@triton.jit
def _tile_groups(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    sgb,
    c,
    n,
    ng,
    G: tl.constexpr,
    PER_SG: tl.constexpr,
    GP: tl.constexpr,
    BSG: tl.constexpr,
    CG: tl.constexpr,
):
    """Groups ``[BSG, CG]`` of the tile (super-groups from ``sgb``, chunk ``c``): index,
    whether real, size; elements ``[BSG, CG, GP]``: index in the span, whether real."""
    sgl = tl.arange(0, BSG)[:, None]
    gi = c * CG + tl.arange(0, CG)[None, :]
    g = (sgb + sgl) * PER_SG + gi
    greal = (gi < PER_SG) & (g < ng)
    size = tl.where(greal, tl.minimum(n - g * G, G), 0)
    jj = tl.arange(0, GP)[None, None, :]
    el = g[:, :, None] * G + jj
    ereal = jj < size[:, :, None]
    return g, greal, size, jj, el, ereal


@triton.jit
def _unpack_tile(body_ptr, nbody, tab_ptr, scale, w, off, jj, ereal):
    """Decoded fp32 values ``[BSG, CG, GP]`` of a tile of a span body, from its groups'
    scales, widths and bit offsets (:func:`_tile_widths`): ``level * s`` (``0 * s`` for width
    0, so a NaN or Inf scale decodes to NaN)."""
    w3 = w[:, :, None]
    pos = off[:, :, None] + jj * w3
    m = ereal & (w3 > 0)
    byte = pos >> 3
    b0 = tl.load(body_ptr + byte, mask=m & (byte < nbody), other=0).to(tl.int32)
    b1 = tl.load(body_ptr + byte + 1, mask=m & (byte + 1 < nbody), other=0).to(tl.int32)
    code = ((b0 | (b1 << 8)) >> (pos & 7)) & ((1 << w3) - 1)
    level = tl.load(tab_ptr + (1 << w3) - 2 + code, mask=m, other=0.0)
    return level * scale[:, :, None]


@triton.jit
def _tile_values(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    x_ptr,
    in_ptr,
    ebase,
    in_body,
    in_nbody,
    tab_ptr,
    sgb,
    c,
    n,
    ng,
    in_tau,
    in_left,
    in_flat,
    in_rise,
    in_bit,
    FUSED: tl.constexpr,
    IN_KIND: tl.constexpr,
    G: tl.constexpr,
    PER_SG: tl.constexpr,
    GP: tl.constexpr,
    K: tl.constexpr,
    POOLED: tl.constexpr,
    Q,
    BSG: tl.constexpr,
    CG: tl.constexpr,
):
    """A tile (:func:`_tile_groups`) and its fp32 values: ``x``, or (``FUSED``) the decoded
    incoming span plus ``x``, carrying the incoming span's ``in_rise`` and ``in_bit``."""
    g, greal, size, jj, el, ereal = _tile_groups(sgb, c, n, ng, G, PER_SG, GP, BSG, CG)
    v = load_f32(x_ptr, el, ereal, IN_KIND)
    if FUSED:
        scale, w, off, in_rise, in_bit = _tile_widths(
            in_ptr, ebase, tab_ptr, g, greal, size, in_tau, in_left, in_flat, in_rise, in_bit, K,
            PER_SG, POOLED, Q, BSG, CG,
        )  # fmt: skip
        v = _unpack_tile(in_body, in_nbody, tab_ptr, scale, w, off, jj, ereal) + v
    return g, greal, size, jj, el, ereal, v, in_rise, in_bit


@triton.jit
def _quantize(v, scale, w, tab_ptr, idx, key0, key1, ckey0, ckey1, hop, num_hops, MODE):  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    """Level index of each value (``_quantize`` of the reference) in its width's table: the
    nearest (ties to the lower level) or, with a dither ``u``, the upper neighbour when
    ``u < frac``; 0 where the width is 0."""
    m = w > 0
    y = tl.math.div_rn(v, tl.where(m, scale, 1.0))
    y = tl.minimum(tl.maximum(y, -1.0), 1.0)
    nlev = 1 << w
    base = nlev - 2
    # searchsorted(levels, y): how many levels are < y (binary lifting over <= 256 levels)
    cnt = tl.zeros_like(w)
    for b in tl.static_range(8):
        cand = cnt + (128 >> b)
        ok = m & (cand <= nlev)
        lv = tl.load(tab_ptr + base + cand - 1, mask=ok, other=0.0)
        cnt = tl.where(ok & (lv < y), cand, cnt)
    hi = tl.minimum(tl.maximum(cnt, 1), nlev - 1)
    lo = hi - 1
    l_lo = tl.load(tab_ptr + base + lo, mask=m, other=0.0)
    l_hi = tl.load(tab_ptr + base + hi, mask=m, other=1.0)
    frac = tl.math.div_rn(y - l_lo, l_hi - l_lo)
    frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
    if MODE == 0:
        up = frac > 0.5
    else:
        u = uniform_open01(hash_u32(idx, key0, key1))
        if MODE == 2:
            # correlated: u = (stratum + v) / H, stratum = (per-coordinate shift + hop) mod H
            shift = hash_u32(idx, ckey0, ckey1).to(tl.int64) % num_hops
            stratum = (shift + hop) % num_hops
            u = tl.math.div_rn(stratum.to(tl.float32) + u, num_hops.to(tl.float32))
        up = u < frac
    return tl.where(m, tl.where(up, hi, lo), 0)


@triton.jit
def _span_statistics(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    x_span, inp, out, stat, tab_ptr, ebase, in_body, in_nbody, nsg, n, ng, in_tau, in_left,
    in_flat, FUSED: tl.constexpr, IN_KIND: tl.constexpr, G: tl.constexpr, PER_SG: tl.constexpr,
    GP: tl.constexpr, K: tl.constexpr, POOLED: tl.constexpr, Q, BSG: tl.constexpr,
    CG: tl.constexpr, NCH: tl.constexpr,
):  # fmt: skip
    """Phase 2a of :func:`_dq_encode_kernel`: every group's absmax bits into ``stat``, every
    super-group's scale into the output header."""
    zero = tl.full([], 0, tl.int32)
    in_rise = zero
    in_bit = zero
    for sgb in range(0, nsg, BSG):
        amax = tl.zeros([BSG], dtype=tl.int32)
        for c in range(NCH):
            # -- load with mask: fp32 values (fused: decoded partial sum + local)
            g, greal, _, _, _, ereal, v, in_rise, in_bit = _tile_values(
                x_span, inp, ebase, in_body, in_nbody, tab_ptr, sgb, c, n, ng, in_tau, in_left,
                in_flat, in_rise, in_bit, FUSED, IN_KIND, G, PER_SG, GP, K, POOLED, Q, BSG, CG,
            )  # fmt: skip
            # -- compute: integer max of the magnitude bits (NaN > Inf > finite)
            mag = tl.where(ereal, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
            ag = tl.max(mag, axis=2)
            tl.store(stat + g, ag, mask=greal)
            amax = tl.maximum(amax, tl.max(ag, axis=1))
        # -- store with mask: S = the smallest bf16 >= absmax (NaN: NAN_SCALE)
        sg = sgb + tl.arange(0, BSG)
        s16 = tl.where(amax > 0x7F800000, NAN_SCALE, (amax + 0xFFFF) >> 16)
        tl.store(out + 2 * sg, (s16 & 0xFF).to(tl.uint8), mask=sg < nsg)
        tl.store(out + 2 * sg + 1, (s16 >> 8).to(tl.uint8), mask=sg < nsg)
    tl.debug_barrier()


@triton.jit
def _group_codes(out, stat, tab_ptr, ebase, ng, K: tl.constexpr, PER_SG: tl.constexpr,
                 BLK: tl.constexpr):  # fmt: skip
    """Phase 2b of :func:`_dq_encode_kernel`: every group's scale code into the output header
    (two per byte) and its level into ``stat`` (over its absmax); returns the smallest and
    largest level of the live groups."""
    lmin = tl.full([], 1 << 20, tl.int32)
    lmax = tl.full([], -(1 << 20), tl.int32)
    for pb in range(0, (ng + 1) // 2, BLK // 2):
        pr = pb + tl.arange(0, BLK // 2)
        g = 2 * pr[:, None] + tl.arange(0, 2)[None, :]
        m = g < ng
        a = tl.load(stat + g, mask=m, other=0)
        s16 = _load_s16(out, g // PER_SG, m)
        s = (s16 << 16).to(tl.float32, bitcast=True)
        af = a.to(tl.float32, bitcast=True)
        # the 16 candidate group scales, as the decoder computes them: the largest code
        # whose scale is still >= the absmax
        j = tl.arange(0, 16)[None, None, :]
        cand = _group_scale(s[:, :, None], j, tab_ptr + STEPS_AT, K)
        e = tl.max(tl.where(cand >= af[:, :, None], j, -1), axis=2)
        e = tl.minimum(tl.maximum(e, 0), 15)
        e = tl.where(a == 0, 15, e)
        e = tl.where(m, e, 0)
        tl.debug_barrier()  # every absmax of the block is read before its level overwrites it
        nib = tl.sum(e << (tl.arange(0, 2)[None, :] * 4), axis=1)
        tl.store(out + ebase + pr, nib.to(tl.uint8), mask=2 * pr < ng)
        lvl, live = _level_of(s16, e, K)
        live = live & m
        tl.store(stat + g, lvl, mask=m)
        lmin = tl.minimum(lmin, tl.min(tl.min(tl.where(live, lvl, 1 << 20), axis=1), axis=0))
        lmax = tl.maximum(lmax, tl.max(tl.max(tl.where(live, lvl, -(1 << 20)), axis=1), axis=0))
    tl.debug_barrier()
    return lmin, lmax


@triton.jit
def _quantize_pack(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    x_span, inp, out, body, pack, tab_ptr, ebase, in_body, in_nbody, nsg, n, ng, in_tau,
    in_left, in_flat, tau, left, flat, base, key0, key1, ckey0, ckey1, hop, num_hops,
    FUSED: tl.constexpr, IN_KIND: tl.constexpr, G: tl.constexpr, PER_SG: tl.constexpr,
    GP: tl.constexpr, K: tl.constexpr, POOLED: tl.constexpr, MODE: tl.constexpr, Q,
    BSG: tl.constexpr, CG: tl.constexpr, NCH: tl.constexpr,
):  # fmt: skip
    """Phase 3 of :func:`_dq_encode_kernel`: the values again (``base``: the global index of
    the span's first one), their widths, offsets and level indices, packed into ``body``;
    returns the byte the last tile ended in, its run and the run before it."""
    zero = tl.full([], 0, tl.int32)
    NE: tl.constexpr = BSG * CG * GP
    in_rise = zero
    in_bit = zero
    rise = zero
    bit = zero
    kc = zero  # the byte the previous tile ended in, its run so far, and the run before it
    crun = zero
    cprev = zero
    lane = tl.arange(0, NE)
    for sgb in range(0, nsg, BSG):
        for c in range(NCH):
            # -- load with mask: the values, as in 2a
            g, greal, size, jj, el, ereal, v, in_rise, in_bit = _tile_values(
                x_span, inp, ebase, in_body, in_nbody, tab_ptr, sgb, c, n, ng, in_tau, in_left,
                in_flat, in_rise, in_bit, FUSED, IN_KIND, G, PER_SG, GP, K, POOLED, Q, BSG, CG,
            )  # fmt: skip
            k0 = bit >> 3
            # -- store: the byte the previous tile ended in, when this tile starts past it
            tl.store(body + kc, ((crun & 0xFF) | (cprev >> 8)).to(tl.uint8), mask=k0 != kc)
            # -- compute: the groups' scales and widths, then the level indices
            scale, w, off, rise, bit = _tile_widths(
                out, ebase, tab_ptr, g, greal, size, tau, left, flat, rise, bit, K, PER_SG,
                POOLED, Q, BSG, CG,
            )  # fmt: skip
            w3 = tl.where(ereal, w[:, :, None], 0)
            idx = base + el
            code = _quantize(
                v, scale[:, :, None], w3, tab_ptr, idx, key0, key1, ckey0, ckey1, hop,
                num_hops, MODE,
            )  # fmt: skip
            # -- pack: byte runs of the codes (code << (p mod 8) at byte p div 8)
            pos = off[:, :, None] + tl.where(ereal, jj, size[:, :, None]) * w[:, :, None]
            key = tl.reshape(pos >> 3, [NE])
            nxt = tl.reshape((pos + w3) >> 3, [NE])
            psum = tl.cumsum(tl.reshape(code << (pos & 7), [NE]), 0)
            k1 = tl.max(key, axis=0)
            tl.debug_barrier()  # the previous tile has read its run sums
            tl.store(pack + key - k0 + 1, psum, mask=(nxt != key) | (lane == NE - 1))
            tl.debug_barrier()
            nb = k1 - k0
            r0 = tl.load(pack + lane + 1, mask=lane <= nb, other=0)
            r0 -= tl.load(pack + lane, mask=(lane >= 1) & (lane <= nb), other=0)
            r1 = tl.load(pack + lane, mask=(lane >= 1) & (lane <= nb), other=0)
            r1 -= tl.load(pack + lane - 1, mask=(lane >= 2) & (lane <= nb), other=0)
            cont = k0 == kc
            run = r0 + tl.where((lane == 0) & cont, crun, 0)
            prev = r1 + tl.where((lane == 1) & cont, crun, 0)
            first_prev = tl.where(cont, cprev, tl.where(k0 == kc + 1, crun, 0))
            prev = tl.where(lane == 0, first_prev, prev)
            # -- store with mask: the bytes this tile completed
            byte = (run & 0xFF) | (prev >> 8)
            tl.store(body + k0 + lane, byte.to(tl.uint8), mask=lane < nb)
            kc = k1
            crun = tl.sum(tl.where(lane == nb, run, 0), axis=0)
            cprev = tl.sum(tl.where(lane == nb, prev, 0), axis=0)
    return kc, crun, cprev


# -- kernels ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["offset", "key0", "key1", "ckey0", "ckey1", "hop", "num_hops"])
def _dq_encode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values (encode) or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload (reduce; unused when not FUSED)
    out_ptr,  # output payload
    tab_ptr,  # fp32: level tables, then the scale steps
    stat_ptr,  # int32 scratch [spans, NG]: group absmax bits, then group levels
    lin_ptr,  # int32 scratch [spans, NG]: group levels of the incoming span (FUSED)
    pack_ptr,  # int32 scratch [spans, BSG * CG * GP + 2]: the packer's run sums
    in_pool_ptr,  # int64 [spans, 2] (POOL_IN): each incoming span's budget bits, byte offset
    out_pool_ptr,  # int64 [spans, 2] (POOL_OUT): the same for the output payload
    # sizes
    numel,
    in_span_bytes,  # bytes of a full span in the incoming payload
    out_span_bytes,
    in_budget,  # bits of a full span's container, and of the last (partial) span's
    in_budget_last,
    out_budget,
    out_budget_last,
    # hop context of the output (stochastic and correlated rounding)
    offset,  # global index of element 0
    key0,
    key1,
    ckey0,  # keys of the per-coordinate hop shift (correlated)
    ckey1,
    hop,
    num_hops,
    # meta-parameters
    FUSED: tl.constexpr,  # reduce: values = decode(in payload) + local
    POOL_IN: tl.constexpr,  # the incoming spans' budgets from in_pool_ptr (pooling="bucket")
    POOL_OUT: tl.constexpr,
    IN_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    SPAN: tl.constexpr,
    SG: tl.constexpr,
    G: tl.constexpr,
    PER_SG: tl.constexpr,  # SG // G
    NG: tl.constexpr,  # groups of a full span
    K: tl.constexpr,  # scale_steps
    POOLED: tl.constexpr,
    MODE: tl.constexpr,  # 0 nearest, 1 uniform dither, 2 correlated dither
    Q0: tl.constexpr,  # the integer priorities of the next bit at widths 0..7
    Q1: tl.constexpr,
    Q2: tl.constexpr,
    Q3: tl.constexpr,
    Q4: tl.constexpr,
    Q5: tl.constexpr,
    Q6: tl.constexpr,
    Q7: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    NT: tl.constexpr,  # thresholds costed per pass of the water-filling search
    GP: tl.constexpr,  # group size padded to a power of two
    CG: tl.constexpr,  # groups per tile row (a power of two)
    BSG: tl.constexpr,  # super-groups per tile
    NCH: tl.constexpr,  # chunks of CG groups per super-group
    BLK: tl.constexpr,  # groups per step of the group loops
):
    # bytes moved per element: the values twice (4 fp32, 2 bf16/fp16), the output payload
    # (bits_k / 8 + 2 / SG + 1 / 2G) once; FUSED adds the incoming payload twice; scratch
    # (L2-resident): 8 / G written and read, and the packer's run sums (~bits / 2)

    # -- map program -> one span
    span, start, n, last, ng, nsg, ebase, hbytes = _map_span(numel, SPAN, SG, G)
    x_span = x_ptr + start
    out, ob_full, ob_last = _span_site(
        out_ptr, out_pool_ptr, span, out_span_bytes, out_budget, out_budget_last, POOL_OUT
    )
    budget, body, nbody, flat = _span_body(out, hbytes, last, ob_full, ob_last, n)
    stat = stat_ptr + span * NG
    NE: tl.constexpr = BSG * CG * GP
    pack = pack_ptr + span * (NE + 2)
    zero = tl.full([], 0, tl.int32)
    Q = (Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7)

    # -- 1. the incoming span's allocation (FUSED)
    inp, ib_full, ib_last = _span_site(
        in_ptr, in_pool_ptr, span, in_span_bytes, in_budget, in_budget_last, POOL_IN
    )
    in_budget_n, in_body, in_nbody, in_flat = _span_body(inp, hbytes, last, ib_full, ib_last, n)
    in_tau = zero
    in_left = zero
    if FUSED and POOLED:
        in_tau, in_left = _header_allocation(
            inp, lin_ptr + span * NG, tab_ptr, nsg, ng, n, in_budget_n, G, PER_SG, K, Q, QMIN,
            QMAX, NT, BLK,
        )  # fmt: skip

    # -- 2a. statistics: group absmax (scratch), super-group scales (output header)
    _span_statistics(
        x_span, inp, out, stat, tab_ptr, ebase, in_body, in_nbody, nsg, n, ng, in_tau, in_left,
        in_flat, FUSED, IN_KIND, G, PER_SG, GP, K, POOLED, Q, BSG, CG, NCH,
    )  # fmt: skip

    # -- 2b. group codes (output header) and levels (scratch), two groups per byte
    lmin, lmax = _group_codes(out, stat, tab_ptr, ebase, ng, K, PER_SG, BLK)
    tau = zero
    left = zero
    if POOLED:
        tau, left = _search(
            stat, ng, n, budget, lmin, lmax, lmin <= lmax, G, Q, QMIN, QMAX, NT, BLK
        )

    # -- 3. the values again: widths, offsets, quantize, pack
    kc, crun, cprev = _quantize_pack(
        x_span, inp, out, body, pack, tab_ptr, ebase, in_body, in_nbody, nsg, n, ng, in_tau,
        in_left, in_flat, tau, left, flat, offset + start, key0, key1, ckey0, ckey1, hop,
        num_hops, FUSED, IN_KIND, G, PER_SG, GP, K, POOLED, MODE, Q, BSG, CG, NCH,
    )  # fmt: skip

    # -- store with mask: the last byte, its spill, zeros to the end of the container
    b0 = (crun & 0xFF) | (cprev >> 8)
    b1 = crun >> 8
    for zb in range(kc, nbody, BLK):
        i = zb + tl.arange(0, BLK)
        val = tl.where(i == kc, b0, tl.where(i == kc + 1, b1, 0))
        tl.store(body + i, val.to(tl.uint8), mask=i < nbody)


@triton.jit
def _dq_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    in_ptr,  # payload
    out_ptr,  # fp32 values
    tab_ptr,  # fp32: level tables, then the scale steps
    lin_ptr,  # int32 scratch [spans, NG]: group levels
    in_pool_ptr,  # int64 [spans, 2] (POOL_IN): each span's budget bits and byte offset
    # sizes
    numel,
    in_span_bytes,
    in_budget,
    in_budget_last,
    # meta-parameters
    POOL_IN: tl.constexpr,
    SPAN: tl.constexpr,
    SG: tl.constexpr,
    G: tl.constexpr,
    PER_SG: tl.constexpr,
    NG: tl.constexpr,
    K: tl.constexpr,
    POOLED: tl.constexpr,
    Q0: tl.constexpr,
    Q1: tl.constexpr,
    Q2: tl.constexpr,
    Q3: tl.constexpr,
    Q4: tl.constexpr,
    Q5: tl.constexpr,
    Q6: tl.constexpr,
    Q7: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    NT: tl.constexpr,  # thresholds costed per pass of the water-filling search
    GP: tl.constexpr,
    CG: tl.constexpr,
    BSG: tl.constexpr,
    NCH: tl.constexpr,
    BLK: tl.constexpr,
):
    # bytes moved per element: the payload (bits_k / 8 + 2 / SG + 1 / 2G) read, 4 written;
    # scratch: 4 / G written and read

    # -- map program -> one span
    span, start, n, last, ng, nsg, ebase, hbytes = _map_span(numel, SPAN, SG, G)
    inp, ib_full, ib_last = _span_site(
        in_ptr, in_pool_ptr, span, in_span_bytes, in_budget, in_budget_last, POOL_IN
    )
    budget, body, nbody, flat = _span_body(inp, hbytes, last, ib_full, ib_last, n)
    zero = tl.full([], 0, tl.int32)
    Q = (Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7)

    # -- compute: the span's allocation from its header
    tau = zero
    left = zero
    if POOLED:
        tau, left = _header_allocation(
            inp, lin_ptr + span * NG, tab_ptr, nsg, ng, n, budget, G, PER_SG, K, Q, QMIN, QMAX,
            NT, BLK,
        )  # fmt: skip

    # -- load with mask, compute, store: the values, tile by tile
    rise = zero
    bit = zero
    for sgb in range(0, nsg, BSG):
        for c in range(NCH):
            g, greal, size, jj, el, ereal = _tile_groups(sgb, c, n, ng, G, PER_SG, GP, BSG, CG)
            scale, w, off, rise, bit = _tile_widths(
                inp, ebase, tab_ptr, g, greal, size, tau, left, flat, rise, bit, K, PER_SG,
                POOLED, Q, BSG, CG,
            )  # fmt: skip
            v = _unpack_tile(body, nbody, tab_ptr, scale, w, off, jj, ereal)
            tl.store(out_ptr + start + el, v, mask=ereal)


# -- launchers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Launch geometry and the per-span sizes of one (codec, numel, ctx)."""

    spans: int
    span_bytes: int  # bytes of a full span
    budget: int  # container bits of a full span
    budget_last: int  # of the last span (partial or full)


def _pool_table(
    codec: DynamiqCodec, numel: int, ctx: HopContext, device: torch.device
) -> torch.Tensor | None:
    """``[spans, 2]`` int64: each span's budget (bits) and payload offset (bytes) under
    ``pooling="bucket"`` with the prologue's result in ``ctx``, else ``None`` (uniform)."""
    table = codec.wire().span_table(numel, ctx)
    return None if table is None else table.contiguous().to(device)


def _plan(codec: DynamiqCodec, numel: int, ctx: HopContext) -> _Plan:
    spans = -(-numel // codec.span)
    last = numel - (spans - 1) * codec.span
    wire = codec.wire()
    budget, budget_last = wire.budget(codec.span, ctx), wire.budget(last, ctx)
    span_bytes = wire.header_nbytes(codec.span) + (budget + 7) // 8
    total = (spans - 1) * span_bytes + wire.header_nbytes(last) + (budget_last + 7) // 8
    if not wire.pooled(ctx) and total != codec.encoded_nbytes(numel, ctx):
        # the layout must be the reference's (pooled budgets: from the per-span table)
        raise RuntimeError(
            f"dynamiq kernels: {total} payload bytes planned for {numel} values, but the "
            f"codec encodes them in {codec.encoded_nbytes(numel, ctx)}"
        )
    return _Plan(spans=spans, span_bytes=span_bytes, budget=budget, budget_last=budget_last)


def _meta(codec: DynamiqCodec, numel: int, device: torch.device) -> dict[str, int]:
    """Compile-time parameters: the codec's geometry and priorities, and the tile shape."""
    g, sg = codec.group, codec.super_group
    per_sg = sg // g
    gp = triton.next_power_of_2(g)
    tile = tile_elems(device)  # values per tile: more in the interpreter (fewer steps)
    cg = min(triton.next_power_of_2(per_sg), max(1, tile // gp))
    nch = -(-per_sg // cg)
    n_sg = -(-min(numel, codec.span) // sg)
    bsg = 1 if nch > 1 else max(1, min(tile // (cg * gp), triton.next_power_of_2(n_sg)))
    ng_span = codec.span // g
    q = codec.wire().priorities
    return {
        "SPAN": codec.span,
        "SG": sg,
        "G": g,
        "PER_SG": per_sg,
        "NG": ng_span,
        "K": codec.scale_steps,
        "POOLED": codec.pooled,
        **{f"Q{w}": q[w] for w in range(_MAX_W)},
        "QMIN": min(q),
        "QMAX": max(q),
        "NT": 16,
        "GP": gp,
        "CG": cg,
        "BSG": bsg,
        "NCH": nch,
        "BLK": max(2, min(triton.next_power_of_2(ng_span), tile // 2)),
    }


@functools.lru_cache(maxsize=64)
def _table_cpu(codec: DynamiqCodec) -> torch.Tensor:
    """The reference's level tables and scale steps (``codec.wire()``), in one fp32 row."""
    wire = codec.wire()
    parts = [wire.levels(w).to(torch.float32).cpu() for w in range(1, _MAX_W + 1)]
    k = codec.scale_steps
    parts.append(wire.group_steps[:k])
    table = torch.cat(parts)
    assert table.numel() == (1 << (_MAX_W + 1)) - 2 + k
    return table


@functools.lru_cache(maxsize=64)
def _table(codec: DynamiqCodec, device: torch.device) -> torch.Tensor:
    # kept per device: a copy to the GPU on every call showed up in the H200 profile as a
    # pageable host-to-device copy per reduce
    return _table_cpu(codec).to(device)


def _scratch(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.empty((max(rows, 1), max(cols, 1)), dtype=torch.int32, device=device)


@dataclass(frozen=True)
class _Launch:
    """What both encode kernels take for one call: the payloads' layouts, the output hop's
    dither keys and rounding mode, and the pooled tables (``None``: uniform budgets)."""

    plan: _Plan
    in_plan: _Plan
    keys: tuple[int, int, int, int]  # key0, key1 (the dither), ckey0, ckey1 (the hop shift)
    mode: int  # 0 nearest, 1 uniform dither, 2 correlated dither
    out_pool: torch.Tensor | None
    in_pool: torch.Tensor | None

    def sizes(self, numel: int, out_ctx: HopContext) -> tuple[int, ...]:
        """The kernels' size and hop-context arguments, in their order (``numel`` to
        ``num_hops``)."""
        p, q = self.plan, self.in_plan
        return (
            numel, q.span_bytes, p.span_bytes, q.budget, q.budget_last, p.budget,
            p.budget_last, out_ctx.offset, *self.keys, out_ctx.hop, out_ctx.num_hops,
        )  # fmt: skip

    def flags(self, fused: bool) -> dict[str, Any]:
        """The kernels' ``FUSED``, ``POOL_IN``, ``POOL_OUT`` and ``MODE``."""
        pool_in, pool_out = self.in_pool is not None, self.out_pool is not None
        return {"FUSED": fused, "POOL_IN": pool_in, "POOL_OUT": pool_out, "MODE": self.mode}


def _launch(
    codec: DynamiqCodec, numel: int, fused: bool, in_ctx: HopContext, out_ctx: HopContext,
    device: torch.device,
) -> _Launch:  # fmt: skip
    plan = _plan(codec, numel, out_ctx)
    key0, key1 = hash_keys(out_ctx.seed, out_ctx.step, out_ctx.hop, out_ctx.rank)
    ckey0, ckey1 = hash_keys(out_ctx.seed, out_ctx.step, 0xFFFFFFFF, 0xFFFFFFFF)
    mode = 0
    if codec.rounding != "nearest":
        mode = 2 if codec.rounding == "correlated" and out_ctx.num_hops > 1 else 1
    return _Launch(
        plan=plan,
        in_plan=_plan(codec, numel, in_ctx) if fused else plan,
        keys=(key0, key1, ckey0, ckey1),
        mode=mode,
        out_pool=_pool_table(codec, numel, out_ctx, device),
        in_pool=_pool_table(codec, numel, in_ctx, device) if fused else None,
    )


def _encode_into(
    codec: DynamiqCodec,
    values: torch.Tensor,
    incoming: torch.Tensor | None,
    in_ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    device = values.device
    numel = values.numel()
    out = torch.empty(codec.encoded_nbytes(numel, out_ctx) or 0, dtype=torch.uint8, device=device)
    if numel == 0:
        return out
    fused = incoming is not None
    la = _launch(codec, numel, fused, in_ctx, out_ctx, device)
    if dynamiq_tiles.eligible(codec):
        dynamiq_tiles.encode_into(codec, values, incoming, out, la, out_ctx)
        return out
    spans = la.plan.spans
    meta = _meta(codec, numel, device)
    ne = meta["BSG"] * meta["CG"] * meta["GP"]
    xv, kind = value_view(values)
    stat = _scratch(spans, meta["NG"], device)
    lin = _scratch(spans, meta["NG"], device) if fused else stat
    pack = _scratch(spans, ne + 2, device)
    in_pool = la.in_pool if la.in_pool is not None else stat
    out_pool = la.out_pool if la.out_pool is not None else stat
    _dq_encode_kernel[(spans,)](
        xv, incoming if fused else out, out, _table(codec, device), stat, lin, pack, in_pool,
        out_pool, *la.sizes(numel, out_ctx), IN_KIND=kind, **la.flags(fused), **meta,
        num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_dq_encode_kernel")
    return out


def encode(codec: DynamiqCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend (outside a collective, the input range
    is checked first, as the reference does: one pass and a host read)."""
    codec.check_range(x, ctx)
    return _encode_into(codec, x, None, ctx, ctx)


def reduce(
    codec: DynamiqCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: one kernel; the incoming payload and
    the local slice are read twice (statistics, then quantize), no fp32 tensor in memory."""
    return _encode_into(codec, local, payload, ctx, out_ctx)


def decode(codec: DynamiqCodec, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    device = payload.device
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel == 0:
        return out
    plan = _plan(codec, numel, ctx)
    pool = _pool_table(codec, numel, ctx, device)
    if dynamiq_tiles.eligible(codec):
        dynamiq_tiles.decode_into(codec, payload, out, plan, pool)
        return out
    meta = _meta(codec, numel, device)
    lin = _scratch(plan.spans, meta["NG"], device)
    _dq_decode_kernel[(plan.spans,)](
        payload, out, _table(codec, device), lin, pool if pool is not None else lin, numel,
        plan.span_bytes, plan.budget, plan.budget_last, POOL_IN=pool is not None, **meta,
        num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_dq_decode_kernel")
    return out


# codecs whose spans are one super-group (the default) run dynamiq_tiles' kernels, many spans
# a program; it imports this module's jit functions, so it comes last
from . import dynamiq_tiles  # noqa: E402
