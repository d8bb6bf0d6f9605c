"""What happens before a collective's first transfer: the ranks agree on its configuration,
then a codec's prologue runs (docs/collectives.md, "The engine").

**Agreement**, at every collective, before any message whose size depends on the
configuration. Each rank hashes its descriptor (a JSON object: wire version, codec config,
schedule digest, sizes, seed, step, ...) to a 32-byte SHA-256 digest; the ranks pass the
smallest and the largest digest they have seen (64 bytes) along a dissemination pattern: in
round ``i`` rank ``r`` sends to ``r + 2**i`` and receives from ``r - 2**i`` (mod ``n``), so
after ``ceil(log2 n)`` rounds every rank knows the smallest and largest digest of all ranks
(one message in and one out per round: no rank receives ``O(n)``). They agree iff the two
are equal. Otherwise (the slow path, on every rank at once) rank 0 gathers every rank's
descriptor and sends every rank the verdict, so :class:`ConfigMismatchError` is raised on
every rank, naming the fields and the ranks; each of those messages is an int64 length, then
that many bytes of UTF-8 JSON.

**Prologues.** A codec may define ``prologue(x, comm) -> dict | None``: a collective step it
needs before encoding (THC agrees on one scale per rotation block, OmniReduce on a global
threshold). ``x`` is the rank's whole buffer (its element ``i`` at global index ``i``);
``comm`` is a :class:`Communicator`; the returned dict reaches every encoding and decoding as
``HopContext.shared``. :func:`run_prologue` runs it with any communicator, so a custom
collective can run THC or OmniReduce exactly as the engine does; :class:`PrologueComm` is the
engine's communicator over a :class:`~dynamiq.collectives.transport.Transport`. Its messages
are always sealed (:func:`~dynamiq.collectives.integrity.seal_message`: a CRC-32 over the
bytes and the message's identity, in the tensor's own dtype), since what the prologue decides
(DynamiQ's budgets, so the payloads' sizes) must be the same on every rank: a message that
fails its check raises :class:`~dynamiq.collectives.integrity.IntegrityError` on its receiver
at once, or, given a ``status`` (the engine's, with ``verify``), is recorded there for the
engine's status exchange right after the prologue.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

import torch

from dynamiq.codecs import Codec

from .integrity import IntegrityError, Status, identity, message_extra, open_message, seal_message
from .transport import LocalCluster, Transport, Work, run_threads

__all__ = [
    "WIRE_VERSION",
    "Communicator",
    "ConfigMismatchError",
    "PrologueComm",
    "agree",
    "allreduce_exact",
    "allreduce_steps",
    "describe_difference",
    "local_prologues",
    "run_prologue",
]

#: Version of the engine's wire protocol (message order, headers); ranks must agree on it.
#: 2: sealed length headers; 3: sealed prologue messages, seals by zlib's CRC-32 everywhere
#: (dynamiq/collectives/integrity.py); 4: a prologue may re-cut the chunks
#: (planning.CHUNK_BOUNDS_KEY); 5: the prologue's exact all-reduce halves and doubles on
#: power-of-two worlds (:func:`allreduce_steps`)
WIRE_VERSION = 5

#: Largest handshake message accepted (bytes): anything larger is a malformed peer.
_MAX_BLOB = 1 << 24


class ConfigMismatchError(ValueError):
    """Ranks disagree on the collective's configuration (codec, schedule, sizes, version)."""


# -- prologues ----------------------------------------------------------------------------------


class Communicator(Protocol):
    """What a codec's ``prologue(x, comm)`` may use: this rank's place, and an all-gather.

    ``allgather(tensor)`` is collective: every rank calls it, in the same order, with a tensor
    of the same shape and dtype; it returns every rank's tensor, indexed by rank (this rank's
    own at ``rank``).
    """

    rank: int
    world_size: int

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


_OPS = ("max", "min", "sum")


def _combine(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return a + b
    return torch.maximum(a, b) if op == "max" else torch.minimum(a, b)


def allreduce_steps(
    n: int, length: int, rank: int
) -> list[tuple[int | None, tuple[int, int], int | None, tuple[int, int], bool]]:
    """The steps of :meth:`PrologueComm.allreduce` on ``rank`` of ``n`` for a tensor of
    ``length`` values: per step, the peer it sends to and the ``[a, b)`` values it sends, the
    peer it receives from and the values the message lands on (combined with them in the
    reduce-scatter half, ``reducing``; copied in the all-gather half); a peer is ``None``
    where its values are empty (nothing is sent, and the other end expects nothing).

    The tensor is cut into ``n`` pieces (piece ``i``: ``[length·i // n, length·(i+1) // n)``).
    A power-of-two ``n`` halves (reduce-scatter: the partner ``rank ^ m``, ``m = n/2 ... 1``,
    gets the half of this rank's range without ``rank``) then doubles (all-gather, ``m = 1
    ... n/2``): ``2 log2 n`` steps. Any other ``n`` runs a ring: ``2 (n - 1)`` steps to the
    next rank and from the previous. Both send ``2 (n - 1) / n`` of the tensor's bytes."""
    bounds = [length * i // n for i in range(n + 1)]

    def span(i: int, j: int) -> tuple[int, int]:
        return bounds[i], bounds[j]

    raw: list[tuple[int, tuple[int, int], int, tuple[int, int], bool]] = []
    if n & (n - 1) == 0:
        lo, hi, m = 0, n, n >> 1
        while m:  # reduce-scatter: keep the half holding piece `rank`
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if rank & m else ((lo, mid), (mid, hi))
            raw.append((rank ^ m, span(*give), rank ^ m, span(*keep), True))
            (lo, hi), m = keep, m >> 1
        m = 1
        while m < n:  # all-gather: this rank's block of m pieces for the partner's
            mine, theirs = rank // m * m, (rank ^ m) // m * m
            raw.append((rank ^ m, span(mine, mine + m), rank ^ m, span(theirs, theirs + m), False))
            m <<= 1
    else:
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        for step in range(2 * (n - 1)):
            reducing = step < n - 1
            s = step if reducing else step - (n - 1)
            send = (rank - s) % n if reducing else (rank + 1 - s) % n
            into = (rank - s - 1) % n if reducing else (rank - s) % n
            raw.append((nxt, span(send, send + 1), prv, span(into, into + 1), reducing))
    return [
        (to if b > a else None, (a, b), frm if d > c else None, (c, d), red)
        for to, (a, b), frm, (c, d), red in raw
    ]


def allreduce_exact(comm: Any, tensor: torch.Tensor, op: str) -> torch.Tensor:
    """The element-wise ``op`` (``"max"``, ``"min"`` or ``"sum"``) of every rank's integer
    ``tensor``: the communicator's own ``allreduce(tensor, op)`` when it has one (the
    engine's :class:`PrologueComm`: a ring, ``2 (n - 1) / n`` times the tensor's bytes per
    rank), else its all-gather, reduced here. Exact (integers), so every rank gets the same."""
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise TypeError(f"allreduce_exact takes an integer tensor (got {tensor.dtype})")
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS} (got {op!r})")
    own = getattr(comm, "allreduce", None)
    if callable(own):
        return own(tensor, op)
    parts = comm.allgather(tensor)
    out = parts[0].clone()
    for p in parts[1:]:
        out = _combine(out, p, op)
    return out


def run_prologue(codec: Codec, x: torch.Tensor, comm: Communicator) -> dict[str, Any] | None:
    """Run ``codec``'s prologue on this rank's whole buffer ``x`` with ``comm``; return what
    every encoding needs as ``HopContext.shared`` (``None`` when the codec has no prologue).

    Collective: every rank calls it with the same codec and a buffer of the same size, before
    any encoding; the result is the same on every rank."""
    prologue = getattr(codec, "prologue", None)  # optional part of the codec contract
    if not callable(prologue):
        return None
    shared = prologue(x, comm)
    if shared is not None and not isinstance(shared, dict):
        raise TypeError(
            f"{type(codec).__name__}.prologue returned {type(shared).__name__}, not a dict or None"
        )
    return shared


def local_prologues(
    codec: Codec,
    xs: list[torch.Tensor],
    chunks: list[tuple[int, int]] | None = None,
    timeout: float = 300.0,
    recut_align: int | None = None,
) -> tuple[list[dict[str, Any] | None], list[PrologueComm]]:
    """Run ``codec``'s prologue on in-process ranks (threads over a
    :class:`~dynamiq.collectives.transport.LocalCluster`), rank ``r`` on ``xs[r]``, with the
    collective's ``chunks`` (``PrologueComm.chunks``): every rank's ``HopContext.shared``, and
    the communicators (their byte counts)."""
    n = len(xs)
    cluster = LocalCluster(n)
    comms = [PrologueComm(cluster.transport(r), timeout) for r in range(n)]
    for comm in comms:
        comm.chunks = None if chunks is None else list(chunks)
        comm.recut_align = recut_align
    shared = run_threads(
        n, lambda r: run_prologue(codec, xs[r], comms[r]), on_error=cluster.aborted.set
    )
    return shared, comms


class PrologueComm:
    """A :class:`Communicator` over a :class:`~dynamiq.collectives.transport.Transport`:
    the all-gather is a send to and a receive from every other rank, the exact all-reduce a
    ring; their bytes are counted in ``bytes_sent`` and ``bytes_received`` (the checks that
    seal every message in ``check_bytes_sent``). Every wait on a peer is bounded by
    ``timeout``. ``chunks``: the engine's chunk bounds, set before the prologue runs
    (``None`` outside the engine). ``status``: where a message that fails its check is
    recorded (the receiver goes on with its own tensor in its place); without one, it
    raises :class:`~dynamiq.collectives.integrity.IntegrityError` at once. ``steps``: the
    exchanges so far (each message's identity holds its step)."""

    def __init__(self, transport: Transport, timeout: float, status: Status | None = None):
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.timeout = timeout
        self.status = status
        self.bytes_sent = 0
        self.bytes_received = 0
        self.check_bytes_sent = 0
        self.steps = 0
        #: the collective's chunks (``[start, end)`` each), for a prologue that pools per chunk
        self.chunks: list[tuple[int, int]] | None = None
        #: set by the engine when the prologue may choose the chunk bounds (multiples of this
        #: many values; ``planning.CHUNK_BOUNDS_KEY``); ``None``: keep ``chunks``
        self.recut_align: int | None = None

    def _ident(self, src: int, dst: int) -> bytes:
        # round -1: no payload round has it; the step tells the prologue's messages apart
        return identity(getattr(self.transport, "seq", 0), -1, -1, self.steps, src, dst)

    def _swap(
        self, out: dict[int, torch.Tensor], into: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """One step: send ``out[dst]`` to each ``dst``, receive a tensor shaped like
        ``into[src]`` from each ``src`` (sealed, checked); returns them (1-D) by sender."""
        wires = {
            src: torch.empty(t.numel() + message_extra(t), dtype=t.dtype, device=t.device)
            for src, t in into.items()
        }
        works = [self.transport.irecv(w, src) for src, w in wires.items()]
        for dst, t in out.items():
            sealed = seal_message(self._ident(self.rank, dst), t)
            works.append(self.transport.isend(sealed, dst))
            self.bytes_sent += t.numel() * t.element_size()
            self.check_bytes_sent += (sealed.numel() - t.numel()) * t.element_size()
        for w in works:
            w.wait(self.timeout)
        got = {}
        for src, wire in wires.items():
            body = open_message(self._ident(src, self.rank), wire)
            if body is None:
                if self.status is None:
                    raise IntegrityError(
                        f"rank {self.rank}: a message of the codec's prologue from peer {src} "
                        f"failed its checksum (step {self.steps}): corrupted or misrouted"
                    )
                self.status.record("prologue", peer=src, detail=self.steps)
                body = into[src].detach().reshape(-1)  # a stand-in: every rank raises later
            got[src] = body
            self.bytes_received += body.numel() * body.element_size()
        self.steps += 1
        return got

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype everywhere), indexed by rank."""
        t = tensor.detach().contiguous()
        others = [r for r in range(self.world_size) if r != self.rank]
        got = self._swap({r: t for r in others}, {r: t for r in others})
        return [t if r == self.rank else got[r].view(t.shape) for r in range(self.world_size)]

    def allreduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The element-wise ``op`` of every rank's integer ``tensor`` (same shape and dtype
        everywhere): a reduce-scatter, then an all-gather, by halving and doubling on a
        power-of-two world, else by a ring (:func:`allreduce_steps`), ``2 (n - 1) / n`` times
        the tensor's bytes in all (use :func:`allreduce_exact`, which checks the arguments)."""
        out = tensor.detach().reshape(-1).clone()
        if self.world_size == 1 or out.numel() == 0:
            return out.view(tensor.shape)
        for to, (a, b), frm, (c, d), reducing in allreduce_steps(
            self.world_size, out.numel(), self.rank
        ):
            dst = out[c:d]
            got = self._swap(
                {to: out[a:b]} if to is not None else {}, {frm: dst} if frm is not None else {}
            )
            if frm is not None:
                dst.copy_(_combine(dst, got[frm], op) if reducing else got[frm])
        return out.view(tensor.shape)


# -- agreement ----------------------------------------------------------------------------------


def _send_blob(transport: Transport, blob: bytes, dst: int, device: torch.device) -> list[Work]:
    data = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if blob
        else torch.empty(0, dtype=torch.uint8)
    )
    return [
        transport.isend(torch.tensor([len(blob)], dtype=torch.int64, device=device), dst),
        transport.isend(data.to(device), dst),
    ]


def _recv_blob(transport: Transport, src: int, timeout: float, device: torch.device) -> bytes:
    hdr = torch.empty(1, dtype=torch.int64, device=device)
    transport.irecv(hdr, src).wait(timeout)
    size = int(hdr[0])
    if not 0 <= size <= _MAX_BLOB:
        raise ConfigMismatchError(f"rank {transport.rank}: malformed handshake from {src}")
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    transport.irecv(buf, src).wait(timeout)
    return bytes(buf.cpu().numpy().tobytes())


def describe_difference(a: dict[str, Any], b: dict[str, Any], ra: int, rb: int) -> str:
    """Name the first keys on which two descriptors differ."""
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    parts = [f"{k}: rank {ra} has {a.get(k)!r}, rank {rb} has {b.get(k)!r}" for k in keys[:3]]
    return "; ".join(parts)


def _verdict(transport: Transport, mine: bytes, timeout: float, device: torch.device) -> str:
    """Rank 0: compare every rank's descriptor with its own; ``""`` when all agree."""
    problems = []
    for src in range(1, transport.world_size):
        theirs = json.loads(_recv_blob(transport, src, timeout, device))
        if theirs != json.loads(mine):
            problems.append(describe_difference(json.loads(mine), theirs, 0, src))
    if not problems:
        return ""
    return "ranks disagree on the collective's configuration: " + " | ".join(problems)


def _disseminate(
    transport: Transport, digest: bytes, timeout: float, device: torch.device
) -> tuple[bytes, bytes, int]:
    """The smallest and largest digest over all ranks (and the bytes this rank sent)."""
    r, n = transport.rank, transport.world_size
    lo = hi = digest
    sent, shift = 0, 1
    while shift < n:
        out = torch.frombuffer(bytearray(lo + hi), dtype=torch.uint8).to(device)
        got = torch.empty(2 * len(digest), dtype=torch.uint8, device=device)
        recv = transport.irecv(got, (r - shift) % n)
        send = transport.isend(out, (r + shift) % n)
        recv.wait(timeout)
        send.wait(timeout)
        theirs = bytes(got.cpu().numpy().tobytes())
        lo, hi = min(lo, theirs[: len(digest)]), max(hi, theirs[len(digest) :])
        sent += out.numel()
        shift *= 2
    return lo, hi, sent


def agree(
    transport: Transport,
    desc: dict[str, Any],
    timeout: float,
    device: torch.device | str = "cpu",
) -> int:
    """Check that every rank has the same descriptor; raise on every rank if not.

    A fixed-size digest exchange (``ceil(log2 n)`` rounds of 64 bytes) decides; only on a
    mismatch does rank 0 gather the descriptors, to name the fields. The messages live on
    ``device`` (the data's: NCCL moves CUDA tensors only). Returns bytes sent.
    """
    device = torch.device(device)
    r, n = transport.rank, transport.world_size
    if n == 1:
        return 0
    mine = json.dumps(desc, sort_keys=True, default=str).encode()
    lo, hi, sent = _disseminate(transport, hashlib.sha256(mine).digest(), timeout, device)
    if lo == hi:
        return sent
    if r != 0:  # send mine to rank 0, get its verdict
        works = _send_blob(transport, mine, 0, device)
        sent += 8 + len(mine)
        verdict = _recv_blob(transport, 0, timeout, device).decode()
    else:  # compare everybody's with mine, send the verdict to all
        verdict = _verdict(transport, mine, timeout, device)
        works = []
        for dst in range(1, n):
            works += _send_blob(transport, verdict.encode(), dst, device)
            sent += 8 + len(verdict)
    for w in works:
        w.wait(timeout)
    raise ConfigMismatchError(
        verdict or "ranks disagree on the collective's configuration (their digests differ)"
    )
