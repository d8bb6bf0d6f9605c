"""Pass-through codecs ``fp32``, ``bf16`` and ``fp16`` (docs/design.md, "Codec sources").

Wire format: the values in the named IEEE format, little-endian, nothing else. ``bf16`` and
``fp16`` round to nearest-even; finite values beyond the format's largest value saturate to it
(so a finite gradient never becomes Inf); ±Inf stays ±Inf. Input already in the codec's
format is copied bit for bit; a converted NaN becomes the canonical quiet NaN (``0x7fc0``
bf16, ``0x7e00`` fp16, ``0x7fc00000`` fp32), the same on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, ErrorBound, HopContext
from .formats import exponent_of
from .registry import register_codec

__all__ = ["BF16Codec", "FP16Codec", "FP32Codec", "PassThroughCodec"]


@dataclass(frozen=True, kw_only=True)
class PassThroughCodec(Codec):
    """Values cast to an IEEE format: ``block_size`` 1, ``itemsize`` bytes per value.

    Error bound (per element, ``p`` = mantissa bits + 1, ``emin`` = exponent of the smallest
    normal, ``max`` = largest finite value)::

        |x̂ - x| <= max(2^(max(floor(log2|x|), emin) - p), |x| - max)

    i.e. half a unit in the last place, or the saturation error. 0 for ``fp32``.
    """

    dtype: ClassVar[torch.dtype]
    nonfinite: ClassVar[str] = "NaN stays NaN and ±Inf stays ±Inf."

    @property
    def block_size(self) -> int:
        return 1

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return numel * self.dtype.itemsize

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        if x.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        if x.dtype == self.dtype:
            y = x.clone()
        else:
            big = torch.finfo(self.dtype).max
            xf = x.float()
            y = torch.where(torch.isinf(xf), xf, xf.clamp(-big, big)).to(self.dtype)
            # NaN becomes the canonical quiet NaN: torch's casts write device- and
            # layout-dependent NaN bits (one CPU writes bf16 0xffff or 0x7fc0)
            ibits = y.view(torch.int32 if self.dtype == torch.float32 else torch.int16)
            y = torch.where(torch.isnan(xf), _CANONICAL_NAN[self.dtype], ibits).view(self.dtype)
        return y.contiguous().view(torch.uint8)

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=payload.device)
        return payload.view(self.dtype).float()

    @property
    def error_bound(self) -> ErrorBound:
        fi = torch.finfo(self.dtype)
        p = _NMANT[self.dtype]
        emin = int(math.log2(fi.tiny))
        big = float(fi.max)
        exact = self.dtype == torch.float32

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            a = x.detach().double().abs()
            if exact:
                return torch.zeros_like(a)
            e = exponent_of(x).clamp(min=emin).double()
            half_ulp = torch.exp2(e - (p + 1))
            return torch.maximum(half_ulp, a - big)

        def witness(numel: int) -> torch.Tensor:
            # 1 + half an ulp: exactly on a tie, rounds to even (down) with the full bound
            k = torch.arange(numel, dtype=torch.float64)
            x = (1.0 + 2.0 ** -(p + 1)) * torch.exp2(torch.remainder(k, 30) - 15)
            return x.float() * torch.where(k % 2 == 0, 1.0, -1.0)

        formula = "0" if exact else f"max(2^(max(floor(log2|x|), {emin}) - {p + 1}), |x| - {big:g})"
        return ErrorBound(formula=formula, unbiased=exact, max_abs=max_abs, witness=witness)


_NMANT = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
#: bits of the canonical quiet NaN of each format (as a signed integer)
_CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


@register_codec
@dataclass(frozen=True, kw_only=True)
class FP32Codec(PassThroughCodec):
    """Uncompressed fp32 (32 bits/value); exact."""

    codec_id: ClassVar[str] = "fp32"
    kernel_family: ClassVar[str | None] = "passthrough"  # dynamiq/kernels/_declared.py
    dtype: ClassVar[torch.dtype] = torch.float32


@register_codec
@dataclass(frozen=True, kw_only=True)
class BF16Codec(PassThroughCodec):
    """bfloat16 (16 bits/value), round-to-nearest-even, saturating."""

    codec_id: ClassVar[str] = "bf16"
    kernel_family: ClassVar[str | None] = "passthrough"  # dynamiq/kernels/_declared.py
    dtype: ClassVar[torch.dtype] = torch.bfloat16


@register_codec
@dataclass(frozen=True, kw_only=True)
class FP16Codec(PassThroughCodec):
    """IEEE float16 (16 bits/value), round-to-nearest-even, saturating at ±65504."""

    codec_id: ClassVar[str] = "fp16"
    kernel_family: ClassVar[str | None] = "passthrough"  # dynamiq/kernels/_declared.py
    dtype: ClassVar[torch.dtype] = torch.float16
