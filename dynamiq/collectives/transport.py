"""Transports: one method per verb, a torch.distributed one and an in-process fake.

A :class:`Transport` moves tensors between the ranks of one collective: ``isend`` and
``irecv`` return a :class:`Work` whose ``wait(timeout)`` completes the transfer or raises
:class:`PeerTimeoutError` naming the peer; ``close()`` ends its use (later transfers raise).
The engine never touches ``torch.distributed`` directly, so the same schedule code runs over
gloo, NCCL and the in-process :class:`LocalTransport` (N ranks as N threads of one process).

**Concurrent collectives.** Any number of collectives may be in flight on one transport (or
one process group): each runs on its own :class:`Channel` (:func:`open_collective`, called in
issue order), numbered by the :class:`Sequencer` of the transport's group, so every rank gives
the same collective the same number. Where the transport matches messages by tag (gloo, the
in-process one), a channel's messages carry the tag ``1 + seq % 2**30`` and collectives run
at once; where it does not (NCCL, a custom transport without ``tag``), they run one at a time
in issue order. Either way no message is matched to another collective's receive.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch

from .failures import DictBoard, StoreBoard

__all__ = [
    "Channel",
    "LocalCluster",
    "LocalTransport",
    "PeerTimeoutError",
    "Sequencer",
    "TorchDistTransport",
    "Transport",
    "TransportClosedError",
    "TransportError",
    "Work",
    "open_collective",
]

#: Tags of collectives' messages are ``1 + seq % _TAG_SPACE`` (0 stays the untagged default).
_TAG_SPACE = 1 << 30


class PeerTimeoutError(TimeoutError):
    """A peer did not deliver (or accept) data in time: it died, closed the connection,
    stalled or disagrees. ``peer``: the rank waited for, where known."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class TransportError(RuntimeError):
    """The transport itself failed to start a transfer (e.g. a broken process group).
    ``peer``: the rank of the transfer, where known."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class Work(Protocol):
    def wait(self, timeout: float) -> None: ...


class Transport(Protocol):
    """Point-to-point transfers between the ranks ``0 .. world_size - 1`` of a collective."""

    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` (contiguous) to ``dst``; the tensor must stay alive.
        (The built-in transports also take ``tag=``: see :class:`Channel`.)"""
        ...

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into ``tensor`` (its size is the message's size) from ``src``."""
        ...

    def close(self) -> None:
        """End this rank's use of the transport: later ``isend``/``irecv`` raise. Idempotent;
        transfers already started are not cancelled (wait on them first)."""
        ...


class Sequencer:
    """Numbers the collectives issued on one group (in issue order, from 0); with
    ``serial``, lets them run only one at a time, in that order (:meth:`start`, :meth:`end`)."""

    def __init__(self, serial: bool):
        self.serial = serial
        self.issued = 0
        self.turn = 0  # with ``serial``: the collective allowed to run
        self.done: set[int] = set()
        self.cond = threading.Condition()

    def issue(self) -> int:
        with self.cond:
            self.issued += 1
            return self.issued - 1

    def start(self, seq: int) -> None:
        if self.serial:
            with self.cond:
                self.cond.wait_for(lambda: self.turn >= seq)

    def end(self, seq: int) -> None:
        """Collective ``seq`` is over (idempotent): the next one may run."""
        with self.cond:
            self.done.add(seq)
            while self.turn in self.done:
                self.done.discard(self.turn)
                self.turn += 1
            self.cond.notify_all()


#: the sequencer of a transport that has none of its own (runs its collectives in order)
_FALLBACK: weakref.WeakKeyDictionary[Any, Sequencer] = weakref.WeakKeyDictionary()


class Channel:
    """One collective's view of a transport (a :class:`Transport` itself): its messages carry
    its tag, or (``sequencer.serial``) it runs alone. Bracket its transfers by :meth:`start`
    and :meth:`end` (``end`` also when it fails, or never runs)."""

    def __init__(self, base: Any, sequencer: Sequencer, seq: int):
        self.base, self.sequencer, self.seq = base, sequencer, seq
        self.rank: int = base.rank
        self.world_size: int = base.world_size
        self.tag = 0 if sequencer.serial else 1 + seq % _TAG_SPACE
        #: whether :meth:`irecv_upto` can take a message shorter than its buffer
        self.can_drain = bool(getattr(base, "can_drain", False))

    @property
    def board(self) -> Any:
        """Where failures are posted (dynamiq/collectives/failures.py), or ``None``."""
        return getattr(self.base, "board", None)

    def start(self) -> None:
        self.sequencer.start(self.seq)

    def end(self) -> None:
        self.sequencer.end(self.seq)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        if self.tag:
            return self.base.isend(tensor, dst, tag=self.tag)
        return self.base.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        if self.tag:
            return self.base.irecv(tensor, src, tag=self.tag)
        return self.base.irecv(tensor, src)

    def irecv_upto(self, tensor: torch.Tensor, src: int) -> Work:
        """Receive a message of *at most* ``tensor``'s size (only where ``can_drain``): the
        engine drains a payload whose length it cannot trust this way."""
        if self.tag:
            return self.base.irecv_upto(tensor, src, tag=self.tag)
        return self.base.irecv_upto(tensor, src)

    def close(self) -> None:
        """Ends this collective (as :meth:`end`); the transport stays open."""
        self.end()


def open_collective(transport: Any) -> Channel:
    """The channel of the next collective on ``transport``: call it in issue order (the
    same order on every rank), before handing the collective to another thread. A transport
    with a ``sequencer`` attribute uses it (tagged unless ``serial``); any other runs its
    collectives one at a time. A :class:`Channel` is returned as it is."""
    if isinstance(transport, Channel):
        return transport
    seqr = getattr(transport, "sequencer", None)
    if seqr is None:
        seqr = _FALLBACK.setdefault(transport, Sequencer(serial=True))
    return Channel(transport, seqr, seqr.issue())


class TransportClosedError(RuntimeError):
    """A transfer was started on a transport after its ``close()``."""


def _check_open(closed: bool, rank: int, verb: str) -> None:
    if closed:
        raise TransportClosedError(f"rank {rank}: {verb} on a closed transport")


class _Done:
    def wait(self, timeout: float) -> None:
        return None


class _LocalRecv:
    def __init__(
        self,
        cluster: LocalCluster,
        out: torch.Tensor,
        src: int,
        dst: int,
        tag: int,
        upto: bool = False,
    ):
        self.cluster, self.out, self.src, self.dst = cluster, out, src, dst
        self.q = cluster.box(src, dst, tag)
        self.upto = upto  # a message shorter than ``out`` is taken (into its start)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.cluster.aborted.is_set():
                raise PeerTimeoutError(
                    f"rank {self.dst}: gave up waiting for peer {self.src}: another rank failed",
                    self.src,
                )
            try:
                msg = self.q.get(timeout=min(0.05, max(deadline - time.monotonic(), 0.0)))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(
                        f"rank {self.dst}: no data from peer {self.src} within {timeout:g} s",
                        self.src,
                    ) from None
        size_ok = msg.numel() <= self.out.numel() if self.upto else msg.numel() == self.out.numel()
        if not size_ok or msg.dtype != self.out.dtype:
            raise ValueError(
                f"rank {self.dst}: message from peer {self.src} has {msg.numel()} "
                f"{msg.dtype} values, expected {self.out.numel()} {self.out.dtype}"
            )
        self.out[: msg.numel()].copy_(msg.to(self.out.device))


class LocalCluster:
    """Mailboxes shared by the :class:`LocalTransport` of each simulated rank: one per
    (sender, receiver, tag); each rank numbers its collectives with its own sequencer."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.boxes: defaultdict[tuple[int, int, int], queue.Queue[torch.Tensor]] = defaultdict(
            queue.Queue
        )
        self._lock = threading.Lock()
        self.sequencers = [Sequencer(serial=False) for _ in range(world_size)]
        #: set when a rank fails, so that the others stop waiting for it at once
        self.aborted = threading.Event()
        #: where failed collectives post who failed (dynamiq/collectives/failures.py)
        self.board = DictBoard()

    def box(self, src: int, dst: int, tag: int) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self.boxes[(src, dst, tag)]

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)


class LocalTransport:
    """Rank ``rank`` of a :class:`LocalCluster`: sends are buffered copies, receives block."""

    def __init__(self, cluster: LocalCluster, rank: int):
        self.cluster = cluster
        self.rank = rank
        self.world_size = cluster.world_size
        self.sequencer = cluster.sequencers[rank]
        self.closed = False
        self.can_drain = True  # :meth:`irecv_upto`
        self.board = cluster.board

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        _check_open(self.closed, self.rank, "isend")
        self.cluster.box(self.rank, dst, tag).put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        _check_open(self.closed, self.rank, "irecv")
        return _LocalRecv(self.cluster, tensor, src, self.rank, tag)

    def irecv_upto(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Receive a message of at most ``tensor``'s size (as gloo does)."""
        _check_open(self.closed, self.rank, "irecv")
        return _LocalRecv(self.cluster, tensor, src, self.rank, tag, upto=True)

    def close(self) -> None:
        """Later transfers raise; messages already sent stay in the peers' mailboxes."""
        self.closed = True


_CLOSED_WORDS = ("closed", "reset by peer", "broken pipe", "connection refused", "eof")


class _DistWork:
    def __init__(self, work: Any, peer: int, rank: int, verb: str):
        self.work, self.peer, self.rank, self.verb = work, peer, rank, verb

    def wait(self, timeout: float) -> None:
        t0 = time.monotonic()
        try:
            ok = self.work.wait(timedelta(seconds=timeout))
        except RuntimeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            took = time.monotonic() - t0
            if any(w in first.lower() for w in _CLOSED_WORDS) or took < 0.9 * timeout:
                what = f"peer {self.peer} closed the connection after {took:.1f} s"
            else:
                what = f"no data from peer {self.peer} within {timeout:g} s"
            raise PeerTimeoutError(
                f"rank {self.rank}: {self.verb}: {what} ({first})", self.peer
            ) from exc
        if ok is False:
            what = f"no data from peer {self.peer} within {timeout:g} s"
            raise PeerTimeoutError(f"rank {self.rank}: {self.verb}: {what}", self.peer)


#: one sequencer per process group, shared by every transport over it
_GROUPS: weakref.WeakKeyDictionary[Any, Sequencer] = weakref.WeakKeyDictionary()
_GROUPS_LOCK = threading.Lock()


def _group_sequencer(dist: Any, group: Any) -> Sequencer:
    key = group if group is not None else dist.group.WORLD
    with _GROUPS_LOCK:
        if key not in _GROUPS:
            # gloo matches point-to-point messages by tag; NCCL (and others) ignore tags
            _GROUPS[key] = Sequencer(serial=dist.get_backend(group) != "gloo")
        return _GROUPS[key]


def initialized_dist() -> Any:
    """``torch.distributed``, once a process group is initialized (else a RuntimeError)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call init_process_group first "
            "(or use simulate_allreduce for an in-process run)"
        )
    return dist


class TorchDistTransport:
    """Point-to-point over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

    ``group`` is a process group (default: the world); ranks of the collective are group
    ranks, mapped to global ranks for the P2P calls. Every transport over one group shares
    the group's :class:`Sequencer` (collectives on it are numbered in issue order, tagged on
    gloo, serialised elsewhere). A failure of torch.distributed raises
    :class:`PeerTimeoutError` (waits) or :class:`TransportError` (starts), naming the peer.
    ``close()`` ends its use; the process group stays (it belongs to whoever created it).
    """

    def __init__(self, group: Any = None):
        dist = initialized_dist()
        self.dist = dist
        self.group = group
        self.sequencer = _group_sequencer(dist, group)
        self.closed = False
        #: gloo takes a message shorter than the receive's buffer (:meth:`irecv_upto`)
        self.can_drain = dist.get_backend(group) == "gloo"
        self._board: Any = None
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global: Sequence[int] = (
            list(range(self.world_size))
            if group is None
            else [dist.get_global_rank(group, r) for r in range(self.world_size)]
        )

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        _check_open(self.closed, self.rank, "isend")
        try:
            work = self.dist.isend(tensor, dst=self._global[dst], group=self.group, tag=tag)
        except RuntimeError as exc:
            raise TransportError(
                f"rank {self.rank}: cannot send to peer {dst}: {exc}", dst
            ) from exc
        return _DistWork(work, dst, self.rank, "send to")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        _check_open(self.closed, self.rank, "irecv")
        try:
            work = self.dist.irecv(tensor, src=self._global[src], group=self.group, tag=tag)
        except RuntimeError as exc:
            raise TransportError(
                f"rank {self.rank}: cannot receive from peer {src}: {exc}", src
            ) from exc
        return _DistWork(work, src, self.rank, "receive from")

    @property
    def board(self) -> Any:
        """The group's store as a board of failures (dynamiq/collectives/failures.py), or
        ``None`` where torch.distributed does not expose it."""
        if self._board is None:
            try:
                c10d = self.dist.distributed_c10d
                group = self.group if self.group is not None else self.dist.group.WORLD
                self._board = StoreBoard(c10d._get_process_group_store(group))
            except Exception:  # a private API: without it, no board
                self._board = False
        return self._board or None

    def irecv_upto(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Receive a message of at most ``tensor``'s size (gloo only: ``can_drain``)."""
        if not self.can_drain:
            raise TransportError(f"rank {self.rank}: this backend cannot drain a message")
        return self.irecv(tensor, src, tag=tag)

    def close(self) -> None:
        """Later transfers raise."""
        self.closed = True


def run_threads(world_size: int, fn: Any, on_error: Any = None) -> list[Any]:
    """Run ``fn(rank)`` in one thread per rank; re-raise the first error (by rank).

    ``on_error()`` is called as soon as any rank fails (e.g. to abort the others' waits)."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # reported below, in the caller's thread
            errors[r] = exc
            if on_error is not None:
                on_error()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a root cause beats the timeouts it caused on other ranks
    first = next(
        (e for e in errors if e is not None and not isinstance(e, PeerTimeoutError)),
        next((e for e in errors if e is not None), None),
    )
    if first is not None:
        raise first
    return results
