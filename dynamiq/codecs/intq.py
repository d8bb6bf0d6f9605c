"""Dynamic-range block INT codecs ``int2`` ... ``int8`` (docs/design.md, "Codec
sources"; docs/codecs.md).

Each block of ``block_size`` values shares one scale ``S``: the smallest value of the scale
format that is >= ``absmax / qmax`` (``qmax = 2^(bits-1) - 1``), so ``|x| / S <= qmax`` always
and no code is ever clamped. Codes are symmetric two's complement integers in
``-qmax .. qmax``; the value is ``code * S``.

Wire layout (little-endian): ``ceil(numel / block_size)`` scales in the scale format, then the
``numel`` codes packed densely at ``bits`` bits each (``dynamiq.codecs.packing``).

Rounding: ``"nearest"`` (ties to even) or ``"stochastic"``: ``code = floor(q) + [u < q -
floor(q)]`` with ``q = fl32(x / S)`` and ``u`` from the counter-based hash of ``(seed, step, hop,
rank, global index)`` (``dynamiq.codecs.hashing``).

Non-finite input: a block holding NaN or ±Inf gets a NaN scale (written as the canonical
quiet NaN ``0x7fc0`` bf16, ``0x7e00`` fp16, ``0x7fc00000`` fp32, ``0xff`` e8m0) and decodes to
NaN.
Inputs are accepted up to ``max_input_abs``: 2^127 (half of fp32's range, so that ``code * S``
stays finite), and ``65504 * qmax`` for ``fp16`` scales; a block beyond it raises
``ValueError``. All-zero blocks get scale 0 (``e8m0``: 2^-127) and decode to 0.
Tiny blocks never get a zero scale: it rounds up to the smallest positive value of the scale
format (fp16: 2^-24), so a block far below it decodes to values within ``S/2`` of the input
(zeros when ``absmax < S/2``), as the bound below states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from . import wire_codes
from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .formats import FLOAT8_E8M0FNU
from .hashing import hash_keys, hash_u32, uniform_open01
from .packing import pack_bits, packed_nbytes, unpack_bits
from .registry import register_codec

__all__ = ["IntCodec", "block_absmax"]

SCALE_FORMATS = tuple(wire_codes.SCALE_FORMATS)
_SCALE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SCALE_BYTES = {k: f.nbytes for k, f in wire_codes.SCALE_FORMATS.items()}
#: the bits a NaN scale is written as (canonical quiet NaN, positive), as a signed integer
_CANONICAL_NAN = {k: f.nan_bits for k, f in wire_codes.SCALE_FORMATS.items() if k != "e8m0"}


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 absmax of each block of ``x`` (the last block may be short); NaN if it holds NaN."""
    n = x.numel()
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(nb, block_size).abs().amax(dim=1) if nb else padded[:0]


def _bump(c: torch.Tensor) -> torch.Tensor:
    """The next representable value above each ``c >= 0`` of c's dtype, as fp64."""
    bits = c.view(torch.int16 if c.dtype.itemsize == 2 else torch.int32)
    return (bits + 1).view(c.dtype).double()


def _round_up_to_dtype(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest value of ``dtype`` >= ``q`` (fp64 in, fp64 out; q >= 0)."""
    c = q.to(dtype)
    return torch.where(c.double() < q, _bump(c), c.double())


@register_codec
@dataclass(frozen=True, kw_only=True)
class IntCodec(Codec):
    """Symmetric b-bit integers with one scale per block, scale rounded up.

    Error bound per element of a block with stored scale ``S`` (``qmax = 2^(bits-1) - 1``,
    ``δ = 2^(floor(log2 qmax) - 24)`` for the fp32 rounding of ``x / S``; ``ε = qmax·S·2^-24 +
    2^-150`` when ``scale_format="fp32"``, else 0, for the fp32 rounding of ``code * S``)::

        nearest:     |x̂ - x| <= S * (1/2 + δ) + ε
        stochastic:  |x̂ - x| <= S * (1 + δ) + ε,   E[x̂ - x] = 0 up to S * (δ + 2^-24),
                     E[(x̂ - x)^2] <= (S * (1/2 + δ) + ε)^2 + S^2 * 2^-23
    """

    codec_id: ClassVar[str] = "int"
    kernel_family: ClassVar[str | None] = "intq"  # dynamiq/kernels/_declared.py
    presets: ClassVar[dict[str, dict[str, Any]]] = {f"int{b}": {"bits": b} for b in range(2, 9)}
    nonfinite: ClassVar[str] = "A block holding NaN or ±Inf gets a NaN scale and decodes to NaN."

    bits: int = 8
    block_size: int = 32
    rounding: str = "nearest"
    scale_format: str = "bf16"

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 2, 8)
        check_int("block_size", self.block_size, 2, 1 << 20)
        check_choice("rounding", self.rounding, ("nearest", "stochastic"))
        check_choice("scale_format", self.scale_format, SCALE_FORMATS)

    def __repr__(self) -> str:
        return (
            f"IntCodec(bits={self.bits}, block_size={self.block_size}, "
            f"rounding={self.rounding!r}, scale_format={self.scale_format!r})"
        )

    @property
    def max_input_abs(self) -> float:
        # up to 2^127, so that code * S stays finite; fp16 scales cap at 65504 * qmax
        return min(65504.0 * self.qmax, 2.0**127) if self.scale_format == "fp16" else 2.0**127

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def _nblocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return self._nblocks(numel) * _SCALE_BYTES[self.scale_format] + packed_nbytes(
            numel, self.bits
        )

    # -- scales -----------------------------------------------------------------------------

    def _scales(self, absmax: torch.Tensor) -> torch.Tensor:
        """Stored scales (fp32, exact in the scale format) from block absmax (NaN passes)."""
        a = absmax.double()
        q = a / self.qmax
        if self.scale_format == "e8m0":
            m, e = torch.frexp(q)  # q = m * 2^e, m in [0.5, 1): ceil(log2 q) = e - [m == 0.5]
            e = torch.where(m == 0.5, e - 1, e)
            e = torch.where(q > 0, e, -127).clamp(min=-127)
            s = torch.exp2(e.double())
        else:
            s = _round_up_to_dtype(q, _SCALE_DTYPE[self.scale_format])
        s = torch.where(s * self.qmax < a, _next_up(s, self.scale_format), s)
        finite_a = torch.isfinite(a)
        if bool((finite_a & (a > self.max_input_abs)).any()):
            worst = float(a[finite_a].max())
            raise ValueError(
                f"int codec: a block absmax of {worst!r} exceeds max_input_abs="
                f"{self.max_input_abs!r}: its scale is beyond scale_format="
                f"{self.scale_format!r}; use a wider scale_format ('fp32')"
            )
        return torch.where(finite_a, s, torch.nan).float()

    def _pack_scales(self, s: torch.Tensor) -> torch.Tensor:
        if self.scale_format == "e8m0":
            return FLOAT8_E8M0FNU.encode(s)
        dtype = _SCALE_DTYPE[self.scale_format]
        bits = s.to(dtype).view(torch.int16 if dtype.itemsize == 2 else torch.int32)
        # NaN scales are written as the format's canonical quiet NaN: torch's casts write
        # device- and layout-dependent NaN bits (0xffff or 0x7fc0 for bf16 on one CPU)
        bits = torch.where(torch.isnan(s), _CANONICAL_NAN[self.scale_format], bits)
        return bits.view(torch.uint8)

    def _unpack_scales(self, raw: torch.Tensor) -> torch.Tensor:
        if self.scale_format == "e8m0":
            return FLOAT8_E8M0FNU.decode(raw)
        return raw.view(_SCALE_DTYPE[self.scale_format]).float()

    # -- encode / decode --------------------------------------------------------------------

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        n = x.numel()
        xf = x.float()
        scales = self._scales(block_absmax(xf, self.block_size))
        s_elem = scales.repeat_interleave(self.block_size)[:n]
        safe = torch.where((s_elem > 0) & torch.isfinite(s_elem), s_elem, 1.0)
        q = torch.where(s_elem > 0, xf / safe, 0.0)
        if self.rounding == "nearest":
            code = torch.round(q)
        else:
            keys = hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
            idx = torch.arange(n, device=x.device, dtype=torch.int64) + ctx.offset
            u = uniform_open01(hash_u32(idx, keys))
            fl = torch.floor(q)
            code = fl + (u < q - fl).float()
        code = torch.where(torch.isfinite(code), code, 0.0).to(torch.int64) & 0xFF
        stream = pack_bits(code.to(torch.uint8), self.bits)
        return torch.cat([self._pack_scales(scales), stream])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        nb = self._nblocks(numel)
        sb = nb * _SCALE_BYTES[self.scale_format]
        scales = self._unpack_scales(payload[:sb])
        raw = unpack_bits(payload[sb:], self.bits, numel).to(torch.int64)
        half = 1 << (self.bits - 1)
        code = torch.where(raw >= half, raw - (1 << self.bits), raw)
        return code.float() * scales.repeat_interleave(self.block_size)[:numel]

    # -- error bound ------------------------------------------------------------------------

    @property
    def error_bound(self) -> ErrorBound:
        qmax = self.qmax
        delta = 2.0 ** (qmax.bit_length() - 1 - 24)
        fp32_scale = self.scale_format == "fp32"
        stochastic = self.rounding == "stochastic"
        width = 1.0 if stochastic else 0.5

        def scale_of(x: torch.Tensor) -> torch.Tensor:
            s = self._scales(block_absmax(x.float(), self.block_size)).double()
            return s.repeat_interleave(self.block_size)[: x.numel()]

        def eps(s: torch.Tensor) -> torch.Tensor | float:
            return qmax * s * 2.0**-24 + 2.0**-150 if fp32_scale else 0.0

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            s = scale_of(x)
            return s * (width + delta) + eps(s)

        def var(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            s = scale_of(x)
            return (s * (0.5 + delta) + eps(s)).square() + s.square() * 2.0**-23

        def witness(numel: int) -> torch.Tensor:
            # power-of-two scale 2^-3: exact in every scale format; elements sit on ties
            # (nearest) or 3/4 past an integer (stochastic rounds down w.p. 1/4: error 3S/4)
            k = torch.arange(numel, dtype=torch.float64)
            frac = 0.75 if stochastic else 0.5
            x = (torch.remainder(k, max(qmax, 1)) + frac) * 2.0**-3
            x = torch.where(torch.remainder(k, self.block_size) == 0, qmax * 2.0**-3, x)
            return (x * torch.where(k % 3 == 0, -1.0, 1.0)).float()

        s_txt = f"S = roundup_{self.scale_format}(absmax / qmax)"
        e_txt = " + qmax·S·2^-24 + 2^-150" if fp32_scale else ""
        formula = f"S·({'1' if stochastic else '1/2'} + 2^{qmax.bit_length() - 25}){e_txt}, {s_txt}"
        return ErrorBound(
            formula=formula,
            unbiased=stochastic,
            max_abs=max_abs,
            witness=witness,
            var=var if stochastic else None,
        )


def _next_up(s: torch.Tensor, scale_format: str) -> torch.Tensor:
    """The next value of the scale format above ``s`` (fp64 in/out, s >= 0)."""
    if scale_format == "e8m0":
        return s * 2.0
    return _bump(s.to(_SCALE_DTYPE[scale_format]))
