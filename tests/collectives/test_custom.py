"""The helpers for custom collectives: composed bounds (against an fp64 sum and against the
engine on the same path), prologues with a communicator of one's own, the cut rule; and the
examples of docs/collectives.md, "Your own collective", run."""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from dynamiq.codecs import Codec, ErrorBound, HopContext, get_codec, list_codecs
from dynamiq.collectives import simulate_allreduce
from dynamiq.collectives.bounds import (
    ADD_REL,
    TINY,
    addition_bound,
    encoding_bound,
    fp32_add_slack,
    group_size,
    pack_bound,
    unpack_bound,
)
from dynamiq.collectives.cuts import block_cuts, check_cut_invariance
from dynamiq.collectives.handshake import PrologueComm, local_prologues, run_prologue
from dynamiq.collectives.planning import chunk_layout, plan_schedule
from dynamiq.collectives.schedules import Schedule, Step
from dynamiq.collectives.transport import LocalCluster, run_threads

DOC = Path(__file__).parents[2] / "docs" / "collectives.md"


def _chain() -> Schedule:
    """Three ranks, one chunk: 2 -> 1 -> 0 reduce, then 0 -> 1 -> 2 forward the bytes."""
    idle = Step()
    return Schedule(
        "chain3",
        3,
        1,
        (
            (
                idle,
                Step(recv_from=1, recv_chunks=(0,), action="reduce"),
                Step(send_to=1, send_chunks=(0,)),
                idle,
            ),
            (
                Step(recv_from=2, recv_chunks=(0,), action="reduce"),
                Step(send_to=0, send_chunks=(0,)),
                Step(recv_from=0, recv_chunks=(0,), action="copy"),
                Step(send_to=2, send_chunks=(0,)),
            ),
            (
                Step(send_to=1, send_chunks=(0,)),
                idle,
                idle,
                Step(recv_from=1, recv_chunks=(0,), action="copy"),
            ),
        ),
    )


def _xs(numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    scales = torch.exp2(torch.randint(-8, 9, (numel,), generator=g))
    return [torch.randn(numel, generator=g) * scales for _ in range(3)]


#: codecs whose bound on this path exceeds the largest |sum| (the check that the bound is not
#: vacuous does not apply; the bound must still hold): 2 bits a value, and THC's 4-bit
#: lookup table at its default range
WIDE_BOUND = {"int2", "thc"}


@pytest.mark.parametrize("codec_name", list_codecs())
def test_composed_bound_on_a_two_hop_path(codec_name: str) -> None:
    codec = get_codec(codec_name)
    numel = 4096
    xs = _xs(numel)
    sched = _chain()
    plan = plan_schedule(sched, codec, seed=5)
    # the contexts of the three encodings, from the plan: rank 2's gradient, rank 1's partial
    # sum (fused), rank 0's finished sum (fused, then forwarded as bytes)
    c0 = plan[2][0].sends[0].ctx
    c1 = plan[1][0].recvs[0].out_ctx
    c2 = plan[0][1].recvs[0].out_ctx
    assert c1 is not None and c2 is not None
    # a codec with a prologue (DynamiQ pooled over the bucket): its result, as the engine
    # runs it (on the engine's chunks), reaches every encoding
    chunks, _ = chunk_layout(numel, sched, codec, 1 << 18)
    shared = local_prologues(codec, xs, chunks)[0][0]
    c0, c1, c2 = (dataclasses.replace(c, shared=shared) for c in (c0, c1, c2))
    assert [c.hop for c in (c0, c1, c2)] == [0, 1, 2]
    assert [c.rank for c in (c0, c1, c2)] == [2, 1, 0]

    def path(wire: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The path by hand; ``wire``: each bound as it travels (one fp64 per group)."""

        def sent(b: torch.Tensor) -> torch.Tensor:
            g = group_size(codec)
            return unpack_bound(pack_bound(b, g), numel, g) if wire else b

        p0 = codec.encode(xs[2], c0)
        b0 = sent(encoding_bound(codec, xs[2], c0, held=torch.zeros(numel, dtype=torch.float64)))
        v1 = codec.decode(p0, numel, c0) + xs[1]
        p1 = codec.encode(v1, c1)
        b1 = encoding_bound(codec, v1, c1, held=addition_bound(v1, b0, 0.0))
        b1 = sent(b1)
        v2 = codec.decode(p1, numel, c1) + xs[0]
        p2 = codec.encode(v2, c2)
        b2 = sent(encoding_bound(codec, v2, c2, held=addition_bound(v2, b1, 0.0)))
        return codec.decode(p2, numel, c2), b2

    out, bound = path(wire=False)
    exact = xs[0].double() + xs[1].double() + xs[2].double()
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all())
    assert float(err.max()) > 0
    if codec_name not in WIDE_BOUND:  # not vacuous
        assert float(bound.max()) < float(exact.abs().max())
    # the engine on the same path: the same result, and the same bound as the wire carries it
    sim = simulate_allreduce(xs, codec, sched, seed=5)
    wire_out, wire_bound = path(wire=True)
    assert torch.equal(sim.outputs[0], out) and torch.equal(wire_out, out)
    assert sim.bound is not None and torch.equal(sim.bound, wire_bound)
    assert bool((bound <= wire_bound).all())  # the per-element path is the tighter


def test_addition_slack_covers_fp32_rounding() -> None:
    """Exhaustive over a grid of exponent pairs, subnormals and ties: |fl(a+b) - (a+b)| is
    within the slack of fl(a+b)."""
    g = torch.Generator().manual_seed(0)
    mant = 1 + torch.rand(4000, generator=g)
    exps = torch.randint(-149, 128, (4000,), generator=g).double()
    a = (mant.double() * torch.exp2(exps)).float()
    b = (
        torch.randn(4000, generator=g).double()
        * torch.exp2(exps - torch.randint(0, 30, (4000,), generator=g))
    ).float()
    tiny = torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-126, 1.0, 1.0 + 2.0**-23])
    a = torch.cat([a, tiny, tiny]).float()
    b = torch.cat([b, tiny, torch.full_like(tiny, 2.0**-24)]).float()
    keep = torch.isfinite(a + b)
    a, b = a[keep], b[keep]
    total = a + b
    err = (total.double() - (a.double() + b.double())).abs()
    assert bool((err <= fp32_add_slack(total)).all())
    assert ADD_REL > 2.0**-24 and TINY == 2.0**-150
    with pytest.raises(ValueError, match="at least one addend"):
        addition_bound(total)


def test_the_docs_examples_run() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Your own collective", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    for code in blocks:
        exec(compile(code, f"{DOC}:your-own-collective", "exec"), {})


# -- prologues ---------------------------------------------------------------------------------


class _ThreadComm:
    """A communicator of one's own: ``world_size`` threads meeting at a barrier."""

    def __init__(self, rank: int, world_size: int, board: list, barrier: threading.Barrier):
        self.rank, self.world_size, self.board, self.barrier = rank, world_size, board, barrier

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.board[self.rank] = tensor.clone()
        self.barrier.wait()
        out = list(self.board)
        self.barrier.wait()
        return out


@pytest.mark.parametrize("codec_name", ["thc", "omnireduce", "int8"])
def test_run_prologue_with_ones_own_communicator(codec_name: str) -> None:
    codec = get_codec(codec_name)
    if codec_name == "omnireduce":
        codec = get_codec({"id": "omnireduce", "density": 0.25})
    n = 3
    xs = _xs(1 << 15)
    board: list[Any] = [None] * n
    barrier = threading.Barrier(n)
    mine = run_threads(n, lambda r: run_prologue(codec, xs[r], _ThreadComm(r, n, board, barrier)))
    cl = LocalCluster(n)
    engine = run_threads(n, lambda r: run_prologue(codec, xs[r], PrologueComm(cl.transport(r), 30)))
    assert mine == engine
    if codec_name == "int8":
        assert mine == [None] * n  # no prologue
    elif codec_name == "thc":
        assert mine[0] is not None and mine[0] == mine[1] == mine[2]  # agreed scales
    else:
        assert all(m is not None for m in mine)


class _Bad:
    block_size = 1

    def prologue(self, x: torch.Tensor, comm: Any) -> list[int]:
        return [1]


def test_run_prologue_rejects_a_result_that_is_not_a_dict() -> None:
    with pytest.raises(TypeError, match="_Bad.prologue returned list"):
        run_prologue(_Bad(), torch.ones(3), _ThreadComm(0, 1, [None], threading.Barrier(1)))  # type: ignore[arg-type]


# -- the cut rule ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", list_codecs())
def test_every_codec_keeps_the_cut_rule(codec_name: str) -> None:
    codec = get_codec(codec_name)
    numel = 3 * codec.block_size + 17 if codec.block_size > 1 else 1000
    x = _xs(numel)[0]
    ctx = HopContext(seed=4, step=1, hop=1, num_hops=3, rank=2, contributions=2, world_size=4)
    # a prologue runs on the whole buffer, its element i at global index i (one rank here),
    # and its result goes into every context
    solo = _ThreadComm(0, 1, [None], threading.Barrier(1))
    ctx = dataclasses.replace(ctx, shared=run_prologue(codec, x, solo))
    cuts = block_cuts(numel, 3, codec)
    assert cuts[0][0] == 0 and cuts[-1][1] == numel
    assert all(a % codec.block_size == 0 for a, _ in cuts)
    check_cut_invariance(codec, x, ctx, cuts)


@dataclass(frozen=True, kw_only=True)
class _WholeBufferInt8(Codec):
    """Breaks the rule: one scale from the largest |x| of whatever piece it is given."""

    codec_id: ClassVar[str] = "_whole_buffer_int8_test_only"

    @property
    def block_size(self) -> int:
        return 1

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int | None:
        return numel + 4

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        scale = (x.abs().amax() / 127).clamp_min(1e-30).reshape(1).float()
        q = torch.round(x / scale).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        scale = payload[:4].clone().view(torch.float32)
        return payload[4:].clone().view(torch.int8).float() * scale

    @property
    def error_bound(self) -> ErrorBound:
        return ErrorBound(
            formula="max|x|/254",
            unbiased=False,
            max_abs=lambda x, ctx: torch.full((x.numel(),), float(x.abs().max()) / 254),
            witness=lambda n: torch.ones(n),
        )


def test_the_cut_check_catches_a_codec_that_breaks_the_rule() -> None:
    codec = _WholeBufferInt8()
    x = torch.linspace(-1, 1, 100) * torch.linspace(0.01, 10, 100)
    with pytest.raises(AssertionError, match="depends on the cut"):
        check_cut_invariance(codec, x, HopContext(), block_cuts(100, 4, codec))
    with pytest.raises(ValueError, match="cover"):
        check_cut_invariance(codec, x, HopContext(), [(0, 50)])
    with pytest.raises(ValueError, match="blocks"):
        check_cut_invariance(get_codec("mxfp4"), torch.ones(64), HopContext(), [(0, 5), (5, 64)])
