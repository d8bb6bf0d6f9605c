# mypy: allow-untyped-defs
"""Triton kernels of THC (``thc``, every configuration): encode, decode and the fused reduce.

Reference: :class:`dynamiq.codecs.thc.ThcCodec` (``_encode``, ``_decode``, ``_reduce``), whose
module docstring is the definition of the recipe and the wire layout. Bit-exact with it.

**One program per rotation block** (``ROWS`` blocks of ``D = block_size`` values for small
blocks): a tile ``[ROWS, D]`` in registers; the short last block is a row of its own whose
transform size ``d_r`` is smaller (the butterfly stages beyond ``log2 d_r`` leave it alone).
Coordinate ``j`` of row ``b`` is code ``b·D + j`` of the payload's stream and element ``b·D + j``
of the input, so the rows of a program write whole bytes of the packed codes (``ROWS·D`` is a
multiple of 8) and programs never share a byte.

What runs in Triton (everything per element): loading fp32/bf16/fp16 values, the NaN/Inf
block flags and the input range check, the ±1 signs from the counter hash of
``(rotation_seed, global index)``, the Walsh–Hadamard butterflies, positions, the stochastic
rounding with the counter-hash dither (table lookup or integer grid), packing and unpacking
of the codes at any width (1..23 bits), the inverse rotation and the NaN blocks of decode, and
the reduce: the homomorphic integer path and, for blocks it cannot take, the re-encode of
``decode(payload) + local`` in the same program.

What runs on the host with torch, as the reference computes it (per segment or per block, a
``1/block_size`` fraction of the data): the agreed scales (``ctx.shared``), the ranges ``R``,
``R_k`` and their fp32 quotients, the per-block decode scales ``fl32(R_div / g) · 2^-log2 d``,
the header (ranges as fp32 bytes) and the NaN bitmap, and the range-match test of the reduce.
Without agreed scales (an encode outside a collective) the segment statistic is a fp64 sum of
squares whose rounding depends on torch's summation order: the encode then takes two kernels,
one that rotates and writes the fp32 coordinates ``w``, the reference's own ``_ranges`` on
them (torch), and one that quantizes ``w`` and packs.

**The butterflies in the reference's order.** The reference's stage ``h = 2^s`` maps the pair
``(i, i + h)`` to ``(a + b, a - b)``. The kernel runs the constant-geometry form of the same
stages: every stage splits the row into pairs ``(2i, 2i + 1)`` and writes ``a + b`` to
``i`` and ``a - b`` to ``i + D/2`` (``reshape``, ``split``, ``join``, ``permute``). Stage ``s``
then combines exactly the values the reference's stage ``s`` combines (the two that differ in
bit ``s`` of their original index), ``a`` the one with the bit clear, and after ``log2 D``
stages every value is back at its natural index: the same fp32 operations on the same
operands, so the same bits (a dot product with the Hadamard matrix would not be).

Bit-exactness otherwise as in the other kernels: ``w / R`` and ``(y - lo) / (hi - lo)`` with
``div_rn``, no FMA contraction (``enable_fp_fusion=False``), the reference's fp32 operation
order (``fl(fl(w / R) · g/2) + c·g/2``, ``fl((Y - g/2) · a) + y'``, ``(2Y - c·g) · scale``),
NaN/Inf block flags and range maxima with integer operations on the fp32 bits.

Errors are the reference's, in its order: corrupt ranges and malformed agreed scales are found
on the host, the input range (``max_input_abs``) and corrupt table indices by the kernels
(error words read back after the launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from dynamiq.codecs.base import HopContext
from dynamiq.codecs.hashing import hash_keys
from dynamiq.codecs.packing import pack_bits, unpack_bits
from dynamiq.codecs.thc import ThcCodec, ThcLayout

from ._common import (
    f32_to_bits,
    hash_u32,
    load_f32,
    store_codes,
    tile_elems,
    uniform_open01,
    value_view,
)
from ._stats import record_launch

__all__ = ["decode", "encode", "reduce"]

# what the values of the encode kernel are (``SRC``)
SRC_VALUES = 0  # the input (encode) or the local slice (homomorphic reduce)
SRC_FUSED = 1  # decode(incoming payload) + local slice (the reduce's re-encode)
SRC_ROTATED = 2  # rotated coordinates written by a STATS pass

# error words
ERR_BIG = 0  # largest |value| bits of the (finite blocks of the) values encoded
ERR_CODE = 1  # a table index >= len(table) in the incoming payload
ERR_SUM = 2  # largest |decode + local| bits of the homomorphic reduce's re-encode


# -- device functions -------------------------------------------------------------------------


@triton.jit
def _signs(idx, rkey0, rkey1):
    """The rotation's ±1 of global indices ``idx`` (``1 - 2·(hash >> 31)``, fp32)."""
    return 1.0 - 2.0 * (hash_u32(idx, rkey0, rkey1) >> 31).to(tl.float32)


@triton.jit
def _fwht(v, lg, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr, TAIL: tl.constexpr):
    """Unnormalised Walsh–Hadamard transform of the rows of ``v`` ``[ROWS, D]``, stage ``s``
    applied to rows with ``lg > s`` (``lg`` ``[ROWS, 1]``: log2 of the row's transform size;
    only read when ``TAIL``), in the reference's order (constant-geometry form)."""
    for s in tl.static_range(LOG_D):
        a, b = tl.split(tl.reshape(v, [ROWS, D // 2, 2]))
        if TAIL:
            on = lg > s
            p = tl.where(on, a + b, a)
            q = tl.where(on, a - b, b)
        else:
            p = a + b
            q = a - b
        v = tl.reshape(tl.permute(tl.join(p, q), (0, 2, 1)), [ROWS, D])
    return v


@triton.jit
def _load_codes(stream_ptr, c, cmask, nbytes, BITS: tl.constexpr):
    """Codes ``c`` (int64 code indices, any shape) of a packed stream of ``BITS``-bit codes."""
    NB: tl.constexpr = (BITS + 14) // 8  # bytes a code can touch
    p = c * BITS
    byte = p >> 3
    word = tl.zeros_like(c)
    for t in tl.static_range(NB):
        m = cmask & (byte + t < nbytes)
        word |= tl.load(stream_ptr + byte + t, mask=m, other=0).to(tl.int64) << (8 * t)
    return ((word >> (p & 7)) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _store_wide(stream_ptr, codes, grp, gmask, emask, nbytes, BITS: tl.constexpr):
    """Pack ``codes`` ``[1, G, 8]`` of ``BITS > 8`` bits: a group's 8 codes fill ``BITS``
    bytes, built as up to three 64-bit words (code ``i`` at bit ``i·BITS``)."""
    BP: tl.constexpr = triton.next_power_of_2(BITS)
    NW: tl.constexpr = (BITS + 7) // 8  # 64-bit words per group
    c = tl.where(emask, codes, 0).to(tl.int64) & ((1 << BITS) - 1)
    p = tl.arange(0, 8)[None, None, :] * BITS
    q = p // 64
    s = p % 64
    jj = tl.arange(0, BP)[None, None, :]
    byte = tl.zeros([1, grp.shape[1], BP], dtype=tl.int64)
    for w in tl.static_range(NW):
        part = tl.where(q == w, c << s, 0)  # bits past 64 fall off: the spill below
        spill = (q == w - 1) & (s + BITS > 64)
        part += tl.where(spill, c >> tl.minimum(64 - s, 63), 0)
        word = tl.sum(part, axis=2)[:, :, None]  # disjoint bit fields: the sum is an OR
        byte = tl.where(jj // 8 == w, (word >> ((jj % 8) * 8)) & 0xFF, byte)
    boff = grp[:, :, None] * BITS + jj
    bmask = gmask[:, :, None] & (jj < BITS) & (boff < nbytes)
    tl.store(stream_ptr + boff, byte.to(tl.uint8), mask=bmask)


@triton.jit
def _store_tile(stream_ptr, codes, pid, ncodes, nbytes, ROWS: tl.constexpr, D: tl.constexpr,
                BITS: tl.constexpr):  # fmt: skip
    """Pack the codes ``[ROWS, D]`` of program ``pid`` (whole bytes: ``ROWS·D % 8 == 0``)."""
    G8: tl.constexpr = ROWS * D // 8
    grp = pid.to(tl.int64) * G8 + tl.arange(0, G8)[None, :]
    elem = grp[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    emask = elem < ncodes
    gmask = grp * 8 < ncodes
    c3 = tl.reshape(codes, [1, G8, 8])
    if BITS <= 8:
        store_codes(stream_ptr, c3, grp, gmask, elem, emask, nbytes, BITS)
    else:
        _store_wide(stream_ptr, c3, grp, gmask, emask, nbytes, BITS)


@triton.jit
def _levels(stream_ptr, c, cmask, nbytes, table_ptr, err_ptr, BITS: tl.constexpr,  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
            WIDE: tl.constexpr, NTAB: tl.constexpr):  # fmt: skip
    """Integers ``Y`` (fp32) of a payload's codes ``c``; a table index ``>= NTAB`` sets
    ``err[ERR_CODE]``."""
    code = _load_codes(stream_ptr, c, cmask, nbytes, BITS)
    if WIDE:
        lev = code.to(tl.float32)
    else:
        if (1 << BITS) > NTAB:
            bad = tl.max(tl.max(tl.where(cmask & (code >= NTAB), 1, 0), axis=1), axis=0)
            tl.atomic_max(err_ptr + 1, bad, mask=bad > 0)
        lev = tl.load(table_ptr + tl.minimum(code, NTAB - 1), mask=cmask, other=0.0)
    return lev


@triton.jit
def _prepare(v, emask, rmask, err_ptr, WHICH: tl.constexpr):
    """The reference's ``_prepare``: rows holding NaN/Inf (``[ROWS, 1]``) and the values with
    those rows zeroed; the largest finite-row ``|v|`` (bits) into ``err[WHICH]``."""
    mag = f32_to_bits(v) & 0x7FFFFFFF
    bad = tl.max(tl.where(emask & (mag >= 0x7F800000), 1, 0), axis=1)[:, None] > 0
    vz = tl.where(bad, 0.0, v)
    big = tl.max(tl.max(tl.where(emask & ~bad & rmask, mag, 0), axis=1), axis=0)
    tl.atomic_max(err_ptr + WHICH, big, mask=big > 0)
    return vz, bad


@triton.jit
def _positions(w, r, chalf, HALF: tl.constexpr):
    """``fl(fl(w / R) · g/2) + c·g/2`` (fp32), 0 where ``w == 0``."""
    t = tl.where(w == 0, 0.0, tl.math.div_rn(w, r))
    return t * HALF + chalf


@triton.jit
def _quantize(y, u, lut_ptr, table_ptr, cmask, G: tl.constexpr, WIDE: tl.constexpr):
    """Codes of positions ``y >= 0`` by stochastic rounding with the dither ``u``: to the
    integer grid (``WIDE``) or to the two neighbouring table entries (index of the cell
    ``floor(y)``'s interval from ``lut``)."""
    fl = y.to(tl.int32)  # floor: y >= 0
    if WIDE:
        code = fl + (u < y - fl.to(tl.float32)).to(tl.int32)
    else:
        i = tl.load(lut_ptr + tl.minimum(fl, G), mask=cmask, other=0)
        lo = tl.load(table_ptr + i, mask=cmask, other=0.0)
        hi = tl.load(table_ptr + i + 1, mask=cmask, other=1.0)
        code = i + (u < tl.math.div_rn(y - lo, hi - lo)).to(tl.int32)
    return code


@triton.jit
def _decode_tile(in_ptr, c, cmask, rowc, rmask, lg, nbytes, dscale_ptr, flag_ptr, table_ptr,  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
                 err_ptr, cg, offset, rkey0, rkey1, ROWS: tl.constexpr, D: tl.constexpr,
                 LOG_D: tl.constexpr, TAIL: tl.constexpr, BITS: tl.constexpr,
                 WIDE: tl.constexpr, NTAB: tl.constexpr):  # fmt: skip
    """Decoded values ``[ROWS, D]`` of a payload's rows: ``D ⊙ H·((2Y - c·g) · scale)``, NaN
    in flagged rows; also the integers ``Y``."""
    lev = _levels(in_ptr, c, cmask, nbytes, table_ptr, err_ptr, BITS, WIDE, NTAB)
    scale = tl.load(dscale_ptr + rowc, mask=rmask, other=0.0)
    w = (2.0 * lev - cg) * scale
    x = _fwht(w, lg, ROWS, D, LOG_D, TAIL) * _signs(c + offset, rkey0, rkey1)
    flagged = tl.load(flag_ptr + rowc, mask=rmask, other=0) != 0
    return tl.where(flagged, float("nan"), x), lev


# -- kernels ----------------------------------------------------------------------------------


@triton.jit
def _map_rows(nblocks, nfull, log_tail, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """This program's rows ``[ROWS, 1]`` (blocks) and coordinates ``[ROWS, D]``: ``(pid, row,
    c, row mask, row clamped to the last block, log2 of each row's transform size)``."""
    pid = tl.program_id(0)
    row = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    c = row * D + tl.arange(0, D)[None, :]
    rmask = row < nblocks
    rowc = tl.minimum(row, nblocks - 1)
    lg = tl.where(row < nfull, LOG_D, log_tail)
    return pid, row, c, rmask, rowc, lg


@triton.jit(do_not_specialize=["offset", "offset_in", "key0", "key1", "rkey0", "rkey1", "force"])
def _thc_encode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    x_ptr,  # values or local slice: int32 (fp32) / int16 (bf16, fp16) view
    in_ptr,  # incoming payload's code stream (SRC_FUSED, HOMO)
    w_ptr,  # fp32 rotated coordinates: written (STATS), read (SRC_ROTATED)
    out_ptr,  # outgoing payload's code stream
    par_ptr,  # fp32 [3, nblocks]: R_div (out), decode scale (in), a = R_kin / R_kout (HOMO)
    nan_in_ptr,  # uint8 [nblocks]: the incoming payload's NaN flags (SRC_FUSED, HOMO)
    fit_in_ptr,  # uint8 [nblocks]: blocks the homomorphic path may take, local aside (HOMO)
    flag_out_ptr,  # uint8 [nblocks]: outgoing NaN flags (STATS, SRC_VALUES, SRC_FUSED, HOMO)
    fits_ptr,  # uint8 [nblocks]: blocks the homomorphic path took (HOMO)
    sc_ptr,  # fp32 [4]: c·g/2 (positions), m·g/2 (homomorphic positions), clamp, c_in·g
    table_ptr,  # fp32 table
    lut_ptr,  # int32 [g + 1]: table interval of each unit cell
    err_ptr,  # int32 [3]: ERR_BIG, ERR_CODE, ERR_SUM
    # sizes
    n,  # values
    ncodes,  # coordinates (nfull·D + d_r)
    nblocks,
    nfull,  # full blocks; row nfull (if any) is the short last block
    log_tail,  # log2 d_r
    in_nbytes,  # bytes of the incoming code stream
    out_nbytes,  # bytes of the outgoing code stream
    # hop contexts
    offset,  # global index of element 0 (outgoing)
    offset_in,  # ... of the incoming payload (SRC_FUSED)
    key0,  # dither keys of the outgoing context
    key1,
    rkey0,  # rotation keys
    rkey1,
    force,  # HOMO: compute the re-encode in every program (the sum's range check)
    # meta-parameters
    SRC: tl.constexpr,  # SRC_VALUES, SRC_FUSED, SRC_ROTATED
    STATS: tl.constexpr,  # pass 1 of 2: write the rotated coordinates and flags, no codes
    HOMO: tl.constexpr,  # the homomorphic reduce (SRC_VALUES: the local slice)
    IN_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    D: tl.constexpr,  # block size
    LOG_D: tl.constexpr,
    TAIL: tl.constexpr,  # whether there is a short last block
    ROWS: tl.constexpr,  # blocks per program
    BITS_IN: tl.constexpr,  # incoming code width
    WIDE_IN: tl.constexpr,  # incoming codes are integers (widen, k_in > 1), not table indices
    BITS: tl.constexpr,  # outgoing code width
    WIDE: tl.constexpr,
    WIDEN: tl.constexpr,  # variant "widen" (HOMO: integer adds) or "requantize"
    G: tl.constexpr,  # table[-1]
    NTAB: tl.constexpr,  # len(table)
):
    # bytes moved per value: values in (4 fp32, 2 bf16/fp16) + BITS / 8 out (+ 4 / D header);
    # SRC_FUSED / HOMO add BITS_IN / 8 in; the two-pass encode adds 4 out + 4 in (w)

    # -- map program -> rows [ROWS, 1] (blocks), coordinates [ROWS, D]
    pid, row, c, rmask, rowc, lg = _map_rows(nblocks, nfull, log_tail, ROWS, D, LOG_D)
    emask = c < n
    cmask = c < ncodes
    HALF: tl.constexpr = float(G // 2)
    chalf = tl.load(sc_ptr)
    ymax = tl.load(sc_ptr + 2)
    rdiv = tl.load(par_ptr + rowc, mask=rmask, other=1.0)

    # -- load with mask: the values (decoded partial sum + local), NaN/Inf rows, rotation
    if SRC == 2:
        w = tl.load(w_ptr + c, mask=cmask, other=0.0)
        v = w  # unused
        bad = row < 0
    else:
        v = load_f32(x_ptr, c, emask, IN_KIND)
        if SRC == 1:
            x_in, _ = _decode_tile(
                in_ptr, c, cmask, rowc, rmask, lg, in_nbytes, par_ptr + nblocks, nan_in_ptr,
                table_ptr, err_ptr, tl.load(sc_ptr + 3), offset_in, rkey0, rkey1, ROWS, D, LOG_D,
                TAIL, BITS_IN, WIDE_IN, NTAB,
            )  # fmt: skip
            v = tl.where(emask, x_in + v, 0.0)
        vz, bad = _prepare(v, emask, rmask, err_ptr, 0)
        w = _fwht(vz * _signs(c + offset, rkey0, rkey1), lg, ROWS, D, LOG_D, TAIL)
    if STATS:
        # -- store with mask: pass 1 ends here
        tl.store(w_ptr + c, w, mask=cmask)
        tl.store(flag_out_ptr + row, bad.to(tl.uint8), mask=rmask)
    else:
        # -- compute: positions, stochastic rounding
        u = uniform_open01(hash_u32(c + offset, key0, key1))
        if HOMO:
            lev = _levels(in_ptr, c, cmask, in_nbytes, table_ptr, err_ptr, BITS_IN, WIDE_IN, NTAB)
            yl = _positions(w, rdiv, tl.load(sc_ptr + 1), HALF)
            if WIDEN:
                y = lev + yl
            else:
                a = tl.load(par_ptr + 2 * nblocks + rowc, mask=rmask, other=0.0)
                y = (lev - HALF) * a + yl
            y = tl.minimum(tl.maximum(y, 0.0), ymax)
            codes = _quantize(y, u, lut_ptr, table_ptr, cmask, G, WIDE)
            fits = (tl.load(fit_in_ptr + rowc, mask=rmask, other=0) != 0) & ~bad
            nfit = tl.max(tl.max(tl.where(rmask & ~fits, 1, 0), axis=1), axis=0)
            bad_out = row < 0
            if nfit + force > 0:
                # the blocks the homomorphic path cannot take: encode(decode + local)
                x_in, _ = _decode_tile(
                    in_ptr, c, cmask, rowc, rmask, lg, in_nbytes, par_ptr + nblocks,
                    nan_in_ptr, table_ptr, err_ptr, tl.load(sc_ptr + 3), offset, rkey0,
                    rkey1, ROWS, D, LOG_D, TAIL, BITS_IN, WIDE_IN, NTAB,
                )  # fmt: skip
                s = tl.where(emask, x_in + v, 0.0)
                sz, bad_s = _prepare(s, emask, rmask, err_ptr, 2)
                ws = _fwht(sz * _signs(c + offset, rkey0, rkey1), lg, ROWS, D, LOG_D, TAIL)
                ys = tl.minimum(tl.maximum(_positions(ws, rdiv, chalf, HALF), 0.0), ymax)
                codes = tl.where(fits, codes, _quantize(ys, u, lut_ptr, table_ptr, cmask, G, WIDE))
                bad_out = bad_s & ~fits
            tl.store(fits_ptr + row, fits.to(tl.uint8), mask=rmask)
            bad = bad_out
        else:
            y = tl.minimum(tl.maximum(_positions(w, rdiv, chalf, HALF), 0.0), ymax)
            codes = _quantize(y, u, lut_ptr, table_ptr, cmask, G, WIDE)
        # -- store with mask: the row flags and the packed codes
        tl.store(flag_out_ptr + row, bad.to(tl.uint8), mask=rmask)
        _store_tile(out_ptr, codes, pid, ncodes, out_nbytes, ROWS, D, BITS)


@triton.jit(do_not_specialize=["offset", "rkey0", "rkey1"])
def _thc_decode_kernel(  # noqa: PLR0913  Triton: an argument per pointer, size, constexpr
    # pointers
    in_ptr,  # payload's code stream
    out_ptr,  # fp32 values
    scale_ptr,  # fp32 [nblocks]: fl32(R_div / g) · 2^-log2 d of each block
    flag_ptr,  # uint8 [nblocks]: NaN flags
    sc_ptr,  # fp32 [1]: c·g
    table_ptr,  # fp32 table
    err_ptr,  # int32 [3]: ERR_CODE
    # sizes
    n,
    ncodes,
    nblocks,
    nfull,
    log_tail,
    nbytes,
    # hop context
    offset,
    rkey0,
    rkey1,
    # meta-parameters
    D: tl.constexpr,
    LOG_D: tl.constexpr,
    TAIL: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    WIDE: tl.constexpr,
    NTAB: tl.constexpr,
):
    # bytes moved per value: BITS / 8 (+ 5 / D per block) read, 4 written

    # -- map program -> rows [ROWS, 1] (blocks), coordinates [ROWS, D]
    _, _, c, rmask, rowc, lg = _map_rows(nblocks, nfull, log_tail, ROWS, D, LOG_D)
    # -- load with mask and compute in fp32: levels, scale, inverse rotation, NaN rows
    x, _ = _decode_tile(
        in_ptr, c, c < ncodes, rowc, rmask, lg, nbytes, scale_ptr,
        flag_ptr, table_ptr, err_ptr, tl.load(sc_ptr), offset, rkey0, rkey1, ROWS, D, LOG_D,
        TAIL, BITS, WIDE, NTAB,
    )  # fmt: skip
    # -- store with mask
    tl.store(out_ptr + c, x, mask=c < n)


# -- launchers --------------------------------------------------------------------------------


def _rows(codec: ThcCodec, nblocks: int, device: torch.device) -> int:
    """Blocks per program: ``ROWS · D`` whole bytes of codes, about a tile of values."""
    d = codec.block_size
    rows = max(1, tile_elems(device) // d, 8 // d)
    return max(min(rows, triton.next_power_of_2(nblocks)), -(-8 // d))


def _tables(codec: ThcCodec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The table (fp32) and the table interval of each unit cell ``0 .. g`` (int32), as the
    reference's ``_table_interval`` builds them."""
    table = torch.tensor(codec.table, dtype=torch.float32, device=device)
    cells = torch.arange(codec.g + 1, dtype=torch.float32, device=device)
    lut = (torch.searchsorted(table, cells, right=True) - 1).clamp(0, len(codec.table) - 2)
    return table, lut.to(torch.int32)


#: a fixed warp count for every launch instead of ``_num_warps``'s (``benchmarks/gpu_check.py``
#: times a few on a GPU); None: the rule below
WARPS_OVERRIDE: int | None = None


def _num_warps(tile: int) -> int:
    """Warps per program for a tile of ``tile`` values: 4 up to 4096 values, then one more
    warp per 1024 up to 16. With 4 warps a 16384-value block (the default) needs more than the
    255 registers a thread may have (``ptxas -v``, sm_90: 2-13 KB of spill stores a thread);
    16 warps take 128 registers and spill 0.2-1.7 KB. The results do not depend on it (the
    kernels' reductions are integer maxima and sums of disjoint bit fields)."""
    if WARPS_OVERRIDE is not None:
        return WARPS_OVERRIDE
    return max(4, min(16, tile // 1024))


def _geometry(codec: ThcCodec, lay: ThcLayout, device: torch.device) -> dict[str, Any]:
    rows = _rows(codec, lay.nblocks, device)
    return {
        "grid": (triton.cdiv(lay.nblocks, rows),),
        "num_warps": _num_warps(rows * codec.block_size),
        "sizes": (
            lay.numel,
            lay.ncodes,
            lay.nblocks,
            lay.nfull,
            max(lay.tail_d.bit_length() - 1, 0),
        ),
        "meta": {
            "D": codec.block_size,
            "LOG_D": codec.block_size.bit_length() - 1,
            "TAIL": lay.tail > 0,
            "ROWS": rows,
        },
    }


def _wide(codec: ThcCodec, k: int) -> bool:
    return codec.variant == "widen" and k > 1


def _big(codec: ThcCodec, err: torch.Tensor, which: int) -> None:
    """Raise the reference's ``_prepare`` error when ``err[which]`` exceeds the input range."""
    bits = int(err[which].item())
    big = float(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())
    if big > codec.max_input_abs:
        raise ValueError(
            f"thc: |x| = {big!r} exceeds max_input_abs={codec.max_input_abs!r} (the "
            f"rotation over {codec.block_size} values or the clip T = "
            f"{codec.effective_clip:g} could overflow fp32)"
        )


def _corrupt(codec: ThcCodec, err: torch.Tensor) -> None:
    if int(err[ERR_CODE].item()):
        raise ValueError(f"thc: corrupt payload: a table index is >= {len(codec.table)}")


def _header(
    payload: torch.Tensor, codec: ThcCodec, lay: ThcLayout, ctx: HopContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's ``_unpack`` less the codes: ranges (fp64), NaN flags (uint8 per block)
    and the code stream."""
    wire = codec.wire()
    nseg = wire.nsegments(lay, ctx.offset)
    r = payload[: 4 * nseg].clone().view(torch.float32).double()
    if not bool((torch.isfinite(r) & (r >= 0)).all()):
        raise ValueError("thc: corrupt payload: a segment range is negative or not finite")
    nf = -(-lay.nblocks // 8)
    flags = unpack_bits(payload[4 * nseg : 4 * nseg + nf], 1, lay.nblocks)
    return r, flags.to(torch.uint8).contiguous(), payload[4 * nseg + nf :]


def _decode_scales(
    codec: ThcCodec, r: torch.Tensor, k: int, lay: ThcLayout, of_block: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Per block ``fl32(R_div / g) · 2^-log2 d_b`` (the reference's ``_decode``), and ``c``."""
    wire = codec.wire()
    r_div, c = wire.divisor(r, k)
    per_g = r_div.float() / torch.full_like(r_div, float(codec.g), dtype=torch.float32)
    inv = [2.0 ** -(codec.block_size.bit_length() - 1)] * lay.nfull
    if lay.tail:
        inv.append(2.0 ** -(lay.tail_d.bit_length() - 1))
    inv_d = torch.tensor(inv, dtype=torch.float32, device=r.device)
    return per_g[of_block] * inv_d, c


@dataclass(frozen=True)
class _Incoming:
    """The payload a reduce decodes: its code stream and context, per-block decode scales and
    NaN flags (uint8), and ``c·g`` of its contributions."""

    stream: torch.Tensor
    ctx: HopContext
    scale: torch.Tensor
    flags: torch.Tensor
    cg: float


def _launch_encode(  # noqa: PLR0913  the launcher hands the kernel its buffers; keyword-only flags pick the pass
    codec: ThcCodec,
    lay: ThcLayout,
    values: torch.Tensor,
    stream: torch.Tensor,
    par: torch.Tensor,
    flags: dict[str, torch.Tensor],
    scalars: list[float],
    err: torch.Tensor,
    ctx: HopContext,
    *,
    src: int,
    incoming: _Incoming | None = None,
    stats: bool = False,
    homo: bool = False,
    w: torch.Tensor | None = None,
    force: int = 0,
) -> None:
    wire = codec.wire()
    device = values.device
    geo = _geometry(codec, lay, device)
    xv, kind = value_view(values)
    table, lut = _tables(codec, device)
    k = ctx.contributions
    in_stream, in_ctx = (stream, ctx) if incoming is None else (incoming.stream, incoming.ctx)
    k_in = in_ctx.contributions
    key0, key1 = hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
    rkey0, rkey1 = wire.rotation_keys
    out_flags = flags["out"]
    nan_in = out_flags if incoming is None else incoming.flags
    sc = torch.tensor(scalars, dtype=torch.float32, device=device)
    _thc_encode_kernel[geo["grid"]](
        xv, in_stream, stream if w is None else w, stream, par, nan_in,
        flags.get("fit_in", out_flags), out_flags, flags.get("fits", out_flags), sc, table,
        lut, err, *geo["sizes"], in_stream.numel(), stream.numel(),
        ctx.offset, in_ctx.offset, key0, key1, rkey0, rkey1, force,
        SRC=src, STATS=stats, HOMO=homo, IN_KIND=kind, **geo["meta"],
        BITS_IN=codec.width(k_in), WIDE_IN=_wide(codec, k_in), BITS=codec.width(k),
        WIDE=_wide(codec, k), WIDEN=codec.variant == "widen", G=codec.g, NTAB=len(codec.table),
        enable_fp_fusion=False, num_warps=geo["num_warps"],
    )  # fmt: skip
    record_launch("_thc_encode_kernel")


def _encode_into(
    codec: ThcCodec, values: torch.Tensor, incoming: _Incoming | None, ctx: HopContext
) -> torch.Tensor:
    """``codec._encode(values, ctx)``, or ``codec._encode(decode(incoming) + values, ctx)``."""
    wire = codec.wire()
    device = values.device
    n = values.numel()
    k = ctx.contributions
    wire.check_contributions(k)
    lay = wire.layout(n)
    segs = wire.segments(lay, ctx.offset, device)
    out = torch.empty(codec.encoded_nbytes(n, ctx), dtype=torch.uint8, device=device)
    nseg = wire.nsegments(lay, ctx.offset)
    stream = out[4 * nseg + -(-lay.nblocks // 8) :]
    err = torch.zeros(3, dtype=torch.int32, device=device)
    flags = {"out": torch.zeros(lay.nblocks, dtype=torch.uint8, device=device)}
    par = torch.ones(3, lay.nblocks, dtype=torch.float32, device=device)
    cg_in = 0.0
    if incoming is not None:
        par[1] = incoming.scale
        cg_in = incoming.cg
    src = SRC_VALUES if incoming is None else SRC_FUSED
    try:
        agreed = wire.agreed_scales(ctx, segs, device)
        malformed = False
    except (TypeError, ValueError):
        agreed, malformed = None, True  # the reference checks the values first: pass 1 does
    if agreed is None:
        # pass 1: rotate, flags, range check; the segment statistic in torch (the reference's)
        w = torch.empty(lay.ncodes, dtype=torch.float32, device=device)
        _launch_encode(
            codec, lay, values, stream, par, flags, [0.0, 0.0, 0.0, cg_in], err, ctx,
            src=src, incoming=incoming, stats=True, w=w,
        )  # fmt: skip
        _corrupt(codec, err)
        _big(codec, err, ERR_BIG)
        if malformed:
            wire.agreed_scales(ctx, segs, device)  # raises the reference's error
        r = wire.ranges(ctx, w, flags["out"] == 0, lay)
    else:
        r = wire.clip_ranges(agreed)
    r_div, c = wire.divisor(r, k)
    par[0] = r_div[segs.of_block].float()
    scal = [float(c * (codec.g // 2)), 0.0, float(c * codec.g), cg_in]
    if agreed is None:
        # pass 2: quantize the rotated coordinates
        _launch_encode(codec, lay, values, stream, par, {**flags, "out": flags["out"].clone()},
                       scal, err, ctx, src=SRC_ROTATED, w=w)  # fmt: skip
    else:
        _launch_encode(codec, lay, values, stream, par, flags, scal, err, ctx, src=src,
                       incoming=incoming)  # fmt: skip
        _corrupt(codec, err)
        _big(codec, err, ERR_BIG)
    _write_header(out, r, flags["out"], nseg)
    return out


def _write_header(out: torch.Tensor, r: torch.Tensor, flags: torch.Tensor, nseg: int) -> None:
    out[: 4 * nseg] = r.float().contiguous().view(torch.uint8)
    bitmap = pack_bits(flags, 1)
    out[4 * nseg : 4 * nseg + bitmap.numel()] = bitmap


def encode(codec: ThcCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on the Triton backend: one kernel with agreed scales
    (``ctx.shared``), two without."""
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    return _encode_into(codec, x.contiguous(), None, ctx)


def decode(codec: ThcCodec, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on the Triton backend."""
    wire = codec.wire()
    device = payload.device
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel == 0:
        return out
    k = ctx.contributions
    lay = wire.layout(numel)
    r, flags, stream = _header(payload, codec, lay, ctx)
    segs = wire.segments(lay, ctx.offset, device)
    scale, c = _decode_scales(codec, r, k, lay, segs.of_block)
    table, _ = _tables(codec, device)
    err = torch.zeros(3, dtype=torch.int32, device=device)
    geo = _geometry(codec, lay, device)
    rkey0, rkey1 = wire.rotation_keys
    sc = torch.tensor([float(c * codec.g)], dtype=torch.float32, device=device)
    _thc_decode_kernel[geo["grid"]](
        stream, out, scale, flags, sc, table, err, *geo["sizes"], stream.numel(),
        ctx.offset, rkey0, rkey1, **geo["meta"], BITS=codec.width(k), WIDE=_wide(codec, k),
        NTAB=len(codec.table), enable_fp_fusion=False, num_warps=geo["num_warps"],
    )  # fmt: skip
    record_launch("_thc_decode_kernel")
    _corrupt(codec, err)
    return out


def reduce(
    codec: ThcCodec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)``: one kernel for homomorphic and
    re-encoded blocks alike (launched again only to range-check the re-encode of every block
    when a local block holds NaN/Inf, as the reference does); without the homomorphic path
    (no agreed scales, ``m < 1``, another offset) the encode of ``decode(payload) + local``."""
    wire = codec.wire()
    device = local.device
    n = local.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    local = local.contiguous()
    k_in, k_out = ctx.contributions, out_ctx.contributions
    wire.check_contributions(k_in)
    wire.check_contributions(k_out)
    m = k_out - k_in
    lay = wire.layout(n)
    r_in, flags_in, in_stream = _header(payload, codec, lay, ctx)
    segs = wire.segments(lay, out_ctx.offset, device)
    agreed = wire.agreed_scales(out_ctx, segs, device)
    in_segs = wire.segments(lay, ctx.offset, device)
    in_scale, c_in = _decode_scales(codec, r_in, k_in, lay, in_segs.of_block)
    incoming = _Incoming(in_stream, ctx, in_scale, flags_in, float(c_in * codec.g))
    if agreed is None or m < 1 or ctx.offset != out_ctx.offset:
        return _encode_into(codec, local, incoming, out_ctx)
    r_out = wire.clip_ranges(agreed)
    fit_in = ((flags_in == 0) & (r_in == r_out)[segs.of_block]).to(torch.uint8)
    out = torch.empty(codec.encoded_nbytes(n, out_ctx), dtype=torch.uint8, device=device)
    nseg = wire.nsegments(lay, out_ctx.offset)
    stream = out[4 * nseg + -(-lay.nblocks // 8) :]
    par = torch.ones(3, lay.nblocks, dtype=torch.float32, device=device)
    r_div, c = wire.divisor(r_out, k_out)  # both paths divide by it
    par[0] = r_div[segs.of_block].float()
    par[1] = in_scale
    half = codec.g // 2
    if codec.variant == "widen":
        chalf_h = float(m * half)
    else:
        r_kin, _ = wire.divisor(r_out, k_in)
        a = torch.where(r_div > 0, r_kin.float() / r_div.float(), 0.0)
        par[2] = a[segs.of_block]
        chalf_h = float(half)
    scal = [float(c * half), chalf_h, float(c * codec.g), incoming.cg]
    flags = {
        "fit_in": fit_in,
        "out": torch.zeros(lay.nblocks, dtype=torch.uint8, device=device),
        "fits": torch.zeros(lay.nblocks, dtype=torch.uint8, device=device),
    }
    err = torch.zeros(3, dtype=torch.int32, device=device)
    # every program re-encodes its blocks when some block cannot take the homomorphic path
    force = int(not bool(fit_in.all()))
    while True:
        _launch_encode(
            codec, lay, local, stream, par, flags, scal, err, out_ctx, src=SRC_VALUES,
            incoming=incoming, homo=True, force=force,
        )  # fmt: skip
        _big(codec, err, ERR_BIG)
        _corrupt(codec, err)
        if bool(flags["fits"].all()):
            break
        if force:
            _big(codec, err, ERR_SUM)
            break
        force = 1  # a local block holds NaN/Inf: range-check every block's re-encode
    _write_header(out, r_out, flags["out"], nseg)
    return out
