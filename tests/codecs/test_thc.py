"""THC: the wire format against an independent NumPy computation of the documented recipe,
agreed per-segment scales, homomorphic integer aggregation, certified bounds, and all-reduces
in the simulator."""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hash_reference import ref_hash, ref_keys
from hypothesis import given, settings
from hypothesis import strategies as st

import dynamiq.codecs.thc as thc_module
from dynamiq.codecs import HopContext, ThcCodec, get_codec
from dynamiq.codecs.thc import DEFAULT_NORM_CLIP, DEFAULT_TABLE, SHARED_KEY, fwht
from dynamiq.collectives import get_schedule, simulate_allreduce
from dynamiq.collectives.planning import chunk_layout, plan_schedule
from dynamiq.data import load_slice
from dynamiq.testing import check_bound_tight, run_conformance
from dynamiq.testing.strategies import finite_tensors

U = 2.0**-24
G = 30

# -- an independent reference of the documented recipe (plain Python + NumPy) -----------------


def ref_signs(n: int, offset: int = 0, rotation_seed: int = 0) -> np.ndarray:
    keys = ref_keys(rotation_seed, 0, 0xFFFFFFFF, 0)
    return np.array([1.0 - 2.0 * (ref_hash(offset + i, keys) >> 31) for i in range(n)])


def ref_dither(n: int, ctx: HopContext) -> np.ndarray:
    keys = ref_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
    h = [ref_hash(ctx.offset + j, keys) for j in range(n)]
    return np.array([(2 * (v >> 9) + 1) * U for v in h], dtype=np.float32)


def sylvester(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def ref_butterfly_f32(v: np.ndarray) -> np.ndarray:
    """The Walsh–Hadamard butterflies in fp32, stage by stage (pairs i, i + h)."""
    v = v.astype(np.float32).copy()
    d, h = v.size, 1
    while h < d:
        v = v.reshape(-1, 2, h)
        v = np.stack([v[:, 0] + v[:, 1], v[:, 0] - v[:, 1]], axis=1).reshape(-1)
        h *= 2
    return v


def ref_unpack(data: bytes, bits: int, n: int) -> list[int]:
    word = int.from_bytes(data, "little")
    return [(word >> (i * bits)) & ((1 << bits) - 1) for i in range(n)]


def ref_rotate(x: np.ndarray, d: int, offset: int = 0) -> np.ndarray:
    """fp32 rotated coordinates of full blocks of ``x``."""
    s = ref_signs(x.size, offset).astype(np.float32)
    return np.concatenate(
        [ref_butterfly_f32(x[b : b + d] * s[b : b + d]) for b in range(0, x.size, d)]
    )


def roundup_f32(v: float) -> float:
    f = np.float32(v)
    return float(f if float(f) >= v else np.nextafter(f, np.float32(np.inf)))


def ref_statistic(w: np.ndarray, scale: str) -> float:
    """A segment's statistic: RMS of ``w`` (fp64, rounded up to fp32) or its largest |w|."""
    if scale == "max":
        return float(np.abs(w).max())
    return roundup_f32(math.sqrt(float(np.sum(w.astype(np.float64) ** 2)) / w.size))


def ref_range(s: float, t: float) -> float:
    return float(np.float32(s) * np.float32(t))


def ref_positions(w: np.ndarray, r: np.ndarray, c: int = 1, clamp: bool = True) -> np.ndarray:
    """``fl(fl(w / R)·g/2) + c·g/2`` in fp32, per coordinate ``R``."""
    t = np.where(w == 0, np.float32(0), w / np.asarray(r, dtype=np.float32)).astype(np.float32)
    y = (t * np.float32(G // 2)).astype(np.float32) + np.float32(c * G // 2)
    return np.clip(y, 0, c * G).astype(np.float32) if clamp else y.astype(np.float32)


def ref_table_sr(y: np.ndarray, u: np.ndarray, table=DEFAULT_TABLE) -> np.ndarray:
    tab = np.array(table, dtype=np.float32)
    i = np.clip(np.searchsorted(tab, y, side="right") - 1, 0, len(tab) - 2)
    lo, hi = tab[i], tab[i + 1]
    f = ((y - lo) / (hi - lo)).astype(np.float32)
    return i + (u < f)


def ref_grid_sr(y: np.ndarray, u: np.ndarray) -> np.ndarray:
    lo = np.floor(y)
    return (lo + (u < y - lo)).astype(np.int64)


def gaussian(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))


def as_payload(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# -- the transform ------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 1024])
def test_fwht_is_the_sylvester_hadamard_matrix(d: int) -> None:
    x = np.random.default_rng(d).integers(-1000, 1000, (3, d)).astype(np.float64)
    got = fwht(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, x @ sylvester(d))  # integers: exact in any order
    np.testing.assert_array_equal(fwht(torch.from_numpy(got)).numpy() / d, x)  # H·H = d·I


def test_fwht_leaves_its_input_alone() -> None:
    x = torch.randn(2, 256)
    before = x.clone()
    fwht(x)
    assert torch.equal(x, before)


def test_rotation_signs_from_the_cache_match_the_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-process sign cache: first use, growth, a hit, and indices past its cap."""
    monkeypatch.setattr(thc_module, "_SIGN_CACHE", {})
    monkeypatch.setattr(thc_module, "_SIGN_CACHE_MAX", 4096)
    codec = ThcCodec(block_size=256, rotation_seed=7)
    for n, offset in [(300, 5), (1000, 2000), (256, 0), (600, 3900), (60, 4000), (512, 5000)]:
        lay = codec._layout(n)
        got = codec._signs(lay, offset, torch.device("cpu")).numpy()
        np.testing.assert_array_equal(got, ref_signs(lay.ncodes, offset, rotation_seed=7))
    assert thc_module._SIGN_CACHE[(7, torch.device("cpu"))].numel() == 4096  # grown, then capped


# -- the wire format ----------------------------------------------------------------------------

RECIPES = [
    ({}, HopContext()),  # norm, one segment per block, T = DEFAULT_NORM_CLIP
    ({}, HopContext(seed=5, step=7, hop=2, num_hops=4, rank=3, contributions=3)),  # R_k
    ({"scale": "max", "scale_blocks": 0}, HopContext()),  # one scale: the largest |w|
    ({"variant": "widen", "scale_blocks": 2}, HopContext(contributions=3, offset=1024)),
]


@pytest.mark.parametrize("config,ctx", RECIPES, ids=lambda v: str(v)[:40])
def test_encoding_matches_the_documented_recipe(config: dict, ctx: HopContext) -> None:
    codec = ThcCodec(block_size=1024, **config)
    d, k, n = 1024, ctx.contributions, 2048
    x = gaussian(n, seed=1) * torch.exp2(torch.arange(n) // d * 3.0)  # two scales
    payload = codec.encode(x, ctx).numpy().tobytes()
    w = ref_rotate(x.numpy(), d, ctx.offset)
    # segments are global: scale_blocks = 2 at offset 1024 puts the blocks in segments 0, 1
    span = d * (codec.scale_blocks or 10**9)
    seg = (ctx.offset + np.arange(n)) // span
    segments = sorted(set(seg.tolist()))
    t = 1.0 if codec.scale == "max" else DEFAULT_NORM_CLIP
    rho = k if codec.variant == "widen" else float(np.float32(k**0.5))
    r, r_div = [], np.zeros(n, dtype=np.float32)
    for s in segments:
        stat = ref_statistic(w[seg == s], codec.scale)  # standalone: the payload's own
        r.append(ref_range(stat if k == 1 else roundup_f32(stat / rho), t))
        rd = r[-1] if codec.variant == "widen" or k == 1 else roundup_f32(r[-1] * rho)
        r_div[seg == s] = rd
    c = k if codec.variant == "widen" else 1
    y = ref_positions(w, r_div, c)
    u = ref_dither(n, ctx)
    codes = ref_grid_sr(y, u) if c > 1 else ref_table_sr(y, u)
    width = (k * G).bit_length() if c > 1 else 4
    head = 4 * len(segments)
    assert payload[:head] == np.array(r, dtype=np.float32).tobytes()
    assert payload[head] == 0  # no NaN/Inf block
    assert len(payload) == head + 1 + n * width // 8 == codec.encoded_nbytes(n, ctx)
    assert ref_unpack(payload[head + 1 :], width, n) == codes.tolist()

    # decoding is D ⊙ H · ((2Y - c·g)·R_div/g) / d, within the fp32 slack of the decode
    levels = codes.astype(np.float64) if c > 1 else np.array(DEFAULT_TABLE, np.float64)[codes]
    wh = (2 * levels - c * G) * r_div.astype(np.float64) / G
    s = ref_signs(n, ctx.offset)
    h = sylvester(d)
    want = np.concatenate([s[b : b + d] * (h @ wh[b : b + d]) / d for b in (0, d)])
    got = codec.decode(as_payload(payload), n, ctx).numpy()
    gamma = 10 * U / (1 - 10 * U)
    slack = (2 * U + gamma) * c * r_div.astype(np.float64) * (1 + 2**-20) + np.abs(want) * U
    assert np.all(np.abs(got - want) <= slack)


def test_norm_scale_is_the_largest_worker_norm() -> None:
    """The agreed ``"norm"`` statistic of a segment of full blocks is ``max_rank ‖x_seg‖ ·
    √(d / n)`` (Parseval for the unnormalised H: no rotation in the reference)."""
    codec = ThcCodec(block_size=64, scale_blocks=2)
    xs = [gaussian(64 * 5, seed=s, scale=1.0 + s) for s in range(3)]
    xs[1][128:256] *= 10.0  # rank 1 is the largest in segment 1 only

    class Alone:  # a world of one: the rank's own statistics
        def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
            return [t]

    own = [codec.prologue(x, Alone())[SHARED_KEY] for x in xs]
    sent: list[torch.Tensor] = []

    class World:  # every rank's statistics, as the engine's all-gather returns them
        def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
            sent.append(t)
            return [torch.tensor(o, dtype=torch.float32) for o in own]

    agreed = codec.prologue(xs[0], World())[SHARED_KEY]
    assert len(sent) == 1 and sent[0].dtype == torch.float32 and sent[0].numel() == 3
    for s, (a, b) in enumerate([(0, 128), (128, 256), (256, 320)]):
        norms = [float(np.linalg.norm(x.numpy()[a:b].astype(np.float64))) for x in xs]
        want = max(roundup_f32(nm * math.sqrt(64 / (b - a))) for nm in norms)
        assert agreed[s] == pytest.approx(want, rel=1e-6)
        assert agreed[s] == max(o[s] for o in own)


def test_short_last_block_is_padded_to_a_power_of_two() -> None:
    codec = ThcCodec(block_size=64)  # one segment (and one R) per block
    for n in (1, 5, 64, 65, 100, 128 + 33):
        nfull, tail = divmod(n, 64)
        nblocks = nfull + (tail > 0)
        ncodes = nfull * 64 + (1 << (tail - 1).bit_length() if tail else 0)
        assert codec.encoded_nbytes(n) == 4 * nblocks + -(-nblocks // 8) + -(-ncodes * 4 // 8)
        x = gaussian(n, seed=n)
        err = (codec.decode(codec.encode(x), n).double() - x.double()).abs()
        assert bool((err <= codec.error_bound.max_abs_error(x)).all())
    assert codec.encoded_nbytes(0) == 0 and codec.encode(torch.empty(0)).numel() == 0


def test_segments_are_global_so_the_header_depends_on_the_offset() -> None:
    codec = ThcCodec(block_size=64, scale_blocks=2)  # segments [0, 128), [128, 256), ...
    assert codec.encoded_nbytes(128) == 4 + 1 + 64
    assert codec.encoded_nbytes(128, HopContext(offset=64)) == 8 + 1 + 64  # two segments
    assert codec.encoded_nbytes(129, HopContext(offset=128)) == 8 + 1 + 65  # a tail of 1
    assert ThcCodec(block_size=64, scale_blocks=0).encoded_nbytes(999, HopContext(offset=64)) == (
        4 + 2 + (15 * 64 + 64) // 2
    )
    x = gaussian(128, seed=2)
    ctx = HopContext(offset=64)
    assert codec.encode(x, ctx).numel() == 73
    y = codec.decode(codec.encode(x, ctx), 128, ctx)
    assert bool(((y - x).abs().double() <= codec.error_bound.max_abs_error(x, ctx)).all())


def test_widen_width_grows_with_contributions() -> None:
    widen, requant = ThcCodec(variant="widen", block_size=1024), ThcCodec(block_size=1024)
    n = 3 * 1024
    for k in (1, 2, 3, 8, 100):
        ctx = HopContext(contributions=k)
        width = 4 if k == 1 else math.ceil(math.log2(k * 30 + 1))
        assert widen.width(k) == width
        assert widen.encoded_nbytes(n, ctx) == 12 + 1 + n * width // 8
        assert requant.encoded_nbytes(n, ctx) == 12 + 1 + n * 4 // 8
    assert [widen.width(k) for k in (1, 2, 3, 4, 5, 8, 9)] == [4, 6, 7, 7, 8, 8, 9]


def test_requantize_range_grows_like_k_to_the_growth() -> None:
    """Standalone, a requantize sum of ``k`` is scaled so that its own statistic fits: the
    header holds ``R = T·S/ρ_k`` and the codes span ``R_k = roundup(R·ρ_k)``."""
    x = gaussian(1024, seed=3)
    for growth, k in [(0.5, 4), (0.5, 9), (1.0, 3), (0.0, 5)]:
        codec = ThcCodec(block_size=1024, scale="max", growth=growth)
        assert codec.rho(k) == float(np.float32(k**growth))
        payload = codec.encode(x, HopContext(contributions=k))
        r = float(payload[:4].clone().view(torch.float32)[0])
        amax = float(np.abs(ref_rotate(x.numpy(), 1024)).max())
        assert r == roundup_f32(amax / codec.rho(k)) if codec.rho(k) != 1 else r == amax
        assert roundup_f32(r * codec.rho(k)) >= amax  # never clamps its own value
    assert ThcCodec(variant="widen").rho(7) == 7.0 and ThcCodec().effective_growth == 0.5


def test_zero_is_exact_and_nonfinite_blocks_are_flagged() -> None:
    codec = ThcCodec(block_size=32, scale_blocks=0)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(100)), 100), torch.zeros(100))
    x = gaussian(100, seed=3)
    x[40] = math.inf
    payload = codec.encode(x)
    assert payload[4] == 0b10  # block 1 flagged
    y = codec.decode(payload, 100)
    assert bool(torch.isnan(y[32:64]).all()) and bool(torch.isfinite(y[:32]).all())
    seg = ThcCodec(block_size=32)  # a flagged block's segment gets range 0, the others theirs
    p = seg.encode(x)
    r = p[:16].clone().view(torch.float32)
    assert float(r[1]) == 0.0 and bool((r[[0, 2, 3]] > 0).all()) and p[16] == 0b10


# -- homomorphic aggregation --------------------------------------------------------------------


def _agreed(xs: list[np.ndarray], d: int, scale: str = "norm", span: int | None = None) -> list:
    """What the prologue agrees on: per segment of ``span`` values, the largest statistic."""
    span = span or d
    ws = [ref_rotate(x, d) for x in xs]
    return [
        max(ref_statistic(w[a : a + span], scale) for w in ws) for a in range(0, xs[0].size, span)
    ]


@pytest.mark.parametrize("variant", ["widen", "requantize"])
def test_reduce_adds_integers(variant: str) -> None:
    """reduce = the payload's integers + local's unclamped positions, clamped once and
    rounded once with out_ctx's dither (an independent recomputation of every code), and it
    decodes within the bound."""
    codec = ThcCodec(variant=variant, block_size=1024)
    d, n = 1024, 2048
    x1, x2 = gaussian(n, seed=4), gaussian(n, seed=5) * 0.7
    x2[:8] *= 30.0  # some of local's coordinates exceed the range on their own
    scales = _agreed([x1.numpy(), x2.numpy()], d)
    shared = {SHARED_KEY: tuple(scales)}
    c1 = HopContext(seed=3, hop=0, num_hops=2, rank=0, contributions=1, shared=shared)
    c2 = HopContext(seed=3, hop=1, num_hops=2, rank=1, contributions=2, shared=shared)
    p1 = codec.encode(x1, c1)
    head = 8
    y1 = np.array(DEFAULT_TABLE, dtype=np.float32)[ref_unpack(p1.numpy().tobytes()[9:], 4, n)]
    p2 = codec.reduce(p1, x2, c1, c2)
    r = np.repeat([ref_range(s, DEFAULT_NORM_CLIP) for s in scales], d).astype(np.float32)
    assert p2.numpy().tobytes()[:head] == np.array(r[::d], dtype=np.float32).tobytes()
    w2 = ref_rotate(x2.numpy(), d)
    u = ref_dither(n, c2)
    if variant == "widen":
        y = np.clip((y1 + ref_positions(w2, r, 1, clamp=False)).astype(np.float32), 0, 2 * G)
        want = ref_grid_sr(y, u)
        assert ref_unpack(p2.numpy().tobytes()[head + 1 :], 6, n) == want.tolist()
    else:
        rho2 = np.float32(2**0.5)
        r2 = np.array([roundup_f32(float(v) * float(rho2)) for v in r], dtype=np.float32)
        a = (r / r2).astype(np.float32)
        part = ((y1 - np.float32(15)) * a).astype(np.float32)
        y = np.clip((part + ref_positions(w2, r2, 1, clamp=False)).astype(np.float32), 0, G)
        want = ref_table_sr(y, u)
        assert ref_unpack(p2.numpy().tobytes()[head + 1 :], 4, n) == want.tolist()
    total = codec.decode(p1, n, c1) + x2
    err = (codec.decode(p2, n, c2).double() - total.double()).abs()
    assert bool((err <= codec.error_bound.max_abs_error(total, c2)).all())


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    variant=st.sampled_from(["widen", "requantize"]),
    scale=st.sampled_from(["norm", "max"]),
    k_in=st.integers(1, 6),
    m=st.integers(1, 6),
)
def test_homomorphic_reduce_stays_within_the_bound(
    data: st.DataObject, variant: str, scale: str, k_in: int, m: int
) -> None:
    """Under agreed scales (any inputs, any scales: even ones far too small, which clamp),
    the integer path decodes within the bound of decode(payload) + local."""
    codec = ThcCodec(variant=variant, scale=scale, block_size=16, scale_blocks=2)
    half = codec.max_input_abs / 64
    partial = data.draw(finite_tensors(16, max_abs=half, dtypes=("float32",)))
    local = data.draw(finite_tensors(16, max_abs=half, dtypes=("float32",)))
    n = min(partial.numel(), local.numel())
    partial, local = partial[:n].contiguous(), local[:n].contiguous()
    nseg = -(-n // 32)
    base = data.draw(st.sampled_from(["prologue", "tiny", "zero"]))
    if base == "prologue":

        class Alone:
            def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
                return [t]

        other = torch.tensor(codec.prologue(local, Alone())[SHARED_KEY], dtype=torch.float32)

        class Two:  # this rank holds partial, the other local
            def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
                return [t, other]

        shared = codec.prologue(partial, Two())
    else:
        s = 1e-3 * float(local.abs().max()) if base == "tiny" and n else 0.0
        shared = {SHARED_KEY: tuple([s] * nseg)}
    ctx = HopContext(seed=1, hop=0, num_hops=2, rank=0, contributions=k_in, shared=shared)
    out = HopContext(seed=1, hop=1, num_hops=2, rank=1, contributions=k_in + m, shared=shared)
    payload = codec.encode(partial, ctx)
    result = codec.reduce(payload, local, ctx, out)
    total = codec.decode(payload, n, ctx) + local
    got = codec.decode(result, n, out).double()
    bound = codec.error_bound.max_abs_error(total, out)
    assert bool(((got - total.double()).abs() <= bound).all())


def test_reduce_falls_back_where_the_payload_has_another_range() -> None:
    """A payload encoded with its own (local) range cannot take the integer path: those
    blocks are re-encoded from decode(payload) + local, and the result is bounded."""
    codec = ThcCodec(variant="widen", block_size=64)
    x1, x2 = gaussian(128, seed=6), gaussian(128, seed=7)
    shared = {SHARED_KEY: tuple(_agreed([x1.numpy(), x2.numpy()], 64))}
    c1 = HopContext(contributions=1, shared=shared)
    c2 = HopContext(hop=1, num_hops=2, rank=1, contributions=2, shared=shared)
    p1 = codec.encode(x1, HopContext())  # the payload's own range, not the agreed one
    p2 = codec.reduce(p1, x2, c1, c2)
    again = codec.encode(codec.decode(p1, 128, c1) + x2, c2)
    assert torch.equal(p2, again)
    total = codec.decode(p1, 128, c1) + x2
    err = (codec.decode(p2, 128, c2).double() - total.double()).abs()
    assert bool((err <= codec.error_bound.max_abs_error(total, c2)).all())


def test_prologue_without_data_and_too_few_scales() -> None:
    codec = ThcCodec(block_size=64)

    class Fail:
        def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
            raise AssertionError("an empty buffer needs no exchange")

    assert codec.prologue(torch.empty(0), Fail()) == {SHARED_KEY: ()}
    ctx = HopContext(offset=128, shared={SHARED_KEY: (1.0, 2.0)})
    with pytest.raises(ValueError, match="holds 2 segment scales"):
        codec.encode(gaussian(64), ctx)
    with pytest.raises(ValueError, match="finite and >= 0"):
        codec.encode(gaussian(64), HopContext(shared={SHARED_KEY: -1.0}))
    with pytest.raises(TypeError, match="number or a sequence"):
        codec.encode(gaussian(64), HopContext(shared={SHARED_KEY: object()}))


def test_chunking_does_not_change_the_result_under_agreed_scales() -> None:
    codec = ThcCodec(block_size=64, scale_blocks=2)
    x = gaussian(64 * 6, seed=8)
    shared = {SHARED_KEY: (50.0, 60.0, 70.0)}
    whole = codec.decode(codec.encode(x, HopContext(shared=shared)), x.numel())
    for a, b in [(0, 128), (128, 320), (320, 384), (64, 192)]:
        ctx = HopContext(offset=a, shared=shared)
        part = codec.decode(codec.encode(x[a:b].contiguous(), ctx), b - a, ctx)
        assert torch.equal(part, whole[a:b])


# -- bounds -------------------------------------------------------------------------------------

CONFIGS = [
    {},
    {"variant": "widen"},
    {"scale": "max", "scale_blocks": 0, "block_size": 256},  # the first version's recipe
    {"scale": "max", "clip": 0.5, "block_size": 64},
    {"table": (0, 2, 5, 7, 9, 12, 14), "block_size": 16, "clip": 1.5},  # 3-bit indices, g = 14
    {"rotation_seed": 12345, "block_size": 256, "scale_blocks": 3, "growth": 1.0},
]


@pytest.mark.parametrize(
    "config",
    # the default: test_conformance.py; the first version's recipe is slow (~15-25 s)
    [pytest.param(CONFIGS[2], marks=pytest.mark.slow), *CONFIGS[3:5]],
    ids=str,
)
@pytest.mark.usefixtures("quarter_examples")  # variants: the default runs the full count
def test_extra_configs_conform(config: dict) -> None:
    run_conformance({"id": "thc", **config})


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_witness_reaches_most_of_the_bound(config: dict) -> None:
    codec = get_codec({"id": "thc", **config})
    for numel in (1024, 4 * codec.block_size, 3 * codec.block_size + 5):
        assert check_bound_tight(codec, numel) >= 0.65


def test_bound_is_mostly_the_rounding_term() -> None:
    """The fp32 slack terms are small next to the rounding term on ordinary data (max scale:
    no clamping)."""
    codec = ThcCodec(scale="max", block_size=1024)
    x = gaussian(4096, seed=9)
    bound = codec.error_bound.max_abs_error(x)
    rounding, det, _, _ = codec._bound_terms(x, HopContext())
    assert float(det.max()) < 1e-3 * float(rounding.min())
    assert float(bound.max()) < 1.01 * float(rounding.max()) + 1e-3 * float(x.abs().max())


def test_clamping_is_in_the_bound() -> None:
    codec = ThcCodec(scale="max", clip=0.25, block_size=64)
    x = gaussian(256, seed=10)
    x[::64] = 40.0  # one spike per block: its rotation clamps at a quarter of the absmax
    err = (codec.decode(codec.encode(x), 256).double() - x.double()).abs()
    bound = codec.error_bound.max_abs_error(x)
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.5
    assert not codec.error_bound.unbiased and not get_codec("thc").error_bound.unbiased
    assert ThcCodec(scale="max").error_bound.unbiased


def test_norm_scale_clamps_the_tail_and_says_so() -> None:
    """THC's clamp at T standard deviations: a heavy-tailed block loses its peaks (biased),
    the bound's clamping term covers them exactly."""
    codec = ThcCodec(block_size=256)
    target = gaussian(256, seed=12).double().numpy()
    target[7] = 200.0  # a rotated coordinate far out (a rotated spike stays one)
    x = torch.from_numpy(ref_signs(256) * (sylvester(256) @ target) / 256).float()
    w = ref_rotate(x.numpy(), 256)
    r = ref_range(ref_statistic(w, "norm"), DEFAULT_NORM_CLIP)
    assert np.abs(w).max() > r  # clamped
    _, det, _, _ = codec._bound_terms(x, HopContext())
    assert float(det[0]) >= float(np.mean(np.maximum(np.abs(w) - r, 0)))
    err = (codec.decode(codec.encode(x), 256).double() - x.double()).abs()
    assert bool((err <= codec.error_bound.max_abs_error(x)).all())


def test_variance_bound_holds_empirically() -> None:
    """The variance bound is the exact mean squared error of independent dithers (plus tiny
    deterministic terms): the sample mean over 200 seeds lands within sampling noise of it.
    Per seed, the total squared error of the 4 blocks sums 256 independent rounding errors
    (Parseval), relative std <= sqrt(2/256) ~ 0.09; over 200 seeds 0.0063, so 5σ is ~3%."""
    codec = ThcCodec(scale="max", block_size=64)
    x = gaussian(256, seed=11)
    sq = torch.zeros(256, dtype=torch.float64)
    trials = 200
    for t in range(trials):
        ctx = HopContext(seed=t)
        sq += (codec.decode(codec.encode(x, ctx), 256, ctx).double() - x.double()).square()
    mse, var = float(sq.sum()) / trials, float(codec.error_bound.variance(x).sum())
    assert 0.95 * var <= mse <= 1.05 * var  # check_unbiased runs on scale="max" configs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"variant": "grow"}, "variant must be one of"),
        ({"table": (0, 4, 10)}, "must contain g/2"),
        ({"table": (0, 3, 2, 4)}, "strictly increasing"),
        ({"table": (0, 1, 3)}, "even g"),
        ({"table": (1, 2, 4)}, "from 0"),
        ({"block_size": 48}, "power of two"),
        ({"scale": "rms"}, "scale must be one of"),
        ({"scale_blocks": -1}, "scale_blocks must be"),
        ({"clip": 0.0}, "clip must be in"),
        ({"clip": 1.5, "scale": "max"}, "clip must be in"),
        ({"clip": 1e6}, "clip must be in"),
        ({"growth": 1.5}, "growth must be in"),
        ({"growth": 0.5, "variant": "widen"}, "growth applies to variant='requantize'"),
        ({"rotation_seed": -1}, "rotation_seed must be"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ThcCodec(**kwargs)


def test_bad_config_types() -> None:
    with pytest.raises(TypeError, match="clip must be a float"):
        ThcCodec(clip="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="growth must be a float"):
        ThcCodec(growth=True)  # type: ignore[arg-type]


def test_config_round_trips_through_json() -> None:
    codec = get_codec({"id": "thc", "table": [0, 2, 4, 6, 8]})
    assert codec.table == (0, 2, 4, 6, 8) and codec.bits == 3 and codec.g == 8
    assert get_codec(codec.get_config()) == codec and hash(codec) == hash(
        ThcCodec(table=(0, 2, 4, 6, 8))
    )
    assert codec.get_config()["clip"] is None and codec.effective_clip == DEFAULT_NORM_CLIP
    explicit = get_codec({"id": "thc", "clip": 2, "growth": 1})
    assert explicit.clip == 2.0 and explicit.growth == 1.0 and explicit != codec


def test_out_of_range_input_and_contributions_are_clear_errors() -> None:
    codec = ThcCodec()
    assert codec.max_input_abs == 2.0 ** (127 - 14 - 2)  # T = 2.25 takes two more bits
    assert ThcCodec(scale="max", block_size=1024).max_input_abs == 2.0**117
    with pytest.raises(ValueError, match="exceeds max_input_abs"):
        codec.encode(torch.tensor([2.0**112, 1.0]))
    with pytest.raises(ValueError, match="contributions × g"):
        codec.encode(torch.ones(4), HopContext(contributions=300_000))
    with pytest.raises(ValueError, match="corrupt payload"):
        bad = codec.encode(torch.ones(4)).clone()
        bad[:4] = torch.tensor([-1.0]).view(torch.uint8)
        codec.decode(bad, 4)


# -- all-reduce ---------------------------------------------------------------------------------


def _count_encodes(monkeypatch: pytest.MonkeyPatch) -> itertools.count:
    counter = itertools.count()
    original = ThcCodec._encode

    def counting(self: ThcCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        next(counter)
        return original(self, x, ctx)

    monkeypatch.setattr(thc_module.ThcCodec, "_encode", counting)
    return counter


@pytest.mark.parametrize(
    "config",
    [{"variant": "requantize"}, {"variant": "widen"}, {"scale": "max", "scale_blocks": 3}],
    ids=str,
)
@pytest.mark.parametrize("schedule", ["ring", "butterfly", "tree"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_allreduce_in_the_simulator(
    config: dict, schedule: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = ThcCodec(block_size=64, **config)
    rng = np.random.default_rng(n)
    base = rng.standard_normal(64 * 9 + 17)
    xs = [
        torch.from_numpy((base + rng.standard_normal(base.size)).astype(np.float32))
        for _ in range(n)
    ]
    counter = _count_encodes(monkeypatch)
    res = simulate_allreduce(xs, codec, schedule, seed=n, sub_chunk=128)
    # every rank bit-identical, the certified bound holds
    for out in res.outputs[1:]:
        assert torch.equal(out.view(torch.int32), res.outputs[0].view(torch.int32))
    assert res.bound is not None
    assert bool(((res.outputs[0].double() - res.exact).abs() <= res.bound).all())
    # homomorphic: every reduce added integers (no re-encoding of a decoded sum), so the only
    # encodes are the plan's fresh ones
    sched = get_schedule(schedule, n)
    plan = plan_schedule(sched, codec, seed=n)
    _, pieces = chunk_layout(base.size, sched, codec, 128)
    fresh = [
        [
            (op, a, b)
            for rnd in plan[r]
            for op in rnd.sends
            if op.encode
            for a, b in pieces[op.chunk]
        ]
        for r in range(n)
    ]
    assert next(counter) == sum(len(f) for f in fresh)
    # bytes: the payloads (their sizes from encoded_nbytes at the chunk's offset and the hop's
    # contributions) plus the prologue's all-gather of one fp32 per segment to every other rank
    nseg = -(-base.size // (64 * codec.scale_blocks))
    sent = [
        4 * nseg * (n - 1)
        + sum(
            op.codec.encoded_nbytes(b - a, HopContext(offset=a, contributions=op.ctx.contributions))
            for rnd in plan[r]
            for op in rnd.sends
            for a, b in pieces[op.chunk]
        )
        for r in range(n)
    ]
    assert res.bytes_sent == sent


def test_real_gradients_ring_of_8() -> None:
    """The committed slice of real gradients ([8, 32768]): the numbers docs/benchmarks.md
    quotes (loose regression limits)."""
    xs = [row.contiguous() for row in load_slice()]
    widen = simulate_allreduce(xs, {"id": "thc", "variant": "widen"}, "ring")
    requant = simulate_allreduce(xs, "thc", "ring")
    assert widen.vnmse < 0.02 and 7.0 < widen.bits_per_value() < 8.0
    assert requant.vnmse < 0.3 and 4.0 < requant.bits_per_value() < 4.05
    for res in (widen, requant):
        assert bool(((res.outputs[0].double() - res.exact).abs() <= res.bound).all())


@pytest.mark.slow
def test_default_table_is_the_fitted_one() -> None:
    """benchmarks/fit_thc_table.py reproduces DEFAULT_TABLE (needs the fit split: minutes)."""
    path = Path(__file__).parents[2] / "benchmarks" / "fit_thc_table.py"
    spec = importlib.util.spec_from_file_location("fit_thc_table", path)
    assert spec is not None and spec.loader is not None
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    from dynamiq.data import load_gradients

    rows = load_gradients("fit", workers=32, progress=False)
    codec = ThcCodec(table=(0, 15, 30))  # the positions do not depend on the table
    assert fit.fitted_table(rows, codec, 8, 16) == DEFAULT_TABLE
