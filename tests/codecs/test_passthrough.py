"""Pass-through codecs against torch's own casts; saturation and specials."""

from __future__ import annotations

import math

import pytest
import torch

from dynamiq.codecs import get_codec


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_matches_torch_rne_cast_in_range(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    x = (
        torch.randn(100_000, generator=g)
        * torch.exp2(torch.randint(-30, 30, (100_000,), generator=g))
    ).clamp(-big, big)
    codec = get_codec(name)
    assert torch.equal(codec.encode(x), x.to(dtype).view(torch.uint8))
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x.to(dtype).float())


def test_saturation_and_specials() -> None:
    codec = get_codec("fp16")
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan, 65504.0, 65520.0])
    y = codec.decode(codec.encode(x), x.numel())
    assert y[:2].tolist() == [65504.0, -65504.0]
    assert y[2] == math.inf and y[3] == -math.inf and math.isnan(y[4])
    assert y[5] == 65504.0 and y[6] == 65504.0
    bound = codec.error_bound.max_abs_error(x[:2])
    assert bound.tolist() == [1e6 - 65504.0] * 2


def test_fp32_is_exact_and_same_dtype_is_a_copy() -> None:
    x = torch.randn(1000)
    p = get_codec("fp32").encode(x)
    assert torch.equal(p.view(torch.float32), x) and p.data_ptr() != x.data_ptr()
    xb = x.bfloat16()
    assert torch.equal(get_codec("bf16").encode(xb).view(torch.bfloat16), xb)
