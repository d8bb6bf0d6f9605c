"""Triton kernels of the declarative block formats (``nvfp4``, every ``BlockCodec`` with
``fits_kernels()``, plugins' subclasses included): generic over the declared data.

Reference: :class:`dynamiq.codecs.blockfmt.BlockCodec` (``_encode``, ``_decode``, and
``_reduce`` = ``_encode(_decode(payload) + local.float())``), wire layout in its docstring and
``docs/formats.md``. Bit-exact with it: block maxima are integer maxima of the magnitude bits
(NaN never dropped), ``t = b / (Me·G)`` and ``q = x / S`` are IEEE divisions (``div_rn``),
scale and element codes are rounded to nearest even by
:func:`~dynamiq.kernels._common.encode_element` (values clamped first to ``2^(emax+1)``,
which saturates as the reference does), decoding multiplies exact values.

A program owns ``ROWS`` whole blocks as rows ``[ROWS, B]`` (B the block size, a power of two
of 8..128; 4- or 8-bit codes: a block's codes fill whole bytes), so programs write disjoint
bytes; program 0 also writes the fp32 tensor scale ``G`` in front. The incoming payload's
``G`` (fused reduce, decode) is read from its header in the kernel; the outgoing one is an
argument: from the prologue's result (``ctx.shared``) with no host synchronisation, else
(outside a collective) from the data's absmax.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.blockfmt import TENSOR_AMAX_KEY, BlockCodec, finite_absmax_bits
from dynamiq.codecs.packing import packed_nbytes

from ._common import (
    SPECIALS,
    bits_to_f32,
    decode_element,
    encode_element,
    f32_to_bits,
    load_f32,
    pack_rows,
    tile_elems,
    unpack_rows,
    value_view,
)
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]


@triton.jit
def _load_g(in_ptr, HDR: tl.constexpr):
    """The fp32 tensor scale in front of a payload (1.0 without one)."""
    if HDR == 0:
        return 1.0
    j = tl.arange(0, 4)
    byte = tl.load(in_ptr + j).to(tl.int32)
    return bits_to_f32(tl.sum(byte << (8 * j), axis=0))


@triton.jit
def _decode_rows(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    in_ptr, blk, bmask, boff, bymask, nblocks, g,
    ROWS: tl.constexpr, B: tl.constexpr, HDR: tl.constexpr,
    E_NEXP: tl.constexpr, E_NMANT: tl.constexpr, E_BIAS: tl.constexpr, E_BITS: tl.constexpr,
    E_SPECIALS: tl.constexpr,
    S_NEXP: tl.constexpr, S_NMANT: tl.constexpr, S_BIAS: tl.constexpr,
    S_SPECIALS: tl.constexpr,
):  # fmt: skip
    """fp32 values ``[ROWS, B]`` of the blocks ``blk`` of a payload: element · (s · G)."""
    sc = tl.load(in_ptr + HDR + blk, mask=bmask, other=0).to(tl.int32)
    S = decode_element(sc, S_NEXP, S_NMANT, S_BIAS, 8, S_SPECIALS) * g
    raw = tl.load(in_ptr + HDR + nblocks + boff, mask=bymask, other=0).to(tl.int32)
    code = unpack_rows(raw, ROWS, B, E_BITS)
    return decode_element(code, E_NEXP, E_NMANT, E_BIAS, E_BITS, E_SPECIALS) * S[:, None]


@triton.jit
def _blk_encode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    x_ptr,  # values, or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16) view
    in_ptr,  # incoming payload (reduce; unused when not FUSED)
    out_ptr,  # outgoing payload: [G], scale bytes, packed codes
    n, nblocks, nbytes,
    g_bits,  # fp32 bits of the outgoing G
    FUSED: tl.constexpr, IN_KIND: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr,
    HDR: tl.constexpr,  # 4 with a tensor scale, else 0
    E_NEXP: tl.constexpr, E_NMANT: tl.constexpr, E_BIAS: tl.constexpr, E_BITS: tl.constexpr,
    E_SPECIALS: tl.constexpr, E_MAX_CODE: tl.constexpr, E_MAX: tl.constexpr,
    E_LIMIT_BITS: tl.constexpr,  # fp32 bits of 2^(emax + 1): |q| clamped to it saturates
    S_NEXP: tl.constexpr, S_NMANT: tl.constexpr, S_BIAS: tl.constexpr,
    S_SPECIALS: tl.constexpr, S_MAX_CODE: tl.constexpr, S_NAN: tl.constexpr,
    S_LIMIT: tl.constexpr,
):  # fmt: skip
    # bytes moved per element: values in (4 fp32, 2 bf16/fp16) + (E_BITS / 8 + 1 / B) out;
    # FUSED adds (E_BITS / 8 + 1 / B) in
    BPR: tl.constexpr = B * E_BITS // 8  # code bytes per block

    # -- map program -> blocks [ROWS], elements [ROWS, B], code bytes [ROWS, BPR]
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bmask = blk < nblocks
    elem = blk[:, None] * B + tl.arange(0, B)[None, :]
    emask = elem < n
    boff = blk[:, None] * BPR + tl.arange(0, BPR)[None, :]
    bymask = boff < nbytes
    g = bits_to_f32(g_bits + tl.zeros([ROWS], dtype=tl.int32))

    # -- load with mask: the fp32 values (fused: decoded partial sum + local)
    v = load_f32(x_ptr, elem, emask, IN_KIND)
    if FUSED:
        g_in = _load_g(in_ptr, HDR)
        partial = _decode_rows(
            in_ptr, blk, bmask, boff, bymask, nblocks, g_in, ROWS, B, HDR,
            E_NEXP, E_NMANT, E_BIAS, E_BITS, E_SPECIALS, S_NEXP, S_NMANT, S_BIAS, S_SPECIALS,
        )  # fmt: skip
        v = partial + v
    bits = f32_to_bits(v)

    # -- compute: block scale t = b / (Me·G) rounded in the scale format, S = s·G
    amax = tl.max(tl.where(emask, bits & 0x7FFFFFFF, 0), axis=1)
    finite = amax < 0x7F800000
    t = tl.math.div_rn(bits_to_f32(tl.where(finite, amax, 0)), g * E_MAX)
    t = tl.minimum(t, S_LIMIT)
    sc = encode_element(f32_to_bits(t), 0, S_NMANT, S_BIAS, 8, S_SPECIALS, S_MAX_CODE)
    sc = tl.where(finite, sc, S_NAN)
    S = decode_element(sc, S_NEXP, S_NMANT, S_BIAS, 8, S_SPECIALS) * g
    ok = finite & (S > 0)
    q = tl.math.div_rn(v, tl.where(ok, S, 1.0)[:, None])
    qb = f32_to_bits(q)
    qb = (qb & -2147483648) | tl.minimum(qb & 0x7FFFFFFF, E_LIMIT_BITS)  # sign | clamped |q|
    codes = encode_element(qb, 0, E_NMANT, E_BIAS, E_BITS, E_SPECIALS, E_MAX_CODE)
    codes = tl.where(ok[:, None] & emask, codes, 0)

    # -- store with mask: G (program 0), scale bytes, packed codes
    if HDR > 0:
        j = tl.arange(0, 4)
        hmask = j < tl.where(pid == 0, 4, 0)
        tl.store(out_ptr + j, ((g_bits >> (8 * j)) & 0xFF).to(tl.uint8), mask=hmask)
    tl.store(out_ptr + HDR + blk, sc.to(tl.uint8), mask=bmask)
    packed = pack_rows(codes, ROWS, B, E_BITS)
    tl.store(out_ptr + HDR + nblocks + boff, packed.to(tl.uint8), mask=bymask)


@triton.jit
def _blk_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    in_ptr, out_ptr, n, nblocks, nbytes,
    ROWS: tl.constexpr, B: tl.constexpr, HDR: tl.constexpr,
    E_NEXP: tl.constexpr, E_NMANT: tl.constexpr, E_BIAS: tl.constexpr, E_BITS: tl.constexpr,
    E_SPECIALS: tl.constexpr,
    S_NEXP: tl.constexpr, S_NMANT: tl.constexpr, S_BIAS: tl.constexpr,
    S_SPECIALS: tl.constexpr,
):  # fmt: skip
    # bytes moved per element: (E_BITS / 8 + 1 / B) read, 4 written
    BPR: tl.constexpr = B * E_BITS // 8
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bmask = blk < nblocks
    elem = blk[:, None] * B + tl.arange(0, B)[None, :]
    boff = blk[:, None] * BPR + tl.arange(0, BPR)[None, :]
    g = _load_g(in_ptr, HDR)
    v = _decode_rows(
        in_ptr, blk, bmask, boff, boff < nbytes, nblocks, g, ROWS, B, HDR,
        E_NEXP, E_NMANT, E_BIAS, E_BITS, E_SPECIALS, S_NEXP, S_NMANT, S_BIAS, S_SPECIALS,
    )  # fmt: skip
    tl.store(out_ptr + elem, v, mask=elem < n)


# -- launchers --------------------------------------------------------------------------------


def _f32_bits(x: float) -> int:
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


def _meta(codec: BlockCodec) -> dict[str, int]:
    e, s = codec.elem, codec.scale_fmt
    return {
        "B": codec.block_size,
        "E_NEXP": e.nexp,
        "E_NMANT": e.nmant,
        "E_BIAS": e.bias,
        "E_BITS": e.bits,
        "E_SPECIALS": SPECIALS[e.specials],
        "S_NEXP": s.nexp,
        "S_NMANT": s.nmant,
        "S_BIAS": s.bias,
        "S_SPECIALS": SPECIALS[s.specials],
    }


def _encode_meta(codec: BlockCodec) -> dict[str, float | int]:
    e, s = codec.elem, codec.scale_fmt
    return {
        **_meta(codec),
        "E_MAX_CODE": e.max_code,
        "E_MAX": e.max,
        "E_LIMIT_BITS": _f32_bits(2.0 ** (e.emax + 1)),
        "S_MAX_CODE": s.max_code,
        "S_NAN": s.nan_code or 0,
        "S_LIMIT": 2.0 ** (s.emax + 1),
    }


def _rows(codec: BlockCodec, device: torch.device, nblocks: int) -> int:
    return max(1, min(tile_elems(device) // codec.block_size, triton.next_power_of_2(nblocks)))


def _encode_into(
    codec: BlockCodec,
    values: torch.Tensor,
    incoming: torch.Tensor | None,
    k: int,
    out: torch.Tensor,
) -> torch.Tensor:
    n = values.numel()
    if n == 0:
        return out
    nblocks = -(-n // codec.block_size)
    rows = _rows(codec, values.device, nblocks)
    xv, kind = value_view(values)
    _blk_encode_kernel[(triton.cdiv(nblocks, rows),)](
        xv, out if incoming is None else incoming, out, n, nblocks,
        packed_nbytes(n, codec.elem.bits), _f32_bits(2.0**k),
        FUSED=incoming is not None, IN_KIND=kind, ROWS=rows, HDR=codec.header_nbytes(n),
        **_encode_meta(codec), enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_blk_encode_kernel")
    return out


def encode(codec: BlockCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend."""
    out = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8, device=x.device)
    return _encode_into(codec, x, None, codec.tensor_exp_of(x, ctx), out)


def reduce(
    codec: BlockCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: one pass, no fp32 tensor in memory (in
    a collective; outside one, the sum's absmax is found first, for its tensor scale)."""
    shared = out_ctx.shared
    if codec.tensor_scale and (shared is None or TENSOR_AMAX_KEY not in shared):
        total = decode(codec, payload, local.numel(), ctx) + local.float()
        k = codec.tensor_exp(finite_absmax_bits(total), 1)
    else:
        k = codec.tensor_exp_of(local, out_ctx)
    out = torch.empty_like(payload)
    return _encode_into(codec, local, payload, k, out)


def decode(codec: BlockCodec, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if numel == 0:
        return out
    nblocks = -(-numel // codec.block_size)
    rows = _rows(codec, payload.device, nblocks)
    _blk_decode_kernel[(triton.cdiv(nblocks, rows),)](
        payload, out, numel, nblocks, packed_nbytes(numel, codec.elem.bits),
        ROWS=rows, HDR=codec.header_nbytes(numel), **_meta(codec), enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_blk_decode_kernel")
    return out
