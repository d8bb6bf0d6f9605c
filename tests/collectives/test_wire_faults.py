"""Faults over real gloo ranks end in a named error on every rank, never a signal death:
a configuration that changes on a persistent transport (codec, size, step), a length header
one too small (it fails its seal), bounds from a peer that are NaN or negative."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed

from dynamiq.collectives import allreduce
from dynamiq.testing.distributed import run_gloo

pytestmark = pytest.mark.distributed


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _job_mismatch(rank: int, world: int) -> list[str]:
    from dynamiq.collectives.transport import TorchDistTransport

    tr = TorchDistTransport()  # persistent, as the DDP hook's

    def call(codec: str = "fp32", numel: int = 5000, step: int = 3) -> None:
        x = torch.full((numel,), float(rank + 1))
        allreduce(x, codec, "ring", transport=tr, threshold=0, step=step, timeout=10)
        assert torch.equal(x, torch.full((numel,), float(world * (world + 1) // 2)))

    return [
        _outcome(call),
        _outcome(lambda: call(codec="mxfp4" if rank == 1 else "fp32")),
        _outcome(lambda: call(numel=6000 if rank == 2 else 5000)),
        _outcome(lambda: call(step=4 if rank == 0 else 3)),
        _outcome(call),  # agreed again: runs
    ]


def test_changed_configuration_on_a_persistent_transport_raises_on_every_rank() -> None:
    results = run_gloo(_job_mismatch, 3, timeout=120, pg_timeout=30)
    assert all(s == "ok" for s, _ in results), results
    for _, out in results:
        assert out[0] == "ok" and out[4] == "ok", out
        for text, field, value in [(out[1], "codec", "rank 1"), (out[2], "numel", "6000")]:
            assert text.startswith("ConfigMismatchError") and field in text, text
            assert value in text, text
        assert out[3].startswith("ConfigMismatchError") and "step" in out[3], out[3]


class _Corrupt:
    """Rank 1's transport with one fault: ``short`` sends its first length header one too
    small, ``nan``/``negative`` replace the first value of every bound it sends."""

    def __init__(self, base: Any, fault: str):
        self.base, self.fault = base, fault
        self.rank, self.world_size, self.sequencer = base.rank, base.world_size, base.sequencer
        self.done = False

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        if self.fault == "short" and t.dtype == torch.int64 and not self.done:
            t, self.done = t - 1, True
        elif self.fault != "short" and t.dtype == torch.float64:
            t = t.clone()
            t[0] = float("nan") if self.fault == "nan" else -1.0
        return self.base.isend(t, dst, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        return self.base.irecv(t, src, tag=tag)

    def close(self) -> None:
        self.base.close()


def _job_wire(rank: int, world: int) -> list[str]:
    from dynamiq.collectives.transport import TorchDistTransport

    out = []
    for fault, codec, bound in [
        ("short", {"id": "omnireduce", "density": 0.5, "block_size": 64}, False),
        ("nan", "int8", True),
        ("negative", "int8", True),
    ]:
        # a gloo timeout closes the group's connections: a fresh group per fault
        tr: Any = TorchDistTransport(torch.distributed.new_group([0, 1]))
        if rank == 1:
            tr = _Corrupt(tr, fault)
        x = torch.randn(4096) + rank
        opts = {"threshold": 0, "return_bound": bound, "timeout": 3, "sub_chunk": 1024}
        out.append(_outcome(lambda x=x, c=codec, t=tr, o=opts: allreduce(x, c, transport=t, **o)))
        # the receiver fails at once, the sender a timeout later: start the next together
        torch.distributed.barrier()
    return out


def test_bad_lengths_and_bounds_from_a_peer_are_named_errors() -> None:
    results = run_gloo(_job_wire, 2, timeout=120, pg_timeout=30)
    assert all(s == "ok" for s, _ in results), results  # no signal death
    receiver, sender = results[0][1], results[1][1]
    # the header is sealed (dynamiq/collectives/integrity.py): one too small fails its check
    assert receiver[0].startswith("IntegrityError") and "length header" in receiver[0]
    for text in receiver[1:]:
        assert text.startswith("ValueError") and "bound from peer 1" in text, text
    for text in receiver:
        assert "peer 1" in text and "round 0" in text, text
    for text in sender:  # the sender's peer stopped: a named error, within its timeout
        assert text.startswith("PeerTimeoutError") and "peer 0" in text, text
