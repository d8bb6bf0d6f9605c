"""The codecs' public wire descriptions (``codec.wire()``), which the kernels read instead of
the codecs' internals: each checked against the format's definition (docs/formats.md) and
the codec's own encodings, not against the private function it delegates to."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dynamiq.codecs import HopContext
from dynamiq.codecs._dynamiq_levels import DISTORTION_FITTED
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.codecs.hashing import hash_keys
from dynamiq.codecs.omnireduce import OmniReduceCodec
from dynamiq.codecs.thc import ThcCodec
from dynamiq.collectives.handshake import local_prologues


def _grads(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 4, (n // 300 + 1,), generator=g).float())
    return torch.randn(n, generator=g) * scale.repeat_interleave(300)[:n]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_dynamiq_priorities_and_group_scales_are_the_formats(k: int) -> None:
    """``Q[w] = round(4k log2(D(w) - D(w+1)))``; the counts are their definition; the group
    scale of code ``e`` is ``fl32(S · 2^(-(e mod k)/k)) · 2^-(e div k)`` (numpy fp32)."""
    wire = DynamiqCodec(scale_steps=k).wire()
    d = DISTORTION_FITTED
    assert wire.priorities == tuple(round(4 * k * math.log2(d[w] - d[w + 1])) for w in range(8))
    lo, hi = min(wire.priorities), max(wire.priorities)
    counts = [sum(q >= lo + i for q in wire.priorities) for i in range(hi - lo + 2)]
    assert wire.priority_counts.tolist() == counts
    for e in range(16):
        assert float(wire.group_steps[e]) == float(np.float32(2.0 ** (-(e % k) / k)))
        assert float(wire.group_powers[e]) == 2.0 ** -(e // k)
    # one rounding, as the codec encodes: S·step, then an exact power of two
    s = np.float32(3.0517578e-05)
    for e in range(16):
        want = np.float32(s * np.float32(2.0 ** (-(e % k) / k))) * np.float32(2.0 ** -(e // k))
        got = (torch.tensor(float(s)) * wire.group_steps[e]) * wire.group_powers[e]
        assert float(got) == float(want)
    assert DynamiqCodec(scale_steps=k).wire() is wire  # one per configuration


@pytest.mark.parametrize("width", range(1, 9))
def test_dynamiq_levels_and_rounding_tables_agree(width: int) -> None:
    """Each width's ``2^w`` ascending levels are the first entries of its row of the
    tables' ``levels``, and every level's cell counts the keys below it correctly."""
    for rounding in ("nearest", "stochastic"):
        wire = DynamiqCodec(rounding=rounding).wire()
        lv = wire.levels(width)
        assert lv.numel() == 1 << width and bool((lv[1:] > lv[:-1]).all())
        row = wire.tables.levels.view(9, -1)[width]
        assert torch.equal(row[: lv.numel()], lv.float())


def test_dynamiq_budgets_and_span_table_size_the_payload() -> None:
    """Uniform: the budget is ``floor(bits_k · len)`` and there is no table. Pooled (a
    prologue's result): the table's offsets are the running sums of each span's header and
    ``ceil(budget / 8)`` bytes, ending at ``encoded_nbytes``, which the encoding has."""
    codec = DynamiqCodec(hop_slope=1.0)
    wire = codec.wire()
    ctx = HopContext(hop=2, num_hops=6)
    bits = codec.bits + 1.0 * (2 - 2.5) / 5
    assert wire.budget(256, ctx) == math.floor(bits * 256)
    assert wire.span_table(4096, ctx) is None and not wire.pooled(ctx)
    assert wire.header_nbytes(256) == 2 + 16 * 4 // 8
    n = 256 * 37 + 100
    xs = [_grads(n, s) for s in range(3)]
    shared = local_prologues(codec, xs, None, timeout=30.0)[0][0]
    pctx = HopContext(hop=2, num_hops=6, shared=shared)
    assert wire.pooled(pctx)
    table = wire.span_table(n, pctx)
    assert table is not None and table.shape == (38, 2)
    lens = [256] * 37 + [100]
    budgets = table[:, 0].tolist()
    sizes = [wire.header_nbytes(m) + -(-b // 8) for m, b in zip(lens, budgets, strict=True)]
    assert table[:, 1].tolist() == [sum(sizes[:i]) for i in range(38)]
    assert sum(sizes) == codec.encoded_nbytes(n, pctx) == codec.encode(xs[0], pctx).numel()
    assert int(table[:, 0].sum()) <= math.floor(bits * n)
    assert wire.memo(pctx) is not None and wire.memo(ctx) is None


def test_thc_wire_describes_its_payload() -> None:
    """The rotation's keys are the counter hash at the hop no context has; the segment
    scales, the NaN bitmap and the codes fill ``encoded_nbytes``; agreed scales come from
    ``ctx.shared`` and their ranges are ``fl32(T·S)``."""
    codec = ThcCodec(scale_blocks=2)
    wire = codec.wire()
    assert wire.rotation_keys == hash_keys(codec.rotation_seed, 0, 0xFFFFFFFF, 0)
    n, offset = codec.block_size * 5 + 77, codec.block_size * 3
    lay = wire.layout(n)
    assert lay.nblocks == 6 and lay.sizes()[-1] == 128
    nseg = wire.nsegments(lay, offset)
    segs = wire.segments(lay, offset, torch.device("cpu"))
    assert segs.first == 1 and nseg == segs.count == 4
    assert segs.of_block.tolist() == [0, 1, 1, 2, 2, 3]
    ctx = HopContext(offset=offset)
    codes = -(-lay.ncodes * codec.width(1) // 8)
    assert codec.encoded_nbytes(n, ctx) == 4 * nseg + 1 + codes
    assert wire.agreed_scales(ctx, segs, torch.device("cpu")) is None
    agreed = HopContext(offset=offset, shared={"thc_scale": [0.5, 1.0, 2.0, 4.0, 8.0]})
    s = wire.agreed_scales(agreed, segs, torch.device("cpu"))
    assert s is not None and s.tolist() == [1.0, 2.0, 4.0, 8.0]
    t = float(np.float32(codec.effective_clip))
    want = [float(np.float32(np.float64(v) * t)) for v in s.tolist()]
    assert wire.clip_ranges(s).tolist() == want
    with pytest.raises(ValueError, match="contributions"):
        wire.check_contributions(1 << 22)


def test_omnireduce_rule_is_the_kth_block_by_norm_then_index() -> None:
    """By brute force: the rule ``(τ, i*)`` is the norm and index of the K-th
    finite block by (norm descending, index ascending), ``K = ceil(density · blocks)``."""
    codec = OmniReduceCodec(density=0.3, block_size=4)
    wire = codec.wire()
    assert wire.nblocks(4 * 9 + 1) == 10
    norms = torch.tensor([3.0, 1.0, 3.0, float("inf"), 2.0, 3.0, 0.0, 1.0, 2.0, 5.0])
    index = wire.block_index(10, 4 * 20, torch.device("cpu"))
    assert index.tolist() == list(range(20, 30))
    tau, tie = wire.rule(norms.double(), index)
    finite = [(float(v), int(i)) for v, i in zip(norms, index, strict=True) if math.isfinite(v)]
    k = math.ceil(0.3 * 10)
    kth = sorted(finite, key=lambda p: (-p[0], p[1]))[k - 1]
    assert (tau, tie) == kth == (3.0, 22)
