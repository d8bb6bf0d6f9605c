"""The DynamiQ Triton kernels with pooled budgets (``pooling="bucket"``), bit-exact with the
reference (through Triton's interpreter on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_harness import interpreted_imports

with interpreted_imports():
    import dynamiq.kernels as kernels

from dynamiq.codecs import HopContext
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.collectives.handshake import local_prologues

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]


def layered(n: int, seed: int) -> torch.Tensor:
    """Blocks of 700 values at scales from 2^-30 to 2^3."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 4, (n // 700 + 1,), generator=g).float())
    return torch.randn(n, generator=g) * scale.repeat_interleave(700)[:n]


def test_triton_kernels_bit_exact_with_pooled_budgets() -> None:
    pytest.importorskip("triton")
    codec = DynamiqCodec(rounding="stochastic")
    n = 256 * 9 + 77
    xs = [layered(n, s) for s in range(2)]
    shared = local_prologues(codec, xs, [(0, 1024), (1024, n)])[0][0]
    ctx = HopContext(shared=shared, seed=3, hop=1, num_hops=3)
    out_ctx = dataclasses.replace(ctx, hop=2)
    ref = kernels.encode(codec, xs[0], ctx, backend="reference")
    assert torch.equal(ref, kernels.encode(codec, xs[0], ctx, backend="triton"))
    d_ref = kernels.decode(codec, ref, n, ctx, backend="reference")
    d_tri = kernels.decode(codec, ref, n, ctx, backend="triton")
    assert torch.equal(d_ref.view(torch.int32), d_tri.view(torch.int32))
    r_ref = kernels.reduce(codec, ref, xs[1], ctx, out_ctx, backend="reference")
    assert torch.equal(r_ref, kernels.reduce(codec, ref, xs[1], ctx, out_ctx, backend="triton"))
