"""The pooled DynamiQ prologue's native CPU kernels (``csrc/dynamiq_pool.cpp``) against the
PyTorch reference of ``dynamiq/codecs/_dynamiq_pool.py``: the level table against the
reference's own ``floor(k log2 a)`` on every threshold and its neighbours, the per-span
demand on real gradients of every model family (and on values placed at the thresholds,
with NaN, ±Inf, zeros and subnormals), and the budgets' integer sharing."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
import torch

from dynamiq.codecs import _dynamiq_pool as pool
from dynamiq.codecs.dynamiq_codec import DynamiqCodec, _priority_tables
from dynamiq.data import FAMILIES, load_slice
from dynamiq.kernels import cpu_native

if cpu_native._compiler() is None:
    pytest.skip(
        "no C++ compiler on this machine (CXX, g++, c++, clang++): the native CPU kernels "
        "cannot be built here",
        allow_module_level=True,
    )


@pytest.fixture
def reference() -> Iterator[None]:
    """Within the block the prologue runs its PyTorch reference (no native kernels)."""
    yield
    cpu_native.set_cpu_kernels(None)


def _both(codec: DynamiqCodec, x: torch.Tensor, regions: list[tuple[int, int]]):
    """(native, reference) demand and largest finite ``|x|`` of ``x``, then the same
    statistics; the native path must have run."""
    assert pool._native_demand(codec, x.reshape(-1), regions, 1000) is not None
    native = pool.span_demand(codec, x, regions), pool.span_statistics(codec, x, 3, regions)
    cpu_native.set_cpu_kernels(False)
    try:
        assert pool._native_demand(codec, x.reshape(-1), regions, 1000) is None
        ref = pool.span_demand(codec, x, regions), pool.span_statistics(codec, x, 3, regions)
    finally:
        cpu_native.set_cpu_kernels(None)
    (nd, nw), ns = native
    (rd, rw), rs = ref
    assert torch.equal(nd, rd) and nw == rw, (nd, rd, nw, rw)
    return ns, rs


def _level_of_table(table: dict, bits: torch.Tensor) -> torch.Tensor:
    """A level as the kernel reads the table: ``l_min`` plus the thresholds <= the bits."""
    return table["l_min"] + torch.searchsorted(table["all"].long(), bits, right=True)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_level_table_is_the_references_level(k: int) -> None:
    """Every threshold, its neighbours, and random bit patterns of every binade (subnormals
    included): the table's level is ``_level``'s. Its rows hold each normal binade's
    thresholds and ``base`` counts those below."""
    table = pool.level_table(k)
    assert table is not None
    thr = table["all"].long()
    g = torch.Generator().manual_seed(k)
    rand = torch.randint(1, 0x7F800000, (200_000,), generator=g)
    bits = torch.cat([thr, thr - 1, thr + 1, thr - 7, thr + 7, rand]).clamp(1, 0x7F7FFFFF)
    want = pool._level(k, bits.to(torch.int32).view(torch.float32)).long()
    assert torch.equal(_level_of_table(table, bits), want)
    # (1 is the first level above l_min: the smallest subnormal has level l_min)
    assert table["l_min"] == math.floor(k * math.log2(2.0**-149))
    row, base = table["row"].long().view(256, -1), table["base"].long()
    for e in (1, 60, 127, 200, 254):
        inside = thr[(thr >> 23) == e]
        assert torch.equal(row[e, : inside.numel()], inside)
        assert bool((row[e, inside.numel() :] == 0x7FFFFFFF).all())
        assert int(base[e]) == table["l_min"] + int((thr < (e << 23)).sum())


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_native_levels_at_every_threshold(k: int) -> None:
    """The kernel's own level of values on, one below and one above every threshold (groups
    of one value: a level each), against ``_level``: every row's thresholds count, the binade
    that holds ``k + 1`` of them included."""
    table = pool.level_table(k)
    assert table is not None
    thr = table["all"].long()
    bits = torch.cat([thr, thr - 1, thr + 1]).clamp(1, 0x7F7FFFFF)
    x = bits.to(torch.int32).view(torch.float32)
    levels, _, _ = cpu_native.pool_levels(x, 1, table)
    assert torch.equal(levels.long(), pool._level(k, x).long())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demand_on_real_gradients_is_the_references(
    family: str, dtype: torch.dtype, reference: None
) -> None:
    """The committed slice of each family, one region and the engine's four chunks (and
    regions on whole groups but not whole spans, and a short last group)."""
    x = load_slice(family).reshape(-1).to(dtype)
    n = x.numel() // 256 * 256
    codec = DynamiqCodec()
    cases = [
        (x[:n], [(0, n)]),
        (x[:n], [(i * n // 4 // 256 * 256, (i + 1) * n // 4 // 256 * 256) for i in range(3)]
         + [(3 * n // 4 // 256 * 256, n)]),
        (x[: n - 5], [(0, 16 * 4001), (16 * 4001, 16 * 9000), (16 * 9000, n - 5)]),
    ]  # fmt: skip
    for values, regions in cases:
        native, ref = _both(codec, values, regions)
        assert torch.equal(native, ref), (family, dtype, regions[:2])
        assert int(pool.decode_statistics(codec, native)[0].sum()) > 0


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_demand_at_the_level_thresholds(k: int, dtype: torch.dtype, reference: None) -> None:
    """Values on, one below and one above every threshold, with NaN, ±Inf, zeros and
    subnormals, groups of 16 and of 5: the native demand and flags are the reference's."""
    table = pool.level_table(k)
    assert table is not None
    thr = table["all"].long()
    vals = torch.cat([thr, thr - 1, thr + 1]).clamp(1, 0x7F7FFFFF).to(torch.int32)
    vals = vals.view(torch.float32)
    vals = vals[(vals < 6e4) & (vals > 6e-8)] if dtype == torch.float16 else vals
    g = torch.Generator().manual_seed(k)
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3e-39])
    x = torch.cat([vals.repeat(-(-70_000 // vals.numel())), specials.repeat(300)])
    x = x[torch.randperm(x.numel(), generator=g)]
    x = x * torch.where(torch.rand(x.numel(), generator=g) < 0.5, -1.0, 1.0)
    x[:64] = 0.0  # a span of zeros and groups of zeros
    x = x[: x.numel() // 16 * 16 - 3].to(dtype)  # a short last group
    for group in (16, 5):
        shape = {} if group == 16 else {"group": 5, "super_group": 80, "span": 1280}
        codec = DynamiqCodec(scale_steps=k, **shape)
        native, ref = _both(codec, x, [(0, x.numel())])
        assert torch.equal(native, ref), (k, dtype, group)


def test_demand_of_a_buffer_without_finite_values(reference: None) -> None:
    x = torch.tensor([math.nan, math.inf, 0.0, -math.inf]).repeat(1 << 15)
    native, ref = _both(DynamiqCodec(), x, [(0, x.numel())])
    assert torch.equal(native, ref)
    demand, bad, top = pool.decode_statistics(DynamiqCodec(), native)
    assert int(demand.abs().sum()) == 0 and bad == 0 and top is None


def _distribute_cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(60):
        ns = int(torch.randint(1, 400, (), generator=g))
        lens = torch.randint(1, 257, (ns,), generator=g)
        lens[torch.rand(ns, generator=g) < 0.5] = 256
        demand = torch.randint(0, 2049, (ns,), generator=g)
        demand = torch.minimum(demand, 8 * lens)
        demand[torch.rand(ns, generator=g) < 0.3] = 0
        cuts = torch.randint(0, ns + 1, (int(torch.randint(0, 6, (), generator=g)),), generator=g)
        first = sorted({0, ns, *cuts.tolist()})
        if int(torch.randint(0, 4, (), generator=g)) == 0:
            first = sorted([*first, first[-1]])  # an empty segment
        seg_len = [int(lens[a:b].sum()) for a, b in itertools.pairwise(first)]
        # totals from nothing to past every cap
        total = torch.tensor([int(torch.randint(0, 2 * m + 2, (), generator=g)) for m in seg_len])
        yield demand, lens, first, total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distribute_is_the_references(seed: int) -> None:
    """Random segments (demanding nothing, capped, empty, totals beyond every cap)."""
    for demand, lens, first, total in _distribute_cases(seed):
        seg = torch.repeat_interleave(torch.arange(len(first) - 1), torch.tensor(first).diff())
        want = pool._distribute_reference(demand, lens, seg, total)
        got = cpu_native.pool_distribute(demand, lens, first, total)
        assert torch.equal(got, want), (first, total.tolist())
        assert bool((got <= lens).all()) and bool((got >= 0).all())


def test_distribute_on_real_demand(reference: None) -> None:
    """The demand of the lm slice, the whole buffer and four segments."""
    codec = DynamiqCodec()
    x = load_slice("lm").reshape(-1)
    stats = pool.span_statistics(codec, x, 0, [(0, x.numel())])
    lens = pool._span_lengths(codec, [(0, x.numel())])
    demand = pool.decode_statistics(codec, stats)[0]
    q = lens.numel() // 4
    for first in ([0, lens.numel()], [0, q, 2 * q, 3 * q, lens.numel()]):
        for bits in (0.5, 4.62, 7.9):
            sizes = [int(lens[a:b].sum()) for a, b in itertools.pairwise(first)]
            total = torch.tensor([math.floor(bits * m) // 8 for m in sizes])
            seg = torch.repeat_interleave(torch.arange(len(first) - 1), torch.tensor(first).diff())
            want = pool._distribute_reference(demand, lens, seg, total)
            assert torch.equal(cpu_native.pool_distribute(demand, lens, first, total), want)


def test_bad_arguments_raise_before_the_kernel() -> None:
    levels, _, _ = cpu_native.pool_levels(torch.ones(64), 16, pool.level_table(2) or {})
    _, count = _priority_tables(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="pool_demand"):
        cpu_native.pool_demand(levels, 65, 16, [(0, 65)], 256, 0, count, 0)  # 5 groups
    with pytest.raises(ValueError, match="pool_demand"):
        cpu_native.pool_demand(levels, 64, 16, [(0, 8), (8, 64)], 256, 0, count, 0)
    with pytest.raises(ValueError, match="pool_demand"):
        cpu_native.pool_demand(levels, 64, 16, [(0, 80)], 256, 0, count, 0)
    lens, demand = torch.full((4,), 256), torch.ones(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not cut 4 spans"):
        cpu_native.pool_distribute(demand, lens, [0, 3, 2, 4], torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="do not cut 4 spans"):
        cpu_native.pool_distribute(demand, lens, [0, 3], torch.tensor([1]))
    with pytest.raises(ValueError, match="one total a segment"):
        cpu_native.pool_distribute(demand, lens, [0, 4], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="one total a segment"):
        cpu_native.pool_distribute(demand, lens, [0, 4], torch.tensor([-1]))
    with pytest.raises(ValueError, match="group must be positive"):
        cpu_native.pool_levels(torch.ones(64), 0, pool.level_table(2) or {})
