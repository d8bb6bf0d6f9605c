"""Naming the rank that failed first (dynamiq/collectives/failures.py): the board, its
order, a board that hangs, and in process a dead link seen by every rank."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from dynamiq.collectives import allreduce
from dynamiq.collectives.failures import (
    BOARD_TIMEOUT,
    DictBoard,
    Failure,
    StoreBoard,
    first_failure,
    post_failure,
)
from dynamiq.collectives.transport import LocalCluster
from dynamiq.testing.faults import FaultyTransport


def test_the_earliest_failure_by_phase_round_and_time_is_named() -> None:
    board = DictBoard()
    later = Failure(rank=3, suspect=2, phase=2, round_=1, t=10.0, what="PeerTimeoutError: x")
    first = Failure(rank=2, suspect=1, phase=2, round_=0, t=12.0, what="PeerTimeoutError: y")
    status = Failure(rank=0, suspect=3, phase=3, round_=5, t=1.0, what="PeerTimeoutError: z")
    for f in (later, first, status):
        post_failure(board, 7, f)
    post_failure(board, 8, Failure(1, 1, 0, 0, 0.0, "ValueError: another collective"))
    assert first_failure(board, 7, 4) == first  # round 0 beats round 1, though later
    assert first_failure(board, 9, 4) is None
    assert "rank 1 failed first" in first.describe() and "rank 2's wait" in first.describe()
    own = Failure(rank=0, suspect=0, phase=1, round_=0, t=0.0, what="IntegrityError: bad")
    assert own.describe() == "rank 0 failed first (prologue: IntegrityError: bad)"


class _HangingStore:
    def set(self, key: str, value: str) -> None:
        time.sleep(30)

    def check(self, keys: list[str]) -> bool:
        time.sleep(30)
        return False


def test_a_board_that_hangs_is_given_up_and_skipped() -> None:
    board = StoreBoard(_HangingStore())
    t0 = time.monotonic()
    post_failure(board, 0, Failure(0, 1, 2, 0, 0.0, "PeerTimeoutError"))
    assert time.monotonic() - t0 < BOARD_TIMEOUT + 0.5 and board.dead
    t0 = time.monotonic()
    assert first_failure(board, 0, 4) is None
    assert time.monotonic() - t0 < 0.5  # skipped at once


@pytest.mark.parametrize("sched", ["ring", "butterfly"])
def test_every_rank_names_the_rank_whose_link_went_silent(sched: str) -> None:
    # rank 1 stops sending to one peer: that peer times out on rank 1; the others time out
    # (or give up) on a neighbour, and name rank 1 from the board
    n = 4
    cluster = LocalCluster(n)
    out = [""] * n

    def body(r: int) -> None:
        tr: Any = cluster.transport(r)
        if r == 1:
            tr = FaultyTransport(tr, "drop", at=1)
        x = torch.randn(n * 2 * 4096, generator=torch.Generator().manual_seed(r))
        try:
            allreduce(x, "int8", sched, transport=tr, threshold=0, sub_chunk=4096, timeout=1)
            out[r] = "ok"
        except Exception as exc:
            out[r] = f"{type(exc).__name__}: {exc}"
            cluster.aborted.set()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    survivors = [t for i, t in enumerate(out) if i != 1]
    assert all(t.startswith("PeerTimeoutError") for t in survivors), out
    for t in survivors:
        assert "peer 1 " in t.split(" (")[0] or "rank 1 failed first" in t, out
    assert any("rank 1 failed first" in t for t in survivors), out  # (one waited on another)
