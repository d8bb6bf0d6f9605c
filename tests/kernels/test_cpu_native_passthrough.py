"""The native CPU kernels of the pass-through codecs (``fp32``, ``bf16``, ``fp16``;
``csrc/passthrough_kernels.cpp``) against the PyTorch reference, bit for bit.

Every check forces ``backend="cpu"`` (proved by the launch counter) and compares payload bytes
with no tolerance, except where the reference's bits are the hardware's choice: the NaN an fp32
addition returns (the ``fp32`` codec's reduce payload, and every decoded value), compared by
position. Inputs: every kind of edge value of the three types (signed zeros, subnormals, the
smallest normals, the largest finite values and what lies beyond them, rounding ties, NaN with
payloads, ±Inf), random bit patterns, fp32/bf16/fp16 inputs, lengths across tile and thread
boundaries; and a slow test of every fp32 bit pattern.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_harness import assert_bytes_equal, assert_values_equal, both

import dynamiq.kernels as K
from dynamiq.codecs import Codec, HopContext, get_codec
from dynamiq.kernels import cpu_native

if cpu_native._compiler() is None:
    pytest.skip(
        "no C++ compiler on this machine (CXX, g++, c++, clang++): the native CPU kernels "
        "cannot be built here",
        allow_module_level=True,
    )

NAMES = ["fp32", "bf16", "fp16"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CTX, OUT_CTX = HopContext(hop=0, num_hops=2), HopContext(hop=1, num_hops=2, contributions=2)


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def edge_values() -> torch.Tensor:
    """fp32 values on and around every boundary of the three types' conversions."""
    out: list[torch.Tensor] = []
    # (type, mantissa bits, fp32 bits below its mantissa in the normal range)
    for dtype, nmant, step in ((torch.bfloat16, 7, 16), (torch.float16, 10, 13)):
        fi = torch.finfo(dtype)
        sub = fi.smallest_normal * 2.0**-nmant  # the smallest subnormal
        landmarks = [0.0, sub, 3 * sub, fi.smallest_normal - sub, fi.smallest_normal, 1.0, 1.5]
        landmarks.append(fi.max)
        bits = torch.tensor(landmarks, dtype=torch.float32).view(torch.int32).to(torch.int64)
        # the value, fp32 ulps either side, and the ties halfway to the neighbours
        half = 1 << (step - 1)
        for d in (-half - 1, -half, -half + 1, -1, 0, 1, half - 1, half, half + 1, 3 * half):
            out.append(_f32((bits + d).clamp(0, 0x7F7FFFFF).tolist()))
    out.append(_f32([0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FA00001, 0x7F800001, 0x7FFFFFFF]))
    out.append(_f32([0x00000001, 0x007FFFFF, 0x00800000, 0x33000000, 0x33000001, 0x337FFFFF]))
    out.append(_f32([0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x7F7F7FFF, 0x7F7F8000]))
    # ties to even in the normal range: mantissa ...1|1000 and ...0|1000 for both types
    out.append(_f32([0x3F808000, 0x3F818000, 0x3F801000, 0x3F803000, 0x38801000, 0x38803000]))
    x = torch.cat(out)
    return torch.cat([x, -x])


def random_bits(n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns (every exponent alike: NaN, Inf, subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if dtype == torch.float32 else x.to(dtype)


def check_all(codec: Codec, x: torch.Tensor, local: torch.Tensor, what: str) -> None:
    """encode, decode and the fused reduce on the native backend == the reference."""
    n = x.numel()
    what = f"{codec.codec_id} n={n} {x.dtype}/{local.dtype} {what}"
    got, want = both(K.encode, codec, x, CTX, fast="cpu")
    assert_bytes_equal(got, want, f"{what} encode")
    got, want = both(K.decode, codec, want, n, CTX, fast="cpu")
    assert_values_equal(got, want, f"{what} decode")
    payload = codec._encode(x, CTX)
    got, want = both(K.reduce, codec, payload, local, CTX, OUT_CTX, fast="cpu")
    if codec.codec_id == "fp32":  # the payload is the fp32 sum: NaN bits are the hardware's
        assert_values_equal(got.view(torch.float32), want.view(torch.float32), f"{what} reduce")
    else:
        assert_bytes_equal(got, want, f"{what} reduce")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_values(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name)
    x = edge_values()
    local = torch.flip(x, [0])  # edge values meet edge values in the sum
    for ldtype in DTYPES:
        check_all(codec, as_dtype(x, dtype), as_dtype(local, ldtype), "edges")


@pytest.mark.parametrize("name", NAMES)
def test_random_bit_patterns_and_lengths(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths around the tiles (16384 values) split over 1 and 3 threads."""
    monkeypatch.setattr(cpu_native, "_PER_THREAD", 64)  # threads even for small inputs
    codec = get_codec(name)
    threads = torch.get_num_threads()
    try:
        for nt in (3, 1):
            torch.set_num_threads(nt)
            for i, n in enumerate((0, 1, 7, 16383, 16385, 3 * 16384 + 5)):
                dtype, ldtype = DTYPES[i % 3], DTYPES[(i + nt) % 3]
                x, local = random_bits(n, 2 * i), random_bits(n, 2 * i + 1)
                check_all(codec, as_dtype(x, dtype), as_dtype(local, ldtype), f"{nt} threads")
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    dtype=st.sampled_from(DTYPES),
    ldtype=st.sampled_from(DTYPES),
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
        max_size=300,
    ),
)
def test_hypothesis(
    name: str, dtype: torch.dtype, ldtype: torch.dtype, values: list[float]
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    check_all(get_codec(name), as_dtype(x, dtype), as_dtype(x.flip(0) * 3, ldtype), "hypothesis")


def test_auto_runs_them_on_large_cpu_inputs() -> None:
    x = random_bits(cpu_native.MIN_NUMEL, 5)
    for name in NAMES:
        codec = get_codec(name)
        payload = codec.encode(x)
        assert K.last_backend() == "cpu"
        assert torch.equal(payload, codec._encode(x, HopContext()))
        codec.encode(x[:100])
        assert K.last_backend() == "reference"  # small inputs: the reference


@pytest.mark.slow
def test_every_fp32_bit_pattern() -> None:
    """The bf16 and fp16 encodes of all 2^32 fp32 values, against the reference (about two
    minutes on 2 cores)."""
    chunk = 1 << 26
    for k in range((1 << 32) // chunk):
        bits = torch.arange(k * chunk, (k + 1) * chunk, dtype=torch.int64)
        x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
        for name in ("bf16", "fp16"):
            codec = get_codec(name)
            got = K.encode(codec, x, backend="cpu")
            assert_bytes_equal(got, codec._encode(x, HopContext()), f"{name} chunk {k}")
