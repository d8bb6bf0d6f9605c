"""The engine over real gloo processes on loopback: same bits as the simulator, bounds hold,
configuration mismatches and dead or stalled peers raise instead of hanging."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dynamiq.collectives import allreduce, simulate_allreduce
from dynamiq.testing.distributed import run_gloo

pytestmark = pytest.mark.distributed

CASES = [
    ("fp32", "ring"),
    ("mxfp8_e4m3", "ring"),
    ("mxfp4", "butterfly"),
    ({"id": "int", "bits": 4, "rounding": "stochastic"}, "butterfly"),
    ("int8", "tree"),
    ("mxfp6_e2m3", "hierarchical"),
    ("bf16", "tree"),
]


def _inputs(world: int, numel: int = 2000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(world)
    return [torch.randn(numel, generator=g) * (1 + r) for r in range(world)]


def _options(schedule: str, world: int) -> dict | None:
    if schedule != "hierarchical":
        return None
    return {"ranks_per_node": 2 if world % 2 == 0 else 1, "intra_codec": "fp32"}


def _job_cases(rank: int, world: int) -> list:
    out = []
    for codec, schedule in CASES:
        x = _inputs(world)[rank].clone()
        st = allreduce(
            x,
            codec,
            schedule,
            seed=7,
            return_bound=True,
            sub_chunk=256,
            schedule_options=_options(schedule, world),
            timeout=30,
        )
        out.append((x, st.bound, st.bytes_sent, st.bytes_received))
    # async handle and AVG on bf16
    xb = _inputs(world)[rank].bfloat16()
    handle = allreduce(xb, "mxfp8_e4m3", "ring", op="avg", async_op=True, timeout=30)
    st = handle.wait(60)
    out.append((xb.float(), None, st.bytes_sent, st.bytes_received))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_matches_simulator_bit_for_bit(world: int) -> None:
    results = run_gloo(_job_cases, world, timeout=240)
    assert all(status == "ok" for status, _ in results), results
    for i, (codec, schedule) in enumerate(CASES):
        sim = simulate_allreduce(
            _inputs(world),
            codec,
            schedule,
            seed=7,
            sub_chunk=256,
            schedule_options=_options(schedule, world),
        )
        for r, (_, per_case) in enumerate(results):
            x, bound, sent, _ = per_case[i]
            assert torch.equal(x, sim.outputs[r]), (codec, schedule, r)
            assert torch.equal(bound, sim.bound), (codec, schedule, r)
            assert sent == sim.bytes_sent[r]
        err = (sim.outputs[0].double() - sim.exact).abs()
        assert bool((err <= sim.bound).all())
    sim = simulate_allreduce([x.bfloat16() for x in _inputs(world)], "mxfp8_e4m3", "ring", op="avg")
    for _, per_case in results:
        assert torch.equal(per_case[-1][0], sim.outputs[0])


def _job_mismatch(rank: int, world: int) -> str:
    codec = "mxfp4" if rank != 1 else "mxfp6_e2m3"
    try:
        allreduce(torch.ones(5000), codec, "ring", timeout=20)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_config_mismatch_raises_on_every_rank() -> None:
    results = run_gloo(_job_mismatch, 3, timeout=120)
    for status, text in results:
        assert status == "ok"
        assert text.startswith("ConfigMismatchError"), text
        assert "codec" in text and "mxfp6_e2m3" in text and "rank 1" in text


def _job_dead_peer(rank: int, world: int, mode: str) -> str:
    if rank == 1:
        if mode == "die":
            os._exit(0)  # the peer disappears without a word
        time.sleep(12)  # a stalled peer
        return "slept"
    t0 = time.perf_counter()
    try:
        allreduce(torch.ones(50_000), "int8", "ring", timeout=3)
    except Exception as exc:
        return f"{type(exc).__name__} after {time.perf_counter() - t0:.1f}s: {exc}"
    return "no error"


@pytest.mark.parametrize("mode", [pytest.param("die", marks=pytest.mark.slow), "stall"])
def test_dead_or_stalled_peer_raises_within_timeout(mode: str) -> None:
    results = run_gloo(_job_dead_peer, 3, mode, timeout=60, pg_timeout=30)
    for rank in (0, 2):
        status, text = results[rank]
        assert status == "ok", text
        assert text.startswith("PeerTimeoutError"), text
        seconds = float(text.split(" after ")[1].split("s:")[0])
        assert seconds < 15, text
        assert "peer" in text


def _job_lifecycle(rank: int, world: int) -> dict:
    from dynamiq.collectives import CollectiveOptions
    from dynamiq.collectives.transport import TorchDistTransport, TransportClosedError
    from dynamiq.ddp import DynamiqState

    tr = TorchDistTransport()
    opts = CollectiveOptions(codec="int8", schedule="ring", timeout=30)
    control = [allreduce(torch.ones(5000), options=opts, transport=tr).control_bytes_sent]
    control.append(allreduce(torch.ones(5000), options=opts, transport=tr).control_bytes_sent)
    tr.close()
    try:
        allreduce(torch.ones(5000), options=opts, transport=tr)
        closed = "no error"
    except TransportClosedError as exc:
        closed = str(exc)
    state = DynamiqState(options=opts.replace(threshold=0), sub_chunk=512)
    state.close()
    return {
        "control": control,
        "closed": closed,
        "state_transport_closed": state.transport.closed,  # type: ignore[attr-defined]
        "state_codec": state.codec.get_config(),
        "state_options": (state.options.op, state.options.threshold, state.options.sub_chunk),
    }


def test_transport_lifecycle_over_gloo() -> None:
    """The torch.distributed transport checks the configuration at every call, refuses
    transfers once closed, and a DDP state closes the transport it made."""
    results = run_gloo(_job_lifecycle, 2, timeout=120)
    for status, out in results:
        assert status == "ok", out
        # a fixed-size digest exchange at every call (1 round of 64 bytes on 2 ranks)
        assert out["control"] == [64, 64]
        assert "on a closed transport" in out["closed"]
        assert out["state_transport_closed"] is True
        assert out["state_codec"]["id"] == "int" and out["state_codec"]["bits"] == 8
        assert out["state_options"] == ("avg", 0, 512)
