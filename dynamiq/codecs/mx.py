"""OCP Microscaling (MX v1.0) codecs (docs/design.md, "Codec sources").

An MX codec is data: "a block of 32 elements of format F sharing one ``float8_e8m0fnu`` scale".
Encoding a block follows the OCP reference conversion: ``amax = max|v|``; shared exponent
``floor(log2(amax)) - emax(F)`` clamped to the E8M0 range ``-127 .. 127`` (``amax = 0`` gives
the smallest scale); ``X = 2^shared``; each element is ``v / X`` rounded to nearest-even in F
with subnormals, saturating at ``±max(F)``. Decoding is ``X * element`` (exact in fp32).

Wire layout (little-endian): ``ceil(numel / 32)`` E8M0 scale bytes, then the ``numel`` element
codes packed densely at ``bits(F)`` bits each (``dynamiq.codecs.packing``: two fp4 codes a byte,
low nibble first; four fp6 codes in three bytes).

Non-finite input: a block holding NaN or ±Inf gets the NaN scale ``0xFF`` (its element codes
are 0) and decodes to NaN, as the OCP specification says.

MXINT8 follows Microsoft's reference emulation: symmetric codes ``-127 .. 127`` (``-128`` is
never written) with an implicit scale of 2^-6, so elements span ``-127/64 .. 127/64``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, ErrorBound, HopContext
from .formats import (
    FLOAT4_E2M1FN,
    FLOAT6_E2M3FN,
    FLOAT6_E3M2FN,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT8_E8M0FNU,
    INT8,
    ElementFormat,
    exponent_of,
)
from .intq import block_absmax
from .packing import pack_bits, packed_nbytes, unpack_bits
from .registry import register_codec

__all__ = ["MXFP4", "MXFP6E2M3", "MXFP6E3M2", "MXFP8E4M3", "MXFP8E5M2", "MXINT8", "MXCodec"]

MX_BLOCK = 32


@dataclass(frozen=True, kw_only=True)
class MXCodec(Codec):
    """OCP MX: blocks of 32 elements of ``element`` format with one E8M0 scale (floor rule).

    Error bound per element of a block with scale ``X = 2^clamp(floor(log2 absmax) - emax,
    -127, 127)``, ``ulp`` the spacing of the element format's top binade and ``max`` its
    largest value::

        |x̂ - x| <= X * max(ulp / 2, 2^(emax + 1) - max)

    (rounding in the top binade, or saturation of ``|v| / X < 2^(emax + 1)`` to ``max``).
    """

    element: ClassVar[ElementFormat]
    nonfinite: ClassVar[str] = (
        "A block holding NaN or ±Inf gets the NaN scale 0xFF and decodes to NaN (OCP rule)."
    )

    @property
    def block_size(self) -> int:
        return MX_BLOCK

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return -(-numel // MX_BLOCK) + packed_nbytes(numel, self.element.bits)

    def _shared_exp(self, absmax: torch.Tensor) -> torch.Tensor:
        """The OCP shared exponent of each block (int64; NaN/Inf blocks are flagged apart)."""
        return (exponent_of(absmax) - self.element.emax).clamp(-127, 127)

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        n = x.numel()
        xf = x.float()
        absmax = block_absmax(xf, MX_BLOCK)
        finite = torch.isfinite(absmax)
        shared = self._shared_exp(absmax)
        scale_codes = torch.where(finite, shared + 127, 0xFF).to(torch.uint8)
        shared_elem = shared.repeat_interleave(MX_BLOCK)[:n]
        codes = self.element.encode(xf, shared_elem, saturate=True)
        codes = torch.where(finite.repeat_interleave(MX_BLOCK)[:n], codes, 0)
        return torch.cat([scale_codes, pack_bits(codes, self.element.bits)])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        nb = -(-numel // MX_BLOCK)
        scales = FLOAT8_E8M0FNU.decode(payload[:nb])
        codes = unpack_bits(payload[nb:], self.element.bits, numel)
        return self.element.decode(codes) * scales.repeat_interleave(MX_BLOCK)[:numel]

    @property
    def error_bound(self) -> ErrorBound:
        fmt = self.element
        table = fmt.decode_table()
        finite = table[torch.isfinite(table) & (table >= 0)].double().unique()
        top_ulp = float(finite[-1] - finite[-2])
        sat = 2.0 ** (fmt.emax + 1) - fmt.max
        unit = max(top_ulp / 2, sat)

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            absmax = block_absmax(x.float(), MX_BLOCK)
            bound = torch.exp2(self._shared_exp(absmax).double()) * unit
            bound = torch.where(torch.isfinite(absmax), bound, torch.inf)
            return bound.repeat_interleave(MX_BLOCK)[: x.numel()]

        def witness(numel: int) -> torch.Tensor:
            # every block's absmax sits just below 2^(emax + 1) * X: it saturates to max
            k = torch.arange(numel, dtype=torch.float64)
            top = 2.0 ** (fmt.emax + 1) * (1 - 2.0**-12)
            x = torch.where(torch.remainder(k, MX_BLOCK) == 0, top, torch.cos(k) * fmt.max)
            x = x * torch.exp2(torch.remainder(torch.floor(k / MX_BLOCK), 40) - 20)
            return x.float()

        formula = f"X·{unit:g}, X = 2^clamp(floor(log2 absmax) - {fmt.emax}, -127, 127)"
        return ErrorBound(formula=formula, unbiased=False, max_abs=max_abs, witness=witness)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@register_codec
@dataclass(frozen=True, kw_only=True)
class MXFP8E4M3(MXCodec):
    """MXFP8 with E4M3 elements (8.25 bits/value)."""

    codec_id: ClassVar[str] = "mxfp8_e4m3"
    kernel_family: ClassVar[str | None] = "mx"  # dynamiq/kernels/_declared.py
    element: ClassVar[ElementFormat] = FLOAT8_E4M3FN


@register_codec
@dataclass(frozen=True, kw_only=True)
class MXFP8E5M2(MXCodec):
    """MXFP8 with E5M2 elements (8.25 bits/value)."""

    codec_id: ClassVar[str] = "mxfp8_e5m2"
    kernel_family: ClassVar[str | None] = "mx"  # dynamiq/kernels/_declared.py
    element: ClassVar[ElementFormat] = FLOAT8_E5M2


@register_codec
@dataclass(frozen=True, kw_only=True)
class MXFP6E3M2(MXCodec):
    """MXFP6 with E3M2 elements (6.25 bits/value)."""

    codec_id: ClassVar[str] = "mxfp6_e3m2"
    kernel_family: ClassVar[str | None] = "mx"  # dynamiq/kernels/_declared.py
    element: ClassVar[ElementFormat] = FLOAT6_E3M2FN


@register_codec
@dataclass(frozen=True, kw_only=True)
class MXFP6E2M3(MXCodec):
    """MXFP6 with E2M3 elements (6.25 bits/value)."""

    codec_id: ClassVar[str] = "mxfp6_e2m3"
    kernel_family: ClassVar[str | None] = "mx"  # dynamiq/kernels/_declared.py
    element: ClassVar[ElementFormat] = FLOAT6_E2M3FN


@register_codec
@dataclass(frozen=True, kw_only=True)
class MXFP4(MXCodec):
    """MXFP4 with E2M1 elements (4.25 bits/value)."""

    codec_id: ClassVar[str] = "mxfp4"
    kernel_family: ClassVar[str | None] = "mx"  # dynamiq/kernels/_declared.py
    element: ClassVar[ElementFormat] = FLOAT4_E2M1FN


@register_codec
@dataclass(frozen=True, kw_only=True)
class MXINT8(MXCodec):
    """MXINT8: symmetric int8 elements with an implicit 2^-6 (8.25 bits/value)."""

    codec_id: ClassVar[str] = "mxint8"
    kernel_family: ClassVar[str | None] = "mx"  # dynamiq/kernels/_declared.py
    element: ClassVar[ElementFormat] = INT8
