"""``DynamiqState`` without torch.distributed gives dynamiq's error, not torch's."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dynamiq.ddp import DynamiqState


def test_state_without_a_process_group_says_what_to_do() -> None:
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError, match=r"DynamiqState needs an initialised.*init_process_group"
    ):
        DynamiqState(codec="int8")


def _backward(rank: int, fault: str) -> str:
    import time

    import torch

    from dynamiq.ddp import DynamiqState, dynamiq_hook
    from dynamiq.testing.faults import FaultyTransport

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    state = DynamiqState(codec="int8", threshold=0, timeout=2, verify=fault == "payload")
    ddp.register_comm_hook(state, dynamiq_hook)
    if rank == 1 and fault == "payload":
        state.transport = FaultyTransport(state.transport, "payload", at=0, verify=True)
    try:
        if rank == 1 and fault == "dead":
            time.sleep(4)  # never joins the backward: its peer waits, then times out
            return "absent"
        ddp(torch.randn(8, 64) + rank).sum().backward()
        return "ok"
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        err = state.last_error
        return f"{type(err).__name__}: {str(err).splitlines()[0]} | {first}"
    finally:
        state.close()


def _job_hook_errors(rank: int, world: int) -> list[str]:
    return [_backward(rank, "payload"), _backward(rank, "dead")]


@pytest.mark.distributed
def test_the_hook_raises_dynamiqs_errors_with_their_names() -> None:
    from dynamiq.testing.distributed import run_gloo

    results = run_gloo(_job_hook_errors, 2, timeout=120)
    assert all(s == "ok" for s, _ in results), results
    (bad0, dead0), (bad1, dead1) = results[0][1], results[1][1]
    # verify=True reaches the state: a flipped bit from rank 1 fails backward on both ranks
    assert bad0.split(" | ")[0] == bad1.split(" | ")[0], (bad0, bad1)
    assert bad0.startswith("IntegrityError") and "from rank 1" in bad0, bad0
    assert "IntegrityError" in bad0.split(" | ")[1] and "IntegrityError" in bad1.split(" | ")[1]
    # a dead peer: PeerTimeoutError; what backward() raised names it (old code: "Unable to
    # cast <PeerTimeoutError ...> to Tensor")
    assert dead1 == "absent"
    assert dead0.startswith("PeerTimeoutError: rank 0"), dead0
    raised = dead0.split(" | ")[1]
    assert "PeerTimeoutError: rank 0: receive from: no data from peer 1" in raised, raised
