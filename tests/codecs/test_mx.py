"""MX block encoding bit for bit against an independent computation on ml_dtypes casts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynamiq.codecs import MXCodec, get_codec, list_codecs
from dynamiq.codecs.packing import unpack_bits
from dynamiq.testing import finite_tensors

# codec id -> (ml_dtypes element type or None for MXINT8, emax of the element, element bits)
MX = {
    "mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 8, 8),
    "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 15, 8),
    "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 4, 6),
    "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 2, 6),
    "mxfp4": (ml_dtypes.float4_e2m1fn, 2, 4),
    "mxint8": (None, 0, 8),
}


def test_every_mx_codec_has_a_reference() -> None:
    """The table above is this file's independent reference (ml_dtypes): a registered MX
    codec missing from it would go untested here."""
    assert sorted(n for n in list_codecs() if isinstance(get_codec(n), MXCodec)) == sorted(MX)


def reference_mx(name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E8M0 scale bytes, element codes) by the OCP recipe, written with numpy + ml_dtypes."""
    elem, emax, _ = MX[name]
    n = x.size
    nb = -(-n // 32)
    scales = np.zeros(nb, dtype=np.uint8)
    codes = np.zeros(n, dtype=np.uint8)
    for b in range(nb):
        v = x[32 * b : 32 * b + 32].astype(np.float64)
        amax = np.max(np.abs(v))
        if not np.isfinite(amax):
            scales[b] = 0xFF
            continue  # element codes are 0 in a NaN block
        if amax == 0:
            shared = -127
        else:
            _, e = np.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
            shared = int(e) - 1 - emax
        shared = max(-127, min(127, shared))
        scales[b] = shared + 127
        scaled = v / 2.0**shared  # exact: power-of-two scaling in fp64
        if elem is None:
            q = np.clip(np.round(scaled * 64), -127, 127).astype(np.int64)  # np.round: RNE
            codes[32 * b : 32 * b + 32] = (q & 0xFF).astype(np.uint8)
        else:
            top = float(ml_dtypes.finfo(elem).max)
            clipped = np.clip(scaled, -top, top)  # the MX saturation rule
            codes[32 * b : 32 * b + 32] = clipped.astype(elem).view(np.uint8)
    return scales, codes


def _split(name: str, payload: torch.Tensor, n: int) -> tuple[np.ndarray, np.ndarray]:
    nb = -(-n // 32)
    bits = MX[name][2]
    return payload[:nb].numpy(), unpack_bits(payload[nb:], bits, n).numpy()


@pytest.mark.parametrize("name", list(MX))
@given(x=finite_tensors(32, dtypes=("float32", "bfloat16", "float16")))
def test_block_encoding_matches_ml_dtypes_reference(name: str, x: torch.Tensor) -> None:
    codec = get_codec(name)
    scales, codes = _split(name, codec.encode(x), x.numel())
    ref_scales, ref_codes = reference_mx(name, x.float().numpy())
    assert np.array_equal(scales, ref_scales)
    mask = np.repeat(ref_scales != 0xFF, 32)[: x.numel()]
    # ml_dtypes' code for -0.0 and our code agree too (sign bit kept)
    assert np.array_equal(codes[mask], ref_codes[mask])


@pytest.mark.parametrize("name", list(MX))
def test_decode_is_scale_times_element(name: str) -> None:
    elem, _, _ = MX[name]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(32 * 50) * np.exp2(rng.integers(-140, 120, 32 * 50))).astype(
        np.float32
    )
    codec = get_codec(name)
    y = codec.decode(codec.encode(torch.from_numpy(x)), x.size).numpy()
    scales, codes = reference_mx(name, x)
    if elem is None:
        vals = codes.view(np.int8).astype(np.float64) / 64
    else:
        vals = codes.view(elem).astype(np.float64)
    ref = vals * np.exp2(np.repeat(scales.astype(np.float64) - 127, 32))
    assert np.array_equal(y.astype(np.float64), ref)  # decode is exact in fp32


@pytest.mark.parametrize("name", list(MX))
def test_special_blocks(name: str) -> None:
    codec = get_codec(name)
    x = torch.zeros(32 * 5 + 7)
    x[32:64] = 1e-42  # fp32 subnormals: the scale clamps at 2^-127
    x[64] = float("nan")
    x[96:128] = torch.tensor([3.4e38, -3.0e38, 1.0, -2.0e38] * 8)  # huge: saturate, finite
    x[130] = float("-inf")
    payload = codec.encode(x)
    nb = 6
    scales = payload[:nb].tolist()
    assert scales[0] == 0 and scales[1] == 0, "zero block and tiny block: smallest scale"
    assert scales[2] == 0xFF and scales[4] == 0xFF, "NaN / Inf blocks: NaN scale"
    y = codec.decode(payload, x.numel())
    assert torch.isnan(y[64:96]).all() and torch.isnan(y[128:160]).all()
    assert torch.isfinite(y[96:128]).all() and (y[0:32] == 0).all()
    assert torch.isfinite(y[160:]).all()


def test_wire_sizes_and_bits_per_value() -> None:
    expected = {
        "mxfp8_e4m3": 8.25,
        "mxfp8_e5m2": 8.25,
        "mxfp6_e3m2": 6.25,
        "mxfp6_e2m3": 6.25,
        "mxfp4": 4.25,
        "mxint8": 8.25,
    }
    for name, bpv in expected.items():
        codec = get_codec(name)
        assert codec.bits_per_value() == bpv
        assert codec.encoded_nbytes(0) == 0
        assert codec.encoded_nbytes(1) == 1 + 1
        assert codec.encoded_nbytes(33) == 2 + (33 * MX[name][2] + 7) // 8


def test_fp4_packing_order() -> None:
    """Two fp4 codes per byte, element 0 in the low nibble (docs/formats.md)."""
    codec = get_codec("mxfp4")
    x = torch.tensor([1.0, 6.0, -0.5, 0.0] + [0.0] * 28)  # amax 6 -> shared exp 0
    payload = codec.encode(x)
    assert payload[0] == 127
    assert payload[1] == 0x72 and payload[2] == 0x09  # (6.0:0x7)<<4 | (1.0:0x2); 0x0<<4 | 0x9


@given(st.integers(0, 200))
def test_mx_empty_and_remainders(n: int) -> None:
    codec = get_codec("mxfp6_e2m3")
    x = torch.linspace(-1, 1, n)
    assert codec.decode(codec.encode(x), n).shape == (n,)
