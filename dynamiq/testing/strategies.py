"""Hypothesis strategies for codec inputs and hop contexts (docs/design.md, "House
style", item 6).

:func:`finite_tensors` draws values spread over magnitudes; :func:`edge_tensors` aims where
certified bounds slip: rounding ties of the element grids, scale boundaries, and subnormal
powers of two (docs/reliability.md, "Bounds never violated"). :func:`codec_inputs`, what the
conformance kit draws from, mixes both. All strategies live here. Profiles ``dev`` (fast),
``ci`` (default of ``make test``) and ``thorough`` are registered on import; pick one with
``HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dynamiq.codecs.base import FP32_MAX, Codec, HopContext

__all__ = ["codec_inputs", "edge_tensors", "finite_tensors", "hop_contexts", "load_profile"]

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
    return _to_dtype(x, dtype, max_abs)


#: exponents where scales and element grids change behaviour: fp32's subnormals and smallest
#: normals (bf16 shares its exponent range), fp16's subnormals and smallest normals, around 1,
#: fp16's largest binade, and the top of fp32
EDGE_EXPONENTS = (
    *range(-149, -119),
    *range(-26, -12),
    -1,
    0,
    1,
    *range(14, 17),
    *range(123, 128),
)
#: significands of the scale-setting values: 1 (powers of two), steps of bf16's and fp16's
#: grids, the largest fp32 significand, and the qmax of INT formats (their scales are exact)
_SIGNIFICANDS = (
    1.0,
    1 + 1 / 128,
    1 + 1 / 1024,
    2 - 2**-7,
    2 - 2**-10,
    2 - 2**-23,
    *(q / 2 ** (q.bit_length() - 1) for q in (3, 7, 15, 31, 63, 127)),
)
#: grid sizes whose rounding ties ``(k + 1/2) / q`` of the block scale are aimed at: INT's
#: qmax, and powers of two (dyadic midpoints: the MX and floating-point element grids)
_TIE_GRIDS = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 256, 1024)


def _edge_magnitudes(rng: np.random.Generator, n: int, top: int) -> np.ndarray:
    """``n`` values ``significand · 2^e`` (fp64), ``e`` mostly in ``top - 3 .. top`` (so that
    the largest of a block, which sets its scale, is near ``top`` too), a few anywhere."""
    exps = np.where(rng.random(n) < 0.95, top - rng.integers(0, 4, n), rng.integers(-149, 128, n))
    return np.ldexp(rng.choice(np.array(_SIGNIFICANDS), n), exps)


@st.composite
def edge_tensors(
    draw: st.DrawFn,
    block_size: int = 32,
    *,
    max_abs: float = FP32_MAX,
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"),
    witness: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """1-D finite tensors aimed where certified bounds slip, piecewise over chunks of
    1, 16, 32 or ``block_size`` values, each chunk's scale-setting magnitude ``significand ·
    2^e`` (powers of two, bf16/fp16 grid values, INT-qmax multiples; ``e`` within 3 below an
    exponent of :data:`EDGE_EXPONENTS`: subnormals, format limits, around 1), as

    * ``"constant"``: each chunk constant (blocks at subnormal powers of two, ...);
    * ``"ties"``: the chunk's first value sets the scale, the others sit on rounding ties
      ``(k + 1/2) / q`` of it (``q`` an INT qmax or a power of two) or on grid points ``k / q``;
    * ``"powers"``: every value its own power of two or grid value;
    * ``"witness"`` (given a bound's ``witness``, where the bound is tight): the witness input
      times a power of two that puts its largest value at ``2^e`` (into the subnormals, to the
      format limits), where rounding differs;

    with random signs (per chunk or per value) and, optionally, values nudged one fp32 ulp up
    or down (just off a tie or a boundary). Never above ``max_abs`` in magnitude."""
    max_abs = _f32_floor(max_abs)
    n = draw(_lengths(block_size))
    dtype = _DTYPES[draw(st.sampled_from(dtypes))]
    # the witness (where the bound is tight) moved to the edges weighs as two patterns
    patterns = ["constant", "ties", "powers"] + (["witness"] * 2 if witness and n else [])
    pattern = draw(st.sampled_from(patterns))
    chunk = draw(st.sampled_from(sorted({1, 16, 32, max(block_size, 1)})))
    nudge = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
    per_value_sign = draw(st.booleans())
    top = draw(st.sampled_from(EDGE_EXPONENTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_chunks = -(-n // chunk)
    if pattern == "witness":
        assert witness is not None
        w = witness(n).double().numpy()
        peak = float(np.abs(w).max())
        mag = np.abs(w) * 2.0 ** (top - (math.floor(math.log2(peak)) if peak > 0 else 0))
        sign_w = np.where(w < 0, -1.0, 1.0)
        mag = mag * sign_w  # the witness's own signs (times the chunks' random ones)
    elif pattern == "powers":
        mag = _edge_magnitudes(rng, n, top)
    else:
        mag = np.repeat(_edge_magnitudes(rng, n_chunks, top), chunk)[:n]
        if pattern == "ties":
            q = rng.choice(np.array(_TIE_GRIDS), n)
            k = np.floor(rng.random(n) * q)
            frac = np.where(rng.random(n) < 0.75, (k + 0.5) / q, k / q)
            frac[::chunk] = 1.0  # the chunk's first value sets its scale
            mag = mag * frac
    sign = rng.choice([-1.0, 1.0], n if per_value_sign else n_chunks)
    x = mag * (sign if per_value_sign else np.repeat(sign, chunk)[:n])
    x32 = np.clip(x, -max_abs, max_abs).astype(np.float32)
    if nudge:
        moved = rng.random(n) < nudge
        outward = np.copysign(np.float32(FP32_MAX), x32)  # (no overflow to inf)
        toward = np.where(rng.random(n) < 0.5, np.float32(0), outward)
        x32 = np.where(moved, np.nextafter(x32, toward), x32).astype(np.float32)
        x32 = np.clip(x32, -max_abs, max_abs).astype(np.float32)
    return _to_dtype(torch.from_numpy(x32.copy()), dtype, max_abs)


def _to_dtype(x: torch.Tensor, dtype: torch.dtype, max_abs: float) -> torch.Tensor:
    """fp32 ``x`` in ``dtype``, clamped first to its largest value ``<= max_abs`` (so the cast
    stays in range)."""
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
    """Finite inputs a codec accepts (magnitudes up to ``codec.max_input_abs``): spread
    (:func:`finite_tensors`) or aimed at edges (:func:`edge_tensors`), half each."""
    kw.setdefault("max_abs", codec.max_input_abs)
    edges = edge_tensors(codec.block_size, witness=codec.error_bound.witness, **kw)
    return st.one_of(finite_tensors(codec.block_size, **kw), edges)
