"""Triton kernels of the OCP MX codecs (``mxfp8_*``, ``mxfp6_*``, ``mxfp4``, ``mxint8``).

Reference: :class:`dynamiq.codecs.mx.MXCodec` (``_encode``, ``_decode``, and ``_reduce`` =
``_encode(_decode(payload) + local.float())``), wire layout in ``docs/formats.md``. Bit-exact
with it: the shared exponent comes from the integer max of the magnitude bits (so NaN is never
dropped by a float max), elements are rounded to nearest even by an exact fp32 add and
subtract at the format's spacing (:func:`~dynamiq.kernels._common.encode_element`), decoding
multiplies by exact powers of two.

A program owns ``ROWS`` whole blocks of 32 values, so programs write disjoint bytes: 8- and
4-bit codes as rows ``[ROWS, 32]`` (:func:`_mx_rows_kernel`: wide loads and stores), 6-bit
codes as ``[ROWS, 4, 8]`` groups of 8 codes (a block's codes fill ``4 * BITS`` whole bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.mx import MX_BLOCK, MXCodec
from dynamiq.codecs.packing import packed_nbytes

from ._common import (
    SPECIALS,
    bits_to_f32,
    decode_element,
    encode_element,
    exponent_of,
    f32_to_bits,
    load_codes,
    load_f32,
    pack_rows,
    program_groups,
    store_codes,
    tile_elems,
    unpack_rows,
    value_view,
)
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]

#: 8- and 4-bit elements take :func:`_mx_rows_kernel` (blocks as rows); False sends them
#: through the general kernel (``benchmarks/gpu_check.py`` times both)
ROWS_PATH = True
#: warps per program of the rows kernel (tuned on an H200 by ``benchmarks/gpu_check.py``)
NUM_WARPS = 4


@triton.jit
def _load_e8m0(ptr, blk, mask):
    """fp32 values of the E8M0 scales of blocks ``blk``: code c is 2^(c - 127); code 0 is the
    fp32 subnormal 2^-127, 0xff is NaN."""
    sc = tl.load(ptr + blk, mask=mask, other=0).to(tl.int32)
    scale = bits_to_f32(tl.where(sc == 0, 1 << 22, sc << 23))
    return tl.where(sc == 0xFF, float("nan"), scale)


@triton.jit
def _mx_decode_tile(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    in_ptr,
    blk,
    bmask,
    grp,
    gmask,
    elem,
    emask,
    nblocks,
    nbytes,
    NEXP: tl.constexpr,
    NMANT: tl.constexpr,
    BIAS: tl.constexpr,
    BITS: tl.constexpr,
    SPECIALS: tl.constexpr,
):
    """fp32 values ``[R, 4, 8]`` of the blocks ``blk`` ``[R]`` of an MX payload."""
    scale = _load_e8m0(in_ptr, blk, bmask)
    codes = load_codes(in_ptr + nblocks, grp, gmask, elem, emask, nbytes, BITS)
    return decode_element(codes, NEXP, NMANT, BIAS, BITS, SPECIALS) * scale[:, None, None]


@triton.jit
def _mx_encode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values to encode, or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload (reduce; unused when not FUSED)
    out_ptr,  # output payload: nblocks scale bytes, then the packed codes
    # sizes
    n,  # number of values
    nblocks,  # ceil(n / 32)
    nbytes,  # bytes of the packed code stream
    # meta-parameters
    FUSED: tl.constexpr,  # reduce: values = decode(in payload) + local
    IN_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    NEXP: tl.constexpr,
    NMANT: tl.constexpr,
    BIAS: tl.constexpr,
    BITS: tl.constexpr,
    SPECIALS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    EMAX: tl.constexpr,
    ROWS: tl.constexpr,  # blocks per program
):
    # bytes moved per element: in (4, 2 or 2 for the values) + (BITS / 8 + 1 / 32) written;
    # FUSED adds (BITS / 8 + 1 / 32) read for the incoming payload

    # -- map program -> blocks [ROWS], groups [ROWS, 4], elements [ROWS, 4, 8]
    blk, grp, gmask, elem, emask = program_groups(n, ROWS, 4)
    bmask = blk < nblocks

    # -- load with mask: the fp32 values (fused: decoded partial sum + local)
    v = load_f32(x_ptr, elem, emask, IN_KIND)
    if FUSED:
        partial = _mx_decode_tile(
            in_ptr, blk, bmask, grp, gmask, elem, emask, nblocks, nbytes, NEXP, NMANT, BIAS,
            BITS, SPECIALS,
        )  # fmt: skip
        v = partial + v
    bits = f32_to_bits(v)

    # -- compute: shared exponent from the integer max of |v| bits (NaN > Inf > finite)
    amax = tl.max(tl.max(tl.where(emask, bits & 0x7FFFFFFF, 0), axis=2), axis=1)
    finite = amax < 0x7F800000
    shared = tl.minimum(tl.maximum(exponent_of(amax) - EMAX, -127), 127)
    scale_code = tl.where(finite, shared + 127, 0xFF)
    codes = encode_element(bits, shared[:, None, None], NMANT, BIAS, BITS, SPECIALS, MAX_CODE)
    codes = tl.where(finite[:, None, None], codes, 0)

    # -- store with mask: scale bytes, then the packed codes
    tl.store(out_ptr + blk, scale_code.to(tl.uint8), mask=bmask)
    store_codes(out_ptr + nblocks, codes, grp, gmask, elem, emask, nbytes, BITS)


@triton.jit
def _mx_rows_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values to encode, or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload (reduce; unused when not FUSED)
    out_ptr,  # output payload: nblocks scale bytes, then the packed codes
    # sizes
    n,  # number of values
    nblocks,  # ceil(n / 32)
    nbytes,  # bytes of the packed code stream
    # meta-parameters
    FUSED: tl.constexpr,
    IN_KIND: tl.constexpr,
    NEXP: tl.constexpr,
    NMANT: tl.constexpr,
    BIAS: tl.constexpr,
    BITS: tl.constexpr,  # 8 or 4
    SPECIALS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    EMAX: tl.constexpr,
    ROWS: tl.constexpr,  # blocks per program
):
    # the GPU layout of 8- and 4-bit elements: blocks as rows [ROWS, 32], values contiguous
    # along a row (wide loads and stores; a block's absmax is a row max). Bytes moved per
    # element: values in (4 fp32, 2 bf16/fp16) + (BITS / 8 + 1 / 32) out; FUSED adds as much in
    BPR: tl.constexpr = 4 * BITS  # code bytes per block

    # -- map program -> blocks [ROWS], elements [ROWS, 32]
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bmask = blk < nblocks
    elem = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    emask = elem < n
    boff = blk[:, None] * BPR + tl.arange(0, BPR)[None, :]  # code bytes [ROWS, BPR]
    bymask = boff < nbytes

    # -- load with mask: the fp32 values (fused: decoded partial sum + local)
    v = load_f32(x_ptr, elem, emask, IN_KIND)
    if FUSED:
        scale = _load_e8m0(in_ptr, blk, bmask)
        raw = tl.load(in_ptr + nblocks + boff, mask=bymask, other=0).to(tl.int32)
        code = unpack_rows(raw, ROWS, 32, BITS)
        v = decode_element(code, NEXP, NMANT, BIAS, BITS, SPECIALS) * scale[:, None] + v
    bits = f32_to_bits(v)

    # -- compute: shared exponent from the integer max of |v| bits (NaN > Inf > finite)
    amax = tl.max(tl.where(emask, bits & 0x7FFFFFFF, 0), axis=1)
    finite = amax < 0x7F800000
    shared = tl.minimum(tl.maximum(exponent_of(amax) - EMAX, -127), 127)
    codes = encode_element(bits, shared[:, None], NMANT, BIAS, BITS, SPECIALS, MAX_CODE)
    codes = tl.where(finite[:, None] & emask, codes, 0)

    # -- store with mask: scale bytes, then the codes
    tl.store(out_ptr + blk, tl.where(finite, shared + 127, 0xFF).to(tl.uint8), mask=bmask)
    packed = pack_rows(codes, ROWS, 32, BITS)
    tl.store(out_ptr + nblocks + boff, packed.to(tl.uint8), mask=bymask)


@triton.jit
def _mx_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    in_ptr,  # payload
    out_ptr,  # fp32 values
    # sizes
    n,
    nblocks,
    nbytes,
    # meta-parameters
    NEXP: tl.constexpr,
    NMANT: tl.constexpr,
    BIAS: tl.constexpr,
    BITS: tl.constexpr,
    SPECIALS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # bytes moved per element: (BITS / 8 + 1 / 32) read, 4 written

    # -- map program -> blocks [ROWS], groups [ROWS, 4], elements [ROWS, 4, 8]
    blk, grp, gmask, elem, emask = program_groups(n, ROWS, 4)
    bmask = blk < nblocks
    # -- load with mask and compute in fp32
    v = _mx_decode_tile(
        in_ptr, blk, bmask, grp, gmask, elem, emask, nblocks, nbytes, NEXP, NMANT, BIAS, BITS,
        SPECIALS,
    )  # fmt: skip
    # -- store with mask
    tl.store(out_ptr + elem, v, mask=emask)


# -- launchers --------------------------------------------------------------------------------


def _element_meta(codec: MXCodec) -> dict[str, int]:
    fmt = codec.element
    return {
        "NEXP": fmt.nexp,
        "NMANT": fmt.nmant,
        "BIAS": fmt.bias,
        "BITS": fmt.bits,
        "SPECIALS": SPECIALS[fmt.specials],
    }


def _rows(device: torch.device, nblocks: int) -> int:
    return max(1, min(tile_elems(device) // MX_BLOCK, triton.next_power_of_2(nblocks)))


def _encode_into(
    codec: MXCodec, values: torch.Tensor, incoming: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    n = values.numel()
    if n == 0:
        return out
    fmt = codec.element
    nblocks = -(-n // MX_BLOCK)
    rows = _rows(values.device, nblocks)
    xv, kind = value_view(values)
    grid = (triton.cdiv(nblocks, rows),)
    if ROWS_PATH and fmt.bits in (8, 4):
        _mx_rows_kernel[grid](
            xv, out if incoming is None else incoming, out, n, nblocks,
            packed_nbytes(n, fmt.bits),
            FUSED=incoming is not None, IN_KIND=kind, **_element_meta(codec),
            MAX_CODE=fmt.max_code, EMAX=fmt.emax, ROWS=rows,
            enable_fp_fusion=False, num_warps=NUM_WARPS,
        )  # fmt: skip
        record_launch("_mx_rows_kernel")
        return out
    _mx_encode_kernel[grid](
        xv, out if incoming is None else incoming, out,
        n, nblocks, packed_nbytes(n, fmt.bits),
        FUSED=incoming is not None, IN_KIND=kind, **_element_meta(codec),
        MAX_CODE=fmt.max_code, EMAX=fmt.emax, ROWS=rows, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_mx_encode_kernel")
    return out


def encode(codec: MXCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend."""
    out = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8, device=x.device)
    return _encode_into(codec, x, None, out)


def reduce(
    codec: MXCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: one pass, no fp32 tensor in memory."""
    out = torch.empty_like(payload)
    return _encode_into(codec, local, payload, out)


def decode(codec: MXCodec, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if numel == 0:
        return out
    nblocks = -(-numel // MX_BLOCK)
    rows = _rows(payload.device, nblocks)
    grid = (triton.cdiv(nblocks, rows),)
    _mx_decode_kernel[grid](
        payload, out, numel, nblocks, packed_nbytes(numel, codec.element.bits),
        **_element_meta(codec), ROWS=rows, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_mx_decode_kernel")
    return out
