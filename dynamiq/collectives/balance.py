"""Bytes per round at scale, without holding every rank's buffer.

The largest / mean bytes any rank sends in a round (``SimRun.round_bytes``,
``AllReduceStats.round_bytes``) is what a schedule's time follows; a full simulation of 1024
ranks of a 25 MB bucket needs 27 GB. These functions give the same numbers, exactly, from less:

* :func:`round_nbytes`: codecs whose message sizes are known in advance (``encoded_nbytes``
  given the prologue's shared result): the engine's plan and the codec's sizes, no data. For a
  prologue that all-reduces statistics (pooled DynamiQ), the shared result comes from
  :func:`~dynamiq.collectives.simulator.prologue_shared`, one rank's buffer at a time.
* :func:`omnireduce_round_nbytes`: OmniReduce at density 1, whose sizes follow the data: it
  is lossless, so a message decodes to its fp32 partial sum, and carries the blocks of its
  value that are not all zero (a ``reduce``: the payload's and the local value's non-zero
  ones, ``dynamiq/codecs/omnireduce.py``). The plan runs on plain fp32 sums, a group of
  chunks at a time (a chunk's messages never depend on another chunk's values), reading
  every rank's values of those chunks only.

``tests/collectives/test_balance.py`` checks both against :func:`simulate_schedule
<dynamiq.collectives.simulator.simulate_schedule>`'s ``round_bytes`` for every registered
codec and schedule; ``benchmarks/round_balance.py`` measures them at 8 to 1024 ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dynamiq.codecs import Codec, HopContext, get_codec
from dynamiq.codecs.base import check_int
from dynamiq.codecs.omnireduce import OmniReduceCodec

from .planning import CtxKey, Plan, chunk_layout, prologue_bounds
from .schedules import Schedule
from .simulator import batch_fields

__all__ = ["nonzero_blocks", "omnireduce_round_nbytes", "round_balance", "round_nbytes"]

#: the length header the engine sends before each payload of a data-dependent size
LENGTH_HEADER = 8


def round_nbytes(
    numel: int,
    codec: Any,
    schedule: Schedule,
    *,
    shared: Any = None,
    seed: int = 0,
    step: int = 0,
    sub_chunk: int = 1 << 18,
) -> np.ndarray:
    """``out[k, r]``: the payload bytes rank ``r`` sends in round ``k`` of the all-reduce of
    ``numel`` values (``SimRun.round_bytes``), without data, for a codec whose message sizes
    are known in advance given ``shared``.

    ``shared``: the prologue's result, the same on every rank (``None``: no prologue), e.g.
    :func:`~dynamiq.collectives.simulator.prologue_shared` (pooled DynamiQ's span budgets);
    the chunk bounds it chose, if any, cut the buffer as in the engine. A message's size is
    the sum of ``encoded_nbytes`` over its sub-chunks, with the plan's context at each
    sub-chunk's global offset; ``ValueError`` if one is ``None`` (a size that depends on the
    data). Time and memory are linear in the plan's messages; for a codec whose sizes read
    no other field of the context (``simulator.batch_fields`` is empty), one size a chunk,
    summed over the schedule's steps.

    >>> from dynamiq.collectives import get_schedule
    >>> ring = get_schedule("ring", 4)
    >>> round_nbytes(1000, "int8", ring)[:2].tolist()  # rank 0 sends the short chunk first
    [[248, 272, 272, 272], [272, 248, 272, 272]]
    >>> round(round_balance(round_nbytes(1000, "int8", ring), ring), 3)
    1.023
    """
    check_int("numel", numel, 0)
    c = get_codec(codec)
    _, pieces = chunk_layout(
        numel, schedule, c, sub_chunk, prologue_bounds(shared, numel, schedule, c)
    )
    if batch_fields(c) == () and not schedule.codecs():
        # sizes that read no field of the context but the offset and the shared result (the
        # simulator's batched codecs): one size a chunk, summed over the steps' sends
        ctx = HopContext(seed=seed, step=step, world_size=schedule.world_size)
        per_chunk = [_message_nbytes(c, ctx, p, shared) for p in pieces]
        return np.array(
            [[sum(per_chunk[ch] for ch in st.send_chunks) for st in row] for row in schedule.steps],
            dtype=np.int64,
        ).T.copy()
    plan = Plan(schedule, c, seed=seed, step=step)
    out = np.zeros((plan.stop - plan.start, schedule.world_size), dtype=np.int64)
    sizes: dict[tuple[int, CtxKey, int], int] = {}
    for ops in plan.rounds():
        row = out[ops.round - plan.start]
        for r, _dst, ch, ci, _fresh, key in ops.sends:
            size = sizes.get((ci, key, ch))
            if size is None:
                size = sizes[ci, key, ch] = _message_nbytes(
                    plan.codecs[ci], plan.context(key), pieces[ch], shared
                )
            row[r] += size
    return out


def _message_nbytes(
    codec: Codec, ctx: HopContext, pieces: list[tuple[int, int]], shared: Any
) -> int:
    total = 0
    for a, b in pieces:
        got = codec.encoded_nbytes(b - a, dataclasses.replace(ctx, offset=a, shared=shared))
        if got is None:
            raise ValueError(
                f"{codec!r}: the size of {b - a} values at offset {a} depends on the data "
                "(omnireduce_round_nbytes, or simulate it: simulator.simulate_schedule)"
            )
        total += got
    return total


def _check_omnireduce(codec: Any) -> OmniReduceCodec:
    c = get_codec(codec)
    if type(c) is not OmniReduceCodec or c.density != 1.0:
        raise ValueError(f"needs OmniReduce at density 1 (got {c!r})")
    return c


def nonzero_blocks(v: np.ndarray, block: int) -> np.ndarray:
    """Which ``block``-value blocks of ``v`` (its last may be short) hold a value that is not
    zero (NaN and ±Inf included, ``-0.0`` not): the blocks OmniReduce at density 1 sends."""
    nz = np.asarray(v) != 0
    if nz.size == 0:
        return np.zeros(0, dtype=bool)
    return np.logical_or.reduceat(nz, np.arange(0, nz.size, block))


class _Chunk:
    """A chunk's blocks (their bytes on the wire) and its messages' fixed bytes (a length
    header and a bitmap per non-empty sub-chunk)."""

    def __init__(self, pieces: list[tuple[int, int]], block: int, item: int) -> None:
        a0, b0 = pieces[0][0], pieces[-1][1]
        starts = np.arange(a0, b0, block)
        self.lengths = (np.minimum(starts + block, b0) - starts) * item
        blocks = [-(-(b - a) // block) for a, b in pieces if b > a]
        self.fixed = sum(LENGTH_HEADER + -(-m // 8) for m in blocks)

    def nbytes(self, carried: np.ndarray) -> int:
        return self.fixed + int(self.lengths[carried].sum())


#: a message: the blocks it carries, and the values it decodes to (fp32 sums: the codec is
#: lossless at density 1, but for the sign of a zero and a NaN's bits)
_Msg = tuple[np.ndarray, np.ndarray]


def omnireduce_round_nbytes(
    values: Callable[[int, int], np.ndarray],
    numel: int,
    codec: Any,
    schedule: Schedule,
    *,
    sub_chunk: int = 1 << 18,
    group_values: int = 1 << 26,
) -> np.ndarray:
    """``out[k, r]`` as :func:`round_nbytes`, for OmniReduce at density 1, whose sizes follow
    the data. ``values(a, b)``: every rank's values ``[a, b)`` (``[world_size, b - a]``
    fp32), read for a group of chunks at a time (about ``group_values`` values of all ranks).

    The codec is lossless at density 1, so each message decodes to its fp32 partial sum: a
    fresh encoding carries the blocks of its value that are not all zero
    (:func:`nonzero_blocks`); a fused ``reduce`` carries the payload's blocks and the local
    value's non-zero ones, and decodes to ``payload + local``; a ``keep`` sums in fp32; a
    forward keeps the message. Chunks never mix, so groups of chunks run apart. Each
    non-empty sub-chunk adds its 8-byte length header and its bitmap. ``ValueError`` for a
    schedule that uses another codec too.
    """
    c = _check_omnireduce(codec)
    n = schedule.world_size
    plan = Plan(schedule, c)
    if len(plan.codecs) != 1:
        raise ValueError("the schedule uses another codec than OmniReduce: simulate it")
    bounds, pieces = chunk_layout(numel, schedule, c, sub_chunk)
    chunks = [_Chunk(p, c.block_size, c.values.dtype.itemsize) for p in pieces]
    widest = max(1, max(b - a for a, b in bounds))
    per = max(1, group_values // (n * widest))
    ops: list[list[tuple[int, list[tuple[int, int, bool]], list[tuple[int, int, int, str]]]]]
    ops = [[] for _ in range(0, len(bounds), per)]
    for rnd in plan.rounds():
        k = rnd.round - plan.start
        sends: dict[int, list[tuple[int, int, bool]]] = {}
        recvs: dict[int, list[tuple[int, int, int, str]]] = {}
        for r, _dst, ch, _ci, fresh, _key in rnd.sends:
            sends.setdefault(ch // per, []).append((r, ch, fresh))
        for r, src, ch, _ci, mode, _key, _out in rnd.recvs:
            recvs.setdefault(ch // per, []).append((r, src, ch, mode))
        for g in sorted(set(sends) | set(recvs)):
            ops[g].append((k, sends.get(g, []), recvs.get(g, [])))
    out = np.zeros((plan.stop - plan.start, n), dtype=np.int64)
    for g, group_ops in enumerate(ops):
        first, last = g * per, min(len(bounds), (g + 1) * per) - 1
        lo, hi = bounds[first][0], bounds[last][1]
        raw = np.ascontiguousarray(values(lo, hi), dtype=np.float32)
        if raw.shape != (n, hi - lo):
            raise ValueError(f"values({lo}, {hi}) must be [{n}, {hi - lo}] (got {raw.shape})")
        _run_group(raw, lo, bounds, chunks, c.block_size, group_ops, out)
    return out


def _run_group(
    raw: np.ndarray,
    lo: int,
    bounds: list[tuple[int, int]],
    chunks: list[_Chunk],
    block: int,
    ops: list[tuple[int, list[tuple[int, int, bool]], list[tuple[int, int, int, str]]]],
    out: np.ndarray,
) -> None:
    """One group of chunks through the plan, as the simulator runs it (its states: a message
    held, an fp32 sum kept, or the rank's own value)."""
    held: dict[tuple[int, int], _Msg] = {}
    kept: dict[tuple[int, int], np.ndarray] = {}

    def local(r: int, ch: int) -> np.ndarray:
        if (r, ch) in held:
            return held[r, ch][1]
        if (r, ch) in kept:
            return kept[r, ch]
        a, b = bounds[ch]
        return raw[r, a - lo : b - lo]

    for k, sends, recvs in ops:
        sent: dict[tuple[int, int], _Msg] = {}
        for r, ch, fresh in sends:
            if fresh:
                v = local(r, ch)
                msg = (nonzero_blocks(v, block), v)
            else:
                msg = held[r, ch]
            held[r, ch] = sent[r, ch] = msg
            out[k, r] += chunks[ch].nbytes(msg[0])
        for r, src, ch, mode in recvs:
            m, v = sent[src, ch]
            if mode == "copy":
                held[r, ch] = (m, v)
                continue
            lv = local(r, ch)
            total = v + lv
            held.pop((r, ch), None)
            kept.pop((r, ch), None)
            if mode == "keep":
                kept[r, ch] = total
            else:
                held[r, ch] = (m | nonzero_blocks(lv, block), total)


def round_balance(
    round_bytes: np.ndarray, schedule: Schedule, *, return_round: bool = False
) -> Any:
    """The worst round's largest / mean bytes over the ranks the schedule has send in it
    (1.0 when no round sends); with ``return_round``, ``(ratio, round)``."""
    sends = np.array([[st.send_to is not None for st in row] for row in schedule.steps]).T
    worst, at = 1.0, 0
    for k, (row, live) in enumerate(zip(round_bytes, sends, strict=True)):
        if live.any() and row[live].mean() > 0:
            ratio = float(row[live].max() / row[live].mean())
            if ratio > worst:
                worst, at = ratio, k
    return (worst, at) if return_round else worst
