"""The readable DynamiQ reference (``dynamiq/codecs/dynamiq_reference.py``) is the normative
one: under a real prologue result (the default ``pooling="bucket"``), the batched PyTorch codec
and the native CPU kernels give its sizes, bytes, decoded values, reduced payloads and bounds,
bit for bit; it reproduces every golden DynamiQ fixture (the pooled one's re-cut chunks
included). The Triton kernels' side is ``tests/kernels/test_dynamiq_reference_kernels.py``;
every other knob, without a prologue, is ``test_dynamiq_codec.py``'s."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynamiq.kernels as K
from dynamiq.codecs import DynamiqCodec, HopContext, get_codec
from dynamiq.codecs.dynamiq_reference import DynamiqReference
from dynamiq.collectives.handshake import local_prologues
from dynamiq.kernels import cpu_native
from dynamiq.testing.golden import fixture_context
from dynamiq.testing.strategies import finite_tensors

FIXTURES = Path(__file__).parents[1] / "fixtures"
SPAN = 256  # the default configuration's span


def layered(n: int, seed: int) -> torch.Tensor:
    """Layer-like gradients: runs of 700 values at scales 2^-30 .. 2^3 (heavy-tailed within),
    a zero group and a subnormal group."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 4, (n // 700 + 1,), generator=g).float())
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    x = x * scale.repeat_interleave(700)[:n]
    x[16:32] = 0.0
    x[48:64] = 2.0**-140
    return x


def pooled(
    codec: DynamiqCodec, xs: list[torch.Tensor], chunks: list[tuple[int, int]] | None
) -> tuple[HopContext, HopContext]:
    """A hop's context and the next hop's, both holding the result of the prologue that
    ``len(xs)`` in-process ranks ran on their buffers ``xs``."""
    shared = local_prologues(codec, xs, chunks, timeout=30.0)[0][0]
    assert shared is not None
    ctx = HopContext(shared=shared, seed=5, step=2, hop=1, num_hops=3, rank=1)
    return ctx, dataclasses.replace(ctx, hop=2, rank=2)


def _same_values(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    bits = torch.int32 if got.dtype == torch.float32 else torch.int64
    got_b, want_b = got.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits)
    assert torch.equal(got_b, want_b), f"{what}: {int((got_b != want_b).sum())} values differ"


def _same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: {got.numel()} bytes, want {want.numel()}"
    diff = (got != want).nonzero()
    assert diff.numel() == 0, (
        f"{what}: first differing byte {int(diff[0, 0]) if diff.numel() else 0}"
    )


def reference_outputs(
    codec: DynamiqCodec, x: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
) -> dict[str, Any]:
    ref = DynamiqReference(codec)
    payload = ref.encode(x, ctx)
    assert payload.numel() == ref.encoded_nbytes(x.numel(), ctx)
    return {
        "nbytes": payload.numel(),
        "payload": payload,
        "decoded": ref.decode(payload, x.numel(), ctx),
        "reduced": ref.reduce(payload, local, ctx, out_ctx),
        "max_abs": ref.max_abs(x, ctx),
    }


def check_batched(
    codec: DynamiqCodec, x: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
) -> dict[str, Any]:
    """The batched codec (``_encode``, ``_decode``, ``_reduce``, the bound) gives the
    reference's sizes and outputs; returns the reference's."""
    want = reference_outputs(codec, x, local, ctx, out_ctx)
    n, p = x.numel(), want["payload"]
    assert codec.encoded_nbytes(n, ctx) == want["nbytes"], "encoded_nbytes"
    _same_bytes(codec._encode(x, ctx), p, "batched encode")
    _same_values(codec._decode(p, n, ctx), want["decoded"], "batched decode")
    _same_bytes(codec._reduce(p, local, ctx, out_ctx), want["reduced"], "batched reduce")
    _same_values(codec.error_bound.max_abs_error(x, ctx), want["max_abs"], "batched max_abs")
    return want


def check_native(
    codec: DynamiqCodec,
    x: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    want: dict[str, Any],
) -> None:
    """The native CPU kernels (``backend="cpu"``, forced: they must run) give the
    reference's bytes and values."""
    if cpu_native._compiler() is None:
        pytest.skip("no C++ compiler: the native CPU kernels cannot be built here")
    n, p = x.numel(), want["payload"]
    _same_bytes(K.encode(codec, x, ctx, backend="cpu"), p, "native encode")
    assert K.last_backend() == "cpu"
    _same_values(K.decode(codec, p, n, ctx, backend="cpu"), want["decoded"], "native decode")
    got = K.reduce(codec, p, local, ctx, out_ctx, backend="cpu")
    _same_bytes(got, want["reduced"], "native reduce")


def check_all(
    codec: DynamiqCodec, x: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
) -> None:
    want = check_batched(codec, x, local, ctx, out_ctx)
    check_native(codec, x, local, ctx, out_ctx, want)


#: sizes around the group (16) and span (256), a two-region buffer and a longer one
SIZES = [1, 15, 16, 17, 255, 256, 257, 8 * SPAN, 8 * SPAN + 1, 23 * SPAN + 77]


def _chunks(n: int) -> list[tuple[int, int]] | None:
    """Two regions (the engine's chunks) where the buffer holds more than 8 spans."""
    return [(0, 8 * SPAN), (8 * SPAN, n)] if n > 8 * SPAN else None


@pytest.mark.parametrize("n", SIZES)
def test_default_config_under_a_prologue(n: int) -> None:
    codec = DynamiqCodec()
    xs = [layered(n, s) for s in range(2)]
    ctx, out_ctx = pooled(codec, xs, _chunks(n))
    check_all(codec, xs[0], xs[1], ctx, out_ctx)


def test_the_budgets_are_the_prologues() -> None:
    """The reference's budgets are the prologue's (unequal across spans, each a whole number
    of bytes, the bucket's bytes in all), not ``floor(bits · len)``; without the result in
    the context, or for ``pooling="span"``, they are."""
    codec = DynamiqCodec()
    n = 23 * SPAN + 77
    xs = [layered(n, s) for s in range(2)]
    ctx, _ = pooled(codec, xs, _chunks(n))
    ref = DynamiqReference(codec)
    got = ref.budgets(n, ctx)
    uniform = [math.floor(codec.bits * min(SPAN, n - a)) for a in range(0, n, SPAN)]
    assert len(got) == len(uniform) and len(set(got)) > 2 and got != uniform
    assert all(b % 8 == 0 for b in got)
    assert sum(got) <= 8 * (math.floor(codec.bits * n) // 8)
    assert ref.budgets(n, HopContext()) == uniform
    span_ref = DynamiqReference(DynamiqCodec(pooling="span"))
    assert span_ref.budgets(n, ctx) == uniform


def test_sub_chunks_at_offsets() -> None:
    """Chunks of the buffer at their offsets (inside a region, across the regions' border, a
    region's short end) take the prologue's budgets of their own spans."""
    codec = DynamiqCodec()
    n = 23 * SPAN + 77
    xs = [layered(n, s) for s in range(2)]
    ctx, out_ctx = pooled(codec, xs, _chunks(n))
    for a, b in ((3 * SPAN, 8 * SPAN), (5 * SPAN, 12 * SPAN), (8 * SPAN, n)):
        sub, sub_out = (dataclasses.replace(c, offset=a) for c in (ctx, out_ctx))
        x, local = xs[0][a:b].contiguous(), xs[1][a:b].contiguous()
        check_all(codec, x, local, sub, sub_out)


def test_zeros_and_non_finite_values() -> None:
    """A whole span of zeros (a demand of 0), a zero buffer on another rank, NaN in one
    super-group and -Inf in another: each decodes as the reference says."""
    codec = DynamiqCodec()
    n = 12 * SPAN + 5
    x = layered(n, 7)
    x[2 * SPAN : 3 * SPAN] = 0.0
    x[5 * SPAN + 3] = math.nan
    x[9 * SPAN + 100] = -math.inf
    ctx, out_ctx = pooled(codec, [x, torch.zeros(n)], _chunks(n))
    check_all(codec, x, layered(n, 8).bfloat16(), ctx, out_ctx)


def test_an_all_zero_bucket() -> None:
    """No rank demands anything: the bytes are shared evenly."""
    codec = DynamiqCodec()
    n = 4 * SPAN + 9
    ctx, out_ctx = pooled(codec, [torch.zeros(n), torch.zeros(n)], None)
    check_all(codec, torch.zeros(n), layered(n, 9), ctx, out_ctx)


@st.composite
def buffers(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[tuple[int, int]] | None]:
    """Two ranks' finite buffers of one length (all dtypes, magnitudes subnormal to 2^100) and
    the engine's chunks: none, or a cut on a span."""
    n = draw(st.integers(1, 12 * SPAN), label="n")
    xs = [draw(finite_tensors(SPAN, size=n, max_abs=2.0**100), label=f"rank {r}") for r in range(2)]
    cut = draw(st.none() | st.integers(1, max(1, (n - 1) // SPAN)), label="cut")
    chunks = None if cut is None or cut * SPAN >= n else [(0, cut * SPAN), (cut * SPAN, n)]
    return xs, chunks


@settings(max_examples=min(25, settings.default.max_examples), deadline=None)
@given(drawn=buffers())
def test_hypothesis_buffers_under_a_prologue(
    drawn: tuple[list[torch.Tensor], list[tuple[int, int]] | None],
) -> None:
    codec = DynamiqCodec()
    xs, chunks = drawn
    ctx, out_ctx = pooled(codec, xs, chunks)
    check_all(codec, xs[0], xs[1], ctx, out_ctx)


DYNAMIQ_FIXTURES = sorted(p.name for p in FIXTURES.glob("dynamiq*") if p.is_dir())


@pytest.mark.parametrize("name", DYNAMIQ_FIXTURES)
def test_reproduces_the_golden_fixtures(name: str) -> None:
    """Every frozen DynamiQ payload, chunk by chunk at its offset (the pooled fixture: the
    chunks its prologue re-cut to equal bytes), and its decoded values."""
    folder = FIXTURES / name
    meta = json.loads((folder / "config.json").read_text())
    codec = get_codec(meta["codec"])
    assert isinstance(codec, DynamiqCodec)
    x = torch.frombuffer(bytearray((folder / "input.bin").read_bytes()), dtype=torch.float32)
    payload = torch.frombuffer(bytearray((folder / "payload.bin").read_bytes()), dtype=torch.uint8)
    decoded = torch.frombuffer(
        bytearray((folder / "decoded.bin").read_bytes()), dtype=torch.float32
    )
    ctx, pieces = fixture_context(codec, meta, x)
    ref, at, got = DynamiqReference(codec), 0, []
    for a, b in pieces:
        if b > a:
            c = dataclasses.replace(ctx, offset=ctx.offset + a)
            size = ref.encoded_nbytes(b - a, c)
            _same_bytes(ref.encode(x[a:b], c), payload[at : at + size], f"{name} {a}..{b}")
            got.append(ref.decode(payload[at : at + size], b - a, c))
            at += size
    assert at == payload.numel(), f"{name}: {at} bytes, the fixture holds {payload.numel()}"
    _same_values(torch.cat(got), decoded, f"{name} decode")
