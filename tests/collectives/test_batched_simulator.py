"""The batched simulator against the threaded run of the engine: bit for bit, for every
registered codec and every schedule; the round-by-round planner against the first one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plan_oracle import oracle_plan

from dynamiq.codecs import HopContext, IntCodec, get_codec, list_codecs
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.collectives import get_schedule, simulate_allreduce
from dynamiq.collectives.planning import plan_schedule
from dynamiq.collectives.simulator import batch_fields, simulate_schedule

SCHEDULES = ["ring", "butterfly", "tree", "hierarchical"]
#: configurations that take the other paths: rank- and offset-dependent dither (per rank),
#: a budget that moves with the hop (batched by hop)
EXTRA = [
    {"id": "int", "bits": 4, "rounding": "stochastic"},
    {"id": "dynamiq", "hop_slope": 0.25},
    {"id": "dynamiq", "rounding": "stochastic"},
]


def _options(schedule: str, n: int, intra: str | None = "fp32") -> dict | None:
    if schedule != "hierarchical":
        return None
    g = next(g for g in (4, 3, 2, 1) if n % g == 0)
    return {"ranks_per_node": g, "intra_codec": intra}


def _inputs(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(numel) * np.exp2(rng.integers(-6, 7, numel))
    return [
        torch.from_numpy((base * rng.uniform(0.5, 1.5) + rng.standard_normal(numel)).astype("f4"))
        for _ in range(n)
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


def _assert_same(codec, schedule: str, xs: list[torch.Tensor], **kw) -> None:
    threads = simulate_allreduce(xs, codec, schedule, engine="threads", **kw)
    batched = simulate_allreduce(xs, codec, schedule, **kw)
    for a, b in zip(threads.outputs, batched.outputs, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    if kw.get("return_bound", True):
        assert threads.bound is not None and batched.bound is not None
        assert torch.equal(_bits(threads.bound), _bits(batched.bound))
        for a, b in zip(threads.stats, batched.stats, strict=True):
            assert a.bound is not None and b.bound is not None
            assert torch.equal(_bits(a.bound), _bits(b.bound))
    else:
        assert batched.bound is None
    for a, b in zip(threads.stats, batched.stats, strict=True):
        counters = ("bytes_sent", "bytes_received", "bound_bytes_sent", "control_bytes_sent")
        assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
    assert threads.vnmse == batched.vnmse


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("codec", list_codecs() + EXTRA, ids=str)
def test_bit_identical_to_the_threaded_engine(codec, schedule: str) -> None:
    for n, numel, sub in ((2, 300, 1 << 18), (3, 300, 96), (4, 257, 64), (8, 300, 96)):
        xs = _inputs(n, numel, seed=n)
        opts = _options(schedule, n)
        _assert_same(codec, schedule, xs, seed=n, step=2, sub_chunk=sub, schedule_options=opts)


@pytest.mark.parametrize(
    ("codec", "schedule", "n"),
    [
        ("int8", "ring", 16),
        ("mxfp8_e4m3", "butterfly", 16),
        ("dynamiq", "hierarchical", 16),
        pytest.param("dynamiq", "ring", 16, marks=pytest.mark.slow),  # ~14 s
        pytest.param("dynamiq", "butterfly", 32, marks=pytest.mark.slow),
        pytest.param("mxfp4", "ring", 32, marks=pytest.mark.slow),  # ~16 s
        ("int8", "hierarchical", 32),
    ],
)
def test_bit_identical_at_16_and_32_ranks(codec: str, schedule: str, n: int) -> None:
    xs = _inputs(n, 4100, seed=n)
    opts = {"ranks_per_node": 8} if schedule == "hierarchical" else None
    _assert_same(codec, schedule, xs, sub_chunk=1024, schedule_options=opts)


@pytest.mark.parametrize("codec", ["int8", "dynamiq", "thc"])
def test_without_bounds_same_values_and_no_bound_bytes(codec: str) -> None:
    xs = _inputs(6, 700, seed=1)
    _assert_same(codec, "butterfly", xs, return_bound=False)
    res = simulate_allreduce(xs, codec, "butterfly", return_bound=False)
    assert all(s.bound_bytes_sent == 0 and s.bound is None for s in res.stats)


def test_avg_bf16_and_same_codec_inside_nodes() -> None:
    xs = [x.bfloat16() for x in _inputs(8, 500, seed=2)]
    _assert_same("int8", "ring", xs, op="avg")
    opts = _options("hierarchical", 8, intra=None)  # fused re-encodings inside the nodes
    _assert_same("mxfp6_e2m3", "hierarchical", xs, schedule_options=opts)
    opts = _options("hierarchical", 8, intra="int8")  # an override equal to the codec
    _assert_same("int8", "hierarchical", xs, schedule_options=opts)


def test_one_call_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring of n: the first round's encodings and each reduce round's re-encodings of all
    ranks are one call each (n calls; the threaded engine makes n per round)."""
    calls = []
    encode = IntCodec.encode

    def counting(self, x, ctx=None):  # type: ignore[no-untyped-def]
        calls.append(x.numel())
        return encode(self, x, ctx)

    monkeypatch.setattr(IntCodec, "encode", counting)
    n = 8
    xs = _inputs(n, 32 * n * 5, seed=0)
    run = simulate_schedule(xs, get_codec("int8"), get_schedule("ring", n))
    assert calls == [32 * 5 * n] * n
    # every rank sends one chunk per round: the bytes of a round are even
    assert run.round_bytes.shape == (2 * (n - 1), n)
    assert (run.round_bytes == run.round_bytes[0, 0]).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", range(1, 10))
def test_plan_matches_the_first_planner(schedule: str, n: int) -> None:
    sched = get_schedule(schedule, n, **(_options(schedule, n) or {}))
    rr = sched.reduce_rounds
    for codec in (get_codec("int8"), get_codec("thc")):
        for rounds in (None, (0, rr), (rr, sched.num_rounds)):
            if rounds is not None and n == 1:
                continue
            got = plan_schedule(sched, codec, seed=3, step=1, rounds=rounds)
            assert got == oracle_plan(sched, codec, seed=3, step=1, rounds=rounds)
    same = get_schedule("hierarchical", 4, ranks_per_node=2, intra_codec="int8")
    assert plan_schedule(same, get_codec("int8")) == oracle_plan(same, get_codec("int8"))


@pytest.mark.parametrize("codec", list_codecs() + EXTRA, ids=str)
def test_batch_fields_are_all_the_codec_reads(codec) -> None:
    """Where the simulator batches a codec, contexts that differ in every other field give
    the same bytes, the same values and the same bound."""
    c = get_codec(codec)
    fields = batch_fields(c)
    if fields is None:
        return
    x = _inputs(1, 4096, seed=7)[0] * 3
    a = HopContext(seed=1, step=2, hop=1, num_hops=4, rank=3, contributions=2, world_size=8)
    other = {"seed": 9, "step": 5, "hop": 2, "num_hops": 6, "rank": 0, "contributions": 5}
    b = HopContext(
        **{k: getattr(a, k) if k in fields else v for k, v in other.items()},
        offset=64 * 1024,
        world_size=16,
    )
    pa, pb = c.encode(x, a), c.encode(x, b)
    assert torch.equal(pa, pb)
    assert torch.equal(c.decode(pa, x.numel(), a), c.decode(pb, x.numel(), b))
    assert torch.equal(c.error_bound.max_abs_error(x, a), c.error_bound.max_abs_error(x, b))
    assert c.encoded_nbytes(x.numel(), a) == c.encoded_nbytes(x.numel(), b)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pooled_dynamiq_many_spans_per_chunk(schedule: str) -> None:
    """The default (pooled) DynamiQ with several spans in every chunk, a short last span and
    sub-chunks: the chunks of all ranks share each call, their budgets gathered by place."""
    n = 8
    xs = _inputs(n, n * 256 * 3 + 37, seed=5)
    opts = _options(schedule, n)
    _assert_same("dynamiq", schedule, xs, seed=1, step=3, sub_chunk=512, schedule_options=opts)


def test_pooled_dynamiq_one_call_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring of n with the pooled default: one encode call per round for all ranks, each on
    the whole buffer's worth of values (its chunks re-cut by the prologue)."""
    calls = []
    encode = DynamiqCodec.encode

    def counting(self, x, ctx=None):  # type: ignore[no-untyped-def]
        calls.append(x.numel())
        return encode(self, x, ctx)

    monkeypatch.setattr(DynamiqCodec, "encode", counting)
    n, numel = 8, 8 * 256 * 4 + 100
    simulate_schedule(_inputs(n, numel, seed=0), get_codec("dynamiq"), get_schedule("ring", n))
    assert calls == [numel] * n
