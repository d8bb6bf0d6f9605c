"""Engine features: prologues, data-dependent sizes, reduce_scatter / all_gather, user
schedules and the validator, the uncompressed threshold."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from dynamiq.codecs import Codec, ErrorBound, HopContext, IntCodec
from dynamiq.collectives import (
    Schedule,
    all_gather,
    get_schedule,
    reduce_scatter,
    simulate_allreduce,
)
from dynamiq.collectives.handshake import PrologueComm
from dynamiq.collectives.schedules import ScheduleError, Step
from dynamiq.collectives.transport import LocalCluster, run_threads


def _xs(n: int, numel: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


@dataclass(frozen=True, kw_only=True)
class _AgreedInt8(IntCodec):
    """INT8 that needs every rank's absmax first (a THC-style prologue)."""

    codec_id: ClassVar[str] = "_agreed_int8_test_only"

    def prologue(self, x: torch.Tensor, comm: PrologueComm) -> dict[str, Any]:
        local = x.float().abs().amax() if x.numel() else torch.zeros(())
        every = comm.allgather(local.reshape(1))
        return {"gmax": float(torch.cat(every).max())}

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        if ctx.shared is None or "gmax" not in ctx.shared:
            raise AssertionError("the prologue's result did not reach the encoder")
        return super()._encode(x, ctx)


def test_prologue_runs_once_and_reaches_every_encoding() -> None:
    xs = _xs(4)
    plain = simulate_allreduce(xs, IntCodec(bits=8), "ring")
    agreed = simulate_allreduce(xs, _AgreedInt8(bits=8), "ring")
    assert torch.equal(plain.outputs[0], agreed.outputs[0])
    # each rank sent its 4-byte absmax to the 3 others: counted as bytes sent
    assert [a - p for a, p in zip(agreed.bytes_sent, plain.bytes_sent, strict=True)] == [12] * 4
    assert all("prologue" in s.seconds for s in agreed.stats)


@dataclass(frozen=True, kw_only=True)
class _SparseFP32(Codec):
    """Lossless zero-block skipping (OmniReduce-style): a bitmap of the non-zero blocks of 32,
    then their fp32 values. Its size depends on the data."""

    codec_id: ClassVar[str] = "_sparse_fp32_test_only"

    @property
    def block_size(self) -> int:
        return 32

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int | None:
        return None

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        n = x.numel()
        nb = -(-n // 32)
        padded = torch.zeros(nb * 32)
        padded[:n] = x.float()
        blocks = padded.view(nb, 32)
        keep = (blocks != 0).any(dim=1)
        bitmap = keep.to(torch.uint8)
        return torch.cat([bitmap, blocks[keep].reshape(-1).view(torch.uint8)])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        nb = -(-numel // 32)
        keep = payload[:nb].bool()
        vals = payload[nb:].clone().view(torch.float32).view(-1, 32)
        blocks = torch.zeros(nb, 32)
        blocks[keep] = vals
        return blocks.reshape(-1)[:numel].clone()

    @property
    def error_bound(self) -> ErrorBound:
        return ErrorBound(
            formula="0",
            unbiased=True,
            max_abs=lambda x, ctx: torch.zeros(x.numel(), dtype=torch.float64),
            witness=lambda n: torch.zeros(n),
        )


@pytest.mark.parametrize("schedule", ["ring", "butterfly", "tree"])
def test_data_dependent_sizes_send_a_length_first(schedule: str) -> None:
    xs = _xs(5, 4096)
    for x in xs:
        x[512:3000] = 0.0  # mostly empty blocks: the payloads shrink
    dense = simulate_allreduce(xs, "fp32", schedule)
    sparse = simulate_allreduce(xs, _SparseFP32(), schedule)
    for out in sparse.outputs:
        assert torch.equal(out, sparse.outputs[0])
    # lossless: only fp32 summation error (chunks are cut on 32-blocks here, on single values
    # for fp32, so the order of the additions, and their rounding, may differ)
    err = (sparse.outputs[0].double() - sparse.exact).abs()
    assert sparse.bound is not None and bool((err <= sparse.bound).all())
    assert float(sparse.bound.max()) < 1e-5
    assert sum(sparse.bytes_sent) < 0.6 * sum(dense.bytes_sent)
    assert sum(s.bytes_received for s in sparse.stats) == sum(sparse.bytes_sent)


@pytest.mark.parametrize("schedule", ["ring", "butterfly", "tree", "hierarchical"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_reduce_scatter_then_all_gather(schedule: str, n: int) -> None:
    opts = {"ranks_per_node": 2 if n % 2 == 0 else 1} if schedule == "hierarchical" else None
    xs = _xs(n, 999, seed=n)
    before = [x.clone() for x in xs]
    full = simulate_allreduce(
        xs, "mxfp6_e2m3", schedule, seed=3, sub_chunk=96, schedule_options=opts
    )
    cl = LocalCluster(n)
    shards = run_threads(
        n,
        lambda r: reduce_scatter(
            xs[r],
            "mxfp6_e2m3",
            schedule,
            seed=3,
            sub_chunk=96,
            transport=cl.transport(r),
            schedule_options=opts,
        ),
    )
    assert all(torch.equal(x, b) for x, b in zip(xs, before, strict=True))  # inputs untouched
    covered = sorted(rng for s in shards for rng in s.ranges)
    assert covered[0][0] == 0 and covered[-1][1] == 999
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    for s in shards:  # the very sums allreduce gives
        want = [full.outputs[0][a:b] for a, b in s.ranges]
        assert torch.equal(s.values, torch.cat(want) if want else torch.empty(0))
    cl2 = LocalCluster(n)
    outs = run_threads(
        n,
        lambda r: all_gather(
            shards[r],
            "mxfp6_e2m3",
            schedule,
            seed=3,
            sub_chunk=96,
            transport=cl2.transport(r),
            schedule_options=opts,
        ),
    )
    for out, _ in outs:
        assert torch.equal(out, outs[0][0])
    # the gathered values are the shards re-encoded once: within one encoding of them
    values = torch.cat([s.values for s in sorted(shards, key=lambda s: s.ranges or [(0, 0)])])
    assert values.numel() == 999
    err = (outs[0][0] - values).abs().max()
    assert float(err) <= float(values.abs().max()) * 0.5 / 7.5 + 1e-30


def test_all_gather_rejects_a_wrong_shard() -> None:
    cl = LocalCluster(2)
    shards = run_threads(
        2, lambda r: reduce_scatter(_xs(2)[r], "fp32", "ring", transport=cl.transport(r))
    )
    bad = shards[0]
    bad.values = bad.values[:-1]
    with pytest.raises(ValueError, match="shard has"):
        all_gather(bad, "fp32", "ring", transport=LocalCluster(2).transport(0))


def test_user_schedule_runs_and_validator_names_problems() -> None:
    # two ranks, one chunk: rank 1 reduces into rank 0, rank 0 sends the result back
    mine = Schedule(
        "handmade",
        2,
        1,
        (
            (
                Step(recv_from=1, recv_chunks=(0,), action="reduce"),
                Step(send_to=1, send_chunks=(0,)),
            ),
            (Step(send_to=0, send_chunks=(0,)), Step(recv_from=0, recv_chunks=(0,), action="copy")),
        ),
    )
    res = simulate_allreduce(_xs(2), "int8", mine)
    assert torch.equal(res.outputs[0], res.outputs[1])
    assert get_schedule(mine, 2) is mine
    with pytest.raises(ScheduleError, match="for world_size 2, not 3"):
        get_schedule(mine, 3)
    with pytest.raises(ScheduleError, match="rank 1 ends without the gradients of ranks \\[0\\]"):
        Schedule(
            "half",
            2,
            1,
            (
                (Step(recv_from=1, recv_chunks=(0,), action="reduce"),),
                (Step(send_to=0, send_chunks=(0,)),),
            ),
        )
    with pytest.raises(ScheduleError, match="round 0: rank 0 sends chunks \\(0,\\) to rank 1"):
        Schedule("unmatched", 2, 1, ((Step(send_to=1, send_chunks=(0,)),), (Step(),)))
    with pytest.raises(
        ScheduleError, match="rank 0 sends and receives chunk\\(s\\) \\[0\\] at once"
    ):
        Schedule(
            "both",
            2,
            1,
            (
                (Step(send_to=1, send_chunks=(0,), recv_from=1, recv_chunks=(0,)),),
                (Step(send_to=0, send_chunks=(0,), recv_from=0, recv_chunks=(0,)),),
            ),
        )
    with pytest.raises(ScheduleError, match="action must be"):
        Schedule("verb", 2, 1, ((Step(action="add"),), (Step(),)))
    with pytest.raises(ScheduleError, match="ranks_per_node must divide world_size=6"):
        get_schedule("hierarchical", 6, ranks_per_node=4)


def test_small_buffers_go_uncompressed() -> None:
    xs = _xs(3, 100)
    res = simulate_allreduce(xs, "mxfp4", "ring", threshold=1000)
    assert "FP32Codec" in res.stats[0].codec
    exact = simulate_allreduce(xs, "fp32", "ring")
    assert torch.equal(res.outputs[0], exact.outputs[0])


def test_per_phase_accounting() -> None:
    res = simulate_allreduce(_xs(4, 4096), "mxfp8_e4m3", "ring")
    for st in res.stats:
        assert {"agree", "encode", "reduce", "wait", "decode", "total"} <= set(st.seconds)
        assert st.control_bytes_sent > 0 and st.bound_bytes_sent > 0
        assert st.bytes_received > 0


def test_reduce_scatter_and_all_gather_async() -> None:
    xs = _xs(3, 500)
    cl = LocalCluster(3)
    handles = run_threads(
        3,
        lambda r: reduce_scatter(xs[r], "int8", "ring", transport=cl.transport(r), async_op=True),
    )
    shards = [h.wait(60) for h in handles]
    cl2 = LocalCluster(3)
    outs = run_threads(
        3,
        lambda r: all_gather(shards[r], "int8", "ring", transport=cl2.transport(r), async_op=True),
    )
    results = [h.wait(60) for h in outs]
    assert all(torch.equal(o[0], results[0][0]) for o in results)
    full = simulate_allreduce(xs, "int8", "ring")
    err = (results[0][0].double() - full.exact).abs().max()
    assert float(err) < 0.1
