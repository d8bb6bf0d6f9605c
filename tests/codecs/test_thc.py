"""THC: the wire format against an independent NumPy computation of the documented recipe,
homomorphic integer aggregation, certified bounds, and all-reduces in the simulator."""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hash_reference import ref_hash, ref_keys

import dynamiq.codecs.thc as thc_module
from dynamiq.codecs import HopContext, ThcCodec, get_codec
from dynamiq.codecs.thc import DEFAULT_TABLE, SHARED_KEY, fwht
from dynamiq.collectives import get_schedule, plan_schedule, simulate_allreduce
from dynamiq.collectives.engine import chunk_layout
from dynamiq.data import load_slice
from dynamiq.testing import check_bound_tight, run_conformance

U = 2.0**-24

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


def ref_positions(w: np.ndarray, k: int, r: float, g: int = 30) -> np.ndarray:
    t = (w / np.float32(r)).astype(np.float32)
    y = (t * np.float32(g // 2)).astype(np.float32) + np.float32(k * g // 2)
    return np.clip(y, 0, k * g).astype(np.float32)


def ref_table_sr(y: np.ndarray, u: np.ndarray, table=DEFAULT_TABLE) -> np.ndarray:
    tab = np.array(table, dtype=np.float32)
    i = np.clip(np.searchsorted(tab, y, side="right") - 1, 0, len(tab) - 2)
    lo, hi = tab[i], tab[i + 1]
    f = ((y - lo) / (hi - lo)).astype(np.float32)
    return i + (u < f)


def gaussian(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))


# -- the transform ------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 1024])
def test_fwht_is_the_sylvester_hadamard_matrix(d: int) -> None:
    x = np.random.default_rng(d).integers(-1000, 1000, (3, d)).astype(np.float64)
    got = fwht(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, x @ sylvester(d))  # integers: exact in any order
    np.testing.assert_array_equal(fwht(torch.from_numpy(got)).numpy() / d, x)  # H·H = d·I


# -- the wire format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ctx", [HopContext(), HopContext(seed=5, step=7, hop=2, num_hops=4, rank=3)]
)
def test_encoding_matches_the_documented_recipe(ctx: HopContext) -> None:
    codec = get_codec("thc")
    d = codec.block_size
    x = gaussian(2 * d, seed=1) * torch.exp2(torch.arange(2 * d) // d * 3.0)  # two scales
    payload = codec.encode(x, ctx).numpy().tobytes()
    xs = x.numpy()
    w = ref_rotate(xs, d, ctx.offset)
    r = float(np.abs(w).max())  # standalone: the payload's own largest |w|, T = 1
    codes = ref_table_sr(ref_positions(w, 1, r), ref_dither(2 * d, ctx))
    assert payload[:4] == np.float32(r).tobytes()
    assert payload[4] == 0  # no NaN/Inf block
    assert len(payload) == 4 + 1 + 2 * d * 4 // 8 == codec.encoded_nbytes(2 * d)
    assert ref_unpack(payload[5:], 4, 2 * d) == codes.tolist()

    # decoding is D ⊙ H · ((2Y - g)·R/g) / d, within the fp32 slack of the decode
    levels = np.array(DEFAULT_TABLE, dtype=np.float64)[codes]
    wh = (2 * levels - 30) * r / 30
    s = ref_signs(2 * d, ctx.offset)
    h = sylvester(d)
    want = np.concatenate([s[b : b + d] * (h @ wh[b : b + d]) / d for b in (0, d)])
    got = codec.decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 2 * d, ctx)
    gamma = 10 * U / (1 - 10 * U)
    slack = (2 * U + gamma) * r * (1 + 2**-20) + np.abs(want) * U
    assert np.all(np.abs(got.numpy() - want) <= slack)


def test_short_last_block_is_padded_to_a_power_of_two() -> None:
    codec = ThcCodec(block_size=64)
    for n in (1, 5, 64, 65, 100, 128 + 33):
        nfull, tail = divmod(n, 64)
        ncodes = nfull * 64 + (1 << (tail - 1).bit_length() if tail else 0)
        assert codec.encoded_nbytes(n) == 4 + -(-(nfull + (tail > 0)) // 8) + -(-ncodes * 4 // 8)
        x = gaussian(n, seed=n)
        err = (codec.decode(codec.encode(x), n).double() - x.double()).abs()
        assert bool((err <= codec.error_bound.max_abs_error(x)).all())
    assert codec.encoded_nbytes(0) == 0 and codec.encode(torch.empty(0)).numel() == 0


def test_widen_width_grows_with_contributions() -> None:
    widen, requant = ThcCodec(variant="widen"), ThcCodec()
    n = 3 * 1024
    for k in (1, 2, 3, 8, 100):
        ctx = HopContext(contributions=k)
        width = 4 if k == 1 else math.ceil(math.log2(k * 30 + 1))
        assert widen.width(k) == width
        assert widen.encoded_nbytes(n, ctx) == 4 + 1 + n * width // 8
        assert requant.encoded_nbytes(n, ctx) == 4 + 1 + n * 4 // 8
    assert [widen.width(k) for k in (1, 2, 3, 4, 5, 8, 9)] == [4, 6, 7, 7, 8, 8, 9]


def test_zero_is_exact_and_nonfinite_blocks_are_flagged() -> None:
    codec = ThcCodec(block_size=32)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(100)), 100), torch.zeros(100))
    x = gaussian(100, seed=3)
    x[40] = math.inf
    payload = codec.encode(x)
    assert payload[4] == 0b10  # block 1 flagged
    y = codec.decode(payload, 100)
    assert bool(torch.isnan(y[32:64]).all()) and bool(torch.isfinite(y[:32]).all())


# -- homomorphic aggregation --------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["widen", "requantize"])
def test_reduce_adds_integers(variant: str) -> None:
    """reduce = the payload's integers + local's positions, rounded once with out_ctx's
    dither (an independent recomputation of every code), and it decodes within the bound."""
    codec = ThcCodec(variant=variant)
    d = 1024
    x1, x2 = gaussian(2 * d, seed=4), gaussian(2 * d, seed=5) * 0.7
    w1, w2 = ref_rotate(x1.numpy(), d), ref_rotate(x2.numpy(), d)
    scale = float(max(np.abs(w1).max(), np.abs(w2).max()))  # what the prologue agrees on
    shared = {SHARED_KEY: scale}
    c1 = HopContext(seed=3, hop=0, num_hops=2, rank=0, contributions=1, shared=shared)
    c2 = HopContext(seed=3, hop=1, num_hops=2, rank=1, contributions=2, shared=shared)
    p1 = codec.encode(x1, c1)
    y1 = np.array(DEFAULT_TABLE, dtype=np.float32)[ref_unpack(p1.numpy().tobytes()[5:], 4, 2 * d)]
    p2 = codec.reduce(p1, x2, c1, c2)
    y = (y1 + ref_positions(w2, 1, scale)).astype(np.float32)  # integers + local, in fp32
    u = ref_dither(2 * d, c2)
    if variant == "widen":
        lo = np.floor(y)
        want = (lo + (u < y - lo)).astype(np.int64)
        assert ref_unpack(p2.numpy().tobytes()[5:], 6, 2 * d) == want.tolist()  # ceil(log2 61)
    else:
        want = ref_table_sr((y / np.float32(2)).astype(np.float32), u)
        assert ref_unpack(p2.numpy().tobytes()[5:], 4, 2 * d) == want.tolist()
    total = codec.decode(p1, 2 * d, c1) + x2
    err = (codec.decode(p2, 2 * d, c2).double() - total.double()).abs()
    assert bool((err <= codec.error_bound.max_abs_error(total, c2)).all())


def test_reduce_falls_back_where_local_would_be_clamped() -> None:
    """With an agreed scale too small for a block of local, that block is re-encoded from
    decode(payload) + local (clamped, and the bound says so); other blocks stay integer sums."""
    codec = ThcCodec(variant="widen", block_size=64)
    x1 = gaussian(128, seed=6)
    x2 = gaussian(128, seed=7)
    x2[64:] *= 100.0  # block 1 of local is far beyond the scale
    scale = float(np.abs(ref_rotate(x1.numpy(), 64)).max())
    shared = {SHARED_KEY: scale}
    c1 = HopContext(contributions=1, shared=shared)
    c2 = HopContext(hop=1, num_hops=2, rank=1, contributions=2, shared=shared)
    p1 = codec.encode(x1, c1)
    p2 = codec.reduce(p1, x2, c1, c2)
    total = codec.decode(p1, 128, c1) + x2
    err = (codec.decode(p2, 128, c2).double() - total.double()).abs()
    bound = codec.error_bound.max_abs_error(total, c2)
    assert bool((err <= bound).all())
    assert float(err[64:].max()) > 10 * float(bound[:64].max())  # clamped, and bounded
    assert torch.equal(p2, codec.reduce(p1, x2, c1, c2))


def test_prologue_agrees_on_the_largest_rotated_magnitude() -> None:
    codec = ThcCodec(block_size=64)
    xs = [gaussian(200, seed=s, scale=s + 1.0) for s in range(3)]

    class Alone:  # a world of one: the rank's own value
        def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
            return [t]

    own = [codec.prologue(x, Alone())[SHARED_KEY] for x in xs]

    class World:  # every rank's value, as the engine's all-gather returns them
        def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
            return [torch.tensor([v], dtype=torch.float32) for v in own]

    padded = [np.concatenate([x.numpy(), np.zeros(56, np.float32)]) for x in xs]
    assert own == [float(np.abs(ref_rotate(p, 64)).max()) for p in padded]
    assert codec.prologue(xs[0], World()) == {SHARED_KEY: max(own)}


def test_chunking_does_not_change_the_result_under_an_agreed_scale() -> None:
    codec = ThcCodec(block_size=64)
    x = gaussian(64 * 6, seed=8)
    shared = {SHARED_KEY: 50.0}
    whole = codec.decode(codec.encode(x, HopContext(shared=shared)), x.numel())
    for a, b in [(0, 128), (128, 320), (320, 384)]:
        ctx = HopContext(offset=a, shared=shared)
        part = codec.decode(codec.encode(x[a:b].contiguous(), ctx), b - a, ctx)
        assert torch.equal(part, whole[a:b])


# -- bounds -------------------------------------------------------------------------------------

CONFIGS = [
    {},
    {"variant": "widen"},
    {"clip": 0.5, "block_size": 64},
    {"table": (0, 2, 5, 7, 9, 12, 14), "block_size": 16},  # 3-bit indices, g = 14
    {"rotation_seed": 12345, "block_size": 256},
]


@pytest.mark.parametrize("config", CONFIGS[1:4], ids=str)  # the default: test_conformance.py
def test_extra_configs_conform(config: dict) -> None:
    run_conformance({"id": "thc", **config})


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_witness_reaches_most_of_the_bound(config: dict) -> None:
    codec = get_codec({"id": "thc", **config})
    assert check_bound_tight(codec, 4 * codec.block_size) >= 0.65


def test_bound_is_mostly_the_rounding_term() -> None:
    """The fp32 slack terms are small next to the rounding term on ordinary data."""
    codec = get_codec("thc")
    x = gaussian(4096, seed=9)
    bound = codec.error_bound.max_abs_error(x)
    rounding, det, _, _ = codec._bound_terms(x, HopContext())
    assert float(det.max()) < 1e-3 * float(rounding.min())
    assert float(bound.max()) < 1.01 * float(rounding.max()) + 1e-3 * float(x.abs().max())


def test_clamping_is_in_the_bound() -> None:
    codec = ThcCodec(clip=0.25, block_size=64)
    x = gaussian(256, seed=10)
    x[::64] = 40.0  # one spike per block: its rotation clamps at a quarter of the absmax
    err = (codec.decode(codec.encode(x), 256).double() - x.double()).abs()
    bound = codec.error_bound.max_abs_error(x)
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.5
    assert not codec.error_bound.unbiased and get_codec("thc").error_bound.unbiased


def test_variance_bound_holds_empirically() -> None:
    """The variance bound is the exact mean squared error of independent dithers (plus tiny
    deterministic terms): the sample mean over 200 seeds lands within sampling noise of it.
    Per seed, the total squared error of the 4 blocks sums 256 independent rounding errors
    (Parseval), relative std <= sqrt(2/256) ~ 0.09; over 200 seeds 0.0063, so 5σ is ~3%."""
    codec = ThcCodec(block_size=64)
    x = gaussian(256, seed=11)
    sq = torch.zeros(256, dtype=torch.float64)
    trials = 200
    for t in range(trials):
        ctx = HopContext(seed=t)
        sq += (codec.decode(codec.encode(x, ctx), 256, ctx).double() - x.double()).square()
    mse, var = float(sq.sum()) / trials, float(codec.error_bound.variance(x).sum())
    assert 0.95 * var <= mse <= 1.05 * var  # check_unbiased runs on "thc" in test_conformance


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"variant": "grow"}, "variant must be one of"),
        ({"table": (0, 4, 10)}, "must contain g/2"),
        ({"table": (0, 3, 2, 4)}, "strictly increasing"),
        ({"table": (0, 1, 3)}, "even g"),
        ({"table": (1, 2, 4)}, "from 0"),
        ({"block_size": 48}, "power of two"),
        ({"clip": 0.0}, "clip must be in"),
        ({"clip": 1.5}, "clip must be in"),
        ({"rotation_seed": -1}, "rotation_seed must be"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ThcCodec(**kwargs)


def test_table_round_trips_through_json_as_a_tuple() -> None:
    codec = get_codec({"id": "thc", "table": [0, 2, 4, 6, 8]})
    assert codec.table == (0, 2, 4, 6, 8) and codec.bits == 3 and codec.g == 8
    assert get_codec(codec.get_config()) == codec and hash(codec) == hash(
        ThcCodec(table=(0, 2, 4, 6, 8))
    )


def test_out_of_range_input_and_contributions_are_clear_errors() -> None:
    codec = ThcCodec()
    assert codec.max_input_abs == 2.0**117
    with pytest.raises(ValueError, match="exceeds max_input_abs"):
        codec.encode(torch.tensor([2.0**118, 1.0]))
    with pytest.raises(ValueError, match="contributions × g"):
        codec.encode(torch.ones(4), HopContext(contributions=300_000))


# -- all-reduce ---------------------------------------------------------------------------------


def _count_encodes(monkeypatch: pytest.MonkeyPatch) -> itertools.count:
    counter = itertools.count()
    original = ThcCodec._encode

    def counting(self: ThcCodec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        next(counter)
        return original(self, x, ctx)

    monkeypatch.setattr(thc_module.ThcCodec, "_encode", counting)
    return counter


@pytest.mark.parametrize("variant", ["requantize", "widen"])
@pytest.mark.parametrize("schedule", ["ring", "butterfly", "tree"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_allreduce_in_the_simulator(
    variant: str, schedule: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = ThcCodec(variant=variant, block_size=64)
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
    # bytes: the payloads (their sizes from encoded_nbytes and the hop's contributions) plus
    # the prologue's all-gather of one fp32 to every other rank
    sent = [
        4 * (n - 1)
        + sum(
            op.codec.encoded_nbytes(b - a, op.ctx)
            for rnd in plan[r]
            for op in rnd.sends
            for a, b in pieces[op.chunk]
        )
        for r in range(n)
    ]
    assert res.bytes_sent == sent


def test_real_gradients_ring_of_8() -> None:
    """The committed slice of real gradients ([8, 32768]): the numbers docs/codecs.md quotes
    (loose regression limits)."""
    xs = [row.contiguous() for row in load_slice()]
    widen = simulate_allreduce(xs, {"id": "thc", "variant": "widen"}, "ring")
    requant = simulate_allreduce(xs, "thc", "ring")
    assert widen.vnmse < 0.1 and 7.0 < widen.bits_per_value() < 8.0
    assert requant.vnmse < 1.5 and 4.0 < requant.bits_per_value() < 4.05
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
    from dynamiq.data import load_gradients, load_slice_info

    rows = load_gradients("fit", workers=32, progress=False)[:, load_slice_info()["indices"]]
    y = np.concatenate([fit.positions(rows[i : i + 8], 30, 1.0, 1024) for i in range(0, 32, 8)])
    assert fit.fit(y, 30, 16)[1] == DEFAULT_TABLE
