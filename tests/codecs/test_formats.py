"""Element formats against ml_dtypes: every encoding exhaustively, rounding edge cases."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from dynamiq.codecs.formats import (
    ELEMENT_FORMATS,
    FLOAT4_E2M1FN,
    FLOAT6_E2M3FN,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT8_E8M0FNU,
    INT8,
    exponent_of,
    get_format,
)

ML = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
    "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
}


def _ml_values(name: str) -> np.ndarray:
    fmt = get_format(name)
    return np.arange(1 << fmt.bits, dtype=np.uint8).view(ML[name]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(ML))
def test_decode_every_code_matches_ml_dtypes(name: str) -> None:
    ref = _ml_values(name)
    ours = get_format(name).decode_table().numpy()
    both_nan = np.isnan(ref) & np.isnan(ours)
    assert np.array_equal(np.isnan(ref), np.isnan(ours))
    assert np.array_equal(ref[~both_nan], ours[~both_nan])
    # signed zeros and signed infinities too
    assert np.array_equal(np.signbit(ref[~both_nan]), np.signbit(ours[~both_nan]))


@pytest.mark.parametrize("name", sorted(ML))
def test_finfo_metadata_matches_ml_dtypes(name: str) -> None:
    fmt, fi = get_format(name), ml_dtypes.finfo(ML[name])
    assert fmt.bits == fi.bits
    assert fmt.max == float(fi.max)
    assert fmt.tiny == float(fi.smallest_normal)
    assert fmt.smallest_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.nmant == fi.nmant and fmt.nexp == fi.nexp
    assert fmt.emax == math.floor(math.log2(float(fi.max)))


def _candidates(name: str) -> np.ndarray:
    """Every finite value, every midpoint between neighbours and the floats just beside each
    midpoint, values beyond max, and a wide random sweep."""
    vals = _ml_values(name)
    finite = np.unique(vals[np.isfinite(vals)].astype(np.float64))
    mids = (finite[1:] + finite[:-1]) / 2
    mids32 = mids.astype(np.float32)
    rng = np.random.default_rng(1234)
    sweep = rng.standard_normal(50_000) * np.exp2(rng.integers(-40, 40, 50_000))
    top = float(finite.max())
    parts = [
        finite.astype(np.float32),
        mids32,
        np.nextafter(mids32, np.float32(np.inf)),
        np.nextafter(mids32, np.float32(-np.inf)),
        rng.uniform(-1.5 * top, 1.5 * top, 50_000).astype(np.float32),
        sweep.astype(np.float32),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38], dtype=np.float32),
    ]
    x = np.concatenate(parts)
    return x[np.isfinite(x)]


@pytest.mark.parametrize("name", sorted(ML))
def test_encode_rne_matches_ml_dtypes_casts(name: str) -> None:
    x = _candidates(name)
    if name == "float8_e8m0fnu":
        # no sign, no zero; ml_dtypes rounds fp32 subnormal inputs in its own way (table below)
        x = np.abs(x)
        x = x[x >= np.float32(2.0**-126)]
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(ML[name]).view(np.uint8)
    ours = get_format(name).encode(torch.from_numpy(x), saturate=False).numpy()
    ref_vals = ref.view(ML[name]).astype(np.float32)
    ours_vals = get_format(name).decode_table().numpy()[ours]
    nan = np.isnan(ref_vals)
    assert np.array_equal(nan, np.isnan(ours_vals)), x[nan != np.isnan(ours_vals)][:5]
    assert np.array_equal(ref[~nan], ours[~nan]), x[~nan][ref[~nan] != ours[~nan]][:5]


@pytest.mark.parametrize("name", sorted(ML))
def test_encode_decode_identity_on_every_code(name: str) -> None:
    fmt = get_format(name)
    table = fmt.decode_table()
    codes = torch.arange(1 << fmt.bits)
    finite = torch.isfinite(table)
    back = fmt.encode(table[finite])
    assert torch.equal(
        fmt.decode_table()[back.long()].view(torch.int32), table[finite].view(torch.int32)
    )
    # the encoder writes canonical codes: each finite code maps back to itself
    assert torch.equal(back.long(), codes[finite])


# (format, fp32 input, expected code, why)
EDGE_CASES = [
    (FLOAT8_E4M3FN, 448.0, 0x7E, "largest normal"),
    (FLOAT8_E4M3FN, 464.0, 0x7E, "tie between 448 and (absent) 480: even mantissa, saturate"),
    (FLOAT8_E4M3FN, 1e6, 0x7E, "saturates to max (the MX rule)"),
    (FLOAT8_E4M3FN, -1e6, 0xFE, "saturates to -max"),
    (FLOAT8_E4M3FN, 2.0**-10, 0x00, "half the smallest subnormal: tie to even (zero)"),
    (FLOAT8_E4M3FN, 3 * 2.0**-11, 0x01, "above half the smallest subnormal rounds up"),
    (FLOAT8_E4M3FN, 1.0625, 0x38, "tie 1 vs 1.125: to even (1.0)"),
    (FLOAT8_E4M3FN, 1.1875, 0x3A, "tie 1.125 vs 1.25: to even (1.25)"),
    (FLOAT8_E4M3FN, 7.5 * 2.0**-9, 0x08, "tie largest subnormal vs smallest normal: even"),
    (FLOAT8_E5M2, 57344.0, 0x7B, "largest normal"),
    (FLOAT8_E5M2, 61440.0, 0x7B, "tie toward 65536 (Inf): saturate keeps max"),
    (FLOAT8_E5M2, 2.0**-17, 0x00, "half the smallest subnormal: to even (zero)"),
    (FLOAT8_E5M2, -0.0, 0x80, "negative zero keeps its sign"),
    (FLOAT4_E2M1FN, 0.25, 0x0, "tie 0 vs 0.5: to even (0)"),
    (FLOAT4_E2M1FN, 0.75, 0x2, "tie 0.5 vs 1: to even (1.0)"),
    (FLOAT4_E2M1FN, 2.5, 0x4, "tie 2 vs 3: to even (2)"),
    (FLOAT4_E2M1FN, 5.0, 0x6, "tie 4 vs 6: to the even mantissa (4)"),
    (FLOAT4_E2M1FN, 7.0, 0x7, "beyond max 6: saturate"),
    (FLOAT4_E2M1FN, -6.5, 0xF, "beyond -max: saturate"),
    (FLOAT6_E2M3FN, 7.75, 0x1F, "beyond max 7.5: saturate"),
    (FLOAT6_E2M3FN, 0.0625, 0x00, "tie 0 vs 0.125: to even (0)"),
    (FLOAT8_E8M0FNU, 1.0, 127, "2^0"),
    (FLOAT8_E8M0FNU, 1.5, 128, "tie between 2^0 and 2^1 rounds up (no mantissa: code 1 is odd)"),
    (FLOAT8_E8M0FNU, 1.49, 127, "below the tie rounds down"),
    (FLOAT8_E8M0FNU, 2.0**-127, 0, "smallest scale (fp32 subnormal input)"),
    (FLOAT8_E8M0FNU, 1e-45, 0, "below range: the smallest scale (there is no zero)"),
    (FLOAT8_E8M0FNU, 2.0**127, 254, "largest scale"),
    (FLOAT8_E8M0FNU, -1.0, 255, "negative: NaN"),
    (INT8, 1.0, 64, "1.0 = 64 * 2^-6"),
    (INT8, -1.0, 0xC0, "two's complement -64"),
    (INT8, 1.0 / 128, 0, "tie 0 vs 1/64: to even"),
    (INT8, 3.0 / 128, 2, "tie 1/64 vs 2/64: to even"),
    (INT8, 2.0, 127, "beyond 127/64: saturate"),
    (INT8, -2.0, 0x81, "beyond -127/64: saturate to -127 (-128 is never written)"),
]


@pytest.mark.parametrize("fmt,value,code,why", EDGE_CASES, ids=lambda v: str(v)[:24])
def test_rounding_edge_cases(fmt, value: float, code: int, why: str) -> None:  # type: ignore[no-untyped-def]
    got = int(fmt.encode(torch.tensor([value], dtype=torch.float32))[0])
    assert got == code, f"{fmt.name}({value}) = {got:#x}, expected {code:#x}: {why}"


def test_int8_element_exhaustive() -> None:
    table = INT8.decode_table().double()
    q = torch.arange(256)
    signed = torch.where(q >= 128, q - 256, q).double()
    assert torch.equal(table, signed / 64)
    # every multiple of 1/64 in range encodes exactly; -128 is never produced
    vals = torch.arange(-127, 128, dtype=torch.float32) / 64
    codes = INT8.encode(vals).long()
    assert torch.equal(table[codes].float(), vals)
    assert 0x80 not in set(INT8.encode(torch.linspace(-10, 10, 10001)).tolist())
    assert INT8.max == 127 / 64 and INT8.smallest_subnormal == 1 / 64 and INT8.emax == 0


def test_scaled_encode_is_single_rounding() -> None:
    """encode(x, scale_exp=k) == encode(x * 2^-k) whenever x * 2^-k is exact in fp32, and stays
    exact where it is not (fp32 subnormal inputs scaled up)."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy((rng.standard_normal(4000) * 2.0**-130).astype(np.float32))
    for fmt in ELEMENT_FORMATS.values():
        k = torch.full((x.numel(),), -127, dtype=torch.int64)
        got = fmt.encode(x, k)
        ref = fmt.encode((x.double() * 2.0**127).float())  # exact: scaling up loses nothing
        assert torch.equal(got, ref), fmt.name


def test_exponent_of() -> None:
    x = torch.tensor([1.0, 1.5, 2.0, 0.75, 2.0**-126, 2.0**-149, 3 * 2.0**-140, 3.4e38, 0.0])
    assert exponent_of(x).tolist() == [0, 0, 1, -1, -126, -149, -139, 127, -150]


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown element format 'float3'.*float8_e4m3fn"):
        get_format("float3")


def test_no_float8_casts_in_formats_module() -> None:
    import inspect

    import dynamiq.codecs.formats as mod

    src = inspect.getsource(mod)
    assert "torch.float8" not in src and "import ml_dtypes" not in src
