"""A transport wrapper that injects one fault into one rank's messages (docs/reliability.md,
"The fault matrix").

:class:`FaultyTransport` wraps the transport of one collective call on the faulty rank. It
tells the engine's messages apart by their dtype (docs/collectives.md, "The engine"): codec
payloads are ``uint8`` (with ``verify``, their checksum in their last bytes), length headers
one ``int64`` word sent just before a payload, bounds ``float64`` just after it;
the first ``ceil(log2 n)`` ``uint8`` messages are the configuration check, which it leaves
alone. Faults, each hitting the ``at``-th payload (counted from 0) and what goes with it:

- ``kill``: the process exits (code :data:`KILLED`) instead of sending it;
- ``stall``: sleeps ``stall`` seconds before sending it, then goes on;
- ``drop``: it and every later message to that peer are never sent (a link gone silent);
- ``reorder``: it (with its header and bound) swaps places with the next payload to the
  same peer, if they have the same sizes or length headers (else gloo would abort on the
  size mismatch before any check: the fault does not apply);
- ``payload``, ``header``, ``bound``: one bit of it, of its length header, of its bound is
  flipped (``flip`` names the bit);
- ``prologue``: one bit of the ``at``-th message of the codec's prologue is flipped (the
  prologue's messages are the ones of another dtype than ``uint8``, ``int64`` and
  ``float64``: DynamiQ's all-reduce of int8 demands, THC's all-gather of fp32
  scales).

A fault that cannot apply (no header: fixed-size codec; no bound; no next payload) leaves
the messages alone: :attr:`FaultyTransport.applied` says whether it struck.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

__all__ = ["FAULTS", "KILLED", "FaultyTransport"]

FAULTS = ("kill", "stall", "drop", "reorder", "payload", "header", "bound", "prologue")
#: dtypes of the engine's own messages; a message of any other dtype is the codec's prologue
_ENGINE_DTYPES = (torch.uint8, torch.int64, torch.float64)
#: exit code of a rank killed by the ``kill`` fault
KILLED = 17


class _Sent:
    """A send that the wrapper holds back (``reorder``) or never makes (``drop``)."""

    def __init__(self, owner: FaultyTransport | None = None):
        self.owner = owner
        self.work: Any = None

    def wait(self, timeout: float) -> None:
        if self.owner is not None:
            self.owner.flush()
        if self.work is not None:
            self.work.wait(timeout)


class _Recv:
    def __init__(self, owner: FaultyTransport, work: Any):
        self.owner, self.work = owner, work

    def wait(self, timeout: float) -> None:
        self.owner.flush()  # held sends go out before this rank blocks on anything
        self.work.wait(timeout)


class FaultyTransport:
    """``base`` (a tagged transport: a ``TorchDistTransport`` or ``LocalTransport``) with
    ``fault`` injected at the ``at``-th payload this rank sends (``verify``: the engine runs
    with checksums, which changes the size of its headers)."""

    def __init__(
        self,
        base: Any,
        fault: str,
        *,
        at: int = 1,
        verify: bool = False,
        stall: float = 3.0,
        flip: int = 0,
    ):
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        self.base, self.fault, self.at, self.verify = base, fault, at, verify
        self.stall, self.flip = stall, flip
        self.rank, self.world_size = base.rank, base.world_size
        self.sequencer = base.sequencer
        self.skip = math.ceil(math.log2(self.world_size)) if self.world_size > 1 else 0
        self.payloads = 0  # uint8 messages seen, the configuration check's included
        self.prologue_messages = 0  # messages of the codec's prologue seen
        self.applied = False
        self._struck = False
        self._bound_to: int | None = None  # ``bound``: flip the next float64 to this peer
        self._dropped: set[int] = set()  # peers whose link went silent
        self._header: dict[int, tuple[torch.Tensor, int, _Sent]] = {}  # the one before a payload
        self._held: dict[int, list[tuple[torch.Tensor, int, _Sent]]] = {}  # ``reorder``
        self._starts: dict[int, list[int]] = {}  # ``reorder``: where each held group starts

    # -- the transport ---------------------------------------------------------------------

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        return _Recv(self, self.base.irecv(t, src, tag=tag))

    @property
    def board(self) -> Any:
        return getattr(self.base, "board", None)

    @property
    def can_drain(self) -> bool:
        return bool(getattr(self.base, "can_drain", False))

    def irecv_upto(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        return _Recv(self, self.base.irecv_upto(t, src, tag=tag))

    def close(self) -> None:
        self.base.close()

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        out = _Sent(self)
        if dst in self._dropped:
            return _Sent()
        if self.payloads >= self.skip and self._is_header(t):  # held until its payload
            self._header[dst] = (t, tag, out)
            return out
        msgs = [self._header.pop(dst)] if dst in self._header else []
        if t.dtype == torch.uint8:
            index = self.payloads - self.skip
            self.payloads += 1
            if index == self.at and not self._struck and self.fault != "prologue":
                self._struck = True
                t, msgs = self._strike(t, dst, msgs)
                if dst in self._dropped:
                    return _Sent()
            elif index >= 0 and dst in self._held:  # a new group (its header first)
                self._starts[dst].append(len(self._held[dst]))
        elif t.dtype == torch.float64 and self._bound_to == dst:
            t, self.applied, self._bound_to = _flipped(t, 52 + self.flip), True, None
        elif t.dtype not in _ENGINE_DTYPES:  # the codec's prologue
            index, self.prologue_messages = self.prologue_messages, self.prologue_messages + 1
            if self.fault == "prologue" and index == self.at and not self._struck:
                self._struck = True
                t, self.applied = _flipped(t, self.flip), True
        for m in [*msgs, (t, tag, out)]:
            self._queue(dst, *m)
        return out

    # -- the faults ------------------------------------------------------------------------

    @staticmethod
    def _is_header(t: torch.Tensor) -> bool:
        return t.dtype == torch.int64 and t.numel() == 1

    def _strike(
        self, t: torch.Tensor, dst: int, msgs: list[tuple[torch.Tensor, int, _Sent]]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int, _Sent]]]:
        """Apply the fault to payload ``t`` to ``dst`` (``msgs``: its header, if any)."""
        fault = self.fault
        if fault == "kill":
            os._exit(KILLED)
        elif fault == "stall":
            self.applied = True
            time.sleep(self.stall)
        elif fault == "drop":
            self.applied = True
            self._dropped.add(dst)
        elif fault == "reorder":
            self._held[dst], self._starts[dst] = [], [0]
        elif fault == "payload":
            t, self.applied = _flipped(t, self.flip), True
        elif fault == "header" and msgs:
            hdr, htag, hout = msgs[0]
            msgs, self.applied = [(_flipped(hdr, self.flip), htag, hout)], True
        elif fault == "bound":
            self._bound_to = dst
        return t, msgs

    def _queue(self, dst: int, t: torch.Tensor, tag: int, out: _Sent) -> None:
        if dst not in self._held:
            out.work = self.base.isend(t, dst, tag=tag)
            return
        self._held[dst].append((t, tag, out))
        if len(self._starts[dst]) > 2:  # two whole groups held: swap them now
            self.flush()

    def flush(self) -> None:
        """Send what ``reorder`` holds, its first two groups swapped (if it has two), and any
        header held; then stop holding."""
        for dst in list(self._held):
            msgs, starts = self._held.pop(dst), self._starts.pop(dst)
            if len(starts) >= 2:
                b = starts[1]
                c = starts[2] if len(starts) > 2 else len(msgs)
                if _swappable(msgs[:b], msgs[b:c]):
                    msgs = msgs[b:c] + msgs[:b] + msgs[c:]
                    self.applied = True
            for t, tag, out in msgs:
                out.work = self.base.isend(t, dst, tag=tag)
        for dst in list(self._header):
            t, tag, out = self._header.pop(dst)
            out.work = self.base.isend(t, dst, tag=tag)


def _swappable(
    a: list[tuple[torch.Tensor, int, _Sent]], b: list[tuple[torch.Tensor, int, _Sent]]
) -> bool:
    """Whether two groups of messages can swap places without a size mismatch, which gloo
    answers by aborting the process before any check of ours: the same sizes (DynamiQ's
    pooled sub-chunks may differ), or sized by length headers (the receiver then drains)."""
    if a and b and FaultyTransport._is_header(a[0][0]) and FaultyTransport._is_header(b[0][0]):
        return True
    return [m[0].numel() for m in a] == [m[0].numel() for m in b]


def _flipped(t: torch.Tensor, bit: int) -> torch.Tensor:
    """A copy of ``t`` with bit ``bit`` of its first element flipped."""
    out = t.detach().clone().contiguous()
    raw = out.view(torch.uint8)
    width = out.element_size() * 8
    bit %= width
    raw[bit // 8] ^= 1 << (bit % 8)
    return out
