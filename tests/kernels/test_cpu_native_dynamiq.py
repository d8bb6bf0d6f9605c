"""The DynamiQ codec's native CPU kernel (``dynamiq.kernels.cpu_native``,
``csrc/dynamiq_kernels.cpp``) against its PyTorch reference, bit for bit (docs/design.md,
"House style", item 7).

Every check computes the plain reference (``backend="reference"``: the codec's ``_encode`` /
``_decode`` / ``_reduce``) beside the native kernel (``backend="cpu"``, forced, so a kernel that
cannot be built fails instead of falling back), proves the kernel ran (``last_backend()`` and
its launch count) and compares payload bytes, or the int32 views of fp32 values with NaN by
position, with no tolerance. Covered: every knob (``bits`` down to 0.5 and up to 8, fractional;
``span``, ``super_group``; ``group`` 2, 3, 8, 12, 16, 24, 32, 64, 256; fitted and uniform
levels; nearest, stochastic and correlated rounding with ``num_hops`` 3, 5, 7 and 2^32 - 1;
``hop_slope``; ``pooled=False``; ``scale_steps`` 1..4), short last spans and groups, NaN/±Inf,
zeros, subnormals, values near 2^127 and above bf16's largest, fp32/bf16/fp16 inputs, offsets
past 2^32 and 2^63, arbitrary payload bytes, values on the edge of every rounding decision
(round-up thresholds; fractions equal to the dither, so a dither off by one ulp shows), thread
counts, the portable (non-AVX-512) build, and Hypothesis over random configurations, sizes and
contexts.
"""

from __future__ import annotations

import math
import platform
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from dynamiq_inputs import check_all as _check_all
from dynamiq_inputs import edge_values, random_values
from hypothesis import given
from hypothesis import strategies as st
from kernel_harness import assert_bytes_equal, assert_values_equal
from kernel_harness import both as _both

import dynamiq.kernels as K
from dynamiq.codecs import HopContext, get_codec
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.kernels import _compiled, cpu_native
from dynamiq.testing.strategies import hop_contexts

if cpu_native._compiler() is None:
    pytest.skip(
        "no C++ compiler on this machine (CXX, g++, c++, clang++): the native CPU kernels "
        "cannot be built here",
        allow_module_level=True,
    )

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dq(**kw: Any) -> DynamiqCodec:
    codec = get_codec({"id": "dynamiq", **kw})
    assert isinstance(codec, DynamiqCodec)
    return codec


SMALL = {"span": 1024, "super_group": 256, "group": 16}
#: every knob; groups of 16, 32 and 64 run the vector code (where built), the others the loops
CONFIGS: dict[str, dict[str, Any]] = {
    "small": SMALL,
    "uniform": {**SMALL, "levels": "uniform", "bits": 4.734375},
    "stochastic": {**SMALL, "rounding": "stochastic"},
    "correlated_slope": {**SMALL, "rounding": "correlated", "hop_slope": 1.5, "bits": 3.5},
    "unpooled": {**SMALL, "pooled": False, "bits": 5.3},
    "steps1": {**SMALL, "scale_steps": 1, "bits": 2.9},
    "steps3_uniform_stochastic": {
        **SMALL,
        "scale_steps": 3,
        "levels": "uniform",
        "rounding": "stochastic",
    },
    "steps4": {**SMALL, "scale_steps": 4, "bits": 6.3},
    "group3": {"span": 960, "super_group": 96, "group": 3, "bits": 2.2},
    "group2_sg2": {"span": 512, "super_group": 2, "group": 2, "bits": 1.3},
    "group12_correlated": {"span": 768, "super_group": 48, "group": 12, "rounding": "correlated"},
    "group24": {"span": 1152, "super_group": 96, "group": 24, "bits": 4.734375},
    "group8": {"span": 512, "super_group": 64, "group": 8, "scale_steps": 3},
    "group32_stochastic": {"span": 2048, "super_group": 512, "group": 32, "rounding": "stochastic"},
    "group64_correlated": {
        "span": 1024,
        "super_group": 1024,
        "group": 64,
        "rounding": "correlated",
        "bits": 6.9,
    },
    "group256": {"span": 1024, "super_group": 512, "group": 256, "bits": 7.9},
    "bits_half": {**SMALL, "bits": 0.5, "hop_slope": 4.0},
    "bits8_correlated": {**SMALL, "bits": 8.0, "rounding": "correlated"},
    "bits8_uniform": {**SMALL, "bits": 8.0, "levels": "uniform", "scale_steps": 1},
}
#: (ctx the payload was encoded with, out_ctx of the reduce); num_hops 3, 5, 7: the correlated
#: dither divides by a number that is not a power of two
CTX_PAIRS = (
    (HopContext(), HopContext(hop=1, num_hops=3)),
    (
        HopContext(seed=7, step=3, hop=1, num_hops=5, rank=2, offset=4099),
        HopContext(seed=7, step=3, hop=4, num_hops=5, rank=5, offset=4099),
    ),
    (
        HopContext(seed=2**40 + 5, step=2**33, hop=0, num_hops=7, rank=1, offset=2**32 - 17),
        HopContext(seed=2**40 + 5, step=2**33, hop=6, num_hops=7, rank=2, offset=2**32 - 17),
    ),
)


pytestmark = pytest.mark.usefixtures("cpu_switches_cleared")


# -- comparisons --------------------------------------------------------------------------------

_KERNEL = {K.encode: "cpu_dynamiq_encode", K.decode: "cpu_dynamiq_decode"}
_KERNEL[K.reduce] = "cpu_dynamiq_reduce"


def both(fn: Any, op: str, *args: Any) -> tuple[Any, Any]:
    """``fn`` on the reference and on the native kernel (forced), with a proof that the
    kernel ran (an empty input needs no launch)."""
    assert _KERNEL[fn] == f"cpu_dynamiq_{op}"
    return _both(fn, *args, kernel=_KERNEL[fn], fast="cpu")


def check_all(
    codec: DynamiqCodec,
    x: torch.Tensor,
    local: torch.Tensor,
    pair: tuple[HopContext, HopContext],
    what: str,
) -> None:
    """Encode, decode and reduce on the reference and on the native kernel: all bit-exact."""
    _check_all(codec, x, local, pair, what, fast="cpu", kernels=_KERNEL)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_bit_exact(name: str) -> None:
    """Random and edge-case inputs of 2.4 spans (a short last span and a short last group),
    every input dtype across the configurations, hop contexts that move ``bits_k``."""
    codec = dq(**CONFIGS[name])
    k = list(CONFIGS).index(name)
    dtype = DTYPES[k % 3]
    n = 2 * codec.span + codec.span * 2 // 5 + 1
    x = random_values(n, k).to(dtype)
    edge = edge_values(n, codec.super_group if codec.super_group >= 16 else 64, k).to(dtype)
    check_all(codec, x, edge, CTX_PAIRS[k % 3], f"{name} {dtype} random")
    check_all(codec, edge, x, CTX_PAIRS[(k + 1) % 3], f"{name} {dtype} edge")


@pytest.mark.parametrize("n", [0, 1, 7, 17, 300, 1024, 1025])
def test_remainders(n: int) -> None:
    """Lengths: none, 1 value, a short group, a short super-group, one span, a span and one."""
    codec = dq(**CONFIGS["correlated_slope"])
    x = random_values(n, n).to(DTYPES[n % 3])
    local = edge_values(n, 64, n).to(DTYPES[(n + 1) % 3])
    pair = CTX_PAIRS[1]
    if n == 300:  # 32-bit hop counts (the correlated dither's strata, H rounded to fp32)
        pair = (
            HopContext(seed=3, hop=2**32 - 3, num_hops=2**32 - 1, offset=2**40),
            HopContext(seed=3, hop=2**32 - 2, num_hops=2**32 - 1, offset=2**40),
        )
    check_all(codec, x, local, pair, f"n={n}")


def test_offsets_across_2_63() -> None:
    """Global indices whose low word wraps inside a span and that wrap int64 (the dither)."""
    codec = dq(**CONFIGS["group12_correlated"])
    x, local = random_values(2000, 1), random_values(2000, 2)
    for offset in (2**32 - 700, 2**63 - 1500):
        pair = (
            HopContext(seed=9, hop=0, num_hops=3, offset=offset),
            HopContext(seed=9, hop=2, num_hops=3, rank=4, offset=offset),
        )
        check_all(codec, x, local, pair, f"offset {offset}")


def test_default_config_several_spans() -> None:
    """The default codec (spans of 256, groups of 16): 21 full spans and a short one."""
    codec = get_codec("dynamiq")
    assert isinstance(codec, DynamiqCodec)
    n = 2 * codec.span + 5000
    x = random_values(n, 3)
    local = edge_values(n, 1024, 4).to(torch.bfloat16)
    check_all(codec, x, local, CTX_PAIRS[0], "default")


@pytest.mark.parametrize("group, span", [(8, 256), (16, 256), (32, 256), (8, 1024), (4, 2048)])
@pytest.mark.parametrize("bits", [0.5, 1.0, 2.0, 3.3, 4.62, 5.5, 7.0, 7.97, 8.0])
def test_one_super_group_spans_at_every_budget(group: int, span: int, bits: float) -> None:
    """Spans of one super-group of full groups (the default's shape: its own widths code,
    ``widths_one_sg``, up to 255 groups; 512 groups of 4 take the general code) from a
    budget of a few groups' bits to every group at 8 bits, with a short last span of whole
    groups (the same code) and one with a short last group (the general code); edge values
    give groups of equal codes, so thresholds tie and groups rise."""
    codec = dq(span=span, super_group=span, group=group, pooling="span", bits=bits)
    for k, n in enumerate((3 * span + 3 * group, 3 * span + 3 * group + 2)):
        x = random_values(n, k + int(8 * bits))
        edge = edge_values(n, 256, k + group).to(DTYPES[k])
        check_all(codec, x, edge, CTX_PAIRS[0], f"group {group} bits {bits} n {n} random")
        check_all(codec, edge, x, CTX_PAIRS[1], f"group {group} bits {bits} n {n} edge")


@pytest.mark.parametrize("name", ["small", "correlated_slope", "group3", "group64_correlated"])
def test_arbitrary_payload_bytes(name: str) -> None:
    """Payloads no encoder wrote (negative, NaN, Inf and subnormal scales, any group code, any
    body) decode and reduce like the reference."""
    codec = dq(**CONFIGS[name])
    g = torch.Generator().manual_seed(11)
    ctx, out_ctx = CTX_PAIRS[1]
    for n in (5, 2100):
        payload = torch.randint(0, 256, (codec.encoded_nbytes(n, ctx),), generator=g)
        payload = payload.to(torch.uint8)
        got, want = both(K.decode, "decode", codec, payload, n, ctx)
        assert_values_equal(got, want, f"decode {name} n={n}")
        local = random_values(n, n).to(torch.float16)
        got, want = both(K.reduce, "reduce", codec, payload, local, ctx, out_ctx)
        assert_bytes_equal(got, want, f"reduce {name} n={n}")


def test_nonfinite_super_groups_decode_to_nan() -> None:
    """A super-group holding NaN gets the scale 0xFFFF, one holding ±Inf 0x7F80; both decode
    to NaN, the other super-groups do not. A finite value above ``max_input_abs`` raises on
    both backends."""
    codec = dq(**SMALL)
    x = random_values(1024, 5)
    x[600] = 3.39e38  # finite, but above bf16's largest (3.3895e38): its scale would be Inf
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError, match="exceeds max_input_abs"):
            K.encode(codec, x, HopContext(), backend=backend)
    x[10] = float("nan")
    x[300] = float("inf")
    x[600] = float("inf")
    got, want = both(K.encode, "encode", codec, x, HopContext())
    assert_bytes_equal(got, want, "encode")
    scales = got[:8].view(torch.int16).tolist()
    assert [s & 0xFFFF for s in scales[:3]] == [0xFFFF, 0x7F80, 0x7F80], scales
    got_v, want_v = both(K.decode, "decode", codec, got, 1024, HopContext())
    assert_values_equal(got_v, want_v, "decode")
    assert bool(got_v[:768].isnan().all()) and bool(got_v[768:].isfinite().all())


def test_zeros_and_empty_budget() -> None:
    """All zeros: zero scales, codes 15, an all-zero body, exact zeros back; a hop whose
    ``bits_k`` clamps to 0 has no body at all, and a reduce into a body from it."""
    codec = dq(**CONFIGS["bits_half"])
    ctx = HopContext(hop=0, num_hops=3)
    assert codec._budget(1024, ctx) == 0
    got, want = both(K.encode, "encode", codec, torch.zeros(1024), HopContext())
    assert_bytes_equal(got, want, "zeros")
    assert not bool(got[:8].any()) and bool((got[8:40] == 0xFF).all()) and not got[40:].any()
    assert bool((K.decode(codec, got, 1024, backend="cpu") == 0).all())
    y = random_values(1024, 1)
    got, want = both(K.encode, "encode", codec, y, ctx)
    assert_bytes_equal(got, want, "no body")
    assert got.numel() == 40
    got_v, want_v = both(K.decode, "decode", codec, got, 1024, ctx)
    assert_values_equal(got_v, want_v, "decode without body")
    got_r, want_r = both(K.reduce, "reduce", codec, got, y, ctx, HopContext(hop=2, num_hops=3))
    assert_bytes_equal(got_r, want_r, "reduce into a body")


def test_real_gradients() -> None:
    """Real partial sums (every width 0..8 occurs): worker 0's gradient, then worker 1's."""
    from dynamiq.data import load_slice

    grads = load_slice()
    for cfg in ({}, {"rounding": "correlated", "hop_slope": 1.0}, {"rounding": "stochastic"}):
        codec = dq(span=4096, **cfg)
        x = grads[0, :9000].contiguous()
        local = grads[1, :9000].contiguous().to(torch.bfloat16)
        pair = (HopContext(seed=1, hop=0, num_hops=5), HopContext(seed=1, hop=1, num_hops=5))
        check_all(codec, x, local, pair, f"real gradients {cfg}")


def test_large_spans() -> None:
    """The configurations of the benchmarks beyond the default span: 2^20-value spans (one
    full span and a short one) over "layers" of real gradients at different scales,
    super-groups of 4096, the 8.5-bit layout (groups of 8, quarter-octave scales), a low
    budget."""
    from dynamiq.data import load_slice

    grads = load_slice()
    n = (1 << 20) + 40_000
    reps = -(-n // grads.shape[1])
    scale = torch.exp2(torch.arange(reps, dtype=torch.float32) % 13 - 6)
    x = (grads[0].repeat(reps).view(reps, -1) * scale[:, None]).reshape(-1)[:n].contiguous()
    local = grads[1].repeat(reps)[:n].contiguous().to(torch.bfloat16)
    pair = (HopContext(hop=0, num_hops=7, offset=4096), HopContext(hop=1, num_hops=7, offset=4096))
    for cfg in (
        {"span": 1 << 20, "super_group": 4096},
        {"span": 1 << 20, "bits": 7.98, "group": 8, "scale_steps": 4},
        {"span": 1 << 20, "bits": 1.4844},
    ):
        check_all(dq(**cfg), x, local, pair, f"large span {cfg}")


@pytest.mark.parametrize(
    ("rounding", "group", "num_hops", "levels"),
    [
        ("nearest", 16, 1, "fitted"),
        ("nearest", 12, 1, "uniform"),
        ("stochastic", 16, 1, "fitted"),
        ("stochastic", 12, 2, "uniform"),
        ("correlated", 16, 3, "fitted"),
        ("correlated", 12, 5, "fitted"),
        ("correlated", 32, 7, "uniform"),
    ],
)
def test_rounding_decisions_at_their_edges(
    rounding: str, group: int, num_hops: int, levels: str
) -> None:
    """Values on the edge of every rounding decision, in groups of scale 1 (each holds 1.0):
    nearest: each round-up threshold and the fp32 value below it; stochastic and correlated:
    values whose fraction ``(y - lower) / gap`` is exactly the reference's dither ``u`` (it
    rounds down) or the next fp32 above it (up), so a dither off by one ulp, or a comparison
    the other way, flips a decision."""
    import dynamiq.codecs.dynamiq_codec as dc

    sg = 96 if group == 12 else 256
    # dithered: widths 1 and 2, whose wide gaps let most fractions equal the dither exactly
    bits = 4.7 if rounding == "nearest" else 1.5
    codec = dq(span=1536, super_group=sg, group=group, rounding=rounding, levels=levels, bits=bits)
    ctx = HopContext(
        seed=5, step=2, hop=num_hops - 1, num_hops=num_hops, rank=3, offset=2**32 - 500
    )
    n = codec.span + 300  # a short last span, with a short last group for groups of 32
    x = torch.zeros(n)
    x[::group] = 1.0  # every group: absmax 1, S = 1, e = 0, scale 1
    widths = []
    for first in range(0, n, codec.span):
        span = x[first : first + codec.span]
        s_sg, e, _ = codec._scales(span)
        budget = codec._budget(span.numel(), ctx)
        w = codec._widths(s_sg, e, span.numel(), budget)
        widths.append(w.repeat_interleave(group)[: span.numel()])
    w = torch.cat(widths)
    i = torch.arange(n)
    inner = (i % group != 0) & (w > 0)
    w_in, i_in = w[inner], i[inner]
    t = codec._tables(torch.device("cpu"))
    if rounding == "nearest":
        # the thresholds of each width, ascending (the finite keys of its cell table)
        keys = t.key.view(9, -1)
        rows = [torch.unique(keys[k][torch.isfinite(keys[k])]) for k in range(1, 9)]
        pick = [
            rows[int(wk) - 1][int(ik) % ((1 << int(wk)) - 1)]
            for wk, ik in zip(w_in, i_in, strict=True)
        ]
        y = torch.stack(pick)
        below = torch.nextafter(y, torch.tensor(-2.0))
        x[inner] = torch.where(i_in % 2 == 0, y, below)
    else:
        u = codec._span_ctx_u(i_in + ctx.offset, ctx)
        target = torch.where(i_in % 2 == 0, u, torch.nextafter(u, torch.tensor(2.0)))
        h = 1 + i_in % ((1 << w_in) - 1)  # the upper neighbour of each value
        flat = w_in * dc._ROW + h
        lower, gap = t.lower[flat], t.gap[flat]
        # the smallest fp32 y in (lower, upper] with fl(fl(y - lower) / gap) >= target (the
        # fraction never falls as y grows): bisection over fp32 values
        a, b = dc._float_key(lower), dc._float_key(t.levels[flat])
        while bool((b - a > 1).any()):
            mid = (a + b) >> 1
            up = (dc._key_float(mid) - lower) / gap >= target
            a, b = torch.where(up, a, mid), torch.where(up, mid, b)
        y = dc._key_float(b)
        exact = (y - lower) / gap == target
        assert float(exact.float().mean()) > 0.5  # most fractions are the dither exactly
        x[inner] = y
    assert float(x.abs().max()) == 1.0
    got, want = both(K.encode, "encode", codec, x, ctx)
    assert_bytes_equal(got, want, f"{rounding} edges")


# -- threads, the portable build ------------------------------------------------------------------


def test_thread_count_does_not_change_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """1, 2 and 3 threads over many spans: the same bytes and values."""
    monkeypatch.setattr(cpu_native, "_PER_THREAD", 64)  # threads even for small inputs
    threads = torch.get_num_threads()
    codecs = [dq(**CONFIGS["correlated_slope"]), dq(**CONFIGS["group3"])]
    x, local = random_values(9000, 1), random_values(9000, 2).to(torch.bfloat16)
    ctx, out_ctx = CTX_PAIRS[2]
    runs = []
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            out = []
            for codec in codecs:
                p = K.encode(codec, x, ctx, backend="cpu")
                out += [p, K.decode(codec, p, 9000, ctx, backend="cpu")]
                out.append(K.reduce(codec, p, local, ctx, out_ctx, backend="cpu"))
            runs.append(out)
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    check_all(codecs[0], x, local, (ctx, out_ctx), "after the thread runs")


@pytest.mark.parametrize(
    "flag",
    [
        # ~12-19 s: a second full compile of the kernels
        pytest.param("-DDQ_PORTABLE", marks=pytest.mark.slow, id="portable"),
        # the AVX2 code of machines without AVX-512 (dynamiq_avx2.h): where the compiler
        # targets x86 with AVX2, else the portable loops again
        pytest.param("-mno-avx512f", id="avx2"),
    ],
)
def test_other_builds_bit_exact(flag: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The code that machines without AVX-512 run, built here with ``flag``, for group sizes
    the AVX-512 code would otherwise take, and the default's spans of one super-group."""
    if flag.startswith("-m") and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"{flag} is an x86 flag; this machine is {platform.machine()}")
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "_FAILURE", None)
    monkeypatch.setattr(cpu_native, "FLAGS", (*cpu_native.FLAGS, flag))
    monkeypatch.setenv("DYNAMIQ_CACHE", str(tmp_path))
    assert cpu_native.available()
    for name in ("small", "stochastic", "group64_correlated", "bits8_correlated"):
        codec = dq(**CONFIGS[name])
        n = codec.span + 333
        x, local = random_values(n, 1), edge_values(n, 64, 2).to(torch.float16)
        check_all(codec, x, local, CTX_PAIRS[1], f"{flag} {name}")
        check_all(codec, local, x, CTX_PAIRS[2], f"{flag} {name} edge")
    for group, bits in ((16, 4.62), (16, 0.5), (16, 7.97), (8, 3.3), (32, 5.5)):
        codec = dq(span=256, super_group=256, group=group, pooling="span", bits=bits)
        n = 5 * 256 + 3 * group
        x, local = random_values(n, group), edge_values(n, 256, 3).to(torch.bfloat16)
        check_all(codec, x, local, CTX_PAIRS[0], f"{flag} one super-group {group} {bits}")
        check_all(codec, local, x, CTX_PAIRS[1], f"{flag} one super-group {group} {bits} edge")


# -- Hypothesis -------------------------------------------------------------------------------


@st.composite
def configs(draw: st.DrawFn) -> DynamiqCodec:
    group = draw(st.one_of(st.sampled_from([16, 32, 64, 8]), st.integers(2, 40)))
    super_group = group * draw(st.integers(1, max(1, 512 // group)))
    span = super_group * draw(st.integers(1, max(1, 2048 // super_group)))
    bits = draw(st.one_of(st.sampled_from([0.5, 4.7, 4.734375, 8.0]), st.floats(0.5, 8.0)))
    return dq(
        bits=bits,
        span=span,
        super_group=super_group,
        group=group,
        levels=draw(st.sampled_from(["fitted", "uniform"])),
        rounding=draw(st.sampled_from(["nearest", "stochastic", "correlated"])),
        hop_slope=draw(st.sampled_from([0.0, 0.0, 1.0, 4.0])),
        pooled=draw(st.booleans()) or draw(st.booleans()),
        scale_steps=draw(st.integers(1, 4)),
    )


@given(codec=configs(), data=st.data(), ctx=hop_contexts(), out_ctx=hop_contexts())
def test_hypothesis(
    codec: DynamiqCodec, data: st.DataObject, ctx: HopContext, out_ctx: HopContext
) -> None:
    n = data.draw(st.integers(0, 3 * codec.span), label="n")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    spread = data.draw(st.integers(0, 60), label="spread")
    if data.draw(st.booleans(), label="edge values"):
        x = edge_values(n, data.draw(st.sampled_from([7, 16, 64, 300]), label="block"), seed)
    else:
        x = random_values(n, seed, spread)
    x = x.to(data.draw(st.sampled_from(DTYPES), label="dtype"))
    local = random_values(n, seed + 1, spread)
    if n and data.draw(st.booleans(), label="specials"):
        local[seed % n] = data.draw(st.sampled_from([float("nan"), float("inf"), 3.39e38]))
    local = local.to(data.draw(st.sampled_from(DTYPES), label="local dtype"))
    check_all(codec, x, local, (ctx, out_ctx), "hypothesis")


# -- the dispatcher and bad input ---------------------------------------------------------------


def test_auto_uses_the_native_kernel_for_large_cpu_inputs() -> None:
    codec = dq(**SMALL)
    n = cpu_native.MIN_NUMEL
    x, local = random_values(n, 0), random_values(n, 1)
    before = K.launch_counts().get("cpu_dynamiq_encode", 0)
    payload = codec.encode(x)
    assert K.last_backend() == "cpu"
    assert K.launch_counts()["cpu_dynamiq_encode"] == before + 1
    assert_bytes_equal(payload, codec._encode(x, HopContext()), "auto encode")
    out = torch.empty(n)
    assert codec.decode(payload, n, out=out) is out and K.last_backend() == "cpu"
    assert_values_equal(out, codec._decode(payload, n, HopContext()), "auto decode")
    ctx, out_ctx = HopContext(hop=0, num_hops=3), HopContext(hop=1, num_hops=3)
    payload = codec.encode(x, ctx)
    want = codec._reduce(payload, local, ctx, out_ctx)
    assert_bytes_equal(codec.reduce(payload, local, ctx, out_ctx), want, "auto reduce")
    assert K.last_backend() == "cpu"
    codec.encode(x[: n - 1])  # below MIN_NUMEL: the reference
    assert K.last_backend() == "reference"


@pytest.mark.parametrize("how", ["env", "function", "compile"])
def test_auto_native_can_be_switched_off(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``DYNAMIQ_CPU_KERNELS=0``, ``set_cpu_kernels(False)``, or the explicit torch.compile
    opt-in (DynamiQ compiles its own block functions: a stand-in compiler here) keep "auto"
    on the reference; forcing the native kernel still works."""
    compiled: list[str] = []
    if how == "env":
        monkeypatch.setenv("DYNAMIQ_CPU_KERNELS", "0")
        K.set_cpu_kernels(None)  # read the environment now (it is read once otherwise)
    elif how == "function":
        K.set_cpu_kernels(False)
    else:

        def fake_compile(fn: Any, dynamic: bool | None = None) -> Any:
            compiled.append(fn.__name__)
            return fn

        monkeypatch.setattr(torch, "compile", fake_compile)
        K.set_cpu_compile(True)
    codec = dq(span=4096, super_group=1024)
    x = random_values(max(cpu_native.MIN_NUMEL, _compiled.MIN_NUMEL), 0)
    want = K.encode(codec, x, backend="reference")
    assert_bytes_equal(codec.encode(x), want, how)
    assert K.last_backend() == "reference"
    assert compiled == (["_encode_rows"] if how == "compile" else [])
    assert_bytes_equal(K.encode(codec, x, backend="cpu"), want, f"{how}, forced")
    assert K.last_backend() == "cpu"


def test_bad_input_errors() -> None:
    codec = dq(**SMALL)
    meta = torch.empty(64, device="meta")
    with pytest.raises(ValueError, match="backend='cpu' runs CPU tensors"):
        K.encode(codec, meta, backend="cpu")
    with pytest.raises(ValueError, match="native CPU kernels take CPU tensors"):
        cpu_native.encode(codec, meta, HopContext())
    with pytest.raises(TypeError, match="dtype float32, bfloat16 or float16"):
        K.encode(codec, torch.zeros(64, dtype=torch.int32), backend="cpu")
    with pytest.raises(TypeError, match="take x as float32, bfloat16 or float16"):
        cpu_native.encode(codec, torch.zeros(64, dtype=torch.float64), HopContext())
    payload = codec.encode(torch.ones(100))
    with pytest.raises(TypeError, match="take local as float32"):
        cpu_native.reduce(codec, payload, torch.ones(100, dtype=torch.int64), *CTX_PAIRS[0])
    with pytest.raises(ValueError, match="local must be a contiguous 1-D tensor"):
        cpu_native.reduce(codec, payload, torch.ones(200)[::2], *CTX_PAIRS[0])
    with pytest.raises(ValueError, match=r"contiguous 1-D tensor of \d+ bytes"):
        cpu_native.decode(codec, payload[:-1], 100, HopContext())
    with pytest.raises(TypeError, match="payload must have dtype torch.uint8"):
        cpu_native.decode(codec, payload.float(), 100, HopContext())
    with pytest.raises(ValueError, match="payload has"):  # the dispatcher's own check
        K.reduce(codec, payload, torch.ones(101), backend="cpu")

    class MyDynamiq(DynamiqCodec):  # a subclass may change what its reference computes
        codec_id: ClassVar[str] = "test_my_dynamiq"

    with pytest.raises(NotImplementedError, match="no native CPU kernel for encode"):
        K.encode(MyDynamiq(), torch.zeros(cpu_native.MIN_NUMEL), backend="cpu")


# -- the pooled codec's prologue: group absmax -------------------------------------------------


def _finite_absmax_fp64(x: torch.Tensor, group: int) -> torch.Tensor:
    a = x.double().abs()
    return torch.where(torch.isfinite(a), a, 0.0).view(-1, group).amax(dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [16, 3, 256])
def test_group_absmax_finite_values_only(dtype: torch.dtype, group: int) -> None:
    """``cpu_native.group_absmax`` against fp64 maxima of the finite magnitudes: NaN, ±Inf,
    -0, subnormals, each format's largest finite value, groups of zeros and of specials only."""
    n = group * 900
    x = random_values(n, 5).to(dtype)
    info = torch.finfo(dtype)
    specials = torch.tensor(
        [math.nan, math.inf, -math.inf, -0.0, info.tiny / 4, -info.max, info.max, -math.nan]
    ).to(dtype)
    g = torch.Generator().manual_seed(9)
    at = torch.randint(0, n, (400,), generator=g)
    x[at] = specials[torch.arange(400) % specials.numel()]
    x[:group] = 0.0  # a group of zeros
    x[group : 2 * group] = specials[:3].repeat(group)[:group]  # a group of NaN/±Inf only
    got = cpu_native.group_absmax(x, group)
    assert got.dtype == torch.float32
    want = _finite_absmax_fp64(x, group)
    assert torch.equal(got.double(), want)
    assert float(got[0]) == 0.0 and float(got[1]) == 0.0


def test_group_absmax_bad_input() -> None:
    with pytest.raises(ValueError, match="not whole groups of 16"):
        cpu_native.group_absmax(torch.ones(40), 16)
    with pytest.raises(TypeError, match="take x as float32"):
        cpu_native.group_absmax(torch.ones(32, dtype=torch.float64), 16)


@pytest.mark.parametrize(("cut", "kernel"), [(70000, "pool_levels"), (70001, "group_absmax")])
def test_prologue_statistics_native_or_not(
    monkeypatch: pytest.MonkeyPatch, cut: int, kernel: str
) -> None:
    """The prologue's statistics of a large buffer (the whole demand from the native kernel
    when the regions start on whole groups, else its group absmax) equal those with the
    native kernels switched off (PyTorch), NaN and ±Inf included."""
    from dynamiq.codecs import _dynamiq_pool as pool

    codec = dq()
    n = 3 * (1 << 16) + 77
    x = random_values(n, 8) * torch.exp2(torch.randint(-20, 20, (n,)).float())
    x[[5, 70000, n - 1]] = torch.tensor([math.nan, math.inf, -math.inf])
    regions = pool.regions_of(codec, n, [(0, cut), (cut, n)])
    calls: list[int] = []
    real = getattr(cpu_native, kernel)
    monkeypatch.setattr(cpu_native, kernel, lambda *a: calls.append(1) or real(*a))
    native = pool.span_statistics(codec, x, 1, regions)
    ran = len(calls)
    assert ran  # the native kernel ran
    cpu_native.set_cpu_kernels(False)
    try:
        plain = pool.span_statistics(codec, x, 1, regions)
    finally:
        cpu_native.set_cpu_kernels(None)
    assert len(calls) == ran  # and now it did not
    assert torch.equal(native, plain)


def test_the_argument_template_holds_the_tables_it_points_into() -> None:
    """The native template points into DynamiQ's tables; it holds them itself. Where another
    thread's concurrent first call left a second, equal dict in the cache (``lru_cache`` does
    not lock its computation), the tensors it pointed into had no owner: a collective of 4
    threads failed with a garbage ``Q`` refused by the kernel. Here the cache is dropped
    between building the template and using it, the freed memory overwritten."""
    import gc

    codec = DynamiqCodec(bits=4.3, scale_steps=3)
    cpu_native._dynamiq_tables.cache_clear()
    native = cpu_native._Native(codec, "dynamiq")
    cpu_native._dynamiq_tables.cache_clear()
    gc.collect()
    junk = [torch.full((1 << 14,), -7.0e30) for _ in range(64)]  # reuse what was freed
    x = torch.randn(8192, generator=torch.Generator().manual_seed(3))
    ctx = HopContext()
    want = K.encode(codec, x, ctx, backend="reference")
    assert_bytes_equal(native.encode(codec, x, ctx), want, "native encode")
    del junk
