"""Triton kernels of the pass-through codecs ``fp32``, ``bf16``, ``fp16``.

Reference: :class:`dynamiq.codecs.passthrough.PassThroughCodec` (``_encode``, ``_decode``, and
``_reduce`` = ``_encode(_decode(payload) + local.float())``), wire layout in
``docs/formats.md``. One kernel converts between value buffers: fp32 from bf16 by a 16-bit
shift, to bf16 by round-to-nearest-even on the bit pattern, fp16 both ways with integer
operations; finite values saturate at the target's largest value, a converted NaN becomes the
canonical quiet NaN, a buffer already in the target format is copied bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.passthrough import PassThroughCodec

from ._common import (
    NAN_F32,
    f32_to_bf16_bits,
    f32_to_bits,
    f32_to_f16_bits,
    load_f32,
    tile_elems,
    value_view,
)
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]


@triton.jit
def _passthrough_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    src_ptr,  # values to convert (encode, decode) or the local slice (reduce): int32 / int16
    in_ptr,  # incoming payload in DST_KIND (reduce; unused when not FUSED)
    dst_ptr,  # converted values: int32 (fp32) / int16 (bf16, fp16)
    # sizes
    n,
    # meta-parameters
    FUSED: tl.constexpr,  # reduce: dst = convert(in + src) in fp32
    SRC_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    DST_KIND: tl.constexpr,
    CANON_NAN: tl.constexpr,  # an fp32 destination writes NaN as 0x7fc00000
    BLOCK: tl.constexpr,
):
    # bytes moved per element: itemsize(src) + itemsize(dst), FUSED: + itemsize(dst)

    # -- map program -> block of elements
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SRC_KIND == DST_KIND and not FUSED:
        # -- load, store with mask: same format, bit copy
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    else:
        # -- load with mask, in fp32 (fused: incoming partial sum + local)
        v = load_f32(src_ptr, offs, mask, SRC_KIND)
        if FUSED:
            # local + partial: the NaN of ``local`` wins when both are NaN, as in torch's CPU
            # add (an fma of the second operand); only NaN payload bits depend on the order
            v = v + load_f32(in_ptr, offs, mask, DST_KIND)
        # -- compute: convert the bit pattern
        bits = f32_to_bits(v)
        if DST_KIND == 0:
            if CANON_NAN:
                bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, NAN_F32, bits)
            out = bits
        elif DST_KIND == 1:
            out = f32_to_bf16_bits(bits).to(tl.int16)
        else:
            out = f32_to_f16_bits(bits).to(tl.int16)
        # -- store with mask
        tl.store(dst_ptr + offs, out, mask=mask)


# -- launchers --------------------------------------------------------------------------------


def _convert(
    src: torch.Tensor, dst: torch.Tensor, incoming: torch.Tensor | None, canon_nan: bool
) -> None:
    n = src.numel()
    if n == 0:
        return
    sv, skind = value_view(src)
    dv, dkind = value_view(dst)
    iv = dv if incoming is None else value_view(incoming)[0]
    block = min(tile_elems(src.device), triton.next_power_of_2(n))
    _passthrough_kernel[(triton.cdiv(n, block),)](
        sv, iv, dv, n, FUSED=incoming is not None, SRC_KIND=skind, DST_KIND=dkind,
        CANON_NAN=canon_nan, BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_passthrough_kernel")


def encode(codec: PassThroughCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend."""
    out = torch.empty(x.numel(), dtype=codec.dtype, device=x.device)
    _convert(x, out, None, canon_nan=True)
    return out.view(torch.uint8)


def decode(
    codec: PassThroughCodec, payload: torch.Tensor, numel: int, ctx: HopContext
) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if numel:
        _convert(payload.view(codec.dtype), out, None, canon_nan=False)
    return out


def reduce(
    codec: PassThroughCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: one pass over memory."""
    out = torch.empty(local.numel(), dtype=codec.dtype, device=local.device)
    if local.numel():
        _convert(local, out, payload.view(codec.dtype), canon_nan=False)
    return out.view(torch.uint8)
