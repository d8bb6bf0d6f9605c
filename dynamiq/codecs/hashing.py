"""Counter-based hash for stochastic and correlated rounding (docs/design.md,
"Randomness and determinism").

Every random number a codec draws is a pure function of ``(seed, step, hop, rank, global element
index)``: no ``torch.rand``, no global RNG state, so every rank, the reference and the kernels
draw the same numbers. The mixer is MurmurHash3's 32-bit finalizer (``fmix32``) chained over the
words of the counter; it uses only 32-bit multiply, xor and logical shift, which Triton
reproduces bit for bit (``dynamiq.kernels`` carries the same function for the GPU).

The per-call words ``(seed, step, hop, rank)`` fold into two 32-bit keys on the host
(:func:`hash_keys`); the per-element part (:func:`hash_u32`) is two ``fmix32`` rounds::

    h = fmix32((lo32(index) * 0x9E3779B1 + key0) mod 2^32)
    h = fmix32(h ^ hi32(index) ^ key1)

>>> import torch
>>> k = hash_keys(seed=1, step=2, hop=0, rank=3)
>>> h = hash_u32(torch.arange(4), k)
>>> bool(((h >= 0) & (h < 2**32)).all())
True
"""

from __future__ import annotations

import torch

__all__ = ["fmix32", "hash_keys", "hash_u32", "uniform_open01"]

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1


def _fmix32_int(h: int) -> int:
    h &= MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    h ^= h >> 16
    return h


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 finalizer on uint32 values held in an int64 tensor."""
    h = h & MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def hash_keys(seed: int, step: int, hop: int, rank: int) -> tuple[int, int]:
    """Fold the per-call counter words into two 32-bit keys (host side, Python ints)."""
    k = _fmix32_int(seed & MASK32)
    k = _fmix32_int(k ^ (seed >> 32) ^ 0x243F6A88)
    k = _fmix32_int(k ^ (step & MASK32))
    k = _fmix32_int(k ^ (step >> 32) ^ 0x85A308D3)
    k = _fmix32_int(k ^ (hop & MASK32))
    key0 = _fmix32_int(k ^ (rank & MASK32))
    key1 = _fmix32_int(key0 ^ 0x13198A2E)
    return key0, key1


def hash_u32(index: torch.Tensor, keys: tuple[int, int]) -> torch.Tensor:
    """Hash global element indices (int64, >= 0) to uint32 values in an int64 tensor."""
    idx = index.to(torch.int64)
    lo = idx & MASK32
    hi = idx >> 32
    h = fmix32(((lo * _GOLDEN) & MASK32) + keys[0])
    return fmix32(h ^ hi ^ keys[1])


def uniform_open01(h: torch.Tensor) -> torch.Tensor:
    """Map uint32 hashes to fp32 in (0, 1) on the midpoints of a 2^-23 grid (exact in fp32).

    ``u = (2 * (h >> 9) + 1) * 2^-24``, so ``P(u < f) = f`` up to 2^-24 for any ``f`` in [0, 1].
    """
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)
