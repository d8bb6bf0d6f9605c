"""The codec contract: :class:`Codec`, :class:`HopContext` and :class:`ErrorBound`.

Implements docs/design.md, "The codec contract" and "Error bounds". A codec is an immutable,
keyword-only value object whose configuration is its declared dataclass fields. The public
methods (:meth:`Codec.encode`, :meth:`Codec.decode`, :meth:`Codec.reduce`) validate their
arguments and then go through the kernel dispatcher (:mod:`dynamiq.kernels`, backend
``"auto"``), which runs a Triton kernel where one can run (CUDA tensors, or
``TRITON_INTERPRET=1``) and otherwise the codec's private reference implementation
(``_encode``, ``_decode``, ``_reduce``), so every codec rejects bad input the same way before
any kernel touches it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

__all__ = [
    "FLOAT_DTYPES",
    "FP32_MAX",
    "Codec",
    "ErrorBound",
    "HopContext",
]

#: Largest finite fp32 value.
FP32_MAX = float.fromhex("0x1.fffffep127")  # 3.4028234663852886e38

#: Input dtypes every codec accepts.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: :mod:`dynamiq.kernels`, imported at the first call of a codec method (the kernels import the
#: codecs; ``import dynamiq.codecs`` imports no kernel module)
_kernels: Any = None


def _dispatcher() -> Any:
    global _kernels
    if _kernels is None:
        from dynamiq import kernels

        _kernels = kernels
    return _kernels


#: :class:`HopContext`'s integer fields, in the order a kernel's op boundary passes them
HOP_INT_FIELDS = (
    "seed", "step", "hop", "num_hops", "rank", "contributions", "offset", "world_size",
)  # fmt: skip
#: each int field's range: seed, step and offset are 64-bit counter words, the others fit in
#: 32 bits; counts start at 1
_INT_RANGES = tuple(
    (
        name,
        1 if name in ("num_hops", "contributions", "world_size") else 0,
        2**63 - 1 if name in ("seed", "step", "offset") else 2**32 - 1,
    )
    for name in HOP_INT_FIELDS
)


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    """Raise a ``TypeError``/``ValueError`` unless ``value`` is an int in ``lo..hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {'in ' if hi is not None else ''}{rng} (got {value})")


@dataclass(frozen=True)
class HopContext:
    """Where a chunk is in the collective; everything a codec may condition on.

    Attributes:
        seed: user seed of the collective (randomness is a pure function of it).
        step: training iteration.
        hop: index of this re-encoding along the chunk's path (0 for the first encoding).
        num_hops: how many re-encodings the chunk goes through in the whole collective.
        rank: the encoding rank.
        contributions: how many workers' gradients the (partial) sum already holds.
        offset: global element index of the chunk's first element.
        world_size: number of ranks in the collective.
        shared: result of the codec's ``prologue`` (e.g. an agreed global norm), or ``None``.

    >>> HopContext(hop=2, num_hops=7, rank=3).hop
    2
    """

    seed: int = 0
    step: int = 0
    hop: int = 0
    num_hops: int = 1
    rank: int = 0
    contributions: int = 1
    offset: int = 0
    world_size: int = 1
    shared: Mapping[str, Any] | None = field(default=None, hash=False, compare=True)

    def __post_init__(self) -> None:
        for name, lo, hi in _INT_RANGES:
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:  # (the fast path: one test a field)
                check_int(name, v, lo, hi)
        if self.hop >= self.num_hops:
            raise ValueError(f"hop must be < num_hops={self.num_hops} (got {self.hop})")
        if self.shared is not None and not isinstance(self.shared, Mapping):
            raise TypeError(f"shared must be a mapping or None (got {type(self.shared).__name__})")


DEFAULT_CTX = HopContext()


@dataclass(frozen=True)
class ErrorBound:
    """A codec's declared, certified error bound.

    Attributes:
        formula: the per-element bound as a human-readable formula (also in the docstring of
            the codec and in ``docs/codecs.md``).
        unbiased: whether ``E[decode(encode(x))] == x`` (over the codec's hash dither).
        max_abs: ``(x, ctx) -> fp64 tensor`` with ``|decode(encode(x, ctx), ctx) - x| <=
            max_abs(x, ctx)`` element-wise, for every finite ``x`` (with probability one).
        witness: ``numel -> tensor``: a worst-case input on which the observed error reaches at
            least half the bound somewhere (the bound is tight, not just true).
        var: for stochastic codecs, ``(x, ctx) -> fp64 tensor`` bounding ``E[(x̂ - x)^2]``.
    """

    formula: str
    unbiased: bool
    max_abs: Callable[[torch.Tensor, HopContext], torch.Tensor]
    witness: Callable[[int], torch.Tensor]
    var: Callable[[torch.Tensor, HopContext], torch.Tensor] | None = None

    def max_abs_error(self, x: torch.Tensor, ctx: HopContext | None = None) -> torch.Tensor:
        """Certified per-element bound on ``|decode(encode(x, ctx), ctx) - x|`` (fp64)."""
        return self.max_abs(x, ctx or DEFAULT_CTX)

    def variance(self, x: torch.Tensor, ctx: HopContext | None = None) -> torch.Tensor:
        """Per-element bound on the mean squared error ``E[(x̂ - x)^2]`` (fp64).

        For deterministic codecs the squared error itself is bounded by ``max_abs_error**2``.
        """
        if self.var is not None:
            return self.var(x, ctx or DEFAULT_CTX)
        return self.max_abs_error(x, ctx).square()


class Codec:
    """Base class of every codec: an immutable, keyword-only value object.

    Subclasses are frozen keyword-only dataclasses with a class attribute ``codec_id`` and
    implement ``block_size``, ``encoded_nbytes``, ``_encode``, ``_decode``, ``error_bound`` and
    optionally ``_reduce`` (default: re-quantize, ``encode(decode(payload) + local, out_ctx)``).

    Class attributes:
        codec_id: the registry id (``get_config()["id"]``).
        presets: named configurations registered beside ``codec_id`` (``"int8"`` is
            ``{"id": "int", "bits": 8}``).
        homomorphic: ``reduce`` aggregates without decompressing (its result decodes within the
            bound of ``decode(payload) + local`` instead of being bit-identical to re-encoding).
        nonfinite: what happens to NaN/±Inf inputs (a sentence, shown in the docs).
        kernel_family: the family of fused kernels that computes exactly what the reference
            does (``"intq"``, ``"mx"``, ``"block"``, ...: dynamiq/kernels/_declared.py),
            resolved at the first dispatch; ``None`` (the default): the reference only. Only
            a declaration in a class's own body counts: a subclass runs on its reference
            until it declares (or registers) kernels itself.
    """

    codec_id: ClassVar[str]
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    homomorphic: ClassVar[bool] = False
    nonfinite: ClassVar[str] = ""
    kernel_family: ClassVar[str | None] = None

    # -- configuration ----------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """JSON-safe configuration including ``"id"``; ``get_codec(get_config()) == self``."""
        config: dict[str, Any] = {"id": self.codec_id}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            config[f.name] = getattr(self, f.name)
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Build from a config mapping (``"id"`` optional); unknown keys are an error."""
        params = dict(config)
        cid = params.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise ValueError(f"config id must be {cls.codec_id!r} (got {cid!r})")
        allowed = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise ValueError(
                f"unknown config key(s) {', '.join(map(repr, unknown))} for codec "
                f"{cls.codec_id!r} (allowed: {', '.join(sorted(allowed)) or 'none'})"
            )
        return cls(**params)

    # -- geometry ---------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Elements per independently encoded block; chunks are cut on multiples of it."""
        raise NotImplementedError

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int | None:
        """Exact wire size in bytes of ``numel`` values (``None``: data-dependent)."""
        raise NotImplementedError

    @property
    def bound_block(self) -> int:
        """Elements (aligned like blocks) outside of which a NaN/±Inf never spoils a finite
        element's bound (default: the block); the engine sends multi-hop bounds per
        ``max(bound_block, 32)`` values."""
        return self.block_size

    @property
    def max_input_abs(self) -> float:
        """Largest finite ``|x|`` the codec encodes; beyond it ``encode`` raises ``ValueError``."""
        return FP32_MAX

    def bits_per_value(self, numel: int = 1 << 20) -> float:
        """Wire bits per value for a large buffer (``8 * encoded_nbytes(numel) / numel``)."""
        nbytes = self.encoded_nbytes(numel)
        return math.nan if nbytes is None else 8.0 * nbytes / numel

    # -- the three operations ---------------------------------------------------------------

    def encode(self, x: torch.Tensor, ctx: HopContext | None = None) -> torch.Tensor:
        """Encode 1-D fp32/bf16/fp16 ``x`` into a self-contained uint8 payload."""
        ctx = check_ctx(ctx)
        check_values("x", x)
        return (_kernels or _dispatcher())._encode(self, x, ctx, "auto")

    def decode(
        self,
        payload: torch.Tensor,
        numel: int,
        ctx: HopContext | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode ``numel`` values from ``payload`` into an fp32 tensor (``out`` if given)."""
        ctx = check_ctx(ctx)
        check_int("numel", numel, 0)
        self.check_payload(payload, numel, ctx)
        if out is not None:
            _check_out(out, numel, payload.device)
        result = (_kernels or _dispatcher())._decode(self, payload, numel, ctx, "auto")
        if out is None:
            return result
        out.copy_(result)
        return out

    def reduce(
        self,
        payload: torch.Tensor,
        local: torch.Tensor,
        ctx: HopContext | None = None,
        out_ctx: HopContext | None = None,
    ) -> torch.Tensor:
        """Fused decompress-accumulate-recompress of a partial sum.

        ``ctx`` says how ``payload`` was encoded and ``out_ctx`` (default ``ctx``) how to
        encode the result. For re-quantizing codecs the result is bit-identical to
        ``encode(decode(payload, numel, ctx) + local.float(), out_ctx)``.
        """
        ctx = check_ctx(ctx)
        out_ctx = ctx if out_ctx is None else check_ctx(out_ctx)
        check_values("local", local)
        if isinstance(payload, torch.Tensor) and payload.device != local.device:
            raise ValueError(
                f"payload and local must be on the same device "
                f"(got {payload.device} and {local.device})"
            )
        self.check_payload(payload, local.numel(), ctx)
        return (_kernels or _dispatcher())._reduce(self, payload, local, ctx, out_ctx, "auto")

    # -- what subclasses implement ----------------------------------------------------------

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        raise NotImplementedError

    def _reduce(
        self, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
    ) -> torch.Tensor:
        partial = self._decode(payload, local.numel(), ctx)
        return self._encode(partial + local.float(), out_ctx)

    @property
    def error_bound(self) -> ErrorBound:
        """The codec's certified error bound."""
        raise NotImplementedError

    # -- the prologue's result across a torch.library op (dynamiq/kernels/_ops.py) ----------

    def shared_tensors(self, shared: Mapping[str, Any] | None) -> list[torch.Tensor]:
        """``ctx.shared`` as tensors, the form in which it crosses a ``torch.library`` op
        (:meth:`shared_from_tensors` inverts it). A codec with a prologue overrides both;
        by default only ``None`` (no prologue result) crosses."""
        if shared is None:
            return []
        raise NotImplementedError(
            f"codec {self.codec_id!r} ({type(self).__qualname__}) cannot pass ctx.shared "
            "through a torch.library op (torch.compile, fake tensors): define its "
            "shared_tensors and shared_from_tensors"
        )

    def shared_from_tensors(self, tensors: list[torch.Tensor]) -> Mapping[str, Any] | None:
        """The ``ctx.shared`` that :meth:`shared_tensors` made ``tensors`` from (what the
        kernels read of it)."""
        if not tensors:
            return None
        raise NotImplementedError(
            f"codec {self.codec_id!r} ({type(self).__qualname__}) defines no shared_from_tensors"
        )

    # -- checks -----------------------------------------------------------------------------

    def check_payload(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> None:
        """``TypeError``/``ValueError`` unless ``payload`` is a 1-D contiguous uint8 tensor of
        :meth:`encoded_nbytes` bytes (where that is known): what ``decode`` and ``reduce``
        check before any kernel reads it."""
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"payload must be a torch.Tensor (got {type(payload).__name__})")
        if payload.dtype != torch.uint8:
            raise TypeError(f"payload must have dtype torch.uint8 (got {payload.dtype})")
        if payload.dim() != 1:
            raise ValueError(f"payload must be 1-D (got shape {tuple(payload.shape)})")
        if not payload.is_contiguous():
            raise ValueError("payload must be contiguous")
        expected = self.encoded_nbytes(numel, ctx)
        if expected is not None and payload.numel() != expected:
            raise ValueError(
                f"payload has {payload.numel()} bytes but {self.codec_id} encodes {numel} "
                f"values in {expected} bytes"
            )


def check_ctx(ctx: HopContext | None) -> HopContext:
    """``ctx``, or :data:`DEFAULT_CTX` for ``None``; ``TypeError`` for anything else."""
    if ctx is None:
        return DEFAULT_CTX
    if not isinstance(ctx, HopContext):
        raise TypeError(f"ctx must be a HopContext or None (got {type(ctx).__name__})")
    return ctx


def check_values(name: str, x: torch.Tensor) -> None:
    """``TypeError``/``ValueError`` naming ``name`` unless ``x`` is a 1-D contiguous fp32,
    bf16 or fp16 tensor (what ``encode`` and ``reduce`` take)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(x).__name__})")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16 (got {x.dtype})")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (got shape {tuple(x.shape)}); flatten it first")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor (got {type(out).__name__})")
    if out.dtype != torch.float32:
        raise TypeError(f"out must have dtype torch.float32 (got {out.dtype})")
    if out.shape != (numel,):
        raise ValueError(f"out must have shape ({numel},) (got {tuple(out.shape)})")
    if out.device != device:
        raise ValueError(f"out must be on the payload's device {device} (got {out.device})")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise a ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))} (got {value!r})")
