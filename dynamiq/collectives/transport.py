"""Transports: one method per verb, a torch.distributed one and an in-process fake.

A :class:`Transport` moves tensors between the ranks of one collective: ``isend`` and
``irecv`` return a :class:`Work` whose ``wait(timeout)`` completes the transfer or raises
:class:`PeerTimeoutError` naming the peer; ``close()`` ends its use (later transfers raise).
The engine never touches ``torch.distributed`` directly, so the same schedule code runs over
gloo, NCCL and the in-process :class:`LocalTransport` (N ranks as N threads of one process).

A transport that lives across many collectives (a DDP hook's) may also remember the
configurations its ranks have agreed on (:class:`RemembersAgreements`), so the engine's
handshake runs once per configuration instead of at every call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "LocalCluster",
    "LocalTransport",
    "PeerTimeoutError",
    "RemembersAgreements",
    "TorchDistTransport",
    "Transport",
    "TransportClosedError",
    "Work",
]


class PeerTimeoutError(TimeoutError):
    """A peer did not deliver (or accept) data in time: it died, stalled or disagrees."""


class Work(Protocol):
    def wait(self, timeout: float) -> None: ...


class Transport(Protocol):
    """Point-to-point transfers between the ranks ``0 .. world_size - 1`` of a collective."""

    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` (contiguous) to ``dst``; the tensor must stay alive."""
        ...

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into ``tensor`` (its size is the message's size) from ``src``."""
        ...

    def close(self) -> None:
        """End this rank's use of the transport: later ``isend``/``irecv`` raise. Idempotent;
        transfers already started are not cancelled (wait on them first)."""
        ...


@runtime_checkable
class RemembersAgreements(Protocol):
    """A transport whose ranks keep the configurations they agreed on (see
    :func:`dynamiq.collectives.handshake.agree`): ``agreed`` holds their descriptors."""

    agreed: set[bytes]


class TransportClosedError(RuntimeError):
    """A transfer was started on a transport after its ``close()``."""


def _check_open(closed: bool, rank: int, verb: str) -> None:
    if closed:
        raise TransportClosedError(f"rank {rank}: {verb} on a closed transport")


class _Done:
    def wait(self, timeout: float) -> None:
        return None


class _LocalRecv:
    def __init__(self, cluster: LocalCluster, out: torch.Tensor, src: int, dst: int):
        self.cluster, self.out, self.src, self.dst = cluster, out, src, dst
        self.q = cluster.boxes[(src, dst)]

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.cluster.aborted.is_set():
                raise PeerTimeoutError(
                    f"rank {self.dst}: gave up waiting for peer {self.src}: another rank failed"
                )
            try:
                msg = self.q.get(timeout=min(0.05, max(deadline - time.monotonic(), 0.0)))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(
                        f"rank {self.dst}: no data from peer {self.src} within {timeout:g} s"
                    ) from None
        if msg.numel() != self.out.numel() or msg.dtype != self.out.dtype:
            raise ValueError(
                f"rank {self.dst}: message from peer {self.src} has {msg.numel()} "
                f"{msg.dtype} values, expected {self.out.numel()} {self.out.dtype}"
            )
        self.out.copy_(msg.to(self.out.device))


class LocalCluster:
    """Mailboxes shared by the :class:`LocalTransport` of each simulated rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.boxes: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (a, b): queue.Queue() for a in range(world_size) for b in range(world_size)
        }
        #: set when a rank fails, so that the others stop waiting for it at once
        self.aborted = threading.Event()

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)


class LocalTransport:
    """Rank ``rank`` of a :class:`LocalCluster`: sends are buffered copies, receives block."""

    def __init__(self, cluster: LocalCluster, rank: int):
        self.cluster = cluster
        self.rank = rank
        self.world_size = cluster.world_size
        self.closed = False

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        _check_open(self.closed, self.rank, "isend")
        self.cluster.boxes[(self.rank, dst)].put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        _check_open(self.closed, self.rank, "irecv")
        return _LocalRecv(self.cluster, tensor, src, self.rank)

    def close(self) -> None:
        """Later transfers raise; messages already sent stay in the peers' mailboxes."""
        self.closed = True


class _DistWork:
    def __init__(self, work: Any, peer: int, rank: int, verb: str):
        self.work, self.peer, self.rank, self.verb = work, peer, rank, verb

    def wait(self, timeout: float) -> None:
        try:
            ok = self.work.wait(timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise PeerTimeoutError(
                f"rank {self.rank}: {self.verb} peer {self.peer} failed or timed out after "
                f"{timeout:g} s ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from exc
        if ok is False:
            raise PeerTimeoutError(
                f"rank {self.rank}: {self.verb} peer {self.peer} timed out after {timeout:g} s"
            )


class TorchDistTransport:
    """Point-to-point over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

    ``group`` is a process group (default: the world); ranks of the collective are group
    ranks, mapped to global ranks for the P2P calls. It remembers the configurations its
    ranks agreed on (``agreed``, see :class:`RemembersAgreements`). ``close()`` ends its use;
    the process group stays (it belongs to whoever created it).
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group first "
                "(or use simulate_allreduce for an in-process run)"
            )
        self.dist = dist
        self.group = group
        #: configurations already agreed on by every rank (see ``handshake.agree``)
        self.agreed: set[bytes] = set()
        self.closed = False
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global: Sequence[int] = (
            list(range(self.world_size))
            if group is None
            else [dist.get_global_rank(group, r) for r in range(self.world_size)]
        )

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        _check_open(self.closed, self.rank, "isend")
        work = self.dist.isend(tensor, dst=self._global[dst], group=self.group)
        return _DistWork(work, dst, self.rank, "send to")

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        _check_open(self.closed, self.rank, "irecv")
        work = self.dist.irecv(tensor, src=self._global[src], group=self.group)
        return _DistWork(work, src, self.rank, "receive from")

    def close(self) -> None:
        """Later transfers raise; the agreed configurations are forgotten."""
        self.closed = True
        self.agreed.clear()


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
