"""``chunk_sizes`` against what the engine encodes, schedule shapes, and chunk balance for
every registered codec's default."""

from __future__ import annotations

import pytest
import torch

from dynamiq.codecs import IntCodec, get_codec, list_codecs
from dynamiq.collectives import chunk_sizes, get_schedule, simulate_allreduce
from dynamiq.collectives.schedules import schedule_shape


@pytest.mark.parametrize("numel", [0, 1, 31, 32, 1000, 4097])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_chunk_sizes_are_what_the_engine_encodes(
    monkeypatch: pytest.MonkeyPatch, n: int, numel: int
) -> None:
    """In a ring's first round rank r encodes its whole chunk r - 1 afresh (one call with a
    large sub-chunk): the sizes those calls see are the chunk sizes."""
    seen: dict[int, int] = {}
    encode = IntCodec.encode

    def recording(self, x, ctx=None):  # type: ignore[no-untyped-def]
        if ctx is not None and ctx.hop == 0 and ctx.contributions == 1:
            seen[(ctx.rank - 1) % n] = x.numel()
        return encode(self, x, ctx)

    monkeypatch.setattr(IntCodec, "encode", recording)
    xs = [torch.ones(numel) for _ in range(n)]
    simulate_allreduce(xs, "int8", "ring", engine="threads", return_bound=False)
    sizes = chunk_sizes(numel, "int8", "ring", world_size=n)
    if n == 1:
        assert sizes == [numel] and not seen
        return
    assert sizes == [seen[ch] for ch in range(n)]


@pytest.mark.parametrize("codec", ["fp32", "int8", "nf4", "thc", "dynamiq"])
@pytest.mark.parametrize("numel", [0, 5, 1000, 100_003, 262_144])
@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_chunk_sizes_partition_the_buffer_in_whole_blocks(codec: str, numel: int, n: int) -> None:
    block = get_codec(codec).block_size
    cases = [("ring", {}), ("butterfly", {}), ("hierarchical", {"ranks_per_node": 4})]
    for schedule, opts in cases:
        if schedule == "hierarchical" and n % 4:
            continue
        sizes = chunk_sizes(numel, codec, schedule, world_size=n, **opts)
        assert len(sizes) == get_schedule(schedule, n, **opts).num_chunks
        assert sum(sizes) == numel
        # cut on whole blocks (the buffer's end aside), at most one block apart
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        assert all(e % block == 0 or e == numel for e in ends)
        blocks = [-(-s // block) for s in sizes]
        assert max(blocks) - min(blocks) <= 1


def test_chunk_sizes_with_an_intra_codec_and_a_schedule_object() -> None:
    # THC inside the nodes: chunks are cut on its 16,384-value blocks for everyone
    sizes = chunk_sizes(1 << 16, "int8", "hierarchical", world_size=8, intra_codec="thc")
    assert sizes == [16384, 16384, 16384, 16384]
    sched = get_schedule("butterfly", 6)
    assert chunk_sizes(1000, "mxfp4", sched) == chunk_sizes(1000, "mxfp4", "butterfly", 6)
    with pytest.raises(ValueError, match="for 6 ranks, not 4"):
        chunk_sizes(1000, "mxfp4", sched, world_size=4)
    with pytest.raises(TypeError, match="world_size"):
        chunk_sizes(1000, "mxfp4", "ring")
    with pytest.raises(ValueError, match="ranks_per_node must divide"):
        chunk_sizes(1000, "mxfp4", "hierarchical", world_size=6, ranks_per_node=4)
    with pytest.raises(ValueError, match="numel"):
        chunk_sizes(-1, "mxfp4", "ring", world_size=2)


@pytest.mark.parametrize("n", range(1, 41))
def test_schedule_shape_is_the_built_schedules(n: int) -> None:
    cases = [("ring", {}), ("butterfly", {}), ("tree", {})]
    cases += [("hierarchical", {"ranks_per_node": g, "intra_codec": "fp32"}) for g in (1, 2, 4)]
    cases += [("hierarchical", {"ranks_per_node": 2})]
    for name, opts in cases:
        if name == "hierarchical" and n % opts["ranks_per_node"]:
            continue
        built = get_schedule(name, n, **opts)
        assert schedule_shape(name, n, **opts) == (built.num_chunks, built.codecs())


# -- balance: largest / mean chunk <= 1.1 --------------------------------------------------

#: a 25 MB DDP bucket and DDP's first (1 MiB) bucket, in fp32 values
BUFFERS = [6_553_600, 262_144]
RANKS = [8, 32, 128, 1024]
_THC = (
    "THC's wire unit is its 16,384-value rotation block (dynamiq/codecs/thc.py): a buffer of "
    "400 or 16 such blocks cannot spread evenly over this many ranks; a smaller block is a "
    "different accuracy/speed trade-off of the codec, not a cut the engine can change"
)
#: (codec, values, ranks) whose default block cannot balance, and why
UNBALANCED = {
    **{("thc", 6_553_600, n): _THC for n in (128, 1024)},
    **{("thc", 262_144, n): _THC for n in (32, 128, 1024)},
}


def _cases() -> list:
    out = []
    for codec in list_codecs():
        for numel in BUFFERS:
            for n in RANKS:
                why = UNBALANCED.get((codec, numel, n))
                marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
                out.append(pytest.param(codec, numel, n, marks=marks, id=f"{codec}-{numel}-{n}"))
    return out


@pytest.mark.parametrize(("codec", "numel", "n"), _cases())
@pytest.mark.parametrize("schedule", ["ring", "butterfly"])
def test_every_codec_default_balances_its_chunks(
    codec: str, numel: int, n: int, schedule: str
) -> None:
    sizes = chunk_sizes(numel, codec, schedule, world_size=n)
    assert len(sizes) == n  # powers of two: a chunk per rank in both schedules
    assert max(sizes) / (numel / n) <= 1.1
