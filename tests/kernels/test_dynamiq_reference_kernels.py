"""The DynamiQ Triton kernels against the readable, normative reference
(``dynamiq/codecs/dynamiq_reference.py``) for the default configuration under a real prologue
result (``pooling="bucket"``): the same bytes, decoded values and reduced payloads (through
Triton's interpreter on the CPU). The batched codec's and the native kernels' side is
``tests/codecs/test_dynamiq_reference.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kernel_harness import DEVICE, assert_bytes_equal, assert_values_equal, interpreted_imports

with interpreted_imports():
    import dynamiq.kernels as K

from dynamiq.codecs import HopContext
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.codecs.dynamiq_reference import DynamiqReference
from dynamiq.collectives.handshake import local_prologues

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]

SPAN = 256  # the default configuration's span


def layered(n: int, seed: int) -> torch.Tensor:
    """Runs of 700 values at scales 2^-30 .. 2^3 (heavy-tailed within), a zero group."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 4, (n // 700 + 1,), generator=g).float())
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    x = x * scale.repeat_interleave(700)[:n]
    x[16:32] = 0.0
    return x


@pytest.mark.parametrize("n", [1, 17, SPAN + 1, 9 * SPAN + 77])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_triton_matches_the_reference_under_a_prologue(n: int, special: bool) -> None:
    codec = DynamiqCodec()
    xs = [layered(n, s) for s in range(2)]
    if special:  # NaN in the first super-group, -Inf in the last (of more than one)
        xs[0][0] = math.nan
        if n > SPAN:
            xs[0][-1] = -math.inf
    chunks = [(0, 4 * SPAN), (4 * SPAN, n)] if n > 4 * SPAN else None
    shared = local_prologues(codec, xs, chunks, timeout=30.0)[0][0]
    ctx = HopContext(shared=shared, seed=3, hop=1, num_hops=3, rank=1)
    out_ctx = dataclasses.replace(ctx, hop=2)
    ref = DynamiqReference(codec)
    payload = ref.encode(xs[0], ctx)
    x, local, p = xs[0].to(DEVICE), xs[1].to(DEVICE), payload.to(DEVICE)
    assert_bytes_equal(K.encode(codec, x, ctx, backend="triton"), payload, "encode")
    assert K.last_backend() == "triton"
    got = K.decode(codec, p, n, ctx, backend="triton")
    assert_values_equal(got, ref.decode(payload, n, ctx), "decode")
    got = K.reduce(codec, p, local, ctx, out_ctx, backend="triton")
    assert_bytes_equal(got, ref.reduce(payload, xs[1], ctx, out_ctx), "reduce")
