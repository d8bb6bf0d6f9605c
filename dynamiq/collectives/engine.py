"""The engine: executes any schedule with any codec over any transport (docs/collectives.md,
"The engine").

Each rank holds, per chunk, either a *raw* fp32 value (its gradient, or an exact fp32 sum of
decoded partial sums and its gradient) or an *encoded* one (payload bytes with the codec and
:class:`~dynamiq.codecs.HopContext` that made them). Per round of the schedule
(:meth:`ScheduleRun.run_round`):

1. post the receives (:meth:`ScheduleRun.post_receives`);
2. send: forward the encoded bytes of a chunk as they are, or encode its raw value
   (:meth:`ScheduleRun.issue_sends`);
3. process each received sub-chunk as it arrives, while later ones are still in flight
   (:meth:`ScheduleRun.process_arrival`): ``copy`` keeps the bytes; ``reduce`` adds the local
   value, and either recompresses at once with the codec's fused ``reduce`` (when this rank's
   next use of the chunk is to send it) or keeps the exact fp32 sum (when the next use is
   another reduction: no needless rounding);

and at the end every chunk still encoded is decoded (:meth:`ScheduleRun.finish`).

On the CPU (gloo, the in-process transport) rounds overlap: a round's receives are posted
one round ahead, a piece the next round sends goes out as soon as this round has finished it,
and finished chunks are decoded while later data is in flight; messages keep the lock-step
order and values, so the bytes are the same (payloads of data-dependent size keep rounds in
lock-step; on CUDA the rounds stay in lock-step).

The rank that completes a chunk's sum always sends it on in the all-gather, so it encodes it
once and everybody, the owner included, decodes those very bytes: **every rank ends
bit-identical**. Which encoding is which hop is planned from the schedule alone, identically on
every rank (:mod:`dynamiq.collectives.planning`), so receivers know each payload's
``HopContext`` (``hop``, ``num_hops``, ``contributions``, the encoding ``rank``, the global
``offset``) without metadata on the wire.

Chunks are cut on multiples of the codecs' block sizes, aligned to global offsets, and split
into sub-chunks of ``sub_chunk`` elements (also block multiples): nothing a codec decides
depends on the cut, so the result is the same for any sub-chunk size.

Two optional collaborators: certified bounds (``return_bound=True``, :class:`_Bounds`, composed
with :mod:`dynamiq.collectives.bounds`) and error feedback (a ``residual``,
:class:`_ErrorFeedback`). The handshake and prologues are :mod:`dynamiq.collectives.handshake`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dynamiq.codecs import Codec, HopContext

from .bounds import (
    addition_bound,
    encoding_bound,
    group_size,
    num_groups,
    pack_bound,
    unpack_bound,
)
from .failures import Failure, first_failure, post_failure
from .handshake import (
    WIRE_VERSION,
    ConfigMismatchError,
    PrologueComm,
    agree,
    describe_difference,
    run_prologue,
)
from .integrity import (
    ALGORITHM,
    CHECKSUM_BYTES,
    IntegrityError,
    Status,
    checksum,
    identity,
    open_length,
    pack_checksum,
    seal_length,
    unpack_checksum,
)
from .planning import (
    RecvOp,
    RoundPlan,
    SendOp,
    chunk_bounds,
    chunk_layout,
    layout_align,
    plan_schedule,
    prologue_bounds,
)
from .schedules import Schedule
from .transport import PeerTimeoutError, Transport, TransportError, Work, open_collective

__all__ = [
    "WIRE_VERSION",
    "ConfigMismatchError",
    "EngineResult",
    "PrologueComm",
    "RunConfig",
    "ScheduleRun",
    "agree",
    "chunk_bounds",
    "chunk_layout",
    "describe_difference",
    "plan_schedule",
    "run_schedule",
]

#: A payload of data-dependent size may hold at most this many bytes per value, plus
#: ``_LENGTH_SLACK`` (a length header above it is a malformed peer, not an allocation).
_LENGTH_PER_VALUE = 16
_LENGTH_SLACK = 1024


@dataclass
class EngineResult:
    """What one rank's run produced and measured.

    ``bytes_sent`` counts payloads, their length headers, their checksums (``verify``) and
    the prologue's exchange; ``control_bytes_sent`` the configuration check, the status
    exchange(s) and the checks sealing the prologue's messages;
    ``round_bytes[k]`` the payload and header bytes this rank sent in round ``k`` of the run
    (0 when it sent nothing), so ``sum(round_bytes)`` is ``bytes_sent`` less the prologue.
    """

    output: torch.Tensor  # fp32, the all-reduced buffer
    bound: torch.Tensor | None  # fp64 per element, when asked
    bytes_sent: int = 0
    bytes_received: int = 0
    bound_bytes_sent: int = 0
    control_bytes_sent: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    round_bytes: list[int] = field(default_factory=list)
    status: Status | None = None  # the merged status (when the exchange ran)


@dataclass(frozen=True)
class RunConfig:
    """How :class:`ScheduleRun` runs (every field has the meaning of the keyword of
    :func:`run_schedule` of the same name).

    ``overlap``: let rounds overlap (receives posted a round ahead, the next round's sends
    to the same peer started as their inputs are final); ``None``: on the CPU only. Either
    way the same messages go out in the same order with the same bytes.
    """

    seed: int = 0
    step: int = 0
    sub_chunk: int = 1 << 18
    return_bound: bool = False
    timeout: float = 300.0
    base_offset: int = 0
    descriptor: dict[str, Any] | None = None
    rounds: tuple[int, int] | None = None
    outputs: Sequence[int] | None = None
    inplace: bool = False
    overlap: bool | None = None
    chunk_bounds: Sequence[tuple[int, int]] | None = None  # one [start, end) per chunk
    verify: bool = False
    status: bool | None = None  # the end-of-collective status exchange; None: as ``verify``


# -- per-chunk state, incoming and outgoing pieces ---------------------------------------------


@dataclass
class _State:
    """A chunk on this rank: raw (its values are in the work buffer) or encoded (one payload
    and bound per sub-chunk, with the codec and context that made them)."""

    encoded: bool = False
    codec: Codec | None = None
    ctx: HopContext | None = None
    payloads: list[torch.Tensor] = field(default_factory=list)
    bounds: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class _Incoming:
    """A sub-chunk ``j`` (``[a, b)``) to receive: its buffers and transfers, once posted
    (``buf is None``: data-dependent size, posted after its length header)."""

    op: RecvOp
    j: int
    a: int
    b: int
    buf: torch.Tensor | None = None
    work: Work | None = None
    bound_buf: torch.Tensor | None = None
    bound_work: Work | None = None
    size: int = 0  # the payload's bytes (``buf`` holds its checksum too, with ``verify``)


@dataclass
class _Sends:
    """A round's sends, issued in schedule order: item ``i`` is ``(send op, sub-chunk)``,
    ``deps[i]`` the index in the previous round's receives of the piece it needs finished
    (-1: none); ``pos`` the next item to send; ``new`` the state each sent chunk will have."""

    k: int
    items: list[tuple[SendOp, int]]
    deps: list[int]
    pos: int = 0
    new: dict[int, _State] = field(default_factory=dict)
    pending: list[Work] = field(default_factory=list)


@dataclass
class _Deferred:
    """A finished sub-chunk to decode into the work buffer (before round ``k + 1``'s waits)."""

    k: int
    codec: Codec
    ctx: HopContext
    payload: torch.Tensor
    a: int
    b: int


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - t0
        return now


# -- the optional collaborators ----------------------------------------------------------------


class _Bounds:
    """The certified bound of every raw value (``beta``, fp64 per element) and the wire side
    of bounds: the buffers a packed bound is received into, and what a sent one becomes."""

    def __init__(self, numel: int, device: torch.device):
        self.beta = torch.zeros(numel, dtype=torch.float64, device=device)
        self.device = device

    def receive_buffer(self, codec: Codec, numel: int) -> torch.Tensor:
        return torch.empty(num_groups(numel, codec), dtype=torch.float64, device=self.device)

    @staticmethod
    def unpack(packed: torch.Tensor, codec: Codec, numel: int) -> torch.Tensor:
        return unpack_bound(packed, numel, group_size(codec))

    @staticmethod
    def pack(bound: torch.Tensor, codec: Codec) -> torch.Tensor:
        return pack_bound(bound, group_size(codec))


class _ErrorFeedback:
    """Accumulates ``v - decode(encode(v))`` of every value this rank encodes, at its
    positions (fp32, the buffer's size)."""

    def __init__(self, residual: torch.Tensor):
        self.residual = residual

    def record(
        self, a: int, v: torch.Tensor, codec: Codec, payload: torch.Tensor, ctx: HopContext
    ) -> None:
        b = a + v.numel()
        self.residual[a:b] += v - codec.decode(payload, b - a, ctx)


# -- the run -----------------------------------------------------------------------------------


class ScheduleRun:
    """One rank's run of a schedule: construct, then :meth:`run` (once).

    Constructing it opens the collective's channel on ``transport``
    (:func:`~dynamiq.collectives.transport.open_collective`): construct runs in the same
    order on every rank (the order they are issued in), and run each one constructed.

    ``plan`` (every rank's :func:`~dynamiq.collectives.planning.plan_schedule`) may be given
    to share one among simulated ranks; ``residual`` turns error feedback on (see
    :func:`run_schedule`).
    """

    def __init__(
        self,
        transport: Transport,
        x: torch.Tensor,
        codec: Codec,
        schedule: Schedule,
        config: RunConfig | None = None,
        *,
        plan: list[list[RoundPlan]] | None = None,
        residual: torch.Tensor | None = None,
    ):
        n = transport.world_size
        if schedule.world_size != n:
            raise ValueError(f"schedule is for {schedule.world_size} ranks, transport has {n}")
        self.transport = open_collective(transport)
        self.x = x
        self.codec = codec
        self.schedule = schedule
        self.config = config or RunConfig()
        self.rank = transport.rank
        self.timer = _Timer()
        self.result = EngineResult(output=torch.empty(0), bound=None)
        self.feedback = _ErrorFeedback(residual) if residual is not None else None
        self.bounds = _Bounds(x.numel(), x.device) if self.config.return_bound else None
        self.verify = self.config.verify
        self.status = Status(self.rank)
        st = self.config.status
        self.exchange_status = self.verify if st is None else st
        self.shared: dict[str, Any] | None = None
        self.recut: list[tuple[int, int]] | None = None  # chunk bounds the prologue chose
        self._given_plan = plan
        overlap = self.config.overlap
        self.overlap = x.device.type == "cpu" if overlap is None else overlap
        # filled in by :meth:`prepare`
        self.plan: list[RoundPlan] = []
        self.pieces: list[list[tuple[int, int]]] = []
        self.work = torch.empty(0)
        self._source: torch.Tensor | None = None  # x, where ``work`` is not x itself
        self._written: set[tuple[int, int]] = set()  # the pieces of ``work`` written (if so)
        self.state: list[_State] = []
        self.last_recv: dict[int, int] = {}
        self.deferred: list[_Deferred] = []
        self.decoded: set[tuple[int, int]] = set()
        self.posted: dict[int, list[_Incoming]] = {}
        self.early: _Sends | None = None  # a round's sends, started during the previous one
        self._round = 0  # the round running (for errors)
        self._phase = 0  # an index into failures.PHASES (for errors)
        # per-piece contexts and per-round size kinds, built once (the hot path asks for the
        # same ones several times a piece); keyed by the planned context's identity (the plan
        # keeps every planned context alive for the run)
        self._ctxs: dict[tuple[int, int], HopContext] = {}
        self._nbytes: dict[tuple[int, int, int, int], int | None] = {}
        self._fixed: dict[int, bool] = {}

    # -- the steps -------------------------------------------------------------------------

    def run(self) -> EngineResult:
        """Agree, run the prologue, every round, and decode: the rank's result."""
        self.transport.start()  # its turn (at once, unless the transport serialises)
        try:
            t0 = time.perf_counter()
            self.agree_on_config()
            t0 = self.timer.add("agree", t0)
            self._phase = 1
            if self.run_codec_prologue():
                self.timer.add("prologue", t0)
            self._phase = 2
            self.prepare()
            for k in range(len(self.plan)):
                self._round = k
                self.run_round(k)
            return self.finish()
        except TransportError as exc:  # a transfer could not start: say where
            if " (round " in str(exc):
                raise self._blame(exc) from exc.__cause__
            where = TransportError(str(exc) + self._where(self._round), exc.peer)
            raise self._blame(where) from exc
        except Exception as exc:
            better = self._blame(exc)
            if better is exc:
                raise
            raise better from exc
        finally:
            self.transport.end()

    def _blame(self, exc: Exception) -> Exception:
        """Post this rank's failure on the transport's board (dynamiq/collectives/failures.py)
        and, for a failed wait or transfer, add the earliest failure of any rank to its text
        (the rank that failed first, where the board knows it). Errors every rank raises
        alike (the status exchange's, a configuration mismatch) are left as they are."""
        board = getattr(self.transport, "board", None)
        if (
            board is None
            or getattr(exc, "everywhere", False)
            or isinstance(exc, ConfigMismatchError)
        ):
            return exc
        peer = getattr(exc, "peer", None)
        suspect = self.rank if not isinstance(exc, (PeerTimeoutError, TransportError)) else peer
        text = f"{type(exc).__name__}: {str(exc).split(' (')[0]}"[:200]
        seq, n = self.transport.seq, self.transport.world_size
        if suspect is not None:
            post_failure(
                board, seq, Failure(self.rank, suspect, self._phase, self._round, time.time(), text)
            )
        if suspect == self.rank:
            return exc
        first = first_failure(board, seq, n)
        if first is None or first.rank == self.rank:
            return exc  # this rank's own failure is the earliest: its text says it all
        return type(exc)(f"{exc}; {first.describe()}", peer)

    def agree_on_config(self) -> None:
        """Check that every rank runs the same configuration (raises on every rank if not)."""
        cfg = self.config
        desc = {
            "wire_version": WIRE_VERSION,
            "codec": self.codec.get_config(),
            "schedule": self.schedule.describe(),
            "numel": self.x.numel(),
            "seed": cfg.seed,
            "sub_chunk": cfg.sub_chunk,
            "return_bound": cfg.return_bound,
            "step": cfg.step,
            "verify": ALGORITHM if self.verify else False,
            "status": self.exchange_status,
            **(cfg.descriptor or {}),
        }
        self.result.control_bytes_sent += agree(self.transport, desc, cfg.timeout, self.x.device)

    def run_codec_prologue(self) -> bool:
        """Run the codec's prologue, if it has one; its result reaches every encoding.

        Its messages are always sealed (:class:`PrologueComm`). With the status exchange
        (``verify``), a message that fails its check is recorded, and when the prologue sent
        anything the ranks exchange their status right after it: a failure raises the same
        :class:`IntegrityError` on every rank, before any payload (whose sizes may depend on
        the prologue's result); without, the receiver raises at once."""
        if not callable(getattr(self.codec, "prologue", None)):
            return False
        cfg = self.config
        status = self.status if self.exchange_status else None
        comm = PrologueComm(self.transport, cfg.timeout, status)
        comm.chunks, _ = chunk_layout(
            self.x.numel(), self.schedule, self.codec, cfg.sub_chunk, cfg.chunk_bounds
        )
        if cfg.chunk_bounds is None and cfg.outputs is None and cfg.rounds is None:
            comm.recut_align = layout_align(self.schedule, self.codec)  # a whole all-reduce
        try:
            self.shared = run_prologue(self.codec, self.x, comm)
        except Exception:
            if not self.status.failed:  # (a stand-in may upset the codec: the status says why)
                raise
        self.result.bytes_sent += comm.bytes_sent
        self.result.bytes_received += comm.bytes_received
        self.result.control_bytes_sent += comm.check_bytes_sent
        if status is not None and comm.steps:
            self._exchange_status()
        if comm.recut_align is not None:  # after the status: never from a failed prologue
            self.recut = prologue_bounds(self.shared, self.x.numel(), self.schedule, self.codec)
        return True

    def _exchange_status(self) -> None:
        """Merge every rank's status (collective) and raise its first failure, if any."""
        self._phase = 3 if self._phase == 2 else self._phase
        t = time.perf_counter()
        self.status.exchange(self.transport, self.config.timeout, self.x.device)
        self.timer.add("status", t)
        self.result.control_bytes_sent += self.status.bytes_sent
        self.result.status = self.status
        self.status.raise_for_error(f"{self.schedule.name} collective {self.transport.seq}")

    def prepare(self) -> None:
        """Plan, cut the buffer, and set up the working buffer and chunk states."""
        cfg, x = self.config, self.x
        plan = self._given_plan or plan_schedule(
            self.schedule, self.codec, seed=cfg.seed, step=cfg.step, rounds=cfg.rounds
        )
        self.plan = plan[self.rank]
        given = cfg.chunk_bounds if cfg.chunk_bounds is not None else self.recut
        _, self.pieces = chunk_layout(x.numel(), self.schedule, self.codec, cfg.sub_chunk, given)
        # raw values (fp32), updated in place; else a buffer written piece by piece as the
        # run produces values, a piece not yet written read from ``x`` (no copy up front: a
        # reduce-scatter writes only the chunks it keeps)
        if cfg.inplace and x.dtype == torch.float32 and x.is_contiguous():
            self.work = x.detach()
        else:
            self.work = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
            self._source = x.detach().reshape(-1)
        self.state = [_State() for _ in range(self.schedule.num_chunks)]
        # A chunk whose last receive on this rank has happened holds its final bytes: decode
        # its sub-chunks in the next rounds, one before each wait for a peer's data (the link
        # is busy, the CPU would idle), instead of all after the last round; not in the round
        # that produced them, whose end the next round's sends wait for. Same bytes, same
        # decode: same result. (Bounds are set at the end: a send may still replace a
        # payload's bound by the packed one its receiver gets.)
        for k, rnd in enumerate(self.plan):
            for op in rnd.recvs:
                self.last_recv[op.chunk] = k
        self.result.round_bytes = [0] * len(self.plan)

    def run_round(self, k: int) -> None:
        """Round ``k``: receives posted, sends issued, arrivals processed as they come.

        With ``overlap``, the next round's receives are posted one round ahead and, where
        it goes to the same peer (:meth:`_send_ahead`), a piece the next round sends goes
        out as soon as this round has finished it (gloo moves
        nothing until the receive is posted, and a round's last piece would otherwise hold
        up its first). Every message still goes out in the order of the lock-step schedule,
        computed from the same values. Payloads of data-dependent size keep rounds in
        lock-step (their lengths are read one by one)."""
        # 1. post receives (unless posted a round ahead), and the next round's
        incoming = self.posted.pop(k) if k in self.posted else self.post_receives(k)
        ahead = self.overlap and k + 1 < len(self.plan)
        if ahead and self._fixed_size(k) and self._fixed_size(k + 1):
            self.posted[k + 1] = self.post_receives(k + 1)
        # 2. sends: the rest of them, then this round's states of what was sent
        sends = self.early or self._plan_sends(k, [])
        self.issue_sends(sends, 1 << 62, {})  # everything left: its inputs are all final now
        for sop in self.plan[k].sends:
            self.state[sop.chunk] = sends.new[sop.chunk]
        nxt = self._plan_sends(k + 1, incoming) if self._send_ahead(k) else None
        # 3. receive and process, sub-chunk by sub-chunk; start the next round's sends
        fresh: dict[int, _State] = {}
        if nxt is not None:
            self.issue_sends(nxt, -1, fresh)
        for i, inc in enumerate(incoming):
            if self.deferred:
                self._decode_deferred(1, before_round=k)
            self.process_arrival(k, inc, fresh)
            if nxt is not None:
                self.issue_sends(nxt, i, fresh)
        for ch, st in fresh.items():
            self.state[ch] = st
        self.early = nxt
        t = time.perf_counter()
        for w in sends.pending:
            self._wait(w, k)
        self.timer.add("wait", t)

    def finish(self) -> EngineResult:
        """Decode what is still encoded (the owner decodes its own bytes too); set bounds."""
        self._decode_deferred(len(self.deferred), before_round=len(self.plan))
        t = time.perf_counter()
        for ch, s in enumerate(self.state):
            if not self._wanted(ch):
                continue
            if not s.encoded:
                for a, b in self.pieces[ch]:
                    if self._source is not None and (a, b) not in self._written:
                        self._write(a, b, self._raw(a, b))  # held raw all along (one rank)
                continue
            assert s.codec is not None and s.ctx is not None
            for j, (a, b) in enumerate(self.pieces[ch]):
                if (ch, j) not in self.decoded:
                    self._write(a, b, s.codec.decode(s.payloads[j], b - a, self._ctx(s.ctx, a)))
                if self.bounds is not None:
                    bj = s.bounds[j]
                    assert bj is not None
                    self.bounds.beta[a:b] = bj
        self.timer.add("decode", t)
        res = self.result
        if self.exchange_status:
            self._exchange_status()
        # (without the exchange, ``status=False``, what this rank found is raised here only)
        name = f"{self.schedule.name} collective {self.transport.seq}"
        self.status.raise_for_error(name, everywhere=False)
        res.output = self.work
        res.bound = self.bounds.beta if self.bounds is not None else None
        res.seconds = self.timer.seconds
        res.seconds["total"] = sum(self.timer.seconds.values())
        return res

    # -- receiving -------------------------------------------------------------------------

    def post_receives(self, k: int) -> list[_Incoming]:
        """Round ``k``'s receives: fixed-size payloads are posted at once (matched in order);
        data-dependent ones one by one when processed, each after its length header."""
        rnd = self.plan[k]
        incoming: list[_Incoming] = []
        for op in rnd.recvs:
            assert rnd.recv_from is not None
            for j, (a, b) in enumerate(self.pieces[op.chunk]):
                inc = _Incoming(op, j, a, b)
                size = self._size(op.codec, op.ctx, a, b)
                if size is not None:
                    self._post(inc, rnd.recv_from, size)
                incoming.append(inc)
        return incoming

    def _post(self, inc: _Incoming, src: int, size: int) -> None:
        inc.size = size
        extra = CHECKSUM_BYTES if self.verify else 0
        inc.buf = torch.empty(size + extra, dtype=torch.uint8, device=self.x.device)
        inc.work = self.transport.irecv(inc.buf, src)
        if self.bounds is not None:
            inc.bound_buf = self.bounds.receive_buffer(inc.op.codec, inc.b - inc.a)
            inc.bound_work = self.transport.irecv(inc.bound_buf, src)

    def _receive(self, k: int, inc: _Incoming) -> torch.Tensor:
        """Wait for ``inc``'s payload (and bound); a data-dependent one reads its length
        first."""
        src = self.plan[k].recv_from
        assert src is not None
        if inc.buf is None:  # data-dependent size: the length comes first
            hdr = torch.empty(1, dtype=torch.int64, device=self.x.device)
            self._wait(self.transport.irecv(hdr, src), k)
            opened = open_length(self._ident(k, inc.op.chunk, inc.j, src, self.rank), int(hdr[0]))
            if opened is None:
                return self._drain(k, inc, src)
            size = opened
            valid = getattr(inc.op.codec, "valid_nbytes", None)  # optional codec check
            if not 0 <= size <= _LENGTH_PER_VALUE * (inc.b - inc.a) + _LENGTH_SLACK or (
                valid is not None and not valid(inc.b - inc.a, size)
            ):
                raise ValueError(
                    f"rank {self.rank}: bad payload length {size} from peer {src}{self._where(k)}"
                )
            self._post(inc, src, size)
            self.result.bytes_received += 8
        assert inc.buf is not None and inc.work is not None
        self._wait(inc.work, k)
        if inc.bound_work is not None:
            self._wait(inc.bound_work, k)
        if self.verify:  # the payload's last bytes are its checksum
            payload, got = inc.buf[: inc.size], unpack_checksum(inc.buf[inc.size :])
            inc.buf = payload
            self.result.bytes_received += CHECKSUM_BYTES
            ident = self._ident(k, inc.op.chunk, inc.j, src, self.rank)
            if got != checksum(ident, payload, inc.bound_buf):
                self._replace_corrupt(k, inc, src)
        return inc.buf

    def _drain(self, k: int, inc: _Incoming, src: int) -> torch.Tensor:
        """A length header failed its seal: the payload's size is unknown. With the status
        exchange, on a transport that takes a message shorter than its buffer (gloo), record
        it, receive the payload into a buffer of the largest valid size (and its bound), and
        go on with a stand-in: every rank raises at the end. Else raise here at once."""
        bad = IntegrityError(
            f"rank {self.rank}: the length header from peer {src} (chunk {inc.op.chunk}, "
            f"sub-chunk {inc.j}) failed its check{self._where(k)}"
        )
        if not (self.exchange_status and getattr(self.transport, "can_drain", False)):
            raise bad  # the size of the payload to receive is unknown: this rank cannot go on
        self.status.record("header", round_=k, peer=src, chunk=inc.op.chunk, sub=inc.j)
        cap = _LENGTH_PER_VALUE * (inc.b - inc.a) + _LENGTH_SLACK + CHECKSUM_BYTES
        sink = torch.empty(cap, dtype=torch.uint8, device=self.x.device)
        self._wait(self.transport.irecv_upto(sink, src), k)
        if self.bounds is not None:
            inc.bound_buf = self.bounds.receive_buffer(inc.op.codec, inc.b - inc.a)
            self._wait(self.transport.irecv(inc.bound_buf, src), k)
        self.result.bytes_received += 8
        self._replace_corrupt(k, inc, src, record=False)
        assert inc.buf is not None
        return inc.buf

    def _replace_corrupt(self, k: int, inc: _Incoming, src: int, record: bool = True) -> None:
        """A payload failed its checksum: record it (every rank raises at the end) and go on
        with a valid stand-in (zeros, encoded; a zero bound), so the schedule completes."""
        if record:
            self.status.record("checksum", round_=k, peer=src, chunk=inc.op.chunk, sub=inc.j)
        zeros = torch.zeros(inc.b - inc.a, dtype=torch.float32, device=self.x.device)
        inc.buf = inc.op.codec.encode(zeros, self._ctx(inc.op.ctx, inc.a))
        if inc.bound_buf is not None:
            inc.bound_buf.zero_()

    def process_arrival(self, k: int, inc: _Incoming, fresh: dict[int, _State]) -> None:
        """Receive one sub-chunk and copy it, reduce it into a fused re-encoding, or keep the
        exact fp32 sum; ``fresh`` collects the chunks' new states of this round."""
        t = time.perf_counter()
        payload = self._receive(k, inc)
        t = self.timer.add("wait", t)
        op, j, a, b = inc.op, inc.j, inc.a, inc.b
        self.result.bytes_received += payload.numel()
        pb = None
        if self.bounds is not None:
            assert inc.bound_buf is not None
            bad = torch.isnan(inc.bound_buf) | (inc.bound_buf < 0)
            if bool(bad.any()):
                src = self.plan[k].recv_from
                raise ValueError(
                    f"rank {self.rank}: bound from peer {src} is negative or NaN "
                    f"({inc.bound_buf[bad][0].item()!r}){self._where(k)}"
                )
            pb = self.bounds.unpack(inc.bound_buf, op.codec, b - a)
        st = fresh.setdefault(
            op.chunk,
            _State(op.mode != "keep", op.codec, op.out_ctx if op.mode == "fused" else op.ctx),
        )
        if op.mode == "copy":
            st.payloads.append(payload)
            st.bounds.append(pb)
        elif op.mode == "fused":
            self._reduce_fused(inc, payload, pb, st)
        else:
            self._reduce_keep(inc, payload, pb)
        if op.mode != "keep" and self.last_recv[op.chunk] == k and self._wanted(op.chunk):
            assert st.codec is not None and st.ctx is not None
            self.deferred.append(_Deferred(k, st.codec, st.ctx, st.payloads[-1], a, b))
            self.decoded.add((op.chunk, j))
        self.timer.add("reduce", t)

    def _reduce_fused(
        self, inc: _Incoming, payload: torch.Tensor, pb: torch.Tensor | None, st: _State
    ) -> None:
        """Add the local value and re-encode at once with the codec's fused ``reduce``."""
        op, a, b = inc.op, inc.a, inc.b
        local, lb = self._local_value(self.state[op.chunk], inc.j, a, b)
        assert op.out_ctx is not None
        in_c, out_c = self._ctx(op.ctx, a), self._ctx(op.out_ctx, a)
        out_payload = op.codec.reduce(payload, local.contiguous(), in_c, out_c)
        st.payloads.append(out_payload)
        bound = None
        if self.feedback is not None or self.bounds is not None:
            # the sum the fused reduce encoded (only error feedback and bounds need it: the
            # plain path stays one fused call)
            v = op.codec.decode(payload, b - a, in_c) + local
            if self.feedback is not None:
                self.feedback.record(a, v, op.codec, out_payload, out_c)
            if self.bounds is not None:
                assert pb is not None and lb is not None
                bound = encoding_bound(op.codec, v, out_c, held=addition_bound(v, pb, lb))
        st.bounds.append(bound)

    def _reduce_keep(self, inc: _Incoming, payload: torch.Tensor, pb: torch.Tensor | None) -> None:
        """Add the local value and keep the exact fp32 sum (the next use is a reduction)."""
        op, a, b = inc.op, inc.a, inc.b
        local, lb = self._local_value(self.state[op.chunk], inc.j, a, b)
        v = op.codec.decode(payload, b - a, self._ctx(op.ctx, a)) + local
        self._write(a, b, v)
        if self.bounds is not None:
            assert pb is not None and lb is not None
            self.bounds.beta[a:b] = addition_bound(v, pb, lb)

    # -- sending ---------------------------------------------------------------------------

    def _plan_sends(self, k: int, prev: list[_Incoming]) -> _Sends:
        where_recv = {(inc.op.chunk, inc.j): i for i, inc in enumerate(prev)}
        items = [(sop, j) for sop in self.plan[k].sends for j in range(len(self.pieces[sop.chunk]))]
        deps = [where_recv.get((sop.chunk, j), -1) for sop, j in items]
        return _Sends(k, items, deps)

    def issue_sends(self, sends: _Sends, done: int, fresh: dict[int, _State]) -> None:
        """Send the pieces of ``sends`` whose inputs are ready (the previous round has
        processed its receives up to index ``done``; ``fresh``: its new states)."""
        while sends.pos < len(sends.items) and sends.deps[sends.pos] <= done:
            sop, j = sends.items[sends.pos]
            sends.pos += 1
            view = fresh.get(sop.chunk, self.state[sop.chunk])
            new = sends.new.setdefault(
                sop.chunk, _State(True, sop.codec, sop.ctx) if sop.encode else view
            )
            if sop.encode:
                self._encode_piece(sop, view, new, j)
            self._send_piece(sends, sop, new, j)

    def _encode_piece(self, sop: SendOp, view: _State, new: _State, j: int) -> None:
        t = time.perf_counter()
        a, b = self.pieces[sop.chunk][j]
        v, vb = self._local_value(view, j, a, b)
        c = self._ctx(sop.ctx, a)
        payload = sop.codec.encode(v.contiguous(), c)
        if self.feedback is not None:
            self.feedback.record(a, v, sop.codec, payload, c)
        bnd = None
        if self.bounds is not None:
            assert vb is not None
            bnd = encoding_bound(sop.codec, v, c, held=vb)
        new.payloads.append(payload)
        new.bounds.append(bnd)
        self.timer.add("encode", t)

    def _send_piece(self, sends: _Sends, sop: SendOp, new: _State, j: int) -> None:
        dst = self.plan[sends.k].send_to
        assert dst is not None
        a, b = self.pieces[sop.chunk][j]
        payload, bnd = new.payloads[j], new.bounds[j]
        nbytes = payload.numel()
        k, ch = sends.k, sop.chunk
        if self._size(sop.codec, sop.ctx, a, b) is None:
            word = seal_length(self._ident(k, ch, j, self.rank, dst), payload.numel())
            hdr = torch.tensor([word], dtype=torch.int64, device=self.x.device)
            sends.pending.append(self.transport.isend(hdr, dst))
            nbytes += 8
        packed = None
        if self.bounds is not None:
            assert bnd is not None
            packed = self.bounds.pack(bnd, sop.codec)
            self.result.bound_bytes_sent += packed.numel() * 8
            # keep what the receiver gets, so every rank ends with the same bound
            new.bounds[j] = self.bounds.unpack(packed, sop.codec, b - a)
        wire = payload
        if self.verify:  # the checksum rides at the end of the payload: no extra message
            crc = checksum(self._ident(k, ch, j, self.rank, dst), payload, packed)
            wire = torch.cat([payload, pack_checksum(crc, payload.device)])
            nbytes += CHECKSUM_BYTES
        sends.pending.append(self.transport.isend(wire, dst))
        if packed is not None:
            sends.pending.append(self.transport.isend(packed, dst))
        self.result.bytes_sent += nbytes
        self.result.round_bytes[k] += nbytes

    # -- helpers ---------------------------------------------------------------------------

    def _ctx(self, ctx: HopContext, start: int) -> HopContext:
        """A planned context (offset 0) at the global offset of a piece starting at
        ``start``, with the prologue's result (built once per context and piece: only used
        after the prologue, whose result then no longer changes)."""
        key = (id(ctx), start)
        got = self._ctxs.get(key)
        if got is None:
            got = dataclasses.replace(
                ctx, offset=self.config.base_offset + start, shared=self.shared
            )
            self._ctxs[key] = got
        return got

    def _size(self, codec: Codec, ctx: HopContext, a: int, b: int) -> int | None:
        """``codec.encoded_nbytes`` of the piece ``[a, b)`` in the planned context ``ctx``
        (asked once per piece: the plan keeps both objects alive for the run)."""
        key = (id(codec), id(ctx), a, b)
        if key not in self._nbytes:
            self._nbytes[key] = codec.encoded_nbytes(b - a, self._ctx(ctx, a))
        return self._nbytes[key]

    def _local_value(
        self, s: _State, j: int, a: int, b: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The value (and bound) this rank holds for sub-chunk ``j`` of a chunk."""
        if not s.encoded:
            return self._raw(a, b), (self.bounds.beta[a:b] if self.bounds is not None else None)
        assert s.codec is not None and s.ctx is not None
        v = s.codec.decode(s.payloads[j], b - a, self._ctx(s.ctx, a))
        return v, s.bounds[j]

    def _raw(self, a: int, b: int) -> torch.Tensor:
        """The fp32 values of the piece ``[a, b)`` held raw (the input, until written)."""
        if self._source is None or (a, b) in self._written:
            return self.work[a:b]
        return self._source[a:b].to(torch.float32)

    def _write(self, a: int, b: int, v: torch.Tensor) -> None:
        self.work[a:b] = v
        if self._source is not None:
            self._written.add((a, b))  # (an empty piece may share its start with the next)

    def _wanted(self, chunk: int) -> bool:
        outputs = self.config.outputs
        return outputs is None or chunk in outputs

    def _send_ahead(self, k: int) -> bool:
        """Whether round ``k + 1``'s sends may start during round ``k``: only on round
        ``k``'s own connection (a ring's every round, butterfly's rounds with one partner).
        Early bytes to another peer share this rank's link with round ``k``'s, which every
        partner waits for: measured on the emulated cluster at 100 Mbit/s, that made
        butterfly up to 19 % slower (docs/benchmarks.md, "... early sends only on the same
        connection")."""
        if not (self.overlap and k + 1 < len(self.plan)):
            return False
        return self.plan[k + 1].send_to == self.plan[k].send_to

    def _fixed_size(self, k: int) -> bool:
        got = self._fixed.get(k)
        if got is None:
            got = self._fixed[k] = all(
                self._size(op.codec, op.ctx, a, b) is not None
                for op in self.plan[k].recvs
                for a, b in self.pieces[op.chunk]
            )
        return got

    def _decode_deferred(self, count: int, before_round: int) -> None:
        t = time.perf_counter()
        for _ in range(count):
            if not self.deferred or self.deferred[0].k >= before_round:
                break
            d = self.deferred.pop(0)
            self._write(d.a, d.b, d.codec.decode(d.payload, d.b - d.a, self._ctx(d.ctx, d.a)))
        self.timer.add("decode", t)

    def _ident(self, k: int, chunk: int, j: int, src: int, dst: int) -> bytes:
        """The identity of sub-chunk ``j`` of ``chunk`` sent in round ``k`` from ``src`` to
        ``dst`` (:func:`~dynamiq.collectives.integrity.identity`)."""
        return identity(self.transport.seq, k, chunk, j, src, dst)

    def _where(self, k: int) -> str:
        return f" (round {k} of {len(self.plan)}, schedule {self.schedule.name})"

    def _wait(self, w: Work, k: int) -> None:
        try:
            w.wait(self.config.timeout)
        except (PeerTimeoutError, TransportError) as exc:
            raise type(exc)(str(exc) + self._where(k), exc.peer) from exc


def run_schedule(
    transport: Transport,
    x: torch.Tensor,
    codec: Codec,
    schedule: Schedule,
    config: RunConfig | None = None,
    *,
    plan: list[list[RoundPlan]] | None = None,
    residual: torch.Tensor | None = None,
    **keywords: Any,
) -> EngineResult:
    """All-reduce (sum) the 1-D tensor ``x`` of this rank; returns the fp32 result.

    The keywords are :class:`RunConfig`'s fields (or pass ``config``), with these meanings:

    ``inplace=True`` lets a contiguous fp32 ``x`` be the working buffer (no copy of it): it
    ends holding the result, which is then ``x`` itself; if the run fails its contents are
    undefined. Other dtypes are copied as without it.

    ``residual`` (fp32, ``x.numel()``), when given, accumulates ``v - decode(encode(v))`` of
    every value this rank encodes, at its positions: its own contribution and the partial
    sums it re-encodes (error feedback adds it to the next step's gradient).
    ``rounds=(start, stop)`` runs part of the schedule (``reduce_scatter``, ``all_gather``);
    ``outputs`` lists the chunks to decode at the end (default: all).

    A codec with a ``prologue(x, comm)`` method (a collective step it needs first, e.g. an
    agreement on a global norm) has it run here (:mod:`dynamiq.collectives.handshake`);
    ``comm.allgather(tensor)`` exchanges a small tensor with every rank, its bytes count in
    ``bytes_sent``, and the returned dict reaches every encoding as ``HopContext.shared``.

    ``descriptor`` is compared across ranks before the first transfer (a mismatch raises
    :class:`ConfigMismatchError` on every rank). ``timeout`` bounds every wait on a peer.
    ``base_offset`` is the global offset of ``x[0]`` (what the codecs' contexts see).
    """
    if config is not None and keywords:
        raise TypeError(f"run_schedule: pass config or keywords, not both ({sorted(keywords)})")
    cfg = config or RunConfig(**keywords)
    return ScheduleRun(transport, x, codec, schedule, cfg, plan=plan, residual=residual).run()
