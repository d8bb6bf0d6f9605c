"""The counter hash of docs/formats.md section 4 in plain Python integers: the independent
reference the hash, stochastic-rounding and THC tests compare against."""

from __future__ import annotations

M32 = 0xFFFFFFFF


def ref_fmix32(h: int) -> int:
    h &= M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def ref_keys(seed: int, step: int, hop: int, rank: int) -> tuple[int, int]:
    k = ref_fmix32(seed & M32)
    k = ref_fmix32(k ^ (seed >> 32) ^ 0x243F6A88)
    k = ref_fmix32(k ^ (step & M32))
    k = ref_fmix32(k ^ (step >> 32) ^ 0x85A308D3)
    k = ref_fmix32(k ^ (hop & M32))
    key0 = ref_fmix32(k ^ (rank & M32))
    return key0, ref_fmix32(key0 ^ 0x13198A2E)


def ref_hash(idx: int, keys: tuple[int, int]) -> int:
    h = ref_fmix32(((idx & M32) * 0x9E3779B1 + keys[0]) & M32)
    return ref_fmix32(h ^ (idx >> 32) ^ keys[1])
