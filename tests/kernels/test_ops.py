"""The ``torch.library`` ops (``dynamiq/kernels/_ops.py``): ``torch.compile`` traces the codecs'
calls as ops and gets the eager bytes; fake and meta tensors get the encoded size; the codec,
the hop context and the prologue's result cross the boundary and come back equal."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import dynamiq.kernels as K
from dynamiq.codecs import HopContext, get_codec, list_codecs
from dynamiq.codecs import _dynamiq_pool as pool
from dynamiq.kernels import _ops

N = 4096 + 160  # a short last block (and a short last DynamiQ span)
CTX = HopContext(seed=7, step=3, hop=0, num_hops=3, rank=1, offset=8192, world_size=4)
OUT = dataclasses.replace(CTX, hop=1, rank=2, contributions=2)
OPS = {
    torch.ops.dynamiq.encode.default,
    torch.ops.dynamiq.decode.default,
    torch.ops.dynamiq.reduce.default,
}


def _data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
    return x, torch.randn(n, generator=g)


def _three(codec: Any, ctx: HopContext, out: HopContext) -> Callable[..., Any]:
    def f(x: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = codec.encode(x, ctx)
        r = codec.reduce(p, local, ctx, out)
        return p, r, codec.decode(r, local.numel(), out)

    return f


def _recording() -> tuple[Callable[..., Any], list[Any]]:
    """A ``torch.compile`` backend that runs the traced graph as it is and keeps its nodes'
    targets."""
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        seen.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    return backend, seen


def _same(want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(want, got, strict=True):
        assert type(b) is torch.Tensor
        assert a.dtype == b.dtype and torch.equal(a, b)


#: every registered codec, and one that reads every field of the hop context (its dither)
CODECS = [*list_codecs(), '{"id": "int", "bits": 5, "rounding": "stochastic"}']


@pytest.mark.parametrize("name", CODECS)
def test_compiled_calls_are_the_ops_and_give_the_eager_bytes(name: str) -> None:
    codec = get_codec(name)
    x, local = _data()
    f = _three(codec, CTX, OUT)
    want = f(x, local)
    backend, seen = _recording()
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend)(x, local)
    _same(want, got)
    assert set(seen) >= OPS


def _with_prologue(name: str, x: torch.Tensor, local: torch.Tensor) -> tuple[Any, ...]:
    codec = get_codec(name)
    both = x + local
    shared = codec.prologue_result(codec.prologue_statistics(both, 0, None), both.numel(), 1, None)
    # (the pool covers the buffer of the prologue: offsets from 0)
    ctx = dataclasses.replace(CTX, offset=0, shared=shared)
    return codec, ctx, dataclasses.replace(OUT, offset=0, shared=shared)


@pytest.mark.parametrize("backend", ["recording", "aot_eager"])
@pytest.mark.parametrize("name", ["dynamiq", "nvfp4"])
def test_the_prologue_result_crosses_as_tensors(name: str, backend: str) -> None:
    x, local = _data()
    codec, ctx, out = _with_prologue(name, x, local)
    assert codec.shared_tensors(ctx.shared)  # (the result is there, and crosses)
    f = _three(codec, ctx, out)
    want = f(x, local)
    recording, seen = _recording()
    torch._dynamo.reset()
    got = torch.compile(
        f, fullgraph=True, backend=recording if backend == "recording" else backend
    )(x, local)
    _same(want, got)
    if backend == "recording":
        assert set(seen) >= OPS


def test_a_pool_comes_back_equal_from_its_tensors() -> None:
    x, local = _data()
    codec, ctx, _ = _with_prologue("dynamiq", x, local)
    back = codec.shared_from_tensors(codec.shared_tensors(ctx.shared))
    assert back is not None and back[pool.SHARED_KEY] == ctx.shared[pool.SHARED_KEY]
    # the simulator's gathered pools carry fixed budgets: those cross too
    budgets = [pool.chunk_budgets(codec, ctx.shared, N, 0, codec.bits)]
    g = pool.gathered(codec, ctx.shared, budgets, N)
    back = codec.shared_from_tensors(codec.shared_tensors(g))[pool.SHARED_KEY]
    assert torch.equal(back.fixed, g[pool.SHARED_KEY].fixed)
    ctx0 = dataclasses.replace(CTX, offset=0)
    assert codec.encoded_nbytes(N, dataclasses.replace(ctx0, shared={pool.SHARED_KEY: back})) == (
        codec.encoded_nbytes(N, dataclasses.replace(ctx0, shared=g))
    )


@pytest.mark.parametrize("name", list_codecs())
def test_fake_and_meta_tensors_get_the_encoded_size(name: str) -> None:
    codec = get_codec(name)
    nbytes = codec.encoded_nbytes(N, CTX)
    with FakeTensorMode(shape_env=ShapeEnv()):
        fx, fl = torch.empty(N), torch.empty(N)
        p = codec.encode(fx, CTX)
        r = codec.reduce(p, fl, CTX, OUT)
        d = codec.decode(r, N, OUT)
    assert d.shape == (N,) and d.dtype == torch.float32
    meta = torch.empty(N, device="meta")
    if nbytes is None:  # sized from the data: a data-dependent size, which meta cannot hold
        assert isinstance(p.shape[0], torch.SymInt)
        with pytest.raises(ValueError, match="depends on the data.*meta tensors"):
            codec.encode(meta, CTX)
        with FakeTensorMode(), pytest.raises(ValueError, match="without a ShapeEnv"):
            codec.encode(torch.empty(N), CTX)
        return
    assert p.shape == r.shape == (nbytes,) and p.dtype == torch.uint8
    m = codec.encode(meta, CTX)
    assert m.device.type == "meta" and m.shape == (nbytes,)


def test_eager_calls_on_plain_tensors_skip_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("routed through the op")

    for op in ("encode", "decode", "reduce"):
        monkeypatch.setattr(_ops, op, refuse)
    codec = get_codec("int8")
    x, local = _data()
    p = codec.encode(x, CTX)
    codec.reduce(p, local, CTX, OUT)
    K.decode(codec, p, N, CTX, backend="reference")
    with pytest.raises(AssertionError, match="routed"):
        codec.encode(torch.empty(N, device="meta"), CTX)


@pytest.mark.parametrize("name", ["int8", "mxfp8_e4m3", "dynamiq"])
def test_opcheck(name: str) -> None:
    x, local = _data()
    codec, ctx, out = (
        _with_prologue(name, x, local) if name == "dynamiq" else (get_codec(name), CTX, OUT)
    )
    key = _ops._codec_key(codec)
    s_in, s_out = codec.shared_tensors(ctx.shared), codec.shared_tensors(out.shared)
    p = codec.encode(x, ctx)
    nbytes = codec.encoded_nbytes(N, out)
    cases = [
        (torch.ops.dynamiq.encode.default, (x, key, _ops._ints(ctx), s_in, p.numel(), "auto")),
        (torch.ops.dynamiq.decode.default, (p, N, key, _ops._ints(ctx), s_in, "auto")),
        (
            torch.ops.dynamiq.reduce.default,
            (p, local, key, _ops._ints(ctx), s_in, _ops._ints(out), s_out, nbytes, "auto"),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_a_graph_made_in_another_process_rebuilds_its_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec = get_codec({"id": "int", "bits": 5, "rounding": "stochastic"})
    x, _ = _data()
    key = _ops._codec_key(codec)
    monkeypatch.setattr(_ops, "_BY_KEY", {})  # (what a fresh process knows)
    got = torch.ops.dynamiq.encode.default(x, key, _ops._ints(CTX), [], -1, "auto")
    assert torch.equal(got, codec.encode(x, CTX))
    assert _ops._BY_KEY[key] == codec


def test_a_size_the_codec_does_not_write_is_named() -> None:
    codec = get_codec("int8")
    x, _ = _data()
    key = _ops._codec_key(codec)
    wrong = codec.encoded_nbytes(N) + 1
    with pytest.raises(RuntimeError, match="encoded_nbytes and its encode disagree"):
        torch.ops.dynamiq.encode.default(x, key, _ops._ints(CTX), [], wrong, "auto")


def test_a_prologue_result_without_a_conversion_is_named() -> None:
    codec = get_codec("int8")
    with pytest.raises(NotImplementedError, match="'int'.*shared_tensors and shared_from_tensors"):
        codec.shared_tensors({"mine": 1})
    assert codec.shared_tensors(None) == [] and codec.shared_from_tensors([]) is None
