"""The DynamiQ codec: widths from integer scale codes, fixed wire size, levels, rounding;
the batched reference against the readable, span-by-span one
(``dynamiq/codecs/dynamiq_reference.py``, "the oracle" here)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynamiq.codecs.dynamiq_codec as dc
import dynamiq.kernels as K
from dynamiq.codecs import DynamiqCodec, HopContext, get_codec
from dynamiq.codecs._dynamiq_levels import DISTORTION_FITTED
from dynamiq.codecs.dynamiq_codec import level_table
from dynamiq.codecs.dynamiq_reference import DynamiqReference
from dynamiq.codecs.dynamiq_reference import _quantize as oracle_quantize
from dynamiq.kernels import _compiled
from dynamiq.testing.strategies import finite_tensors, hop_contexts

SMALL = {"span": 1024, "super_group": 256, "group": 16}


def _reference_widths(
    codec: DynamiqCodec, s_sg: list[float], e: list[int], length: int, budget: int
) -> list[int]:
    """Reverse water-filling written with Python integers and linear scans: the next bit of a
    group is worth 4k·log2(s^2 (D(w) - D(w+1))) = 8 L + Q[w]; take every bit worth at least
    the lowest threshold that fits the budget, then the bits worth one less, in index order,
    while they fit."""
    k = codec.scale_steps
    d = DISTORTION_FITTED
    q = [round(4 * k * math.log2(d[w] - d[w + 1])) for w in range(8)]
    per_sg = codec.super_group // codec.group
    sizes = [codec.group] * len(e)
    sizes[-1] = length - codec.group * (len(e) - 1)
    live = [s_sg[i // per_sg] > 0 for i in range(len(e))]
    if not any(live):
        return [0] * len(e)
    level = [
        k * math.frexp(s_sg[i // per_sg])[1] - k - e[i] if live[i] else 0 for i in range(len(e))
    ]
    prio = [
        [8 * level[i] + q[w] for w in range(8)] if live[i] else [-(1 << 40)] * 8
        for i in range(len(e))
    ]

    def widths(tau: int) -> list[int]:
        return [sum(1 for p in row if p >= tau) for row in prio]

    def cost(tau: int) -> int:
        return sum(w * n for w, n in zip(widths(tau), sizes, strict=True))

    tau = max(p for row, ok in zip(prio, live, strict=True) if ok for p in row) + 1
    while cost(tau - 1) <= budget and tau > min(
        min(r) for r, ok in zip(prio, live, strict=True) if ok
    ):
        tau -= 1
    w = widths(tau)
    left = budget - sum(a * n for a, n in zip(w, sizes, strict=True))
    spent = 0
    for i in range(len(w)):
        if w[i] < 8 and prio[i][w[i]] == tau - 1:
            spent += sizes[i]
            if spent <= left:
                w[i] += 1
    return w


@settings(max_examples=40)
@given(
    scales=st.lists(st.floats(1e-30, 1e30, allow_nan=False), min_size=1, max_size=4),
    codes=st.lists(st.integers(0, 15), min_size=64, max_size=64),
    bits=st.sampled_from([0.5, 1.5, 3.0, 4.7, 7.9]),
    steps=st.integers(1, 3),
    length=st.integers(1, 1024),
)
def test_widths_match_a_plain_greedy(scales, codes, bits, steps, length) -> None:  # type: ignore[no-untyped-def]
    codec = DynamiqCodec(bits=bits, scale_steps=steps, **SMALL)
    n_g = -(-length // 16)
    n_sg = -(-length // 256)
    s_sg = torch.tensor((scales * 4)[:n_sg], dtype=torch.float32).bfloat16().float()
    e = torch.tensor(codes[:n_g], dtype=torch.int64)
    budget = codec._budget(length, None)
    got = codec._widths(s_sg, e, length, budget).tolist()
    assert got == _reference_widths(codec, s_sg.tolist(), e.tolist(), length, budget)
    sizes = [16] * n_g
    sizes[-1] = length - 16 * (n_g - 1)
    assert sum(w * n for w, n in zip(got, sizes, strict=True)) <= budget


def test_widths_depend_only_on_scale_codes() -> None:
    """Changing values without changing any group's absmax leaves every code of the other
    groups, and all widths, unchanged: the receiver needs nothing but the scale codes."""
    codec = DynamiqCodec(**SMALL)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * torch.exp(torch.randn(1024, generator=g) * 2)
    s1, e1, _ = codec._scales(x)
    y = x.clone()
    blk = y[32:48]
    keep = int(blk.abs().argmax())
    noise = torch.rand(16, generator=g) * 0.5 - 0.25
    noise[keep] = 0
    y[32:48] = blk * (1 + noise)
    y[32 + keep] = x[32 + keep]
    s2, e2, _ = codec._scales(y)
    assert torch.equal(s1, s2) and torch.equal(e1, e2)
    w1 = codec._widths(s1, e1, 1024, codec._budget(1024, None))
    w2 = codec._widths(s2, e2, 1024, codec._budget(1024, None))
    assert torch.equal(w1, w2)


def test_group_scale_covers_the_group() -> None:
    codec = DynamiqCodec(**SMALL)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, generator=g) * torch.exp(torch.randn(1024, generator=g) * 4)
    s_sg, e, a_g = codec._scales(x)
    s_g = codec._group_scale(s_sg.repeat_interleave(16), e)
    assert bool((s_g >= a_g).all())
    # and it is the tightest code: one more step down would not cover the group
    tighter = codec._group_scale(s_sg.repeat_interleave(16), (e + 1).clamp(max=15))
    assert bool(((tighter < a_g) | (e == 15)).all())


@pytest.mark.parametrize("kind", ["fitted", "uniform"])
def test_level_tables(kind: str) -> None:
    for w in range(1, 9):
        lv = level_table(kind, w)
        assert lv.numel() == 1 << w
        assert bool((lv[1:] > lv[:-1]).all())
        assert torch.equal(lv, -lv.flip(0))
        assert float(lv.abs().max()) <= 1.0
    assert float(level_table("uniform", 4)[-1]) == 1.0


def test_wire_size_fixed_by_numel_config_and_ctx() -> None:
    codec = DynamiqCodec(bits=4.0, hop_slope=2.0, **SMALL)
    x = torch.randn(3000)
    for hop in range(5):
        ctx = HopContext(hop=hop, num_hops=5)
        assert codec.encode(x, ctx).numel() == codec.encoded_nbytes(3000, ctx)
        assert codec.encode(torch.zeros(3000), ctx).numel() == codec.encoded_nbytes(3000, ctx)
    sizes = [codec.encoded_nbytes(3000, HopContext(hop=h, num_hops=5)) for h in range(5)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]  # later hops get more bits
    mean_bits = sum(sizes) * 8 / 5 / 3000
    assert abs(mean_bits - codec.bits_per_value(3000)) < 0.05


def test_default_is_under_five_bits_per_value() -> None:
    assert get_codec("dynamiq").bits_per_value(1 << 20) <= 5.0


def test_correlated_dither_is_stratified_across_hops() -> None:
    """Over the H hops of a coordinate, its dithers fall in H different strata [i/H, (i+1)/H):
    each hop is uniform (unbiased) yet the hops' rounding errors are anti-correlated."""
    codec = DynamiqCodec(rounding="correlated", **SMALL)
    idx = torch.arange(5000)
    h = 7
    us = torch.stack(
        [codec._span_ctx_u(idx, HopContext(seed=3, hop=k, num_hops=h, rank=k)) for k in range(h)]
    )
    strata = (us * h).floor().long()
    assert bool((strata.sort(dim=0).values == torch.arange(h).unsqueeze(1)).all())
    hist = torch.bincount((us[0] * 10).long(), minlength=10).double()
    assert float(hist.min()) > 400  # one hop alone is uniform


def test_correlated_rounding_cancels_errors_across_hops() -> None:
    """Rounding the same values at H hops: the summed error is smaller with correlated than
    with independent stochastic rounding (the point of stratification)."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(8192, generator=g) * 2 - 1
    x[::16] = 1.0  # every group has the same scale, so every group gets the same width
    err = {}
    for rounding in ("stochastic", "correlated"):
        codec = DynamiqCodec(bits=3.0, rounding=rounding, **SMALL)
        total = torch.zeros(8192, dtype=torch.float64)
        for k in range(8):
            ctx = HopContext(seed=1, hop=k, num_hops=8, rank=0)
            total += codec.decode(codec.encode(x, ctx), 8192, ctx).double() - x.double()
        err[rounding] = float(total.square().mean())
    assert err["correlated"] < 0.7 * err["stochastic"], err


@pytest.mark.parametrize(
    "config,exc,words",
    [
        ({"bits": 9}, ValueError, "bits must be in 0.5..8 (got 9)"),
        ({"bits": "4"}, TypeError, "bits must be a number"),
        (
            {"span": 1536, "super_group": 1024},
            ValueError,
            "span (1536) must be a multiple of super_group",
        ),
        ({"levels": "lloyd"}, ValueError, "levels must be one of"),
        ({"rounding": "up"}, ValueError, "rounding must be one of"),
        ({"scale_steps": 5}, ValueError, "scale_steps must be in 1..4 (got 5)"),
        ({"hop_slope": -1}, ValueError, "hop_slope must be in 0..4"),
        ({"balance": 0.5}, ValueError, "balance must be in 1..1e6 (got 0.5)"),
        ({"balance_slack": -1}, ValueError, "balance_slack must be in 0..1073741824 (got -1)"),
        ({"balance_slack": 1.5}, TypeError, "balance_slack must be an int"),
    ],
)
def test_bad_config(config: dict, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc) as info:
        get_codec({"id": "dynamiq", **config})
    assert words in str(info.value)


def test_nan_super_group_decodes_nan_and_others_survive() -> None:
    codec = DynamiqCodec(**SMALL)
    x = torch.randn(1024)
    x[300] = math.nan
    y = codec.decode(codec.encode(x), 1024)
    assert bool(torch.isnan(y[256:512]).all())
    assert bool(torch.isfinite(y[:256]).all() and torch.isfinite(y[512:]).all())


# -- the batched reference against the span-by-span oracle ----------------------------------

#: (span, super_group, group): default-like, small, and group sizes that are not multiples of 8
GEOMETRIES = [
    (1024, 256, 16),
    (2048, 1024, 16),
    (512, 64, 8),
    (256, 256, 32),
    (480, 96, 12),
    (64, 8, 2),
    (96, 48, 24),
    (384, 128, 4),
]


@st.composite
def dynamiq_configs(draw: st.DrawFn) -> DynamiqCodec:
    """Every knob of the codec, on spans small enough for the oracle."""
    span, sg, g = draw(st.sampled_from(GEOMETRIES))
    return DynamiqCodec(
        bits=draw(st.sampled_from([0.5, 1.0, 2.3, 3.5, 4.7, 6.0, 7.9, 8.0])),
        span=span,
        super_group=sg,
        group=g,
        levels=draw(st.sampled_from(["fitted", "uniform"])),
        rounding=draw(st.sampled_from(["nearest", "stochastic", "correlated"])),
        hop_slope=draw(st.sampled_from([0.0, 0.0, 1.0, 2.5])),
        pooled=draw(st.booleans()),
        scale_steps=draw(st.integers(1, 4)),
    )


@st.composite
def oracle_inputs(draw: st.DrawFn, span: int) -> torch.Tensor:
    """Finite inputs around the span (all dtypes), sometimes with NaN or ±Inf mixed in."""
    x = draw(finite_tensors(span, max_abs=2.0**100))
    if x.numel() and draw(st.booleans()):
        n_bad = draw(st.integers(1, 3))
        where = draw(st.lists(st.integers(0, x.numel() - 1), min_size=n_bad, max_size=n_bad))
        bad = draw(st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), min_size=n_bad))
        x = x.clone()
        for i, v in zip(where, bad, strict=False):
            x[i] = v
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors as integers (bit-exact comparison, NaN payloads included)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


def _assert_same_values(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    assert torch.equal(_bits(got.nan_to_num(0.0)), _bits(want.nan_to_num(0.0))), what


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: {got.numel()} bytes, want {want.numel()}"
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"{what}: first differing byte {int(diff[0, 0])}"


def oracle_outputs(
    codec: DynamiqCodec, x: torch.Tensor, local: torch.Tensor, ctx: HopContext, out_ctx: HopContext
) -> dict[str, torch.Tensor]:
    """The oracle's payload, decoded values, bound and reduced payload."""
    oracle = DynamiqReference(codec)
    payload = oracle.encode(x, ctx)
    decoded = oracle.decode(payload, x.numel(), ctx)
    return {
        "payload": payload,
        "decoded": decoded,
        "max_abs": oracle.max_abs(x, ctx),
        "reduced": oracle.reduce(payload, local, ctx, out_ctx),
    }


def check_against_oracle(
    codec: DynamiqCodec,
    x: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    want: dict[str, torch.Tensor] | None = None,
) -> None:
    """Bytes, decoded values, ``max_abs_error`` and ``reduce`` identical to the oracle's."""
    want = want or oracle_outputs(codec, x, local, ctx, out_ctx)
    p = want["payload"]
    _assert_same_bytes(codec._encode(x, ctx), p, f"{codec!r} encode")
    _assert_same_values(codec._decode(p, x.numel(), ctx), want["decoded"], f"{codec!r} decode")
    _assert_same_values(
        codec.error_bound.max_abs_error(x, ctx), want["max_abs"], f"{codec!r} max_abs"
    )
    _assert_same_bytes(codec._reduce(p, local, ctx, out_ctx), want["reduced"], f"{codec!r} reduce")


@contextlib.contextmanager
def blocks_of(values: int, tau_grid: int | None = None) -> Iterator[None]:
    """Process ``values`` values per block (small blocks: small inputs cross blocks too);
    ``tau_grid`` 0 makes every water-filling threshold search a bisection."""
    old = dc._BLOCK, dc._TAU_GRID
    dc._BLOCK = values
    dc._TAU_GRID = old[1] if tau_grid is None else tau_grid
    try:
        yield
    finally:
        dc._BLOCK, dc._TAU_GRID = old


@settings(max_examples=min(50, settings.default.max_examples))
@given(codec=dynamiq_configs(), data=st.data(), ctx=hop_contexts(), out_ctx=hop_contexts())
def test_matches_the_span_by_span_oracle(
    codec: DynamiqCodec, data: st.DataObject, ctx: HopContext, out_ctx: HopContext
) -> None:
    x = data.draw(oracle_inputs(codec.span), label="x")
    local = data.draw(finite_tensors(codec.span, max_abs=2.0**100), label="local")
    n = min(x.numel(), local.numel())
    tau_grid = data.draw(st.sampled_from([None, 0]), label="tau_grid")
    with blocks_of(2048, tau_grid):  # blocks of one to 32 spans
        check_against_oracle(codec, x[:n].contiguous(), local[:n].contiguous(), ctx, out_ctx)


def _heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"rounding": "stochastic", "levels": "uniform", "scale_steps": 1},
        {"rounding": "correlated", "hop_slope": 2.0, "bits": 3.2},
        {"pooled": False, "bits": 5.5},
    ],
    ids=["default", "stochastic-uniform", "correlated-slope", "flat"],
)
def test_matches_the_oracle_on_default_spans(config: dict[str, Any]) -> None:
    """A full 65,536-value span and a short last span (special values in); block boundaries
    are the Hypothesis test's."""
    codec = DynamiqCodec(**config)
    n = 65536 + 1000
    x = _heavy_tailed(n, 1)
    x[:70000:97] = 0.0
    x[1:5000:101] = 2.0**-140
    x[10_240:11_264] = 0.0  # a whole super-group of zeros
    x[30_000] = math.nan
    x[65536 + 10] = -math.inf
    local = _heavy_tailed(n, 2).bfloat16()
    ctx = HopContext(seed=9, step=4, hop=1, num_hops=6, rank=5, offset=12_345)
    out_ctx = HopContext(seed=9, step=4, hop=2, num_hops=6, rank=4, offset=12_345)
    want = oracle_outputs(codec, x, local, ctx, out_ctx)
    check_against_oracle(codec, x, local, ctx, out_ctx, want)
    with blocks_of(dc._BLOCK, tau_grid=0):  # the bisection
        check_against_oracle(codec, x, local, ctx, out_ctx, want)


@pytest.mark.parametrize("geometry", [(1024, 256, 16), (512, 64, 8)])
def test_portable_paths_match_the_oracle(
    monkeypatch: pytest.MonkeyPatch, geometry: tuple[int, int, int]
) -> None:
    """The byte-order-free packing of big-endian machines gives the same bytes as the
    64-bit word views."""
    monkeypatch.setattr(dc, "_LITTLE", False)
    span, sg, g = geometry
    for rounding in ("nearest", "stochastic"):
        codec = DynamiqCodec(span=span, super_group=sg, group=g, rounding=rounding, bits=3.7)
        x = _heavy_tailed(3 * span + 77, 3)
        ctx = HopContext(seed=1, hop=1, num_hops=3)
        check_against_oracle(codec, x, _heavy_tailed(x.numel(), 4), ctx, ctx)


def _neighbours(v: torch.Tensor, k: int) -> torch.Tensor:
    """``v`` and its ``k`` nearest fp32 neighbours on each side (within [-1, 1])."""
    a = v.float().numpy().astype(np.float32)
    out = [a]
    up, down = a.copy(), a.copy()
    for _ in range(k):
        up = np.nextafter(up, np.float32(2))
        down = np.nextafter(down, np.float32(-2))
        out += [up, down]
    return torch.from_numpy(np.concatenate(out)).clamp(-1, 1)


@pytest.mark.parametrize("kind", ["fitted", "uniform"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_level_lookup_matches_searchsorted(kind: str, rounding: str) -> None:
    """The cell tables give exactly the oracle's searchsorted-and-divide rounding: at every
    level, every midpoint (where nearest rounding flips) and every cell edge, and at the
    32 fp32 values on each side of them, and on a dense grid of [-1, 1]."""
    codec = DynamiqCodec(levels=kind, rounding=rounding)
    oracle = DynamiqReference(codec)
    tables = dc._tables(kind, rounding != "nearest", torch.device("cpu"))
    cells = torch.arange(2 * dc._CELLS + 1, dtype=torch.float64) / dc._CELLS - 1
    for w in range(1, 9):
        lv = oracle._levels(w)
        points = torch.cat([lv, (lv[1:] + lv[:-1]) / 2, cells.float(), torch.tensor([0.0, -0.0])])
        y = torch.cat([_neighbours(points, 32), torch.linspace(-1, 1, 100_003)])
        pad = (-y.numel()) % 16
        y = torch.cat([y, torch.zeros(pad)]).view(1, -1, 16)
        u = None
        if rounding != "nearest":
            g = torch.Generator().manual_seed(w)
            u = torch.rand(y.shape, generator=g).clamp(min=2.0**-24)
            u.view(-1)[::7] = 1.0  # correlated rounding's dither can round to 1
            u.view(-1)[1::7] = 0.5
            u.view(-1)[2::7] = 2.0**-24
        width = torch.full(y.shape[:2], w, dtype=torch.int64)
        got = dc._quantize(y, width, tables, u).view(-1).long()
        want = oracle_quantize(y.view(-1), lv, None if u is None else u.view(-1))
        assert torch.equal(got, want), f"width {w}: {int((got != want).sum())} values differ"


# -- the CPU fast path (compiled block functions) ---------------------------------------------


@pytest.fixture
def cpu_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DYNAMIQ_CPU_COMPILE", raising=False)
    monkeypatch.setattr(dc, "_BLOCK", 2 * 1024)
    _compiled._CACHE.clear()
    K.set_cpu_compile(True)
    yield
    K.set_cpu_compile(None)
    _compiled._CACHE.clear()


def test_fast_path_runs_the_compiled_blocks(
    cpu_compile: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the CPU fast path on, the dispatcher runs the codec's compiled block functions
    (a stand-in for ``torch.compile`` here) on all the full spans at once, the plain ones on
    the short last span; the bytes are the plain reference's."""
    compiled: list[str] = []

    def fake_compile(fn: Any, dynamic: bool | None = True) -> Any:
        assert dynamic is None  # the row count is marked dynamic, the rest is static
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    codec = DynamiqCodec(**SMALL)
    n = _compiled.MIN_NUMEL + 1500  # full spans and a short one
    x, local = _heavy_tailed(n, 5), _heavy_tailed(n, 6)
    ctx, out_ctx = HopContext(hop=0, num_hops=2), HopContext(hop=1, num_hops=2)
    p = codec.encode(x, ctx)
    assert torch.equal(p, codec._encode(x, ctx))
    assert torch.equal(codec.decode(p, n, ctx), codec._decode(p, n, ctx))
    assert torch.equal(codec.reduce(p, local, ctx, out_ctx), codec._reduce(p, local, ctx, out_ctx))
    assert compiled == ["_encode_rows", "_decode_rows", "_reduce_rows"]


def test_fast_path_falls_back_when_the_compiler_fails(
    cpu_compile: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def broken(fn: Any, dynamic: bool | None = True) -> Any:
        def run(*args: Any) -> Any:
            calls.append(1)
            raise RuntimeError("InductorError: no working C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    codec = DynamiqCodec(**SMALL)
    x = _heavy_tailed(_compiled.MIN_NUMEL, 7)
    want = codec._encode(x, HopContext())
    assert torch.equal(codec.encode(x), want)
    assert torch.equal(codec.encode(x), want)
    assert calls == [1] and _compiled._CACHE[(codec, "encode_rows")] is None  # not retried
    assert _compiled.failed(codec, "encode_rows")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, importing Inductor
def test_compiled_blocks_are_bit_exact() -> None:
    """The real ``torch.compile`` of the block functions (needs a C++ compiler; minutes)."""
    codec = DynamiqCodec(**SMALL)
    stochastic = DynamiqCodec(rounding="stochastic", **SMALL)
    n = 50 * 1024 + 777
    x = _heavy_tailed(n, 8)
    x[::997] = 0.0
    x[5::1009] = 2.0**-140
    x[30_000] = math.nan
    x[40_000:41_024] = 0.0
    local = _heavy_tailed(n, 9)
    ctx, out_ctx = HopContext(seed=2, hop=0, num_hops=2), HopContext(seed=2, hop=1, num_hops=2)
    _compiled._CACHE.clear()
    try:
        p = codec._encode(x, ctx)
        assert torch.equal(codec._encode(x, ctx, compiled=True), p)
        _assert_same_values(
            codec._decode(p, n, ctx, compiled=True), codec._decode(p, n, ctx), "decode"
        )
        for c in (codec, stochastic):
            want = c._reduce(p, local, ctx, out_ctx)
            assert torch.equal(c._reduce(p, local, ctx, out_ctx, compiled=True), want)
        assert set(_compiled._CACHE) == {
            (codec, "encode_rows"),
            (codec, "decode_rows"),
            (codec, "reduce_rows"),
            (stochastic, "reduce_rows"),
        }
        assert all(fn is not None for fn in _compiled._CACHE.values()), "fell back to eager"
    finally:
        _compiled._CACHE.clear()


def test_bf16_round_up_matches_torch_conversion() -> None:
    """The integer ``roundup_bf16`` is torch's bf16 conversion stepped up when it fell below:
    on random fp32 bit patterns (subnormals included), every bf16 value and its fp32
    neighbours, zero, the largest finite value, Inf and NaN."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int64)
    grid = torch.arange(0, 0x7F81, dtype=torch.int64) << 16  # every non-negative bf16 + Inf
    near = torch.cat([grid - 1, grid, grid + 1, grid + 0x8000]).clamp(0, 0x7F800000)
    a = torch.cat([bits, near]).to(torch.int32).view(torch.float32)
    a = torch.cat([a, torch.tensor([0.0, 3.4028234663852886e38, math.inf, math.nan])])
    s = a.to(torch.bfloat16)
    want = torch.where(s.float() < a, (s.view(torch.int16) + 1).view(torch.bfloat16), s).float()
    _assert_same_values(dc._bf16_round_up(a), want, "roundup_bf16")
