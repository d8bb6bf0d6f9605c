"""Planning: what every rank does in every round of a schedule, and how a buffer is cut.

A plan is a pure function of the schedule, the codec and the seed/step, so every rank computes
the same one: which encoding is which hop (``HopContext``), whether a received partial sum is
copied, reduced and re-encoded at once (``fused``) or kept as an exact fp32 sum (``keep``).
Chunks are cut on multiples of the codecs' block sizes, aligned to global offsets, and split
into sub-chunks (also block multiples), so nothing a codec decides depends on the cut.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dynamiq.codecs import Codec, HopContext, get_codec

from .schedules import Schedule

__all__ = [
    "RecvOp",
    "RoundPlan",
    "SendOp",
    "check_bounds",
    "chunk_bounds",
    "chunk_layout",
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


@dataclass
class _Sym:
    encoded: bool = False
    codec: Codec | None = None
    ctx: HopContext | None = None
    level: int = 0  # encodings along the longest history of the value
    contrib: int = 1  # gradients summed in the value


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
    owns. Pure function of its arguments: every rank computes the same plan.
    """
    start, stop = rounds if rounds is not None else (0, schedule.num_rounds)
    gather_only = start > 0 and start >= schedule.reduce_rounds
    n = schedule.world_size
    codecs: dict[Any, Codec] = {}

    def codec_of(override: Any) -> Codec:
        if override is None:
            return codec
        key = json.dumps(get_codec(override).get_config(), sort_keys=True)
        return codecs.setdefault(key, get_codec(override))

    # when does each (rank, chunk) next appear, and how: ("send", codec) or ("recv", mode)
    events: dict[tuple[int, int], list[tuple[int, str, Codec]]] = {}
    for r in range(n):
        for k, st in enumerate(schedule.steps[r]):  # the whole schedule: a partial run
            for ch in st.send_chunks:  # encodes exactly as the full one does
                events.setdefault((r, ch), []).append((k, "send", codec_of(st.codec)))
            for ch in st.recv_chunks:
                events.setdefault((r, ch), []).append((k, "recv", codec_of(st.codec)))

    def next_event(r: int, ch: int, k: int) -> tuple[str, Codec] | None:
        for kk, kind, c in events.get((r, ch), ()):
            if kk > k:
                return kind, c
        return None

    def run(num_hops: list[int] | None) -> tuple[list[list[RoundPlan]], list[int]]:
        sym = [[_Sym() for _ in range(schedule.num_chunks)] for _ in range(n)]
        if gather_only:
            for r in range(n):
                for ch in range(schedule.num_chunks):
                    sym[r][ch].contrib = n if ch in schedule.owned_chunks(r) else 0
        plans: list[list[RoundPlan]] = [[] for _ in range(n)]

        def ctx(r: int, ch: int, level: int, contrib: int) -> HopContext:
            h = num_hops[ch] if num_hops else level + 1
            return HopContext(
                seed=seed,
                step=step,
                hop=level,
                num_hops=max(h, level + 1),
                rank=r,
                contributions=contrib,
                world_size=n,
            )

        for k in range(start, stop):
            outgoing: dict[int, dict[int, _Sym]] = {}
            sends: list[list[SendOp]] = [[] for _ in range(n)]
            for r in range(n):
                st = schedule.steps[r][k]
                c = codec_of(st.codec)
                for ch in st.send_chunks:
                    s = sym[r][ch]
                    fresh = not (s.encoded and s.codec == c)
                    if fresh:
                        s = _Sym(True, c, ctx(r, ch, s.level, s.contrib), s.level + 1, s.contrib)
                        sym[r][ch] = s
                    assert s.ctx is not None
                    sends[r].append(SendOp(ch, c, s.ctx, fresh))
                    outgoing.setdefault(r, {})[ch] = dataclasses.replace(s)
            for r in range(n):
                st = schedule.steps[r][k]
                c = codec_of(st.codec)
                recvs = []
                for ch in st.recv_chunks:
                    assert st.recv_from is not None
                    msg = outgoing[st.recv_from][ch]
                    assert msg.ctx is not None
                    if st.action == "copy":
                        sym[r][ch] = dataclasses.replace(msg)
                        recvs.append(RecvOp(ch, c, msg.ctx, "copy"))
                        continue
                    mine = sym[r][ch]
                    level = max(mine.level, msg.level)
                    contrib = mine.contrib + msg.contrib
                    nxt = next_event(r, ch, k)
                    if nxt is not None and nxt[0] == "send" and nxt[1] == c:
                        out = ctx(r, ch, level, contrib)
                        sym[r][ch] = _Sym(True, c, out, level + 1, contrib)
                        recvs.append(RecvOp(ch, c, msg.ctx, "fused", out))
                    else:
                        sym[r][ch] = _Sym(False, None, None, level, contrib)
                        recvs.append(RecvOp(ch, c, msg.ctx, "keep"))
                plans[r].append(RoundPlan(st.send_to, tuple(sends[r]), st.recv_from, tuple(recvs)))
        hops = [max(sym[r][ch].level for r in range(n)) for ch in range(schedule.num_chunks)]
        return plans, hops

    _, hops = run(None)
    plans, _ = run([max(h, 1) for h in hops])
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
    codecs = [codec] + [get_codec(c) for c in schedule.codecs()]
    align = math.lcm(*(c.block_size for c in codecs))
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
