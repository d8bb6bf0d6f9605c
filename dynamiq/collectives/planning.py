"""Planning: what every rank does in every round of a schedule, and how a buffer is cut.

A plan is a pure function of the schedule, the codec and the seed/step, so every rank computes
the same one: which encoding is which hop (``HopContext``), whether a received partial sum is
copied, reduced and re-encoded at once (``fused``) or kept as an exact fp32 sum (``keep``).
Chunks are cut on multiples of the codecs' block sizes, aligned to global offsets, and split
into sub-chunks (also block multiples), so nothing a codec decides depends on the cut.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dynamiq.codecs import Codec, HopContext, get_codec
from dynamiq.codecs.base import check_int

from .schedules import Schedule, schedule_shape

__all__ = [
    "CHUNK_BOUNDS_KEY",
    "Plan",
    "RecvOp",
    "RoundOps",
    "RoundPlan",
    "SendOp",
    "check_bounds",
    "chunk_bounds",
    "chunk_layout",
    "chunk_sizes",
    "plan_schedule",
]


@dataclass(frozen=True)
class SendOp:
    chunk: int
    codec: Codec
    ctx: HopContext  # the context the payload is (or gets) encoded with (offset 0)
    encode: bool  # encode a raw value (True) or forward bytes held (False)


@dataclass(frozen=True)
class RecvOp:
    chunk: int
    codec: Codec
    ctx: HopContext  # how the incoming payload was encoded (offset 0)
    mode: str  # "copy", "fused" (reduce and re-encode with out_ctx) or "keep" (fp32 sum)
    out_ctx: HopContext | None = None


@dataclass(frozen=True)
class RoundPlan:
    send_to: int | None
    sends: tuple[SendOp, ...]
    recv_from: int | None
    recvs: tuple[RecvOp, ...]


#: A hop context in compact form: ``(hop, num_hops, rank, contributions)`` (the rest of a
#: plan's contexts is ``seed``, ``step`` and ``world_size``, the same for every encoding).
CtxKey = tuple[int, int, int, int]
#: ``(rank, dst, chunk, codec index, encode, ctx)``: ``rank`` sends ``chunk`` to ``dst``,
#: encoding its raw value (``encode``) or forwarding the bytes it holds.
SendEntry = tuple[int, int, int, int, bool, CtxKey]
#: ``(rank, src, chunk, codec index, mode, ctx, out_ctx)``: as :class:`RecvOp`.
RecvEntry = tuple[int, int, int, int, str, CtxKey, CtxKey | None]


@dataclass(frozen=True)
class RoundOps:
    """One round of a plan, every rank's operations in compact form (ranks ascending, each
    rank's chunks in the order of its :class:`~dynamiq.collectives.schedules.Step`)."""

    round: int
    sends: list[SendEntry]
    recvs: list[RecvEntry]


class Plan:
    """A schedule's plan, made round by round (:meth:`rounds`) in memory linear in the
    number of ranks × chunks: what :func:`plan_schedule` lists, without the lists.

    ``codecs[i]`` is the codec of codec index ``i`` (0: the collective's; equal codecs share
    an index); :meth:`context` expands a compact context.
    """

    def __init__(
        self,
        schedule: Schedule,
        codec: Codec,
        *,
        seed: int = 0,
        step: int = 0,
        rounds: tuple[int, int] | None = None,
    ) -> None:
        self.schedule, self.seed, self.step = schedule, seed, step
        self.start, self.stop = rounds if rounds is not None else (0, schedule.num_rounds)
        self.codecs: list[Codec] = [codec]
        self._by_config: dict[str, int] = {}
        self._contexts: dict[CtxKey, HopContext] = {}
        n = schedule.world_size
        # the steps' codec indices, per (rank, round): a step's override, resolved once
        self._step_codec = [[self._codec_index(st.codec) for st in row] for row in schedule.steps]
        self._initial_contrib: list[list[int]] | None = None
        if self.start > 0 and self.start >= schedule.reduce_rounds:  # an all-gather alone:
            owner = {ch: r for ch, (r, _) in schedule.completions().items()}  # finished sums
            self._initial_contrib = [
                [n if owner.get(ch) == r else 0 for ch in range(schedule.num_chunks)]
                for r in range(n)
            ]
        self._fused = self._fused_flags()
        self.num_hops = self._num_hops()

    def _codec_index(self, override: Any) -> int:
        if override is None:
            return 0
        key = json.dumps(get_codec(override).get_config(), sort_keys=True)
        if key not in self._by_config:
            c = get_codec(override)
            same = [i for i, known in enumerate(self.codecs) if known == c]
            self._by_config[key] = same[0] if same else len(self.codecs)
            if not same:
                self.codecs.append(c)
        return self._by_config[key]

    def context(self, key: CtxKey) -> HopContext:
        """The :class:`HopContext` (offset 0) of a compact context (one object per key)."""
        ctx = self._contexts.get(key)
        if ctx is None:
            hop, num_hops, rank, contrib = key
            ctx = HopContext(
                seed=self.seed,
                step=self.step,
                hop=hop,
                num_hops=num_hops,
                rank=rank,
                contributions=contrib,
                world_size=self.schedule.world_size,
            )
            self._contexts[key] = ctx
        return ctx

    def _num_hops(self) -> list[int]:
        """Per chunk, the encodings along its longest history (at least 1): a symbolic pass
        over levels alone."""
        s = self.schedule
        n, c = s.world_size, s.num_chunks
        enc = [[-1] * c for _ in range(n)]  # codec index of the bytes held, -1: raw
        lvl = [[0] * c for _ in range(n)]
        for k in range(self.start, self.stop):
            fused, j = self._fused[k], 0
            out: dict[tuple[int, int], tuple[int, int]] = {}
            for r in range(n):
                st, ci = s.steps[r][k], self._step_codec[r][k]
                for ch in st.send_chunks:
                    if enc[r][ch] != ci:
                        enc[r][ch] = ci
                        lvl[r][ch] += 1
                    out[r, ch] = (ci, lvl[r][ch])
            for r in range(n):
                st = s.steps[r][k]
                for ch in st.recv_chunks:
                    assert st.recv_from is not None
                    e, level = out[st.recv_from, ch]
                    if st.action == "copy":
                        enc[r][ch], lvl[r][ch] = e, level
                        continue
                    level = max(lvl[r][ch], level)
                    if fused[j]:
                        enc[r][ch], lvl[r][ch] = self._step_codec[r][k], level + 1
                    else:
                        enc[r][ch], lvl[r][ch] = -1, level
                    j += 1
        return [max(1, max(lvl[r][ch] for r in range(n))) for ch in range(c)]

    def _fused_flags(self) -> dict[int, bytearray]:
        """Per round, for each ``reduce`` receive (in order), whether the rank's next use of
        the chunk (over the whole schedule: a partial run encodes as the full one does) is
        to send it with the same codec: then it re-encodes at once (``fused``)."""
        s = self.schedule
        n, c = s.world_size, s.num_chunks
        nxt = [[-2] * c for _ in range(n)]  # next use: codec index of a send, -1 recv, -2 none
        flags: dict[int, bytearray] = {}
        for k in range(s.num_rounds - 1, self.start - 1, -1):
            if k < self.stop:
                row = bytearray()
                for r in range(n):
                    st = s.steps[r][k]
                    if st.action == "reduce":
                        ci = self._step_codec[r][k]
                        row.extend(nxt[r][ch] == ci for ch in st.recv_chunks)
                flags[k] = row
            for r in range(n):
                st, ci = s.steps[r][k], self._step_codec[r][k]
                for ch in st.recv_chunks:
                    nxt[r][ch] = -1
                for ch in st.send_chunks:
                    nxt[r][ch] = ci
        return flags

    def rounds(self) -> Iterator[RoundOps]:
        """The plan's rounds, made one at a time."""
        s = self.schedule
        n, c = s.world_size, s.num_chunks
        nh = self.num_hops
        enc = [[-1] * c for _ in range(n)]
        key: list[list[CtxKey | None]] = [[None] * c for _ in range(n)]
        lvl = [[0] * c for _ in range(n)]
        contrib = self._initial_contrib or [[1] * c for _ in range(n)]
        contrib = [list(row) for row in contrib]
        for k in range(self.start, self.stop):
            sends: list[SendEntry] = []
            out: dict[tuple[int, int], tuple[int, CtxKey, int, int]] = {}
            for r in range(n):
                st, ci = s.steps[r][k], self._step_codec[r][k]
                for ch in st.send_chunks:
                    assert st.send_to is not None
                    fresh = enc[r][ch] != ci
                    if fresh:
                        level = lvl[r][ch]
                        enc[r][ch], lvl[r][ch] = ci, level + 1
                        key[r][ch] = (level, max(nh[ch], level + 1), r, contrib[r][ch])
                    held = key[r][ch]
                    assert held is not None
                    sends.append((r, st.send_to, ch, ci, fresh, held))
                    out[r, ch] = (ci, held, lvl[r][ch], contrib[r][ch])
            recvs: list[RecvEntry] = []
            fused, j = self._fused[k], 0
            for r in range(n):
                st, ci = s.steps[r][k], self._step_codec[r][k]
                for ch in st.recv_chunks:
                    assert st.recv_from is not None
                    m_ci, m_key, m_lvl, m_contrib = out[st.recv_from, ch]
                    if st.action == "copy":
                        enc[r][ch], key[r][ch] = m_ci, m_key
                        lvl[r][ch], contrib[r][ch] = m_lvl, m_contrib
                        recvs.append((r, st.recv_from, ch, ci, "copy", m_key, None))
                        continue
                    level = max(lvl[r][ch], m_lvl)
                    total = contrib[r][ch] + m_contrib
                    contrib[r][ch] = total
                    if fused[j]:
                        o_key = (level, max(nh[ch], level + 1), r, total)
                        enc[r][ch], key[r][ch], lvl[r][ch] = ci, o_key, level + 1
                        recvs.append((r, st.recv_from, ch, ci, "fused", m_key, o_key))
                    else:
                        enc[r][ch], key[r][ch], lvl[r][ch] = -1, None, level
                        recvs.append((r, st.recv_from, ch, ci, "keep", m_key, None))
                    j += 1
            yield RoundOps(k, sends, recvs)


def plan_schedule(
    schedule: Schedule,
    codec: Codec,
    *,
    seed: int = 0,
    step: int = 0,
    rounds: tuple[int, int] | None = None,
) -> list[list[RoundPlan]]:
    """What every rank does in every round, with the hop context of every encoding.

    ``rounds=(start, stop)`` plans only those rounds; a plan that starts after the reduce
    phase (an all-gather alone) assumes each rank holds the finished sums of the chunks it
    owns. Pure function of its arguments: every rank computes the same plan. (The lists of
    :class:`Plan`'s rounds; equal contexts are one object.)
    """
    plan = Plan(schedule, codec, seed=seed, step=step, rounds=rounds)
    n = schedule.world_size
    plans: list[list[RoundPlan]] = [[] for _ in range(n)]
    ctx = plan.context
    for ops in plan.rounds():
        sends: list[list[SendOp]] = [[] for _ in range(n)]
        recvs: list[list[RecvOp]] = [[] for _ in range(n)]
        for r, _dst, ch, ci, fresh, key in ops.sends:
            sends[r].append(SendOp(ch, plan.codecs[ci], ctx(key), fresh))
        for r, _src, ch, ci, mode, key, out in ops.recvs:
            out_ctx = ctx(out) if out is not None else None
            recvs[r].append(RecvOp(ch, plan.codecs[ci], ctx(key), mode, out_ctx))
        for r in range(n):
            st = schedule.steps[r][ops.round]
            plans[r].append(RoundPlan(st.send_to, tuple(sends[r]), st.recv_from, tuple(recvs[r])))
    return plans


def chunk_bounds(numel: int, num_chunks: int, align: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk: block-aligned, as even as blocks allow."""
    nb = -(-numel // align)
    return [
        (min(numel, i * nb // num_chunks * align), min(numel, (i + 1) * nb // num_chunks * align))
        for i in range(num_chunks)
    ]


def _pieces(start: int, end: int, sub: int) -> list[tuple[int, int]]:
    return [(s, min(end, s + sub)) for s in range(start, end, sub)] or [(start, start)]


def _align(codecs: list[Codec]) -> int:
    return math.lcm(*(c.block_size for c in codecs))


#: the key of ``HopContext.shared`` under which a codec's prologue returns the chunk bounds
#: it chose, when the engine lets it (``PrologueComm.recut_align``: an all-reduce with no
#: caller-given bounds); the engine then cuts the buffer by them (pooled DynamiQ: equal bytes)
CHUNK_BOUNDS_KEY = "dynamiq.chunk_bounds"


def layout_align(schedule: Schedule, codec: Codec) -> int:
    """The values every chunk bound is a multiple of (but the buffer's end): the least
    common multiple of the block sizes of every codec the schedule uses."""
    return _align([codec] + [get_codec(c) for c in schedule.codecs()])


def prologue_bounds(
    shared: Any, numel: int, schedule: Schedule, codec: Codec
) -> list[tuple[int, int]] | None:
    """The chunk bounds a prologue chose (``shared[CHUNK_BOUNDS_KEY]``), checked: a
    partition of ``[0, numel)`` into the schedule's chunks, in order, on multiples of
    :func:`layout_align`; ``None`` when it chose none. Raises ``ValueError`` otherwise."""
    got = shared.get(CHUNK_BOUNDS_KEY) if isinstance(shared, dict) else None
    if got is None:
        return None
    bounds = check_bounds(got, numel, schedule.num_chunks)
    align = layout_align(schedule, codec)
    if any(
        (a % align and a != numel) or (b % align and b != numel) for a, b in bounds
    ) or bounds != sorted(bounds):
        raise ValueError(f"prologue chunk bounds {bounds[:4]}... are not in order on {align}s")
    return bounds


def chunk_layout(
    numel: int,
    schedule: Schedule,
    codec: Codec,
    sub_chunk: int,
    bounds: Sequence[tuple[int, int]] | None = None,
) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """Chunk bounds and each chunk's sub-chunks, aligned to every codec's block size.

    ``bounds`` (one ``[start, end)`` per chunk, together a partition of ``[0, numel)``, in
    any order) replaces the even cut: sub-chunks, and so the codecs' blocks, then start at
    each chunk's own start (a chunk's last block may be partial, its padding sent as bytes).
    """
    align = _align([codec] + [get_codec(c) for c in schedule.codecs()])
    sub = max(align, sub_chunk // align * align)
    if bounds is None:
        bounds = chunk_bounds(numel, schedule.num_chunks, align)
    else:
        bounds = check_bounds(bounds, numel, schedule.num_chunks)
    return bounds, [_pieces(a, b, sub) for a, b in bounds]


def check_bounds(
    bounds: Sequence[tuple[int, int]], numel: int, num_chunks: int
) -> list[tuple[int, int]]:
    """``bounds`` as a list of int pairs; raises unless they partition ``[0, numel)`` into
    ``num_chunks`` ranges."""
    out = [(int(a), int(b)) for a, b in bounds]
    if len(out) != num_chunks:
        raise ValueError(f"chunk_bounds has {len(out)} ranges, the schedule {num_chunks} chunks")
    pos = 0
    for a, b in sorted(out):
        if a != pos or b < a:
            raise ValueError(f"chunk_bounds {out} do not partition [0, {numel})")
        pos = b
    if pos != numel:
        raise ValueError(f"chunk_bounds {out} do not partition [0, {numel})")
    return out


def chunk_sizes(
    numel: int,
    codec: Any,
    schedule: str | Schedule = "ring",
    world_size: int | None = None,
    **schedule_options: Any,
) -> list[int]:
    """The number of values in each chunk of ``schedule`` for a buffer of ``numel`` values:
    the units a hop re-encodes and the next hop waits for (a ring's time follows the largest).

    ``codec``: an id, a config or a Codec; ``schedule``: a built-in's name (with
    ``world_size`` and its options; its steps are not built) or a :class:`Schedule`. Chunks
    are cut on multiples of every involved codec's block size, as evenly as whole blocks
    allow (the engine's cut, :func:`chunk_layout`); the buffer's tail ends the last one.

    >>> chunk_sizes(1000, "int8", "ring", world_size=4)
    [256, 256, 256, 232]
    """
    check_int("numel", numel, 0)
    c = get_codec(codec)
    if isinstance(schedule, Schedule):
        if world_size is not None and world_size != schedule.world_size:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.world_size} ranks, not {world_size}"
            )
        num_chunks, overrides = schedule.num_chunks, schedule.codecs()
    else:
        if world_size is None:
            raise TypeError("chunk_sizes needs world_size= with a schedule given by name")
        num_chunks, overrides = schedule_shape(schedule, world_size, **schedule_options)
    align = _align([c] + [get_codec(o) for o in overrides])
    return [b - a for a, b in chunk_bounds(numel, num_chunks, align)]
