"""Inputs and checks shared by the DynamiQ kernel tests: the Triton kernels
(``test_dynamiq_kernels.py``) and the native CPU kernel (``test_cpu_native_dynamiq.py``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from kernel_harness import assert_bytes_equal, assert_values_equal, both, cycle_blocks
from kernel_harness import random_values as _random_values

import dynamiq.kernels as K
from dynamiq.codecs import HopContext
from dynamiq.codecs.dynamiq_codec import DynamiqCodec, level_table

#: heavy-tailed magnitudes (a normal times 2^-20 .. 2^20), zeros, powers of two
random_values = functools.partial(_random_values, spread=20)


def midpoints() -> torch.Tensor:
    """1.0 then the midpoints of the uniform and fitted tables (nearest-rounding ties)."""
    mids = [torch.ones(1)]
    for kind in ("uniform", "fitted"):
        for w in (1, 2, 3, 4, 5, 6):
            lv = level_table(kind, w)
            mids.append((lv[1:] + lv[:-1]) / 2)
    return torch.cat(mids)


def edge_values(n: int, block: int, seed: int) -> torch.Tensor:
    """Blocks (one super-group each) of special content: zeros, -0.0, fp32/bf16/fp16
    subnormals, huge values (beyond bf16's largest too), NaN, ±Inf, one large value among
    tiny ones, bf16 scales exactly on and one ulp above a bf16 value, constant values (equal
    priorities: the leftover bits go in index order), nearest-rounding ties."""
    g = torch.Generator().manual_seed(seed)
    mid = midpoints()
    kinds = [
        lambda m: torch.zeros(m),
        lambda m: -torch.zeros(m),
        lambda m: torch.randint(-(2**23), 2**23, (m,), generator=g).float() * 2.0**-149,
        lambda m: torch.randint(-127, 128, (m,), generator=g).float() * 2.0**-133,
        lambda m: torch.randint(-1023, 1024, (m,), generator=g).float() * 2.0**-24,
        lambda m: torch.linspace(-1, 1, m) * 2.0**127,
        lambda m: torch.where(torch.arange(m) == 3, 3.39e38, torch.randn(m, generator=g)),
        lambda m: torch.where(torch.arange(m) == m // 2, float("nan"), 1.0),
        lambda m: torch.where(torch.arange(m) == 0, float("inf"), -2.0),
        lambda m: torch.where(torch.arange(m) == m - 1, float("-inf"), 3.0e-3),
        lambda m: torch.where(torch.arange(m) == 1, 1.0e4, 1.0e-30 * torch.randn(m, generator=g)),
        lambda m: torch.where(torch.arange(m) == 2, 1.5, torch.randn(m, generator=g)),
        lambda m: torch.where(
            torch.arange(m) == 2, float(torch.nextafter(torch.tensor(1.5), torch.tensor(2.0))), 0.7
        ),
        lambda m: torch.full((m,), 0.3),
        lambda m: mid.repeat(-(-m // mid.numel()))[:m],
    ]
    return cycle_blocks(kinds, n, block)


def check_all(
    codec: DynamiqCodec,
    x: torch.Tensor,
    local: torch.Tensor,
    pair: tuple[HopContext, HopContext],
    what: str,
    *,
    fast: str,
    kernels: dict[Any, str],
) -> None:
    """Encode ``x``, decode the reference payload, reduce it with ``local``: each bit-exact
    between the reference and the ``fast`` backend, whose ``kernels[op]`` must launch."""
    ctx, out_ctx = pair
    n = x.numel()
    got, want = both(K.encode, codec, x, ctx, kernel=kernels[K.encode], fast=fast)
    if want is None:
        # both refused a finite value beyond max_input_abs (the same ValueError): encode
        # the input clipped to it; the reduce below still adds the huge values as `local`
        # where the other order of the pair passes them (a partial sum may overflow bf16)
        big = torch.isfinite(x) & (x.abs() > codec.max_input_abs)
        x = torch.where(big, torch.sign(x) * codec.max_input_abs, x).to(x.dtype)
        got, want = both(K.encode, codec, x, ctx, kernel=kernels[K.encode], fast=fast)
    assert_bytes_equal(got, want, f"encode {what}")
    got_v, want_v = both(K.decode, codec, want, n, ctx, kernel=kernels[K.decode], fast=fast)
    assert_values_equal(got_v, want_v, f"decode {what}")
    got_r, want_r = both(
        K.reduce, codec, want, local, ctx, out_ctx, kernel=kernels[K.reduce], fast=fast
    )
    assert_bytes_equal(got_r, want_r, f"reduce {what}")
