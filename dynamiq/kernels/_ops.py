"""The three operations as ``torch.library`` ops: what ``torch.compile`` and fake tensors see.

Implements docs/design.md, "Kernels" (the ``torch.library`` ops). The ops are

* ``dynamiq::encode(Tensor x, str codec, int[] ctx, Tensor[] shared, int nbytes,
  str backend) -> Tensor``
* ``dynamiq::decode(Tensor payload, int numel, str codec, int[] ctx, Tensor[] shared,
  str backend) -> Tensor``
* ``dynamiq::reduce(Tensor payload, Tensor local, str codec, int[] ctx, Tensor[] shared,
  int[] out_ctx, Tensor[] out_shared, int nbytes, str backend) -> Tensor``

registered with ``Library.define``/``impl`` (one implementation for every device: the
dispatcher's own choice of native CPU kernel, Triton or reference, and ``backend`` as its
override) and a fake implementation that sizes the output by ``nbytes``: the codec's
``encoded_nbytes``, computed by the caller, who holds the prologue's result (``-1``: a
data-dependent size, where the codec sizes its payload from the data).

What crosses the boundary: the codec as its canonical configuration (``get_config()`` as
sorted JSON; the codec object is remembered under it, so a plugin class that is not
registered still works in the process that made it), the hop context as its eight int fields
(in the order of ``dynamiq.codecs.base.HOP_INT_FIELDS``) and ``ctx.shared`` as tensors (the codec's
:meth:`~dynamiq.codecs.Codec.shared_tensors`; only what the kernels read crosses).

**When they are used.** The dispatcher (:mod:`dynamiq.kernels`) routes a call through these ops
while ``torch.compile`` traces it and for tensors that hold no data (fake or meta tensors, and
other tensor subclasses); eager calls on plain tensors call the kernels directly, since an op
costs about 5 µs more a call (the "op" column of ``python benchmarks/dispatch_overhead.py``;
recorded in docs/benchmarks.md). Both paths run the same kernels and give the same bytes.
The tensors of ``ctx.shared`` are taken as immutable (a prologue's result is): a context
rebuilt from them is memoized by their identity.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dynamiq.codecs.base import HOP_INT_FIELDS, HopContext

if TYPE_CHECKING:
    from dynamiq.codecs.base import Codec

__all__ = ["decode", "encode", "reduce"]

_LIB = torch.library.Library("dynamiq", "DEF")
_LIB.define(
    "encode(Tensor x, str codec, int[] ctx, Tensor[] shared, int nbytes, str backend) -> Tensor"
)
_LIB.define(
    "decode(Tensor payload, int numel, str codec, int[] ctx, Tensor[] shared, str backend)"
    " -> Tensor"
)
_LIB.define(
    "reduce(Tensor payload, Tensor local, str codec, int[] ctx, Tensor[] shared, "
    "int[] out_ctx, Tensor[] out_shared, int nbytes, str backend) -> Tensor"
)

#: canonical configuration -> codec (one entry a configuration), and id(codec) -> (codec, its
#: configuration) for the last codec objects seen (cleared when full)
_BY_KEY: dict[str, Codec] = {}
_KEY_OF: dict[int, tuple[Codec, str]] = {}
_MAX_KEYS = 1024
_LOCK = threading.Lock()


def _codec_key(codec: Codec) -> str:
    """``codec``'s canonical configuration, remembered with the codec."""
    got = _KEY_OF.get(id(codec))
    if got is not None and got[0] is codec:
        return got[1]
    key = json.dumps(codec.get_config(), sort_keys=True, default=_json_default)
    with _LOCK:
        _BY_KEY.setdefault(key, codec)
        if len(_KEY_OF) >= _MAX_KEYS:
            _KEY_OF.clear()
        _KEY_OF[id(codec)] = (codec, key)
    return key


# dynamo takes the key as a constant, not tracing json.dumps (what
# torch.compiler.assume_constant_result marks, without importing dynamo here: about 2 s)
_codec_key._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _json_default(v: Any) -> Any:
    if isinstance(v, (tuple, frozenset, set)):
        return list(v)
    raise TypeError(f"a codec configuration value {v!r} is not JSON-safe")


def _codec_of(key: str) -> Codec:
    codec = _BY_KEY.get(key)
    if codec is None:  # a graph made in another process: the registry builds it
        from dynamiq.codecs import get_codec

        codec = get_codec(json.loads(key))
        with _LOCK:
            codec = _BY_KEY.setdefault(key, codec)
    return codec


def _size(codec: Codec, numel: int, ctx: HopContext) -> int:
    """``encoded_nbytes`` as the ops take it (``-1``: data-dependent), computed by the caller,
    which holds the prologue's result itself (fake tensors of it would not)."""
    nbytes = codec.encoded_nbytes(numel, ctx)
    return -1 if nbytes is None else nbytes


def _sized(codec: Codec, out: torch.Tensor, nbytes: int) -> torch.Tensor:
    if nbytes >= 0 and out.numel() != nbytes:
        raise RuntimeError(
            f"codec {codec.codec_id!r} wrote {out.numel()} bytes where its encoded_nbytes "
            f"says {nbytes}: its encoded_nbytes and its encode disagree"
        )
    return out


def _ints(ctx: HopContext) -> list[int]:
    return [getattr(ctx, f) for f in HOP_INT_FIELDS]


#: the hop contexts rebuilt from the ops' arguments: (id of the codec, the ints, the ids of the
#: shared tensors) -> (the codec, the tensors, the context); the entries hold what their ids
#: name, so an id is not reused while it is here
_CTXS: dict[tuple[int, ...], tuple[Codec, list[torch.Tensor], HopContext]] = {}
_MAX_CTXS = 512


def _ctx(codec: Codec, ints: list[int], shared: list[torch.Tensor]) -> HopContext:
    """The hop context of an op's arguments (checked like any other; memoized: rebuilding
    and checking one costs more than the op boundary)."""
    key = (id(codec), *ints, *map(id, shared))
    got = _CTXS.get(key)
    if got is not None and got[0] is codec:
        return got[2]
    mapping: Mapping[str, Any] | None = codec.shared_from_tensors(list(shared))
    ctx = HopContext(**dict(zip(HOP_INT_FIELDS, ints, strict=True)), shared=mapping)
    if len(_CTXS) >= _MAX_CTXS:
        _CTXS.clear()
    _CTXS[key] = (codec, list(shared), ctx)
    return ctx


# -- what the callers (dynamiq.kernels' validated entry points) call ---------------------------


def encode(codec: Codec, x: torch.Tensor, ctx: HopContext, backend: str) -> torch.Tensor:
    shared = codec.shared_tensors(ctx.shared)
    nbytes = _size(codec, x.numel(), ctx)
    op = torch.ops.dynamiq.encode.default
    return op(x, _codec_key(codec), _ints(ctx), shared, nbytes, backend)


def decode(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: HopContext, backend: str
) -> torch.Tensor:
    shared = codec.shared_tensors(ctx.shared)
    op = torch.ops.dynamiq.decode.default
    return op(payload, numel, _codec_key(codec), _ints(ctx), shared, backend)


def reduce(
    codec: Codec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    backend: str,
) -> torch.Tensor:
    shared, out_shared = codec.shared_tensors(ctx.shared), codec.shared_tensors(out_ctx.shared)
    op = torch.ops.dynamiq.reduce.default
    key, nbytes = _codec_key(codec), _size(codec, local.numel(), out_ctx)
    return op(payload, local, key, _ints(ctx), shared, _ints(out_ctx), out_shared, nbytes, backend)


# -- the implementations -----------------------------------------------------------------------


def _encode_impl(
    x: torch.Tensor,
    codec: str,
    ctx: list[int],
    shared: list[torch.Tensor],
    nbytes: int,
    backend: str,
) -> torch.Tensor:
    from . import _encode_direct

    c = _codec_of(codec)
    return _sized(c, _encode_direct(c, x, _ctx(c, ctx, shared), backend), nbytes)


def _decode_impl(
    payload: torch.Tensor,
    numel: int,
    codec: str,
    ctx: list[int],
    shared: list[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    from . import _decode_direct

    c = _codec_of(codec)
    return _decode_direct(c, payload, numel, _ctx(c, ctx, shared), backend)


def _reduce_impl(  # noqa: PLR0913 (the schema's arguments)
    payload: torch.Tensor,
    local: torch.Tensor,
    codec: str,
    ctx: list[int],
    shared: list[torch.Tensor],
    out_ctx: list[int],
    out_shared: list[torch.Tensor],
    nbytes: int,
    backend: str,
) -> torch.Tensor:
    from . import _reduce_direct

    c = _codec_of(codec)
    a, b = _ctx(c, ctx, shared), _ctx(c, out_ctx, out_shared)
    return _sized(c, _reduce_direct(c, payload, local, a, b, backend), nbytes)


for _name, _fn in (("encode", _encode_impl), ("decode", _decode_impl), ("reduce", _reduce_impl)):
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")


# -- the fake implementations: the output's size ----------------------------------------------


def _checked(codec: str, op: str, t: torch.Tensor, backend: str) -> Codec:
    """The codec, after the checks a real call of ``op`` on ``t`` makes of ``backend`` (a
    forced backend that cannot run ``t``'s device raises here too)."""
    from . import _plan

    c = _codec_of(codec)
    _plan(c, op, t, backend)
    return c


def _nbytes(c: Codec, numel: int, nbytes: int) -> Any:
    """The payload's bytes (the caller's ``encoded_nbytes``), or a data-dependent size."""
    if nbytes >= 0:
        return nbytes
    try:
        return torch.library.get_ctx().new_dynamic_size()
    except RuntimeError:  # meta tensors, and fake ones without a ShapeEnv
        raise ValueError(
            f"codec {c.codec_id!r}: the payload's size of {numel} values depends on the data, "
            "which meta tensors (and fake tensors without a ShapeEnv) cannot express: use "
            "torch.compile, FakeTensorMode(shape_env=ShapeEnv()) or real tensors"
        ) from None


@torch.library.register_fake("dynamiq::encode", lib=_LIB)
def _encode_fake(
    x: torch.Tensor,
    codec: str,
    ctx: list[int],
    shared: list[torch.Tensor],
    nbytes: int,
    backend: str,
) -> torch.Tensor:
    c = _checked(codec, "encode", x, backend)
    return x.new_empty(_nbytes(c, x.numel(), nbytes), dtype=torch.uint8)


@torch.library.register_fake("dynamiq::decode", lib=_LIB)
def _decode_fake(
    payload: torch.Tensor,
    numel: int,
    codec: str,
    ctx: list[int],
    shared: list[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    _checked(codec, "decode", payload, backend)
    return payload.new_empty(numel, dtype=torch.float32)


@torch.library.register_fake("dynamiq::reduce", lib=_LIB)
def _reduce_fake(  # noqa: PLR0913 (the schema's arguments)
    payload: torch.Tensor,
    local: torch.Tensor,
    codec: str,
    ctx: list[int],
    shared: list[torch.Tensor],
    out_ctx: list[int],
    out_shared: list[torch.Tensor],
    nbytes: int,
    backend: str,
) -> torch.Tensor:
    c = _checked(codec, "reduce", local, backend)
    return local.new_empty(_nbytes(c, local.numel(), nbytes), dtype=torch.uint8)
