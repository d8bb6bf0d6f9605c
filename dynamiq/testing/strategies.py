"""Hypothesis strategies for codec inputs and hop contexts (docs/design.md, "House
style", item 6).

All strategies live here. Profiles ``dev`` (fast), ``ci`` (default of ``make test``) and
``thorough`` are registered on import; pick one with ``HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dynamiq.codecs.base import FP32_MAX, Codec, HopContext

__all__ = ["codec_inputs", "finite_tensors", "hop_contexts", "load_profile"]

settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def load_profile() -> None:
    """Load the profile named by ``HYPOTHESIS_PROFILE`` (default ``dev``)."""
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _f32_floor(v: float) -> float:
    """The largest fp32 value <= ``v`` (v >= 0)."""
    f = np.float32(min(v, FP32_MAX))
    return float(np.nextafter(f, np.float32(0)) if float(f) > v else f)


def _lengths(block_size: int) -> st.SearchStrategy[int]:
    """Empty, one, block remainders and several blocks."""
    b = block_size
    edge = sorted({0, 1, 2, max(b - 1, 1), b, b + 1, 2 * b - 1, 2 * b + 3, 3 * b})
    return st.one_of(st.sampled_from(edge), st.integers(0, min(6 * b, 4096)))


@st.composite
def finite_tensors(
    draw: st.DrawFn,
    block_size: int = 32,
    *,
    max_abs: float = FP32_MAX,
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"),
) -> torch.Tensor:
    """1-D finite tensors: lengths around ``block_size``; magnitudes from subnormal to huge,
    zeros, mixed or single signs, fp32/bf16/fp16; never above ``max_abs`` in magnitude."""
    max_abs = _f32_floor(max_abs)
    n = draw(_lengths(block_size))
    dtype = _DTYPES[draw(st.sampled_from(dtypes))]
    if n <= 2000 and draw(st.booleans()):
        # Hypothesis' own float choices: boundary values, subnormals, exact powers of two
        vals = draw(
            st.lists(
                st.floats(
                    min_value=-max_abs,
                    max_value=max_abs,
                    allow_nan=False,
                    allow_infinity=False,
                    width=32,
                ),
                min_size=n,
                max_size=n,
            )
        )
        x = torch.tensor(vals, dtype=torch.float32)
    else:
        seed = draw(st.integers(0, 2**32 - 1))
        lo = draw(st.integers(-149, 120))
        hi = draw(st.integers(lo, min(lo + 60, 127)))
        zero_frac = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]))
        signs = draw(st.sampled_from(["mixed", "positive", "negative"]))
        rng = np.random.default_rng(seed)
        mag = np.exp2(rng.uniform(lo, hi + 1, n)) * rng.uniform(0.5, 1.0, n)
        mag[rng.random(n) < zero_frac] = 0.0
        if signs == "mixed":
            mag *= rng.choice([-1.0, 1.0], n)
        elif signs == "negative":
            mag = -mag
        x = torch.from_numpy(np.clip(mag, -max_abs, max_abs).astype(np.float32))
    # largest value of dtype <= max_abs: clamping to it in fp32 keeps the cast in range
    top = torch.tensor(min(max_abs, torch.finfo(dtype).max), dtype=torch.float64).to(dtype)
    if float(top) > max_abs:
        top = torch.nextafter(top, torch.zeros_like(top))
    return x.clamp(-float(top), float(top)).to(dtype).contiguous()


@st.composite
def hop_contexts(draw: st.DrawFn) -> HopContext:
    """Contexts with any seed/step/rank/offset; hop < num_hops."""
    num_hops = draw(st.integers(1, 64))
    return HopContext(
        seed=draw(st.integers(0, 2**64 - 1).map(lambda v: v & (2**63 - 1))),
        step=draw(st.integers(0, 10**9)),
        hop=draw(st.integers(0, num_hops - 1)),
        num_hops=num_hops,
        rank=draw(st.integers(0, 1023)),
        contributions=draw(st.integers(1, 1024)),
        offset=draw(st.integers(0, 2**40)),
        world_size=draw(st.integers(1, 1024)),
    )


def codec_inputs(codec: Codec, **kw: Any) -> st.SearchStrategy[torch.Tensor]:
    """Finite inputs a codec accepts (magnitudes up to ``codec.max_input_abs``)."""
    kw.setdefault("max_abs", codec.max_input_abs)
    return finite_tensors(codec.block_size, **kw)
