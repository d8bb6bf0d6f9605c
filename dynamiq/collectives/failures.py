"""Which rank failed first, when a collective fails without the status exchange reaching
every rank (docs/reliability.md, "Naming the first failing rank").

A rank that dies or stalls makes its neighbours' waits fail; their peers then wait for them
in turn, so a ``PeerTimeoutError`` alone names the neighbour a rank waited for, not the rank
that failed. So each rank whose collective fails posts one :class:`Failure` on a small
shared **board** (the process group's store on torch.distributed, a dict in process), keyed
by the collective's sequence number and its rank: where it was (phase, round), when, and
whom it suspects (the peer its wait failed on; itself for an error it raised). It then reads
the others' and names the earliest failure, by (phase, round, time): the failure closest to
the cause. Only failed collectives touch the board; a board that does not answer within
:data:`BOARD_TIMEOUT` seconds (e.g. its host rank died) is skipped, so reading it never
hangs. The times are each host's wall clock: ties between hosts within their clock skew
are ordered by that skew.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "BOARD_TIMEOUT",
    "PHASES",
    "DictBoard",
    "Failure",
    "StoreBoard",
    "first_failure",
    "post_failure",
]

#: seconds a post, or a read of every rank's entry, may take before the board is skipped
BOARD_TIMEOUT = 1.0
#: seconds a failing rank waits for earlier failures to be posted before reading the board
GRACE = 0.1
#: the phases of a collective, in order
PHASES = ("agree", "prologue", "rounds", "status")


@dataclass(frozen=True)
class Failure:
    """One rank's failure: ``rank`` failed in ``phase`` (an index into :data:`PHASES`),
    round ``round_``, at wall-clock time ``t``, suspecting ``suspect`` (its own rank for an
    error it raised), with ``what`` (the error's first words)."""

    rank: int
    suspect: int
    phase: int
    round_: int
    t: float
    what: str

    def key(self) -> tuple[int, int, float, int]:
        return (self.phase, self.round_, self.t, self.rank)

    def describe(self) -> str:
        where = PHASES[self.phase] if self.phase != 2 else f"round {self.round_}"
        if self.suspect == self.rank:
            return f"rank {self.rank} failed first ({where}: {self.what})"
        return (
            f"rank {self.suspect} failed first, most likely (rank {self.rank}'s wait for it "
            f"failed before any other, {where}: {self.what})"
        )


class DictBoard:
    """The board of in-process ranks (a dict shared by a cluster's transports)."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.entries[key] = value

    def get_many(self, keys: list[str]) -> list[str | None]:
        with self.lock:
            return [self.entries.get(k) for k in keys]


class StoreBoard:
    """The board over a torch.distributed store (the process group's): every operation in
    a daemon thread, given up after :data:`BOARD_TIMEOUT` seconds (a store whose host died
    could otherwise block for the store's own timeout); after one such, the board is
    skipped."""

    def __init__(self, store: Any):
        self.store = store
        self.dead = False

    def _call(self, fn: Any) -> Any:
        if self.dead:
            return None
        box: list[Any] = []

        def body() -> None:
            try:
                box.append(fn())
            except Exception:  # a broken store: skipped
                box.append(None)

        th = threading.Thread(target=body, daemon=True)
        th.start()
        th.join(BOARD_TIMEOUT)
        if not box:
            self.dead = True
            return None
        return box[0]

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self.store.set(key, value))

    def get_many(self, keys: list[str]) -> list[str | None]:
        def read() -> list[str | None]:
            return [self.store.get(k).decode() if self.store.check([k]) else None for k in keys]

        got = self._call(read)
        return got if isinstance(got, list) else [None] * len(keys)


def _key(seq: int, rank: int) -> str:
    return f"dynamiq.failed.{seq}.{rank}"  # a store key (not a path)


def post_failure(board: Any, seq: int, failure: Failure) -> None:
    """Post this rank's failure of collective ``seq``."""
    board.set(_key(seq, failure.rank), json.dumps(asdict(failure)))


def first_failure(board: Any, seq: int, world_size: int) -> Failure | None:
    """The earliest failure posted for collective ``seq`` (after a short grace for the
    others' posts), or ``None``."""
    time.sleep(GRACE)
    found = []
    for raw in board.get_many([_key(seq, r) for r in range(world_size)]):
        if raw:
            try:
                found.append(Failure(**json.loads(raw)))
            except (TypeError, ValueError):  # not ours: ignored
                continue
    return min(found, key=Failure.key, default=None)
