"""OmniReduce: block bitmap + carried blocks, checked against an independent NumPy selection and
wire layout; lossless at density 1; union aggregation; error feedback; the simulator."""

from __future__ import annotations

import math
import threading
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynamiq.codecs import HopContext, OmniReduceCodec, get_codec
from dynamiq.codecs.omnireduce import THRESHOLD_KEY, TIE_KEY
from dynamiq.collectives import allreduce, get_schedule, simulate_allreduce
from dynamiq.collectives.planning import chunk_layout, plan_schedule
from dynamiq.collectives.transport import LocalCluster
from dynamiq.data import load_slice
from dynamiq.testing import check_bound_tight, finite_tensors, run_conformance


def ref_selected(x: np.ndarray, b: int, density: float, first_block: int = 0) -> np.ndarray:
    """The top ``ceil(density · blocks)`` non-zero blocks by squared norm (ties: lower global
    index first), plus every block holding NaN/Inf; plain NumPy."""
    nb = -(-x.size // b)
    blocks = [x[i * b : (i + 1) * b].astype(np.float64) for i in range(nb)]
    norms = [float(np.sum(v * v)) for v in blocks]
    special = [not math.isfinite(n) for n in norms]
    if density == 1.0:
        return np.array([s or n > 0 for s, n in zip(special, norms, strict=True)], dtype=bool)
    k = math.ceil(Fraction(str(density)) * nb)  # 0.2 · 30 is 6
    ranked = sorted(
        (i for i in range(nb) if not special[i] and norms[i] > 0),
        key=lambda i: (-norms[i], first_block + i),
    )
    keep = set(ranked[:k])
    return np.array([special[i] or i in keep for i in range(nb)], dtype=bool)


def ref_payload(x: np.ndarray, b: int, sent: np.ndarray, fmt: str) -> bytes:
    """Bitmap (block i in bit i % 8 of byte i // 8) then the sent blocks' values."""
    bitmap = np.packbits(sent.astype(np.uint8), bitorder="little").tobytes()
    keep = np.repeat(sent, b)[: x.size]
    dtype = {"fp32": np.dtype("<f4"), "bf16": np.dtype(ml_dtypes.bfloat16), "fp16": "<f2"}[fmt]
    return bitmap + x[keep].astype(dtype).tobytes()


def blocky(n: int, b: int, seed: int, zero_every: int = 3) -> torch.Tensor:
    """Values with block norms spread over 2^0..2^12 and some all-zero blocks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp2(np.repeat(rng.integers(0, 13, -(-n // b)), b)[:n])
    for i in range(0, -(-n // b), zero_every):
        x[i * b : (i + 1) * b] = 0.0
    return torch.from_numpy(x.astype(np.float32))


# -- density 1: lossless ------------------------------------------------------------------------


@given(x=finite_tensors(16, dtypes=("float32",)), zeros=st.lists(st.integers(0, 300), max_size=8))
def test_density_one_is_lossless_and_skips_zero_blocks(x: torch.Tensor, zeros: list[int]) -> None:
    codec = OmniReduceCodec(block_size=16)
    x = x.clone()
    for z in zeros:
        x[z * 16 : (z + 1) * 16] = 0.0
    payload = codec.encode(x)
    nonzero = ref_selected(x.numpy(), 16, 1.0)
    assert payload.numpy().tobytes() == ref_payload(x.numpy(), 16, nonzero, "fp32")
    y = codec.decode(payload, x.numel())
    expected = torch.where(torch.from_numpy(np.repeat(nonzero, 16)[: x.numel()]), x, 0.0)
    assert torch.equal(y.view(torch.int32), expected.view(torch.int32))  # -0.0 kept where sent
    assert bool((y == x).all())
    nblocks = -(-x.numel() // 16)
    sent_values = int(np.repeat(nonzero, 16)[: x.numel()].sum())
    assert payload.numel() == -(-nblocks // 8) + 4 * sent_values


# -- density < 1: the selection and the wire ----------------------------------------------------


@pytest.mark.parametrize("fmt", ["auto", "fp16", "fp32"])
@pytest.mark.parametrize("density", [0.1, 0.3, 0.5, 0.99])
def test_top_blocks_and_wire_layout_match_the_reference(density: float, fmt: str) -> None:
    codec = OmniReduceCodec(density=density, block_size=32, value_format=fmt)
    x = blocky(32 * 40 + 7, 32, seed=int(density * 100))
    sent = ref_selected(x.numpy(), 32, density)
    want = ref_payload(x.numpy(), 32, sent, "bf16" if fmt == "auto" else fmt)
    assert codec.encode(x).numpy().tobytes() == want
    nonzero = int((x.view(-1)[: 32 * 40].view(40, 32).abs().sum(1) > 0).sum()) + int(
        x[-7:].ne(0).any()
    )
    assert int(sent.sum()) == min(math.ceil(Fraction(str(density)) * 41), nonzero)


def test_ties_go_to_the_lower_block_index() -> None:
    codec = OmniReduceCodec(density=0.25, block_size=8)
    same = torch.linspace(-1, 1, 8)
    x = torch.cat([same * 0.5, same, same, same, same * 0.1, same, same * 0.2, same * 0.3])
    sent = unpack_bitmap(codec.encode(x), 8)
    assert sent.tolist() == [False, True, True, False, False, False, False, False]
    # with an offset the global index decides the same way
    ctx = HopContext(offset=8 * 1000)
    assert unpack_bitmap(codec.encode(x, ctx), 8).tolist() == sent.tolist()


class NoComm:
    """The OmniReduce prologue does not communicate."""

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise AssertionError("omnireduce's prologue must not communicate")


def unpack_bitmap(payload: torch.Tensor, nblocks: int) -> torch.Tensor:
    bits = np.unpackbits(payload.numpy()[: -(-nblocks // 8)], bitorder="little")
    return torch.from_numpy(bits[:nblocks].astype(bool))


def test_nonfinite_blocks_are_always_sent_and_take_no_place() -> None:
    codec = OmniReduceCodec(density=0.25, block_size=8)
    x = blocky(64, 8, seed=1, zero_every=100)
    clean = unpack_bitmap(codec.encode(x), 8)
    x[3] = math.nan
    x[60] = -math.inf
    got = unpack_bitmap(codec.encode(x), 8)
    assert bool(got[0]) and bool(got[7])
    finite_blocks = [i for i in range(8) if i not in (0, 7)]
    ref = ref_selected(x.numpy(), 8, 0.25)
    assert got.tolist() == ref.tolist() and int(got[finite_blocks].sum()) == 2
    y = codec.decode(codec.encode(x), 64)
    assert math.isnan(float(y[3])) and float(y[60]) == -math.inf
    assert clean.numel() == 8


def test_prologue_rule_makes_the_result_independent_of_chunking() -> None:
    codec = OmniReduceCodec(density=0.2, block_size=16)
    x = blocky(16 * 30, 16, seed=2)
    shared = codec.prologue(x, NoComm())
    assert shared is not None and set(shared) == {THRESHOLD_KEY, TIE_KEY}
    whole = codec.decode(codec.encode(x, HopContext(shared=shared)), x.numel())
    assert int(unpack_bitmap(codec.encode(x, HopContext(shared=shared)), 30).sum()) == 6
    parts = []
    for a, b in [(0, 64), (64, 256), (256, 480)]:
        ctx = HopContext(offset=a, shared=shared)
        parts.append(codec.decode(codec.encode(x[a:b].contiguous(), ctx), b - a, ctx))
    assert torch.equal(torch.cat(parts), whole)
    assert OmniReduceCodec().prologue(x, NoComm()) is None


# -- reduce and bounds --------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_reduce_carries_the_union_of_selected_blocks(shared: bool) -> None:
    codec = OmniReduceCodec(density=0.25, block_size=8)
    x1, x2 = blocky(96, 8, seed=3, zero_every=100), blocky(96, 8, seed=4, zero_every=100)
    rule = codec.prologue(x2, NoComm()) if shared else None
    c1, c2 = HopContext(), HopContext(hop=1, num_hops=2, contributions=2, shared=rule)
    p1 = codec.encode(x1, c1)
    total = codec.decode(p1, 96, c1) + x2
    out = codec.reduce(p1, x2, c1, c2)
    # the local's selection: by its own rule in a collective, by the sum's rule standalone
    basis = x2 if shared else total
    n2 = [float(np.sum(x2.numpy()[i * 8 : i * 8 + 8].astype(np.float64) ** 2)) for i in range(12)]
    nb = [
        float(np.sum(basis.numpy()[i * 8 : i * 8 + 8].astype(np.float64) ** 2)) for i in range(12)
    ]
    kth = sorted(nb, reverse=True)[2]  # K = ceil(0.25 · 12) = 3
    mine = np.array([v >= kth for v in n2])
    union = unpack_bitmap(p1, 12).numpy() | mine
    assert unpack_bitmap(out, 12).numpy().tolist() == union.tolist()
    keep = np.repeat(union, 8)
    assert out.numpy().tobytes()[2:] == total.numpy()[keep].astype(ml_dtypes.bfloat16).tobytes()
    err = (codec.decode(out, 96, c2).double() - total.double()).abs()
    assert bool((err <= codec.error_bound.max_abs_error(total, c2)).all())


def test_dropped_blocks_lose_exactly_their_values() -> None:
    codec = OmniReduceCodec(density=0.3, block_size=16, value_format="fp32")
    x = blocky(16 * 20, 16, seed=5, zero_every=100)
    err = (codec.decode(codec.encode(x), x.numel()).double() - x.double()).abs()
    bound = codec.error_bound.max_abs_error(x)
    sent = np.repeat(ref_selected(x.numpy(), 16, 0.3), 16)
    assert bool((err[~sent] == x.double().abs()[~sent]).all())
    assert bool((bound[~sent] == x.double().abs()[~sent]).all())  # tight: the bound is reached
    assert bool((err[sent] == 0).all()) and bool((bound[sent] == 0).all())


CONFIGS = [
    {"density": 0.3},
    {"density": 0.5, "value_format": "fp16", "block_size": 32},
    {"value_format": "bf16"},
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.usefixtures("quarter_examples")  # variants: the default runs the full count
def test_extra_configs_conform(config: dict) -> None:
    run_conformance({"id": "omnireduce", **config})
    assert check_bound_tight(get_codec({"id": "omnireduce", **config})) >= 0.99


def test_bits_per_value_is_an_upper_bound() -> None:
    assert OmniReduceCodec().bits_per_value() == 8 * (512 + 4 * 2**20) / 2**20
    c = OmniReduceCodec(density=0.1)
    assert c.bits_per_value() == 8 * (512 + 2 * 410 * 256) / 2**20  # K = ceil(409.6)
    x = blocky(2**16, 256, seed=6, zero_every=100)
    assert 8 * c.encode(x).numel() / x.numel() <= c.bits_per_value(x.numel())


def test_bad_config_and_payloads() -> None:
    for kwargs, match in [
        ({"density": 0.0}, "density must be in"),
        ({"density": 1.5}, "density must be in"),
        ({"block_size": 24}, "power of two"),
        ({"value_format": "fp8"}, "value_format must be one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            OmniReduceCodec(**kwargs)
    codec = OmniReduceCodec(density=0.5, block_size=8)
    payload = codec.encode(torch.linspace(-1, 1, 40))
    with pytest.raises(ValueError, match="bitmap announces"):
        codec.decode(payload[:-1], 40)
    with pytest.raises(ValueError, match="bitmap announces"):
        codec.reduce(torch.cat([payload, payload[:2]]), torch.ones(40))
    assert codec.encoded_nbytes(40) is None and codec.encoded_nbytes(0) == 0


# -- all-reduce ---------------------------------------------------------------------------------


def _bitmap(numel: int, block: int = 16) -> int:
    nblocks = -(-numel // block)
    return -(-nblocks // 8)


def _dense_inputs(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(numel) * np.exp2(rng.integers(-6, 7, numel))
    return [
        torch.from_numpy((base + rng.standard_normal(numel)).astype(np.float32)) for _ in range(n)
    ]


@pytest.mark.parametrize("density", [1.0, 0.1])
@pytest.mark.parametrize("schedule", ["ring", "butterfly", "tree"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_allreduce_in_the_simulator(density: float, schedule: str, n: int) -> None:
    codec = OmniReduceCodec(density=density, block_size=16)
    numel = 16 * 37 + 5
    xs = _dense_inputs(n, numel, seed=n)
    res = simulate_allreduce(xs, codec, schedule, seed=n, sub_chunk=64)
    for out in res.outputs[1:]:
        assert torch.equal(out.view(torch.int32), res.outputs[0].view(torch.int32))
    err = (res.outputs[0].double() - res.exact).abs()
    assert res.bound is not None and bool((err <= res.bound).all())
    sched = get_schedule(schedule, n)
    plan = plan_schedule(sched, codec, seed=n)
    _, pieces = chunk_layout(numel, sched, codec, 64)
    sends = [
        [(a, b) for rnd in plan[r] for op in rnd.sends for a, b in pieces[op.chunk]]
        for r in range(n)
    ]
    if density == 1.0:
        # lossless: only fp32 summation error (n - 1 additions of partial sums <= Σ|x|)
        abs_sum = torch.stack([x.double().abs() for x in xs]).sum(dim=0)
        assert bool((err <= (n - 1) * 2.0**-24 * (1 + 2.0**-20) * abs_sum * 1.001).all())
        # dense data: every block sent; a length header per non-empty piece
        want = [sum(8 + _bitmap(b - a) + 4 * (b - a) for a, b in s if b > a) for s in sends]
        assert res.bytes_sent == want
    else:
        dense = [sum(8 + _bitmap(b - a) + 2 * (b - a) for a, b in s if b > a) for s in sends]
        assert all(got < full for got, full in zip(res.bytes_sent, dense, strict=True))


def test_error_feedback_conserves_the_dropped_mass() -> None:
    """With residuals, what the all-reduce drops is exactly what the ranks keep for the next
    step: output + Σ residuals = Σ gradients, up to fp32 rounding."""
    codec = OmniReduceCodec(density=0.2, block_size=16, value_format="fp32")
    n, numel = 4, 16 * 50
    xs = _dense_inputs(n, numel, seed=7)
    cluster = LocalCluster(n)
    outs = [x.clone() for x in xs]
    residuals = [torch.zeros(numel) for _ in range(n)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            allreduce(
                outs[r],
                codec,
                "ring",
                transport=cluster.transport(r),
                threshold=0,
                residual=residuals[r],
            )
        except BaseException as exc:
            errors.append(exc)
            cluster.aborted.set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    exact = torch.stack([x.double() for x in xs]).sum(dim=0)
    kept = torch.stack([r.double() for r in residuals]).sum(dim=0)
    assert float(kept.abs().max()) > 0  # something was dropped
    abs_sum = torch.stack([x.double().abs() for x in xs]).sum(dim=0)
    # each value passes through at most 2n fp32 additions or subtractions
    assert bool(
        ((outs[0].double() + kept - exact).abs() <= 2 * n * 2.0**-24 * abs_sum * 1.001).all()
    )


def test_real_gradients_ring_of_8() -> None:
    xs = [row.contiguous() for row in load_slice()]
    lossless = simulate_allreduce(xs, "omnireduce", "ring")
    sparse = simulate_allreduce(xs, {"id": "omnireduce", "density": 0.1}, "ring")
    assert lossless.vnmse < 1e-12 and 30 < lossless.bits_per_value() < 32.1
    assert sparse.vnmse < 0.05 and sparse.bits_per_value() < 3.0
