"""The counter hash as a Triton kernel (reference: :mod:`dynamiq.codecs.hashing`).

The hash itself is written once, in :func:`dynamiq.kernels._common.hash_u32`, and inlined by
every kernel that draws random numbers; this module launches it on its own, so tests (and
codecs that need a dither tensor) can compare it with the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import hash_u32 as _hash
from ._common import tile_elems
from ._common import uniform_open01 as _uniform
from ._stats import record_launch

__all__ = ["hash_u32", "uniform_open01"]


@triton.jit(do_not_specialize=["key0", "key1"])
def _hash_kernel(
    # pointers
    index_ptr,  # int64 global element indices (>= 0)
    out_ptr,  # int64 hashes (uint32 values), or fp32 uniforms when UNIFORM
    # sizes
    n,
    # keys from hashing.hash_keys(seed, step, hop, rank)
    key0,
    key1,
    # meta-parameters
    UNIFORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # bytes moved per element: 8 read, 8 (hash) or 4 (uniform) written

    # -- map program -> block of indices
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # -- load with mask
    idx = tl.load(index_ptr + offs, mask=mask, other=0)
    # -- compute: two fmix32 rounds
    h = _hash(idx, key0, key1)
    # -- store with mask
    if UNIFORM:
        tl.store(out_ptr + offs, _uniform(h), mask=mask)
    else:
        tl.store(out_ptr + offs, h.to(tl.int64), mask=mask)


def _launch(index: torch.Tensor, keys: tuple[int, int], uniform: bool) -> torch.Tensor:
    idx = index.to(torch.int64).contiguous().reshape(-1)
    if bool((idx < 0).any()):
        raise ValueError("index must be >= 0")
    dtype = torch.float32 if uniform else torch.int64
    out = torch.empty(idx.numel(), dtype=dtype, device=idx.device)
    n = idx.numel()
    if n:
        block = min(tile_elems(idx.device), triton.next_power_of_2(n))
        _hash_kernel[(triton.cdiv(n, block),)](
            idx, out, n, keys[0], keys[1], UNIFORM=uniform, BLOCK=block
        )
        record_launch("_hash_kernel")
    return out.reshape(index.shape)


def hash_u32(index: torch.Tensor, keys: tuple[int, int]) -> torch.Tensor:
    """``dynamiq.codecs.hashing.hash_u32`` on the Triton backend (uint32 values as int64)."""
    return _launch(index, keys, uniform=False)


def uniform_open01(index: torch.Tensor, keys: tuple[int, int]) -> torch.Tensor:
    """``uniform_open01(hash_u32(index, keys))`` on the Triton backend (fp32 in (0, 1))."""
    return _launch(index, keys, uniform=True)
