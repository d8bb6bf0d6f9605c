"""Declarative block formats: a codec family defined by data (docs/formats.md, "Block formats").

A block format is five fields: an **element** format, a **block size**, a **scale** format, the
scale's **rounding rule**, and whether a **per-tensor scale** is agreed through the prologue.
:class:`BlockCodec` implements every combination with one PyTorch reference, and the generic
kernels (:mod:`dynamiq.kernels.block`: Triton; ``csrc/cpu_kernels.cpp``, ``dq_blk_run``:
native CPU) implement the ``"nearest"`` rule for every 4- and 8-bit element and power-of-two
block of 8..128 values, bit-exact with it, reading nothing but these fields. A subclass that
only changes the defaults (a plugin declaring its own format) gets the same kernels.

``nvfp4`` is the preset ``element="float4_e2m1fn", block_size=16, scale="float8_e4m3fn",
scale_rule="nearest", tensor_scale=True``.

**Encoding** a tensor of ``n`` values:

1. *Per-tensor scale* (``tensor_scale``): ``G = 2^k``, an fp32 power of two, from ``A``, the
   largest finite ``|x|`` of every rank's whole buffer, agreed by the prologue as an exact max
   all-reduce of its fp32 bits (outside a collective, ``ctx.shared`` unset: the chunk's own),
   and ``c = ctx.contributions`` (1 outside a collective), the number of gradients a partial
   sum holds, so ``|partial sum| <= c·A``::

       k = clamp(floor(log2 A) + 1 + ceil(log2 c) - T, KMIN, KMAX),  T = floor(log2(Me·Ms))

   (``Me``, ``Ms`` the largest element and scale values: ``c·A < 2^(k+T) <= Me·Ms·G``, so
   no block scale saturates unless rounding errors pushed a partial sum beyond ``c·A``;
   ``KMIN`` keeps the smallest block scale ``Ms_min·G`` a normal fp32, ``KMAX`` keeps
   ``Me·Ms·G`` finite). Without a tensor scale, ``G = 1``.
2. *Block scale* (``scale_rule="nearest"``, the NVFP4 recipe): ``b`` the block's absmax,
   ``t = fl32(b / (Me·G))`` (one rounding; ``Me·G`` is exact), ``s`` = ``t`` rounded to
   nearest-even in the scale format, saturating at ``Ms`` (``float8_e4m3fn``'s 448);
   ``S = s·G`` (exact). ``scale_rule="floor"`` is the OCP MX rule (``float8_e8m0fnu``
   scales, no tensor scale, :mod:`dynamiq.codecs.mx`): ``S = 2^clamp(floor(log2 b) - emax,
   -127, 127)``; those declarations give the MX codecs' very bytes (a test says so).
3. *Elements*: ``q = fl32(x / S)`` (IEEE division), rounded to nearest-even in the element
   format with subnormals, saturating at ``±Me``; a block whose scale is 0 gets codes 0.
   (``floor``: the element of ``x·2^-e``, one rounding, as MX.)

**Decoding** is ``element · S``, exact in fp32.

Wire layout (little-endian): with a tensor scale and ``n > 0``, the fp32 ``G`` (4 bytes);
then ``ceil(n / block_size)`` scale bytes; then the ``n`` element codes packed densely
(:mod:`dynamiq.codecs.packing`: two 4-bit codes a byte, low nibble first).

Non-finite input: a block holding NaN or ±Inf gets the scale format's NaN code (its element
codes are 0) and decodes to NaN; NaN/±Inf never enter ``A``.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .formats import ELEMENT_FORMATS, FLOAT8_E8M0FNU, ElementFormat, exponent_of, get_format
from .packing import pack_bits, packed_nbytes, unpack_bits
from .registry import register_codec

__all__ = ["SCALE_RULES", "TENSOR_AMAX_KEY", "BlockCodec", "finite_absmax_bits"]

#: ``HopContext.shared`` key of the prologue's result: the fp32 bits (an int) of the largest
#: finite ``|x|`` over every rank's buffer
TENSOR_AMAX_KEY = "block.tensor_amax"
SCALE_RULES = ("nearest", "floor")
_MAX_BLOCK = 1 << 16


def finite_absmax_bits(x: torch.Tensor) -> int:
    """The fp32 bits of the largest finite ``|x|`` (0 when there is none).

    One pass without temporaries (``aminmax``, which propagates NaN) when every value is
    finite, its largest magnitude being ``max(-min, max)`` exactly; the bit-level pass
    otherwise."""
    if x.numel() == 0:
        return 0
    flat = x.detach().reshape(-1)
    lo, hi = (float(v) for v in torch.aminmax(flat))
    if math.isfinite(lo) and math.isfinite(hi):
        return struct.unpack("<I", struct.pack("<f", max(-lo, hi)))[0] & 0x7FFFFFFF
    bits = flat.float().view(torch.int32) & 0x7FFFFFFF
    return int(torch.where(bits < 0x7F800000, bits, 0).max())


def _block_amax_bits(xf: torch.Tensor, block: int) -> torch.Tensor:
    """The integer max of the magnitude bits of each block (int64; NaN > Inf > finite)."""
    n = xf.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, dtype=torch.int32, device=xf.device)
    padded[:n] = xf.view(torch.int32) & 0x7FFFFFFF
    return padded.view(nb, block).amax(dim=1).to(torch.int64) if nb else padded[:0].long()


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=4096)
def _tensor_exp(limits: tuple[int, int, int], amax_bits: int, contributions: int) -> int:
    """:meth:`BlockCodec.tensor_exp` (memoized: every call of an encode and a reduce asks)."""
    top, kmin, kmax = limits
    ceil_log2 = (contributions - 1).bit_length()
    return min(max(_exponent_of_bits(amax_bits) + 1 + ceil_log2 - top, kmin), kmax)


def _exponent_of_bits(bits: int) -> int:
    """``formats.exponent_of`` of one fp32 magnitude bit pattern (a Python int)."""
    if bits == 0:
        return -150
    if bits >> 23:
        return (bits >> 23) - 127
    return (bits & 0x7FFFFF).bit_length() - 150


def _pow2(k: int) -> float:
    return math.ldexp(1.0, k)


@dataclass(frozen=True, kw_only=True)
class BlockCodec(Codec):
    """A block format declared by data (see the module docstring); ``nvfp4`` is a preset.

    Fields: ``element`` and ``scale`` (names of :data:`~dynamiq.codecs.formats.ELEMENT_FORMATS`),
    ``block_size``, ``scale_rule`` (``"nearest"`` or ``"floor"``) and ``tensor_scale``.

    Error bound per element ``x`` of a block with scale ``S = s·G`` (rule ``"nearest"``;
    ``h`` half the spacing of the element format's top binade, ``Me`` its largest value)::

        |x̂ - x| <= max(h·S, |x| - Me·S) + 2^-23·|x|

    (rounding to nearest in the element format, or saturation, plus the fp32 rounding of
    ``x / S``; a block whose scale rounds to 0 decodes to 0: ``|x|``). Rule ``"floor"``: the
    MX bound ``X·max(h, 2^(emax+1) - Me)``.

    >>> codec = BlockCodec(**BlockCodec.presets["nvfp4"])
    >>> codec == BlockCodec(), codec.bits_per_value(1 << 20)
    (True, 4.500030517578125)
    """

    codec_id: ClassVar[str] = "block"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "nvfp4": {
            "element": "float4_e2m1fn",
            "block_size": 16,
            "scale": "float8_e4m3fn",
            "scale_rule": "nearest",
            "tensor_scale": True,
        }
    }
    #: the kernel family (resolved at the first dispatch: :mod:`dynamiq.kernels.block` and the
    #: native ``dq_blk_run``); declared again for each subclass that keeps the reference,
    #: ``None`` in one that overrides it
    kernel_family: ClassVar[str | None] = "block"
    nonfinite: ClassVar[str] = (
        "A block holding NaN or ±Inf gets the scale format's NaN code and decodes to NaN; "
        "NaN/±Inf never enter the per-tensor scale."
    )

    element: str = "float4_e2m1fn"
    block_size: int = 16
    scale: str = "float8_e4m3fn"
    scale_rule: str = "nearest"
    tensor_scale: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # kernels belong to the class that declares them (dynamiq/kernels/_declared.py): a
        # subclass that keeps the reference computes the same, so it is declared for here; a
        # changed reference gets none (the generic kernels do not apply)
        super().__init_subclass__(**kwargs)
        overrides = any(op in vars(cls) for op in ("_encode", "_decode", "_reduce"))
        if "kernel_family" not in vars(cls):
            cls.kernel_family = None if overrides else cls.kernel_family

    def __post_init__(self) -> None:
        for name in ("element", "scale"):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in ELEMENT_FORMATS:
                known = ", ".join(ELEMENT_FORMATS)
                raise ValueError(f"{name} must be an element format name ({known}; got {value!r})")
        check_int("block_size", self.block_size, 1, _MAX_BLOCK)
        check_choice("scale_rule", self.scale_rule, SCALE_RULES)
        if not isinstance(self.tensor_scale, bool):
            raise TypeError(f"tensor_scale must be a bool (got {self.tensor_scale!r})")
        if get_format(self.element).specials == "fnu":
            raise ValueError(f"element {self.element!r} is unsigned: not an element format")
        scale = get_format(self.scale)
        if self.scale_rule == "floor":
            if scale != FLOAT8_E8M0FNU or self.tensor_scale:
                raise ValueError(
                    "scale_rule='floor' is the OCP MX rule: scale='float8_e8m0fnu' and "
                    "tensor_scale=False"
                )
        elif scale.specials not in ("fn", "ieee", "none") or scale.bits != 8:
            raise ValueError(
                f"scale_rule='nearest' takes an 8-bit signed float scale format "
                f"(float8_e4m3fn, float8_e5m2; got {self.scale!r})"
            )

    # -- the declared data ------------------------------------------------------------------

    @property
    def elem(self) -> ElementFormat:
        """The element format."""
        return get_format(self.element)

    @property
    def scale_fmt(self) -> ElementFormat:
        """The block-scale format."""
        return get_format(self.scale)

    @functools.cached_property
    def tensor_exp_limits(self) -> tuple[int, int, int]:
        """``(T, KMIN, KMAX)`` of the per-tensor exponent (module docstring, step 1; computed
        once per codec: every encode reads it)."""
        top = math.floor(math.log2(self.elem.max * self.scale_fmt.max))
        kmin = -126 - int(math.log2(self.scale_fmt.smallest_subnormal))
        kmax = 127 - (top + 1)
        return top, kmin, kmax

    def tensor_exp(self, amax_bits: int, contributions: int) -> int:
        """``k`` of the per-tensor scale ``G = 2^k`` for an agreed absmax (fp32 bits)."""
        return _tensor_exp(self.tensor_exp_limits, amax_bits, contributions)

    def tensor_exp_of(self, x: torch.Tensor, ctx: HopContext) -> int:
        """``k`` for encoding ``x`` under ``ctx``: the prologue's absmax and ``ctx``'s
        contributions, else the chunk's own absmax (0 without a tensor scale)."""
        if not self.tensor_scale:
            return 0
        shared = ctx.shared
        if shared is not None and TENSOR_AMAX_KEY in shared:
            return self.tensor_exp(int(shared[TENSOR_AMAX_KEY]), ctx.contributions)
        return self.tensor_exp(finite_absmax_bits(x), 1)

    def shared_tensors(self, shared: Mapping[str, Any] | None) -> list[torch.Tensor]:
        """The agreed absmax's bits as one int64 tensor (``[]`` without it)."""
        if shared is None or TENSOR_AMAX_KEY not in shared:
            return []
        return [torch.tensor([int(shared[TENSOR_AMAX_KEY])], dtype=torch.int64)]

    def shared_from_tensors(self, tensors: list[torch.Tensor]) -> Mapping[str, Any] | None:
        if not tensors:
            return None
        return {TENSOR_AMAX_KEY: int(tensors[0].reshape(-1)[0])}

    def fits_kernels(self) -> bool:
        """Whether the generic kernels implement this declaration: rule ``"nearest"``, 4- or
        8-bit elements, power-of-two blocks of 8..128 values (else the reference runs)."""
        b = self.block_size
        return (
            self.scale_rule == "nearest"
            and self.elem.bits in (4, 8)
            and 8 <= b <= 128
            and b & (b - 1) == 0
        )

    # -- geometry ---------------------------------------------------------------------------

    def header_nbytes(self, numel: int) -> int:
        """Bytes before the block scales: the fp32 tensor scale (0 without one, or empty)."""
        return 4 if self.tensor_scale and numel > 0 else 0

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int:
        return (
            self.header_nbytes(numel)
            + -(-numel // self.block_size)
            + packed_nbytes(numel, self.elem.bits)
        )

    # -- prologue: the agreed absmax --------------------------------------------------------

    #: how :meth:`prologue` combines the ranks' statistics (the simulator reduces in process)
    prologue_op: ClassVar[str] = "max"

    def prologue(self, x: torch.Tensor, comm: Any) -> dict[str, Any] | None:
        """With a tensor scale: every rank's largest finite ``|x|``, by one exact max
        all-reduce of its fp32 bits (an int32); ``None`` otherwise."""
        from dynamiq.collectives.handshake import allreduce_exact  # not at import: cycle

        stats = self.prologue_statistics(x, comm.rank, getattr(comm, "chunks", None))
        if stats is None:
            return None
        reduced = allreduce_exact(comm, stats, "max")
        return self.prologue_result(reduced, x.numel(), comm.world_size, None)

    def prologue_statistics(
        self, x: torch.Tensor, rank: int, chunks: list[tuple[int, int]] | None
    ) -> torch.Tensor | None:
        """This rank's part: the bits of its largest finite ``|x|`` (int32 ``[1]``)."""
        if not self.tensor_scale:
            return None
        return torch.tensor([finite_absmax_bits(x)], dtype=torch.int32)

    def prologue_result(
        self,
        reduced: torch.Tensor,
        numel: int,
        world_size: int,
        chunks: list[tuple[int, int]] | None,
        recut_align: int | None = None,
    ) -> dict[str, Any]:
        """``HopContext.shared``: ``{TENSOR_AMAX_KEY: bits}``."""
        return {TENSOR_AMAX_KEY: int(reduced.reshape(-1)[0])}

    # -- the scales -------------------------------------------------------------------------

    def block_scales(
        self, xf: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale codes uint8, S fp32, finite)`` per block of ``xf`` with ``G = 2^k``."""
        amax = _block_amax_bits(xf, self.block_size)
        finite = amax < 0x7F800000
        sf = self.scale_fmt
        if self.scale_rule == "floor":
            shared = (exponent_of(_f32(amax)) - self.elem.emax).clamp(-127, 127)
            codes = torch.where(finite, shared + 127, 0xFF).to(torch.uint8)
            return codes, sf.decode(codes), finite
        b = _f32(torch.where(finite, amax, 0))
        # a tensor divisor (exact in fp32): an IEEE division on every device (a scalar one
        # may become a multiplication by its reciprocal)
        t = b / torch.full_like(b, self.elem.max * _pow2(k))
        codes = sf.encode(t, saturate=True)
        codes = torch.where(finite, codes, sf.nan_code).to(torch.uint8)  # type: ignore[arg-type]
        return codes, sf.decode(codes) * _pow2(k), finite

    # -- encode / decode --------------------------------------------------------------------

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        n = x.numel()
        xf = x.float().contiguous()
        k = self.tensor_exp_of(xf, ctx)
        scodes, S, finite = self.block_scales(xf, k)
        fe, B = self.elem, self.block_size
        ok = (finite & (S > 0)).repeat_interleave(B)[:n]
        if self.scale_rule == "floor":
            shared = (scodes.to(torch.int64) - 127).repeat_interleave(B)[:n]
            codes = fe.encode(xf, shared, saturate=True)
        else:
            Se = S.repeat_interleave(B)[:n]
            q = torch.where(ok, xf / torch.where(ok, Se, 1.0), 0.0)
            codes = fe.encode(q, 0, saturate=True)
        codes = torch.where(ok, codes, 0)
        parts = [scodes, pack_bits(codes, fe.bits)]
        if self.header_nbytes(n):
            head = torch.tensor([_pow2(k)], dtype=torch.float32, device=x.device)
            parts.insert(0, head.view(torch.uint8))
        return torch.cat(parts)

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        h = self.header_nbytes(numel)
        g = payload[:h].clone().view(torch.float32) if h else None
        nb = -(-numel // self.block_size)
        s = self.scale_fmt.decode(payload[h : h + nb])
        S = s * g if g is not None else s
        codes = unpack_bits(payload[h + nb :], self.elem.bits, numel)
        return self.elem.decode(codes) * S.repeat_interleave(self.block_size)[:numel]

    # -- error bound ------------------------------------------------------------------------

    def _half_top_ulp(self) -> float:
        table = self.elem.decode_table()
        finite = table[torch.isfinite(table) & (table >= 0)].double().unique()
        return float(finite[-1] - finite[-2]) / 2

    @property
    def error_bound(self) -> ErrorBound:
        fe, B = self.elem, self.block_size
        h, me = self._half_top_ulp(), fe.max
        sat = 2.0 ** (fe.emax + 1) - me

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            xf = x.float().contiguous()
            _, S, finite = self.block_scales(xf, self.tensor_exp_of(xf, ctx))
            Se = S.double().repeat_interleave(B)[: x.numel()]
            ax = xf.double().abs()
            if self.scale_rule == "floor":
                bound = Se * max(h, sat)
            else:
                bound = torch.maximum(Se * h, ax - me * Se) + ax * 2.0**-23
            return torch.where(finite.repeat_interleave(B)[: x.numel()], bound, torch.inf)

        def witness(numel: int) -> torch.Tensor:
            # blocks of magnitude 2^-(i mod 8) (exact scales): a first value at the element
            # format's max, the others on the tie between its two largest values (error h·S)
            k = torch.arange(numel, dtype=torch.float64)
            blk = torch.floor(k / B)
            mid = me - h
            x = torch.where(torch.remainder(k, B) == 0, me, mid * torch.sign(torch.cos(k) + 0.5))
            return (x * torch.exp2(-torch.remainder(blk, 8))).float()

        if self.scale_rule == "floor":
            formula = f"X·{max(h, sat):g}, X = 2^clamp(floor(log2 absmax) - {fe.emax}, -127, 127)"
        else:
            formula = f"max({h:g}·S, |x| - {me:g}·S) + 2^-23·|x|, S = s·G"
        return ErrorBound(formula=formula, unbiased=False, max_abs=max_abs, witness=witness)


register_codec(BlockCodec)
