"""Many collectives in flight on one group: each is matched to its own messages (tagged on
gloo and in-process; serialised where the transport has no tags) and gives, bit for bit, what
it gives alone."""

from __future__ import annotations

import pytest
import torch

from dynamiq.collectives import all_gather, allreduce, reduce_scatter
from dynamiq.collectives.transport import LocalCluster, run_threads
from dynamiq.testing.distributed import run_gloo

# (codec, numel): mixed codecs, sizes (fixed- and data-dependent-size payloads)
JOBS = [
    ("int8", 3000),
    ("fp32", 700),
    ({"id": "omnireduce", "density": 0.5, "block_size": 64}, 5000),
    ("mxfp8_e4m3", 1280),
    ("int8", 9000),
    ("bf16", 300),
    ("fp32", 4096),
    ("mxfp4", 2048),
]


def _x(rank: int, i: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(numel, generator=g) * (1 + i)


def _many(rank: int, in_flight: int, **kw: object) -> list[torch.Tensor]:
    """``in_flight`` async all-reduces, then one reduce-scatter/all-gather pair in flight
    together, then each one alone, in the same order on every rank."""
    opts = dict(schedule="ring", threshold=0, sub_chunk=512, timeout=20, **kw)
    jobs = JOBS[:in_flight]
    xs = [_x(rank, i, n) for i, (_, n) in enumerate(jobs)]
    handles = [allreduce(x, c, async_op=True, **opts) for x, (c, _) in zip(xs, jobs, strict=True)]  # type: ignore[arg-type]
    rs_in = _x(rank, 99, 4000)
    rs = reduce_scatter(rs_in, "int8", async_op=True, **opts)  # type: ignore[arg-type]
    for h in handles:
        h.wait(60)
    shard = rs.wait(60)
    gathered, _ = all_gather(shard, "int8", async_op=True, **opts).wait(60)  # type: ignore[arg-type]
    alone = [_x(rank, i, n) for i, (_, n) in enumerate(jobs)]
    for x, (c, _) in zip(alone, jobs, strict=True):
        allreduce(x, c, **opts)  # type: ignore[arg-type]
    shard1 = reduce_scatter(rs_in, "int8", **opts)  # type: ignore[arg-type]
    gathered1, _ = all_gather(shard1, "int8", **opts)  # type: ignore[arg-type]
    return [*xs, gathered, *alone, gathered1]


def _job(rank: int, world: int, in_flight: int) -> list[torch.Tensor]:
    return _many(rank, in_flight)


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "in_flight"), [(2, 8), (4, 4)])
def test_concurrent_collectives_over_gloo_match_each_alone(world: int, in_flight: int) -> None:
    results = run_gloo(_job, world, in_flight, timeout=120, pg_timeout=30)
    assert all(s == "ok" for s, _ in results), results
    half = in_flight + 1
    for _, outs in results:
        for concurrent, alone in zip(outs[:half], outs[half:], strict=True):
            assert torch.equal(concurrent, alone)
    for i in range(2 * half):  # and every rank ends bit-identical
        assert all(torch.equal(outs[i], results[0][1][i]) for _, outs in results)


@pytest.mark.parametrize("world", [2, 4])
def test_concurrent_collectives_in_process_match_each_alone(world: int) -> None:
    cluster = LocalCluster(world)
    outs = run_threads(
        world,
        lambda r: _many(r, 6, transport=cluster.transport(r)),
        on_error=cluster.aborted.set,
    )
    for per_rank in outs:
        for concurrent, alone in zip(per_rank[:7], per_rank[7:], strict=True):
            assert torch.equal(concurrent, alone)
