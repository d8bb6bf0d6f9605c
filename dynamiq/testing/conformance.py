"""The codec conformance kit (docs/design.md, "House style", item 5): one set of checks for
every codec.

Plugin authors run it on their own codecs::

    from dynamiq.testing import run_conformance
    run_conformance(MyCodec(), fixtures_dir="tests/fixtures")

Each ``check_*`` function raises ``AssertionError`` with a message naming the codec and the
failing input. The Hypothesis-driven checks draw inputs from :mod:`dynamiq.testing.strategies`
(shapes including empty, one and block remainders; magnitudes from subnormal to huge; zeros;
mixed signs; fp32/bf16/fp16; and, half of them, inputs aimed at rounding ties, scale
boundaries, subnormal powers of two and the bound's witness moved there: ``edge_tensors``),
under the Hypothesis settings in force, the caller's (:mod:`dynamiq.testing.profiles`).
The checks inside the engine (the multi-hop bound, block locality) are in
:mod:`dynamiq.testing.allreduce`. docs/testing.md documents them all.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamiq.codecs import Codec, HopContext, get_codec

from .allreduce import check_allreduce_bound, check_block_locality
from .golden import check_golden, golden_input
from .strategies import codec_inputs, edge_battery, hop_contexts, schedules, tensor_lists

__all__ = [
    "check_bad_input",
    "check_bound_edges",
    "check_bound_sound",
    "check_bound_tight",
    "check_config",
    "check_encoded_nbytes",
    "check_golden",
    "check_nonfinite",
    "check_reduce",
    "check_roundtrip",
    "check_unbiased",
    "run_conformance",
]


def _err(codec: Codec, x: torch.Tensor, ctx: HopContext | None = None) -> torch.Tensor:
    payload = codec.encode(x, ctx)
    return (codec.decode(payload, x.numel(), ctx).double() - x.double()).abs()


def check_config(codec: Codec) -> None:
    """Config through JSON, ``get_codec(config) == codec``, hashable, ``eval(repr)`` round trip."""
    config = codec.get_config()
    assert config["id"] == codec.codec_id, f"{codec!r}: config id {config['id']!r}"
    again = get_codec(json.loads(json.dumps(config)))
    assert again == codec, f"{codec!r}: JSON config round trip gave {again!r}"
    assert hash(again) == hash(codec), f"{codec!r}: equal codecs hash differently"
    namespace = {type(codec).__name__: type(codec)}
    assert eval(repr(codec), namespace) == codec, f"repr {codec!r} does not round-trip"
    try:
        type(codec).from_config({**config, "no_such_key": 1})
    except ValueError as exc:
        assert "no_such_key" in str(exc), f"{codec!r}: unknown-key error does not name it"
    else:
        raise AssertionError(f"{codec!r}: an unknown config key was accepted")


def check_roundtrip(codec: Codec, x: torch.Tensor, ctx: HopContext | None = None) -> None:
    """Wire size, payload type, decode shape/dtype, ``out=`` and determinism for one input."""
    payload = codec.encode(x, ctx)
    assert payload.dtype == torch.uint8 and payload.dim() == 1, f"{codec!r}: payload type"
    size = codec.encoded_nbytes(x.numel(), ctx)
    if size is not None:
        assert payload.numel() == size, (
            f"{codec!r}: encoded_nbytes({x.numel()}) is {size} but encode wrote "
            f"{payload.numel()} bytes (ctx {ctx})"
        )
    y = codec.decode(payload, x.numel(), ctx)
    assert y.dtype == torch.float32 and y.shape == (x.numel(),), f"{codec!r}: decode shape"
    out = torch.empty(x.numel(), dtype=torch.float32)
    same = codec.decode(payload, x.numel(), ctx, out=out)
    assert same is out and torch.equal(out.view(torch.int32), y.view(torch.int32))
    again = codec.encode(x, ctx)
    assert torch.equal(again, payload), f"{codec!r}: encode is not deterministic"
    assert torch.equal(codec.encode(x.clone(), ctx), payload)


def check_bound_sound(codec: Codec, x: torch.Tensor, ctx: HopContext | None = None) -> float:
    """``|decode(encode(x)) - x| <= error_bound.max_abs_error(x)`` element-wise; returns the
    largest error / bound (0 where every bound is 0)."""
    err = _err(codec, x, ctx)
    bound = codec.error_bound.max_abs_error(x, ctx)
    assert bound.dtype == torch.float64 and bound.shape == x.shape, f"{codec!r}: bound shape"
    assert bool(torch.isfinite(bound).all()), f"{codec!r}: non-finite bound for finite input"
    bad = err > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise AssertionError(
            f"{codec!r}: error {err[i].item()!r} > bound {bound[i].item()!r} at index {i} "
            f"(x = {x[i].item()!r}, dtype {x.dtype}, numel {x.numel()}, ctx {ctx})"
        )
    pos = bound > 0
    return float((err[pos] / bound[pos]).max()) if bool(pos.any()) else 0.0


def check_encoded_nbytes(codec: Codec, sizes: tuple[int, ...] | None = None) -> None:
    """``encoded_nbytes(n, ctx)`` is the size of what ``encode`` writes, for ``n`` in
    ``sizes`` (default: 0, 1, block remainders, several blocks) and two contexts; a mismatch
    is reported as such, with the codec and both sizes (not as a later size error)."""
    b = codec.block_size
    ns = sizes if sizes is not None else sorted({0, 1, max(b - 1, 1), b, b + 1, 3 * b + 5})
    base = golden_input(b)
    for n in ns:
        x = base.repeat(-(-n // max(base.numel(), 1)) or 1)[:n].contiguous()
        for ctx in (HopContext(), HopContext(seed=3, step=1, hop=1, num_hops=3, offset=5 * b)):
            declared = codec.encoded_nbytes(n, ctx)
            try:
                payload = codec.encode(x, ctx)
            except ValueError as exc:
                if "encoded_nbytes" not in str(exc):
                    raise
                raise AssertionError(f"{codec!r}: {exc}") from None
            if declared is not None and payload.numel() != declared:
                raise AssertionError(
                    f"{codec!r}: encoded_nbytes({n}) is {declared} but encode wrote "
                    f"{payload.numel()} bytes for {n} values (ctx {ctx})"
                )


def check_bound_edges(codec: Codec) -> float:
    """:func:`check_bound_sound` on the fixed inputs of
    :func:`~dynamiq.testing.strategies.edge_battery`, aimed where a bound is reached (the
    witness and dwarfed blocks at every edge exponent, nudged one ulp). Returns the largest
    error / bound seen: a bound reached exactly somewhere is found to the ulp, whatever the
    Hypothesis example count."""
    worst = 0.0
    for x in edge_battery(codec):
        worst = max(worst, check_bound_sound(codec, x))
    return worst


def check_bound_tight(codec: Codec, numel: int = 1024) -> float:
    """On the bound's witness input the error reaches at least half the bound somewhere.

    Returns the largest ratio observed error / bound.
    """
    eb = codec.error_bound
    x = eb.witness(numel)
    assert x.numel() == numel and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    err = _err(codec, x)
    bound = eb.max_abs_error(x)
    if bool((bound == 0).all()):
        assert bool((err == 0).all()), f"{codec!r}: zero bound but non-zero error"
        return 1.0
    check_bound_sound(codec, x)
    ratio = float((err / bound.clamp(min=1e-300))[bound > 0].max())
    assert ratio >= 0.5, f"{codec!r}: bound not tight: witness reaches {ratio:.3g} of it"
    return ratio


def check_reduce(
    codec: Codec,
    partial: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext | None = None,
    out_ctx: HopContext | None = None,
) -> None:
    """``reduce == encode(decode(payload) + local, out_ctx)`` bit-exactly (re-quantizing
    codecs), or within the bound of ``decode(payload) + local`` (homomorphic codecs)."""
    payload = codec.encode(partial, ctx)
    result = codec.reduce(payload, local, ctx, out_ctx)
    total = codec.decode(payload, local.numel(), ctx) + local.float()
    octx = ctx if out_ctx is None else out_ctx
    if not codec.homomorphic:
        expected = codec.encode(total, octx)
        assert torch.equal(result, expected), f"{codec!r}: reduce differs from re-encoding"
    else:
        got = codec.decode(result, local.numel(), octx).double()
        bound = codec.error_bound.max_abs_error(total, octx)
        assert bool(((got - total.double()).abs() <= bound).all()), f"{codec!r}: reduce bound"


def check_nonfinite(codec: Codec) -> None:
    """NaN/±Inf follow the declared policy: never a silent finite value at their position;
    blocks without non-finite values are unaffected, and so are the bounds of values outside
    the codec's ``bound_block`` around them (a value that decodes to NaN has bound ``inf``)."""
    b = codec.block_size
    n = 4 * b + 3
    x = torch.linspace(-3, 5, n, dtype=torch.float32)
    specials = {1: math.nan, b + 2: math.inf, 2 * b + 1: -math.inf}
    for i, v in specials.items():
        x[i] = v
    y = codec.decode(codec.encode(x), n)
    for i, v in specials.items():
        yi = y[i].item()
        ok = math.isnan(yi) or (math.isinf(v) and yi == v)
        assert ok, f"{codec!r}: input {v} at {i} decoded to finite {yi}"
    clean = torch.ones(n, dtype=torch.bool)
    for i in specials:
        start = i // b * b
        clean[start : start + b] = False
    xs = x.clone()
    xs[~clean] = 0.0
    ref = codec.decode(codec.encode(xs), n)
    assert torch.equal(y[clean], ref[clean]), f"{codec!r}: a NaN/Inf leaked into clean blocks"
    assert bool(torch.isfinite(y[clean]).all())
    # the bound: finite and sound outside the bound blocks of the NaN/Inf, and never finite
    # where a finite input decoded to a non-finite value
    bound = codec.error_bound.max_abs_error(x)
    bb = codec.bound_block
    far = torch.ones(n, dtype=torch.bool)
    for i in specials:
        far[i // bb * bb : i // bb * bb + bb] = False
    assert bool(torch.isfinite(bound[far]).all()), (
        f"{codec!r}: a NaN/Inf spoiled the bound of finite values outside its "
        f"{bb}-value bound block"
    )
    err = (y.double() - x.double()).abs()
    bad = far & ~(err <= bound)
    assert not bool(bad.any()), f"{codec!r}: bound violated next to a NaN/Inf at {bad.nonzero()[0]}"
    lost = torch.isfinite(x) & ~torch.isfinite(y)
    assert not bool(torch.isfinite(bound[lost]).any()), (
        f"{codec!r}: a finite bound for values that decode to NaN/Inf"
    )


def check_bad_input(codec: Codec) -> None:
    """Wrong dtype, shape, contiguity, payload size/dtype, device mix: clear errors."""
    x = torch.linspace(-1, 1, 2 * codec.block_size + 1)
    payload = codec.encode(x)

    def raises(exc: type[Exception], words: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except exc as e:
            assert words in str(e), f"{codec!r}: error {e!r} does not mention {words!r}"
        else:
            raise AssertionError(f"{codec!r}: {fn.__name__}{args!r:.60} did not raise")

    raises(TypeError, "dtype", codec.encode, x.double())
    raises(TypeError, "dtype", codec.encode, x.to(torch.int32))
    raises(TypeError, "Tensor", codec.encode, x.tolist())
    raises(ValueError, "1-D", codec.encode, x[:-1].view(-1, 1))
    raises(ValueError, "contiguous", codec.encode, torch.linspace(-1, 1, 40)[::2])
    raises(TypeError, "ctx", codec.encode, x, {"seed": 1})
    size = codec.encoded_nbytes(x.numel())
    if size is not None:
        raises(ValueError, "bytes", codec.decode, payload[:-1], x.numel())
        raises(ValueError, "bytes", codec.decode, torch.cat([payload, payload[:1]]), x.numel())
        raises(ValueError, "bytes", codec.reduce, payload[:-1], x)
    raises(TypeError, "uint8", codec.decode, payload.to(torch.int32), x.numel())
    raises(TypeError, "int", codec.decode, payload, float(x.numel()))
    raises(ValueError, "numel", codec.decode, payload, -1)
    raises(TypeError, "float32", codec.decode, payload, x.numel(), None, torch.empty(1).double())
    raises(ValueError, "shape", codec.decode, payload, x.numel(), None, torch.empty(x.numel() + 1))
    raises(ValueError, "same device", codec.reduce, payload.to("meta"), x)


def check_unbiased(codec: Codec, trials: int = 400, z_max: float = 5.0) -> float:
    """Statistical test of unbiasedness for codecs that declare it.

    Encodes one fixed input under ``trials`` seeds and forms the z-score of the total error
    against the declared per-element variance bound: under ``E[x̂] = x`` the score is within
    ``±z_max`` (5σ: two-sided false-alarm probability < 6e-7 by Chebyshev-free normal
    approximation over ``trials × numel`` independent draws). Returns the z-score.
    """
    assert codec.error_bound.unbiased, f"{codec!r} does not declare unbiased"
    n = 8 * codec.block_size
    k = torch.arange(n, dtype=torch.float64)
    x = (torch.sin(k * 0.7) * 3 + torch.cos(k * 1.3)).float()
    var = codec.error_bound.variance(x).sum()
    total = torch.zeros((), dtype=torch.float64)
    for t in range(trials):
        ctx = HopContext(seed=t + 1)
        total += (codec.decode(codec.encode(x, ctx), n, ctx).double() - x.double()).sum()
    z = float(total / torch.sqrt(var * trials)) if var > 0 else 0.0
    assert abs(z) <= z_max, f"{codec!r}: mean error z-score {z:.2f} (bias)"
    return z


def _share(fraction: int) -> int:
    """A ``1/fraction`` share of the examples of the settings in force (at least 1)."""
    current = settings.default
    return max(1, (current.max_examples if current else 100) // fraction)


def _engine_properties(codec: Codec, allreduce: bool) -> None:
    """Block locality on drawn inputs, contexts and cuts, and (``allreduce``) the multi-hop
    bound over drawn per-rank tensors and schedules, at reduced example counts."""
    b = codec.block_size

    @settings(parent=settings.default, max_examples=_share(8))
    @given(
        x=codec_inputs(codec, max_abs=codec.max_input_abs / 4),  # (room for the prologue)
        ctx=hop_contexts(block_size=b, max_offset=2**30),
        data=st.data(),
    )
    def block_local(x: torch.Tensor, ctx: HopContext, data: st.DataObject) -> None:
        blocks = -(-x.numel() // b)
        inner = (
            st.lists(st.integers(1, blocks - 1), max_size=4, unique=True)
            if blocks > 1
            else st.just([])
        )
        points = [0, *sorted(i * b for i in data.draw(inner)), x.numel()]
        check_block_locality(codec, x, ctx, [list(itertools.pairwise(points))])

    @settings(parent=settings.default, max_examples=_share(20))
    @given(data=st.data(), seed=st.integers(0, 2**31))
    def allreduce_bound(data: st.DataObject, seed: int) -> None:
        limit = min(codec.max_input_abs, 2.0**100) / 64  # partial sums stay within range
        size = (0, min(4 * b, 1024))
        xs = data.draw(tensor_lists(b, ranks=(1, 4), size=size, max_abs=limit), label="tensors")
        sched = data.draw(schedules(len(xs)), label="schedule")
        check_allreduce_bound(xs, codec, sched, seed=seed, sub_chunks=(b,))

    block_local()
    if allreduce:
        allreduce_bound()


def run_conformance(
    codec: Codec | str, fixtures_dir: str | Path | None = None, *, allreduce: bool = True
) -> None:
    """Every check of the kit on one codec, under the Hypothesis settings in force (the
    caller's profile; an eighth of its examples for block locality and, with ``allreduce``,
    a twentieth for the multi-hop bound through the engine)."""
    codec = get_codec(codec)
    check_encoded_nbytes(codec)
    check_config(codec)
    check_bad_input(codec)
    check_nonfinite(codec)
    check_bound_tight(codec)
    check_bound_edges(codec)
    check_block_locality(codec, golden_input(codec.block_size))
    if codec.error_bound.unbiased and codec.error_bound.var is not None:
        check_unbiased(codec)
    if fixtures_dir is not None:
        check_golden(codec, fixtures_dir)

    @given(x=codec_inputs(codec), ctx=st.one_of(st.none(), hop_contexts()))
    def roundtrip_and_bound(x: torch.Tensor, ctx: HopContext | None) -> None:
        check_roundtrip(codec, x, ctx)
        check_bound_sound(codec, x, ctx)

    @given(data=st.data(), ctx=hop_contexts(), out_ctx=st.one_of(st.none(), hop_contexts()))
    def reduce_matches(data: st.DataObject, ctx: HopContext, out_ctx: HopContext | None) -> None:
        half = codec.max_input_abs / 4  # decoded partial + local stays within the limit
        partial = data.draw(codec_inputs(codec, max_abs=half))
        local = data.draw(codec_inputs(codec, max_abs=half))
        n = min(partial.numel(), local.numel())
        check_reduce(codec, partial[:n].contiguous(), local[:n].contiguous(), ctx, out_ctx)

    roundtrip_and_bound()
    reduce_matches()
    _engine_properties(codec, allreduce)
