"""Bit packing against a pure-Python bit stream; the counter-based hash."""

from __future__ import annotations

import numpy as np
import torch
from hash_reference import ref_fmix32
from hypothesis import given
from hypothesis import strategies as st

from dynamiq.codecs.hashing import fmix32, hash_keys, hash_u32, uniform_open01
from dynamiq.codecs.packing import pack_bits, packed_nbytes, unpack_bits


def _reference_pack(codes: list[int], bits: int) -> bytes:
    stream = 0
    for i, c in enumerate(codes):
        stream |= (c & ((1 << bits) - 1)) << (i * bits)
    return stream.to_bytes(packed_nbytes(len(codes), bits), "little")


@given(st.integers(1, 8), st.lists(st.integers(0, 255), max_size=100))
def test_pack_matches_little_endian_bit_stream(bits: int, values: list[int]) -> None:
    codes = [v & ((1 << bits) - 1) for v in values]
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_bits(t, bits)
    assert packed.numpy().tobytes() == _reference_pack(codes, bits)
    assert unpack_bits(packed, bits, len(codes)).tolist() == codes


@given(st.integers(9, 32), st.lists(st.integers(0, 2**32 - 1), max_size=100))
def test_wide_codes_follow_the_same_bit_stream(bits: int, values: list[int]) -> None:
    """9..32-bit codes (THC's widened integer sums) travel as int64, by the same rule."""
    codes = [v & ((1 << bits) - 1) for v in values]
    packed = pack_bits(torch.tensor(codes, dtype=torch.int64), bits)
    assert packed.dtype == torch.uint8
    assert packed.numpy().tobytes() == _reference_pack(codes, bits)
    back = unpack_bits(packed, bits, len(codes))
    assert back.dtype == torch.int64 and back.tolist() == codes


def test_fp6_four_codes_in_three_bytes() -> None:
    packed = pack_bits(torch.tensor([0x3F, 0x00, 0x2A, 0x15], dtype=torch.uint8), 6)
    # stream: 111111 000000 101010 010101 (code 0 lowest) -> little-endian bytes
    assert packed.tolist() == [0x3F, 0xA0, 0x56]


def test_fmix32_matches_python_integers() -> None:
    rng = np.random.default_rng(0)
    vals = [0, 1, 2**31, 2**32 - 1, *rng.integers(0, 2**32, 1000).tolist()]
    got = fmix32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [ref_fmix32(v) for v in vals]


def test_hash_of_large_indices_and_keys() -> None:
    keys = hash_keys(seed=2**62, step=2**40, hop=3, rank=1000)
    idx = torch.tensor([0, 2**32 - 1, 2**32, 2**40 + 5], dtype=torch.int64)
    h = hash_u32(idx, keys)
    assert bool(((h >= 0) & (h < 2**32)).all())
    lo, hi = idx & 0xFFFFFFFF, idx >> 32
    ref = [
        ref_fmix32(ref_fmix32((int(a) * 0x9E3779B1 + keys[0]) % 2**32) ^ int(b) ^ keys[1])
        for a, b in zip(lo, hi, strict=True)
    ]
    assert h.tolist() == ref
    assert len(set(h.tolist())) == 4


def test_uniform_is_exact_and_uniform() -> None:
    """u takes the midpoints of a 2^-23 grid; over 2^20 consecutive indices its histogram
    passes a chi-square test (64 bins, p > 1e-6 threshold: 140 for 63 degrees of freedom)."""
    h = hash_u32(torch.arange(1 << 20), hash_keys(1, 2, 3, 4))
    u = uniform_open01(h)
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(((u.double() * 2**24 - 1) / 2).floor(), (h >> 9).double())
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    expected = (1 << 20) / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 140.0, chi2
    # neighbouring indices are not correlated
    c = np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]
    assert abs(c) < 0.01
