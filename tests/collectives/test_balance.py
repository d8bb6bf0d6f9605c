"""The bytes-per-round instruments (dynamiq/collectives/balance.py) against the batched
simulator's ``round_bytes``: exact, for every registered codec's default and schedule, on real
gradients; and not by accident (a wrong offset, rank or prologue result changes them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynamiq.codecs import get_codec, list_codecs
from dynamiq.collectives import get_schedule
from dynamiq.collectives.balance import (
    nonzero_blocks,
    omnireduce_round_nbytes,
    round_balance,
    round_nbytes,
)
from dynamiq.collectives.simulator import prologue_shared, simulate_schedule
from dynamiq.data import load_slice

N = 8
NUMEL = 200_000 + 77  # a partial last block for every block size
SUB = 8192  # several sub-chunks a chunk (their headers and bitmaps count)
SCHEDULES = {
    "ring": {},
    "butterfly": {},
    "hierarchical": {"ranks_per_node": 4},
}
FIXED = [c for c in list_codecs() if c != "omnireduce"]


def _real_buffers() -> list[torch.Tensor]:
    """Rank ``r``: real gradient slices of the three model families (``load_slice``), their
    rows rotated so that every rank's buffer differs everywhere, cut to ``NUMEL``; a run of
    blocks is all zero on some ranks (``-0.0`` on one), as unused embedding rows are."""
    fams = [load_slice(f) for f in ("lm", "mlm", "digits")]
    out = []
    for r in range(N):
        parts = [g[(r + k) % N] for k in range(N) for g in fams]
        x = torch.cat(parts)[:NUMEL].clone()
        for b in np.random.default_rng(r).choice(np.arange(40, 400), 60, replace=False):
            x[b * 256 : (b + 1) * 256] = -0.0 if r == 5 else 0.0
        out.append(x.contiguous())
    return out


@pytest.fixture(scope="module")
def xs() -> list[torch.Tensor]:
    return _real_buffers()


def _shared(codec, xs, sched):
    if callable(getattr(codec, "prologue_statistics", None)):
        return prologue_shared(codec, iter(xs), sched)
    return None  # no prologue, or one that does not enter the sizes (THC's scales)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", FIXED)
def test_round_nbytes_is_the_simulation(xs, name: str, schedule: str) -> None:
    codec = get_codec(name)
    sched = get_schedule(schedule, N, **SCHEDULES[schedule])
    sim = simulate_schedule(xs, codec, sched, sub_chunk=SUB, return_bound=False)
    got = round_nbytes(NUMEL, codec, sched, shared=_shared(codec, xs, sched), sub_chunk=SUB)
    assert got.dtype == np.int64 and np.array_equal(got, sim.round_bytes)
    assert got.sum() > 0


def _reader(xs: list[torch.Tensor]):
    return lambda a, b: np.stack([x[a:b].numpy() for x in xs])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_omnireduce_round_nbytes_is_the_simulation(xs, schedule: str) -> None:
    codec = get_codec("omnireduce")
    sched = get_schedule(schedule, N, **SCHEDULES[schedule])
    sim = simulate_schedule(xs, codec, sched, sub_chunk=SUB, return_bound=False)
    masks = np.stack([nonzero_blocks(x.numpy(), 256) for x in xs])
    assert not masks.all() and masks.any()  # zero blocks: sizes follow the data here
    for group in (1, 50_000, 1 << 26):  # a chunk a group, a few, all chunks at once
        got = omnireduce_round_nbytes(
            _reader(xs), NUMEL, codec, sched, sub_chunk=SUB, group_values=group
        )
        assert np.array_equal(got, sim.round_bytes)
    # not by accident: values one block off, or another rank's, change the bytes
    shifted = [torch.roll(x, 256) for x in xs]
    other = omnireduce_round_nbytes(_reader(shifted), NUMEL, codec, sched, sub_chunk=SUB)
    assert not np.array_equal(other, sim.round_bytes)
    swapped = [xs[1], xs[0], *xs[2:]]
    other = omnireduce_round_nbytes(_reader(swapped), NUMEL, codec, sched, sub_chunk=SUB)
    assert not np.array_equal(other, sim.round_bytes)


def test_omnireduce_round_nbytes_follows_cancellation() -> None:
    # butterfly keeps rank 0's sum x + (-x) of chunk 0 in fp32 until its last reduce, whose
    # payload (zeros from ranks 1 and 3) carries nothing: the sum's zero blocks are not sent
    # (a union of the ranks' non-zero blocks would send them all)
    codec = get_codec("omnireduce")
    sched = get_schedule("butterfly", 4)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal(4096).astype("f4"))
    xs = [x.clone(), torch.zeros(4096), -x, torch.zeros(4096)]
    sim = simulate_schedule(xs, codec, sched, return_bound=False)
    got = omnireduce_round_nbytes(_reader(xs), 4096, codec, sched)
    assert np.array_equal(got, sim.round_bytes)
    plain = simulate_schedule(
        [x.clone(), xs[1], x.clone(), xs[3]], codec, sched, return_bound=False
    )
    assert got.sum() < plain.round_bytes.sum()


def test_nonzero_blocks_count_nan_and_not_negative_zero() -> None:
    x = np.zeros(5 * 256 + 3, dtype=np.float32)
    x[256 + 7] = np.nan
    x[2 * 256] = -0.0
    x[3 * 256 + 255] = 1e-45  # the smallest subnormal is not zero
    x[5 * 256 + 2] = -np.inf  # the short last block
    assert nonzero_blocks(x, 256).tolist() == [False, True, False, True, False, True]


def test_the_prologue_result_matters(xs) -> None:
    # pooled DynamiQ's sizes come from the shared statistics: without them (the span
    # design's uniform budgets), or from other ranks' data, the bytes differ
    codec = get_codec("dynamiq")
    sched = get_schedule("ring", N)
    sim = simulate_schedule(xs, codec, sched, sub_chunk=SUB, return_bound=False)
    right = _shared(codec, xs, sched)
    assert np.array_equal(
        round_nbytes(NUMEL, codec, sched, shared=right, sub_chunk=SUB), sim.round_bytes
    )
    for wrong in (None, _shared(codec, [x * 0 + x.mean() for x in xs], sched)):
        got = round_nbytes(NUMEL, codec, sched, shared=wrong, sub_chunk=SUB)
        assert not np.array_equal(got, sim.round_bytes)


def test_sub_chunks_and_offsets_matter(xs) -> None:
    # nvfp4 writes a tensor scale per sub-chunk; THC's segments follow the global offset
    for name in ("nvfp4", "thc"):
        codec = get_codec(name)
        sched = get_schedule("ring", N)
        sim = simulate_schedule(xs, codec, sched, sub_chunk=SUB, return_bound=False)
        shared = _shared(codec, xs, sched)
        other = round_nbytes(NUMEL, codec, sched, shared=shared, sub_chunk=4 * SUB)
        assert not np.array_equal(other, sim.round_bytes)


def test_prologue_shared_streams_the_simulators_result(xs) -> None:
    codec = get_codec("dynamiq")
    sched = get_schedule("butterfly", N)
    shared = prologue_shared(codec, (x for x in xs), sched)  # a generator: one at a time
    assert shared is not None and "dynamiq.chunk_bounds" in shared
    with pytest.raises(ValueError, match="for 8 ranks, got 7"):
        prologue_shared(codec, iter(xs[:7]), sched)
    with pytest.raises(ValueError, match="rank 1's buffer"):
        prologue_shared(codec, iter([xs[0], xs[1][:-1], *xs[2:]]), sched)
    with pytest.raises(TypeError, match="not an all-reduce"):
        prologue_shared(get_codec("thc"), iter(xs), sched)
    assert prologue_shared(get_codec("int8"), iter(xs), sched) is None


def test_what_the_instruments_refuse(xs) -> None:
    sched = get_schedule("ring", N)
    with pytest.raises(ValueError, match="depends on the data"):
        round_nbytes(NUMEL, "omnireduce", sched)
    read = _reader(xs)
    with pytest.raises(ValueError, match="density 1"):
        omnireduce_round_nbytes(read, NUMEL, {"id": "omnireduce", "density": 0.5}, sched)
    with pytest.raises(ValueError, match="must be"):
        omnireduce_round_nbytes(_reader(xs[1:]), NUMEL, "omnireduce", sched)
    mixed = get_schedule("hierarchical", N, ranks_per_node=4, intra_codec="fp32")
    with pytest.raises(ValueError, match="another codec"):
        omnireduce_round_nbytes(read, NUMEL, "omnireduce", mixed)


def test_round_balance_reads_the_worst_live_round() -> None:
    sched = get_schedule("ring", 4)
    rb = np.full((sched.num_rounds, 4), 100, dtype=np.int64)
    rb[2] = [100, 100, 100, 300]
    assert round_balance(rb, sched, return_round=True) == (2.0, 2)
    assert round_balance(np.zeros_like(rb), sched) == 1.0
