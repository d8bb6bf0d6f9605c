"""Triton helpers shared by the kernel families (docs/design.md, "Kernels").

Everything here is a ``@triton.jit`` device function that mirrors one piece of the PyTorch
reference in :mod:`dynamiq.codecs` bit for bit:

* the counter hash (:mod:`dynamiq.codecs.hashing`): :func:`fmix32`, :func:`hash_u32`,
  :func:`uniform_open01`, written once here for every Triton kernel;
* float bit patterns: fp32 <-> int32 by bitcast, bf16 by 16-bit shifts, fp16 by integer
  operations, NaN written as the canonical quiet NaN of each format;
* element formats (:class:`dynamiq.codecs.formats.ElementFormat`): encode (round to nearest,
  ties to even, by an exact fp32 add and subtract at the format's spacing) and decode (exact
  powers of two), never through a Triton fp8 cast;
* dense LSB-first bit packing (:mod:`dynamiq.codecs.packing`) of a ``[R, G, 8]`` tile of codes
  (group ``g`` of 8 consecutive codes occupies ``BITS`` consecutive bytes), and of ``[R, B]``
  rows of 8- or 4-bit codes (the rows kernels).

Tiles are 3-D ``[R, G, 8]``: ``R`` rows, each row ``G`` groups of 8 consecutive elements; the
rows kernels' are 2-D ``[R, B]``, one block a row.

Importing this module imports Triton; only :mod:`dynamiq.kernels` imports it, lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynamiq.codecs import wire_codes

# -- kinds of value buffers (``IN_KIND``, ``SRC_KIND``, ``DST_KIND`` meta-parameters) ----------

KIND_FP32 = 0
KIND_BF16 = 1
KIND_FP16 = 2

_KINDS = {torch.float32: (KIND_FP32, torch.int32), torch.bfloat16: (KIND_BF16, torch.int16)}
_KINDS[torch.float16] = (KIND_FP16, torch.int16)


def value_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An integer view of a fp32/bf16/fp16 buffer (kernels work on bit patterns) and its kind."""
    kind, itype = _KINDS[x.dtype]
    return x.view(itype), kind


def tile_elems(device: torch.device) -> int:
    """Elements per program: GPU-sized, larger for the CPU interpreter (fewer Python loops)."""
    return 8192 if device.type == "cpu" else 2048


# canonical quiet NaNs written by the codecs (dynamiq.codecs.passthrough / intq)
NAN_F32: tl.constexpr = tl.constexpr(0x7FC00000)
NAN_BF16: tl.constexpr = tl.constexpr(0x7FC0)
NAN_F16: tl.constexpr = tl.constexpr(0x7E00)


# -- counter hash (dynamiq.codecs.hashing) --------------------------------------------------


@triton.jit
def fmix32(h):
    """MurmurHash3's 32-bit finalizer on ``uint32`` values."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def hash_u32(index, key0, key1):
    """``hashing.hash_u32``: hash global element indices (int64 >= 0) to ``uint32``."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    h = fmix32(lo * 0x9E3779B1 + key0.to(tl.uint32))
    return fmix32(h ^ hi ^ key1.to(tl.uint32))


@triton.jit
def uniform_open01(h):
    """``hashing.uniform_open01``: ``(2 * (h >> 9) + 1) * 2^-24`` in fp32 (exact)."""
    return ((h >> 9) * 2 + 1).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


# -- fp32 bit patterns ----------------------------------------------------------------------


@triton.jit
def f32_to_bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def bits_to_f32(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def exponent_of(a):
    """``formats.exponent_of`` of fp32 magnitude bits ``a`` (int32 >= 0): floor(log2), zero
    gives -150, NaN/Inf give 128."""
    e = a >> 23
    m = a & 0x7FFFFF
    # subnormal: the exponent of the mantissa's leading bit (exact int -> float of < 2^23)
    sub = (f32_to_bits(m.to(tl.float32)) >> 23) - 127 - 149
    out = tl.where(e > 0, e - 127, sub)
    return tl.where(a == 0, -150, out)


@triton.jit
def floor_log2(n):
    """floor(log2(n)) of integers 1 <= n <= 2^24 (exact int -> float conversion); -127 for 0."""
    return (f32_to_bits(n.to(tl.float32)) >> 23) - 127


@triton.jit
def rne_shift(sig, shift):
    """``formats._rne_shift``: ``sig >> shift`` rounded to nearest, ties to even (1..25)."""
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(q.dtype)


# -- value buffers: fp32 / bf16 / fp16 <-> fp32 bits ------------------------------------------


@triton.jit
def f16_bits_to_f32_bits(h):
    """fp16 bit pattern (low 16 bits of an int32) -> fp32 bit pattern, exact; NaN keeps its
    sign and payload (as a hardware conversion does)."""
    h = h & 0xFFFF
    sign = (h >> 15) << 31
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    normal = ((e + 112) << 23) | (m << 13)
    # subnormal: m * 2^-24, normalised by the float conversion of m (exact, m < 2^10)
    sub = f32_to_bits(m.to(tl.float32)) - (24 << 23)
    special = 0x7F800000 | (m << 13)
    mag = tl.where(e == 0x1F, special, tl.where(e > 0, normal, tl.where(m > 0, sub, 0)))
    return sign | mag


@triton.jit
def load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """fp32 values of a value buffer (``ptr`` is an int32 view for fp32 and an int16 view for
    bf16/fp16); 0 where masked."""
    if KIND == 0:
        bits = tl.load(ptr + offs, mask=mask, other=0)
    elif KIND == 1:
        bits = (tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16
    else:
        bits = f16_bits_to_f32_bits(tl.load(ptr + offs, mask=mask, other=0).to(tl.int32))
    return bits_to_f32(bits)


@triton.jit
def round_float_mag(sig, ue, NMANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """``ElementFormat._round_float``: magnitude code of ``sig * 2^(ue - 23)`` (RNE, with
    subnormals), capped at ``MAX_CODE + 1`` (overflow)."""
    bexp = ue + BIAS
    extra = tl.maximum(1 - bexp, 0)
    shift = tl.minimum(23 - NMANT + extra, 25)
    r = rne_shift(sig, shift)
    # a carry out of the mantissa (r == 2^(NMANT+1)) bumps the exponent by itself
    mag = (tl.maximum(bexp - 1, 0) << NMANT) + r
    return tl.minimum(mag, MAX_CODE + 1)


@triton.jit
def split_f32(bits, scale_exp):
    """Normalised significand and exponent of ``|x| * 2^-scale_exp`` (``ElementFormat.encode``):
    value = sig * 2^(ue - 23), sig in [2^23, 2^24) or 0; also the magnitude bits."""
    a = bits & 0x7FFFFFFF
    e = a >> 23
    m = a & 0x7FFFFF
    ue = exponent_of(a) - scale_exp
    lead = tl.where(e > 0, 23, tl.maximum(floor_log2(m), 0))
    sig = tl.where(e > 0, m | 0x800000, m << (23 - lead))
    return sig, ue, a


@triton.jit
def f32_to_f16_bits(bits):
    """``x.clamp(-65504, 65504).to(float16)`` for finite x (±Inf stays ±Inf) as fp16 bits in
    an int32; NaN becomes the canonical quiet NaN 0x7E00."""
    a = bits & 0x7FFFFFFF
    sign = (bits >> 16) & 0x8000
    # saturate finite values above 65504 (0x477fe000) first: a finite value never becomes Inf
    a = tl.where((a > 0x477FE000) & (a < 0x7F800000), 0x477FE000, a)
    sig, ue, a = split_f32(a, 0)
    mag = round_float_mag(sig, ue, 10, 15, 0x7BFF)
    mag = tl.where(a == 0, 0, mag)
    mag = tl.where(a == 0x7F800000, 0x7C00, mag)
    return tl.where(a > 0x7F800000, NAN_F16, sign | mag)


@triton.jit
def f32_to_bf16_bits(bits):
    """``x.clamp(-max, max).to(bfloat16)`` for finite x (RNE on the bit pattern; ±Inf stays
    ±Inf) as bf16 bits in an int32; NaN becomes the canonical quiet NaN 0x7FC0."""
    a = bits & 0x7FFFFFFF
    sign = (bits >> 16) & 0x8000
    a = tl.where((a > 0x7F7F0000) & (a < 0x7F800000), 0x7F7F0000, a)  # saturate at bf16 max
    r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
    return tl.where(a > 0x7F800000, NAN_BF16, sign | r)


# -- element formats (dynamiq.codecs.formats.ElementFormat, saturate=True) ----------------------

#: ``SPECIALS`` meta-parameter of an element format (``ElementFormat.specials``; the codes of
#: ``dynamiq/codecs/wire_codes.py``)
SPECIALS = wire_codes.SPECIALS
# the same codes as the JIT functions below compare them (constexpr globals)
SPEC_IEEE: tl.constexpr = tl.constexpr(wire_codes.SPECIALS["ieee"])
SPEC_FN: tl.constexpr = tl.constexpr(wire_codes.SPECIALS["fn"])
SPEC_INT: tl.constexpr = tl.constexpr(wire_codes.SPECIALS["int"])


@triton.jit
def encode_element(
    bits,
    scale_exp,
    NMANT: tl.constexpr,
    BIAS: tl.constexpr,
    BITS: tl.constexpr,
    SPECIALS: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    """``ElementFormat.encode(x, scale_exp, saturate=True)`` on the fp32 bits of finite ``x``
    with ``|x| * 2^-scale_exp < 2^16``, as in a block whose shared exponent comes from its
    maximum (the MX kernels zero the codes of blocks holding NaN/Inf): the code of ``x *
    2^-scale_exp`` (int32, low ``BITS`` bits), ``scale_exp`` in ``[-127, 127]``.

    ``y = |x| * 2^-scale_exp`` is exact (or below 2^-126, far under half the smallest
    subnormal code of every format, so 0 either way). ``(y + c) - c`` with ``c = 2^(23 + q)``
    rounds it to nearest even at the format's spacing ``2^q`` there (``y < c``, and every fp32
    in ``[c, 2c)`` is a multiple of ``2^q``); the rounded value, an exact element value, times
    ``2^(BIAS - 127)`` is an fp32 whose bits are the code's (a subnormal code as an fp32
    subnormal). Integer elements round ``y * 2^NMANT`` by adding and subtracting ``2^23``."""
    a = bits & 0x7FFFFFFF
    # 2^-scale_exp: 2^-127 is an fp32 subnormal
    inv = bits_to_f32(tl.where(scale_exp == 127, 1 << 22, (127 - scale_exp) << 23))
    y = bits_to_f32(a) * inv
    if SPECIALS == SPEC_INT:
        r = (y * (2.0**NMANT) + 8388608.0) - 8388608.0
        mag = tl.minimum(r.to(tl.int32), MAX_CODE)
        code = tl.where(bits < 0, (-mag) & 0xFF, mag)
    else:
        ey = tl.maximum((f32_to_bits(y) >> 23) - 127, 1 - BIAS)  # exponent of y's spacing
        c = bits_to_f32((ey - NMANT + 150) << 23)
        r = (y + c) - c
        mag = tl.minimum(f32_to_bits(r * (2.0 ** (BIAS - 127))) >> (23 - NMANT), MAX_CODE)
        code = mag | (((bits >> 31) & 1) << (BITS - 1))
    return code


@triton.jit
def sign_extend(code, BITS: tl.constexpr):
    """Two's complement value of ``BITS``-bit codes (int32 in ``[0, 2^BITS)``)."""
    return tl.where(code >= (1 << (BITS - 1)), code - (1 << BITS), code)


@triton.jit
def decode_element(
    code,
    NEXP: tl.constexpr,
    NMANT: tl.constexpr,
    BIAS: tl.constexpr,
    BITS: tl.constexpr,
    SPECIALS: tl.constexpr,
):
    """``ElementFormat.decode``: fp32 value of ``code`` (int32). The magnitude bits shifted
    into an fp32's place read as a value ``2^(127 - BIAS)`` too small (a subnormal code as an
    fp32 subnormal), then scaled by that exact power of two."""
    if SPECIALS == SPEC_INT:
        # exact: |code| <= 2^7, power-of-two factor
        val = sign_extend(code, BITS).to(tl.float32) * (2.0**-NMANT)
    else:
        mag = code & ((1 << (BITS - 1)) - 1)
        val = bits_to_f32(mag << (23 - NMANT)) * (2.0 ** (127 - BIAS))
        sign = (code >> (BITS - 1)) << 31
        val = bits_to_f32(f32_to_bits(val) | sign)
        if SPECIALS == SPEC_IEEE:  # IEEE: exponent all ones is Inf (mantissa 0) or NaN
            inf = bits_to_f32(0x7F800000 | sign)
            nan_or_inf = tl.where((mag & ((1 << NMANT) - 1)) == 0, inf, float("nan"))
            val = tl.where((mag >> NMANT) == (1 << NEXP) - 1, nan_or_inf, val)
        elif SPECIALS == SPEC_FN:  # "fn": only the all-ones magnitude is NaN
            val = tl.where(mag == (1 << (BITS - 1)) - 1, float("nan"), val)
    return val


# -- dense LSB-first bit packing of [R, G, 8] tiles (dynamiq.codecs.packing) ------------------


@triton.jit
def program_groups(n, ROWS: tl.constexpr, GPR: tl.constexpr):
    """Map this program to its ``ROWS`` rows ``[ROWS]`` (int64) of ``GPR`` groups of 8
    consecutive elements: the groups ``[ROWS, GPR]`` (int64), whether they start below ``n``,
    the elements ``[ROWS, GPR, 8]`` and whether they are below ``n``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = row[:, None] * GPR + tl.arange(0, GPR)[None, :]
    gmask = grp * 8 < n
    elem = grp[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    emask = elem < n
    return row, grp, gmask, elem, emask


@triton.jit
def load_codes(stream_ptr, grp, gmask, elem, emask, nbytes, BITS: tl.constexpr):
    """Codes ``[R, G, 8]`` (int32) of the groups ``grp`` ``[R, G]`` (int64 group indices) of a
    packed stream of ``nbytes`` bytes; ``elem`` ``[R, G, 8]`` are the element indices."""
    if BITS == 8:
        codes = tl.load(stream_ptr + elem, mask=emask, other=0).to(tl.int32)
    else:
        j = tl.arange(0, 8)[None, None, :]
        boff = grp[:, :, None] * BITS + j
        bmask = gmask[:, :, None] & (j < BITS) & (boff < nbytes)
        byte = tl.load(stream_ptr + boff, mask=bmask, other=0).to(tl.int64)
        word = tl.sum(byte << (8 * j), axis=2)  # 8 codes of BITS bits: one word of <= 56 bits
        codes = ((word[:, :, None] >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.int32)
    return codes


@triton.jit
def store_codes(stream_ptr, codes, grp, gmask, elem, emask, nbytes, BITS: tl.constexpr):
    """Pack the low ``BITS`` bits of ``codes`` ``[R, G, 8]`` (0 where masked) into groups."""
    if BITS == 8:
        tl.store(stream_ptr + elem, codes.to(tl.uint8), mask=emask)
    else:
        j = tl.arange(0, 8)[None, None, :]
        c = (tl.where(emask, codes, 0) & ((1 << BITS) - 1)).to(tl.int64)
        word = tl.sum(c << (j * BITS), axis=2)  # disjoint bit fields: the sum is an OR
        boff = grp[:, :, None] * BITS + j
        bmask = gmask[:, :, None] & (j < BITS) & (boff < nbytes)
        tl.store(stream_ptr + boff, ((word[:, :, None] >> (8 * j)) & 0xFF).to(tl.uint8), mask=bmask)


# -- dense LSB-first packing of [R, B] rows of 4-bit codes (the rows kernels) -------------------


@triton.jit
def pack_rows(codes, R: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    """Bytes ``[R, B * BITS // 8]`` (int32) of the low ``BITS`` bits of ``codes`` ``[R, B]``,
    packed LSB-first (element ``2j`` in the low nibble of byte ``j``); ``BITS`` 8 or 4."""
    c = codes & ((1 << BITS) - 1)
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(c, [R, B // 2, 2]))
        c = lo | (hi << 4)
    return c


@triton.jit
def unpack_rows(raw, R: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    """Codes ``[R, B]`` (int32) of bytes ``raw`` ``[R, B * BITS // 8]`` (int32), the inverse of
    :func:`pack_rows`."""
    if BITS == 4:
        raw = tl.reshape(tl.join(raw & 0xF, (raw >> 4) & 0xF), [R, B])
    return raw
