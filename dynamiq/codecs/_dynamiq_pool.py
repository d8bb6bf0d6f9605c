"""Bucket-wide pooling of the DynamiQ codec's bit budget (docs/formats.md, "DynamiQ").

With ``pooling="bucket"`` the budget of each span is not a constant: a **prologue** gives every
rank the same per-span numbers, and from them alone every rank (sender and receiver alike)
derives the same budget for every span of the collective buffer, in integer arithmetic.

* **Demand** (:func:`span_statistics`): each rank pools ``floor(bits·N)`` bits over its own
  whole buffer of ``N`` values, by the codec's own reverse water-filling over every group of the
  buffer at once (one threshold for the buffer; non-finite values count as 0 and never enter
  it), and counts the bits each span would get: its demand, sent as one byte, the nearest
  multiple of ``u`` bits (at least one for a demand above 0; :func:`demand_unit`: the group
  size for spans of up to ``255·group / 8`` values, so a demand of whole groups is exact with
  the default spans of 256). Two more bytes follow: ``min(rank + 1, 255)`` if
  this rank holds a finite value beyond ``max_input_abs`` (else 0), and the code of the
  binade ``e`` of its largest finite ``|x|``: 0 for none, 1 for ``e <= -127``, else
  ``e + 128``. Each byte is sent as an int8 less 128 (the maximum commutes with the shift).
* **Exchange**: one exact all-reduce (element-wise max) of those bytes: the same bits/value
  (``8 / span``) at any world size. The agreed demand of a span is ``u`` times its code (at
  most ``8·len``).
* **Budgets** (:func:`span_budgets`): the buffer's ``floor(bits·N) // 8`` bytes are shared
  among the spans by :func:`_distribute`: each span of agreed demand ``M_b > 0`` gets its
  demand plus the same bits a value (a water level; at most ``len_b`` bytes, 8 bits a value),
  or, where the demand exceeds the bytes, a share in proportion to ``M_b``; then per chunk
  the same, within the balance caps. Inside a span the groups then share its budget by the
  span's own water-filling (dynamiq_codec.py), which needs nothing from other spans, so
  results do not depend on how the engine cuts the buffer.

**Where it runs.** The functions here are the reference. On CPU buffers of at least
``_NATIVE_MIN`` values whose regions start on whole groups (every engine cut) the native
kernels (``dynamiq/kernels/csrc/dynamiq_pool.cpp``) give the same integers: the demand in two
passes (one over the values: group absmax, levels from :func:`level_table`, the level
histogram; one over the group levels at the threshold found from the histogram here), and
the integer sharing of :func:`_distribute`. The kernels' per-span budgets and payload offsets
are memoized in the result (:func:`chunk_kernel_ptrs`, :func:`chunk_bytes`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .formats import exponent_of

if TYPE_CHECKING:
    from .dynamiq_codec import DynamiqCodec

__all__ = [
    "SHARED_KEY",
    "chunk_budgets",
    "chunk_bytes",
    "chunk_kernel_args",
    "chunk_kernel_ptrs",
    "decode_statistics",
    "gathered",
    "shared_from_statistics",
    "span_budgets",
    "span_demand",
    "span_statistics",
]

#: the key of the prologue's result in ``HopContext.shared``
SHARED_KEY = "dynamiq.pool"
#: a chunk the prologue re-cuts holds at most this fraction more values than the mean chunk
#: (``chunk_sizes``' measure stays within 1.1): what bytes can be balanced within
RECUT_SLACK = 0.1
#: each rank measures its demand at this many bits/value below the codec's ``bits``: the
#: partial sums concentrate the budget more than one rank's gradient does (docs/benchmarks.md)
DEMAND_OFFSET = 2.0
#: buffers of at least this many values take their group absmax from the native CPU kernel
_NATIVE_MIN = 1 << 16
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


#: the statistics' dtype: a byte each, sent less :data:`_SHIFT`
STATS_DTYPE = torch.int8
_SHIFT = 128
#: the largest code of a byte of the statistics
_CODE_MAX = 255


def demand_unit(codec: DynamiqCodec) -> int:
    """Bits of demand per step of a span's one-byte code: the least multiple of the group
    size ``g`` in which a span's most, ``8·span`` bits, is at most 255 steps (``g`` for
    spans of up to ``255·g / 8`` values: every demand of whole groups, a multiple of ``g``,
    is then exact)."""
    g = codec.group
    return g * max(1, -(-8 * codec.span // (_CODE_MAX * g)))


def _binade_code(worst: float) -> int:
    """The code of the binade of the largest finite ``|x|`` (see the module docstring)."""
    if not worst > 0:
        return 0
    e = int(exponent_of(torch.tensor([worst])).item())
    return min(max(e + 128, 1), _CODE_MAX)


def _binade_of(code: int) -> int | None:
    """The binade a code stands for (an upper bound for code 1), ``None`` for code 0."""
    return None if code <= 0 else max(code - 128, -127)


def regions_of(
    codec: DynamiqCodec, numel: int, regions: list[tuple[int, int]] | None
) -> list[tuple[int, int]]:
    """The non-empty ``[start, end)`` regions whose budgets are pooled apart, sorted (default:
    the whole buffer); each has its own spans from its start (its last may be short).
    Raises ``ValueError`` unless they partition ``[0, numel)``."""
    if numel == 0:
        return []
    if not regions:
        return [(0, numel)]
    got = sorted((int(a), int(b)) for a, b in regions if b > a)
    ok = bool(got) and got[0][0] == 0 and got[-1][1] == numel
    if not ok or any(p[1] != q[0] for p, q in itertools.pairwise(got)):
        raise ValueError(
            f"dynamiq: pooling regions must partition [0, {numel}) (got {list(regions)[:4]}...)"
        )
    return got


def _span_lengths(codec: DynamiqCodec, regions: list[tuple[int, int]]) -> torch.Tensor:
    """The length of every span of every region, in order (int64)."""
    out = []
    for a, b in regions:
        full, rest = divmod(b - a, codec.span)
        out += [torch.full((full,), codec.span, dtype=torch.int64)]
        out += [torch.tensor([rest], dtype=torch.int64)] if rest else []
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def _finite_absmax(v: torch.Tensor, g: int) -> torch.Tensor:
    """The largest finite ``|v|`` of each group of ``g`` (``v``'s length a multiple of ``g``):
    one read of the values (``aminmax``); only groups holding NaN or ±Inf are read again."""
    if v.numel() == 0:
        return v.new_zeros(0, dtype=torch.float32)
    if v.device.type == "cpu" and v.numel() >= _NATIVE_MIN and v.dtype in _NATIVE_DTYPES:
        from dynamiq.kernels import cpu_native  # (the kernels import the codecs)

        if cpu_native.cpu_kernels_enabled() and cpu_native.available():
            return cpu_native.group_absmax(v.contiguous(), g)  # the same, one pass in C++
    rows = v.view(-1, g)
    lo, hi = torch.aminmax(rows, dim=1)
    a = torch.maximum(hi.float(), -lo.float())
    bad = ~torch.isfinite(a)
    if bool(bad.any()):
        sub = rows[bad].float()
        a[bad] = torch.where(torch.isfinite(sub), sub.abs(), 0.0).amax(dim=1)
    return a


def _group_absmax(
    codec: DynamiqCodec, flat: torch.Tensor, regions: list[tuple[int, int]], n_spans: int
) -> tuple[torch.Tensor, float]:
    """The finite group absmax ``[n_spans, span // group]`` of every region's spans (each
    region's groups from its own start, padding groups 0), and the largest of them."""
    span, g = codec.span, codec.group
    per = span // g
    if all(a % g == 0 for a, _ in regions):
        return _aligned_group_absmax(flat, regions, g, per, n_spans)
    parts = []
    for a, b in regions:
        full = (b - a) // g * g
        body = _finite_absmax(flat[a : a + full], g)
        tail = (
            _finite_absmax(
                torch.cat([flat[a + full : b].float(), flat.new_zeros(g - (b - a - full))]), g
            )
            if b - a > full
            else body.new_zeros(0)
        )
        pad = body.new_zeros(-(body.numel() + tail.numel()) % per)
        parts += [body, tail, pad]
    a_g = torch.cat(parts).view(n_spans, per)
    return a_g, float(a_g.max()) if a_g.numel() else 0.0


def _aligned_group_absmax(
    flat: torch.Tensor, regions: list[tuple[int, int]], g: int, per: int, n_spans: int
) -> tuple[torch.Tensor, float]:
    """:func:`_group_absmax` when every region starts on a multiple of ``g``: the regions'
    groups are the buffer's (only the buffer's last may be short), read in one pass, then
    each region's padded to whole spans."""
    n = flat.numel()
    full = n // g * g
    groups = _finite_absmax(flat[:full], g)
    if n > full:
        tail = torch.cat([flat[full:].float(), flat.new_zeros(g - (n - full), dtype=torch.float32)])
        groups = torch.cat([groups, _finite_absmax(tail, g)])
    count = torch.tensor([-(-(b - a) // g) for a, b in regions], dtype=torch.int64)
    padded = -(-count // per) * per
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(count, 0) - count)
    dest = torch.arange(groups.numel()) + torch.repeat_interleave(shift, count)
    dest = dest.to(groups.device)
    a_g = groups.new_zeros(n_spans * per)
    a_g[dest] = groups
    return a_g.view(n_spans, per), float(groups.max()) if groups.numel() else 0.0


def _level(k: int, a: torch.Tensor) -> torch.Tensor:
    """A group's level ``floor(k log2 absmax)`` (int32) of fp32 absmax ``a > 0``."""
    return torch.floor(k * torch.log2(a)).to(torch.int32)


#: thresholds of one binade in :func:`level_table`'s rows (the C kernel's ``KT``)
_PER_BINADE = 8
#: fp32 bit patterns each side of a threshold at which :func:`level_table` checks it
_CHECK = 256


@functools.cache
def level_table(k: int) -> dict[str, Any] | None:
    """:func:`_level` as a table the native kernel reads (``csrc/dynamiq_pool.cpp``): the
    smallest fp32 magnitude bits of every level above the lowest (``all``, ascending, int32),
    each binade's of them (``row``, ``[256, 8]``, padded with ``0x7FFFFFFF``), the level of
    each binade's smallest value less those inside it (``base``) and the lowest level
    (``l_min``); a value's level is ``l_min`` plus the thresholds at or below its bits. Found
    from :func:`_level` itself by bisection, and checked against it at the
    ``_CHECK`` bit patterns each side of every threshold (far from them ``log2``'s
    rounding cannot cross a level); ``None`` if that check fails or a binade holds more
    than 8 (the reference then runs)."""
    lo_b, hi_b = 1, 0x7F7FFFFF  # the positive finite fp32 values

    def level(bits: torch.Tensor) -> torch.Tensor:
        return _level(k, bits.to(torch.int32).view(torch.float32)).to(torch.int64)

    l_min, l_max = (int(v) for v in level(torch.tensor([lo_b, hi_b])))
    want = torch.arange(l_min + 1, l_max + 1, dtype=torch.int64)
    lo, hi = torch.full_like(want, lo_b), torch.full_like(want, hi_b)
    for _ in range(32):  # the smallest bits of level >= want lie in (lo, hi]
        mid = (lo + hi) // 2
        up = level(mid) >= want
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    near = (hi.view(-1, 1) + torch.arange(-_CHECK, _CHECK)).clamp(lo_b, hi_b).reshape(-1)
    if not torch.equal(level(near), l_min + torch.searchsorted(hi, near, right=True)):
        return None
    binade = hi >> 23
    per = torch.bincount(binade, minlength=256)
    if int(per[1:].max()) > _PER_BINADE:
        return None
    row = torch.full((256, _PER_BINADE), 0x7FFFFFFF, dtype=torch.int64)
    rank = torch.arange(hi.numel()) - (torch.cumsum(per, 0) - per)[binade]
    normal = binade > 0  # (the kernel searches ``all`` for subnormals)
    row[binade[normal], rank[normal]] = hi[normal]
    below = torch.searchsorted(hi, torch.arange(256, dtype=torch.int64) << 23)
    return {
        "all": hi.to(torch.int32),
        "row": row.to(torch.int32).reshape(-1),
        "base": (l_min + below).to(torch.int32),
        "l_min": l_min,
    }


def _threshold(k: int, hist: torch.Tensor, lo_l: int, budget: int) -> int:
    """The smallest water-filling threshold whose cost fits ``budget`` bits: ``hist[j]``
    the elements of the live groups of level ``lo_l + j`` (``nb + 1`` entries, the last 0):
    the next bit of a group at level ``L`` and width ``w`` is worth ``8 L + Q[w]``; every
    bit worth at least the threshold is taken."""
    q = _priority_q(k)
    nb = hist.numel() - 1
    suf = hist.flip(0).cumsum(0).flip(0).tolist()  # suf[j]: elements with L >= lo + j

    def cost(tau: int) -> int:  # a group takes its bit w iff L >= ceil((tau - Q)/8)
        return sum(suf[min(max(((tau - qw + 7) >> 3) - lo_l, 0), nb)] for qw in q)

    lo, hi = 8 * lo_l + min(q), 8 * (lo_l + nb - 1) + max(q) + 1
    while lo < hi:  # the smallest threshold whose cost fits
        mid = (lo + hi) >> 1
        if cost(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _priority_q(k: int) -> list[int]:
    from .dynamiq_codec import _PRIORITY  # the codec imports this module

    return list(_PRIORITY[k])


def _demand(
    codec: DynamiqCodec, a_g: torch.Tensor, sizes: torch.Tensor, budget: int
) -> torch.Tensor:
    """Each span's bits when ``budget`` bits are pooled over every group of the buffer by
    the codec's water-filling (``[spans, groups]`` absmax and sizes; :func:`_threshold`;
    a prediction: its leftover bits are not placed)."""
    from .dynamiq_codec import _priority_tables  # the codec imports this module

    k, g = codec.scale_steps, codec.group
    live = (a_g > 0) & (sizes > 0)
    if not bool(live.any()):
        return torch.zeros(a_g.shape[0], dtype=torch.int64, device=a_g.device)

    level = _level(k, torch.where(live, a_g, 1.0))
    lo_l = int(torch.where(live, level, 1 << 30).min())
    nb = int(torch.where(live, level, -(1 << 30)).max()) - lo_l + 1
    # the histogram of the live groups' levels weighted by their sizes: g each, less what the
    # few short groups (a region's last) lack
    rel = torch.where(live, level - lo_l, nb + 1).reshape(-1)
    hist = torch.bincount(rel, minlength=nb + 2)[: nb + 1] * g
    short = torch.nonzero((live & (sizes < g)).reshape(-1)).reshape(-1)
    hist.index_add_(0, rel[short].to(torch.int64), sizes.reshape(-1)[short] - g)
    tau = _threshold(k, hist.cpu(), lo_l, budget)
    # width: how many Q[w] >= tau - 8 L, from a table over the range of Q
    _, count = _priority_tables(k, a_g.device)
    q = _priority_q(k)
    q_lo, q_hi = min(q), max(q)
    w = count.index_select(0, (tau - 8 * level - q_lo).clamp(0, q_hi - q_lo + 1).reshape(-1))
    return (torch.where(live, w.view(level.shape), 0) * sizes).sum(dim=1)


def _native_demand(
    codec: DynamiqCodec, flat: torch.Tensor, regions: list[tuple[int, int]], budget: int
) -> tuple[torch.Tensor, float] | None:
    """:func:`_group_absmax` and :func:`_demand` in two passes of the native CPU kernel
    (``csrc/dynamiq_pool.cpp``; the same numbers): every span's demand and the largest
    finite ``|x|``; ``None`` where it does not run (not a CPU buffer of at least
    ``_NATIVE_MIN`` fp32/bf16/fp16 values, a region not on a whole group, no kernels)."""
    g, k = codec.group, codec.scale_steps
    if flat.device.type != "cpu" or flat.numel() < _NATIVE_MIN or flat.dtype not in _NATIVE_DTYPES:
        return None
    if any(a % g for a, _ in regions):
        return None
    from dynamiq.kernels import cpu_native  # (the kernels import the codecs)

    table = level_table(k)
    if table is None or not (cpu_native.cpu_kernels_enabled() and cpu_native.available()):
        return None
    from .dynamiq_codec import _priority_tables  # the codec imports this module

    levels, hist, worst = cpu_native.pool_levels(flat.contiguous(), g, table)
    n_spans = sum(-(-(b - a) // codec.span) for a, b in regions)
    used = torch.nonzero(hist).reshape(-1)
    if used.numel() == 0:
        return torch.zeros(n_spans, dtype=torch.int64), worst
    first, last = int(used[0]), int(used[-1])
    lo_l = table["l_min"] + first
    tau = _threshold(k, torch.cat([hist[first : last + 1], hist.new_zeros(1)]), lo_l, budget)
    _, count = _priority_tables(k, torch.device("cpu"))
    demand = cpu_native.pool_demand(
        levels, flat.numel(), g, regions, codec.span, tau, count, min(_priority_q(k))
    )
    return demand, worst


def span_demand(
    codec: DynamiqCodec, x: torch.Tensor, regions: list[tuple[int, int]]
) -> tuple[torch.Tensor, float]:
    """Each span's demand (bits, int64, CPU) of this rank's whole buffer ``x`` cut into
    ``regions``, and its largest finite ``|x|``: by the native kernel where it runs, else
    the reference (the same numbers)."""
    flat = x.detach().reshape(-1)
    n, span, g = flat.numel(), codec.span, codec.group
    lens = _span_lengths(codec, regions)
    if n == 0:
        return torch.zeros(lens.numel(), dtype=torch.int64), 0.0
    budget = math.floor(max(codec.bits - DEMAND_OFFSET, 0.5) * n)
    native = _native_demand(codec, flat, regions, budget)
    if native is not None:
        demand, worst = native
    else:
        a_g, worst = _group_absmax(codec, flat, regions, lens.numel())
        start = torch.arange(span // g, device=flat.device) * g
        sizes = (lens.to(flat.device).view(-1, 1) - start).clamp(0, g)  # padding weighs 0
        demand = _demand(codec, a_g, sizes, budget)
    return demand.cpu().to(torch.int64), worst


def span_statistics(
    codec: DynamiqCodec, x: torch.Tensor, rank: int, regions: list[tuple[int, int]]
) -> torch.Tensor:
    """This rank's statistics of its whole buffer ``x`` cut into ``regions``
    (:func:`regions_of`): each span's demand code (:func:`span_demand`), then the bad-input
    flag and the largest binade's code, a byte each as :data:`STATS_DTYPE` less 128 (see the
    module docstring)."""
    demand, worst = span_demand(codec, x, regions)
    unit, n_spans = demand_unit(codec), demand.numel()
    codes = torch.zeros(n_spans + 2, dtype=torch.int64)
    near = torch.div(demand + unit // 2, unit, rounding_mode="floor")  # nearest, >= 1 if > 0
    codes[:n_spans] = torch.where(demand > 0, near.clamp(1, _CODE_MAX), 0)
    codes[n_spans] = min(rank + 1, _CODE_MAX) if worst > codec.max_input_abs else 0
    codes[n_spans + 1] = _binade_code(worst)
    return (codes - _SHIFT).to(STATS_DTYPE)


def decode_statistics(
    codec: DynamiqCodec, stats: torch.Tensor
) -> tuple[torch.Tensor, int, int | None]:
    """What :func:`span_statistics` (or their maximum over ranks) say: each span's demand
    (bits, int64, CPU), the bad-input flag (``rank + 1``, at most 255; 0: none) and the binade
    of the largest finite ``|x|`` (``None``: no value above 0; -127 stands for -127 or below)."""
    if stats.dtype != STATS_DTYPE or stats.numel() < 2:
        raise ValueError(
            f"dynamiq: statistics are {STATS_DTYPE}, two or more (got {stats.dtype}, "
            f"{stats.numel()})"
        )
    codes = stats.detach().to(torch.int64).cpu().reshape(-1) + _SHIFT
    return codes[:-2] * demand_unit(codec), int(codes[-2]), _binade_of(int(codes[-1]))


def shared_from_statistics(
    codec: DynamiqCodec,
    reduced: torch.Tensor,
    numel: int,
    world_size: int,
    regions: list[tuple[int, int]],
    recut_align: int | None = None,
    parts: int | None = None,
) -> dict[str, Any]:
    """``HopContext.shared`` from the all-reduced (max) statistics of the buffer cut into
    ``regions``; raises ``ValueError``, on every rank alike, for input beyond
    ``max_input_abs`` on any rank, or partial sums that could grow beyond it.

    ``recut_align``: the engine lets the prologue choose the bounds of its ``parts``
    chunks (multiples of that many values): the regions become the cut of equal bytes
    (:func:`recut`), returned under ``CHUNK_BOUNDS_KEY`` (``dynamiq.collectives.planning``)
    for the engine."""
    lens = _span_lengths(codec, regions)
    n_spans = lens.numel()
    if reduced.numel() != n_spans + 2:
        raise ValueError(
            f"dynamiq: {reduced.numel()} statistics for a buffer of {numel} values "
            f"({n_spans} spans + 2 expected)"
        )
    demand, bad, top = decode_statistics(codec, reduced)
    if bad:
        who = f"rank {bad - 1}" if bad < _CODE_MAX else f"a rank numbered {_CODE_MAX - 1} or more"
        raise ValueError(
            f"dynamiq: {who} holds a value beyond max_input_abs="
            f"{codec.max_input_abs!r} (a super-group scale would round up to infinity)"
        )
    # every decoded partial sum is within (1 + 2^-7) of its own absmax (the bf16 round-up),
    # so c contributions of absmax <= A stay below c·A·(1 + 2^-7)^(c - 1)
    c = max(world_size, 1)
    log_growth = math.log2(c) + (c - 1) * math.log2(1 + 2.0**-7)
    if top is not None and top + 1 + log_growth > math.log2(codec.max_input_abs):
        limit = 2.0 ** max(math.log2(codec.max_input_abs) - log_growth, -1074.0)
        raise ValueError(
            f"dynamiq: a value of |x| >= 2^{top} on some rank: partial sums of {c} ranks could "
            f"exceed max_input_abs={codec.max_input_abs!r}; keep |x| below {limit:.3g}"
        )
    # (a span never demands more than 8 bits a value: a larger code is clamped)
    demand = torch.minimum(demand, 8 * lens)
    out: dict[str, Any] = {}
    parts = len(regions) if parts is None else parts
    if recut_align is not None and parts > 1 and numel > 0:
        from dynamiq.collectives.planning import CHUNK_BOUNDS_KEY  # not at import: cycle

        regions = recut(codec, demand, lens, numel, parts, recut_align)
        out[CHUNK_BOUNDS_KEY] = list(regions)
        regions = [(a, b) for a, b in regions if b > a]
    first = [0]
    for a, b in regions:
        first.append(first[-1] + -(-(b - a) // codec.span))
    out[SHARED_KEY] = Pool(
        demand=demand, lens=lens, numel=numel, regions=tuple(regions), first=tuple(first)
    )
    return out


def recut(
    codec: DynamiqCodec,
    demand: torch.Tensor,
    lens: torch.Tensor,
    numel: int,
    parts: int,
    align: int,
    slack: float = RECUT_SLACK,
) -> list[tuple[int, int]]:
    """``parts`` chunk bounds (multiples of ``align``, a multiple of the span, but the
    buffer's end) whose largest chunk holds the fewest bytes of the whole-bucket budgets
    (uncapped), among those of at most ``1 + slack`` times the mean chunk's values
    (or the even cut's largest, if more): a binary search on the bytes, each tried by the
    greedy cover that takes the most units it may (optimal for a limit on every chunk).
    Integer arithmetic on shared data: every rank finds the same cut."""
    if align % codec.span:
        raise ValueError(f"dynamiq: chunks aligned to {align} values cut spans of {codec.span}")
    units = -(-numel // align)
    zero = torch.zeros(1, dtype=torch.int64)
    total = torch.tensor([math.floor(codec.bits * numel) // 8])
    whole = _distribute(demand, lens, [0, lens.numel()], total)
    per_unit = torch.arange(lens.numel()) // (align // codec.span)
    cum = torch.cat([zero[:1], _segment_sum(whole, per_unit, units).cumsum(0)]).tolist()
    mean = numel / parts
    most = max(int((1 + slack) * mean) // align, -(-numel // (parts * align)), 1)

    def cover(limit: int) -> list[int] | None:
        cuts = [0]
        while cuts[-1] < units and len(cuts) <= parts:
            at = cuts[-1]
            end = min(at + most, bisect.bisect_right(cum, cum[at] + limit) - 1, units)
            if end <= at:
                return None
            cuts.append(end)
        return cuts if cuts[-1] == units else None

    lo, hi = 0, cum[-1]
    while lo < hi:
        mid = (lo + hi) // 2
        if cover(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    got = cover(lo)
    assert got is not None  # the even cut is one such cover
    while len(got) < parts + 1:  # fewer chunks: split the longest (never more bytes)
        i = max(range(len(got) - 1), key=lambda j: (got[j + 1] - got[j], -j))
        if got[i + 1] - got[i] < 2:
            got.append(units)  # single units all: empty chunks at the end
            continue
        got.insert(i + 1, (got[i] + got[i + 1]) // 2)
    return [(min(a * align, numel), min(b * align, numel)) for a, b in itertools.pairwise(got)]


@dataclass(eq=False)
class Pool:
    """The prologue's result (``HopContext.shared[SHARED_KEY]``): the agreed demand of every
    span (bits, int64), the spans' lengths, the buffer's length, the regions and the index of
    each region's first span (and one past the last); budgets are memoized per bits/value.
    ``fixed``: the budgets of every span whatever the bits/value (:func:`gathered`).
    Equal when the agreed data are (every rank's are)."""

    demand: torch.Tensor
    lens: torch.Tensor
    numel: int
    regions: tuple[tuple[int, int], ...]
    first: tuple[int, ...]
    budgets: dict[tuple[float, float, int], torch.Tensor] = field(default_factory=dict)
    fixed: torch.Tensor | None = None
    #: per bits/value, the container bytes of the spans before each span (and the total)
    prefix: dict[float, list[int]] = field(default_factory=dict)
    #: per bits/value, every span's budget (bits) and start (:func:`chunk_kernel_args`)
    kernel_args: dict[float, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: per (span, bits/value, values, offset) of a chunk: its budgets' bytes
    #: (:func:`chunk_bytes`) and its kernel arguments (:func:`chunk_kernel_ptrs`)
    sizes: dict[tuple[int, float, int, int], int] = field(default_factory=dict)
    ptrs: dict[tuple[int, float, int, int], tuple[int, int, int]] = field(default_factory=dict)
    #: what a kernel memoizes per call of its own (keyed on values and on objects it holds:
    #: ``dynamiq/kernels/cpu_native.py``); it lives as long as this result
    kernel_memo: dict[Any, Any] = field(default_factory=dict)
    #: the pool as tensors, made once (:func:`pool_tensors`)
    tensors: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        #: each region's first value (:func:`_first_span` bisects them)
        self.starts = [a for a, _ in self.regions]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pool):
            return NotImplemented
        same = (self.numel, self.regions) == (other.numel, other.regions)
        return same and torch.equal(self.demand, other.demand)

    __hash__ = None  # type: ignore[assignment]


def _segment_sum(values: torch.Tensor, seg: torch.Tensor, n_seg: int) -> torch.Tensor:
    return torch.zeros(n_seg, dtype=values.dtype).index_add_(0, seg, values)


#: the water level's steps (:func:`_distribute`): 1/LEVEL_STEPS bit a value
LEVEL_STEPS = 256


def _level_bytes(
    demand: torch.Tensor, lens: torch.Tensor, live: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """Each span's bytes at water level ``delta`` (1/LEVEL_STEPS bits a value, per span):
    ``min(len, max(0, LEVEL_STEPS·demand + delta·len) // (8·LEVEL_STEPS))`` for a live span,
    0 for the others."""
    num = (LEVEL_STEPS * demand + delta * lens).clamp(min=0)
    return torch.where(live, torch.minimum(num // (8 * LEVEL_STEPS), lens), 0)


def _distribute(
    demand: torch.Tensor, lens: torch.Tensor, first: list[int], total: torch.Tensor
) -> torch.Tensor:
    """Bytes of every span: each segment's ``total`` shared among its spans (segment ``s``:
    the spans ``first[s]:first[s + 1]``), at most ``lens`` (a byte a value) each. A segment
    whose total holds its demand raises a water level: every live span (demand above 0;
    every span of a segment demanding nothing) gets its demand plus the same bits a value; a
    segment demanding more than its total shares it in proportion to the demand
    (docs/formats.md, "dynamiq"). By the native CPU kernel where it runs, for 256 spans or
    more (``csrc/dynamiq_pool.cpp``: the same integers), else :func:`_distribute_reference`."""
    from dynamiq.kernels import cpu_native  # (the kernels import the codecs)

    native = lens.numel() >= _NATIVE_MIN // 256 and cpu_native.cpu_kernels_enabled()
    if native and cpu_native.available():
        return cpu_native.pool_distribute(demand, lens, first, total)
    seg = torch.repeat_interleave(torch.arange(len(first) - 1), torch.tensor(first).diff())
    return _distribute_reference(demand, lens, seg, total)


def _distribute_reference(
    demand: torch.Tensor, lens: torch.Tensor, seg: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """:func:`_distribute` in PyTorch (``seg``: each span's segment, ascending). A segment
    of total ``T`` bytes and demand ``W`` bits: for ``W <= 8·T`` the level is the largest
    ``delta`` in ``[-8, 8]·LEVEL_STEPS`` whose bytes (:func:`_level_bytes`) fit ``T`` (at the
    lowest every span gets 0: a demand is at most 8 bits a value); for ``W > 8·T`` a span of
    demand ``d`` gets ``d·T // W`` bytes. The bytes left then go one each, in span order,
    round after round, to the live spans below their cap; what none has room for is not
    sent."""
    n_seg = total.numel()
    want = _segment_sum(demand, seg, n_seg)
    live = (demand > 0) | (want == 0)[seg]
    step = 8 * LEVEL_STEPS
    lo = torch.full((n_seg,), -step, dtype=torch.int64)  # fits
    hi = torch.full((n_seg,), step + 1, dtype=torch.int64)  # does not fit (or past the top)
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        fits = _segment_sum(_level_bytes(demand, lens, live, mid[seg]), seg, n_seg) <= total
        lo, hi = torch.where(fits, mid, lo), torch.where(fits, hi, mid)
    over = (want > 8 * total)[seg]
    prop = demand * total[seg] // want[seg].clamp(min=1)  # (< demand / 8 <= lens)
    out = torch.where(over, prop, _level_bytes(demand, lens, live, lo[seg]))
    left = total - _segment_sum(out, seg, n_seg)
    starts = torch.searchsorted(seg, torch.arange(n_seg))
    while True:  # one byte each, in span order, to the live spans below their cap
        room = (live & (out < lens) & (left[seg] > 0)).to(torch.int64)
        if not bool(room.any()):
            return out
        cum = torch.cumsum(room, 0)
        before = torch.cat([torch.zeros(1, dtype=torch.int64), cum])[starts]
        give = (room.bool() & (cum - before[seg] <= left[seg])).to(torch.int64)
        out, left = out + give, left - _segment_sum(give, seg, n_seg)


def _region_totals(pooled: torch.Tensor, uniform: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Each region's bytes: what whole-buffer pooling gives it (``pooled``), at most ``cap``,
    the excess moved to the regions below their cap in proportion to what they had."""
    out = torch.minimum(pooled, cap)
    zero = torch.zeros_like(out)
    for _ in range(32):
        left = int(uniform.sum() - out.sum())
        room = out < cap
        if left <= 0 or not bool(room.any()):
            break
        w = torch.where(room, pooled.clamp(min=1), 0)
        share = w * left // int(w.sum())
        if not bool(share.any()):  # the last bytes, one each in order
            share = (room & (torch.cumsum(room.to(torch.int64), 0) <= left)).to(torch.int64)
        out = torch.minimum(out + torch.maximum(share, zero), cap)
    return out


def span_budgets(pool: Pool, bits: float, balance: float, slack: int) -> torch.Tensor:
    """Bytes of every span's container (int64, CPU) for ``bits`` bits/value (memoized in
    ``pool``): the buffer's ``floor(bits·N) // 8`` bytes shared among its spans by their
    demand (:func:`_distribute`; at most a byte a value), each region holding at most
    ``balance`` times the mean ``m`` of the regions' uniform shares ``floor(bits·len) // 8``,
    or ``floor(m) + slack`` bytes where that is more (the excess goes to the others)."""
    key = (bits, balance, slack)
    got = pool.fixed if pool.fixed is not None else pool.budgets.get(key)
    if got is not None:
        return got
    demand, lens, first = pool.demand, pool.lens, list(pool.first)
    n_seg = len(first) - 1
    seg = torch.repeat_interleave(torch.arange(n_seg), torch.tensor(first).diff())
    uniform = torch.tensor([math.floor(bits * (b - a)) // 8 for a, b in pool.regions])
    whole = _distribute(demand, lens, [0, lens.numel()], uniform.sum().view(1))
    pooled = _segment_sum(whole, seg, n_seg)
    # every region at most `balance` times the mean region's share (the largest message of
    # a round over the mean; a region of fewer values may hold more bytes per value), or
    # `slack` bytes above it: a round of small messages costs its latency, not its bytes
    mean = int(uniform.sum()) / max(n_seg, 1)
    most = max(math.floor(mean * balance), math.floor(mean) + slack)
    cap = torch.minimum(
        torch.full((n_seg,), most, dtype=torch.int64),
        _segment_sum(lens, seg, n_seg),
    )
    totals = _region_totals(pooled, uniform, cap)
    # one region holding the whole buffer's bytes: the same sharing as the whole buffer's
    same = n_seg == 1 and torch.equal(totals, uniform.sum().view(1))
    out = whole if same else _distribute(demand, lens, first, totals)
    pool.budgets[key] = out
    return out


def chunk_budgets(
    codec: DynamiqCodec, shared: Any, numel: int, offset: int, bits: float
) -> torch.Tensor | None:
    """Bytes of the containers of the spans of ``numel`` values at global ``offset`` (int64,
    CPU), or ``None`` when ``shared`` holds no pooling result (the uniform budget applies).
    The values must be whole spans of one region (or end it)."""
    pool = _pool_of(shared)
    if pool is None:
        return None
    if numel == 0 and 0 <= offset <= pool.numel:
        return torch.zeros(0, dtype=torch.int64)
    first = _first_span(codec, pool, numel, offset)
    return span_budgets(pool, bits, codec.balance, codec.balance_slack)[
        first : first + -(-numel // codec.span)
    ]


def chunk_bytes(
    codec: DynamiqCodec, shared: Any, numel: int, offset: int, bits: float
) -> int | None:
    """``int(chunk_budgets(...).sum())`` (``None`` likewise), from prefix sums memoized in
    the pool, and memoized there per chunk: what sizing a message costs, once per sub-chunk,
    without tensor work."""
    pool = _pool_of(shared)
    if pool is None:
        return None
    key = (codec.span, bits, numel, offset)
    got = pool.sizes.get(key)
    if got is None:
        if numel == 0 and 0 <= offset <= pool.numel:
            got = 0
        else:
            first = _first_span(codec, pool, numel, offset)
            prefix = _prefix(codec, pool, bits)
            got = prefix[first + -(-numel // codec.span)] - prefix[first]
        _remember(pool.sizes, key, got)
    return got


#: the most chunks a pool memoizes per kind (an engine's sub-chunks are far fewer)
_MAX_CHUNKS = 1 << 16


def _remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    if len(memo) >= _MAX_CHUNKS:
        memo.clear()
    memo[key] = value


def _prefix(codec: DynamiqCodec, pool: Pool, bits: float) -> list[int]:
    got = pool.prefix.get(bits)
    if got is None:
        budgets = span_budgets(pool, bits, codec.balance, codec.balance_slack)
        got = pool.prefix[bits] = [0, *torch.cumsum(budgets, 0).tolist()]
    return got


def chunk_kernel_args(
    codec: DynamiqCodec, shared: Any, numel: int, offset: int, bits: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The spans of ``numel`` values at global ``offset``: each span's budget (bits; a view)
    and its payload's byte offset in the chunk's payload (int64, contiguous, CPU); ``None``
    as :func:`chunk_budgets`. (The native kernels take :func:`chunk_kernel_ptrs` instead: the
    same numbers without a tensor a call.)"""
    pool = _pool_of(shared)
    if pool is None:
        return None
    if numel == 0 and 0 <= offset <= pool.numel:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    first = _first_span(codec, pool, numel, offset)
    budgets, starts = _every_span(codec, pool, bits)
    end = first + -(-numel // codec.span)
    return budgets[first:end], starts[first:end] - starts[first]


def chunk_kernel_ptrs(
    codec: DynamiqCodec, shared: Any, numel: int, offset: int, bits: float
) -> tuple[int, int, int] | None:
    """What ``dq_dyn_run`` takes for the spans of ``numel > 0`` values at global ``offset``
    (``csrc/dynamiq_kernels.cpp``): the addresses of the first span's entries in two int64
    tensors over every span of the buffer memoized in the pool per bits/value (the budgets in
    bits; each span's start were every span whole: its budget plus a whole span's header),
    and that first start, which the kernel subtracts (the start of a span in the chunk's
    payload: every span of a chunk but its last is whole, so only whole spans lie between
    two of its spans' starts). ``None`` as :func:`chunk_budgets`. The pool holds the tensors:
    the addresses stay valid while the caller holds ``shared``."""
    pool = _pool_of(shared)
    if pool is None:
        return None
    key = (codec.span, bits, numel, offset)
    got = pool.ptrs.get(key)
    if got is None:
        first = _first_span(codec, pool, numel, offset)
        budgets, starts = _every_span(codec, pool, bits)
        base = _prefix(codec, pool, bits)[first] + first * sum(codec._header_bytes(codec.span))
        got = (budgets.data_ptr() + 8 * first, starts.data_ptr() + 8 * first, base)
        _remember(pool.ptrs, key, got)
    return got


def _every_span(codec: DynamiqCodec, pool: Pool, bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every span's budget (bits) and start were every span whole (int64, contiguous; memoized
    in ``pool`` per bits/value)."""
    got = pool.kernel_args.get(bits)
    if got is None:
        budgets = span_budgets(pool, bits, codec.balance, codec.balance_slack)
        sizes = budgets + sum(codec._header_bytes(codec.span))
        got = (budgets * 8).contiguous(), (torch.cumsum(sizes, 0) - sizes).contiguous()
        pool.kernel_args[bits] = got
    return got


def kernel_memo(shared: Any) -> dict[Any, Any] | None:
    """The pool's :attr:`Pool.kernel_memo`, or ``None`` when ``shared`` holds no pool."""
    pool = _pool_of(shared)
    return None if pool is None else pool.kernel_memo


def _pool_of(shared: Any) -> Pool | None:
    pool = shared.get(SHARED_KEY) if shared is not None else None
    if pool is not None and not isinstance(pool, Pool):
        raise TypeError(f"dynamiq: shared[{SHARED_KEY!r}] is not this codec's prologue result")
    return pool


def _first_span(codec: DynamiqCodec, pool: Pool, numel: int, offset: int) -> int:
    """The index of the first of the spans of ``numel`` values at global ``offset``, which
    must be whole spans of one region (or end it), else ``ValueError``."""
    span, regions = codec.span, pool.regions
    end = offset + numel
    r0 = bisect.bisect_right(pool.starts, offset) - 1
    r1 = bisect.bisect_right(pool.starts, end - 1) - 1
    ok = r0 >= 0 and end <= pool.numel and (offset - regions[r0][0]) % span == 0
    # the regions crossed end on spans
    ok = ok and all((regions[r][1] - offset) % span == 0 for r in range(max(r0, 0), max(r1, 0)))
    if not ok or (numel % span and end != regions[r1][1]):
        raise ValueError(
            f"dynamiq: values {offset}..{end} are not whole spans of {span} of the pooling "
            f"regions of the buffer of {pool.numel} values (the prologue ran on another "
            f"buffer or cut?)"
        )
    return pool.first[r0] + (offset - regions[r0][0]) // span


def gathered(codec: DynamiqCodec, shared: Any, budgets: list[torch.Tensor], numel: int) -> Any:
    """``HopContext.shared`` for ``numel`` values cut from the buffer in pieces of whole spans
    of the pooling regions (only the last piece may end in a short span) and laid end to end
    from offset 0, ``budgets`` each piece's :func:`chunk_budgets` (at one bits/value): every
    span keeps its container, and so its bytes and values, since each span is encoded on its
    own. ``dynamiq/collectives/simulator.py`` encodes the chunks of many ranks in one call so."""
    fixed = torch.cat(budgets) if budgets else torch.zeros(0, dtype=torch.int64)
    n_spans, rest = fixed.numel(), numel % codec.span
    if n_spans != -(-numel // codec.span):
        raise ValueError(f"dynamiq: {n_spans} span budgets for {numel} values")
    lens = torch.full((n_spans,), codec.span, dtype=torch.int64)
    if rest:
        lens[-1] = rest
    pool = Pool(
        demand=8 * fixed,
        lens=lens,
        numel=numel,
        regions=((0, numel),) if numel else (),
        first=(0, n_spans) if numel else (0,),
        fixed=fixed,
    )
    return {**shared, SHARED_KEY: pool}


def pool_tensors(shared: Any) -> list[torch.Tensor]:
    """The pool in ``shared`` as tensors (``[]`` without one), the form in which it crosses a
    ``torch.library`` op: the demand, the spans' lengths, one int64 tensor of the buffer's
    length, the regions and each region's first span, and the fixed budgets (empty unless
    :func:`gathered` made the pool). Made once per pool (:attr:`Pool.tensors`)."""
    pool = _pool_of(shared)
    if pool is None:
        return []
    if pool.tensors is None:
        flat = [pool.numel, len(pool.regions), *itertools.chain(*pool.regions), *pool.first]
        fixed = pool.fixed if pool.fixed is not None else torch.zeros(0, dtype=torch.int64)
        pool.tensors = [pool.demand, pool.lens, torch.tensor(flat, dtype=torch.int64), fixed]
    return list(pool.tensors)


#: the last pools rebuilt by :func:`pool_from_tensors`, by the identity of their demand tensor
_FROM_TENSORS: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}


def pool_from_tensors(tensors: list[torch.Tensor]) -> dict[str, Any] | None:
    """``{SHARED_KEY: pool}`` from :func:`pool_tensors`'s tensors (``None`` from ``[]``); the
    same tensors give the same object (so its memos stay warm)."""
    if not tensors:
        return None
    if len(tensors) != 4:
        raise ValueError(f"dynamiq: a pool crosses as 4 tensors (got {len(tensors)})")
    demand, lens, meta, fixed = tensors
    got = _FROM_TENSORS.get(id(demand))
    if got is not None and got[0] is demand:
        return got[1]
    flat = [int(v) for v in meta.tolist()]
    numel, n_regions = flat[0], flat[1]
    ends = flat[2 : 2 + 2 * n_regions]
    regions = tuple((ends[2 * i], ends[2 * i + 1]) for i in range(n_regions))
    pool = Pool(
        demand=demand.to(torch.int64).cpu(),
        lens=lens.to(torch.int64).cpu(),
        numel=numel,
        regions=regions,
        first=tuple(flat[2 + 2 * n_regions :]),
        fixed=fixed.to(torch.int64).cpu() if fixed.numel() else None,
    )
    if len(_FROM_TENSORS) >= 64:
        _FROM_TENSORS.clear()
    out = _FROM_TENSORS[id(demand)] = (demand, {SHARED_KEY: pool})
    return out[1]
