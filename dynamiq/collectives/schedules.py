"""Hop schedules as data (docs/design.md, "The engine").

A :class:`Schedule` says, for each rank and each *round*, what the rank sends to whom, what it
receives from whom, and what it does with what it receives::

    Step(send_to, send_chunks, recv_from, recv_chunks, action, codec)

``action`` is ``"reduce"`` (the received bytes are a partial sum: decompress, add the local
value, recompress) or ``"copy"`` (the received bytes are a finished chunk: keep them as they
are). ``codec`` optionally overrides the collective's codec for the step's transfers (e.g.
uncompressed inside a node). The buffer is cut into ``num_chunks`` chunks on block boundaries.

Rounds are lock-step: a send from ``a`` to ``b`` in round ``k`` is received by ``b`` from ``a``
in round ``k``; so every valid schedule is free of deadlock by construction. Built-ins:

* ``ring``: reduce-scatter around the ring, then all-gather (``2(n-1)`` rounds, ``n`` chunks);
* ``butterfly``: recursive halving reduce-scatter and recursive doubling all-gather over the
  largest power of two ``p <= n``; the ``n - p`` extra ranks fold their buffer into a partner
  first and get the result back at the end (``2 log2 p`` rounds, plus 2 when folding);
* ``tree``: binomial-tree reduce to rank 0, then binomial broadcast (one chunk);
* ``hierarchical``: ranks grouped in nodes of ``ranks_per_node``; a chain reduce inside each
  node to its leader, a ring all-reduce across leaders, a chain broadcast inside each node;
  the intra-node steps may carry their own codec (``intra_codec``, e.g. ``"fp32"``).

>>> s = get_schedule("ring", 3)
>>> s.num_rounds, s.num_chunks
(4, 3)
>>> s.steps[0][0]
Step(send_to=1, send_chunks=(2,), recv_from=2, recv_chunks=(1,), action='reduce', codec=None)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IDLE",
    "Schedule",
    "ScheduleError",
    "Step",
    "butterfly",
    "get_schedule",
    "hierarchical",
    "list_schedules",
    "ring",
    "schedule_shape",
    "tree",
]


class ScheduleError(ValueError):
    """A malformed schedule."""


@dataclass(frozen=True)
class Step:
    """One round of one rank: an optional send and an optional receive."""

    send_to: int | None = None
    send_chunks: tuple[int, ...] = ()
    recv_from: int | None = None
    recv_chunks: tuple[int, ...] = ()
    action: str = "reduce"
    codec: Any = None

    @property
    def idle(self) -> bool:
        return self.send_to is None and self.recv_from is None


IDLE = Step()


@dataclass(frozen=True)
class Schedule:
    """Per-rank, per-round steps over ``num_chunks`` chunks (see the module docstring)."""

    name: str
    world_size: int
    num_chunks: int
    steps: tuple[tuple[Step, ...], ...]

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_rounds(self) -> int:
        return len(self.steps[0]) if self.steps else 0

    def completions(self) -> dict[int, tuple[int, int]]:
        """For each chunk, the ``(rank, round)`` that completes its sum (its owner)."""
        done = self.__dict__.get("_completions")
        if done is None:  # computed once: the schedule is immutable
            done = _simulate(self)
            object.__setattr__(self, "_completions", done)
        return dict(done)

    @property
    def reduce_rounds(self) -> int:
        """Rounds of the reduce(-scatter) phase; the rest only forward finished chunks."""
        done = self.completions()
        return max((k for _, k in done.values()), default=-1) + 1

    def owned_chunks(self, rank: int) -> list[int]:
        """Chunks whose sum ``rank`` completes (what ``reduce_scatter`` leaves it)."""
        if self.world_size == 1:
            return list(range(self.num_chunks))
        return sorted(ch for ch, (r, _) in self.completions().items() if r == rank)

    def codecs(self) -> list[Any]:
        """Every codec override the schedule names (``None`` excluded), in first-use order."""
        seen: list[Any] = []
        for rank_steps in self.steps:
            for st in rank_steps:
                if st.codec is not None and st.codec not in seen:
                    seen.append(st.codec)
        return seen

    def describe(self) -> dict[str, Any]:
        """A JSON-safe description (ranks compare it before the first transfer)."""
        return {
            "name": self.name,
            "world_size": self.world_size,
            "num_chunks": self.num_chunks,
            "rounds": self.num_rounds,
            "digest": self.digest(),
        }

    def digest(self) -> str:
        """A hash of the whole schedule: equal digests mean equal schedules."""
        data = [
            [
                [
                    st.send_to,
                    st.send_chunks,
                    st.recv_from,
                    st.recv_chunks,
                    st.action,
                    _codec_key(st.codec),
                ]
                for st in rank_steps
            ]
            for rank_steps in self.steps
        ]
        blob = json.dumps([self.world_size, self.num_chunks, data], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _codec_key(codec: Any) -> Any:
    if codec is None or isinstance(codec, (str, Mapping)):
        return codec
    get_config = getattr(codec, "get_config", None)
    return get_config() if callable(get_config) else repr(codec)


def validate(s: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first problem of a malformed schedule.

    Checks: shapes (one step list per rank, equal round counts), ranges of peers and chunks,
    lock-step matching of every send with a receive of the same chunks in the same round,
    and, by simulating which ranks' gradients each rank holds for each chunk, that every rank
    ends with every chunk summed over all ranks exactly once.
    """
    n, c = s.world_size, s.num_chunks
    if not isinstance(n, int) or n < 1:
        raise ScheduleError(f"world_size must be >= 1 (got {n!r})")
    if not isinstance(c, int) or c < 1:
        raise ScheduleError(f"num_chunks must be >= 1 (got {c!r})")
    if len(s.steps) != n:
        raise ScheduleError(f"schedule has steps for {len(s.steps)} ranks, world_size is {n}")
    rounds = {len(r) for r in s.steps}
    if len(rounds) > 1:
        raise ScheduleError(f"ranks have different numbers of rounds: {sorted(rounds)}")
    for r, rank_steps in enumerate(s.steps):
        for k, st in enumerate(rank_steps):
            _check_step(st, f"rank {r}, round {k}", r, n, c)
    for k in range(s.num_rounds):
        for r in range(n):
            _check_matching(s, k, r)
    _simulate(s)


def _check_step(st: Any, where: str, r: int, n: int, c: int) -> None:
    """One step's type, action, peers and chunk ranges."""
    if not isinstance(st, Step):
        raise ScheduleError(f"{where}: expected a Step (got {type(st).__name__})")
    if st.action not in ("reduce", "copy"):
        raise ScheduleError(f"{where}: action must be 'reduce' or 'copy' ({st.action!r})")
    for peer, chunks, verb in (
        (st.send_to, st.send_chunks, "send"),
        (st.recv_from, st.recv_chunks, "recv"),
    ):
        if peer is None:
            if chunks:
                raise ScheduleError(f"{where}: {verb} chunks without a peer")
            continue
        if not 0 <= peer < n or peer == r:
            raise ScheduleError(f"{where}: {verb} peer {peer} is not another rank")
        if not chunks:
            raise ScheduleError(f"{where}: {verb} to/from {peer} carries no chunk")
        if any(not 0 <= ch < c for ch in chunks) or len(set(chunks)) != len(chunks):
            raise ScheduleError(f"{where}: bad {verb} chunks {chunks}")


def _check_matching(s: Schedule, k: int, r: int) -> None:
    """Lock-step matching: rank ``r``'s send and receive of round ``k`` have their peers'."""
    st = s.steps[r][k]
    if st.send_to is not None:
        other = s.steps[st.send_to][k]
        if other.recv_from != r or other.recv_chunks != st.send_chunks:
            raise ScheduleError(
                f"round {k}: rank {r} sends chunks {st.send_chunks} to rank "
                f"{st.send_to}, which receives {other.recv_chunks} from "
                f"{other.recv_from}"
            )
        if _codec_key(other.codec) != _codec_key(st.codec):
            raise ScheduleError(f"round {k}: ranks {r} and {st.send_to} disagree on codec")
    if st.recv_from is not None and s.steps[st.recv_from][k].send_to != r:
        raise ScheduleError(
            f"round {k}: rank {r} receives from rank {st.recv_from}, which does not send to it"
        )


def _ranks(bits: int) -> list[int]:
    """The ranks of a bit set (bit ``r`` is rank ``r``), ascending."""
    return [r for r in range(bits.bit_length()) if bits >> r & 1]


def _simulate(s: Schedule) -> dict[int, tuple[int, int]]:
    """Symbolic run: which ranks' gradients each (rank, chunk) holds, round by round (as bit
    sets: time and memory ``O(rounds · n)`` words of ``n`` bits).

    Returns, per chunk, the (rank, round) that completes its sum; raises
    :class:`ScheduleError` where a sum double-counts, is completed twice, or ends incomplete.
    """
    n, c = s.world_size, s.num_chunks
    held = [[1 << r] * c for r in range(n)]
    completed: dict[int, tuple[int, int]] = {}  # chunk -> (rank, round) that summed it all
    everyone = (1 << n) - 1
    for k in range(s.num_rounds):
        for r in range(n):
            st = s.steps[r][k]
            both = set(st.send_chunks) & set(st.recv_chunks)
            if both:
                raise ScheduleError(
                    f"round {k}: rank {r} sends and receives chunk(s) {sorted(both)} at once"
                )
        sent = {}
        for r in range(n):
            st = s.steps[r][k]
            if st.send_to is not None:
                sent[r] = {ch: held[r][ch] for ch in st.send_chunks}
        for r in range(n):
            st = s.steps[r][k]
            if st.recv_from is None:
                continue
            for ch in st.recv_chunks:
                _arrive(held, completed, everyone, sent[st.recv_from][ch], st.action, r, ch, k)
    for r in range(n):
        for ch in range(c):
            if held[r][ch] != everyone:
                missing = _ranks(everyone & ~held[r][ch])
                raise ScheduleError(
                    f"rank {r} ends without the gradients of ranks {missing} in chunk {ch}"
                )
    return completed


def _arrive(
    held: list[list[int]],
    completed: dict[int, tuple[int, int]],
    everyone: int,
    incoming: int,
    action: str,
    r: int,
    ch: int,
    k: int,
) -> None:
    """Rank ``r`` receives chunk ``ch`` holding the gradients ``incoming`` in round ``k``."""
    if action == "copy":
        held[r][ch] = incoming
        return
    if held[r][ch] & incoming:
        raise ScheduleError(
            f"round {k}: rank {r} reduces chunk {ch} twice with the "
            f"gradients of ranks {_ranks(held[r][ch] & incoming)}"
        )
    held[r][ch] = held[r][ch] | incoming
    if held[r][ch] == everyone:
        if ch in completed:
            (r0, k0) = completed[ch]
            raise ScheduleError(
                f"chunk {ch} is summed completely twice (rank {r0} in round "
                f"{k0}, rank {r} in round {k}): ranks would not end "
                f"bit-identical; complete it once and copy it"
            )
        completed[ch] = (r, k)


def _steps(n: int, rounds: int) -> list[list[Step]]:
    return [[IDLE] * rounds for _ in range(n)]


def _pair(
    table: list[list[Step]],
    k: int,
    src: int,
    dst: int,
    chunks: Sequence[int],
    action: str,
    codec: Any = None,
) -> None:
    """Record that ``src`` sends ``chunks`` to ``dst`` in round ``k``."""
    a, b = table[src][k], table[dst][k]
    table[src][k] = Step(dst, tuple(chunks), a.recv_from, a.recv_chunks, a.action, codec)
    table[dst][k] = Step(b.send_to, b.send_chunks, src, tuple(chunks), action, codec)


def ring(world_size: int) -> Schedule:
    """Ring reduce-scatter then all-gather: ``n`` chunks, ``2(n - 1)`` rounds."""
    n = world_size
    t = _steps(n, 2 * (n - 1))
    # rank r ends the reduce-scatter owning chunk r (as reduce_scatter users expect)
    for s in range(n - 1):
        for r in range(n):
            _pair(t, s, r, (r + 1) % n, [(r - 1 - s) % n], "reduce")
    for s in range(n - 1):
        for r in range(n):
            _pair(t, n - 1 + s, r, (r + 1) % n, [(r - s) % n], "copy")
    return Schedule("ring", n, n, tuple(map(tuple, t)))


def butterfly(world_size: int) -> Schedule:
    """Recursive halving / doubling over ``p = 2^floor(log2 n)`` ranks; extra ranks fold in."""
    n = world_size
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    levels = p.bit_length() - 1
    fold = 1 if extra else 0
    t = _steps(n, 2 * levels + 2 * fold)
    everything = list(range(p))
    if extra:
        for i in range(extra):
            _pair(t, 0, p + i, i, everything, "reduce")
    for k in range(levels):
        d = p >> (k + 1)
        for r in range(p):
            base = r & ~(2 * d - 1)
            lower, upper = range(base, base + d), range(base + d, base + 2 * d)
            give = lower if r & d else upper
            _pair(t, fold + k, r, r ^ d, list(give), "reduce")
    for k in range(levels):
        d = 1 << k
        for r in range(p):
            base = r & ~(d - 1)
            _pair(t, fold + levels + k, r, r ^ d, list(range(base, base + d)), "copy")
    if extra:
        for i in range(extra):
            _pair(t, fold + 2 * levels, i, p + i, everything, "copy")
    return Schedule("butterfly", n, p, tuple(map(tuple, t)))


def tree(world_size: int) -> Schedule:
    """Binomial-tree reduce to rank 0, then binomial broadcast; one chunk."""
    n = world_size
    levels = max(n - 1, 0).bit_length()
    t = _steps(n, 2 * levels)
    for k in range(levels):
        d = 1 << k
        for r in range(d, n, 2 * d):
            _pair(t, k, r, r - d, [0], "reduce")
    for k in range(levels):
        d = 1 << (levels - 1 - k)
        for r in range(0, n, 2 * d):
            if r + d < n:
                _pair(t, levels + k, r, r + d, [0], "copy")
    return Schedule("tree", n, 1, tuple(map(tuple, t)))


def hierarchical(world_size: int, ranks_per_node: int = 2, intra_codec: Any = None) -> Schedule:
    """Chain reduce inside each node, ring across node leaders, chain broadcast inside.

    ``ranks_per_node`` must divide ``world_size``; node ``j`` is ranks ``j*g .. j*g + g - 1``
    with leader ``j*g``. ``intra_codec`` (default: the collective's codec) is used for the
    intra-node transfers, e.g. ``"fp32"`` where the node's links are fast.
    """
    n, g = world_size, ranks_per_node
    if not isinstance(g, int) or g < 1 or n % g:
        raise ScheduleError(f"ranks_per_node must divide world_size={n} (got {g!r})")
    m = n // g
    inter = ring(m)
    t = _steps(n, 2 * (g - 1) + inter.num_rounds)
    chunks = list(range(m))
    for j in range(m):
        lead = j * g
        for s in range(g - 1):
            _pair(t, s, lead + g - 1 - s, lead + g - 2 - s, chunks, "reduce", intra_codec)
        for k, st in enumerate(inter.steps[j]):
            if st.send_to is not None:
                _pair(t, g - 1 + k, lead, st.send_to * g, st.send_chunks, st.action)
        for s in range(g - 1):
            _pair(
                t, g - 1 + inter.num_rounds + s, lead + s, lead + s + 1, chunks, "copy", intra_codec
            )
    return Schedule(f"hierarchical(g={g})", n, m, tuple(map(tuple, t)))


_BUILTIN: dict[str, Callable[..., Schedule]] = {
    "ring": ring,
    "butterfly": butterfly,
    "tree": tree,
    "hierarchical": hierarchical,
}


def list_schedules() -> list[str]:
    """Names accepted by :func:`get_schedule`."""
    return sorted(_BUILTIN)


def get_schedule(name: str | Schedule, world_size: int, **kw: Any) -> Schedule:
    """A built-in schedule by name (keyword options passed on), or a user's schedule checked
    against ``world_size``."""
    if isinstance(name, Schedule):
        if name.world_size != world_size:
            raise ScheduleError(
                f"schedule {name.name!r} is for world_size {name.world_size}, not {world_size}"
            )
        return name
    if name not in _BUILTIN:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(list_schedules())})")
    if not isinstance(world_size, int) or world_size < 1:
        raise ScheduleError(f"world_size must be >= 1 (got {world_size!r})")
    return _BUILTIN[name](world_size, **kw)


def _hierarchical_shape(
    world_size: int, ranks_per_node: int = 2, intra_codec: Any = None
) -> tuple[int, list[Any]]:
    n, g = world_size, ranks_per_node
    if not isinstance(g, int) or g < 1 or n % g:
        raise ScheduleError(f"ranks_per_node must divide world_size={n} (got {g!r})")
    return n // g, ([intra_codec] if intra_codec is not None and g > 1 else [])


#: ``(num_chunks, codecs())`` of each built-in, from its arguments alone
_SHAPES: dict[str, Callable[..., tuple[int, list[Any]]]] = {
    "ring": lambda n: (n, []),
    "butterfly": lambda n: (1 << (n.bit_length() - 1), []),
    "tree": lambda n: (1, []),
    "hierarchical": _hierarchical_shape,
}


def schedule_shape(name: str | Schedule, world_size: int, **kw: Any) -> tuple[int, list[Any]]:
    """``(num_chunks, codecs())`` of ``get_schedule(name, world_size, **kw)``, without building
    the steps of a built-in (a ring of 1024 ranks has two million)."""
    if isinstance(name, Schedule) or name not in _SHAPES:
        s = get_schedule(name, world_size, **kw)
        return s.num_chunks, s.codecs()
    if not isinstance(world_size, int) or world_size < 1:
        raise ScheduleError(f"world_size must be >= 1 (got {world_size!r})")
    return _SHAPES[name](world_size, **kw)
