"""The cost model of ``dynamiq plan``: the engine's own plan, replayed in time.

The bytes are exact: the schedule's plan (:func:`dynamiq.collectives.planning.plan_schedule`)
and the engine's chunk layout (:func:`dynamiq.collectives.planning.chunk_layout`) say, for
every rank and round, which sub-chunks it sends (each ``codec.encoded_nbytes`` long: no data
needed; codecs whose size depends on the data count their ``bits_per_value`` bound and an
8-byte length),
which it encodes first, and what it does with each received one (``copy``, ``fused`` reduce,
or ``keep`` an fp32 sum).

The time is a small discrete-event simulation of exactly that work, in the engine's order
(:func:`dynamiq.collectives.engine.run_schedule`): every rank is one thread of CPU steps
(encode, fused reduce, deferred decode, the ``isend`` call itself), each costing its
:class:`~dynamiq.plan.costs.CodecCost` (times the host's ``cpu_slowdown``); messages are α-β
transfers that hold the sender's uplink and the receiver's downlink (:class:`~dynamiq.plan.
costs.Link`) and start no earlier than the receive is posted (plus α for the notice). On the
CPU rounds overlap as the engine does it: the next round's receives are posted a round ahead
and a piece it sends to the same peer goes out as soon as this round has finished its input;
finished chunks are decoded one piece before each wait. On CUDA (``Host.lookahead=False``)
rounds are lock-step. With ``Host.cores`` the ranks' CPU steps share that many cores (a
step starts when one is free: the ``cores`` phase), and every CPU step also costs
``Host.step_overhead``. An all-reduce lasts until its slowest rank is done.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from dynamiq.codecs import HopContext, get_codec
from dynamiq.collectives import get_schedule
from dynamiq.collectives.handshake import allreduce_steps
from dynamiq.collectives.planning import chunk_layout, plan_schedule

from .costs import CodecCost, Host, Link

__all__ = ["Cluster", "Prediction", "simulate", "wire_bytes"]

PHASES = ("prologue", "encode", "reduce", "decode", "send", "wait", "cores")


@dataclass(frozen=True)
class Cluster:
    """``ranks`` ranks, ``ranks_per_node`` to a node: ``intra`` links inside a node,
    ``inter`` between nodes (every rank its own NIC)."""

    ranks: int
    inter: Link
    ranks_per_node: int = 1
    intra: Link | None = None

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"ranks must be >= 2 (got {self.ranks})")
        if not 1 <= self.ranks_per_node <= self.ranks:
            raise ValueError(
                f"ranks per node must be in 1..{self.ranks} (got {self.ranks_per_node})"
            )
        if self.ranks_per_node > 1 and self.intra is None:
            raise ValueError("ranks per node > 1 needs an intra-node link")

    def link(self, a: int, b: int) -> Link:
        same = a // self.ranks_per_node == b // self.ranks_per_node
        return self.intra if same and self.intra is not None else self.inter


@dataclass
class Prediction:
    """What :func:`simulate` predicts for one all-reduce."""

    codec: str
    schedule: str
    seconds: float
    bits_per_value: float
    bytes_sent_per_rank: float  # mean over ranks
    exact_bytes: bool  # False: a data-dependent codec's upper bound
    phases: dict[str, float]  # mean over ranks, seconds
    rounds: list[dict[str, float]]  # per round, rank 0
    per_rank_seconds: list[float] = field(default_factory=list)
    cpu_steps_per_rank: float = 0.0  # mean over ranks

    @property
    def cpu_seconds_per_rank(self) -> float:
        """Mean CPU time a rank spends in its steps (every phase but the waits)."""
        return sum(v for k, v in self.phases.items() if k not in ("wait", "cores"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "schedule": self.schedule,
            "seconds": self.seconds,
            "bits_per_value": self.bits_per_value,
            "bytes_sent_per_rank": self.bytes_sent_per_rank,
            "exact_bytes": self.exact_bytes,
            "phases": self.phases,
            "rounds": self.rounds,
            "per_rank_seconds": self.per_rank_seconds,
            "cpu_steps_per_rank": self.cpu_steps_per_rank,
        }


# -- exact bytes --------------------------------------------------------------------------------


def _piece_bytes(codec: Any, a: int, b: int, ctx: HopContext) -> tuple[int, bool]:
    """(bytes on the wire, size known exactly) of one sub-chunk."""
    ctx = dataclasses.replace(ctx, offset=a)
    n = codec.encoded_nbytes(b - a, ctx)
    if n is not None:
        return int(n), True
    bound = -(-int(codec.bits_per_value(b - a) * (b - a)) // 8)
    return bound + 8, False  # + the engine's length header


class _CountingComm:
    """A ``PrologueComm`` that counts what a rank's all-gathers send (sizes depend on the
    layout only) and hands every rank's tensor back as its own."""

    def __init__(self, ranks: int):
        self.rank, self.world_size, self.bytes_sent, self.steps = 0, ranks, 0, 0

    def allgather(self, tensor: Any) -> list[Any]:
        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        self.steps += 1 if self.world_size > 1 else 0
        return [tensor] * self.world_size

    def allreduce(self, tensor: Any, op: str) -> Any:
        """The engine's (``PrologueComm.allreduce``): rank 0's sends of
        :func:`~dynamiq.collectives.handshake.allreduce_steps`, ``2 (n - 1) / n`` of the
        bytes."""
        n, length = self.world_size, tensor.numel()
        if n > 1 and length:
            steps = allreduce_steps(n, length, 0)
            sent = sum(b - a for to, (a, b), *_ in steps if to is not None)
            self.bytes_sent += tensor.element_size() * sent
            self.steps += len(steps)
        return tensor


def prologue_exchange(codec: Any, ranks: int, numel: int) -> tuple[int, int]:
    """Bytes a rank sends in ``codec``'s prologue and the exchange's steps, one after the
    other (an all-gather: one; an exact all-reduce: ``allreduce_steps``'); ``(0, 0)``
    without a prologue. From a run on zeros."""
    import torch

    c = get_codec(codec)
    prologue = getattr(c, "prologue", None)
    if not callable(prologue):
        return 0, 0
    comm = _CountingComm(ranks)
    prologue(torch.zeros(numel), comm)
    return comm.bytes_sent, comm.steps


def wire_bytes(
    codec: Any, schedule: Any, ranks: int, numel: int, sub_chunk: int = 1 << 18
) -> tuple[list[int], bool]:
    """Bytes each rank sends in one all-reduce (the engine's ``bytes_sent``: payloads, length
    headers, the prologue's exchange), and whether they are exact."""
    c = get_codec(codec)
    sched = get_schedule(schedule, ranks)
    plan = plan_schedule(sched, c)
    _, pieces = chunk_layout(numel, sched, c, sub_chunk)
    sent, exact = [prologue_exchange(c, ranks, numel)[0]] * ranks, True
    for r in range(ranks):
        for rnd in plan[r]:
            for op in rnd.sends:
                for a, b in pieces[op.chunk]:
                    nb, ex = _piece_bytes(op.codec, a, b, op.ctx)
                    sent[r] += nb
                    # DynamiQ pooled over the bucket: each chunk's bytes follow the data
                    # (within `balance` times, or `balance_slack` bytes above, the uniform
                    # budget predicted here)
                    exact &= ex and getattr(op.codec, "pooling", None) != "bucket"
    return sent, exact


# -- the simulation -----------------------------------------------------------------------------


@dataclass
class _Msg:
    src: int
    dst: int
    nbytes: int
    exact: bool = True  # the size is known before it arrives (else a length header first)
    exchange: bool = False  # its round sends to the peer it receives from (a pairwise exchange)
    #: what its sender sends in its round and the rounds next to it to the same peer (which
    #: the engine sends on without a pause: butterfly's last halving and first doubling)
    round_bytes: int = 0
    issued: float | None = None
    posted: float | None = None
    end: float | None = None  # last byte serialised (the send completes)
    arrival: float | None = None


class _Net:
    """Links as FIFO servers: a message holds its sender's uplink and receiver's downlink."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.up = [0.0] * cluster.ranks
        self.down = [0.0] * cluster.ranks
        self.last_dst = [-1] * cluster.ranks

    def schedule(self, m: _Msg) -> None:
        assert m.issued is not None and m.posted is not None
        link = self.cluster.link(m.src, m.dst)
        ready = m.issued
        if m.posted > m.issued:
            # gloo moves nothing before the receiver's "ready" notice, which travels on the
            # connection's other direction, behind what the receiver is sending the sender
            # there (for at most that direction's queue time, ``notice_queue_s``)
            behind = 0.0
            if self.last_dst[m.dst] == m.src and link.notice_queue_s:
                behind = min(max(0.0, self.up[m.dst] - m.posted), link.notice_queue_s)
            ready = m.posted + behind + link.latency_s
        # queued behind a message to another peer: two connections share the uplink
        shared = self.up[m.src] > ready and self.last_dst[m.src] not in (-1, m.dst)
        start = max(ready, self.up[m.src], self.down[m.dst])
        m.end = start + link.seconds(m.nbytes, shared, m.exchange, m.round_bytes)
        self.up[m.src] = self.down[m.dst] = m.end
        self.last_dst[m.src] = m.dst
        m.arrival = m.end + link.latency_s


_Step = tuple[str, Any]  # ("cpu", (seconds, phase)) | ("send", msg) | ("post", msg) | ("wait", …)
_Recv = tuple[Any, int, int, _Msg]  # (recv op, piece index, piece values, message)
_Send = tuple[Any, int, int, int]  # (send op, piece index, piece values, input position)


class _CostOf:
    """The kernel costs of a schedule step's codec: the run's own ``costs`` for its codec,
    ``intra_costs(codec)`` for another (memoised by identity)."""

    def __init__(
        self, c: Any, key: str, costs: CodecCost, intra: Callable[[Any], CodecCost] | None
    ):
        self.c, self.key, self.costs, self.intra = c, key, costs, intra
        self.memo: dict[int, CodecCost] = {}

    def __call__(self, cc: Any) -> CodecCost:
        if id(cc) not in self.memo:
            if self.intra is None or cc is self.c or json_key(cc) == self.key:
                self.memo[id(cc)] = self.costs
            else:
                self.memo[id(cc)] = self.intra(cc)
        return self.memo[id(cc)]


@dataclass
class _Sim:
    """What every rank's process shares: the plan, the layout, the messages, the clocks."""

    c: Any
    sched: Any
    plan: Any
    pieces: Any
    msgs: dict[tuple[Any, ...], _Msg]  # (src, dst, round, chunk, piece)
    cluster: Cluster
    costs: CodecCost
    host: Host
    numel: int
    cost_of: _CostOf
    clocks: list[float]
    rounds: list[dict[str, float]] = field(default_factory=list)
    #: the prologue's bytes a rank sends and its steps (:func:`prologue_exchange`)
    prologue: tuple[int, int] = (0, 0)


def _make_msgs(plan: Any, pieces: Any, n: int) -> tuple[dict[tuple[Any, ...], _Msg], bool]:
    """Every message of the run, matched (sender's k-th send to dst in round order == the
    receiver's k-th receive from src), created up front; and whether all sizes are exact."""
    msgs: dict[tuple[Any, ...], _Msg] = {}
    exact = True
    for r in range(n):
        mine: list[_Msg] = []  # this run of rounds to one peer (the engine sends them on)
        runs = [mine]
        for k, rnd in enumerate(plan[r]):
            if k and plan[r][k - 1].send_to != rnd.send_to:
                mine = []
                runs.append(mine)
            for op in rnd.sends:
                assert rnd.send_to is not None
                for j, (a, b) in enumerate(pieces[op.chunk]):
                    nb, ex = _piece_bytes(op.codec, a, b, op.ctx)
                    exact &= ex
                    pair = rnd.send_to == rnd.recv_from
                    m = msgs[(r, rnd.send_to, k, op.chunk, j)] = _Msg(r, rnd.send_to, nb, ex, pair)
                    mine.append(m)
            for m in mine:
                m.round_bytes = sum(x.nbytes for x in mine)
        if len([run for run in runs if run]) == 1:  # one partner all along: no switch (the
            for m in runs[-1]:  # curve is a switch's cost), the link's exchange efficiency
                m.round_bytes = 0
    return msgs, exact


class _Rank:
    """One rank's process: a generator of :data:`_Step` in the engine's order."""

    def __init__(self, sim: _Sim, r: int):
        self.sim, self.r = sim, r
        self.rp = sim.plan[r]
        self.slow = sim.host.cpu_slowdown
        self.encoded = [False] * sim.sched.num_chunks
        self.last_recv: dict[int, int] = {}
        for k, rnd in enumerate(self.rp):
            for op in rnd.recvs:
                self.last_recv[op.chunk] = k
        self.deferred: list[tuple[int, int]] = []  # (round, piece values)
        self.decoded: set[tuple[int, int]] = set()
        self.decode_cost: dict[int, CodecCost] = {}
        self.posted: dict[int, list[_Recv]] = {}
        self.early: tuple[list[_Send], int] | None = None

    def fixed(self, k: int) -> bool:
        return all(msg.exact for *_, msg in self.recv_list(k))

    def recv_list(self, k: int) -> list[_Recv]:
        rnd = self.rp[k]
        out = []
        for op in rnd.recvs:
            for j, (a, b) in enumerate(self.sim.pieces[op.chunk]):
                out.append((op, j, b - a, self.sim.msgs[(rnd.recv_from, self.r, k, op.chunk, j)]))
        return out

    def send_items(self, k: int, prev: list[Any]) -> list[_Send]:
        where = {(op.chunk, j): i for i, (op, j, _, _) in enumerate(prev)}
        return [
            (sop, j, b - a, where.get((sop.chunk, j), -1))
            for sop in self.rp[k].sends
            for j, (a, b) in enumerate(self.sim.pieces[sop.chunk])
        ]

    def issue(self, k: int, items: list[_Send], pos: int, done: int) -> Generator[_Step, None, int]:
        """Send round ``k``'s pieces from ``pos`` on whose input is ready (position <= done)."""
        rnd = self.rp[k]
        while pos < len(items) and items[pos][3] <= done:
            sop, j, m, _ = items[pos]
            pos += 1
            cc = self.sim.cost_of(sop.codec)
            if sop.encode:
                t = cc.encode(m)
                if self.encoded[sop.chunk]:  # an encoded local value (another codec's)
                    t += self.decode_cost.get(sop.chunk, cc).decode(m)
                yield ("cpu", (t * self.slow, "encode"))
            msg = self.sim.msgs[(self.r, rnd.send_to, k, sop.chunk, j)]
            yield ("cpu", (self.sim.host.send(msg.nbytes) * self.slow, "send"))
            yield ("send", msg)
        return pos

    def run(self) -> Generator[_Step, None, None]:
        yield from self.prologue()
        for k in range(len(self.rp)):
            yield from self.round(k)
        yield from self.finish()

    def prologue(self) -> Generator[_Step, None, None]:
        sim, r = self.sim, self.r
        if callable(getattr(sim.c, "prologue", None)):
            yield ("cpu", (sim.costs.prologue(sim.numel) * self.slow, "prologue"))
            # its exchange: a latency a step (one out and one back at least), and its bytes
            # at the slowest link's goodput
            n = sim.cluster.ranks
            links = [sim.cluster.link(r, p) for p in range(n) if p != r]
            lat = max(link.latency_s for link in links)
            rate = min(link.rate_bps * link.efficiency for link in links)
            nbytes, steps = sim.prologue
            yield ("idle", (max(2, steps) * lat + 8 * nbytes / rate, "prologue"))

    def post_receives(self, k: int, ahead: bool) -> Generator[_Step, None, list[_Recv]]:
        """Post round ``k``'s receives (unless posted a round ahead) and, looking ahead,
        round ``k + 1``'s; returns round ``k``'s."""
        if k in self.posted:
            incoming = self.posted.pop(k)
        else:
            incoming = self.recv_list(k)
            if self.fixed(k):
                for *_, msg in incoming:
                    yield ("post", msg)
        if ahead and self.fixed(k) and self.fixed(k + 1):
            self.posted[k + 1] = self.recv_list(k + 1)
            for *_, msg in self.posted[k + 1]:
                yield ("post", msg)
        return incoming

    def round(self, k: int) -> Generator[_Step, None, None]:
        sim, rnd = self.sim, self.rp[k]
        t_round = sim.clocks[self.r]
        ahead = sim.host.lookahead and k + 1 < len(self.rp)
        incoming = yield from self.post_receives(k, ahead)
        items, pos = self.early if self.early is not None else (self.send_items(k, []), 0)
        pos = yield from self.issue(k, items, pos, 1 << 62)
        for sop in rnd.sends:
            if sop.encode:
                self.encoded[sop.chunk] = True
                self.decode_cost[sop.chunk] = sim.cost_of(sop.codec)
        # (as the engine: early sends only on this round's connection, ScheduleRun._send_ahead)
        early = ahead and self.rp[k + 1].send_to == rnd.send_to
        nxt = self.send_items(k + 1, incoming) if early else None
        npos = 0
        if nxt is not None:
            npos = yield from self.issue(k + 1, nxt, 0, -1)
        for i, recv in enumerate(incoming):
            yield from self.receive(k, recv)
            if nxt is not None:
                npos = yield from self.issue(k + 1, nxt, npos, i)
        for op in rnd.recvs:
            self.encoded[op.chunk] = op.mode != "keep"
            self.decode_cost[op.chunk] = sim.cost_of(op.codec)
        self.early = (nxt, npos) if nxt is not None else None
        for sop in rnd.sends:
            for j in range(len(sim.pieces[sop.chunk])):
                yield ("wait_send", sim.msgs[(self.r, rnd.send_to, k, sop.chunk, j)])
        if self.r == 0:
            row = _round_row(k, t_round, sim.clocks[0], rnd, sim.msgs, 0, sim.pieces, sim.cluster)
            sim.rounds.append(row)

    def receive(self, k: int, recv: _Recv) -> Generator[_Step, None, None]:
        """One received piece: a deferred decode first, the wait, then its reduce."""
        op, j, m, msg = recv
        if self.deferred and self.deferred[0][0] < k:
            _, dm = self.deferred.pop(0)
            yield ("cpu", (self.sim.cost_of(op.codec).decode(dm) * self.slow, "decode"))
        if msg.posted is None:  # data-dependent size: header, then the payload
            yield ("post", msg)
        yield ("wait", msg)
        cc = self.sim.cost_of(op.codec)
        if op.mode == "fused":
            t = cc.reduce(m) + (cc.decode(m) if self.encoded[op.chunk] else 0.0)
            yield ("cpu", (t * self.slow, "reduce"))
        elif op.mode == "keep":
            t = cc.decode(m) + self.sim.host.add(m)
            yield ("cpu", (t * self.slow, "reduce"))
        if op.mode != "keep" and self.last_recv[op.chunk] == k:
            self.deferred.append((k, m))
            self.decoded.add((op.chunk, j))

    def finish(self) -> Generator[_Step, None, None]:
        """The deferred decodes, then every encoded piece not decoded yet."""
        sim = self.sim
        for _, dm in self.deferred:
            yield ("cpu", (sim.costs.decode(dm) * self.slow, "decode"))
        for ch in range(sim.sched.num_chunks):
            if self.encoded[ch]:
                for j, (a, b) in enumerate(sim.pieces[ch]):
                    if (ch, j) not in self.decoded:
                        t = self.decode_cost.get(ch, sim.costs).decode(b - a)
                        yield ("cpu", (t * self.slow, "decode"))


def simulate(
    codec: Any,
    schedule: Any,
    cluster: Cluster,
    numel: int,
    costs: CodecCost,
    host: Host,
    *,
    sub_chunk: int = 1 << 18,
    intra_costs: Callable[[Any], CodecCost] | None = None,
) -> Prediction:
    """Predict one all-reduce of ``numel`` fp32 values (module docstring).

    ``costs`` are the codec's kernel costs; a schedule step with its own codec (the
    hierarchical schedule's ``intra_codec``) costs ``intra_costs(that codec)``."""
    if numel < 1:
        raise ValueError(f"numel must be positive (got {numel})")
    n = cluster.ranks
    c = get_codec(codec)
    sched = get_schedule(schedule, n)
    plan = plan_schedule(sched, c)
    _, pieces = chunk_layout(numel, sched, c, sub_chunk)
    key = json_key(c)
    msgs, exact = _make_msgs(plan, pieces, n)
    clocks = [0.0] * n
    phases = [dict.fromkeys(PHASES, 0.0) for _ in range(n)]
    cost_of = _CostOf(c, key, costs, intra_costs)
    sim = _Sim(c, sched, plan, pieces, msgs, cluster, costs, host, numel, cost_of, clocks)
    sim.prologue = prologue_exchange(c, n, numel)
    runner = _Runner([_Rank(sim, r).run() for r in range(n)], clocks, phases, _Net(cluster), host)
    runner.run()
    sent = [sim.prologue[0]] * n
    for m in msgs.values():
        sent[m.src] += m.nbytes
    carried = 2 * (n - 1) / n * numel
    mean_sent = sum(sent) / n
    return Prediction(
        codec=key if not isinstance(codec, str) else codec,
        schedule=sched.name,
        seconds=max(clocks),
        bits_per_value=8 * mean_sent / carried,
        bytes_sent_per_rank=mean_sent,
        exact_bytes=exact,
        phases={ph: sum(p[ph] for p in phases) / n for ph in PHASES},
        rounds=sim.rounds,
        per_rank_seconds=list(clocks),
        cpu_steps_per_rank=sum(runner.steps) / n,
    )


def json_key(codec: Any) -> str:
    import json

    return json.dumps(get_codec(codec).get_config(), sort_keys=True)


def _round_row(
    k: int, t0: float, t1: float, rnd: Any, msgs: Any, r: int, pieces: Any, cluster: Cluster
) -> dict[str, float]:
    nbytes = sum(
        msgs[(r, rnd.send_to, k, sop.chunk, j)].nbytes
        for sop in rnd.sends
        for j in range(len(pieces[sop.chunk]))
    )
    link = cluster.link(r, rnd.send_to) if rnd.send_to is not None else cluster.inter
    return {
        "round": k,
        "start": t0,
        "end": t1,
        "bytes_sent": nbytes,
        "wire_seconds": link.seconds(nbytes),
        "latency_seconds": link.latency_s,
    }


class _Runner:
    """Advance the rank with the earliest clock, one step at a time; a rank waiting for a
    message not yet sent (or not yet on the wire) sleeps until it is."""

    def __init__(
        self,
        gens: list[Generator[_Step, None, None]],
        clocks: list[float],
        phases: list[dict[str, float]],
        net: _Net,
        host: Host,
    ):
        self.gens, self.clocks, self.phases, self.net = gens, clocks, phases, net
        self.tie = itertools.count()
        self.ready: list[tuple[float, int, int]] = [
            (0.0, next(self.tie), r) for r in range(len(gens))
        ]
        self.blocked: dict[int, tuple[int, _Msg, str]] = {}  # id(msg) -> (rank, msg, kind)
        self.pending: dict[int, _Msg] = {}  # issued or posted, not both yet
        #: when each shared core is free again (``Host.cores``; None: a core per rank)
        self.cores: list[float] | None = [0.0] * host.cores if host.cores else None
        self.overhead = host.step_overhead
        self.steps = [0] * len(gens)  # CPU steps per rank

    def _advance(self, rank: int, t: float) -> None:
        """``rank`` waited until ``t``; it is ready again."""
        self.phases[rank]["wait"] += max(0.0, t - self.clocks[rank])
        self.clocks[rank] = max(self.clocks[rank], t)
        heapq.heappush(self.ready, (self.clocks[rank], next(self.tie), rank))

    def _wake(self, m: _Msg) -> None:
        b = self.blocked.pop(id(m), None)
        if b is not None:
            rank, _, kind = b
            t = m.arrival if kind == "wait" else m.end
            assert t is not None
            self._advance(rank, t)

    def _maybe_schedule(self, m: _Msg) -> None:
        if m.issued is not None and m.posted is not None and m.end is None:
            self.pending.pop(id(m), None)
            self.net.schedule(m)
            self._wake(m)
        else:
            self.pending[id(m)] = m

    def _step(self, r: int, kind: str, arg: Any) -> bool:
        """Apply one step of rank ``r``; True: the rank goes on at once."""
        if kind in ("cpu", "idle"):
            dt, ph = arg
            if kind == "cpu" and dt > 0:
                dt += self.overhead
                self.steps[r] += 1
                if self.cores is not None:  # wait for the first core free
                    free = heapq.heappop(self.cores)
                    start = max(self.clocks[r], free)
                    self.phases[r]["cores"] += start - self.clocks[r]
                    self.clocks[r] = start
                    heapq.heappush(self.cores, start + dt)
            self.clocks[r] += dt
            self.phases[r][ph] += dt
            heapq.heappush(self.ready, (self.clocks[r], next(self.tie), r))
            return False
        if kind in ("send", "post"):
            if kind == "send":
                arg.issued = self.clocks[r]
            else:
                arg.posted = self.clocks[r]
            self._maybe_schedule(arg)
            return True
        # "wait" (for its arrival) or "wait_send" (for its last byte to leave)
        t = arg.arrival if kind == "wait" else arg.end
        if t is None:
            self.blocked[id(arg)] = (r, arg, kind)
            return False
        self._advance(r, t)
        return False

    def run(self) -> None:
        while self.ready:
            _, _, r = heapq.heappop(self.ready)
            for kind, arg in self.gens[r]:
                if not self._step(r, kind, arg):
                    break
        if self.blocked:
            raise RuntimeError(
                f"the simulation deadlocked with {len(self.blocked)} rank(s) waiting"
            )
