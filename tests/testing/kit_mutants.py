"""Broken codecs the test kit must fail (tests/testing/test_kit_catches.py): each is a real
codec with one defect, or a toy with one, as a plugin author might write it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dynamiq.codecs import Codec, ErrorBound, HopContext, IntCodec
from dynamiq.codecs import registry as reg


@contextmanager
def registered(*classes: type[Codec]) -> Iterator[None]:
    """Register codec classes for the duration (the kit's config check looks them up)."""
    for cls in classes:
        reg.register_codec(cls)
    try:
        yield
    finally:
        for cls in classes:
            reg._REGISTRY.pop(cls.codec_id, None)


def one_ulp_less(bound: ErrorBound) -> ErrorBound:
    """``bound`` with every finite per-element value one fp64 ulp smaller (0 stays 0, and
    an infinite bound, of a value that decodes to NaN, stays infinite)."""

    def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        b = bound.max_abs_error(x, ctx)
        return torch.where(torch.isfinite(b), torch.nextafter(b, torch.zeros_like(b)), b)

    return dataclasses.replace(bound, max_abs=max_abs, formula=bound.formula + " - 1 ulp")


@dataclass(frozen=True, kw_only=True)
class Shrunk(Codec):
    """A registered codec (``inner``, by name) whose bound is one ulp too small."""

    codec_id: ClassVar[str] = "_kit_shrunk"
    inner: str = "bf16"

    def _codec(self) -> Codec:
        return reg.get_codec(self.inner)

    @property
    def block_size(self) -> int:
        return self._codec().block_size

    @property
    def max_input_abs(self) -> float:
        return self._codec().max_input_abs

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int | None:
        return self._codec().encoded_nbytes(numel, ctx)

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        return self._codec().encode(x, ctx)

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        return self._codec().decode(payload, numel, ctx)

    def prologue(self, x: torch.Tensor, comm: Any) -> dict[str, Any] | None:
        own = getattr(self._codec(), "prologue", None)
        return own(x, comm) if callable(own) else None

    @property
    def error_bound(self) -> ErrorBound:
        return one_ulp_less(self._codec().error_bound)


@dataclass(frozen=True, kw_only=True)
class HalfUlpInt(IntCodec):
    """INT (nearest) whose bound forgets its fp32 slack and is one ulp below ``S/2``: the
    error on a tie is exactly ``S/2``, so the bound is unsound by one ulp there."""

    codec_id: ClassVar[str] = "_kit_half_ulp_int"
    presets: ClassVar[dict[str, Any]] = {}

    @property
    def error_bound(self) -> ErrorBound:
        true = super().error_bound
        delta = 2.0 ** (self.qmax.bit_length() - 1 - 24)

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            half_s = true.max_abs_error(x, ctx) / (1 + 2 * delta)  # S/2, exactly
            return torch.nextafter(half_s, torch.zeros_like(half_s))

        return dataclasses.replace(true, max_abs=max_abs, formula="S/2 - 1 ulp")


@dataclass(frozen=True, kw_only=True)
class WrongSize(IntCodec):
    """INT whose ``encoded_nbytes`` declares one byte more than it writes."""

    codec_id: ClassVar[str] = "_kit_wrong_size"
    presets: ClassVar[dict[str, Any]] = {}

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return super().encoded_nbytes(numel, ctx) + 1


_QMAX = 127
_NAN_CODE = -128


@dataclass(frozen=True, kw_only=True)
class PerTensorScale(Codec):
    """A toy like the NVFP4 plugin's per-tensor scale: one fp32 scale ``S = absmax / 127``
    (rounded up; absmax over the finite values of the *whole input*), then an int8 code per
    value (-128: NaN/Inf). Sound, tight and deterministic, but not block-local: a piece the
    engine encodes apart gets its own scale, so the result depends on ``sub_chunk``."""

    codec_id: ClassVar[str] = "_kit_per_tensor_scale"
    nonfinite: ClassVar[str] = "NaN/Inf decode to NaN."
    block_size: int = 16

    @property
    def max_input_abs(self) -> float:
        return 2.0**127  # 127·S stays finite

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return 4 + numel

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        finite = torch.isfinite(xf)
        absmax = torch.where(finite, xf.abs(), 0.0).amax() if xf.numel() else xf.new_zeros(())
        s = absmax / _QMAX
        return torch.where(s * _QMAX < absmax, torch.nextafter(s, s.new_tensor(torch.inf)), s)

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        s = self._scale(x)
        xf = x.float()
        q = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
        codes = torch.round(q).clamp(-_QMAX, _QMAX)
        codes = torch.where(torch.isfinite(xf), codes, float(_NAN_CODE)).to(torch.int8)
        return torch.cat([s.reshape(1).view(torch.uint8), codes.view(torch.uint8)])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        s = payload[:4].clone().view(torch.float32)
        codes = payload[4:].view(torch.int8).float()
        return torch.where(codes == _NAN_CODE, torch.nan, codes * s)

    @property
    def error_bound(self) -> ErrorBound:
        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            s = self._scale(x).double()
            # half a step, the fp32 rounding of x / S and of code * S
            b = s * (0.5 + _QMAX * 2.0**-23) + 2.0**-149
            return torch.where(torch.isfinite(x), b, torch.inf).double().expand(x.shape).clone()

        def witness(numel: int) -> torch.Tensor:
            k = torch.arange(numel, dtype=torch.float64)
            x = (torch.remainder(k, _QMAX) + 0.5) * 2.0**-4
            return torch.where(k == 0, _QMAX * 2.0**-4, x).float()

        return ErrorBound(
            formula="S·(1/2 + 127·2^-23) + 2^-149", unbiased=False, max_abs=max_abs, witness=witness
        )
