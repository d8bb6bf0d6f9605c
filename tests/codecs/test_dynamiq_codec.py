"""The DynamiQ codec: widths from integer scale codes, fixed wire size, levels, rounding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamiq.codecs import DynamiqCodec, HopContext, get_codec
from dynamiq.codecs._dynamiq_levels import DISTORTION_FITTED
from dynamiq.codecs.dynamiq_codec import level_table

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
        ({"span": 1536}, ValueError, "span (1536) must be a multiple of super_group"),
        ({"levels": "lloyd"}, ValueError, "levels must be one of"),
        ({"rounding": "up"}, ValueError, "rounding must be one of"),
        ({"scale_steps": 5}, ValueError, "scale_steps must be in 1..4 (got 5)"),
        ({"hop_slope": -1}, ValueError, "hop_slope must be in 0..4"),
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
