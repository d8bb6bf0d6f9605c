"""Hypothesis strategies for codec inputs, hop contexts and all-reduce cases (docs/testing.md,
"Strategies"; docs/design.md, "House style", item 6).

Tensors: :func:`finite_tensors` draws values spread over magnitudes; :func:`edge_tensors` aims
where certified bounds slip: rounding ties of the element grids, scale boundaries, and
subnormal powers of two (docs/reliability.md, "Certified bounds never violated"), and
:func:`edge_battery` is its fixed, deterministic twin; :func:`codec_inputs`, what the
conformance kit draws from, mixes both strategies. Each takes a ``size`` (or a ``shape``) and the
``dtypes`` to draw from. All-reduce cases: :func:`tensor_lists` (one tensor per rank),
:func:`schedules`, :func:`codec_configs` and :func:`hop_contexts`. All strategies live here;
the Hypothesis profiles in :mod:`dynamiq.testing.profiles`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from dynamiq.codecs.base import FP32_MAX, Codec, HopContext

__all__ = [
    "EDGE_EXPONENTS",
    "codec_configs",
    "codec_inputs",
    "edge_battery",
    "edge_tensors",
    "finite_tensors",
    "hop_contexts",
    "schedules",
    "tensor_lists",
]

#: a ``size`` argument: an exact element count, or an inclusive ``(min, max)`` range
Size = int | tuple[int, int] | None
#: a ``dtypes`` argument: names (``"float32"``, ``"bfloat16"``, ``"float16"``) or dtypes
DTypes = Sequence[str | torch.dtype]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _f32_floor(v: float) -> float:
    """The largest fp32 value <= ``v`` (v >= 0)."""
    f = np.float32(min(v, FP32_MAX))
    return float(np.nextafter(f, np.float32(0)) if float(f) > v else f)


def _lengths(block_size: int, size: Size = None) -> st.SearchStrategy[int]:
    """Element counts: ``size`` (exact, or a ``(min, max)`` range, whose block edges are
    favoured), or by default empty, one, block remainders and several blocks."""
    b = block_size
    if isinstance(size, bool) or not isinstance(size, (int, tuple, type(None))):
        raise TypeError(f"size must be an int, a (min, max) pair or None (got {size!r})")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size must be >= 0 (got {size})")
        return st.just(size)
    lo, hi = (0, min(6 * b, 4096)) if size is None else size
    if not 0 <= lo <= hi:
        raise ValueError(f"size range must satisfy 0 <= min <= max (got {size})")
    edge = sorted({0, 1, 2, max(b - 1, 1), b, b + 1, 2 * b - 1, 2 * b + 3, 3 * b})
    edge = [n for n in edge if lo <= n <= hi] if size is not None else edge
    sized = st.integers(lo, hi)
    return st.one_of(st.sampled_from(edge), sized) if edge else sized


def _dtype_names(dtypes: DTypes) -> list[str]:
    names = []
    for d in dtypes:
        name = str(d).removeprefix("torch.") if isinstance(d, torch.dtype) else d
        if name not in _DTYPES:
            raise ValueError(f"dtypes must be among {sorted(_DTYPES)} (got {d!r})")
        names.append(name)
    if not names:
        raise ValueError("dtypes must name at least one dtype")
    return names


def _geometry(
    draw: st.DrawFn, block_size: int, size: Size, shape: tuple[int, ...] | None, dtypes: DTypes
) -> tuple[int, tuple[int, ...] | None, torch.dtype]:
    """The element count, the final shape (``None``: 1-D) and the dtype of one draw."""
    if shape is not None:
        if size is not None:
            raise ValueError("give size or shape, not both")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape must not have negative dimensions (got {shape})")
    n = math.prod(shape) if shape is not None else draw(_lengths(block_size, size))
    return n, shape, _DTYPES[draw(st.sampled_from(_dtype_names(dtypes)))]


@st.composite
def finite_tensors(
    draw: st.DrawFn,
    block_size: int = 32,
    *,
    size: Size = None,
    shape: tuple[int, ...] | None = None,
    max_abs: float = FP32_MAX,
    dtypes: DTypes = ("float32", "bfloat16", "float16"),
) -> torch.Tensor:
    """Finite tensors: magnitudes from subnormal to huge, zeros, mixed or single signs, in
    one of ``dtypes``; never above ``max_abs`` in magnitude. 1-D with ``size`` elements (an
    int, or a ``(min, max)`` range; default: lengths around ``block_size``: 0, 1, block
    remainders, several blocks), or of ``shape``."""
    max_abs = _f32_floor(max_abs)
    n, shape, dtype = _geometry(draw, block_size, size, shape, dtypes)
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
    return _shaped(_to_dtype(x, dtype, max_abs), shape)


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
    size: Size = None,
    shape: tuple[int, ...] | None = None,
    max_abs: float = FP32_MAX,
    dtypes: DTypes = ("float32", "bfloat16", "float16"),
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
    or down (just off a tie or a boundary). Never above ``max_abs`` in magnitude. ``size``,
    ``shape`` and ``dtypes`` as for :func:`finite_tensors`."""
    max_abs = _f32_floor(max_abs)
    n, shape, dtype = _geometry(draw, block_size, size, shape, dtypes)
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
    return _shaped(_to_dtype(torch.from_numpy(x32.copy()), dtype, max_abs), shape)


def _scaled(w: np.ndarray, e: int, limit: float) -> np.ndarray | None:
    """``w`` times the power of two that puts its largest magnitude at ``2^e`` (fp32; None
    when that leaves the codec's range)."""
    peak = float(np.abs(w).max()) if w.size else 0.0
    if peak == 0:
        return None
    x = np.ldexp(w, e - math.frexp(peak)[1] + 1)
    if not np.isfinite(x).all() or float(np.abs(x).max()) > limit:
        return None
    return x.astype(np.float32)


#: the exponents of the battery of partial blocks, and of every block past 4096 values: a
#: sample of :data:`EDGE_EXPONENTS` (fp32's and fp16's subnormals and smallest normals,
#: around 1, fp16's largest binade, the top of fp32)
_FEW_EXPONENTS = (-149, -148, -147, -140, -133, -127, -126, -125, -24, -14, -1, 0, 15, 124, 127)


def _variants(pattern: np.ndarray, exponents: tuple[int, ...], limit: float) -> list[np.ndarray]:
    """``pattern`` moved to each exponent, and nudged one fp32 ulp out and in."""
    out = []
    for e in exponents:
        x = _scaled(pattern, e, limit)
        if x is None:
            continue
        up = np.nextafter(x, np.copysign(np.float32(np.inf), x)).astype(np.float32)
        down = np.nextafter(x, np.float32(0)).astype(np.float32)
        out += [v for v in (x, up, down) if np.isfinite(v).all() and np.abs(v).max() <= limit]
    return out


def edge_battery(codec: Codec) -> list[torch.Tensor]:
    """Fixed fp32 inputs aimed where ``codec``'s bound is reached, the deterministic twin of
    :func:`edge_tensors`: the bound's witness, and blocks of one value dwarfing the others
    (``2^-1 .. 2^-41`` of it: they round to 0), each moved to every exponent of
    :data:`EDGE_EXPONENTS` and nudged one fp32 ulp out and in; ``block_size`` values each,
    all in one tensor (blocks are encoded apart: the kit checks that), then ``2·block + 3``
    values each (a partial block) at a sample of the exponents."""
    b = codec.block_size
    limit = min(codec.max_input_abs, 3.0e38)
    out = []
    for n in sorted({b, min(2 * b + 3, 4096)} if b <= 4096 else {b}):
        k = np.arange(n)
        dwarfed = np.where(k % b == 0, 1.0, np.ldexp(1.0, -(k % 41) - 1))
        dwarfed *= np.where(k % 3 == 0, -1.0, 1.0)
        exps = EDGE_EXPONENTS if n == b and b <= 4096 else _FEW_EXPONENTS
        witness = codec.error_bound.witness(n).double().numpy()
        xs = _variants(witness, exps, limit) + _variants(dwarfed, exps, limit)
        if n == b and xs:
            xs = [np.concatenate(xs)]
        out += [torch.from_numpy(x.copy()) for x in xs]
    return out


def _to_dtype(x: torch.Tensor, dtype: torch.dtype, max_abs: float) -> torch.Tensor:
    """fp32 ``x`` in ``dtype``, clamped first to its largest value ``<= max_abs`` (so the cast
    stays in range)."""
    top = torch.tensor(min(max_abs, torch.finfo(dtype).max), dtype=torch.float64).to(dtype)
    if float(top) > max_abs:
        top = torch.nextafter(top, torch.zeros_like(top))
    return x.clamp(-float(top), float(top)).to(dtype).contiguous()


def _shaped(x: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    return x if shape is None else x.reshape(shape)


def _fixed_or(value: int | None, lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi) if value is None else st.just(value)


@st.composite
def hop_contexts(
    draw: st.DrawFn,
    *,
    seed: int | None = None,
    step: int | None = None,
    num_hops: int | None = None,
    world_size: int | None = None,
    max_offset: int = 2**40,
    block_size: int = 1,
    shared: dict[str, Any] | None = None,
) -> HopContext:
    """Hop contexts; each field given is fixed, the others drawn: ``seed`` (any 63-bit),
    ``step``, ``num_hops`` (1..64; ``hop`` below it), ``world_size`` (1..1024; ``rank`` and
    ``contributions`` within it), ``offset`` a multiple of ``block_size`` up to
    ``max_offset`` (the global index of an encoded piece's first element starts a block),
    and ``shared`` (a prologue's result, ``None`` by default)."""
    hops = draw(_fixed_or(num_hops, 1, 64))
    ranks = draw(_fixed_or(world_size, 1, 1024))
    blocks = max(max_offset // max(block_size, 1), 0)
    return HopContext(
        seed=draw(_fixed_or(seed, 0, 2**63 - 1)),
        step=draw(_fixed_or(step, 0, 10**9)),
        hop=draw(st.integers(0, hops - 1)),
        num_hops=hops,
        rank=draw(st.integers(0, ranks - 1)),
        contributions=draw(st.integers(1, ranks)),
        offset=draw(st.integers(0, blocks)) * max(block_size, 1),
        world_size=ranks,
        shared=shared,
    )


def codec_inputs(codec: Codec, **kw: Any) -> st.SearchStrategy[torch.Tensor]:
    """Finite inputs a codec accepts (magnitudes up to ``codec.max_input_abs``): spread
    (:func:`finite_tensors`) or aimed at edges (:func:`edge_tensors`, with the bound's
    witness), half each. Keywords (``size``, ``dtypes``, ``max_abs``) go to both."""
    kw.setdefault("max_abs", codec.max_input_abs)
    edges = edge_tensors(codec.block_size, witness=codec.error_bound.witness, **kw)
    return st.one_of(finite_tensors(codec.block_size, **kw), edges)


@st.composite
def tensor_lists(
    draw: st.DrawFn,
    block_size: int = 32,
    *,
    ranks: int | tuple[int, int] = (1, 6),
    size: Size = None,
    shape: tuple[int, ...] | None = None,
    dtypes: DTypes = ("float32",),
    max_abs: float = 2.0**100,
    edges: bool = True,
) -> list[torch.Tensor]:
    """One tensor per rank for an all-reduce: ``ranks`` of them (an int or a ``(min, max)``
    range), all of one size (``size`` as for :func:`finite_tensors`) or ``shape`` and one
    dtype, each rank's values spread (:func:`finite_tensors`) or, with ``edges``, aimed at
    ties, scale boundaries and subnormals (:func:`edge_tensors`); ``|x| <= max_abs``."""
    lo, hi = (ranks, ranks) if isinstance(ranks, int) else ranks
    if not 1 <= lo <= hi:
        raise ValueError(f"ranks must be >= 1 (got {ranks})")
    n_ranks = draw(st.integers(lo, hi))
    if shape is None:
        size = draw(_lengths(block_size, size))
    dtype = draw(st.sampled_from(_dtype_names(dtypes)))
    kw: dict[str, Any] = {"size": size, "shape": shape, "dtypes": (dtype,), "max_abs": max_abs}
    one = finite_tensors(block_size, **kw)
    if edges:
        one = st.one_of(one, edge_tensors(block_size, **kw))
    return [draw(one) for _ in range(n_ranks)]


def _schedule_options(name: str, world_size: int) -> list[dict[str, Any]]:
    if name != "hierarchical":
        return [{}]
    return [{"ranks_per_node": g} for g in range(1, world_size + 1) if world_size % g == 0]


@st.composite
def schedules(draw: st.DrawFn, world_size: int, *, names: Sequence[str] | None = None) -> Any:
    """Built-in schedules (:func:`dynamiq.collectives.get_schedule`) for ``world_size``
    ranks, among ``names`` (default: every built-in one; ``hierarchical`` with any
    ``ranks_per_node`` that divides ``world_size``)."""
    from dynamiq.collectives import get_schedule, list_schedules

    pool = list(names) if names is not None else list_schedules()
    unknown = sorted(set(pool) - set(list_schedules()))
    if unknown or not pool:
        raise ValueError(f"names must be among {list_schedules()} (got {list(pool)})")
    name = draw(st.sampled_from(pool))
    return get_schedule(
        name, world_size, **draw(st.sampled_from(_schedule_options(name, world_size)))
    )


#: the configuration space :func:`codec_configs` draws the ``int`` family from
_INT_SPACE = {
    "bits": st.integers(2, 8),
    "block_size": st.sampled_from([2, 7, 16, 32, 64, 128]),
    "rounding": st.sampled_from(["nearest", "stochastic"]),
    "scale_format": st.sampled_from(["bf16", "fp16", "fp32", "e8m0"]),
}


@st.composite
def codec_configs(
    draw: st.DrawFn, names: Sequence[str] | None = None, *, vary_int: bool = True
) -> dict[str, Any]:
    """Codec configurations (JSON-safe dicts for :func:`dynamiq.codecs.get_codec`): the
    configuration of one of ``names`` (default: every codec that ships with dynamiq), or,
    with ``vary_int``, an ``int`` codec with any bits (2..8), block size, rounding and scale
    format."""
    from dynamiq.codecs import get_codec, list_codecs

    pool = list(names) if names is not None else _builtin_names(list_codecs())
    if not pool:
        raise ValueError("names must name at least one codec")
    if vary_int and draw(st.booleans()):
        return {"id": "int", **{k: draw(v) for k, v in _INT_SPACE.items()}}
    return get_codec(draw(st.sampled_from(pool))).get_config()


def _builtin_names(names: list[str]) -> list[str]:
    from dynamiq.codecs import get_codec

    return [n for n in names if type(get_codec(n)).__module__.startswith("dynamiq.")]
