"""The native CPU kernel of the declarative block formats (``dq_blk_run``) against the
PyTorch reference (dynamiq/codecs/blockfmt.py), bit for bit: payload bytes, and decoded fp32
values as int32 views (NaN by position). Inputs aim at element ties, E4M3/E5M2 scale ties,
subnormal and saturated block scales, NaN/±Inf blocks, every remainder, fp32/bf16/fp16, the
prologue's tensor scale with several contribution counts, arbitrary payload bytes, threads."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_harness import assert_values_equal

import dynamiq.kernels as K
from dynamiq.codecs import BlockCodec, HopContext, get_codec
from dynamiq.codecs.blockfmt import TENSOR_AMAX_KEY
from dynamiq.kernels import cpu_native

if cpu_native._compiler() is None:
    pytest.skip("no C++ compiler: the native CPU kernels cannot be built", allow_module_level=True)

CODECS = [
    get_codec("nvfp4"),
    BlockCodec(element="float4_e2m1fn", block_size=32, scale="float8_e5m2", tensor_scale=False),
    BlockCodec(element="float8_e4m3fn", block_size=128),
    BlockCodec(element="float8_e5m2", block_size=8, tensor_scale=False),
    BlockCodec(element="int8", block_size=64, scale="float8_e4m3fn"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(v: float) -> int:
    return int(torch.tensor([v], dtype=torch.float32).view(torch.int32))


def _ctxs() -> list[HopContext]:
    return [
        HopContext(),
        HopContext(contributions=3, shared={TENSOR_AMAX_KEY: _bits(1000.0)}),
        HopContext(contributions=64, shared={TENSOR_AMAX_KEY: _bits(2.0**-100)}),
        HopContext(contributions=1, shared={TENSOR_AMAX_KEY: _bits(3.0e38)}),
    ]


def edge_values(codec: BlockCodec) -> torch.Tensor:
    """One pattern per block: ties between neighbouring elements at several block scales,
    scale ties and subnormal scales, saturation, zeros, -0.0, NaN, ±Inf, fp32 extremes."""
    fe = codec.elem
    table = fe.decode_table()
    pos = table[torch.isfinite(table) & (table > 0)].double().unique()
    mids = ((pos[1:] + pos[:-1]) / 2).tolist()
    blocks: list[list[float]] = []
    for t in (1.0, 1.0625, 1.1875, 2.0**-9, 3 * 2.0**-10, 2.0**-10, 2.0**-17, 448.0, 500.0, 7e4):
        blocks.append([fe.max * t] + [m * t * (-1) ** i for i, m in enumerate(mids)])
    blocks += [[0.0], [-0.0, 0.0], [math.nan, 1.0], [math.inf, -2.0], [-math.inf], [2.0**-149]]
    blocks += [[float.fromhex("0x1.fffffep127"), -1.0], [1e-30, 3e-31, -7e-32]]
    bs = codec.block_size
    out: list[float] = []
    for blk in blocks:
        out.extend((blk * (-(-bs // len(blk))))[:bs])
    return torch.tensor(out, dtype=torch.float64).to(torch.float32)


def random_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g) / 2)
    return x.float()


def check_all(
    codec: BlockCodec, x: torch.Tensor, local: torch.Tensor, what: str, ctxs: int = 4
) -> None:
    for ctx in _ctxs()[:ctxs]:
        out_ctx = ctx if ctx.shared is None else HopContext(contributions=ctx.contributions + 1,
                                                            shared=ctx.shared)  # fmt: skip
        want = codec._encode(x, ctx)
        got = K.encode(codec, x, ctx, "cpu")
        assert torch.equal(got, want), f"{codec!r} {what} encode {ctx}"
        assert_values_equal(K.decode(codec, want, x.numel(), ctx, "cpu"),
                            codec._decode(want, x.numel(), ctx), f"{what} decode")  # fmt: skip
        got = K.reduce(codec, want, local, ctx, out_ctx, "cpu")
        assert torch.equal(got, codec._reduce(want, local, ctx, out_ctx)), f"{what} reduce"


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    top = torch.finfo(dtype).max
    return torch.where(torch.isfinite(x), x.clamp(-top, top), x).to(dtype)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_edge_table(codec: BlockCodec) -> None:
    x = edge_values(codec)
    local = random_values(x.numel(), 1)
    for dtype in DTYPES:
        check_all(codec, _as(x, dtype), _as(local, dtype), f"edge {dtype}")
        check_all(codec, _as(x, dtype)[:-3], _as(local, dtype)[:-3], f"edge remainder {dtype}")


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_random_values_and_remainders(codec: BlockCodec) -> None:
    bs = codec.block_size
    for i, n in enumerate(sorted({1, 7, 9, bs - 1, bs + 1, 3 * bs + 5, 1000})):
        check_all(codec, random_values(n, i), random_values(n, 50 + i), f"n={n}", ctxs=2)


@pytest.mark.slow
def test_two_threads() -> None:
    """More than ``cpu_native._PER_THREAD`` values: two threads, each its own blocks."""
    n = 70001
    check_all(get_codec("nvfp4"), random_values(n, 7), random_values(n, 8), "threads", ctxs=2)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_arbitrary_payload_bytes(codec: BlockCodec) -> None:
    """decode and reduce of payloads no encoder wrote (any G, NaN scales, any codes)."""
    g = torch.Generator().manual_seed(3)
    ctx = _ctxs()[1]
    for n in (1, 45, 300):
        payload = torch.randint(0, 256, (codec.encoded_nbytes(n),), generator=g, dtype=torch.uint8)
        want = codec._decode(payload, n, ctx)
        assert_values_equal(K.decode(codec, payload, n, ctx, "cpu"), want, "arbitrary decode")
        local = random_values(n, n)
        got = K.reduce(codec, payload, local, ctx, ctx, "cpu")
        assert torch.equal(got, codec._reduce(payload, local, ctx, ctx)), "arbitrary reduce"


def test_auto_runs_native_and_plugin_subclasses_inherit_it() -> None:
    """``backend="auto"`` takes the native kernel for large CPU tensors; a subclass that only
    declares data inherits it, one that overrides the reference does not."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True, kw_only=True)
    class Declared(BlockCodec):
        codec_id: ClassVar[str] = "declared_fp8_block"
        element: str = "float8_e4m3fn"
        block_size: int = 32

    @dataclass(frozen=True, kw_only=True)
    class Changed(BlockCodec):
        codec_id: ClassVar[str] = "changed_block"

        def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            return super()._encode(x, ctx)

    x = random_values(1 << 13, 9)
    for codec, backend in ((get_codec("nvfp4"), "cpu"), (Declared(), "cpu")):
        codec.encode(x)
        assert K.last_backend() == backend, codec
        assert K.has_kernels(codec)
    assert not K.has_kernels(Changed())
    with pytest.raises(NotImplementedError, match="no native CPU kernel"):
        K.encode(Changed(), x, backend="cpu")
    # a declaration the generic kernels do not implement runs on the reference
    odd = BlockCodec(block_size=24)
    assert not K.has_kernels(odd)
    odd.encode(x)
    assert K.last_backend() == "reference"
