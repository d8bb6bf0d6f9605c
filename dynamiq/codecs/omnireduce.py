"""OmniReduce (SIGCOMM 2021) as the codec ``omnireduce`` (docs/design.md,
"Codec sources").

Values are cut into blocks of ``block_size`` (a power of two; the last block may be short).
A payload is a bitmap of the blocks it carries and their values; blocks it does not carry
decode to zero.

* ``density = 1`` (the lossless original): every block that is not all zero is sent, in fp32
  (``value_format="auto"``), so ``decode(encode(x)) == x`` (a ``-0.0`` in an all-zero block
  decodes to ``+0.0``, and every NaN to the canonical NaN). On dense gradients this saves almost
  nothing.
* ``density < 1`` (the usual lossy adaptation): each rank keeps its top ``density`` fraction
  of blocks by squared L2 norm, ``K = ceil(density · blocks)`` (``density`` read as the
  decimal it is written as), ties broken by the lower
  global block index, and sends them in 16 bits (``value_format="auto"`` is ``bf16``;
  ``fp16`` or ``fp32`` on request). A block holding NaN/Inf is always sent and does not take
  one of the ``K`` places. What is dropped is not lost for training: the engine's error
  feedback (``residual``, the DDP hook) carries it into the next step.

**Selection is a per-block rule**, so that nothing depends on how the engine cuts a buffer:
block ``b`` (squared norm ``n_b``, global index ``i_b = offset // block_size + b``) is sent iff
it is not all zero and ``n_b > τ`` or ``n_b = τ and i_b <= i*``. In a collective the rank's
``prologue`` computes ``(τ, i*)`` from its whole buffer (the norm and index of its ``K``-th
block; no communication) and every encoding of the rank uses it through ``ctx.shared``;
outside a collective the payload's own ``K``-th block sets it. Norms are summed in fp64 by a
fixed pairwise tree, so a block's norm does not depend on the payload around it.

**Reduce** (``homomorphic``: it does not re-select the sum): ``reduce(payload, local, ctx,
out_ctx)`` carries the union of the payload's blocks and the blocks of ``local`` that pass the
rule of ``out_ctx`` (with ``out_ctx.shared``, else the rule of the payload's sum ``decode(payload)
+ local``), with values ``fl16(decode(payload) + local)``; ``local``'s other blocks are dropped.
Encoding a partial sum afresh (a schedule that keeps an fp32 sum before sending it) applies the
rule to the sum.

**Error bound** per element, from the rule applied to the encoded value ``x``: a block that
passes the rule is certainly sent (for ``reduce`` too: where the payload has no block,
``decode(payload) + local`` equals ``local`` there), with the value format's rounding error
(0 for fp32, half an ulp or the saturation error for bf16/fp16, as the pass-through codecs);
a block that fails it may be dropped, losing the whole value: ``|x̂ - x| <= |x|``. This is
exactly the error of ``encode`` (tight: every dropped element reaches it).

Wire layout: the bitmap (``ceil(blocks / 8)`` bytes, block ``b`` in bit ``b % 8`` of byte
``b // 8``), then the carried blocks' values in order, each in the value format
(little-endian, as the pass-through codecs write them; fp32 values write every NaN as the
canonical quiet NaN ``0x7fc00000``, as the 16-bit formats do, so that no NaN payload that a
conversion or a sum left, which depends on the device, reaches the wire). The size depends on
the data: ``encoded_nbytes`` is ``None`` and the engine sends the length first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Protocol

import torch

from .base import Codec, ErrorBound, HopContext, check_choice, check_int
from .packing import pack_bits, unpack_bits
from .passthrough import PassThroughCodec
from .registry import get_codec, register_codec

__all__ = ["OmniReduceCodec"]

VALUE_FORMATS = ("auto", "fp32", "bf16", "fp16")
#: keys of this rank's selection rule in ``HopContext.shared``
THRESHOLD_KEY, TIE_KEY = "omnireduce_threshold", "omnireduce_tie"
#: the bits of every NaN that fp32 values carry (the canonical quiet NaN)
CANONICAL_NAN_F32 = 0x7FC00000


class _Comm(Protocol):
    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


@register_codec
@dataclass(frozen=True, kw_only=True)
class OmniReduceCodec(Codec):
    """Block-sparse all-reduce: a block bitmap and the values of the carried blocks.

    Config: ``density`` (``(0, 1]``; 1 is lossless), ``block_size`` (a power of two) and
    ``value_format`` (``"auto"``: fp32 at density 1, bf16 below; or ``"fp32"``, ``"bf16"``,
    ``"fp16"``). Error bound: ``|x|`` on blocks that may be dropped, the value format's
    rounding bound on the others (module docstring, ``docs/codecs.md``).

    >>> codec = OmniReduceCodec()
    >>> x = torch.zeros(1024)
    >>> x[300] = 2.5
    >>> payload = codec.encode(x)  # a 1-byte bitmap and the one non-zero block (256 fp32)
    >>> payload.numel(), bool(torch.equal(codec.decode(payload, 1024), x))
    (1025, True)
    >>> OmniReduceCodec(density=0.5).encode(torch.ones(1024)).numel()  # 2 of 4 blocks, bf16
    1025
    """

    codec_id: ClassVar[str] = "omnireduce"
    kernel_family: ClassVar[str | None] = "omnireduce"  # dynamiq/kernels/_declared.py
    homomorphic: ClassVar[bool] = True
    nonfinite: ClassVar[str] = (
        "A block holding NaN or ±Inf is always sent; NaN stays NaN and ±Inf stays ±Inf "
        "(finite values beyond fp16's range saturate with value_format fp16)."
    )

    density: float = 1.0
    block_size: int = 256
    value_format: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)):
            raise TypeError(f"density must be a float (got {type(self.density).__name__})")
        if not 0.0 < float(self.density) <= 1.0:
            raise ValueError(f"density must be in (0, 1] (got {self.density})")
        object.__setattr__(self, "density", float(self.density))
        check_int("block_size", self.block_size, 1, 1 << 16)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (got {self.block_size})")
        check_choice("value_format", self.value_format, VALUE_FORMATS)

    # -- geometry ---------------------------------------------------------------------------

    @property
    def values(self) -> PassThroughCodec:
        """The pass-through codec the carried values are written with."""
        fmt = self.value_format
        if fmt == "auto":
            fmt = "fp32" if self.density == 1.0 else "bf16"
        codec = get_codec(fmt)
        assert isinstance(codec, PassThroughCodec)
        return codec

    def _nblocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def wire(self) -> OmniReduceWire:
        """What a kernel reads to write and read this configuration's bytes: the blocks and
        the selection rule (:class:`OmniReduceWire`)."""
        return OmniReduceWire(self)

    def _keep(self, nblocks: int) -> int:
        """``K = ceil(density · blocks)``, exactly, with ``density`` read as the decimal it is
        written as (``0.2 · 30 = 6``, not the 7 that the binary double 0.2000…0111 gives)."""
        return math.ceil(Fraction(repr(self.density)) * nblocks)

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int | None:
        return 0 if numel == 0 else None

    def valid_nbytes(self, numel: int, nbytes: int) -> bool:
        """Whether a payload of ``numel`` values can have ``nbytes`` bytes: the bitmap, then
        whole blocks of values (the last block may be short). The engine checks a received
        length header with it before it posts the payload's receive."""
        if numel == 0:
            return nbytes == 0
        nb, size = self._nblocks(numel), self.block_size
        rest = nbytes - -(-nb // 8)
        item = self.values.dtype.itemsize
        if rest < 0 or rest % item:
            return False
        full, extra = divmod(rest // item, size)
        tail = numel - (nb - 1) * size  # the last block's size
        if extra == 0:
            return full <= (nb if tail == size else nb - 1)
        return extra == tail and full <= nb - 1

    def bits_per_value(self, numel: int = 1 << 20) -> float:
        """An upper bound (the size depends on the data): bitmap plus every block at density
        1, or ``K = ceil(density · blocks)`` full blocks (one fresh encoding) below."""
        nb = self._nblocks(numel)
        values = min(self._keep(nb) * self.block_size, numel)
        nbytes = -(-nb // 8) + values * self.values.dtype.itemsize
        return 8.0 * nbytes / numel

    # -- the selection rule -----------------------------------------------------------------

    def _norms(self, x: torch.Tensor) -> torch.Tensor:
        """Squared L2 norm of each block (fp64, a fixed pairwise tree; NaN/Inf propagate)."""
        nb, b = self._nblocks(x.numel()), self.block_size
        sq = torch.zeros(nb * b, dtype=torch.float64, device=x.device)
        sq[: x.numel()] = x.double().square()
        v = sq.view(nb, b)
        while v.shape[1] > 1:
            half = v.shape[1] // 2
            v = v[:, :half] + v[:, half:]
        return v[:, 0]

    def _block_index(self, nb: int, offset: int, device: torch.device) -> torch.Tensor:
        return torch.arange(nb, device=device, dtype=torch.int64) + offset // self.block_size

    def _rule_of(self, norms: torch.Tensor, index: torch.Tensor) -> tuple[float, int]:
        """``(τ, i*)``: norm and index of the ``K``-th finite block by (norm desc, index asc);
        ``(0, -1)`` (every non-zero block) when there are at most ``K``."""
        finite = torch.isfinite(norms)
        n, i = norms[finite], index[finite]
        k = self._keep(norms.numel())
        if int((n > 0).sum()) <= k:
            return 0.0, -1
        order = torch.sort(-n, stable=True).indices  # index is ascending already
        kth = order[k - 1]
        return float(n[kth]), int(i[kth])

    def _rule(self, ctx: HopContext, basis: torch.Tensor) -> tuple[float, int]:
        shared = ctx.shared
        if shared is not None and THRESHOLD_KEY in shared:
            return float(shared[THRESHOLD_KEY]), int(shared[TIE_KEY])
        norms = self._norms(basis)
        return self._rule_of(norms, self._block_index(norms.numel(), ctx.offset, basis.device))

    def _selected(self, x: torch.Tensor, rule: tuple[float, int], offset: int) -> torch.Tensor:
        """Blocks of ``x`` the rule sends."""
        norms = self._norms(x)
        special = ~torch.isfinite(norms)
        if self.density == 1.0:
            return special | (norms > 0)
        tau, tie = rule
        index = self._block_index(norms.numel(), offset, x.device)
        passes = (norms > tau) | ((norms == tau) & (index <= tie))
        return special | ((norms > 0) & passes)

    def prologue(self, x: torch.Tensor, comm: _Comm) -> dict[str, Any] | None:
        """This rank's selection rule ``(τ, i*)`` over its whole buffer (no communication);
        ``None`` at density 1, which needs none."""
        if self.density == 1.0:
            return None
        flat = x.detach().reshape(-1).float()
        norms = self._norms(flat)
        tau, tie = self._rule_of(norms, self._block_index(norms.numel(), 0, flat.device))
        return {THRESHOLD_KEY: tau, TIE_KEY: tie}

    # -- encode / decode / reduce -----------------------------------------------------------

    def _elements(self, blocks: torch.Tensor, numel: int) -> torch.Tensor:
        return blocks.repeat_interleave(self.block_size)[:numel]

    def _pack(self, values: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        keep = self._elements(sent, values.numel())
        carried = values[keep].contiguous()
        if self.values.dtype == torch.float32:
            # every NaN as the canonical quiet NaN: the NaN bits of a conversion (fp16 ->
            # fp32) or of a sum (inf + -inf, NaN + x) depend on the device and, on the CPU,
            # on the position (vectorised body or scalar tail); 16-bit values are canonical
            # already (the pass-through codecs)
            bits = torch.where(torch.isnan(carried), CANONICAL_NAN_F32, carried.view(torch.int32))
            carried = bits.view(torch.float32)
        body = self.values.encode(carried)
        return torch.cat([pack_bits(sent.to(torch.uint8), 1), body])

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        if x.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        xf = x.float()
        return self._pack(xf, self._selected(xf, self._rule(ctx, xf), ctx.offset))

    def _unpack(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sent blocks, fp32 values with zeros elsewhere); checks the payload's length."""
        nb = self._nblocks(numel)
        head = -(-nb // 8)
        if payload.numel() < head:
            raise ValueError(
                f"payload has {payload.numel()} bytes, less than the {head}-byte block bitmap"
            )
        sent = unpack_bits(payload[:head], 1, nb).bool()
        keep = self._elements(sent, numel)
        count = int(keep.sum())
        want = head + count * self.values.dtype.itemsize
        if payload.numel() != want:
            raise ValueError(
                f"payload has {payload.numel()} bytes but its bitmap announces {count} values "
                f"in {want} bytes"
            )
        out = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        out[keep] = self.values.decode(payload[head:].clone(), count)  # aligned for its view
        return sent, out

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=payload.device)
        return self._unpack(payload, numel)[1]

    def _reduce(
        self, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
    ) -> torch.Tensor:
        n = local.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=local.device)
        sent, partial = self._unpack(payload, n)
        lf = local.float()
        total = partial + lf
        mine = self._selected(lf, self._rule(out_ctx, total), out_ctx.offset)
        return self._pack(total, sent | mine)

    # -- error bound ------------------------------------------------------------------------

    @property
    def error_bound(self) -> ErrorBound:
        rounding = self.values.error_bound

        def max_abs(x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            if x.numel() == 0:
                return torch.zeros(0, dtype=torch.float64, device=x.device)
            xf = x.float()
            sent = self._selected(xf, self._rule(ctx, xf), ctx.offset)
            special = ~torch.isfinite(self._norms(xf))
            bound = torch.where(
                self._elements(sent, x.numel()), rounding.max_abs(xf, ctx), xf.double().abs()
            )
            return torch.where(self._elements(special, x.numel()), torch.nan, bound)

        def witness(numel: int) -> torch.Tensor:
            # the value format's own worst case (ties), blocks scaled 2^0..2^4 so that the
            # smaller blocks fall below the threshold and are dropped: error |x| = bound
            x = rounding.witness(numel).double()
            block = torch.arange(numel, dtype=torch.int64) // self.block_size
            return (x * torch.exp2(torch.remainder(block * 3, 5).double())).float()

        if self.density == 1.0:
            formula = rounding.formula if self.values.codec_id != "fp32" else "0"
        else:
            formula = (
                f"|x| on blocks below the top-{self.density:g} norm threshold (may be "
                f"dropped), else {self.values.codec_id}'s: {rounding.formula}"
            )
        exact = self.density == 1.0 and self.values.codec_id == "fp32"
        return ErrorBound(formula=formula, unbiased=exact, max_abs=max_abs, witness=witness)


@dataclass(frozen=True)
class OmniReduceWire:
    """OmniReduce's wire format as a kernel reads it (:meth:`OmniReduceCodec.wire`): public,
    so that a kernel never reads the codec's internals."""

    codec: OmniReduceCodec

    def nblocks(self, numel: int) -> int:
        """Blocks of ``numel`` values (the last may be short): bits of the bitmap."""
        return self.codec._nblocks(numel)

    def block_index(self, nblocks: int, offset: int, device: torch.device) -> torch.Tensor:
        """The global index of each of ``nblocks`` blocks at global ``offset`` (int64)."""
        return self.codec._block_index(nblocks, offset, device)

    def rule(self, norms: torch.Tensor, index: torch.Tensor) -> tuple[float, int]:
        """The selection rule ``(τ, i*)`` from the blocks' squared norms (fp64) and global
        indices: a block is sent iff its norm is ``> τ``, or ``== τ`` with index ``<= i*``
        (non-finite and, at density 1, every non-zero block are always sent)."""
        return self.codec._rule_of(norms, index)
