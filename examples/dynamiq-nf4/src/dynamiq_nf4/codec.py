"""The NF4 codec: 16 normal-quantile levels, one absmax scale per block, 4-bit codes.

NF4 ("4-bit NormalFloat", Dettmers et al., *QLoRA*, 2023, section 3) spends its 16 codes on
levels placed at quantiles of the standard normal distribution, so that values drawn from a
bell-shaped distribution land on every code about equally often. Here it is a gradient codec.

Levels (:func:`nf4_levels`): with ``Φ⁻¹`` the standard normal quantile function and
``δ = 1 - (1/30 + 1/32) / 2`` (the mean of ``1 - 1/(2·15)`` and ``1 - 1/(2·16)``: the top
quantile probability, which keeps ``Φ⁻¹`` finite), the raw levels are

* ``Φ⁻¹(δ + (1/2 - δ)·i/8)`` for ``i = 0..7`` (8 positive levels),
* ``0``,
* ``-Φ⁻¹(δ + (1/2 - δ)·i/7)`` for ``i = 0..6`` (7 negative levels),

divided by ``Φ⁻¹(δ)`` so that they span exactly ``[-1, 1]``, sorted, and rounded to fp32.
Code ``k`` (0..15) means the ``k``-th smallest level: code 0 is -1, code 7 is 0, code 15 is 1.

Encoding a block of ``block_size`` values: the scale ``S`` is the block's absmax rounded *up*
to the scale format (``bf16`` by default, or ``fp32``, where it is exact), so ``|x / S| <= 1``
and no value is ever clamped; each value gets the code of the level nearest to
``q = fl32(x / S)``, decided by exact comparison with the midpoints of consecutive levels
(computed in fp64, where they are exact); a value exactly on a midpoint gets the lower level.
Decoding is ``fl32(level[code] · S)``.

Wire layout (little-endian): ``ceil(numel / block_size)`` scales (2 bytes each for ``bf16``,
4 for ``fp32``), then the ``numel`` 4-bit codes, two per byte, element ``2i`` in the low nibble
and ``2i + 1`` in the high nibble; an odd count leaves the last high nibble 0.

Non-finite input: a block holding NaN or ±Inf gets a NaN scale (the canonical quiet NaN,
``0x7fc0`` bf16 or ``0x7fc00000`` fp32), its codes are those of 0 (``0x7``), and it decodes to
NaN. An all-zero block gets scale 0 and decodes to zeros. With ``bf16`` scales a block whose
absmax exceeds the largest bf16 value (``max_input_abs``) raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import ClassVar

import torch

from dynamiq.codecs import Codec, ErrorBound, HopContext
from dynamiq.codecs.base import FP32_MAX

__all__ = ["NF4_LEVELS", "NF4_OFFSET", "NF4Codec", "nf4_levels"]

#: the top quantile probability δ: the mean of 1 - 1/(2·15) and 1 - 1/(2·16)
NF4_OFFSET = 1.0 - (1.0 / 30.0 + 1.0 / 32.0) / 2.0  # 0.9677083333333334

#: largest finite bfloat16 value (the largest bf16 scale)
BF16_MAX = float.fromhex("0x1.fep127")  # 3.3895313892515355e38

SCALE_FORMATS = ("bf16", "fp32")
_SCALE_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SCALE_INT = {"bf16": torch.int16, "fp32": torch.int32}
#: the bits a NaN scale is written as: the canonical quiet NaN (as a signed integer)
_CANONICAL_NAN = {"bf16": 0x7FC0, "fp32": 0x7FC00000}
_MAX_BLOCK = 1 << 20


def nf4_levels() -> tuple[float, ...]:
    """The 16 NF4 levels in increasing order, as fp32 values (see the module docstring).

    >>> levels = nf4_levels()
    >>> len(levels), levels[0], levels[7], levels[15]
    (16, -1.0, 0.0, 1.0)
    """
    phi_inv = NormalDist().inv_cdf
    positive = [phi_inv(NF4_OFFSET + (0.5 - NF4_OFFSET) * i / 8) for i in range(8)]
    negative = [-phi_inv(NF4_OFFSET + (0.5 - NF4_OFFSET) * i / 7) for i in range(7)]
    top = phi_inv(NF4_OFFSET)
    raw = sorted([*negative, 0.0, *positive])
    return tuple(torch.tensor([v / top for v in raw], dtype=torch.float32).tolist())


#: the levels, computed once at import
NF4_LEVELS: tuple[float, ...] = nf4_levels()
_LEVELS = torch.tensor(NF4_LEVELS, dtype=torch.float32)
# decision thresholds: the exact midpoints of consecutive levels (fp32 + fp32 is exact in fp64)
_MIDPOINTS = (_LEVELS[:-1].double() + _LEVELS[1:].double()) / 2
# the largest distance from a point of [-1, 1] to its nearest level: half the widest gap
_HALF_GAP = float((_LEVELS[1:].double() - _LEVELS[:-1].double()).max()) / 2


def _check_config(block_size: object, scale_format: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(
            f"block_size must be an int (got {type(block_size).__name__} {block_size!r})"
        )
    if not 2 <= block_size <= _MAX_BLOCK:
        raise ValueError(f"block_size must be in 2..{_MAX_BLOCK} (got {block_size})")
    if scale_format not in SCALE_FORMATS:
        choices = ", ".join(map(repr, SCALE_FORMATS))
        raise ValueError(f"scale_format must be one of {choices} (got {scale_format!r})")


def _block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 absmax of each block (the last may be short); NaN if it holds NaN, Inf for Inf."""
    n = x.numel()
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(nb, block_size).abs().amax(dim=1)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte, element 2i in the low nibble."""
    c = codes.to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    return (c[0::2] | (c[1::2] << 4)).contiguous()


def _unpack_nibbles(stream: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles`: ``numel`` codes (int64)."""
    s = stream.to(torch.int64)
    return torch.stack([s & 0xF, s >> 4], dim=1).reshape(-1)[:numel]


@dataclass(frozen=True, kw_only=True)
class NF4Codec(Codec):
    """NF4: 4-bit indices into 16 normal-quantile levels, one absmax scale per block.

    ``block_size`` (default 64, as in QLoRA) values share one scale in ``scale_format``
    (``"bf16"``, default: 4.25 bits/value; or ``"fp32"``: 4.5 bits/value).

    Error bound per element of a block with stored scale ``S`` (``S >= absmax``; ``g`` the
    widest gap between consecutive levels, 0.3038, between -1 and the next level)::

        |x̂ - x| <= S·(g/2 + 2^-25 + 2^-24) + 2^-150

    ``g/2`` for rounding to the nearest level, ``2^-25·S`` for the fp32 rounding of ``x / S``
    (at most 1 in magnitude), ``2^-24·S + 2^-150`` for the fp32 rounding of ``level · S``.
    Deterministic (nearest rounding), hence biased.

    >>> codec = NF4Codec()
    >>> codec.bits_per_value()
    4.25
    >>> x = torch.tensor([2.0, -1.0, 0.5, 0.0])  # scale 2: levels -0.525 and 0.246 are nearest
    >>> [round(v, 4) for v in codec.decode(codec.encode(x), 4).tolist()]
    [2.0, -1.0501, 0.4922, 0.0]
    """

    codec_id: ClassVar[str] = "nf4"
    nonfinite: ClassVar[str] = (
        "A block holding NaN or ±Inf gets a NaN scale and decodes to NaN; other blocks are "
        "unaffected."
    )

    block_size: int = 64
    scale_format: str = "bf16"

    def __post_init__(self) -> None:
        _check_config(self.block_size, self.scale_format)

    # -- geometry ---------------------------------------------------------------------------

    @property
    def max_input_abs(self) -> float:
        """bf16 scales reach the largest bf16 value; fp32 scales all of fp32."""
        return BF16_MAX if self.scale_format == "bf16" else FP32_MAX

    def _scale_bytes(self) -> int:
        return 2 if self.scale_format == "bf16" else 4

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        """Scales, then two codes a byte: ``ceil(n / block_size)·2 + ceil(n / 2)`` (bf16)."""
        return -(-numel // self.block_size) * self._scale_bytes() + (numel + 1) // 2

    # -- scales -----------------------------------------------------------------------------

    def _scales(self, absmax: torch.Tensor) -> torch.Tensor:
        """Stored scales, fp32 (exact in the scale format): absmax rounded up; NaN for blocks
        holding NaN/Inf. Raises for a finite absmax beyond ``max_input_abs``."""
        finite = torch.isfinite(absmax)
        too_big = finite & (absmax > self.max_input_abs)
        if bool(too_big.any()):
            worst = float(absmax[too_big].max())
            raise ValueError(
                f"nf4 codec: a block absmax of {worst!r} exceeds max_input_abs="
                f"{self.max_input_abs!r} of scale_format={self.scale_format!r}; "
                "use scale_format='fp32'"
            )
        s = torch.where(finite, absmax, 0.0)
        if self.scale_format == "bf16":
            c = s.to(torch.bfloat16)  # nearest; then one step up where that fell below absmax
            up = (c.view(torch.int16) + 1).view(torch.bfloat16)
            s = torch.where(c.float() < s, up, c).float()
        return torch.where(finite, s, torch.nan)

    def _pack_scales(self, scales: torch.Tensor) -> torch.Tensor:
        bits = scales.to(_SCALE_DTYPE[self.scale_format]).view(_SCALE_INT[self.scale_format])
        nan_bits = _CANONICAL_NAN[self.scale_format]
        return torch.where(torch.isnan(scales), nan_bits, bits).view(torch.uint8)

    def _unpack_scales(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.clone().view(_SCALE_DTYPE[self.scale_format]).float()

    # -- encode / decode --------------------------------------------------------------------

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        n = x.numel()
        xf = x.float()
        scales = self._scales(_block_absmax(xf, self.block_size))
        s = scales.repeat_interleave(self.block_size)[:n]
        usable = (s > 0) & torch.isfinite(s)
        q = torch.where(usable, xf / torch.where(usable, s, 1.0), 0.0)
        # the number of midpoints strictly below q: the nearest level, ties to the lower one
        codes = torch.searchsorted(_MIDPOINTS.to(x.device), q.double())
        return torch.cat([self._pack_scales(scales), _pack_nibbles(codes)])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        nb = -(-numel // self.block_size)
        scales = self._unpack_scales(payload[: nb * self._scale_bytes()])
        codes = _unpack_nibbles(payload[nb * self._scale_bytes() :], numel)
        levels = _LEVELS.to(payload.device)[codes]
        return levels * scales.repeat_interleave(self.block_size)[:numel]

    # -- error bound ------------------------------------------------------------------------

    @property
    def error_bound(self) -> ErrorBound:
        """``S·(g/2 + 2^-25 + 2^-24) + 2^-150`` per element of a block with scale ``S``."""
        unit = _HALF_GAP + 2.0**-25 + 2.0**-24

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            scales = self._scales(_block_absmax(x.float(), self.block_size)).double()
            bound = scales * unit + 2.0**-150
            return torch.where(torch.isnan(bound), torch.inf, bound).repeat_interleave(
                self.block_size
            )[: x.numel()]

        def witness(numel: int) -> torch.Tensor:
            # power-of-two scales (exact in both formats); each block's first value is the
            # scale itself and the others sit on the midpoint of the widest gap, as close as
            # fp32 allows: their error is half that gap
            widest = int((_LEVELS[1:] - _LEVELS[:-1]).argmax())
            mid = float(_MIDPOINTS[widest])
            k = torch.arange(numel, dtype=torch.float64)
            scale = torch.exp2(torch.remainder(torch.div(k, self.block_size).floor(), 40) - 20)
            first = torch.remainder(k, self.block_size) == 0
            return (torch.where(first, 1.0, mid) * scale).float()

        formula = (
            f"S·({2 * _HALF_GAP:.4f}/2 + 2^-25 + 2^-24) + 2^-150, "
            f"S = roundup_{self.scale_format}(absmax)"
        )
        return ErrorBound(formula=formula, unbiased=False, max_abs=max_abs, witness=witness)
