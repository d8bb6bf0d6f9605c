"""The DynamiQ codec pooled over the bucket (``pooling="bucket"``, dynamiq/codecs/_dynamiq_pool.py):
the prologue's exact all-reduce, the budgets every rank derives, bit-exact kernels, cut
invariance, and bad input raised on every rank."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynamiq import kernels
from dynamiq.codecs import HopContext
from dynamiq.codecs import _dynamiq_pool as pool
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.collectives import simulate_allreduce
from dynamiq.collectives.cuts import check_cut_invariance
from dynamiq.collectives.handshake import (
    PrologueComm,
    allreduce_exact,
    allreduce_steps,
    local_prologues,
)
from dynamiq.collectives.transport import LocalCluster, run_threads


def grads(n: int, seed: int = 0) -> torch.Tensor:
    """Layer-like data: blocks of very different scales, some zero, some tiny."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 4, (n // 700 + 1,), generator=g).float())
    x = torch.randn(n, generator=g) * scale.repeat_interleave(700)[:n]
    x[1000:1700] = 0.0
    return x


def prologue(codec: DynamiqCodec, xs: list[torch.Tensor], chunks=None) -> list[dict]:
    return local_prologues(codec, xs, chunks, timeout=30.0)[0]


@pytest.mark.parametrize("length", [37, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_allreduce_is_exact_and_costs_2_n_minus_1_over_n(n: int, op: str, length: int) -> None:
    """Halving and doubling (2, 4, 8 ranks) or a ring (3, 5), pieces empty where the tensor
    has fewer values than ranks: the exact int64 reference on every rank."""
    g = torch.Generator().manual_seed(n)
    ts = [
        torch.randint(-(2**14), 2**14, (length,), generator=g, dtype=torch.int16) for _ in range(n)
    ]
    cluster = LocalCluster(n)
    comms = [PrologueComm(cluster.transport(r), 30.0) for r in range(n)]
    got = run_threads(n, lambda r: allreduce_exact(comms[r], ts[r], op))
    ref = torch.stack([t.long() for t in ts])
    want = {"max": ref.amax(0), "min": ref.amin(0), "sum": ref.sum(0)}[op].to(torch.int16)
    for r in range(n):
        assert torch.equal(got[r], want)
    # every piece travels n - 1 times in the reduce-scatter and n - 1 in the all-gather
    assert sum(c.bytes_sent for c in comms) == 2 * (n - 1) * length * 2
    assert sum(c.bytes_received for c in comms) == 2 * (n - 1) * length * 2
    steps = 2 * (n - 1) if n & (n - 1) else 2 * (n.bit_length() - 1)
    assert all(c.steps == (steps if n > 1 else 0) for c in comms)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 16])
def test_allreduce_steps_pair_every_send_with_its_receive(n: int) -> None:
    """Step by step, what a rank sends is what its peer expects, on the same values; the
    reduce-scatter leaves each piece on one rank, combined from every rank's."""
    length = 1000
    plans = [allreduce_steps(n, length, r) for r in range(n)]
    assert len({len(p) for p in plans}) == 1
    for k in range(len(plans[0])):
        for r in range(n):
            to, sent, _, _, reducing = plans[r][k]
            assert to is not None and to != r
            _, _, frm, into, red = plans[to][k]
            assert frm == r and into == sent and red == reducing
    # who holds what: follow the contributions through the reduce-scatter
    has = [[{r} for _ in range(n)] for r in range(n)]  # has[r][piece]: ranks summed in
    bounds = [length * i // n for i in range(n + 1)]
    for k in range(len(plans[0])):
        if not plans[0][k][4]:
            break
        new = [[set(h) for h in row] for row in has]
        for r in range(n):
            to, (a, b), *_ = plans[r][k]
            for i in range(n):
                if a <= bounds[i] and bounds[i + 1] <= b:
                    new[to][i] |= has[r][i]
        has = new
    done = [[i for i in range(n) if has[r][i] == set(range(n))] for r in range(n)]
    assert sorted(p for d in done for p in d) == list(range(n))


def test_allreduce_exact_refuses_floats_and_unknown_ops() -> None:
    comm = PrologueComm(LocalCluster(1).transport(0), 1.0)
    with pytest.raises(TypeError, match="integer tensor"):
        allreduce_exact(comm, torch.zeros(3), "max")
    with pytest.raises(ValueError, match="op must be one of"):
        allreduce_exact(comm, torch.zeros(3, dtype=torch.int32), "prod")


@pytest.mark.parametrize("chunks", [None, [(0, 2560), (2560, 5120), (5120, 9001)]])
def test_budgets_fit_and_balance(chunks) -> None:
    codec = DynamiqCodec()
    xs = [grads(9001, s) for s in range(3)]
    shared = prologue(codec, xs, chunks)
    assert all(s == shared[0] for s in shared[1:])  # every rank derives the same
    p = shared[0][pool.SHARED_KEY]
    budgets = pool.span_budgets(p, codec.bits, codec.balance, codec.balance_slack)
    lens = p.lens
    assert bool((budgets >= 0).all()) and bool((budgets <= lens).all())  # <= 8 bits a value
    assert int(budgets.sum()) <= math.floor(codec.bits * 9001) // 8
    # every region within `balance` of the mean region's uniform share, or `balance_slack`
    # bytes above it
    shares = [math.floor(codec.bits * (b - a)) // 8 for a, b in p.regions]
    mean = sum(shares) / len(shares)
    cap = max(math.floor(mean * codec.balance), math.floor(mean) + codec.balance_slack)
    for f, t in zip(p.first[:-1], p.first[1:], strict=True):
        assert int(budgets[f:t].sum()) <= cap
    # the wire size: a function of the shared data and the context alone
    ctx = HopContext(shared=shared[1])
    assert codec.encoded_nbytes(9001, ctx) == codec.encode(xs[1], ctx).numel()


@pytest.mark.parametrize(
    "chunks", [[(0, 2560), (2560, 5120), (5120, 9001)], [(0, 2600), (2600, 5200), (5200, 9001)]]
)
def test_chunk_bytes_equal_the_budgets_and_encoded_sizes(chunks) -> None:
    """``encoded_nbytes`` sizes a pooled sub-chunk from memoized prefix sums: equal to the
    sum of the spans' budgets and to the encoding's own size for every sub-chunk of every
    region (whole spans, and each region's short last span, also mid-buffer), and it refuses
    a cut span; the native kernels' memoized budgets and offsets are the spans' own."""
    codec = DynamiqCodec()
    xs = [grads(9001, s) for s in range(3)]
    shared = prologue(codec, xs, chunks)[0]
    ctx = HopContext(shared=shared)
    for a, b in chunks:
        for lo in range(a, b, 768):
            hi = min(lo + 768, b)
            sub = HopContext(shared=shared, offset=lo)
            want = pool.chunk_budgets(codec, shared, hi - lo, lo, codec.bits)
            assert pool.chunk_bytes(codec, shared, hi - lo, lo, codec.bits) == int(want.sum())
            nbytes = codec.encoded_nbytes(hi - lo, sub)
            assert nbytes == int(codec._span_sizes(hi - lo, want * 8).sum())
            assert nbytes == codec.encode(xs[0][lo:hi].contiguous(), sub).numel()
            got = codec._pooled_kernel_args(hi - lo, sub)
            assert got is not None and got[0].is_contiguous()
            assert torch.equal(got[0], want * 8)
            assert torch.equal(got[1], codec._span_offset_tensor(hi - lo, want * 8))
            ptrs = codec._pooled_kernel_ptrs(hi - lo, sub)  # what dq_dyn_run reads
            assert ptrs is not None
            spans = want.numel()
            bits = (ctypes.c_int64 * spans).from_address(ptrs[0])
            starts = (ctypes.c_int64 * spans).from_address(ptrs[1])
            assert list(bits) == (want * 8).tolist()
            assert [s - ptrs[2] for s in starts] == got[1].tolist()
    with pytest.raises(ValueError, match="not whole spans"):
        codec.encoded_nbytes(100, HopContext(shared=shared, offset=5))
    with pytest.raises(ValueError, match="not whole spans"):
        codec._pooled_kernel_args(100, HopContext(shared=shared, offset=5))
    assert codec.encoded_nbytes(0, ctx) == 0
    assert [t.numel() for t in codec._pooled_kernel_args(0, ctx) or ()] == [0, 0]
    assert codec._pooled_kernel_args(256, HopContext()) is None


def test_demand_ignores_nonfinite_values() -> None:
    codec = DynamiqCodec()
    x = grads(4096)
    regions = pool.regions_of(codec, 4096, None)
    clean = x.clone()
    clean[3000] = 0.0
    bad = x.clone()
    bad[3000] = math.inf
    a = pool.span_statistics(codec, clean, 0, regions)
    b = pool.span_statistics(codec, bad, 0, regions)
    assert torch.equal(a, b)  # one Inf never enters the shared statistics


def test_value_beyond_max_input_abs_raises_on_every_rank() -> None:
    codec = DynamiqCodec()
    xs = [grads(3000, s) for s in range(3)]
    xs[1][17] = 3.0e38
    with pytest.raises(ValueError, match=r"rank 1 holds a value beyond max_input_abs"):
        prologue(codec, xs)
    # every rank raises by itself (the flag travels in the all-reduce)
    n = 3
    cluster = LocalCluster(n)
    comms = [PrologueComm(cluster.transport(r), 30.0) for r in range(n)]
    errors: list[str] = []

    def one(r: int) -> None:
        try:
            codec.prologue(xs[r], comms[r])
        except ValueError as e:
            errors.append(str(e))

    run_threads(n, one)
    assert len(errors) == n and all("max_input_abs" in e for e in errors)


def test_partial_sums_that_could_overflow_raise() -> None:
    codec = DynamiqCodec()
    xs = [torch.full((512,), 2.0**125) for _ in range(4)]
    with pytest.raises(ValueError, match="partial sums of 4 ranks could exceed"):
        prologue(codec, xs)


@pytest.mark.parametrize(
    "config",
    [{}, {"span": 4096, "super_group": 256}, {"span": 1280, "group": 5, "super_group": 80}],
)
def test_statistics_are_a_byte_a_span_and_decode_to_the_demand(config: dict) -> None:
    """One int8 per span and two flags; the demand of whole groups decodes exactly where the
    unit is the group (default), else to the nearest multiple of the unit (never 0 for a
    demand above 0, at most 255 units), against :func:`span_demand` computed apart."""
    codec = DynamiqCodec(**config)
    x = grads(40_000, 3)
    x[:5000] *= 2.0**-40  # spans of tiny demand
    regions = pool.regions_of(codec, x.numel(), None)
    stats = pool.span_statistics(codec, x, 0, regions)
    demand, worst = pool.span_demand(codec, x, regions)
    assert stats.dtype == torch.int8 and stats.numel() == demand.numel() + 2
    got, bad, top = pool.decode_statistics(codec, stats)
    unit = pool.demand_unit(codec)
    assert 8 * codec.span <= 255 * unit and unit % codec.group == 0
    if unit == codec.group:
        assert torch.equal(got, demand)
    else:
        near = (got - demand).abs() <= unit // 2
        assert bool((near | (got == 255 * unit) | ((got == unit) & (demand > 0))).all())
    assert bool(((got > 0) == (demand > 0)).all()) and bool(got.gt(0).any())
    assert bad == 0 and top == math.frexp(worst)[1] - 1


@pytest.mark.parametrize(
    ("value", "binade"),
    [
        (0.0, None),
        (2.0**-149, -127),
        (2.0**-127, -127),
        (1.5 * 2.0**-126, -126),
        (1.9 * 2.0**126, 126),
    ],
)
def test_the_largest_binade_takes_one_byte(value: float, binade: int | None) -> None:
    """Binades at and below the byte's range: the code keeps an upper bound (the overflow
    check only needs one); no finite value above 0: none."""
    codec = DynamiqCodec()
    x = torch.zeros(512)
    x[7] = value
    stats = pool.span_statistics(codec, x, 0, [(0, 512)])
    assert pool.decode_statistics(codec, stats)[2] == binade


def test_ranks_past_the_flag_byte_are_named_so() -> None:
    codec = DynamiqCodec()
    x = torch.zeros(256)
    x[3] = 3.0e38
    for rank, who in ((0, "rank 0 holds"), (253, "rank 253 holds"), (254, "254 or more")):
        stats = pool.span_statistics(codec, x, rank, [(0, 256)])
        with pytest.raises(ValueError, match=who):
            pool.shared_from_statistics(codec, stats, 256, 300, [(0, 256)])
    with pytest.raises(ValueError, match="statistics are torch.int8"):
        pool.shared_from_statistics(codec, stats.to(torch.int16), 256, 300, [(0, 256)])


CONFIGS = [
    {},
    {"span": 1024, "super_group": 256, "group": 32, "rounding": "stochastic"},
    {"group": 8, "rounding": "correlated", "hop_slope": 1.0},
    {"span": 512, "super_group": 512, "levels": "uniform", "scale_steps": 1, "balance": 1.5},
]


@pytest.mark.parametrize("config", CONFIGS)
def test_native_kernels_bit_exact_with_pooled_budgets(config: dict) -> None:
    codec = DynamiqCodec(**config)
    n = codec.span * 23 + 77
    xs = [grads(n, s) for s in range(2)]
    shared = prologue(codec, xs, [(0, codec.span * 8), (codec.span * 8, n)])[0]
    ctx = HopContext(shared=shared, seed=5, hop=1, num_hops=3, rank=1)
    out_ctx = dataclasses.replace(ctx, hop=2)
    x, y = xs[0], xs[1]
    ref = kernels.encode(codec, x, ctx, backend="reference")
    assert torch.equal(ref, kernels.encode(codec, x, ctx, backend="cpu"))
    d_ref = kernels.decode(codec, ref, n, ctx, backend="reference")
    d_cpu = kernels.decode(codec, ref, n, ctx, backend="cpu")
    assert torch.equal(d_ref.view(torch.int32), d_cpu.view(torch.int32))
    r_ref = kernels.reduce(codec, ref, y, ctx, out_ctx, backend="reference")
    assert torch.equal(r_ref, kernels.reduce(codec, ref, y, ctx, out_ctx, backend="cpu"))
    # the fused reduce is the decode, the add and the encode
    assert torch.equal(r_ref, kernels.encode(codec, d_ref + y, out_ctx, backend="reference"))
    # sub-chunks at offsets (the kernel reads their spans from tables of every span): inside
    # a region, across the regions' border, and a region's short end
    s = codec.span
    for a, b in ((3 * s, 8 * s), (5 * s, 12 * s), (8 * s, n)):
        sub, sub_out = (dataclasses.replace(c, offset=a) for c in (ctx, out_ctx))
        xa, ya = x[a:b].contiguous(), y[a:b].contiguous()
        ref = kernels.encode(codec, xa, sub, backend="reference")
        assert torch.equal(ref, kernels.encode(codec, xa, sub, backend="cpu")), (a, b)
        d_ref = kernels.decode(codec, ref, b - a, sub, backend="reference")
        d_cpu = kernels.decode(codec, ref, b - a, sub, backend="cpu")
        assert torch.equal(d_ref.view(torch.int32), d_cpu.view(torch.int32)), (a, b)
        r_ref = kernels.reduce(codec, ref, ya, sub, sub_out, backend="reference")
        assert torch.equal(r_ref, kernels.reduce(codec, ref, ya, sub, sub_out, backend="cpu"))


def test_native_arguments_memoized_per_prologue_result() -> None:
    """The native kernel memoizes its filled arguments in the prologue's result (keyed on
    the hop context's values): a new result with other budgets at the same context values,
    made after the last one died (its memory, and maybe its address, reused), gets its own
    budgets, not the dead one's; a context holding no result gets the uniform budgets."""
    codec = DynamiqCodec()
    n = 256 * 12 + 40
    for seed in range(3):
        xs = [grads(n, 10 * seed + s) * 4.0**seed for s in range(2)]
        if seed == 1:
            xs[0][: 256 * 6] *= 1e-6  # other demand: other budgets
        shared = prologue(codec, xs, [(0, 256 * 6), (256 * 6, n)])[0]
        for ctx in (HopContext(shared=shared, offset=256 * 6), HopContext(offset=256 * 6)):
            x = xs[0][256 * 6 :].contiguous()
            ref = kernels.encode(codec, x, ctx, backend="reference")
            assert torch.equal(ref, kernels.encode(codec, x, ctx, backend="cpu")), seed
            d = kernels.decode(codec, ref, x.numel(), ctx, backend="cpu")
            want = kernels.decode(codec, ref, x.numel(), ctx, backend="reference")
            assert torch.equal(d.view(torch.int32), want.view(torch.int32)), seed
        del shared, ctx
        gc.collect()


def test_cut_invariance_with_pooled_budgets() -> None:
    codec = DynamiqCodec()
    n = 256 * 40 + 3
    xs = [grads(n, s) for s in range(2)]
    shared = prologue(codec, xs, [(0, 256 * 20), (256 * 20, n)])[0]
    ctx = HopContext(shared=shared)
    check_cut_invariance(codec, xs[0], ctx, [(0, 256 * 3), (256 * 3, 256 * 25), (256 * 25, n)])
    with pytest.raises(ValueError, match="not whole spans"):
        codec.encode(xs[0][:300].contiguous(), ctx)


def test_pooling_beats_span_local_budgets_on_layered_data() -> None:
    """Same bits on the wire: pooled budgets follow the scales; span-local ones cannot."""
    xs = [grads(1 << 15, s) for s in range(4)]
    pooled = simulate_allreduce(xs, DynamiqCodec(), "ring", seed=0, return_bound=False)
    local = simulate_allreduce(xs, DynamiqCodec(pooling="span"), "ring", seed=0)
    # the prologue: a byte per span (and two more) through a ring: ~8/256 bits a value
    assert pooled.bits_per_value() <= local.bits_per_value() + 0.035
    assert pooled.vnmse < local.vnmse / 4


def test_engine_and_simulator_agree_with_the_prologue() -> None:
    xs = [grads(6000, s) for s in range(3)]
    a = simulate_allreduce(xs, DynamiqCodec(), "ring", seed=1, engine="batched")
    b = simulate_allreduce(xs, DynamiqCodec(), "ring", seed=1, engine="threads")
    for oa, ob in zip(a.outputs, b.outputs, strict=True):
        assert torch.equal(oa.view(torch.int32), ob.view(torch.int32))
    assert a.bytes_sent == b.bytes_sent
    # every rank ends with the same sum, within the certified bound
    assert a.bound is not None
    err = (a.outputs[0].double() - a.exact.double()).abs()
    assert bool((err <= a.bound.double()).all())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_encode_outside_a_collective_checks_the_range(backend: str) -> None:
    codec = DynamiqCodec()
    x = torch.ones(5000)
    x[4321] = -3.0e38
    with pytest.raises(ValueError, match="exceeds max_input_abs"):
        kernels.encode(codec, x, HopContext(), backend=backend)
    x[4321] = math.inf  # non-finite: the NaN policy, not an error
    kernels.encode(codec, x, HopContext(), backend=backend)


# -- the prologue re-cuts an all-reduce's chunks to equal bytes ---------------------------------


def brute_force_cut(cum: list[int], parts: int, most: int) -> int:
    """The least largest-chunk bytes over every cut of ``len(cum) - 1`` units into ``parts``
    chunks (empty ones allowed) of at most ``most`` units: exhaustive."""
    units = len(cum) - 1
    best = None
    for inner in itertools.combinations_with_replacement(range(units + 1), parts - 1):
        cuts = [0, *inner, units]
        if any(b - a > most for a, b in itertools.pairwise(cuts)):
            continue
        worst = max(cum[b] - cum[a] for a, b in itertools.pairwise(cuts))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("units", "parts", "align"), [(11, 3, 256), (9, 4, 512), (13, 2, 256)])
def test_recut_is_the_best_cut_within_the_value_slack(
    seed: int, units: int, parts: int, align: int
) -> None:
    """Against exhaustive search: no cut of chunks within 1 + RECUT_SLACK of the mean values
    (or the even cut's largest) has a smaller largest chunk in bytes."""
    codec = DynamiqCodec()
    numel = units * align - (seed * 37) % 200  # a short last unit
    xs = [grads(numel, seed + 10 * r) for r in range(2)]
    regions = pool.regions_of(codec, numel, None)
    stats = torch.stack([pool.span_statistics(codec, x, r, regions) for r, x in enumerate(xs)])
    reduced = stats.amax(0)
    lens = pool._span_lengths(codec, regions)
    got = pool.recut(codec, reduced[:-2].long().clamp(min=0), lens, numel, parts, align)
    assert len(got) == parts and got[0][0] == 0 and got[-1][1] == numel
    assert all(a % align == 0 and (b % align == 0 or b == numel) for a, b in got)
    assert all(p[1] == q[0] for p, q in itertools.pairwise(got))
    # the same budgets recut uses, summed per unit of `align` values
    total = torch.tensor([math.floor(codec.bits * numel) // 8])
    whole = pool._distribute(reduced[:-2].long().clamp(min=0), lens, [0, lens.numel()], total)
    per = align // codec.span
    unit_bytes = [int(whole[i * per : (i + 1) * per].sum()) for i in range(units)]
    cum = [0, *itertools.accumulate(unit_bytes)]
    most = max(int((1 + pool.RECUT_SLACK) * numel / parts) // align, -(-numel // (parts * align)))
    worst = max(cum[-(-b // align)] - cum[a // align] for a, b in got)
    assert worst == brute_force_cut(cum, parts, most)
    assert all(-(-(b - a) // align) <= most for a, b in got)


@pytest.mark.parametrize(
    ("lens", "demand", "total", "want"),
    [
        # a water level: (d + delta) // 8 bytes for d = 512, 256 bits; delta = 423 is the
        # largest with 116 + 84 <= 200; the span demanding nothing gets nothing
        ([256, 256, 256], [512, 256, 0], 200, [116, 84, 0]),
        # demand beyond 8 T bits: d T // W = 66, 33, 0 (99 bytes), the last byte to span 0
        ([256, 256, 256], [2048, 1024, 16], 100, [67, 33, 0]),
        # every live span full (a byte a value): the 34 bytes left are not sent
        ([256, 10], [2048, 80], 300, [256, 10]),
        # no demand: every span is live; delta = 343 gives 42, 42, 16 (delta = 344: 102)
        ([256, 256, 100], [0, 0, 0], 100, [42, 42, 16]),
    ],
)
def test_sharing_by_hand(lens, demand, total, want) -> None:
    """docs/formats.md's sharing rule on cases worked out by hand, the reference and the
    native kernel alike."""
    lens_t, demand_t = torch.tensor(lens), torch.tensor(demand)
    seg = torch.zeros(len(lens), dtype=torch.int64)
    got = pool._distribute_reference(demand_t, lens_t, seg, torch.tensor([total]))
    assert got.tolist() == want
    from dynamiq.kernels import cpu_native

    if cpu_native.available():
        native = cpu_native.pool_distribute(demand_t, lens_t, [0, len(lens)], torch.tensor([total]))
        assert native.tolist() == want


@given(
    demand=st.lists(st.integers(0, 128).map(lambda k: 16 * k), min_size=1, max_size=40),
    fill=st.floats(0.0, 1.2),
)
def test_sharing_is_a_water_level(demand: list[int], fill: float) -> None:
    """Spans of 256 values whose total holds their demand: no more than the total; every
    live span strictly between 0 and its cap is its demand plus the same bits (within the
    floor and one leftover byte: 8 bits a span); no live span below its demand (the level
    is at least 0 where the demand fits), a span of no demand gets nothing (unless none has
    any); the bytes left unsent only when every live span is full."""
    lens = torch.full((len(demand),), 256, dtype=torch.int64)
    d = torch.tensor(demand, dtype=torch.int64)
    room = int(lens.sum()) if not any(demand) else 256 * sum(1 for v in demand if v)
    lo_total = -(-sum(demand) // 8)  # the demand fits
    total = max(lo_total, int(lo_total + fill * (room - lo_total)))
    seg = torch.zeros(len(demand), dtype=torch.int64)
    out = pool._distribute_reference(d, lens, seg, torch.tensor([total]))
    assert int(out.sum()) <= total and bool((out >= 0).all()) and bool((out <= lens).all())
    live = d > 0 if any(demand) else torch.ones_like(d, dtype=torch.bool)
    assert int(out[~live].sum()) == 0
    surplus = 8 * out - d  # the bits a live span got above its demand
    inner = live & (out > 0) & (out < lens)
    if int(inner.sum()) >= 2:
        assert int(surplus[inner].max() - surplus[inner].min()) <= 15
    assert bool((surplus[live] >= 0).all())
    if int(out.sum()) < total:
        assert bool((out[live] == lens[live]).all())


@pytest.mark.parametrize(
    ("family", "floors"),
    [("lm", (7.5, 8.5)), ("mlm", (9.0, 11.0)), ("digits", (1.7, 2.7))],
)
def test_default_beats_mxfp8_on_every_familys_slice(family: str, floors) -> None:
    """A guard of the pooled default's accuracy on real gradients (each family's shipped
    slice, 8 workers, ~32K values: docs/benchmarks.md, "Sharing the bucket's bytes by a water
    level"): MXFP8's vNMSE over the default's, ring and butterfly, at least about 0.8 of
    what the default measured on 2026-12-03 (lm 9.4 and 11.0, mlm 11.6 and 14.4, digits 2.1
    and 3.4), at fewer than 5 bits a value."""
    from dynamiq.data import load_slice

    xs = list(load_slice(family))
    for schedule, floor in zip(("ring", "butterfly"), floors, strict=True):
        ref = simulate_allreduce(xs, "mxfp8_e4m3", schedule, seed=0, return_bound=False)
        got = simulate_allreduce(xs, DynamiqCodec(), schedule, seed=0, return_bound=False)
        assert got.bits_per_value() < 5.0
        assert ref.vnmse / got.vnmse >= floor, (family, schedule, ref.vnmse / got.vnmse)


def test_small_chunks_may_exceed_balance_by_the_slack() -> None:
    """Chunks of two spans, all the signal in the first: ``balance`` alone holds it to 1.15
    times the mean chunk's share; ``balance_slack`` lets it take that many bytes more (and
    no more), and the bucket's total stays the same."""
    chunks = [(a, a + 512) for a in range(0, 2048, 512)]
    g = torch.Generator().manual_seed(5)
    xs = []
    for _ in range(3):
        x = torch.randn(2048, generator=g) * 1e-6
        x[:512] = torch.randn(512, generator=g)
        xs.append(x)
    p = prologue(DynamiqCodec(), xs, chunks)[0][pool.SHARED_KEY]
    bits, share = 4.62, math.floor(4.62 * 512) // 8
    totals = {}
    for slack in (0, 64, 256):
        budgets = pool.span_budgets(p, bits, 1.15, slack)
        totals[slack] = [int(budgets[f:t].sum()) for f, t in itertools.pairwise(p.first)]
        assert sum(totals[slack]) == 4 * share
        cap = max(math.floor(share * 1.15), share + slack)
        assert max(totals[slack]) <= cap
    assert totals[0][0] == math.floor(share * 1.15)  # the cap binds
    assert totals[64][0] == share + 64
    assert math.floor(share * 1.15) < totals[256][0] <= share + 256
    # the default codec carries the slack into its chunks' budgets
    codec = DynamiqCodec()
    shared = {pool.SHARED_KEY: p}
    assert codec.balance_slack == 256
    first = pool.chunk_budgets(codec, shared, 512, 0, bits)
    assert int(first.sum()) == totals[256][0]
    strict = DynamiqCodec(balance_slack=0)
    assert int(pool.chunk_budgets(strict, shared, 512, 0, bits).sum()) == totals[0][0]


def test_allreduce_rounds_are_balanced_in_bytes() -> None:
    """The engine cuts by the prologue's bounds (gloo-free: the threaded engine and the
    batched simulator alike): every round's largest message is within `balance` of the mean,
    the chunks within 1.1 of the mean values, and the sum is the engine's, bit for bit."""
    n_ranks, numel = 8, 256 * 400
    xs = [grads(numel, s) for s in range(n_ranks)]
    codec = DynamiqCodec()
    runs = [
        simulate_allreduce(xs, codec, "ring", seed=3, engine=e, sub_chunk=1 << 20)
        for e in ("batched", "threads")
    ]
    for oa, ob in zip(runs[0].outputs, runs[1].outputs, strict=True):
        assert torch.equal(oa.view(torch.int32), ob.view(torch.int32))
    res = runs[0]
    for k in range(len(res.stats[0].round_bytes)):
        sent = [s.round_bytes[k] for s in res.stats]
        assert max(sent) <= codec.balance * sum(sent) / len(sent) + 64, (k, sent)
    # the prologue's cut against the even one: chunks within 1.1 of the mean values, and the
    # largest chunk's bytes (under the same cap) no larger
    from dynamiq.collectives.planning import CHUNK_BOUNDS_KEY, chunk_bounds

    even = chunk_bounds(numel, n_ranks, 256)
    kept = local_prologues(codec, xs, even, timeout=30.0)[0][0]
    assert CHUNK_BOUNDS_KEY not in kept  # without recut_align the chunks stay
    moved = local_prologues(codec, xs, even, timeout=30.0, recut_align=256)[0][0]
    cut = moved[CHUNK_BOUNDS_KEY]
    assert cut != even and max(b - a for a, b in cut) <= 1.1 * numel / n_ranks

    def largest(shared: dict) -> int:
        p = shared[pool.SHARED_KEY]
        budgets = pool.span_budgets(p, codec.bits, 1e6, 0)  # uncapped: the cut's own balance
        return max(int(budgets[f:t].sum()) for f, t in itertools.pairwise(p.first))

    assert largest(moved) < largest(kept)


def _group_absmax_per_region(codec: DynamiqCodec, flat: torch.Tensor, regions) -> torch.Tensor:
    """The reference: each region's groups from its own start, |x| of finite values (fp64
    max), zero-padded to whole spans."""
    g, per = codec.group, codec.span // codec.group
    rows = []
    for a, b in regions:
        v = flat[a:b].double()
        v = torch.where(torch.isfinite(v), v.abs(), 0.0)
        v = torch.cat([v, v.new_zeros(-v.numel() % g)]).view(-1, g).amax(dim=1)
        rows.append(torch.cat([v, v.new_zeros(-v.numel() % per)]))
    return torch.cat(rows).view(-1, per).float()


@pytest.mark.parametrize("numel", [4096, 70001])
def test_group_absmax_of_aligned_regions_is_each_regions_own(numel: int) -> None:
    """Regions starting on whole groups are read in one pass (the simulator's 1024 chunks);
    the result is each region's groups from its own start, padded to whole spans."""
    codec = DynamiqCodec()
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-30, 30, (numel,)).float())
    x[[5, numel // 2, numel - 1]] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    for parts in (1, 3, 40):
        cuts = torch.randint(0, numel // 16, (parts - 1,), generator=gen) * 16
        edges = sorted({0, numel, *cuts.tolist()})
        regions = list(itertools.pairwise(edges))
        n_spans = pool._span_lengths(codec, regions).numel()
        got, top = pool._group_absmax(codec, x, regions, n_spans)
        want = _group_absmax_per_region(codec, x, regions)
        assert torch.equal(got, want)
        assert top == float(want.max())


@st.composite
def pools(draw: st.DrawFn) -> pool.Pool:
    """A prologue result of random regions (whole spans of 256 from each region's start, the
    last maybe short) and agreed demand (whole groups' bits, at most 8 a value, some 0)."""
    n_regions = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(0, 6), min_size=n_regions, max_size=n_regions))
    regions, first, lens, at = [], [0], [], 0
    for k, spans in enumerate(sizes):
        tail = draw(st.integers(1, 255)) if k == n_regions - 1 and draw(st.booleans()) else 0
        size = 256 * spans + tail
        regions.append((at, at + size))
        lens += [256] * spans + ([tail] if tail else [])
        first.append(len(lens))
        at += size
    demand = [16 * draw(st.integers(0, n // 2)) if draw(st.booleans()) else 0 for n in lens]
    return pool.Pool(
        demand=torch.tensor(demand, dtype=torch.int64),
        lens=torch.tensor(lens, dtype=torch.int64),
        numel=at,
        regions=tuple(regions),
        first=tuple(first),
    )


@given(
    p=pools(),
    bits=st.floats(0.5, 8.0),
    balance=st.one_of(st.just(1.15), st.floats(1.0, 3.0)),
    slack=st.one_of(st.sampled_from([0, 256]), st.integers(0, 5000)),
)
def test_span_budgets_keep_every_byte_within_the_caps(
    p: pool.Pool, bits: float, balance: float, slack: int
) -> None:
    """Whatever the regions and demand: no span above a byte a value, no region above
    ``max(floor(balance · m), floor(m) + slack)`` (and its values), never more than the
    bucket's ``floor(bits · N) // 8`` bytes, and all of them where no cap binds (the floors
    of the shares lose nothing). Bytes a capped span turns away go only to
    spans that demand bits, so with none below its cap they are not sent (docs/formats.md)."""
    budgets = pool.span_budgets(p, bits, balance, slack)
    assert bool((budgets >= 0).all()) and bool((budgets <= p.lens).all())
    shares = [math.floor(bits * (b - a)) // 8 for a, b in p.regions]
    mean = sum(shares) / len(shares)
    cap = max(math.floor(mean * balance), math.floor(mean) + slack)
    binds = bool((budgets == p.lens).any())
    for (a, b), f, t in zip(p.regions, p.first[:-1], p.first[1:], strict=True):
        got = int(budgets[f:t].sum())
        assert got <= min(cap, b - a)
        binds = binds or got == min(cap, b - a)
    assert int(budgets.sum()) <= sum(shares)
    if not binds:
        assert int(budgets.sum()) == sum(shares)
