"""The rows kernels of the 8- and 4-bit INT and MX codecs (``_int_rows_kernel``,
``_mx_rows_kernel``) against the reference, bit for bit, on inputs aimed at their shortcuts.

Those kernels replace the general ``[ROWS, G, 8]`` kernels' integer arithmetic by float
operations that are exact only by an argument (``kernels/intq._bf16_int_scale``,
``kernels/mx._encode_fast`` / ``_decode_fast``, the rounding by ``(q + 1.5 * 2^23) - 1.5 *
2^23``): block maxima of every magnitude, values on the rounding ties of every binade, every
code of every format decoded, and the same bytes as the general kernels. Runs in Triton's
interpreter on the CPU and natively with ``-m gpu``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_harness import DEVICE, assert_bytes_equal, interpreted_imports

with interpreted_imports():
    from dynamiq.kernels import intq as kintq
    from dynamiq.kernels import mx as kmx

import dynamiq.kernels as K
from dynamiq.codecs import HopContext, MXCodec, get_codec, list_codecs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]

INT_CONFIGS: list[Any] = [
    "int8",
    "int4",
    {"id": "int", "bits": 8, "block_size": 8},
    {"id": "int", "bits": 4, "block_size": 64},
    {"id": "int", "bits": 8, "rounding": "stochastic"},
    {"id": "int", "bits": 4, "rounding": "stochastic", "block_size": 16},
    {"id": "int", "bits": 8, "scale_format": "fp16"},
    {"id": "int", "bits": 8, "scale_format": "fp32"},
    {"id": "int", "bits": 4, "scale_format": "e8m0"},
]
#: every registered MX codec the rows kernel takes (8- and 4-bit elements: kernels/mx.py)
MX_CODECS = [
    n for n in list_codecs() if isinstance(c := get_codec(n), MXCodec) and c.element.bits in (8, 4)
]
CTX = HopContext(seed=3, step=1, hop=1, num_hops=4, rank=1, offset=2**32 - 100)


def _blocks(codec: Any, nb: int, seed: int) -> torch.Tensor:
    """``nb`` blocks, each with its maximum drawn from every finite magnitude (random fp32 bit
    patterns up to ``max_input_abs``) and the rest: fractions of it, ties ``(k + 1/2) *
    2^e`` on the grid below it, random bit patterns under it, zeros, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    b = codec.block_size
    top = torch.tensor([min(codec.max_input_abs, 3.4e38)]).view(torch.int32).item()
    amax = torch.randint(1, int(top), (nb, 1), generator=g, dtype=torch.int32)
    amax = amax.view(torch.float32)
    kind = torch.randint(0, 5, (nb, b), generator=g)
    x = amax * torch.rand(nb, b, generator=g)
    k = torch.randint(0, 128, (nb, b), generator=g).float()
    e = torch.randint(-24, 1, (nb, b), generator=g).float()
    x = torch.where(kind == 1, amax * (k + 0.5) * torch.exp2(e) / 128, x)
    bits = torch.randint(0, 0x7F7FFFFF, (nb, b), generator=g, dtype=torch.int32)
    x = torch.where(kind == 2, torch.minimum(bits.view(torch.float32), amax), x)
    x = torch.where(kind == 3, torch.zeros(()), x)
    x[:, 0] = amax[:, 0]
    sign = torch.where(torch.rand(nb, b, generator=g) < 0.5, -1.0, 1.0)
    return (x * sign).reshape(-1)


@pytest.fixture
def general_path() -> Iterator[None]:
    """Send 8- and 4-bit codes through the general kernels for the test's duration."""
    saved = kintq.ROWS_PATH, kmx.ROWS_PATH
    kintq.ROWS_PATH = kmx.ROWS_PATH = False
    yield
    kintq.ROWS_PATH, kmx.ROWS_PATH = saved


def _check(codec: Any, x: torch.Tensor, local: torch.Tensor, kernel: str) -> torch.Tensor:
    x, local = x.to(DEVICE), local.to(DEVICE)
    before = K.launch_counts().get(kernel, 0)
    got = K.encode(codec, x, CTX, backend="triton")
    assert K.launch_counts().get(kernel, 0) == before + 1, f"{kernel} did not run"
    assert_bytes_equal(got, K.encode(codec, x, CTX, backend="reference"), "encode")
    # halves: the sum stays within max_input_abs (the INT codecs raise beyond it)
    half = K.encode(codec, x * 0.5, CTX, backend="reference")
    got_r = K.reduce(codec, half, local * 0.5, CTX, CTX, backend="triton")
    want_r = K.reduce(codec, half, local * 0.5, CTX, CTX, backend="reference")
    assert_bytes_equal(got_r, want_r, "reduce")
    return got_r


@pytest.mark.parametrize("config", INT_CONFIGS, ids=str)
def test_int_rows_kernel_on_every_magnitude(config: Any) -> None:
    codec = get_codec(config)
    x = _blocks(codec, 1024, 1)
    _check(codec, x, _blocks(codec, 1024, 2).flip(0), "_int_rows_kernel")
    # a last partial block, and the local slice in bf16 / fp16
    n = x.numel() - codec.block_size // 2 - 1
    _check(codec, x[:n], x[:n].flip(0).to(torch.bfloat16), "_int_rows_kernel")
    _check(codec, x[:n] * 1e-30, x[:n].flip(0).to(torch.float16), "_int_rows_kernel")


@pytest.mark.parametrize("name", MX_CODECS)
def test_mx_rows_kernel_on_every_magnitude(name: str) -> None:
    codec = get_codec(name)
    x = _blocks(codec, 1024, 3)
    _check(codec, x, _blocks(codec, 1024, 4).flip(0), "_mx_rows_kernel")
    n = x.numel() - 7
    _check(codec, x[:n], x[:n].flip(0).to(torch.bfloat16), "_mx_rows_kernel")


@pytest.mark.parametrize("name", [*MX_CODECS, "int8", "int4"])
def test_rows_kernels_decode_every_code(name: str) -> None:
    """Payloads holding every byte value (so every code) under random scales, reduced with a
    local slice of NaN, Inf, zeros and values: the decode shortcut for each code."""
    codec = get_codec(name)
    n = 8192
    g = torch.Generator().manual_seed(5)
    payload = K.encode(codec, torch.randn(n, generator=g), CTX, backend="reference")
    bits = codec.element.bits if name.startswith("mx") else codec.bits
    nscale = payload.numel() - n * bits // 8
    payload[nscale:] = torch.arange(payload.numel() - nscale).remainder(256).to(torch.uint8)
    if name.startswith("mx"):  # every scale byte but NaN's, then NaN
        payload[:nscale] = torch.randint(0, 255, (nscale,), generator=g, dtype=torch.uint8)
        payload[nscale - 1] = 0xFF
    local = torch.randn(n, generator=g)
    local[::97] = float("nan")
    local[::101] = float("-inf")
    local[::7] = 0.0
    got = K.reduce(codec, payload.to(DEVICE), local.to(DEVICE), CTX, CTX, backend="triton")
    want = K.reduce(codec, payload, local, CTX, CTX, backend="reference")
    assert_bytes_equal(got, want, "reduce")


@pytest.mark.parametrize("name", ["int8", "int4", "mxfp8_e4m3", "mxfp4"])
def test_rows_kernels_write_the_general_kernels_bytes(
    name: str, request: pytest.FixtureRequest
) -> None:
    codec = get_codec(name)
    x, local = _blocks(codec, 256, 6), _blocks(codec, 256, 7)
    rows = _check(
        codec, x, local, "_int_rows_kernel" if name.startswith("int") else "_mx_rows_kernel"
    )
    request.getfixturevalue("general_path")
    general = _check(
        codec, x, local, "_int_encode_kernel" if name.startswith("int") else "_mx_encode_kernel"
    )
    assert_bytes_equal(rows, general, "rows vs general kernel")
