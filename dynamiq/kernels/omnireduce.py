# mypy: allow-untyped-defs
"""Triton kernels of the OmniReduce codec ``omnireduce`` (every ``density``, ``block_size``
and ``value_format``).

Reference: :class:`dynamiq.codecs.omnireduce.OmniReduceCodec` (``_encode``, ``_decode``,
``_reduce``; wire layout in its module docstring: the block bitmap, then the carried blocks'
values in the value format). The payload's size depends on the data, so encode and reduce
take two kernels with a small host step between them:

1. ``_omni_norms_kernel``: each block's squared L2 norm in fp64 by the reference's pairwise
   tree (element ``j + W/2`` onto ``j``, halving; coded level by level, never ``tl.sum`` over
   a whole block, whose order is not fixed), of ``x`` (encode) or of the local slice
   (reduce), and for a reduce without ``ctx.shared`` also of ``decode(payload) + local``;
2. on the host, with torch, on the per-block vectors only (``blocks = numel / block_size``
   values): the rule ``(τ, i*)`` (from ``ctx.shared``, or the codec's own ``_rule_of``: the
   ``K``-th block by norm, a sort, which is why this step is not in Triton), the blocks to
   send (the reference's ``_selected`` on the kernel's norms; for a reduce, OR the payload's
   blocks), their value counts and, by ``torch.cumsum``, each block's first value index in
   the output; this sizes the output (device syncs, as in the reference);
3. ``_omni_write_kernel``: every element of a sent block converted to the value format and
   written at its position (reduce: ``decode(payload) + local`` in fp32, the payload's block
   located by the incoming bitmap's prefix sum), and the output bitmap.

Decode unpacks the bitmap and checks the payload's length on the host (per block, the
reference's ``ValueError`` messages), then ``_omni_decode_kernel`` writes every element: the
carried value in fp32, or ``+0.0``. No fp32 tensor of the input's size is allocated; the
reduce reads the local slice twice (steps 1 and 3) and the incoming payload once (twice when
the rule comes from the sum: no ``ctx.shared``, density below 1).

Bit-exactness: squares ``fl64(x)^2`` are exact, the tree adds in the reference's order (so NaN
and ±Inf propagate as there); values are converted like the pass-through codecs (fp32 copied
bit for bit, bf16 and fp16 rounded to nearest-even on the bit pattern with saturation; every
NaN written as the format's canonical NaN, fp32 included, :mod:`dynamiq.kernels._common`: the
hardware's own NaN bits of a conversion or an add never reach the wire); ``decode(payload) +
local`` adds ``+0.0`` where the payload carries no block (``-0.0 + 0.0 = +0.0``, as the
reference). The carried values are read and written byte by byte (the value area starts right
after the bitmap, unaligned).

Layout: the norms kernel gives a program ``R`` whole blocks (a tile ``[R, block_size]``); a
block larger than a tile (``NCH`` tiles) is read as ``NCH`` strided slices ``c + NCH * m``,
whose trees are exactly the lower levels of the block's tree, and their ``NCH`` sums are
combined by its top levels. The write and decode kernels take contiguous elements.

Importing this module imports Triton; only :mod:`dynamiq.kernels` imports it, lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.omnireduce import THRESHOLD_KEY, TIE_KEY, OmniReduceCodec
from dynamiq.codecs.packing import unpack_bits

from ._common import (
    NAN_F32,
    bits_to_f32,
    f16_bits_to_f32_bits,
    f32_to_bf16_bits,
    f32_to_bits,
    f32_to_f16_bits,
    load_f32,
    tile_elems,
    value_view,
)
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]

#: value format -> (kind as in ``_common``: 0 fp32, 1 bf16, 2 fp16; bytes per value)
_VALUE_KIND = {"fp32": (0, 4), "bf16": (1, 2), "fp16": (2, 2)}


# -- device helpers ---------------------------------------------------------------------------


@triton.jit
def _pairwise(v, R: tl.constexpr, W: tl.constexpr, LOG: tl.constexpr):
    """Row sums of ``v`` ``[R, W]`` (fp64, ``W = 2^LOG``) by the reference's tree: add the
    second half onto the first, ``LOG`` times."""
    for i in tl.static_range(LOG):
        v = tl.sum(tl.reshape(v, [R, 2, W >> (i + 1)]), axis=1)  # a sum of 2: no order
    return tl.sum(v, axis=1)  # one element


@triton.jit
def _load_value(ptr, pos, mask, KIND: tl.constexpr, ISZ: tl.constexpr):
    """fp32 values of the items ``pos`` (int64, any shape) of a little-endian value stream at
    byte pointer ``ptr`` (not aligned), ``KIND`` 0 fp32, 1 bf16, 2 fp16; ``+0.0`` where
    masked."""
    j = tl.arange(0, ISZ)
    byte = tl.load(
        ptr + (tl.expand_dims(pos, -1) * ISZ + j), mask=tl.expand_dims(mask, -1), other=0
    ).to(tl.int32)
    bits = tl.sum(byte << (8 * j), axis=-1)  # disjoint bytes: the sum is an OR
    if KIND == 1:
        bits = bits << 16
    elif KIND == 2:
        bits = f16_bits_to_f32_bits(bits)
    return bits_to_f32(bits)


@triton.jit
def _store_value(ptr, pos, mask, v, KIND: tl.constexpr, ISZ: tl.constexpr):
    """Write fp32 ``v`` as items ``pos`` of a value stream at byte pointer ``ptr``: fp32 bit
    for bit but NaN as the canonical ``0x7fc00000`` (the reference's ``_pack``), bf16/fp16 as
    the pass-through codecs round them."""
    bits = f32_to_bits(v)
    if KIND == 0:
        bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, NAN_F32, bits)
    elif KIND == 1:
        bits = f32_to_bf16_bits(bits)
    elif KIND == 2:
        bits = f32_to_f16_bits(bits)
    j = tl.arange(0, ISZ)
    byte = (tl.expand_dims(bits, -1) >> (8 * j)) & 0xFF
    tl.store(
        ptr + (tl.expand_dims(pos, -1) * ISZ + j), byte.to(tl.uint8), mask=tl.expand_dims(mask, -1)
    )


# -- kernels ----------------------------------------------------------------------------------


@triton.jit
def _omni_norms_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values (encode) or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload, bytes (TOTAL)
    in_sent_ptr,  # int32 [blocks]: the incoming payload carries the block (TOTAL)
    in_pos_ptr,  # int64 [blocks]: its first value's index in the incoming stream (TOTAL)
    norm_ptr,  # fp64 [blocks]: squared norms of x / local
    total_ptr,  # fp64 [blocks]: squared norms of decode(payload) + local (TOTAL)
    # sizes
    n,  # number of values
    nblocks,
    in_head,  # bitmap bytes of the incoming payload (its value stream starts there)
    # meta-parameters
    TOTAL: tl.constexpr,  # also the norms of decode(payload) + local
    IN_KIND: tl.constexpr,  # x: 0 fp32, 1 bf16, 2 fp16
    KIND: tl.constexpr,  # value format of the incoming payload
    ISZ: tl.constexpr,  # its bytes per value
    BS: tl.constexpr,  # block size
    R: tl.constexpr,  # blocks per program
    W: tl.constexpr,  # values per block and slice: min(BS, tile)
    LOGW: tl.constexpr,
    NCH: tl.constexpr,  # slices per block (BS / W)
    LOGC: tl.constexpr,
):
    # bytes moved per element: x in (4 fp32, 2 bf16/fp16), TOTAL: + the incoming value
    # (ISZ) of carried blocks; out: 8 (or 16) bytes per block

    # -- map program -> blocks [R]; slices c + NCH * m of each block
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    bmask = blk < nblocks
    m = tl.arange(0, W).to(tl.int64)
    col = tl.arange(0, NCH)[None, :]
    acc = tl.zeros([R, NCH], dtype=tl.float64)
    tacc = tl.zeros([R, NCH], dtype=tl.float64)
    if TOTAL:
        sent = tl.load(in_sent_ptr + blk, mask=bmask, other=0) != 0
        pos = tl.load(in_pos_ptr + blk, mask=bmask & sent, other=0)
    for c in range(NCH):
        inner = c + NCH * m  # index in the block
        elem = blk[:, None] * BS + inner[None, :]
        # -- load with mask: fp32 values, 0 beyond n (the reference pads the last block)
        emask = bmask[:, None] & (elem < n)
        v = load_f32(x_ptr, elem, emask, IN_KIND)
        # -- compute in fp64: exact squares, the tree of this slice
        d = v.to(tl.float64)
        acc = tl.where(col == c, _pairwise(d * d, R, W, LOGW)[:, None], acc)
        if TOTAL:
            pmask = emask & sent[:, None]
            ipos = pos[:, None] + inner[None, :]
            part = _load_value(in_ptr + in_head, ipos, pmask, KIND, ISZ)
            t = (v + part).to(tl.float64)
            tacc = tl.where(col == c, _pairwise(t * t, R, W, LOGW)[:, None], tacc)
    # -- compute: the tree's top levels over the slices; store with mask
    tl.store(norm_ptr + blk, _pairwise(acc, R, NCH, LOGC), mask=bmask)
    if TOTAL:
        tl.store(total_ptr + blk, _pairwise(tacc, R, NCH, LOGC), mask=bmask)


@triton.jit
def _omni_write_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values (encode) or the local slice (reduce): int32 (fp32) / int16 (bf16, fp16)
    in_ptr,  # incoming payload, bytes (FUSED)
    in_sent_ptr,  # int32 [blocks]: the incoming payload carries the block (FUSED)
    in_pos_ptr,  # int64 [blocks]: its first value's index in the incoming stream (FUSED)
    out_ptr,  # output payload: bitmap (head bytes), then the value stream
    sent_ptr,  # int32 [blocks]: the output carries the block
    pos_ptr,  # int64 [blocks]: its first value's index in the output stream
    # sizes
    n,
    nblocks,
    in_head,  # bitmap bytes of the incoming payload (its value stream starts there)
    head,  # bitmap bytes of the output
    # meta-parameters
    FUSED: tl.constexpr,  # reduce: values = decode(payload) + local
    IN_KIND: tl.constexpr,  # x: 0 fp32, 1 bf16, 2 fp16
    KIND: tl.constexpr,  # value format
    ISZ: tl.constexpr,  # bytes per value
    BS: tl.constexpr,  # block size
    BLOCK: tl.constexpr,  # elements per program
    KB: tl.constexpr,  # bitmap bytes per program (at least 1)
):
    # bytes moved per element of a sent block: x in (4 fp32, 2 bf16/fp16) + ISZ out, FUSED: +
    # ISZ in where the payload carries it; per block: 12 (FUSED 24) bytes of metadata in

    # -- map program -> elements [BLOCK] and their blocks
    start = tl.program_id(0).to(tl.int64) * BLOCK
    elem = start + tl.arange(0, BLOCK)
    emask = elem < n
    blk = elem // BS
    inner = elem - blk * BS
    sent = tl.load(sent_ptr + blk, mask=emask, other=0) != 0
    smask = emask & sent
    pos = tl.load(pos_ptr + blk, mask=smask, other=0)
    # -- load with mask: fp32 values of the sent blocks (fused: + the decoded payload)
    v = load_f32(x_ptr, elem, smask, IN_KIND)
    if FUSED:
        isent = tl.load(in_sent_ptr + blk, mask=smask, other=0) != 0
        ipos = tl.load(in_pos_ptr + blk, mask=smask & isent, other=0)
        # +0.0 where the payload carries no block; local + partial (only NaN bits depend on
        # the order, and every NaN is written canonical)
        v = v + _load_value(in_ptr + in_head, ipos + inner, smask & isent, KIND, ISZ)
    # -- compute and store with mask: the value format's bytes
    _store_value(out_ptr + head, pos + inner, smask, v, KIND, ISZ)
    # -- the bitmap bytes whose first block starts in this program's elements
    k = (start + 8 * BS - 1) // (8 * BS) + tl.arange(0, KB)
    kmask = (k * (8 * BS) < start + BLOCK) & (k < head)
    b = k[:, None] * 8 + tl.arange(0, 8)[None, :]
    f = tl.load(sent_ptr + b, mask=kmask[:, None] & (b < nblocks), other=0)
    byte = tl.sum((f != 0).to(tl.int32) << tl.arange(0, 8)[None, :], axis=1)
    tl.store(out_ptr + k, byte.to(tl.uint8), mask=kmask)


@triton.jit
def _omni_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    in_ptr,  # payload, bytes
    sent_ptr,  # int32 [blocks]: the payload carries the block
    pos_ptr,  # int64 [blocks]: its first value's index in the value stream
    out_ptr,  # fp32 values
    # sizes
    n,
    head,  # bitmap bytes (the value stream starts there)
    # meta-parameters
    KIND: tl.constexpr,  # value format
    ISZ: tl.constexpr,  # bytes per value
    BS: tl.constexpr,  # block size
    BLOCK: tl.constexpr,  # elements per program
):
    # bytes moved per element: ISZ in (carried blocks) + 4 out; 12 bytes per block

    # -- map program -> elements [BLOCK] and their blocks
    elem = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    emask = elem < n
    blk = elem // BS
    sent = tl.load(sent_ptr + blk, mask=emask, other=0) != 0
    pos = tl.load(pos_ptr + blk, mask=emask & sent, other=0)
    # -- load with mask and convert: +0.0 in the blocks the payload does not carry
    v = _load_value(in_ptr + head, pos + (elem - blk * BS), emask & sent, KIND, ISZ)
    # -- store with mask
    tl.store(out_ptr + elem, v, mask=emask)


# -- host side: the per-block vectors ----------------------------------------------------------


class _Blocks(NamedTuple):
    """Which blocks a payload carries and where their values start."""

    sent: torch.Tensor  # int32 [blocks]
    pos: torch.Tensor  # int64 [blocks]: index of the block's first value in the value stream
    nvalues: int  # values carried


def _value_format(codec: OmniReduceCodec) -> tuple[int, int]:
    return _VALUE_KIND[codec.values.codec_id]


def _lengths(codec: OmniReduceCodec, numel: int, device: torch.device) -> torch.Tensor:
    """Values per block (int64; the last block may be short)."""
    nb, bs = codec.wire().nblocks(numel), codec.block_size
    lens = torch.full((nb,), bs, dtype=torch.int64, device=device)
    lens[-1] = numel - (nb - 1) * bs
    return lens


def _layout(codec: OmniReduceCodec, sent: torch.Tensor, numel: int) -> _Blocks:
    """Value counts and first positions of the blocks ``sent`` (bool), by a prefix sum."""
    counts = torch.where(sent, _lengths(codec, numel, sent.device), 0)
    ends = torch.cumsum(counts, 0)
    nvalues = int(ends[-1])  # one device sync: it sizes the output
    return _Blocks(sent.to(torch.int32), ends - counts, nvalues)


def _unpack(codec: OmniReduceCodec, payload: torch.Tensor, numel: int) -> tuple[_Blocks, int]:
    """The bitmap of ``payload`` as blocks and the bitmap's bytes; the reference's checks of
    the payload's length, with its messages."""
    nb = codec.wire().nblocks(numel)
    head = -(-nb // 8)
    if payload.numel() < head:
        raise ValueError(
            f"payload has {payload.numel()} bytes, less than the {head}-byte block bitmap"
        )
    blocks = _layout(codec, unpack_bits(payload[:head], 1, nb).bool(), numel)
    want = head + blocks.nvalues * codec.values.dtype.itemsize
    if payload.numel() != want:
        raise ValueError(
            f"payload has {payload.numel()} bytes but its bitmap announces {blocks.nvalues} "
            f"values in {want} bytes"
        )
    return blocks, head


def _rule(codec: OmniReduceCodec, ctx: HopContext, norms: torch.Tensor | None) -> tuple[float, int]:
    """``OmniReduceCodec._rule`` with the basis's norms given (``None``: ``ctx.shared`` holds
    the rule, or density 1 needs none)."""
    shared = ctx.shared
    if shared is not None and THRESHOLD_KEY in shared:
        return float(shared[THRESHOLD_KEY]), int(shared[TIE_KEY])
    if norms is None:
        return 0.0, -1  # density 1: unused
    index = codec.wire().block_index(norms.numel(), ctx.offset, norms.device)
    return codec.wire().rule(norms, index)


def _needs_basis(codec: OmniReduceCodec, ctx: HopContext) -> bool:
    """Whether the rule comes from the norms of the encoded values (no ``ctx.shared``)."""
    shared = ctx.shared
    return codec.density < 1.0 and not (shared is not None and THRESHOLD_KEY in shared)


def _selected(
    codec: OmniReduceCodec, norms: torch.Tensor, rule: tuple[float, int], offset: int
) -> torch.Tensor:
    """``OmniReduceCodec._selected`` on the kernel's norms."""
    special = ~torch.isfinite(norms)
    if codec.density == 1.0:
        return special | (norms > 0)
    tau, tie = rule
    index = codec.wire().block_index(norms.numel(), offset, norms.device)
    passes = (norms > tau) | ((norms == tau) & (index <= tie))
    return special | ((norms > 0) & passes)


# -- launchers --------------------------------------------------------------------------------


class _Incoming(NamedTuple):
    """A reduce's incoming payload: its bytes, its blocks and its bitmap's bytes."""

    payload: torch.Tensor
    blocks: _Blocks
    head: int


def _block_norms(
    codec: OmniReduceCodec, x: torch.Tensor, incoming: _Incoming | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Squared norms of the blocks of ``x`` and, given the incoming payload, of
    ``decode(payload) + x``."""
    n, bs = x.numel(), codec.block_size
    nb = codec.wire().nblocks(n)
    tile = tile_elems(x.device)
    if bs <= tile:
        w, nch, rows = bs, 1, max(1, min(tile // bs, triton.next_power_of_2(nb)))
    else:
        w, nch, rows = tile, bs // tile, 1
    xv, in_kind = value_view(x)
    kind, isz = _value_format(codec)
    norms = torch.empty(nb, dtype=torch.float64, device=x.device)
    if incoming is None:  # the incoming pointers are not read
        inp, in_sent, in_pos, in_head, total = xv, norms, norms, 0, norms
    else:
        inp, (in_sent, in_pos, _), in_head = incoming
        total = torch.empty_like(norms)
    _omni_norms_kernel[(triton.cdiv(nb, rows),)](
        xv, inp, in_sent, in_pos, norms, total, n, nb, in_head,
        TOTAL=incoming is not None, IN_KIND=in_kind, KIND=kind, ISZ=isz, BS=bs, R=rows, W=w,
        LOGW=w.bit_length() - 1, NCH=nch, LOGC=nch.bit_length() - 1, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_omni_norms_kernel")
    return norms, None if incoming is None else total


def _write(
    codec: OmniReduceCodec, x: torch.Tensor, incoming: _Incoming | None, sent: torch.Tensor
) -> torch.Tensor:
    """The payload carrying the blocks ``sent`` (bool) of ``x``, or of ``decode(payload) +
    x`` given the incoming payload."""
    n, bs = x.numel(), codec.block_size
    nb = codec.wire().nblocks(n)
    head = -(-nb // 8)
    kind, isz = _value_format(codec)
    out_blocks = _layout(codec, sent, n)
    out = torch.empty(head + out_blocks.nvalues * isz, dtype=torch.uint8, device=x.device)
    block = min(tile_elems(x.device), triton.next_power_of_2(n))
    xv, in_kind = value_view(x)
    if incoming is None:  # the incoming pointers are not read
        inp, in_blocks, in_head = out, out_blocks, 0
    else:
        inp, in_blocks, in_head = incoming
    _omni_write_kernel[(triton.cdiv(n, block),)](
        xv, inp, in_blocks.sent, in_blocks.pos, out, out_blocks.sent, out_blocks.pos,
        n, nb, in_head, head,
        FUSED=incoming is not None, IN_KIND=in_kind, KIND=kind, ISZ=isz, BS=bs, BLOCK=block,
        KB=max(1, block // (8 * bs)), enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_omni_write_kernel")
    return out


def encode(codec: OmniReduceCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend."""
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    norms, _ = _block_norms(codec, x, None)
    rule = _rule(codec, ctx, norms if _needs_basis(codec, ctx) else None)
    return _write(codec, x, None, _selected(codec, norms, rule, ctx.offset))


def decode(
    codec: OmniReduceCodec, payload: torch.Tensor, numel: int, ctx: HopContext
) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if numel == 0:
        return out
    blocks, head = _unpack(codec, payload, numel)
    kind, isz = _value_format(codec)
    block = min(tile_elems(payload.device), triton.next_power_of_2(numel))
    _omni_decode_kernel[(triton.cdiv(numel, block),)](
        payload, blocks.sent, blocks.pos, out, numel, head,
        KIND=kind, ISZ=isz, BS=codec.block_size, BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    record_launch("_omni_decode_kernel")
    return out


def reduce(
    codec: OmniReduceCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: the union of the payload's blocks and
    the local blocks that pass ``out_ctx``'s rule, carrying ``decode(payload) + local``; no
    fp32 tensor of the input's size in memory."""
    n = local.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=local.device)
    blocks, head = _unpack(codec, payload, n)
    incoming = _Incoming(payload, blocks, head)
    # the rule of out_ctx: its shared (tau, i*), else the K-th block of the sum
    norms, total = _block_norms(codec, local, incoming if _needs_basis(codec, out_ctx) else None)
    mine = _selected(codec, norms, _rule(codec, out_ctx, total), out_ctx.offset)
    return _write(codec, local, incoming, (blocks.sent != 0) | mine)
