"""Message integrity and the end-of-collective status exchange (docs/reliability.md,
"Integrity").

**Checksums** (``verify=True``). Every payload the engine sends carries, in
:data:`CHECKSUM_BYTES` bytes appended to it, a CRC-32C (:func:`checksum`) over its bytes, its
bound (sent next, ``return_bound=True``) *and its identity*: the collective's sequence number,
the round, chunk and sub-chunk, the sender and the receiver (:func:`identity`). A flipped
bit, a message delivered to the wrong rank or collective, or two messages swapped within a
round then fail the receiver's check. No extra message is sent. CRC-32C comes from the
``crc32c`` package (hardware instructions where the CPU has them) when it is installed (the
``integrity`` extra), else from the standard library's ``zlib.crc32`` (CRC-32, slower);
every rank must use the same one, so its name is part of the configuration the ranks agree
on (:data:`ALGORITHM`). Length headers (data-dependent sizes) are always sealed with a check
of the length and its identity (:func:`seal_length`), ``verify`` or not, and so are the small
messages of a codec's prologue (:func:`seal_message`): both with the standard library's
CRC-32, the same on every install (no agreement needed), since what they size or decide must
never differ between ranks.

**Status** (:class:`Status`). What a rank detects during a collective (a failed checksum, a
codec's bad input, a deferred device error, ...) is *recorded*, not raised, so the rank keeps
to the schedule and its peers are not left waiting; at the end every rank passes a fixed-size
record (:data:`STATUS_WORDS` int64 words) along the dissemination pattern of the
configuration check (``ceil(log2 n)`` rounds, one message in and one out per round), merging
flags by OR and keeping the first failure (lowest round, then rank). Every rank then holds the
same merged status and raises the same error (:meth:`Status.raise_for_error`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .transport import Transport

__all__ = [
    "ALGORITHM",
    "CHECKSUM_BYTES",
    "KINDS",
    "STATUS_WORDS",
    "CollectiveStatusError",
    "IntegrityError",
    "Kind",
    "Status",
    "checksum",
    "identity",
    "message_extra",
    "open_length",
    "open_message",
    "pack_checksum",
    "seal_length",
    "seal_message",
    "unpack_checksum",
]

try:  # the optional, hardware-accelerated CRC-32C (``pip install dynamiq-allreduce[integrity]``)
    import crc32c as _crc32c

    def _crc(data: bytes | memoryview, value: int = 0) -> int:
        return int(_crc32c.crc32c(data, value))

    #: the checksum in use (agreed across ranks as part of the configuration)
    ALGORITHM = "crc32c"
except ImportError:  # pragma: no cover - exercised where the extra is not installed

    def _crc(data: bytes | memoryview, value: int = 0) -> int:
        return zlib.crc32(data, value)

    ALGORITHM = "crc32"


def identity(seq: int, round_: int, chunk: int, sub: int, src: int, dst: int) -> bytes:
    """The bytes that name one message: collective ``seq``, round, chunk, sub-chunk, sender
    ``src`` and receiver ``dst`` (covered by the checksum, never sent)."""
    return struct.pack("<q5i", seq, round_, chunk, sub, src, dst)


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor (contiguous; copied to the host if it lives elsewhere)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8).numpy().data


def checksum(ident: bytes, *tensors: torch.Tensor | None) -> int:
    """The checksum of ``tensors`` (``None`` ones skipped) under the identity ``ident``."""
    value = _crc(ident)
    for t in tensors:
        if t is not None and t.numel():
            value = _crc(_view(t), value)
    return value


#: a sealed length header: the length in the low bits, a check of it and its identity above
_LENGTH_BITS = 40
_SEAL_MASK = (1 << (63 - _LENGTH_BITS)) - 1  # 23 bits: the word stays a non-negative int64


def _seal(ident: bytes, size: int) -> int:
    return zlib.crc32(ident + b"L" + struct.pack("<q", size)) & _SEAL_MASK


def seal_length(ident: bytes, size: int) -> int:
    """The 8-byte length header of a payload of ``size`` bytes (always, ``verify`` or not):
    a corrupted or misdelivered header is caught before the receive it sizes is posted (gloo
    aborts the process on a size mismatch, before any byte of ours can be checked)."""
    if not 0 <= size < 1 << _LENGTH_BITS:
        raise ValueError(f"payload of {size} bytes cannot be sent")
    return size | _seal(ident, size) << _LENGTH_BITS


def open_length(ident: bytes, word: int) -> int | None:
    """The length a header :func:`seal_length` made holds, or ``None`` if it fails its check."""
    if word < 0:
        return None
    size = word & ((1 << _LENGTH_BITS) - 1)
    return size if word >> _LENGTH_BITS == _seal(ident, size) else None


#: bytes of a payload's checksum, appended to the payload (``verify``)
CHECKSUM_BYTES = 4


def _message_tail(ident: bytes, body: torch.Tensor) -> torch.Tensor:
    """The check :func:`seal_message` appends to ``body``: its CRC-32 (with ``ident``) in
    ``CHECKSUM_BYTES`` bytes, zero-padded to whole elements of ``body``'s dtype (uint8)."""
    crc = zlib.crc32(_view(body), zlib.crc32(ident + b"P"))
    width = -(-CHECKSUM_BYTES // body.element_size()) * body.element_size()
    raw = crc.to_bytes(CHECKSUM_BYTES, "little") + bytes(width - CHECKSUM_BYTES)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(body.device)


def message_extra(t: torch.Tensor) -> int:
    """Elements :func:`seal_message` appends to a tensor of ``t``'s dtype."""
    return -(-CHECKSUM_BYTES // t.element_size())


def seal_message(ident: bytes, t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, with a CRC-32 of its bytes and of ``ident`` appended, in ``t``'s
    dtype (:func:`message_extra` more elements): a prologue's message, always sealed."""
    body = t.detach().reshape(-1).contiguous()
    return torch.cat([body.view(torch.uint8), _message_tail(ident, body)]).view(body.dtype)


def open_message(ident: bytes, wire: torch.Tensor) -> torch.Tensor | None:
    """The tensor a message :func:`seal_message` made holds (1-D), or ``None`` if it fails
    its check (corrupted, or meant for another rank, step or collective)."""
    extra = message_extra(wire)
    if wire.numel() < extra:
        return None
    body = wire[: wire.numel() - extra]
    tail = wire[wire.numel() - extra :].contiguous().view(torch.uint8)
    return body if torch.equal(tail, _message_tail(ident, body)) else None


def pack_checksum(value: int, device: torch.device) -> torch.Tensor:
    """A checksum as the ``CHECKSUM_BYTES`` bytes appended to a payload (little-endian)."""
    raw = value.to_bytes(CHECKSUM_BYTES, "little")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def unpack_checksum(tail: torch.Tensor) -> int:
    """The checksum :func:`pack_checksum` wrote."""
    return int.from_bytes(bytes(tail.cpu().tolist()), "little")


# -- the status --------------------------------------------------------------------------------


class CollectiveStatusError(RuntimeError):
    """A rank recorded a failure in the collective's status (raised on every rank)."""


class IntegrityError(CollectiveStatusError):
    """A message failed its checksum: corrupted, misrouted or out of order (``verify=True``)."""


@dataclass(frozen=True)
class Kind:
    """What a status flag means: its bit, whether it fails the collective, and the error it
    raises then (with the text :meth:`Status.describe` gives it)."""

    name: str
    bit: int
    fatal: bool
    error: type[Exception]
    what: str  # "message from peer {peer} ... failed its checksum" etc.


#: The kinds of record, by name. Collaborators record into :class:`Status` by these names.
KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        Kind("checksum", 0, True, IntegrityError, "a message from rank {peer} failed its checksum"),
        Kind("bad_input", 1, True, ValueError, "bad input ({detail})"),
        Kind("device", 2, True, CollectiveStatusError, "a deferred device error ({detail})"),
        Kind("config", 3, True, CollectiveStatusError, "a configuration error ({detail})"),
        Kind("overflow", 4, False, CollectiveStatusError, "overflow ({detail})"),
        Kind("nonfinite", 5, False, CollectiveStatusError, "non-finite input"),
        Kind(
            "prologue",
            6,
            True,
            IntegrityError,
            "a message of the codec's prologue from rank {peer} failed its checksum (step "
            "{detail})",
        ),
        Kind(
            "header",
            7,
            True,
            IntegrityError,
            "the length header of a message from rank {peer} failed its check",
        ),
    ]
}
_BY_BIT = {k.bit: k for k in KINDS.values()}

#: The status record: flags, then the first fatal failure (round, rank, kind bit, peer,
#: chunk, sub-chunk, detail code); ``_NONE`` where nothing failed.
STATUS_WORDS = 8
_NONE = (1 << 62) - 1


class Status:
    """What one rank detected during a collective, merged across ranks by :meth:`exchange`.

    ``record(kind, ...)`` notes a failure or an event (see :data:`KINDS`); the first fatal
    record (lowest ``round``, then ``rank``) is kept, flags of every kind are ORed.
    ``detail`` is a small int a kind may define (e.g. an index into ``details``, a codec's
    code); ``details`` maps codes to text for the error message and must be the same on
    every rank (it is not exchanged).
    """

    def __init__(self, rank: int, details: Callable[[int], str] | None = None):
        self.rank = rank
        self.flags = 0
        self.first = [_NONE] * (STATUS_WORDS - 1)  # round, rank, bit, peer, chunk, sub, detail
        self.details = details or str
        self.rounds = 0  # of the last exchange
        self.bytes_sent = 0

    def record(
        self,
        kind: str,
        *,
        round_: int = -1,
        peer: int = -1,
        chunk: int = -1,
        sub: int = -1,
        detail: int = 0,
    ) -> None:
        k = KINDS[kind]
        self.flags |= 1 << k.bit
        if k.fatal:
            rec = [round_ + 1, self.rank, k.bit, peer, chunk, sub, detail]  # round -1 sorts first
            self.first = min(self.first, rec)

    def has(self, kind: str) -> bool:
        return bool(self.flags >> KINDS[kind].bit & 1)

    @property
    def failed(self) -> bool:
        return self.first[0] != _NONE

    def _merge(self, words: list[int]) -> None:
        self.flags |= words[0]
        self.first = min(self.first, words[1:])

    def exchange(self, transport: Transport, timeout: float, device: torch.device) -> None:
        """Merge every rank's status into this one (collective: every rank calls it at the
        same point); ``ceil(log2 n)`` rounds of one ``8 * STATUS_WORDS``-byte message."""
        r, n = transport.rank, transport.world_size
        shift, self.rounds, self.bytes_sent = 1, 0, 0
        while shift < n:
            out = torch.tensor([self.flags, *self.first], dtype=torch.int64, device=device)
            got = torch.empty(STATUS_WORDS, dtype=torch.int64, device=device)
            recv = transport.irecv(got, (r - shift) % n)
            send = transport.isend(out, (r + shift) % n)
            recv.wait(timeout)
            send.wait(timeout)
            self._merge([int(v) for v in got.cpu().tolist()])
            self.bytes_sent += 8 * STATUS_WORDS
            self.rounds += 1
            shift *= 2

    def describe(self) -> str:
        """The first failure, in words (the same on every rank after :meth:`exchange`)."""
        round_, rank, bit, peer, chunk, sub, detail = self.first
        k = _BY_BIT.get(bit)
        if k is None:
            return f"rank {rank}: unknown status record {self.first}"
        where = [f"round {round_ - 1}"] if round_ > 0 else []
        where += [f"chunk {chunk}"] if chunk >= 0 else []
        where += [f"sub-chunk {sub}"] if sub >= 0 else []
        text = k.what.format(peer=peer, detail=self.details(detail))
        return f"rank {rank}: {text}" + (f" ({', '.join(where)})" if where else "")

    def raise_for_error(self, collective: str = "", everywhere: bool = True) -> None:
        """Raise the first fatal failure's error (its kind's class), if there is one
        (``everywhere``: after :meth:`exchange`, every rank raises it; the error's
        ``everywhere`` attribute says so)."""
        if not self.failed:
            return
        k = _BY_BIT.get(self.first[2])
        error = k.error if k is not None else CollectiveStatusError
        prefix = f"{collective}: " if collective else ""
        if not everywhere:
            raise error(f"{prefix}{self.describe()}")
        err = error(f"{prefix}{self.describe()}; detected there, raised on every rank")
        err.everywhere = True  # type: ignore[attr-defined]  # (no rank to blame: all know)
        raise err
