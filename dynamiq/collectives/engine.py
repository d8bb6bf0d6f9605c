"""The engine: executes any schedule with any codec over any transport (DESIGN.md,
"Collectives").

Each rank holds, per chunk, either a *raw* fp32 value (its gradient, or an exact fp32 sum of
decoded partial sums and its gradient) or an *encoded* one (payload bytes with the codec and
:class:`~dynamiq.codecs.HopContext` that made them). Per round of the schedule:

1. post the receives;
2. send: forward the encoded bytes of a chunk as they are, or encode its raw value;
3. process each received sub-chunk as it arrives, while later ones are still in flight:
   ``copy`` keeps the bytes; ``reduce`` adds the local value, and either recompresses at once
   with the codec's fused ``reduce`` (when this rank's next use of the chunk is to send it) or
   keeps the exact fp32 sum (when the next use is another reduction: no needless rounding).

On the CPU (gloo, the in-process transport) rounds overlap: a round's receives are posted
one round ahead, a piece the next round sends goes out as soon as this round has finished it,
and finished chunks are decoded while later data is in flight; messages keep the lock-step
order and values, so the bytes are the same (payloads of data-dependent size keep rounds in
lock-step; on CUDA the rounds stay in lock-step).

The rank that completes a chunk's sum always sends it on in the all-gather, so it encodes it
once and everybody, the owner included, decodes those very bytes: **every rank ends
bit-identical**. Which encoding is which hop is planned from the schedule alone, identically on
every rank, so receivers know each payload's ``HopContext`` (``hop``, ``num_hops``,
``contributions``, the encoding ``rank``, the global ``offset``) without metadata on the wire.

Chunks are cut on multiples of the codecs' block sizes, aligned to global offsets, and split
into sub-chunks of ``sub_chunk`` elements (also block multiples): nothing a codec decides
depends on the cut, so the result is the same for any sub-chunk size.

Certified bounds (``return_bound=True``): every value carries a per-element bound on its
distance from the exact sum of the gradients it holds. Encoding ``v`` adds
``codec.error_bound.max_abs_error(v, ctx)``; an fp32 addition adds ``|fl(a + b)|·2^-24 +
2^-150``; a bound travels beside its payload as one fp64 per group of elements (the group's
maximum), counted apart from the payload bytes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dynamiq.codecs import Codec, HopContext

from .planning import RecvOp, RoundPlan, SendOp, chunk_bounds, chunk_layout, plan_schedule
from .schedules import Schedule
from .transport import PeerTimeoutError, Transport, Work

__all__ = [
    "WIRE_VERSION",
    "ConfigMismatchError",
    "EngineResult",
    "PrologueComm",
    "chunk_bounds",
    "chunk_layout",
    "plan_schedule",
    "run_schedule",
]

#: Version of the engine's wire protocol (message order, headers); ranks must agree on it.
WIRE_VERSION = 1

_ADD_REL = 2.0**-24 * (1 + 2.0**-20)  # |fl(a + b) - (a + b)| <= |fl(a + b)| * _ADD_REL + _TINY
_TINY = 2.0**-150


class ConfigMismatchError(ValueError):
    """Ranks disagree on the collective's configuration (codec, schedule, sizes, version)."""


# -- execution --------------------------------------------------------------------------------


@dataclass
class EngineResult:
    """What one rank's run produced and measured."""

    output: torch.Tensor  # fp32, the all-reduced buffer
    bound: torch.Tensor | None  # fp64 per element, when asked
    bytes_sent: int = 0
    bytes_received: int = 0
    bound_bytes_sent: int = 0
    control_bytes_sent: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _State:
    encoded: bool = False
    codec: Codec | None = None
    ctx: HopContext | None = None
    payloads: list[torch.Tensor] = field(default_factory=list)
    bounds: list[torch.Tensor | None] = field(default_factory=list)


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


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - t0
        return now


def _group_size(codec: Codec) -> int:
    return max(codec.bound_block, 32)  # a NaN/Inf spoils the bounds of its bound_block only


def _pack_bound(bound: torch.Tensor, group: int) -> torch.Tensor:
    n = bound.numel()
    ng = -(-n // group)
    padded = torch.zeros(ng * group, dtype=torch.float64, device=bound.device)
    padded[:n] = bound
    return padded.view(ng, group).amax(dim=1) if ng else padded[:0]


def _unpack_bound(groups: torch.Tensor, n: int, group: int) -> torch.Tensor:
    return groups.repeat_interleave(group)[:n]


def _slack(v: torch.Tensor) -> torch.Tensor:
    return v.double().abs() * _ADD_REL + _TINY


def run_schedule(
    transport: Transport,
    x: torch.Tensor,
    codec: Codec,
    schedule: Schedule,
    *,
    seed: int = 0,
    step: int = 0,
    sub_chunk: int = 1 << 18,
    return_bound: bool = False,
    timeout: float = 300.0,
    base_offset: int = 0,
    descriptor: dict[str, Any] | None = None,
    plan: list[list[RoundPlan]] | None = None,
    residual: torch.Tensor | None = None,
    rounds: tuple[int, int] | None = None,
    outputs: Sequence[int] | None = None,
    inplace: bool = False,
) -> EngineResult:
    """All-reduce (sum) the 1-D tensor ``x`` of this rank; returns the fp32 result.

    ``inplace=True`` lets a contiguous fp32 ``x`` be the working buffer (no copy of it): it
    ends holding the result, which is then ``x`` itself; if the run fails its contents are
    undefined. Other dtypes are copied as without it.

    ``residual`` (fp32, ``x.numel()``), when given, accumulates ``v - decode(encode(v))`` of
    every value this rank encodes, at its positions: its own contribution and the partial
    sums it re-encodes (error feedback adds it to the next step's gradient).
    ``rounds=(start, stop)`` runs part of the schedule (``reduce_scatter``, ``all_gather``);
    ``outputs`` lists the chunks to decode at the end (default: all).

    A codec with a ``prologue(x, comm)`` method (a collective step it needs first, e.g. an
    agreement on a global norm) has it run here; ``comm.allgather(tensor)`` exchanges a small
    tensor with every rank, its bytes count in ``bytes_sent``, and the returned dict reaches
    every encoding as ``HopContext.shared``.

    ``descriptor`` is compared across ranks before the first transfer (a mismatch raises
    :class:`ConfigMismatchError` on every rank). ``timeout`` bounds every wait on a peer.
    """
    r, n = transport.rank, transport.world_size
    if schedule.world_size != n:
        raise ValueError(f"schedule is for {schedule.world_size} ranks, transport has {n}")
    timer = _Timer()
    t0 = time.perf_counter()
    result = EngineResult(output=torch.empty(0), bound=None)
    numel = x.numel()
    desc = {
        "wire_version": WIRE_VERSION,
        "codec": codec.get_config(),
        "schedule": schedule.describe(),
        "numel": numel,
        "seed": seed,
        "sub_chunk": sub_chunk,
        "return_bound": return_bound,
        **(descriptor or {}),
    }
    result.control_bytes_sent += agree(transport, desc, timeout, x.device)
    t0 = timer.add("agree", t0)

    shared = None
    prologue = getattr(codec, "prologue", None)
    if callable(prologue):
        comm = PrologueComm(transport, timeout)
        shared = prologue(x, comm)
        result.bytes_sent += comm.bytes_sent
        result.bytes_received += comm.bytes_received
        t0 = timer.add("prologue", t0)

    plan = plan or plan_schedule(schedule, codec, seed=seed, step=step, rounds=rounds)
    _, pieces = chunk_layout(numel, schedule, codec, sub_chunk)

    # raw values (fp32), updated in place
    if inplace and x.dtype == torch.float32 and x.is_contiguous():
        work = x.detach()
    else:
        work = x.detach().to(torch.float32).clone()
    beta = torch.zeros(numel, dtype=torch.float64, device=x.device) if return_bound else None
    state = [_State() for _ in range(schedule.num_chunks)]

    def octx(ctx: HopContext, start: int) -> HopContext:
        return dataclasses.replace(ctx, offset=base_offset + start, shared=shared)

    def local_value(s: _State, j: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not s.encoded:
            return work[a:b], (beta[a:b] if beta is not None else None)
        assert s.codec is not None and s.ctx is not None
        v = s.codec.decode(s.payloads[j], b - a, octx(s.ctx, a))
        return v, s.bounds[j]

    # A chunk whose last receive on this rank has happened holds its final bytes: decode its
    # sub-chunks in the next rounds, one before each wait for a peer's data (the link is busy,
    # the CPU would idle), instead of all after the last round; not in the round that
    # produced them, whose end the next round's sends wait for. Same bytes, same decode:
    # same result. (Bounds are set at the end: a send may still replace a payload's bound by
    # the packed one its receiver gets.)
    rounds_plan = plan[r]
    last_recv: dict[int, int] = {}
    for k, rnd in enumerate(rounds_plan):
        for op in rnd.recvs:
            last_recv[op.chunk] = k
    deferred: list[tuple[int, Codec, HopContext, torch.Tensor, int, int]] = []
    decoded: set[tuple[int, int]] = set()

    def decode_deferred(count: int, before_round: int) -> None:
        t = time.perf_counter()
        for _ in range(count):
            if not deferred or deferred[0][0] >= before_round:
                break
            _, c, ctx, payload, a, b = deferred.pop(0)
            work[a:b] = c.decode(payload, b - a, octx(ctx, a))
        timer.add("decode", t)

    # Rounds overlap on the CPU (gloo, in-process): the next round's receives are posted one
    # round ahead, and a piece the next round sends goes out as soon as this round has
    # finished it (gloo moves nothing until the receive is posted, and a round's last piece
    # would otherwise hold up its first). Every message still goes out in the order of the
    # lock-step schedule, computed from the same values, so the bytes are the same. Payloads
    # of data-dependent size keep rounds in lock-step (their lengths are read one by one).
    lookahead = x.device.type == "cpu"

    def fixed_size(k: int) -> bool:
        return all(
            op.codec.encoded_nbytes(b - a, octx(op.ctx, a)) is not None
            for op in rounds_plan[k].recvs
            for a, b in pieces[op.chunk]
        )

    def post_recvs(k: int) -> list[tuple[RecvOp, int, int, int, Any, Any]]:
        # fixed-size payloads are posted at once (matched in order); data-dependent ones one
        # by one when processed, each after its length header
        rnd = rounds_plan[k]
        incoming: list[tuple[RecvOp, int, int, int, Any, Any]] = []
        for op in rnd.recvs:
            assert rnd.recv_from is not None
            for j, (a, b) in enumerate(pieces[op.chunk]):
                size = op.codec.encoded_nbytes(b - a, octx(op.ctx, a))
                if size is None:
                    incoming.append((op, j, a, b, None, None))
                    continue
                buf = torch.empty(size, dtype=torch.uint8, device=x.device)
                w_buf = transport.irecv(buf, rnd.recv_from)
                bnd = wb = None
                if beta is not None:
                    g = _group_size(op.codec)
                    bnd = torch.empty(-(-(b - a) // g), dtype=torch.float64, device=x.device)
                    wb = transport.irecv(bnd, rnd.recv_from)
                incoming.append((op, j, a, b, (buf, w_buf), (bnd, wb)))
        return incoming

    def plan_sends(k: int, prev: list[tuple[RecvOp, int, int, int, Any, Any]]) -> _Sends:
        where_recv = {(op.chunk, j): i for i, (op, j, *_rest) in enumerate(prev)}
        items = [(sop, j) for sop in rounds_plan[k].sends for j in range(len(pieces[sop.chunk]))]
        deps = [where_recv.get((sop.chunk, j), -1) for sop, j in items]
        return _Sends(k, items, deps)

    def issue(sends: _Sends, done: int, fresh: dict[int, _State]) -> None:
        """Send the pieces of ``sends`` whose inputs are ready (the previous round has
        processed its receives up to index ``done``; ``fresh``: its new states)."""
        rnd = rounds_plan[sends.k]
        while sends.pos < len(sends.items) and sends.deps[sends.pos] <= done:
            sop, j = sends.items[sends.pos]
            sends.pos += 1
            assert rnd.send_to is not None
            a, b = pieces[sop.chunk][j]
            view = fresh.get(sop.chunk, state[sop.chunk])
            new = sends.new.setdefault(
                sop.chunk, _State(True, sop.codec, sop.ctx) if sop.encode else view
            )
            if sop.encode:
                t = time.perf_counter()
                v, vb = local_value(view, j, a, b)
                c = octx(sop.ctx, a)
                payload = sop.codec.encode(v.contiguous(), c)
                if residual is not None:
                    residual[a:b] += v - sop.codec.decode(payload, b - a, c)
                bnd = None
                if beta is not None:
                    assert vb is not None
                    bnd = vb + sop.codec.error_bound.max_abs_error(v, c)
                new.payloads.append(payload)
                new.bounds.append(bnd)
                timer.add("encode", t)
            payload, bnd = new.payloads[j], new.bounds[j]
            if sop.codec.encoded_nbytes(b - a, octx(sop.ctx, a)) is None:
                hdr = torch.tensor([payload.numel()], dtype=torch.int64, device=x.device)
                sends.pending.append(transport.isend(hdr, rnd.send_to))
                result.bytes_sent += 8
            sends.pending.append(transport.isend(payload, rnd.send_to))
            result.bytes_sent += payload.numel()
            if beta is not None:
                assert bnd is not None
                packed = _pack_bound(bnd, _group_size(sop.codec))
                sends.pending.append(transport.isend(packed, rnd.send_to))
                result.bound_bytes_sent += packed.numel() * 8
                # keep what the receiver gets, so every rank ends with the same bound
                new.bounds[j] = _unpack_bound(packed, b - a, _group_size(sop.codec))

    posted: dict[int, list[tuple[RecvOp, int, int, int, Any, Any]]] = {}
    early: _Sends | None = None  # this round's sends, started during the previous round
    for k, rnd in enumerate(rounds_plan):
        where = f" (round {k} of {len(rounds_plan)}, schedule {schedule.name})"

        def wait(w: Work, where: str = where) -> None:
            try:
                w.wait(timeout)
            except PeerTimeoutError as exc:
                raise PeerTimeoutError(str(exc) + where) from exc

        # 1. post receives (unless posted a round ahead), and the next round's -------------
        incoming = posted.pop(k) if k in posted else post_recvs(k)
        ahead = lookahead and k + 1 < len(rounds_plan)
        if ahead and fixed_size(k) and fixed_size(k + 1):
            posted[k + 1] = post_recvs(k + 1)
        # 2. sends: the rest of them, then this round's states of what was sent ------------
        sends = early or plan_sends(k, [])
        issue(sends, 1 << 62, {})  # everything left: its inputs are all final now
        for sop in rnd.sends:
            state[sop.chunk] = sends.new[sop.chunk]
        nxt = plan_sends(k + 1, incoming) if ahead else None
        # 3. receive and process, sub-chunk by sub-chunk; start the next round's sends ------
        fresh: dict[int, _State] = {}
        if nxt is not None:
            issue(nxt, -1, fresh)
        for i, (op, j, a, b, pay, bnds) in enumerate(incoming):
            assert rnd.recv_from is not None
            if deferred:
                decode_deferred(1, before_round=k)
            t = time.perf_counter()
            if pay is None:  # data-dependent size: the length comes first
                hdr = torch.empty(1, dtype=torch.int64, device=x.device)
                wait(transport.irecv(hdr, rnd.recv_from))
                size = int(hdr[0])
                limit = 16 * (b - a) + 1024
                if not 0 <= size <= limit:
                    raise ValueError(
                        f"rank {r}: bad payload length {size} from {rnd.recv_from}{where}"
                    )
                buf = torch.empty(size, dtype=torch.uint8, device=x.device)
                pay = (buf, transport.irecv(buf, rnd.recv_from))
                bnds = (None, None)
                if beta is not None:
                    g = _group_size(op.codec)
                    bnd_buf = torch.empty(-(-(b - a) // g), dtype=torch.float64, device=x.device)
                    bnds = (bnd_buf, transport.irecv(bnd_buf, rnd.recv_from))
                result.bytes_received += 8
            wait(pay[1])
            if bnds[1] is not None:
                wait(bnds[1])
            t = timer.add("wait", t)
            payload = pay[0]
            result.bytes_received += payload.numel()
            in_ctx = octx(op.ctx, a)
            pb = None
            if beta is not None:
                pb = _unpack_bound(bnds[0], b - a, _group_size(op.codec))
            st = fresh.setdefault(
                op.chunk,
                _State(op.mode != "keep", op.codec, op.out_ctx if op.mode == "fused" else op.ctx),
            )
            if op.mode == "copy":
                st.payloads.append(payload)
                st.bounds.append(pb)
            else:
                local, lb = local_value(state[op.chunk], j, a, b)
                if op.mode == "fused":
                    assert op.out_ctx is not None
                    out_c = octx(op.out_ctx, a)
                    out_payload = op.codec.reduce(payload, local.contiguous(), in_ctx, out_c)
                    st.payloads.append(out_payload)
                    bound = None
                    if residual is not None or beta is not None:
                        # the sum the fused reduce encoded (only error feedback and bounds
                        # need it: the plain path stays one fused call)
                        v = op.codec.decode(payload, b - a, in_ctx) + local
                        if residual is not None:
                            residual[a:b] += v - op.codec.decode(out_payload, b - a, out_c)
                        if beta is not None:
                            assert pb is not None and lb is not None
                            bound = (
                                pb + lb + _slack(v) + op.codec.error_bound.max_abs_error(v, out_c)
                            )
                    st.bounds.append(bound)
                else:
                    v = op.codec.decode(payload, b - a, in_ctx) + local
                    work[a:b] = v
                    if beta is not None:
                        assert pb is not None and lb is not None
                        beta[a:b] = pb + lb + _slack(v)
            if (
                op.mode != "keep"
                and last_recv[op.chunk] == k
                and (outputs is None or op.chunk in outputs)
            ):
                assert st.codec is not None and st.ctx is not None
                deferred.append((k, st.codec, st.ctx, st.payloads[-1], a, b))
                decoded.add((op.chunk, j))
            timer.add("reduce", t)
            if nxt is not None:
                issue(nxt, i, fresh)
        for ch, st in fresh.items():
            state[ch] = st
        early = nxt
        t = time.perf_counter()
        for w in sends.pending:
            wait(w)
        timer.add("wait", t)

    # final values: decode what is encoded (the owner decodes its own bytes too)
    decode_deferred(len(deferred), before_round=len(plan[r]))
    t = time.perf_counter()
    for ch, s in enumerate(state):
        if not s.encoded or (outputs is not None and ch not in outputs):
            continue
        assert s.codec is not None and s.ctx is not None
        for j, (a, b) in enumerate(pieces[ch]):
            if (ch, j) not in decoded:
                work[a:b] = s.codec.decode(s.payloads[j], b - a, octx(s.ctx, a))
            if beta is not None:
                bj = s.bounds[j]
                assert bj is not None
                beta[a:b] = bj
    timer.add("decode", t)
    result.output = work
    result.bound = beta
    result.seconds = timer.seconds
    result.seconds["total"] = sum(timer.seconds.values())
    return result


# -- agreement before the first transfer, prologues -------------------------------------------


class PrologueComm:
    """What a codec's ``prologue`` may do: exchange small tensors with every rank."""

    def __init__(self, transport: Transport, timeout: float):
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.timeout = timeout
        self.bytes_sent = 0
        self.bytes_received = 0

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype everywhere), indexed by rank."""
        t = tensor.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        out = [t if r == self.rank else torch.empty_like(t) for r in range(self.world_size)]
        recvs = [self.transport.irecv(out[r], r) for r in range(self.world_size) if r != self.rank]
        sends = [self.transport.isend(t, r) for r in range(self.world_size) if r != self.rank]
        for w in recvs + sends:
            w.wait(self.timeout)
        self.bytes_sent += nbytes * (self.world_size - 1)
        self.bytes_received += nbytes * (self.world_size - 1)
        return out


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
    if not 0 <= size <= 1 << 24:
        raise ConfigMismatchError(f"rank {transport.rank}: malformed handshake from {src}")
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    transport.irecv(buf, src).wait(timeout)
    return bytes(buf.cpu().numpy().tobytes())


def describe_difference(a: dict[str, Any], b: dict[str, Any], ra: int, rb: int) -> str:
    """Name the first keys on which two descriptors differ."""
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    parts = [f"{k}: rank {ra} has {a.get(k)!r}, rank {rb} has {b.get(k)!r}" for k in keys[:3]]
    return "; ".join(parts)


def agree(
    transport: Transport,
    desc: dict[str, Any],
    timeout: float,
    device: torch.device | str = "cpu",
) -> int:
    """Check that every rank has the same descriptor; raise on every rank if not.

    Rank 0 gathers the descriptors and sends every rank the verdict; the messages live on
    ``device`` (the data's: NCCL moves CUDA tensors only). Returns bytes sent.
    """
    device = torch.device(device)
    r, n = transport.rank, transport.world_size
    if n == 1:
        return 0
    mine = json.dumps(desc, sort_keys=True, default=str).encode()
    # a persistent transport (a DDP hook's) agrees once per distinct configuration, not at
    # every call: the training step is not part of the descriptor
    agreed: set[bytes] | None = getattr(transport, "agreed", None)
    if agreed is not None and mine in agreed:
        return 0
    sent = 0
    if r != 0:  # send mine to rank 0, get its verdict
        works = _send_blob(transport, mine, 0, device)
        sent += 8 + len(mine)
        verdict = _recv_blob(transport, 0, timeout, device).decode()
    else:  # compare everybody's with mine, send the verdict to all
        problems = []
        for src in range(1, n):
            theirs = json.loads(_recv_blob(transport, src, timeout, device))
            if theirs != json.loads(mine):
                problems.append(describe_difference(json.loads(mine), theirs, 0, src))
        verdict = (
            "ranks disagree on the collective's configuration: " + " | ".join(problems)
            if problems
            else ""
        )
        works = []
        for dst in range(1, n):
            works += _send_blob(transport, verdict.encode(), dst, device)
            sent += 8 + len(verdict)
    for w in works:
        w.wait(timeout)
    if verdict:
        raise ConfigMismatchError(verdict)
    if agreed is not None:
        agreed.add(mine)
    return sent
