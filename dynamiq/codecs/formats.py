"""Element formats as data (docs/design.md, "House style", items 1-2, and
"Codec sources").

An :class:`ElementFormat` is one frozen record ``(name, nexp, nmant, bias, specials)`` with
finfo-style metadata (``bits, nexp, nmant, max, tiny, smallest_subnormal, eps``). Encoding
(fp32 → code, round-to-nearest-even) works on the fp32 bit pattern with integer operations
only; decoding is a lookup in a table of all ``2**bits`` values, itself built with integer
operations. No float8 cast is used anywhere, so the same arithmetic runs in a Triton kernel.

Codes are returned as ``uint8`` tensors holding the code in the low ``bits`` bits (sign in
bit ``bits - 1`` for signed formats), exactly as ``ml_dtypes`` stores them.

>>> import torch
>>> FLOAT4_E2M1FN.encode(torch.tensor([0.25, 0.75, 5.0, 7.0, -6.0]))
tensor([ 0,  2,  6,  7, 15], dtype=torch.uint8)
>>> FLOAT4_E2M1FN.decode(torch.tensor([1, 7, 9], dtype=torch.uint8))
tensor([ 0.5000,  6.0000, -0.5000])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "ELEMENT_FORMATS",
    "FLOAT4_E2M1FN",
    "FLOAT6_E2M3FN",
    "FLOAT6_E3M2FN",
    "FLOAT8_E4M3FN",
    "FLOAT8_E5M2",
    "FLOAT8_E8M0FNU",
    "INT8",
    "ElementFormat",
    "exponent_of",
    "get_format",
]

Specials = Literal["ieee", "fn", "none", "fnu", "int"]


def exponent_of(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(|x|))`` of fp32 values as int64, from the bit pattern (integer ops).

    Zero gives -150 (below every subnormal); NaN/Inf give 128.
    """
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    e = bits >> 23
    m = bits & 0x7FFFFF
    # subnormal fp32: the exponent of the mantissa's leading bit (exact int -> float of < 2^23)
    sub = (m.to(torch.float32).view(torch.int32).to(torch.int64) >> 23) - 127 - 149
    out = torch.where(e > 0, e - 127, sub)
    return torch.where(bits == 0, torch.full_like(out, -150), out)


@dataclass(frozen=True)
class ElementFormat:
    """A scalar number format: sign, ``nexp`` exponent bits, ``nmant`` mantissa bits.

    Attributes:
        name: industry name (``float8_e4m3fn``, ...; ``int8`` is MXINT8's element).
        nexp: exponent bits (0 for ``int8``).
        nmant: mantissa bits (for ``int8``: fraction bits, value = code * 2**-nmant).
        ibits: integer bits of a fixed-point (``"int"``) format; 0 for floats.
        bias: exponent bias.
        specials: ``"ieee"`` (all-ones exponent is Inf/NaN), ``"fn"`` (only S.1111.111 is NaN),
            ``"none"`` (every code finite), ``"fnu"`` (unsigned, no zero, all-ones NaN: E8M0),
            ``"int"`` (two's complement, symmetric: -2**(bits-1) is unused).
    """

    name: str
    nexp: int
    nmant: int
    bias: int
    specials: Specials
    ibits: int = 0

    # -- finfo-style metadata ---------------------------------------------------------------

    @property
    def signed(self) -> bool:
        return self.specials != "fnu"

    @property
    def bits(self) -> int:
        return self.nexp + self.ibits + self.nmant + (1 if self.signed else 0)

    @property
    def max_code(self) -> int:
        """Largest finite magnitude code (sign bit clear)."""
        if self.specials == "ieee":
            return ((1 << self.nexp) - 1 << self.nmant) - 1
        if self.specials == "fn":
            return (1 << (self.nexp + self.nmant)) - 2
        if self.specials == "fnu":
            return 0xFE
        return (1 << (self.bits - 1)) - 1

    @property
    def nan_code(self) -> int | None:
        if self.specials in ("ieee", "fn"):
            return (1 << (self.nexp + self.nmant)) - 1
        if self.specials == "fnu":
            return 0xFF
        return None

    @property
    def inf_code(self) -> int | None:
        return ((1 << self.nexp) - 1) << self.nmant if self.specials == "ieee" else None

    @property
    def max(self) -> float:
        """Largest finite value."""
        return float(self.decode_table()[self.max_code])

    @property
    def tiny(self) -> float:
        """Smallest positive normal value (``smallest_normal``)."""
        if self.specials == "int":
            return 2.0**-self.nmant
        if self.specials == "fnu":
            return 2.0 ** (-self.bias)
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        if self.specials in ("int", "fnu"):
            return self.tiny
        return 2.0 ** (1 - self.bias - self.nmant)

    @property
    def eps(self) -> float:
        """Difference between 1.0 and the next representable value."""
        if self.specials == "int":
            return 2.0**-self.nmant
        return 2.0**-self.nmant if self.nmant else 1.0

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value, ``floor(log2(max))``."""
        return self._emax()

    @functools.cache  # noqa: B019 - formats are a handful of frozen module constants
    def _emax(self) -> int:
        # cached: the kernels' launchers read it on every call (a tensor op each time)
        return int(exponent_of(torch.tensor([self.max])).item())

    # -- decode -----------------------------------------------------------------------------

    @functools.cache  # noqa: B019 - formats are a handful of frozen module constants
    def decode_table(self) -> torch.Tensor:
        """fp32 value of every code ``0 .. 2**bits - 1`` (built with integer operations)."""
        code = torch.arange(1 << self.bits, dtype=torch.int64)
        if self.specials == "int":
            # two's complement; the encoder never writes -2^(bits-1), which decodes as such
            q = torch.where(code >= 1 << (self.bits - 1), code - (1 << self.bits), code)
            return q.to(torch.float32) * 2.0**-self.nmant  # exact: |q| <= 2^7, power-of-two
        if self.specials == "fnu":
            # 2^(c - 127) has fp32 biased exponent c; c = 0 is fp32's subnormal 2^-127
            bits32 = torch.where(code == 0, 1 << 22, code.clamp(max=0xFE) << 23)
            out = bits32.to(torch.int32).view(torch.float32).clone()
            out[0xFF] = float("nan")
            return out
        mag = code & ((1 << (self.nexp + self.nmant)) - 1)
        sign = (code >> (self.nexp + self.nmant)) & 1
        bexp = mag >> self.nmant
        man = mag & ((1 << self.nmant) - 1)
        normal = ((bexp - self.bias + 127) << 23) | (man << (23 - self.nmant))
        # subnormal: man * 2^(1 - bias - nmant), normalised by the leading bit of man
        lead = exponent_of(man.to(torch.float32)).clamp(min=0)
        sub_bits = ((lead + 1 - self.bias - self.nmant + 127) << 23) | (
            (man - (1 << lead)) << (23 - lead)
        )
        mbits = torch.where(bexp > 0, normal, torch.where(man > 0, sub_bits, 0))
        out32 = mbits | (sign << 31)
        out = torch.where(out32 >= 1 << 31, out32 - (1 << 32), out32)
        vals = out.to(torch.int32).view(torch.float32).clone()
        if self.inf_code is not None:
            vals[self.inf_code] = float("inf")
            vals[self.inf_code | 1 << (self.bits - 1)] = float("-inf")
            nan_mask = (mag > self.inf_code) & (mag <= (1 << (self.nexp + self.nmant)) - 1)
            vals[nan_mask] = float("nan")
        elif self.nan_code is not None:
            vals[self.nan_code] = float("nan")
            vals[self.nan_code | 1 << (self.bits - 1)] = float("nan")
        return vals

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 values of ``codes`` (any integer dtype)."""
        table = self.decode_table().to(codes.device)
        return table[codes.to(torch.int64)]

    # -- encode -----------------------------------------------------------------------------

    def encode(
        self,
        x: torch.Tensor,
        scale_exp: torch.Tensor | int = 0,
        *,
        saturate: bool = True,
    ) -> torch.Tensor:
        """Codes of ``x * 2**-scale_exp``, rounded to nearest, ties to even.

        The power-of-two scale is applied to the exponent field, so there is one rounding
        only. Finite values beyond ``max`` saturate to ``±max`` when ``saturate`` (the MX
        rule); otherwise they become Inf where the format has it, else NaN (as ``ml_dtypes``
        casts do). NaN becomes the format's NaN; in formats without NaN it becomes +0 (MX
        marks such blocks NaN through the scale). ±Inf becomes ±Inf, or ±max where the format
        has no Inf and ``saturate``, or NaN.

        ``float8_e8m0fnu`` (unsigned, no zero): negative values, NaN and ±Inf become NaN
        (``0xFF``); zero and values below 2^-127 become the smallest code 2^-127 (``0x00``).
        """
        bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
        sign = (bits >> 31) & 1
        a = bits & 0x7FFFFFFF
        e = a >> 23
        m = a & 0x7FFFFF
        # normalise: value = sig * 2^(ue - 23) with sig in [2^23, 2^24) (or sig = 0)
        ue = exponent_of(x) - scale_exp
        lead = torch.where(e > 0, 23, exponent_of(m.to(torch.float32)).clamp(min=0))
        sig = torch.where(e > 0, m | 0x800000, m << (23 - lead))
        nonfinite = a >= 0x7F800000
        if self.specials == "int":
            mag = self._round_int(sig, ue)
        elif self.specials == "fnu":
            mag = self._round_exponent(sig, ue)
        else:
            mag = self._round_float(sig, ue)
        mag = torch.where(a == 0, 0, mag)
        over = mag > self.max_code
        big = torch.full_like(mag, self.max_code)
        if saturate or (self.inf_code is None and self.nan_code is None):
            mag = torch.where(over, big, mag)
        elif self.inf_code is not None:
            mag = torch.where(over, self.inf_code, mag)
        else:
            mag = torch.where(over, self.nan_code, mag)  # type: ignore[arg-type]
        isinf = a == 0x7F800000
        if self.inf_code is not None:
            mag = torch.where(isinf, self.inf_code, mag)
        elif saturate or self.nan_code is None:
            mag = torch.where(isinf, big, mag)
        else:
            mag = torch.where(isinf, self.nan_code, mag)
        isnan = a > 0x7F800000
        mag = torch.where(isnan, 0 if self.nan_code is None else self.nan_code, mag)
        if self.specials == "fnu":
            code = torch.where((sign == 1) & (a > 0) | nonfinite, 0xFF, mag)
        elif self.specials == "int":
            code = torch.where(sign == 1, (-mag) & 0xFF, mag)
            code = torch.where(isnan, 0, code)
        else:
            code = mag | (sign << (self.bits - 1))
        return code.to(torch.uint8)

    def _round_float(self, sig: torch.Tensor, ue: torch.Tensor) -> torch.Tensor:
        # target biased exponent; below the normal range the shift grows (subnormals)
        bexp = ue + self.bias
        extra = (1 - bexp).clamp(min=0)
        shift = (23 - self.nmant + extra).clamp(max=25)
        r = _rne_shift(sig, shift)
        # a carry out of the mantissa (r == 2^(nmant+1)) bumps the exponent by itself
        mag = ((bexp - 1).clamp(min=0) << self.nmant) + r
        return mag.clamp(max=self.max_code + 1)  # anything beyond is "overflow"

    def _round_exponent(self, sig: torch.Tensor, ue: torch.Tensor) -> torch.Tensor:
        # E8M0: no mantissa; 1.m x 2^e rounds up from m >= 0.5 (the tie goes up: q = 1 is odd)
        up = (sig >> 22) & 1
        code = ue + self.bias + up
        return code.clamp(min=0, max=self.max_code + 1)

    def _round_int(self, sig: torch.Tensor, ue: torch.Tensor) -> torch.Tensor:
        # value * 2^nmant = sig * 2^(ue - 23 + nmant): round at bit (23 - nmant - ue)
        shift = (23 - self.nmant - ue).clamp(min=1, max=25)
        big = ue > 23 - self.nmant - 1  # |value| * 2^nmant >= 2^23 : far beyond 127
        r = _rne_shift(sig, shift)
        return torch.where(big, self.max_code + 1, r).clamp(max=self.max_code + 1)


def _rne_shift(sig: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``sig >> shift`` rounded to nearest, ties to even (``shift`` in 1..63)."""
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(q.dtype)


FLOAT8_E4M3FN = ElementFormat("float8_e4m3fn", nexp=4, nmant=3, bias=7, specials="fn")
FLOAT8_E5M2 = ElementFormat("float8_e5m2", nexp=5, nmant=2, bias=15, specials="ieee")
FLOAT6_E3M2FN = ElementFormat("float6_e3m2fn", nexp=3, nmant=2, bias=3, specials="none")
FLOAT6_E2M3FN = ElementFormat("float6_e2m3fn", nexp=2, nmant=3, bias=1, specials="none")
FLOAT4_E2M1FN = ElementFormat("float4_e2m1fn", nexp=2, nmant=1, bias=1, specials="none")
FLOAT8_E8M0FNU = ElementFormat("float8_e8m0fnu", nexp=8, nmant=0, bias=127, specials="fnu")
#: MXINT8's element: 8-bit two's complement with an implicit scale of 2^-6, symmetric -127..127.
INT8 = ElementFormat("int8", nexp=0, nmant=6, bias=0, specials="int", ibits=1)

ELEMENT_FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        FLOAT8_E4M3FN,
        FLOAT8_E5M2,
        FLOAT6_E3M2FN,
        FLOAT6_E2M3FN,
        FLOAT4_E2M1FN,
        FLOAT8_E8M0FNU,
        INT8,
    )
}


def get_format(name: str) -> ElementFormat:
    """Look an element format up by name."""
    try:
        return ELEMENT_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown element format {name!r} (known: {', '.join(ELEMENT_FORMATS)})"
        ) from None
