"""Triton kernels of the dynamic-range block INT codecs (``int2`` ... ``int8``, any
``block_size``, ``rounding`` and ``scale_format``).

Reference: :class:`dynamiq.codecs.intq.IntCodec` (``_encode``, ``_decode``, and ``_reduce`` =
``_encode(_decode(payload) + local.float())``), wire layout in ``docs/formats.md``. Bit-exact
with it:

* the scale: the reference rounds ``absmax / qmax`` up to the scale format in fp64 and fixes
  the fp64 rounding up with ``s * qmax < absmax``. That equals the smallest value ``S`` of the
  scale format with ``S * qmax >= absmax`` exactly (fp64 rounding is monotone and no fp64
  number lies strictly between ``fl64(r)`` and ``r``), which :func:`_int_scale` computes:
  for bf16 scales by truncating ``fl32(absmax / qmax)`` to bf16 and stepping up once where
  ``T * qmax < absmax`` (:func:`_bf16_int_scale`), for the others with integer arithmetic on
  the fp32 bits of the absmax, ``S = ceil(r / 2^g) * 2^g`` with ``2^g`` the format's spacing
  at ``r = absmax / qmax`` (:func:`_int_scale_bits`);
* ``q = fl32(x / S)`` with ``div_rn`` (round to nearest, as torch divides), codes by
  ``torch.round`` (ties to even: ``(q + 1.5 * 2^23) - 1.5 * 2^23``) or ``floor(q) + [u < q -
  floor(q)]`` with ``u`` from the counter hash (integer operations);
* the absmax is the integer max of the magnitude bits, so NaN/Inf are never dropped;
* a block beyond ``max_input_abs`` sets an error word; the launcher raises the reference's
  ``ValueError``.

Layout: 8- and 4-bit codes in power-of-two blocks take :func:`_int_rows_kernel`, one block
per row ``[ROWS, block_size]`` (wide loads and stores). Otherwise a program owns ``ROWS`` tiles
of ``L`` whole blocks, ``L = 8 / gcd(block_size, 8)``,
so a tile holds a multiple of 8 codes (whole bytes: programs write disjoint bytes), laid out
``[ROWS, G, 8]`` (``G`` groups of 8 codes, padded to a power of two). Tiles of more than
``MAX_TILE`` values (huge blocks) take two kernels instead: one pass per block for its scale,
then one that reads the scale back and quantizes (the values are read twice).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.hashing import hash_keys
from dynamiq.codecs.intq import IntCodec
from dynamiq.codecs.packing import packed_nbytes
from dynamiq.codecs.wire_codes import SCALE_FORMATS as SCALE_CODES

from ._common import (
    NAN_BF16,
    NAN_F16,
    NAN_F32,
    bits_to_f32,
    f16_bits_to_f32_bits,
    f32_to_bits,
    floor_log2,
    hash_u32,
    load_codes,
    load_f32,
    pack_rows,
    program_groups,
    sign_extend,
    store_codes,
    tile_elems,
    uniform_open01,
    unpack_rows,
    value_view,
)
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]

#: largest tile (values) a program keeps in registers; larger ones take the two-kernel path
MAX_TILE = 4096
#: 8- and 4-bit codes in power-of-two blocks take :func:`_int_rows_kernel` (blocks as rows); False
#: sends them through the general ``[ROWS, G, 8]`` kernel (``benchmarks/gpu_check.py`` times both)
ROWS_PATH = True
#: warps per program of the rows kernel (tuned on an H200 by ``benchmarks/gpu_check.py``)
NUM_WARPS = 4

# scale formats: code, significant bits P, exponent of the smallest positive value GMIN
_FMT = {k: (f.code, f.p, f.gmin) for k, f in SCALE_CODES.items()}
# the scale-format codes as the JIT functions below compare them (constexpr globals)
FMT_BF16: tl.constexpr = tl.constexpr(SCALE_CODES["bf16"].code)
FMT_FP16: tl.constexpr = tl.constexpr(SCALE_CODES["fp16"].code)
FMT_FP32: tl.constexpr = tl.constexpr(SCALE_CODES["fp32"].code)
FMT_E8M0: tl.constexpr = tl.constexpr(SCALE_CODES["e8m0"].code)


# -- scales -----------------------------------------------------------------------------------


@triton.jit
def _int_scale(
    a,
    QMAX: tl.constexpr,
    KQ: tl.constexpr,
    P: tl.constexpr,
    GMIN: tl.constexpr,
    FMT: tl.constexpr,
    MAX_IN_BITS: tl.constexpr,
):
    """Scale of blocks with absmax bits ``a`` (int32 >= 0): ``(S as fp32, S's bits in the
    scale format, absmax > max_input_abs)``. ``S`` is the smallest value of the format (``P``
    significant bits, smallest positive value ``2^GMIN``) with ``S * QMAX >= absmax``; 0 for
    an all-zero block (E8M0: 2^-127); NaN when the block holds NaN/Inf. ``KQ = floor(log2
    QMAX)``. bf16 (the default) with float operations, the others with integer ones."""
    if FMT == FMT_BF16:
        scale, stored, over = _bf16_int_scale(a, QMAX, MAX_IN_BITS)
    else:
        scale, stored, over = _int_scale_bits(a, QMAX, KQ, P, GMIN, FMT, MAX_IN_BITS)
    return scale, stored, over


@triton.jit
def _int_scale_bits(
    a,
    QMAX: tl.constexpr,
    KQ: tl.constexpr,
    P: tl.constexpr,
    GMIN: tl.constexpr,
    FMT: tl.constexpr,
    MAX_IN_BITS: tl.constexpr,
):
    """:func:`_int_scale` of the fp16, fp32 and E8M0 scale formats, in integer arithmetic on
    the fp32 bits of the absmax (the module docstring says why it is exact)."""
    finite = a < 0x7F800000
    # absmax = m24 * 2^e2 exactly, m24 < 2^24
    ef = a >> 23
    m24 = tl.where(ef > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF).to(tl.int64)
    e2 = tl.maximum(ef, 1) - 150
    eM = tl.maximum(floor_log2(m24), 0)
    # fl = floor(log2(absmax / QMAX)), compared exactly: m24 / 2^eM < QMAX / 2^KQ ?
    qm = tl.zeros_like(m24) + QMAX
    fl = eM + e2 - KQ - ((m24 << KQ) < (qm << eM)).to(tl.int32)
    # spacing 2^ge of the format at r; S = ceil(r / 2^ge) * 2^ge = n * 2^ge, n <= 2^P
    ge = tl.maximum(fl - (P - 1), GMIN)
    sh = e2 - ge  # r / 2^ge = m24 * 2^sh / QMAX, sh <= 31
    num = m24 << tl.maximum(sh, 0)
    den = qm << tl.minimum(tl.maximum(-sh, 0), 40)  # beyond 2^40: n = 1 all the same
    n = (num + den - 1) // den
    ln = floor_log2(n)
    ed = ge + ln  # S = 2^ed * (n / 2^ln)
    man23 = (((n << 23) >> ln) & 0x7FFFFF).to(tl.int32)
    sub_f32 = (n << tl.minimum(tl.maximum(ge + 149, 0), 31)).to(tl.int32)
    f32 = tl.where(ed >= -126, ((ed + 127) << 23) | man23, sub_f32)
    f32 = tl.where(a == 0, 0, f32)
    if FMT == FMT_E8M0:
        f32 = tl.where(a == 0, 1 << 22, f32)  # E8M0 has no zero: 2^-127
    # the stored bits
    if FMT == FMT_FP16:
        man10 = (((n << 10) >> ln) & 0x3FF).to(tl.int32)
        sub16 = (n << tl.minimum(tl.maximum(ge + 24, 0), 31)).to(tl.int32)
        h = tl.where(ed >= -14, ((ed + 15) << 10) | man10, sub16)
        stored = tl.where(finite, tl.where(a == 0, 0, h), NAN_F16)
    elif FMT == FMT_FP32:
        stored = tl.where(finite, f32, NAN_F32)
    else:
        stored = tl.where(finite, tl.where(a == 0, 0, ed + 127), 0xFF)
    scale = tl.where(finite, bits_to_f32(f32), float("nan"))
    over = finite & (a > MAX_IN_BITS)
    return scale, stored, over


@triton.jit
def _bf16_int_scale(a, QMAX: tl.constexpr, MAX_IN_BITS: tl.constexpr):
    """:func:`_int_scale` for the bf16 scale format, with float operations: ``T`` = ``fl32(
    absmax / QMAX)`` (``div_rn``) truncated to bf16, then ``S = T`` if ``T * QMAX >= absmax``
    else the next bf16 value. ``fl32`` is monotone, so the true quotient lies in ``(T⁻, T +
    ulp]``; ``T * QMAX`` is exact (8 by 7 significant bits); all-zero blocks get 0."""
    finite = a < 0x7F800000
    amax = bits_to_f32(tl.where(finite, a, 0))
    t = f32_to_bits(tl.math.div_rn(amax, tl.zeros_like(amax) + QMAX)) & -65536  # 0xffff0000
    f32 = tl.where(bits_to_f32(t) * QMAX < amax, t + 0x10000, t)
    stored = tl.where(finite, f32 >> 16, NAN_BF16)
    scale = tl.where(finite, bits_to_f32(f32), float("nan"))
    over = finite & (a > MAX_IN_BITS)
    return scale, stored, over


@triton.jit
def _load_scale(ptr, blk, mask, FMT: tl.constexpr, SB: tl.constexpr):
    """fp32 value of the stored scales of blocks ``blk`` (``SB`` little-endian bytes each)."""
    raw = tl.load(ptr + blk * SB, mask=mask, other=0).to(tl.int32)
    if SB >= 2:
        raw |= tl.load(ptr + blk * SB + 1, mask=mask, other=0).to(tl.int32) << 8
    if SB == 4:
        raw |= tl.load(ptr + blk * SB + 2, mask=mask, other=0).to(tl.int32) << 16
        raw |= tl.load(ptr + blk * SB + 3, mask=mask, other=0).to(tl.int32) << 24
    if FMT == FMT_BF16:
        s = bits_to_f32(raw << 16)
    elif FMT == FMT_FP16:
        s = bits_to_f32(f16_bits_to_f32_bits(raw))
    elif FMT == FMT_FP32:
        s = bits_to_f32(raw)
    else:
        s = bits_to_f32(tl.where(raw == 0, 1 << 22, raw << 23))
        s = tl.where(raw == 0xFF, float("nan"), s)
    return s


@triton.jit
def _store_scale(ptr, blk, mask, stored, SB: tl.constexpr):
    for i in tl.static_range(SB):
        tl.store(ptr + blk * SB + i, ((stored >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)


# -- values and codes -------------------------------------------------------------------------


@triton.jit
def _int_dequantize(stream_ptr, grp, gmask, elem, emask, nbytes, scale, BITS: tl.constexpr):
    """fp32 values ``code * scale`` of the elements ``elem`` of a packed code stream."""
    raw = load_codes(stream_ptr, grp, gmask, elem, emask, nbytes, BITS)
    return sign_extend(raw, BITS).to(tl.float32) * scale


@triton.jit
def _int_values(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    x_ptr,
    in_ptr,
    in_scale,
    grp,
    gmask,
    elem,
    emask,
    nbytes,
    stream_off,
    FUSED: tl.constexpr,
    IN_KIND: tl.constexpr,
    BITS: tl.constexpr,
):
    """fp32 values of ``elem``: ``x``, or (FUSED) ``decode(in payload) + local``."""
    v = load_f32(x_ptr, elem, emask, IN_KIND)
    if FUSED:
        partial = _int_dequantize(
            in_ptr + stream_off, grp, gmask, elem, emask, nbytes, in_scale, BITS
        )
        v = partial + v
    return v


@triton.jit
def _int_codes(v, s, elem, offset, key0, key1, STOCHASTIC: tl.constexpr):
    """Integer codes of ``v`` with scale ``s`` (same shape): ``round(fl32(v / s))`` or the
    stochastic rounding of the reference; 0 where ``s`` is not > 0 (zero or NaN scale)."""
    pos = s > 0
    safe = tl.where(pos & (s < float("inf")), s, 1.0)
    q = tl.where(pos, tl.math.div_rn(v, safe), 0.0)
    if STOCHASTIC:
        # floor(q) + [u < q - floor(q)]; |q| <= qmax < 2^7, so q - floor(q) is exact
        t = q.to(tl.int32)
        fl = t - (t.to(tl.float32) > q).to(tl.int32)
        u = uniform_open01(hash_u32(elem + offset, key0, key1))
        code = fl + (u < q - fl.to(tl.float32)).to(tl.int32)
    else:
        # round half to even: |q| <= QMAX < 2^22, so q + 1.5 * 2^23 lies in [2^23, 2^24),
        # whose spacing is 1: the fp32 addition rounds q to an integer, the subtraction is exact
        code = ((q + 12582912.0) - 12582912.0).to(tl.int32)
    return code


# -- kernels ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["offset", "key0", "key1"])
def _int_encode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values to encode, or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload (reduce; unused when not FUSED)
    out_ptr,  # output payload: nblocks scales of SB bytes, then the packed codes
    err_ptr,  # int32[1]: max absmax bits of a block beyond max_input_abs (0: none)
    # sizes
    n,  # number of values
    nblocks,  # ceil(n / BS)
    nbytes,  # bytes of the packed code stream
    # hop context (stochastic rounding)
    offset,  # global index of element 0
    key0,
    key1,
    # meta-parameters
    FUSED: tl.constexpr,  # reduce: values = decode(in payload) + local
    IN_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    BITS: tl.constexpr,
    BS: tl.constexpr,  # block size
    L: tl.constexpr,  # blocks per tile (L * BS is a multiple of 8)
    G: tl.constexpr,  # groups of 8 per tile, padded to a power of two
    FMT: tl.constexpr,  # scale format: 0 bf16, 1 fp16, 2 fp32, 3 e8m0
    SB: tl.constexpr,  # bytes per scale
    P: tl.constexpr,
    GMIN: tl.constexpr,
    QMAX: tl.constexpr,
    KQ: tl.constexpr,
    MAX_IN_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROWS: tl.constexpr,  # tiles per program
):
    # bytes moved per element: values in (4 fp32, 2 bf16/fp16) + (BITS / 8 + SB / BS) out;
    # FUSED adds (BITS / 8 + SB / BS) in for the incoming payload

    # -- map program -> tiles [ROWS], groups [ROWS, G], elements [ROWS, G, 8]
    T: tl.constexpr = L * BS
    tile = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    g = tl.arange(0, G)[None, :]
    e = g[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # index in the tile
    grp = tile[:, None] * (T // 8) + g
    gmask = (g < T // 8) & (grp * 8 < n)
    elem = tile[:, None, None] * T + e
    emask = (e < T) & (elem < n)
    lblk = e // BS  # block of the element within its tile
    stream_off = nblocks * SB

    # -- load with mask: fp32 values (fused: decoded partial sum + local)
    in_scale = tl.zeros([ROWS, G, 8], dtype=tl.float32)
    if FUSED:
        for b in tl.static_range(L):
            blk = tile * L + b
            s_l = _load_scale(in_ptr, blk, blk < nblocks, FMT, SB)
            in_scale = tl.where(lblk == b, s_l[:, None, None], in_scale)
    v = _int_values(
        x_ptr, in_ptr, in_scale, grp, gmask, elem, emask, nbytes, stream_off, FUSED, IN_KIND,
        BITS,
    )  # fmt: skip
    mag = tl.where(emask, f32_to_bits(v) & 0x7FFFFFFF, 0)

    # -- compute: per-block absmax (integer max of |v| bits: NaN > Inf > finite) and scale
    s = tl.zeros([ROWS, G, 8], dtype=tl.float32)
    worst = tl.max(tl.zeros([ROWS], dtype=tl.int32), axis=0)
    for b in tl.static_range(L):
        blk = tile * L + b
        bmask = blk < nblocks
        if L == 1:
            amax = tl.max(tl.max(mag, axis=2), axis=1)
        else:
            amax = tl.max(tl.max(tl.where(lblk == b, mag, 0), axis=2), axis=1)
        s_l, stored, over = _int_scale(amax, QMAX, KQ, P, GMIN, FMT, MAX_IN_BITS)
        worst = tl.maximum(worst, tl.max(tl.where(over & bmask, amax, 0), axis=0))
        s = tl.where(lblk == b, s_l[:, None, None], s)
        # -- store with mask: the block's scale
        _store_scale(out_ptr, blk, bmask, stored, SB)
    tl.atomic_max(err_ptr, worst, mask=worst > 0)
    codes = _int_codes(v, s, elem, offset, key0, key1, STOCHASTIC)

    # -- store with mask: the packed codes
    store_codes(out_ptr + stream_off, codes, grp, gmask, elem, emask, nbytes, BITS)


@triton.jit(do_not_specialize=["offset", "key0", "key1"])
def _int_rows_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values to encode, or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload (reduce; unused when not FUSED)
    out_ptr,  # output payload: nblocks scales of SB bytes, then the packed codes
    err_ptr,  # int32[1], as in _int_encode_kernel
    # sizes
    n,
    nblocks,
    nbytes,  # bytes of the packed code stream
    # hop context (stochastic rounding)
    offset,
    key0,
    key1,
    # meta-parameters
    FUSED: tl.constexpr,
    IN_KIND: tl.constexpr,
    BITS: tl.constexpr,  # 8 or 4
    BS: tl.constexpr,  # block size, a power of two
    FMT: tl.constexpr,
    SB: tl.constexpr,
    P: tl.constexpr,
    GMIN: tl.constexpr,
    QMAX: tl.constexpr,
    KQ: tl.constexpr,
    MAX_IN_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROWS: tl.constexpr,  # blocks per program
):
    # the GPU layout of 8- and 4-bit codes: blocks as rows [ROWS, BS], values contiguous
    # along a row, so loads and stores are wide and a block's absmax is a row max.
    # bytes moved per element: values in (4 fp32, 2 bf16/fp16) + (BITS / 8 + SB / BS) out;
    # FUSED adds (BITS / 8 + SB / BS) in for the incoming payload
    BPR: tl.constexpr = BS * BITS // 8  # code bytes per block

    # -- map program -> blocks [ROWS], elements [ROWS, BS]
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bmask = blk < nblocks
    elem = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    emask = elem < n
    boff = blk[:, None] * BPR + tl.arange(0, BPR)[None, :]  # code bytes [ROWS, BPR]
    bymask = boff < nbytes

    # -- load with mask: fp32 values (fused: decoded partial sum + local)
    v = load_f32(x_ptr, elem, emask, IN_KIND)
    if FUSED:
        s_in = _load_scale(in_ptr, blk, bmask, FMT, SB)
        raw = tl.load(in_ptr + nblocks * SB + boff, mask=bymask, other=0)
        if BITS == 8:
            code_in = raw.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            code_in = sign_extend(unpack_rows(raw.to(tl.int32), ROWS, BS, BITS), BITS)
            code_in = code_in.to(tl.float32)
        v = code_in * s_in[:, None] + v

    # -- compute: per-block absmax (integer max of |v| bits: NaN > Inf > finite), the scale
    amax = tl.max(tl.where(emask, f32_to_bits(v) & 0x7FFFFFFF, 0), axis=1)
    s, stored, over = _int_scale(amax, QMAX, KQ, P, GMIN, FMT, MAX_IN_BITS)
    worst = tl.max(tl.where(over & bmask, amax, 0), axis=0)
    tl.atomic_max(err_ptr, worst, mask=worst > 0)
    codes = _int_codes(v, s[:, None], elem, offset, key0, key1, STOCHASTIC)

    # -- store with mask: the scales, then the codes
    _store_scale(out_ptr, blk, bmask, stored, SB)
    packed = pack_rows(tl.where(emask, codes, 0), ROWS, BS, BITS)
    tl.store(out_ptr + nblocks * SB + boff, packed.to(tl.uint8), mask=bymask)


@triton.jit
def _int_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    in_ptr,  # payload
    out_ptr,  # fp32 values
    # sizes
    n,
    nblocks,
    nbytes,
    # meta-parameters
    BITS: tl.constexpr,
    BS: tl.constexpr,
    FMT: tl.constexpr,
    SB: tl.constexpr,
    ROWS: tl.constexpr,  # rows of 8 groups of 8 values per program
):
    # bytes moved per element: (BITS / 8 + SB / BS) read, 4 written

    # -- map program -> groups [ROWS, 8], elements [ROWS, 8, 8]
    _, grp, gmask, elem, emask = program_groups(n, ROWS, 8)
    # -- load with mask: each value's code and its block's scale; compute in fp32: code * scale
    scale = _load_scale(in_ptr, elem // BS, emask, FMT, SB)
    v = _int_dequantize(in_ptr + nblocks * SB, grp, gmask, elem, emask, nbytes, scale, BITS)
    # -- store with mask
    tl.store(out_ptr + elem, v, mask=emask)


@triton.jit
def _int_block_scale_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values or local slice
    in_ptr,  # incoming payload (FUSED)
    out_ptr,  # output payload: this kernel writes the scales
    err_ptr,  # int32[1], as in _int_encode_kernel
    # sizes
    n,
    nblocks,
    nbytes,
    # meta-parameters
    FUSED: tl.constexpr,
    IN_KIND: tl.constexpr,
    BITS: tl.constexpr,
    BS: tl.constexpr,
    FMT: tl.constexpr,
    SB: tl.constexpr,
    P: tl.constexpr,
    GMIN: tl.constexpr,
    QMAX: tl.constexpr,
    KQ: tl.constexpr,
    MAX_IN_BITS: tl.constexpr,
    CHUNK: tl.constexpr,  # groups of 8 per loop step
):
    # huge blocks, pass 1 of 2: bytes moved per element = values in (+ incoming payload)

    # -- map program -> one block, looped over in chunks of CHUNK groups
    blk = tl.program_id(0).to(tl.int64)
    start = blk * BS
    end = tl.minimum(start + BS, n)
    in_scale = tl.zeros([1], dtype=tl.float32)
    if FUSED:
        in_scale = _load_scale(in_ptr, blk + tl.zeros([1], dtype=tl.int64), True, FMT, SB)
    amax = tl.zeros([1], dtype=tl.int32)
    for c in range(0, tl.cdiv(BS + 16, CHUNK * 8)):
        # -- load with mask: the chunk's values
        grp = start // 8 + c * CHUNK + tl.arange(0, CHUNK)[None, :]
        elem = grp[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        emask = (elem >= start) & (elem < end)
        gmask = (grp * 8 + 8 > start) & (grp * 8 < end)
        v = _int_values(
            x_ptr, in_ptr, in_scale[:, None, None], grp, gmask, elem, emask, nbytes,
            nblocks * SB, FUSED, IN_KIND, BITS,
        )  # fmt: skip
        # -- compute: running absmax of the magnitude bits
        mag = tl.where(emask, f32_to_bits(v) & 0x7FFFFFFF, 0)
        amax = tl.maximum(amax, tl.max(tl.max(mag, axis=2), axis=1))
    _, stored, over = _int_scale(amax, QMAX, KQ, P, GMIN, FMT, MAX_IN_BITS)
    # -- store: the scale (and the error word)
    _store_scale(out_ptr, blk + tl.zeros([1], dtype=tl.int64), True, stored, SB)
    tl.atomic_max(err_ptr + tl.zeros([1], dtype=tl.int32), amax, mask=over)


@triton.jit(do_not_specialize=["offset", "key0", "key1"])
def _int_quantize_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values or local slice
    in_ptr,  # incoming payload (FUSED)
    out_ptr,  # output payload: scales already written by _int_block_scale_kernel
    # sizes
    n,
    nblocks,
    nbytes,
    # hop context
    offset,
    key0,
    key1,
    # meta-parameters
    FUSED: tl.constexpr,
    IN_KIND: tl.constexpr,
    BITS: tl.constexpr,
    BS: tl.constexpr,
    FMT: tl.constexpr,
    SB: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROWS: tl.constexpr,  # rows of 8 groups of 8 values per program
):
    # huge blocks, pass 2 of 2: values in (+ incoming payload) + (BITS / 8) out per element

    # -- map program -> groups [ROWS, 8], elements [ROWS, 8, 8]
    _, grp, gmask, elem, emask = program_groups(n, ROWS, 8)
    # -- load with mask: values again, and the block scales pass 1 stored
    in_scale = tl.zeros([ROWS, 8, 8], dtype=tl.float32)
    if FUSED:
        in_scale = _load_scale(in_ptr, elem // BS, emask, FMT, SB)
    v = _int_values(
        x_ptr, in_ptr, in_scale, grp, gmask, elem, emask, nbytes, nblocks * SB, FUSED, IN_KIND,
        BITS,
    )  # fmt: skip
    s = _load_scale(out_ptr, elem // BS, emask, FMT, SB)
    # -- compute: the codes
    codes = _int_codes(v, s, elem, offset, key0, key1, STOCHASTIC)
    # -- store with mask
    store_codes(out_ptr + nblocks * SB, codes, grp, gmask, elem, emask, nbytes, BITS)


# -- launchers --------------------------------------------------------------------------------


def _scale_meta(codec: IntCodec) -> dict[str, int]:
    return dict(_scale_meta_of(codec.scale_format, codec.qmax, codec.max_input_abs))


@functools.cache
def _scale_meta_of(scale_format: str, qmax: int, max_input_abs: float) -> dict[str, int]:
    # cached: launchers read it on every call (a tensor op)
    fmt, p, gmin = _FMT[scale_format]
    max_in = torch.tensor([max_input_abs], dtype=torch.float32).view(torch.int32)
    return {
        "FMT": fmt,
        "SB": SCALE_CODES[scale_format].nbytes,
        "P": p,
        "GMIN": gmin,
        "QMAX": qmax,
        "KQ": qmax.bit_length() - 1,
        "MAX_IN_BITS": int(max_in.item()),
    }


def _check_error(codec: IntCodec, err: torch.Tensor) -> None:
    worst_bits = int(err.item())  # one device sync: the reference raises here too
    if worst_bits:
        worst = float(torch.tensor([worst_bits], dtype=torch.int32).view(torch.float32).item())
        raise ValueError(
            f"int codec: a block absmax of {worst!r} exceeds max_input_abs="
            f"{codec.max_input_abs!r}: its scale is beyond scale_format="
            f"{codec.scale_format!r}; use a wider scale_format ('fp32')"
        )


def _encode_into(
    codec: IntCodec,
    values: torch.Tensor,
    incoming: torch.Tensor | None,
    out: torch.Tensor,
    ctx: HopContext,
) -> torch.Tensor:
    n = values.numel()
    if n == 0:
        return out
    bs = codec.block_size
    nblocks = -(-n // bs)
    nbytes = packed_nbytes(n, codec.bits)
    key0, key1 = hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
    xv, kind = value_view(values)
    inp = out if incoming is None else incoming
    err = torch.zeros(1, dtype=torch.int32, device=values.device)
    stochastic = codec.rounding == "stochastic"
    meta = _scale_meta(codec)
    tiles_l = 8 // math.gcd(bs, 8)
    groups = triton.next_power_of_2(tiles_l * bs // 8)
    if ROWS_PATH and codec.bits in (8, 4) and bs & (bs - 1) == 0 and 8 <= bs <= MAX_TILE:
        rows = max(1, min(tile_elems(values.device) // bs, triton.next_power_of_2(nblocks)))
        _int_rows_kernel[(triton.cdiv(nblocks, rows),)](
            xv, inp, out, err, n, nblocks, nbytes, ctx.offset, key0, key1,
            FUSED=incoming is not None, IN_KIND=kind, BITS=codec.bits, BS=bs,
            STOCHASTIC=stochastic, ROWS=rows,
            **meta, enable_fp_fusion=False, num_warps=NUM_WARPS,
        )  # fmt: skip
        record_launch("_int_rows_kernel")
    elif groups * 8 <= MAX_TILE:
        ntiles = -(-nblocks // tiles_l)
        rows = max(
            1, min(tile_elems(values.device) // (groups * 8), triton.next_power_of_2(ntiles))
        )
        _int_encode_kernel[(triton.cdiv(ntiles, rows),)](
            xv, inp, out, err, n, nblocks, nbytes, ctx.offset, key0, key1,
            FUSED=incoming is not None, IN_KIND=kind, BITS=codec.bits, BS=bs, L=tiles_l,
            G=groups, STOCHASTIC=stochastic, ROWS=rows, **meta, enable_fp_fusion=False,
        )  # fmt: skip
        record_launch("_int_encode_kernel")
    else:
        _int_block_scale_kernel[(nblocks,)](
            xv, inp, out, err, n, nblocks, nbytes,
            FUSED=incoming is not None, IN_KIND=kind, BITS=codec.bits, BS=bs, CHUNK=256,
            **meta, enable_fp_fusion=False,
        )  # fmt: skip
        record_launch("_int_block_scale_kernel")
        rows = max(1, tile_elems(values.device) // 64)
        _int_quantize_kernel[(triton.cdiv(n, rows * 64),)](
            xv, inp, out, n, nblocks, nbytes, ctx.offset, key0, key1,
            FUSED=incoming is not None, IN_KIND=kind, BITS=codec.bits, BS=bs,
            FMT=meta["FMT"], SB=meta["SB"], STOCHASTIC=stochastic, ROWS=rows,
            enable_fp_fusion=False,
        )  # fmt: skip
        record_launch("_int_quantize_kernel")
    _check_error(codec, err)
    return out


def encode(codec: IntCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend."""
    out = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8, device=x.device)
    return _encode_into(codec, x, None, out, ctx)


def reduce(
    codec: IntCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: one pass, no fp32 tensor in memory
    (blocks of more than ``MAX_TILE`` values: two passes)."""
    out = torch.empty_like(payload)
    return _encode_into(codec, local, payload, out, out_ctx)


def decode(codec: IntCodec, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if numel == 0:
        return out
    meta = _scale_meta(codec)
    rows = max(1, min(tile_elems(payload.device) // 64, triton.next_power_of_2(-(-numel // 64))))
    _int_decode_kernel[(triton.cdiv(numel, rows * 64),)](
        payload, out, numel, -(-numel // codec.block_size), packed_nbytes(numel, codec.bits),
        BITS=codec.bits, BS=codec.block_size, FMT=meta["FMT"], SB=meta["SB"], ROWS=rows,
        enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_int_decode_kernel")
    return out
