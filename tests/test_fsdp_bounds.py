"""Caller-given chunk bounds in ``reduce_scatter`` (what FSDP2's fixed output layout needs),
on the in-process transport."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dynamiq.codecs import get_codec
from dynamiq.collectives import Schedule, reduce_scatter
from dynamiq.collectives.planning import chunk_layout
from dynamiq.collectives.schedules import get_schedule
from dynamiq.collectives.transport import LocalCluster, run_threads


def _xs(n: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # gradient-like: heavy-tailed magnitudes over several binades
    return [torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4 for _ in range(n)]


def _rs(xs: list[torch.Tensor], codec: str, schedule: str | Schedule, **kw: object) -> list:
    n = len(xs)
    cl = LocalCluster(n)
    return run_threads(
        n, lambda r: reduce_scatter(xs[r], codec, schedule, transport=cl.transport(r), **kw)
    )


def _fsdp_bounds(n: int, s: int) -> list[tuple[int, int]]:
    return [(r * s, (r + 1) * s) for r in range(n)]


@pytest.mark.parametrize("codec", ["fp32", "int8", "dynamiq", "mxfp6_e2m3"])
@pytest.mark.parametrize(("schedule", "n"), [("ring", 2), ("ring", 4), ("butterfly", 4)])
def test_bounds_equal_to_the_even_cut_give_the_same_bits(codec: str, schedule: str, n: int) -> None:
    numel = 4096 * n
    xs = _xs(n, numel, seed=n)
    sched = get_schedule(schedule, n)
    even, _ = chunk_layout(numel, sched, get_codec(codec), 512)
    by_rank = [even[sched.owned_chunks(r)[0]] for r in range(n)]
    plain = _rs(xs, codec, schedule, sub_chunk=512, seed=5)
    given = _rs(xs, codec, schedule, sub_chunk=512, seed=5, chunk_bounds=by_rank)
    for a, b in zip(plain, given, strict=True):
        assert a.ranges == b.ranges
        assert torch.equal(a.values, b.values)


@pytest.mark.parametrize("codec", ["fp32", "int8", "dynamiq", "mxfp6_e2m3"])
@pytest.mark.parametrize(
    ("schedule", "n", "s"), [("ring", 2, 333), ("ring", 4, 1001), ("butterfly", 4, 77)]
)
def test_arbitrary_shard_size_lands_on_each_rank_within_its_bound(
    codec: str, schedule: str, n: int, s: int
) -> None:
    xs = _xs(n, n * s, seed=s)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    shards = _rs(
        xs, codec, schedule, sub_chunk=256, chunk_bounds=_fsdp_bounds(n, s), return_bound=True
    )
    for r, sh in enumerate(shards):
        assert sh.ranges == [(r * s, (r + 1) * s)]
        assert sh.values.numel() == s
        bound = sh.stats.bound
        assert bound is not None and bound.shape == (s,)
        err = (sh.values.double() - exact[r * s : (r + 1) * s]).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
        if codec != "fp32":  # a lossy codec did lose something
            assert float(err.max()) > 0


def test_avg_divides_the_given_shard() -> None:
    xs = _xs(2, 2 * 300)
    total = _rs(xs, "fp32", "ring", chunk_bounds=_fsdp_bounds(2, 300))
    avg = _rs(xs, "fp32", "ring", op="avg", chunk_bounds=_fsdp_bounds(2, 300))
    for t, a in zip(total, avg, strict=True):
        assert torch.equal(a.values, t.values / 2)


def test_a_permuted_ring_still_gives_rank_r_its_range() -> None:
    # a ring whose chunk labels are shuffled: rank r completes chunk perm[r], not chunk r
    n, s = 4, 500
    perm = [2, 0, 3, 1]
    ring = get_schedule("ring", n)
    steps = tuple(
        tuple(
            dataclasses.replace(
                st,
                send_chunks=tuple(perm[c] for c in st.send_chunks),
                recv_chunks=tuple(perm[c] for c in st.recv_chunks),
            )
            for st in rank_steps
        )
        for rank_steps in ring.steps
    )
    shuffled = Schedule("shuffled-ring", n, n, steps)
    assert [shuffled.owned_chunks(r) for r in range(n)] == [[p] for p in perm]
    xs = _xs(n, n * s)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    shards = _rs(xs, "fp32", shuffled, chunk_bounds=_fsdp_bounds(n, s))
    for r, sh in enumerate(shards):
        assert sh.ranges == [(r * s, (r + 1) * s)]
        assert torch.allclose(sh.values.double(), exact[r * s : (r + 1) * s], atol=1e-5)


@pytest.mark.parametrize(
    ("schedule", "n", "opts"),
    [("tree", 2, None), ("hierarchical", 4, {"ranks_per_node": 2}), ("butterfly", 3, None)],
)
def test_schedules_that_cannot_own_rank_ranges_raise_naming_themselves(
    schedule: str, n: int, opts: dict | None
) -> None:
    x = torch.ones(n * 10)
    cl = LocalCluster(n)
    with pytest.raises(ValueError, match=rf"schedule '{schedule}"):
        reduce_scatter(
            x,
            "fp32",
            schedule,
            transport=cl.transport(0),
            chunk_bounds=_fsdp_bounds(n, 10),
            schedule_options=opts,
        )


@pytest.mark.parametrize(
    "bounds", [[(0, 10), (11, 20)], [(0, 10), (10, 19)], [(0, 10)], [(0, 12), (10, 20)]]
)
def test_bounds_that_do_not_partition_raise(bounds: list) -> None:
    cl = LocalCluster(2)
    with pytest.raises(ValueError, match="chunk_bounds"):
        reduce_scatter(
            torch.ones(20), "fp32", "ring", transport=cl.transport(0), chunk_bounds=bounds
        )
