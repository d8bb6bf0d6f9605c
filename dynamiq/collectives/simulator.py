"""The batched simulator: every rank of a schedule in one process, one codec call per round.

:func:`simulate_schedule` computes what the engine (:mod:`dynamiq.collectives.engine`)
computes on every rank, bit for bit (outputs, certified bounds, bytes), without threads or
mailboxes: it walks the plan round by round (:class:`~dynamiq.collectives.planning.Plan`,
made lazily, in memory linear in ranks × chunks) and, in each round, encodes the values of all
ranks that one codec encodes with contexts that codec does not tell apart in **one** call on
their concatenation (see :func:`batch_fields`). That is exact because

* every chunk is a whole number of the codec's blocks, aligned to global offsets (the
  engine's cut, :func:`~dynamiq.collectives.planning.chunk_layout`), and these codecs encode
  each block on its own (the engine's sub-chunk invariant), so a concatenation of chunks
  encodes as the chunks do; the one chunk that ends in a partial block (the buffer's tail)
  goes last in its call;
* a fused ``reduce`` of a re-quantizing codec is bit-identical to encoding ``decode(payload)
  + local`` (the :class:`~dynamiq.codecs.Codec` contract), and decoding is deterministic, so
  each encoding is decoded once and every rank that holds its bytes uses those values.

Pooled DynamiQ (its span budgets from the prologue's result, by global offset) is batched too:
each call's context gathers the budgets of its chunks' spans (``_dynamiq_pool.gathered``), and
each span is encoded on its own. Codecs whose encoding depends on the rank, the offset or a
prologue's result otherwise (stochastic rounding, THC, OmniReduce), homomorphic codecs and
codecs this module does not know (plugins, subclasses) run per rank and per sub-chunk, exactly
as the engine calls them.
``tests/collectives/test_batched_simulator.py`` checks bit-identity with the threaded run of
the engine for every registered codec and schedule.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynamiq.codecs import Codec, HopContext
from dynamiq.codecs._dynamiq_pool import gathered
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.codecs.intq import IntCodec
from dynamiq.codecs.mx import MXFP4, MXFP6E2M3, MXFP6E3M2, MXFP8E4M3, MXFP8E5M2, MXINT8
from dynamiq.codecs.passthrough import BF16Codec, FP16Codec, FP32Codec

from .bounds import fp32_add_slack as _slack
from .bounds import group_size as _group_size
from .engine import EngineResult
from .handshake import allreduce_steps, local_prologues
from .integrity import message_extra
from .planning import CtxKey, Plan, chunk_layout, layout_align, prologue_bounds
from .schedules import Schedule

__all__ = ["SimRun", "batch_fields", "prologue_shared", "simulate_schedule"]

#: codec classes (exactly these, not subclasses) whose encode, decode, size and bound read
#: no field of the HopContext
_CONTEXT_FREE = (
    FP32Codec,
    BF16Codec,
    FP16Codec,
    MXFP8E4M3,
    MXFP8E5M2,
    MXFP6E3M2,
    MXFP6E2M3,
    MXFP4,
    MXINT8,
)


def batch_fields(codec: Codec) -> tuple[str, ...] | None:
    """The :class:`HopContext` fields that ``codec`` reads (encodings that agree on them may
    share one call on their concatenated chunks), or ``None``: it is called per rank.

    INT with nearest rounding reads none (stochastic rounding hashes rank and offset); DynamiQ
    with nearest rounding reads ``hop`` and ``num_hops`` when ``hop_slope`` moves its budget.
    Pooled DynamiQ also reads ``offset`` and ``shared`` (its budgets come from the prologue, by
    global offset): a batched call gets the budgets of its chunks gathered (:func:`_gathers`).
    """
    cls = type(codec)
    if callable(getattr(codec, "prologue", None)) and cls is not DynamiqCodec:
        return None
    if cls in _CONTEXT_FREE:
        return ()
    if cls is IntCodec:
        return () if codec.rounding == "nearest" else None  # type: ignore[attr-defined]
    if cls is DynamiqCodec:
        if codec.rounding != "nearest":  # type: ignore[attr-defined]
            return None
        return () if codec.hop_slope == 0 else ("hop", "num_hops")  # type: ignore[attr-defined]
    return None


def _gathers(codec: Codec) -> bool:
    """Whether ``codec``'s budgets come from a prologue's result by global offset (pooled
    DynamiQ): a batched call on concatenated chunks then gets a context whose ``shared``
    gathers each chunk's span budgets (``_dynamiq_pool.gathered``)."""
    return (
        isinstance(codec, DynamiqCodec)
        and type(codec) is DynamiqCodec
        and codec.pooling == "bucket"
    )


#: where each field batch_fields names sits in a compact context (planning.CtxKey)
_KEY_POS = {"hop": 0, "num_hops": 1, "rank": 2, "contributions": 3}


@dataclass
class _Enc:
    """An encoding of one chunk: its decoded values (per group of ranks with equal prologue
    results), its bound, its wire bytes; the payload of each sub-chunk where it is needed
    again (codecs called per rank)."""

    ci: int
    ch: int
    key: CtxKey
    values: dict[int, torch.Tensor]
    bound: torch.Tensor | None
    nbytes: int
    payloads: list[torch.Tensor] | None = None
    packed: bool = False


@dataclass
class _Item:
    """A value to encode: ``rank`` encodes ``v`` (chunk ``ch``) with ``ci``/``key``; its bound
    before the encoding is ``base``; ``fused``: the received message of a fused reduce."""

    rank: int
    ch: int
    v: torch.Tensor
    base: torch.Tensor | None
    ci: int
    key: CtxKey
    fused: tuple[_Enc, torch.Tensor, CtxKey] | None = None  # (message, local, its ctx)


@dataclass
class SimRun:
    """What :func:`simulate_schedule` computed: each rank's :class:`EngineResult` (output in
    fp32, bound, byte counters, as the engine reports them; ``seconds`` are the whole
    simulation's phases) and ``round_bytes[k, r]``, the payload bytes (with length headers)
    rank ``r`` sends in round ``k``."""

    results: list[EngineResult]
    round_bytes: np.ndarray
    seconds: dict[str, float] = field(default_factory=dict)


class _Sim:
    def __init__(
        self,
        xs: Sequence[torch.Tensor],
        codec: Codec,
        schedule: Schedule,
        seed: int,
        step: int,
        sub_chunk: int,
        return_bound: bool,
    ) -> None:
        self.n, self.numel = schedule.world_size, xs[0].numel()
        self.schedule, self.sub_chunk, self.return_bound = schedule, sub_chunk, return_bound
        self.plan = Plan(schedule, codec, seed=seed, step=step)
        self.codecs = self.plan.codecs
        self.bounds, self.pieces = chunk_layout(self.numel, schedule, codec, sub_chunk)
        self.align = layout_align(schedule, codec)  # what a prologue may re-cut the chunks on
        # the engine's phases; nothing agrees over a wire or waits for a peer here
        self.seconds: dict[str, float] = {"agree": 0.0, "wait": 0.0}
        n = self.n
        self.work = torch.stack([x.detach().to(torch.float32) for x in xs]).reshape(n, -1)
        self.beta = torch.zeros(n, self.numel, dtype=torch.float64) if return_bound else None
        self.state: list[list[_Enc | None]] = [[None] * schedule.num_chunks for _ in range(n)]
        self.sent = [0] * n
        self.received = [0] * n
        self.checks = [0] * n  # the seals of the prologue's messages (control bytes)
        self.bound_sent = [0] * n
        self.shared: list[Mapping[str, Any] | None] = [None] * n
        self.group = [0] * n  # ranks with equal prologue results decode alike
        self._ctx: dict[tuple[CtxKey, int, int], HopContext] = {}
        self._nbytes: dict[tuple[int, Hashable, int], int] = {}
        self._fields = [batch_fields(c) for c in self.codecs]
        self._gather = [_gathers(c) for c in self.codecs]
        self._budgets: dict[tuple[int, Hashable, int, int], torch.Tensor | None] = {}

    def batch_key(self, ci: int, key: CtxKey) -> Hashable | None:
        """What encodings with codec ``ci`` must agree on to share a call (``None``: never)."""
        fields = self._fields[ci]
        return None if fields is None else tuple(key[_KEY_POS[f]] for f in fields)

    # -- contexts and sizes -----------------------------------------------------------------

    def octx(self, key: CtxKey, offset: int, rank: int) -> HopContext:
        """The engine's context of an encoding at ``offset``, on ``rank`` (its prologue)."""
        g = self.group[rank]
        ctx = self._ctx.get((key, offset, g))
        if ctx is None:
            ctx = dataclasses.replace(
                self.plan.context(key), offset=offset, shared=self.shared[rank]
            )
            self._ctx[key, offset, g] = ctx
        return ctx

    def tick(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - t0
        return now

    def chunk_nbytes(self, ci: int, key: CtxKey, ch: int, bkey: Hashable, rank: int) -> int:
        """Wire bytes of chunk ``ch`` (its sub-chunks) for a codec of sizes known in advance
        (for a gathering codec, those of the chunk's place, on ``rank``'s prologue result)."""
        codec = self.codecs[ci]
        if self._gather[ci]:
            k0 = (ci, ("chunk", bkey, ch, self.group[rank]), 0)
            got = self._nbytes.get(k0)
            if got is None:
                sizes = [
                    codec.encoded_nbytes(b - a, self.octx(key, a, rank)) for a, b in self.pieces[ch]
                ]
                got = self._nbytes[k0] = sum(int(z) for z in sizes if z is not None)
            return got
        total = 0
        for a, b in self.pieces[ch]:
            k = (ci, bkey, b - a)
            size = self._nbytes.get(k)
            if size is None:
                got = codec.encoded_nbytes(b - a, self.octx(key, a, 0))
                assert got is not None
                size = self._nbytes[k] = got
            total += size
        return total

    # -- values ------------------------------------------------------------------------------

    def value_of(self, enc: _Enc, rank: int) -> torch.Tensor:
        """The decoded values of ``enc`` on ``rank`` (decoded once per group of ranks)."""
        g = self.group[rank]
        v = enc.values.get(g)
        if v is None:
            assert enc.payloads is not None
            codec = self.codecs[enc.ci]
            t = time.perf_counter()
            parts = [
                codec.decode(p, b - a, self.octx(enc.key, a, rank))
                for p, (a, b) in zip(enc.payloads, self.pieces[enc.ch], strict=True)
            ]
            v = enc.values[g] = torch.cat(parts) if len(parts) > 1 else parts[0]
            self.tick("decode", t)
        return v

    def local(self, rank: int, ch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        enc = self.state[rank][ch]
        if enc is None:
            a, b = self.bounds[ch]
            return self.work[rank, a:b], (self.beta[rank, a:b] if self.beta is not None else None)
        return self.value_of(enc, rank), enc.bound

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, items: list[_Item]) -> list[_Enc]:
        """Encode ``items``: batched calls where :func:`batch_fields` allows, else per rank."""
        out: list[_Enc | None] = [None] * len(items)
        batches: dict[tuple[int, Hashable, int], list[int]] = {}
        for i, it in enumerate(items):
            bkey = self.batch_key(it.ci, it.key)
            if bkey is None:
                out[i] = self.encode_alone(it)
            else:  # (a gathering codec's budgets come from the rank's prologue result)
                grp = self.group[it.rank] if self._gather[it.ci] else 0
                batches.setdefault((it.ci, bkey, grp), []).append(i)
        for (ci, bkey, _g), idx in batches.items():
            block = self.codecs[ci].block_size
            whole = [i for i in idx if items[i].v.numel() % block == 0]
            tails = [i for i in idx if items[i].v.numel() % block != 0]
            # a partial block may only end a call: one tail per call
            groups = [whole + tails[:1]] + [[i] for i in tails[1:]]
            for g in (g for g in groups if g):
                encs = self.encode_batch([items[i] for i in g], bkey)
                for i, enc in zip(g, encs, strict=True):
                    out[i] = enc
        assert all(e is not None for e in out)
        return out  # type: ignore[return-value]

    def encode_batch(self, items: list[_Item], bkey: Hashable) -> list[_Enc]:
        ci = items[0].ci
        codec = self.codecs[ci]
        group = self.group[items[0].rank] if self._gather[ci] else 0
        t = time.perf_counter()
        lens = [it.v.numel() for it in items]
        total = sum(lens)
        x = torch.cat([it.v for it in items]) if len(items) > 1 else items[0].v.contiguous()
        ctx = self.batch_ctx(items, total)
        if total:
            dec = codec.decode(codec.encode(x, ctx), total, ctx)
            err = codec.error_bound.max_abs_error(x, ctx) if self.return_bound else None
        else:
            dec, err = x, (torch.zeros(0, dtype=torch.float64) if self.return_bound else None)
        self.tick("encode", t)
        decs = torch.split(dec, lens)
        errs = torch.split(err, lens) if err is not None else [None] * len(items)
        encs = []
        for it, d, e in zip(items, decs, errs, strict=True):
            bound = None
            if e is not None:
                assert it.base is not None
                bound = it.base + e
            nbytes = self.chunk_nbytes(ci, it.key, it.ch, bkey, it.rank)
            encs.append(_Enc(ci, it.ch, it.key, {group: d}, bound, nbytes))
        return encs

    def batch_ctx(self, items: list[_Item], total: int) -> HopContext:
        """The context of one call on the concatenated values of ``items``: the first one's,
        for a gathering codec with each chunk's budgets gathered from offset 0."""
        it0 = items[0]
        ctx = self.octx(it0.key, self.bounds[it0.ch][0], it0.rank)
        if not self._gather[it0.ci] or ctx.shared is None:
            return ctx
        parts = [self.chunk_budgets(it.ci, it.key, it.ch, it.rank) for it in items]
        if any(p is None for p in parts):  # no pooling result: the uniform budgets
            return ctx
        shared = gathered(self.codecs[it0.ci], ctx.shared, parts, total)  # type: ignore[arg-type]
        return dataclasses.replace(ctx, offset=0, shared=shared)

    def chunk_budgets(self, ci: int, key: CtxKey, ch: int, rank: int) -> torch.Tensor | None:
        """The span budgets (bytes) of chunk ``ch`` as the engine's calls on its sub-chunks
        get them on ``rank`` (memoized: they depend on the place, not on the values)."""
        k = (ci, self.batch_key(ci, key), ch, self.group[rank])
        if k not in self._budgets:
            codec: Any = self.codecs[ci]
            parts = [
                codec._pooled_bytes(b - a, self.octx(key, a, rank)) for a, b in self.pieces[ch]
            ]
            ok = parts and all(p is not None for p in parts)
            self._budgets[k] = torch.cat(parts) if ok else None
        return self._budgets[k]

    def encode_alone(self, it: _Item) -> _Enc:
        """The engine's calls, one per sub-chunk, on the encoding rank (its prologue)."""
        codec = self.codecs[it.ci]
        a0 = self.bounds[it.ch][0]
        t = time.perf_counter()
        payloads, decs, bounds, nbytes = [], [], [], 0
        for j, (a, b) in enumerate(self.pieces[it.ch]):
            v = it.v[a - a0 : b - a0].contiguous()
            c = self.octx(it.key, a, it.rank)
            if it.fused is None:
                p = codec.encode(v, c)
            else:
                msg, local, in_key = it.fused
                in_c = self.octx(in_key, a, it.rank)
                assert msg.payloads is not None
                p = codec.reduce(msg.payloads[j], local[a - a0 : b - a0].contiguous(), in_c, c)
            payloads.append(p)
            decs.append(codec.decode(p, b - a, c))
            if self.return_bound:
                bounds.append(codec.error_bound.max_abs_error(v, c))
            nbytes += p.numel() + (8 if codec.encoded_nbytes(b - a, c) is None else 0)
        self.tick("encode", t)
        dec = torch.cat(decs) if len(decs) > 1 else decs[0]
        bound = None
        if self.return_bound:
            assert it.base is not None
            bound = it.base + (torch.cat(bounds) if len(bounds) > 1 else bounds[0])
        return _Enc(it.ci, it.ch, it.key, {self.group[it.rank]: dec}, bound, nbytes, payloads)

    # -- bounds on the wire --------------------------------------------------------------------

    def pack(self, sent: list[_Enc]) -> None:
        """Give each sent encoding's bound the value its receiver gets: the maximum of each
        group of ``max(bound_block, 32)`` elements of each sub-chunk (as the engine sends it)."""
        if self.beta is None:
            return
        by_group: dict[int, list[_Enc]] = {}
        for e in sent:
            if not e.packed:
                e.packed = True
                by_group.setdefault(_group_size(self.codecs[e.ci]), []).append(e)
        for g, encs in by_group.items():
            lens = [b - a for e in encs for a, b in self.pieces[e.ch]]
            size = np.array(lens, dtype=np.int64)
            padded = -(-size // g) * g
            start = np.cumsum(padded) - padded  # each sub-chunk's place, in whole groups
            first = np.cumsum(size) - size
            total = int(size.sum())
            pos = torch.from_numpy(np.repeat(start - first, size) + np.arange(total))
            vals = torch.cat([e.bound for e in encs if e.bound is not None])
            room = torch.zeros(int(padded.sum()), dtype=torch.float64)
            room[pos] = vals
            back = room.view(-1, g).amax(dim=1)[torch.div(pos, g, rounding_mode="floor")]
            chunk_lens = [e.bound.numel() for e in encs if e.bound is not None]
            for e, bnd in zip(encs, torch.split(back, chunk_lens), strict=True):
                e.bound = bnd

    def bound_nbytes(self, ci: int, ch: int) -> int:
        g = _group_size(self.codecs[ci])
        return sum(-(-(b - a) // g) * 8 for a, b in self.pieces[ch])

    # -- the run -------------------------------------------------------------------------------

    def run(self, xs: Sequence[torch.Tensor]) -> SimRun:
        t0 = time.perf_counter()
        self.prologue(xs)
        rounds = np.zeros((self.plan.stop - self.plan.start, self.n), dtype=np.int64)
        for ops in self.plan.rounds():
            k = ops.round
            # sends: forward the bytes held, or encode (all fresh encodings of the round at once)
            items: list[_Item] = []
            msgs: dict[tuple[int, int], _Enc] = {}
            for r, _dst, ch, ci, fresh, key in ops.sends:
                if fresh:
                    v, vb = self.local(r, ch)
                    items.append(_Item(r, ch, v, vb, ci, key))
                else:
                    held = self.state[r][ch]
                    assert held is not None
                    msgs[r, ch] = held
            for it, enc in zip(items, self.encode(items), strict=True):
                self.state[it.rank][it.ch] = msgs[it.rank, it.ch] = enc
            self.pack([msgs[r, ch] for r, _d, ch, *_ in ops.sends])
            for r, dst, ch, ci, _fresh, _key in ops.sends:
                nb = msgs[r, ch].nbytes
                self.sent[r] += nb
                self.received[dst] += nb
                rounds[k - self.plan.start, r] += nb
                if self.beta is not None:
                    self.bound_sent[r] += self.bound_nbytes(ci, ch)
            self.receive(ops.recvs, msgs)
        results = self.finish()
        self.seconds["total"] = time.perf_counter() - t0
        for r, res in enumerate(results):
            res.seconds = dict(self.seconds)
            res.round_bytes = rounds[:, r].tolist()
        return SimRun(results, rounds, dict(self.seconds))

    def receive(self, recvs: list[Any], msgs: dict[tuple[int, int], _Enc]) -> None:
        t = time.perf_counter()
        todo = []
        for r, src, ch, ci, mode, key, out in recvs:
            msg = msgs[src, ch]
            if mode == "copy":
                self.state[r][ch] = msg
            else:
                todo.append((r, ch, ci, mode, key, out, msg))
        if not todo:
            return
        # v = decode(message) + local, for every reduce of the round at once
        lens, incoming, locals_, pbs, lbs = [], [], [], [], []
        for r, ch, _ci, _mode, _key, _out, msg in todo:
            lv, lb = self.local(r, ch)
            incoming.append(self.value_of(msg, r))
            locals_.append(lv)
            lens.append(lv.numel())
            pbs.append(msg.bound)
            lbs.append(lb)
        v_all = torch.cat(incoming) + torch.cat(locals_)
        vs = torch.split(v_all, lens)
        bases: Sequence[torch.Tensor | None] = [None] * len(todo)
        if self.beta is not None:
            pb = torch.cat([b for b in pbs if b is not None])
            lb = torch.cat([b for b in lbs if b is not None])
            bases = torch.split(pb + lb + _slack(v_all), lens)
        items = []
        for (r, ch, ci, mode, key, out, msg), v, base, lv in zip(
            todo, vs, bases, locals_, strict=True
        ):
            if mode == "keep":
                a, b = self.bounds[ch]
                self.work[r, a:b] = v
                if self.beta is not None:
                    assert base is not None
                    self.beta[r, a:b] = base
                self.state[r][ch] = None
                continue
            assert out is not None
            alone = self.batch_key(ci, out) is None
            fused = (msg, lv, key) if alone else None
            items.append(_Item(r, ch, v, base, ci, out, fused))
        self.tick("reduce", t)
        for it, enc in zip(items, self.encode(items), strict=True):
            self.state[it.rank][it.ch] = enc

    def prologue(self, xs: Sequence[torch.Tensor]) -> None:
        """Run a codec's prologue on every rank (threads: its exchange is collective)."""
        codec = self.codecs[0]
        fn = getattr(codec, "prologue", None)
        if not callable(fn):
            return
        t = time.perf_counter()
        if callable(getattr(codec, "prologue_statistics", None)):
            self.reduced_prologue(codec, xs)
        else:
            # the engine's chunks, as its prologue gets them
            shared, comms = local_prologues(
                codec, list(xs), list(self.bounds), recut_align=self.align
            )
            self.shared = list(shared)
            for r, comm in enumerate(comms):
                self.sent[r] += comm.bytes_sent
                self.received[r] += comm.bytes_received
                self.checks[r] += comm.check_bytes_sent
        for r in range(self.n):
            self.group[r] = next(q for q in range(r + 1) if _same(self.shared[q], self.shared[r]))
        recut = prologue_bounds(self.shared[0], self.numel, self.schedule, codec)
        if recut is not None:  # the engine cuts by the prologue's bounds: so does this
            self.bounds, self.pieces = chunk_layout(
                self.numel, self.schedule, codec, self.sub_chunk, recut
            )
        self.tick("prologue", t)

    def reduced_prologue(self, codec: Any, xs: Sequence[torch.Tensor]) -> None:
        """A prologue that is one exact all-reduce of per-rank statistics, in process: the
        same result as the engine's (:meth:`PrologueComm.allreduce`), whose bytes are
        counted step by step (:func:`~dynamiq.collectives.handshake.allreduce_steps`)."""
        chunks = list(self.bounds)
        got = _reduce_statistics(
            codec, (codec.prologue_statistics(xs[r], r, chunks) for r in range(self.n))
        )
        if got is None:  # the codec's prologue has nothing to agree on here
            self.shared = [None] * self.n
            return
        red, first = got
        shared = codec.prologue_result(red, xs[0].numel(), self.n, chunks, self.align)
        self.shared = [shared] * self.n
        n, length, size = self.n, first.numel(), first.element_size()
        if n == 1 or length == 0:
            return
        seal = message_extra(first) * size  # each non-empty message is sealed
        for r in range(n):
            for to, (a, b), frm, (c, d), _ in allreduce_steps(n, length, r):
                if to is not None:
                    self.sent[r] += size * (b - a)
                    self.checks[r] += seal
                if frm is not None:
                    self.received[r] += size * (d - c)

    def finish(self) -> list[EngineResult]:
        """Each rank's output: its raw values, and the decoded bytes of what it holds encoded
        (ranks holding the same encodings share the work)."""
        t = time.perf_counter()
        done: dict[tuple[Any, ...], int] = {}
        control = [c + k for c, k in zip(_handshake_bytes(self), self.checks, strict=True)]
        results = []
        for r in range(self.n):
            row = self.state[r]
            sig = (self.group[r], *[id(e) if e is not None else ("raw", r) for e in row])
            first = done.setdefault(sig, r)
            if first != r:
                self.work[r] = self.work[first]
                if self.beta is not None:
                    self.beta[r] = self.beta[first]
            else:
                for ch, enc in enumerate(row):
                    if enc is None:
                        continue
                    a, b = self.bounds[ch]
                    self.work[r, a:b] = self.value_of(enc, r)
                    if self.beta is not None:
                        assert enc.bound is not None
                        self.beta[r, a:b] = enc.bound
            results.append(
                EngineResult(
                    output=self.work[r],
                    bound=self.beta[r] if self.beta is not None else None,
                    bytes_sent=self.sent[r],
                    bytes_received=self.received[r],
                    bound_bytes_sent=self.bound_sent[r],
                    control_bytes_sent=control[r],
                )
            )
        self.tick("decode", t)
        return results


def _reduce_statistics(
    codec: Any, stats: Iterable[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact all-reduce (``codec.prologue_op``: max, min or sum, in int64) of the ranks'
    prologue statistics, taken one rank at a time, in their dtype; and rank 0's statistics
    (their shape and dtype). ``None`` when the statistics are ``None`` (nothing to agree on)."""
    op = codec.prologue_op
    acc: torch.Tensor | None = None
    first: torch.Tensor | None = None
    for s in stats:
        if s is None:
            return None
        v = s.to(torch.int64)
        if acc is None:
            acc, first = v, s
        elif op == "max":
            acc = torch.maximum(acc, v)
        elif op == "min":
            acc = torch.minimum(acc, v)
        else:
            acc = acc + v
    if acc is None or first is None:
        return None
    return acc.to(first.dtype), first


def prologue_shared(
    codec: Codec, buffers: Iterable[torch.Tensor], schedule: Schedule
) -> Mapping[str, Any] | None:
    """What every rank's prologue returns (``HopContext.shared``) for a codec whose prologue is
    one exact all-reduce of per-rank statistics (``prologue_statistics``, ``prologue_op``,
    ``prologue_result``: pooled DynamiQ, nvfp4's tensor scale), taken one rank at a time:
    ``buffers`` yields rank 0's whole buffer, then rank 1's, ... (``schedule.world_size`` of
    them; they may be made lazily), so memory holds one buffer and the running reduction. The
    same result as the engine's prologue and :func:`simulate_schedule`'s. ``None`` for a codec
    without a prologue or with nothing to agree on; ``TypeError`` for another kind of prologue
    (an all-gather, a rank's own rule)."""
    if not callable(getattr(codec, "prologue", None)):
        return None
    if not callable(getattr(codec, "prologue_statistics", None)):
        raise TypeError(f"{codec!r}'s prologue is not an all-reduce of statistics")
    n = schedule.world_size
    chunks: list[tuple[int, int]] | None = None
    numel = -1

    def stats() -> Iterator[torch.Tensor | None]:
        nonlocal chunks, numel
        count = 0
        for r, x in enumerate(buffers):
            if chunks is None:
                numel = x.numel()
                chunks = list(chunk_layout(numel, schedule, codec, 1)[0])
            elif x.numel() != numel:
                raise ValueError(f"rank {r}'s buffer has {x.numel()} values, rank 0's {numel}")
            count += 1
            yield codec.prologue_statistics(x, r, chunks)  # type: ignore[attr-defined]
        if count != n:
            raise ValueError(f"schedule is for {n} ranks, got {count} buffers")

    got = _reduce_statistics(codec, stats())
    if got is None:
        return None
    return codec.prologue_result(  # type: ignore[attr-defined]
        got[0], numel, n, chunks, layout_align(schedule, codec)
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):  # e.g. tensors inside
        return a is b


def _handshake_bytes(sim: _Sim) -> list[int]:
    """What the engine's configuration check (``handshake.agree``) sends from each rank when
    the ranks agree: 64 bytes in each of ``ceil(log2 n)`` rounds."""
    rounds = (sim.n - 1).bit_length()
    return [64 * rounds] * sim.n


def simulate_schedule(
    xs: Sequence[torch.Tensor],
    codec: Codec,
    schedule: Schedule,
    *,
    seed: int = 0,
    step: int = 0,
    sub_chunk: int = 1 << 18,
    return_bound: bool = True,
) -> SimRun:
    """All-reduce ``xs`` (1-D, one per rank, equal sizes) as the engine would on every rank.

    ``return_bound=False`` skips every bound computation (and the bound bytes).
    """
    if len(xs) != schedule.world_size:
        raise ValueError(f"schedule is for {schedule.world_size} ranks, got {len(xs)} tensors")
    sim = _Sim(xs, codec, schedule, seed, step, sub_chunk, return_bound)
    return sim.run(xs)
