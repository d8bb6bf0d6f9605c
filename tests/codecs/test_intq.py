"""Dynamic-range block INT: scales rounded up, symmetric codes, stochastic rounding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynamiq.codecs import HopContext, IntCodec, get_codec
from dynamiq.codecs.packing import unpack_bits
from dynamiq.testing import finite_tensors


def _scales_and_codes(codec: IntCodec, payload: torch.Tensor, n: int) -> tuple:
    nb = -(-n // codec.block_size)
    width = {"bf16": 2, "fp16": 2, "fp32": 4, "e8m0": 1}[codec.scale_format]
    raw = payload[: nb * width]
    if codec.scale_format == "e8m0":
        scales = torch.exp2(raw.double() - 127)
    else:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        scales = raw.view(dt[codec.scale_format]).double()
    codes = unpack_bits(payload[nb * width :], codec.bits, n).long()
    codes = torch.where(codes >= 1 << (codec.bits - 1), codes - (1 << codec.bits), codes)
    return scales, codes


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "e8m0"])
@pytest.mark.parametrize("bits", [2, 3, 5, 8])
@given(x=finite_tensors(32, max_abs=1e4, dtypes=("float32",)))
def test_scale_is_smallest_representable_at_least_absmax_over_qmax(
    fmt: str, bits: int, x: torch.Tensor
) -> None:
    codec = IntCodec(bits=bits, scale_format=fmt)
    scales, codes = _scales_and_codes(codec, codec.encode(x), x.numel())
    qmax = codec.qmax
    for b, s in enumerate(scales.tolist()):
        blk = x[32 * b : 32 * b + 32].double()
        amax = float(blk.abs().max())
        if amax == 0:
            assert s == (2.0**-127 if fmt == "e8m0" else 0.0)
            continue
        assert s * qmax >= amax, "scale rounded up: |x| / S <= qmax"
        below = s / 2 if fmt == "e8m0" else float(np.nextafter(np.float32(s), np.float32(0)))
        if fmt in ("bf16", "fp16"):
            dt = torch.bfloat16 if fmt == "bf16" else torch.float16
            below = float((torch.tensor([s], dtype=dt).view(torch.int16) - 1).view(dt))
        if fmt == "e8m0" and s == 2.0**-127:
            continue  # the smallest E8M0 scale: nothing below it
        assert below is not None and below * qmax < amax, "no smaller representable scale works"
    assert bool((codes.abs() <= qmax).all()), "codes never exceed qmax (never clamped)"
    assert not bool((codes == -(1 << (bits - 1))).any()), "-2^(b-1) is never written"


def test_nearest_rounding_against_fp64_reference() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(32 * 64) * np.exp2(rng.integers(-20, 20, 32 * 64))).astype(np.float32)
    codec = IntCodec(bits=4, scale_format="e8m0")  # power-of-two scales: x / S is exact
    scales, codes = _scales_and_codes(codec, codec.encode(torch.from_numpy(x)), x.size)
    s = np.repeat(scales.numpy(), 32)
    assert np.array_equal(codes.numpy(), np.round(x.astype(np.float64) / s).astype(np.int64))


def test_tiny_blocks_do_not_flush_silently() -> None:
    codec = IntCodec(bits=8, scale_format="fp16")
    x = torch.full((32,), 3e-9)  # absmax / qmax is below fp16's smallest subnormal 2^-24
    scales, _ = _scales_and_codes(codec, codec.encode(x), 32)
    assert float(scales[0]) == 2.0**-24  # rounded up to the smallest positive fp16
    err = (codec.decode(codec.encode(x), 32).double() - x.double()).abs()
    assert bool((err <= codec.error_bound.max_abs_error(x)).all())
    assert float(codec.error_bound.max_abs_error(x)[0]) <= 2.0**-25 * (1 + 2**-17)


@pytest.mark.parametrize(
    "fmt,limit",
    [("fp16", 65504.0 * 127), ("bf16", 2.0**127), ("fp32", 2.0**127), ("e8m0", 2.0**127)],
)
def test_out_of_range_block_is_a_clear_error(fmt: str, limit: float) -> None:
    codec = IntCodec(bits=8, scale_format=fmt)
    assert codec.max_input_abs == limit
    ok = torch.tensor([limit, -1.0], dtype=torch.float32)
    assert torch.isfinite(codec.decode(codec.encode(ok), 2)).all()
    bad = torch.tensor([float(np.nextafter(np.float32(limit), np.float32(np.inf))), 1.0])
    with pytest.raises(ValueError, match=f"exceeds max_input_abs.*scale_format='{fmt}'"):
        codec.encode(bad)


def test_bits_per_value() -> None:
    assert get_codec("int8").bits_per_value() == 8.5
    assert IntCodec(bits=4, scale_format="e8m0").bits_per_value() == 4.25
    assert IntCodec(bits=3, scale_format="fp32", block_size=64).bits_per_value() == 3.5
    assert IntCodec(bits=5).encoded_nbytes(33) == 2 * 2 + math.ceil(33 * 5 / 8)


def test_stochastic_is_a_pure_function_of_the_counter() -> None:
    codec = IntCodec(bits=3, rounding="stochastic")
    x = torch.linspace(-1, 1, 4096)
    base = HopContext(seed=1, step=2, hop=3, num_hops=8, rank=4, offset=1000)
    p = codec.encode(x, base)
    assert torch.equal(p, codec.encode(x.clone(), base))
    fields = {"seed": 2, "step": 3, "hop": 4, "rank": 5, "offset": 1032}
    for name, value in fields.items():
        other = HopContext(**{**vars(base), name: value})
        assert not torch.equal(codec.encode(x, other), p), f"{name} does not change the dither"
    # num_hops, contributions and world_size do not enter INT's dither
    same = HopContext(**{**vars(base), "num_hops": 9, "contributions": 3, "world_size": 7})
    assert torch.equal(codec.encode(x, same), p)


def test_stochastic_dither_follows_global_index() -> None:
    """Encoding a chunk at offset k equals the matching slice of encoding the whole buffer:
    randomness depends on the global element index, not on how the buffer was chunked."""
    codec = IntCodec(bits=4, rounding="stochastic", block_size=32)
    x = torch.sin(torch.arange(32 * 40, dtype=torch.float32))
    whole = codec.decode(codec.encode(x, HopContext(seed=9)), x.numel())
    part = codec.decode(codec.encode(x[320:640].contiguous(), HopContext(seed=9, offset=320)), 320)
    assert torch.equal(whole[320:640], part)


@given(st.integers(2, 8), st.integers(0, 300))
def test_roundtrip_of_representable_values_is_exact(bits: int, n: int) -> None:
    """Values that are integer multiples of a power-of-two scale round-trip exactly."""
    codec = IntCodec(bits=bits, scale_format="e8m0")
    qmax = codec.qmax
    k = torch.arange(n)
    q = torch.remainder(k * 7, 2 * qmax + 1) - qmax
    q[::32] = qmax  # every block has absmax qmax * 2^-4: scale exactly 2^-4
    x = q.float() * 2.0**-4
    assert torch.equal(codec.decode(codec.encode(x), n), x)
