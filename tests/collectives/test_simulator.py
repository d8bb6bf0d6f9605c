"""Every registered codec × every schedule × world sizes 1..16 in the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamiq.codecs import get_codec, list_codecs
from dynamiq.collectives import get_schedule, simulate_allreduce
from dynamiq.collectives.handshake import local_prologues
from dynamiq.collectives.planning import (
    CHUNK_BOUNDS_KEY,
    chunk_layout,
    layout_align,
    plan_schedule,
)

SCHEDULES = ["ring", "butterfly", "tree", "hierarchical"]


def _options(schedule: str, n: int, intra: str | None = "fp32") -> dict | None:
    if schedule != "hierarchical":
        return None
    g = next(g for g in (4, 3, 2, 1) if n % g == 0)
    return {"ranks_per_node": g, "intra_codec": intra}


def _inputs(n: int, numel: int, seed: int, scale_spread: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(numel) * np.exp2(
        rng.integers(-scale_spread, scale_spread + 1, numel)
    )
    return [
        torch.from_numpy(
            (base * rng.uniform(0.5, 1.5) + rng.standard_normal(numel)).astype(np.float32)
        )
        for _ in range(n)
    ]


class _CountingComm:
    """A stand-in for the engine's prologue comm that counts what an all-gather sends."""

    def __init__(self, n: int) -> None:
        self.world_size, self.rank, self.sent = n, 0, 0

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.sent += t.numel() * t.element_size() * (self.world_size - 1)
        return [t] * self.world_size


def _expected_bytes(
    codec_name: str, schedule, numel: int, sub_chunk: int, xs: list[torch.Tensor]
) -> list[int] | None:
    """Bytes each rank sends, from the plan, encoded_nbytes and the prologue's exchange
    (independent of the engine's counters: a DynamiQ prologue runs on the engine's own ring
    communicator, the others on a counting all-gather); None for data-dependent sizes."""
    codec = get_codec(codec_name)
    plan = plan_schedule(schedule, codec)
    chunks, pieces = chunk_layout(numel, schedule, codec, sub_chunk)
    n = schedule.world_size
    extra, shared = [0] * n, None
    prologue = getattr(codec, "prologue", None)
    if callable(getattr(codec, "prologue_statistics", None)):
        # an all-reduce lets the prologue re-cut the chunks (planning.CHUNK_BOUNDS_KEY)
        align = layout_align(schedule, codec)
        results, comms = local_prologues(codec, xs, chunks, recut_align=align)
        shared, extra = results[0], [c.bytes_sent for c in comms]
        if shared is not None and CHUNK_BOUNDS_KEY in shared:
            _, pieces = chunk_layout(numel, schedule, codec, sub_chunk, shared[CHUNK_BOUNDS_KEY])
    elif callable(prologue) and n > 1:
        comm = _CountingComm(n)
        prologue(xs[0], comm)
        extra = [comm.sent] * n
    sizes = [
        [
            op.codec.encoded_nbytes(b - a, dataclasses.replace(op.ctx, offset=a, shared=shared))
            if shared is not None
            else op.codec.encoded_nbytes(b - a, op.ctx)
            for rnd in plan[r]
            for op in rnd.sends
            for a, b in pieces[op.chunk]
        ]
        for r in range(n)
    ]
    if any(sz is None for per_rank in sizes for sz in per_rank):
        return None
    return [sum(per_rank) + e for per_rank, e in zip(sizes, extra, strict=True)]  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("codec", list_codecs())
@settings(max_examples=6)
@given(
    n=st.integers(1, 16),
    numel=st.sampled_from([0, 1, 31, 33, 100, 257, 1000]),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0, 4, 20]),
    sub_chunk=st.sampled_from([32, 96, 1 << 18]),
)
def test_invariants(
    codec: str, schedule: str, n: int, numel: int, seed: int, spread: int, sub_chunk: int
) -> None:
    xs = _inputs(n, numel, seed, spread)
    opts = _options(schedule, n)
    res = simulate_allreduce(
        xs, codec, schedule, seed=seed, sub_chunk=sub_chunk, schedule_options=opts
    )
    # every rank bit-identical
    for out in res.outputs[1:]:
        assert torch.equal(out.view(torch.int32), res.outputs[0].view(torch.int32))
    # the certified bound holds
    err = (res.outputs[0].double() - res.exact).abs()
    assert res.bound is not None and bool((err <= res.bound).all())
    # the bytes sent are what the plan and the codec's encoded_nbytes say
    sched = get_schedule(schedule, n, **(opts or {}))
    expected = _expected_bytes(codec, sched, numel, sub_chunk, xs)
    if expected is not None:  # data-dependent sizes: the headers are checked by the engine tests
        assert res.bytes_sent == expected
    received = sum(s.bytes_received for s in res.stats)
    assert received == sum(res.bytes_sent)
    # the result does not depend on the sub-chunk size
    other = simulate_allreduce(
        xs, codec, schedule, seed=seed, sub_chunk=64, schedule_options=opts, return_bound=False
    )
    assert torch.equal(other.outputs[0].view(torch.int32), res.outputs[0].view(torch.int32))


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=25)
@given(n=st.integers(1, 16), numel=st.integers(0, 700), seed=st.integers(0, 2**16))
def test_fp32_matches_fp64_sum_within_summation_slack(
    schedule: str, n: int, numel: int, seed: int
) -> None:
    """fp32 is lossless on the wire: the only error is fp32 summation, at most
    (n - 1) additions of relative error 2^-24 on partial sums bounded by Σ|x_i|."""
    xs = _inputs(n, numel, seed, 10)
    res = simulate_allreduce(xs, "fp32", schedule, schedule_options=_options(schedule, n))
    err = (res.outputs[0].double() - res.exact).abs()
    abs_sum = torch.stack([x.double().abs() for x in xs]).sum(dim=0)
    slack = (n - 1) * 2.0**-24 * (1 + 2.0**-20) * abs_sum * (1 + 2.0**-20) ** n + n * 2.0**-149
    assert bool((err <= slack).all())


def test_avg_and_dtypes() -> None:
    xs = [torch.full((100,), float(i + 1)) for i in range(4)]
    res = simulate_allreduce(xs, "fp32", "ring", op="avg")
    assert torch.equal(res.outputs[0], torch.full((100,), 2.5))
    import torch.distributed as dist

    same = simulate_allreduce(xs, "fp32", "ring", op=dist.ReduceOp.AVG)
    assert torch.equal(same.outputs[0], res.outputs[0])
    with pytest.raises(ValueError, match="op must be"):
        simulate_allreduce(xs, "fp32", "ring", op=dist.ReduceOp.MAX)
    xb = [x.bfloat16() for x in xs]
    res = simulate_allreduce(xb, "int8", "butterfly", op="avg")
    err = (res.outputs[0].double() - res.exact).abs()
    assert bool((err <= res.bound).all())


def test_world_size_one_and_empty() -> None:
    x = torch.randn(1000)
    res = simulate_allreduce([x], "mxfp4", "ring")
    assert torch.equal(res.outputs[0], x) and res.bytes_sent == [0]
    res = simulate_allreduce([torch.empty(0)] * 3, "mxfp4", "butterfly")
    assert res.outputs[0].numel() == 0 and res.vnmse == 0.0


def test_ranks_encode_with_distinct_contexts() -> None:
    """In butterfly two ranks can encode the same global index at the same hop: their hash
    dither must differ (rank is part of the counter)."""
    plan = plan_schedule(get_schedule("butterfly", 4), get_codec("int4"), seed=1)
    seen = {}
    for r, rounds in enumerate(plan):
        for rnd in rounds:
            for op in rnd.sends:
                if op.encode:
                    key = (op.chunk, op.ctx.hop)
                    assert seen.get(key, r) == r or op.ctx.rank == r
                    seen.setdefault(key, r)
                    assert op.ctx.rank == r


def test_stochastic_codec_is_deterministic_given_seed() -> None:
    xs = _inputs(5, 500, 3, 5)
    a = simulate_allreduce(xs, {"id": "int", "bits": 3, "rounding": "stochastic"}, "ring", seed=4)
    b = simulate_allreduce(xs, {"id": "int", "bits": 3, "rounding": "stochastic"}, "ring", seed=4)
    c = simulate_allreduce(xs, {"id": "int", "bits": 3, "rounding": "stochastic"}, "ring", seed=5)
    assert torch.equal(a.outputs[0], b.outputs[0])
    assert not torch.equal(a.outputs[0], c.outputs[0])


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="same shape"):
        simulate_allreduce([torch.zeros(3), torch.zeros(4)], "fp32")
    with pytest.raises(TypeError, match="dtype"):
        simulate_allreduce([torch.zeros(3, dtype=torch.float64)] * 2, "fp32")
    with pytest.raises(ValueError, match="op must be"):
        simulate_allreduce([torch.zeros(3)] * 2, "fp32", op="max")
    with pytest.raises(ValueError, match="unknown schedule 'star'"):
        simulate_allreduce([torch.zeros(3)] * 2, "fp32", "star")
    with pytest.raises(ValueError, match="non-empty list"):
        simulate_allreduce([], "fp32")
