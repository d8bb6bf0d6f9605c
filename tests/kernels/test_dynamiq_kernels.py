"""The DynamiQ codec's Triton kernels against its PyTorch reference, bit for bit (docs/design.md,
"House style", item 7).

Every test computes the reference (``backend="reference"``) beside the kernel
(``backend="triton"``, forced) on the same device and compares payload bytes, or the int32
views of fp32 values (NaN by position: which NaN an fp32 add returns is the hardware's
choice), with no tolerance, and checks that the kernel launched. Spans are small (1024
values) so that Triton's interpreter runs every configuration in seconds; two tests run the
default configuration (spans of 256, pooled over the bucket) on real gradients.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` is set before
Triton is imported and while these tests run: ``kernel_harness.py``); with CUDA the same
tests run natively (``-m gpu`` selects them).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dynamiq_inputs import check_all as _check_all
from dynamiq_inputs import edge_values, random_values
from kernel_harness import DEVICE, assert_bytes_equal, assert_values_equal, interpreted_imports
from kernel_harness import both as _both

with interpreted_imports():
    import dynamiq.kernels as K
    from dynamiq.kernels import dynamiq as kdyn

from dynamiq.codecs import HopContext, get_codec
from dynamiq.codecs.dynamiq_codec import DynamiqCodec
from dynamiq.data import load_slice

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]


SMALL = {"id": "dynamiq", "span": 1024, "super_group": 256, "group": 16}
#: small spans with every knob: levels, rounding, hop_slope, pooled, scale_steps, geometry
CONFIGS: dict[str, dict[str, Any]] = {
    "small": SMALL,
    "uniform": {**SMALL, "levels": "uniform"},
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
    "group3": {"id": "dynamiq", "span": 960, "super_group": 96, "group": 3, "bits": 2.2},
    "group2_sg2": {"id": "dynamiq", "span": 512, "super_group": 2, "group": 2, "bits": 1.3},
    "group256": {"id": "dynamiq", "span": 1024, "super_group": 512, "group": 256, "bits": 7.9},
    "bits_half": {**SMALL, "bits": 0.5, "hop_slope": 4.0},
    "bits8": {**SMALL, "bits": 8.0},
}
#: spans of one super-group (the default geometry): ``dynamiq_tiles``' kernels, many spans a
#: program, with every knob and the geometries they take (8 to 64 groups of 8 to 32)
TILES: dict[str, dict[str, Any]] = {
    "tiles": {"id": "dynamiq"},
    "tiles_uniform_stochastic": {"id": "dynamiq", "levels": "uniform", "rounding": "stochastic"},
    "tiles_correlated_slope": {"id": "dynamiq", "rounding": "correlated", "hop_slope": 1.5},
    "tiles_unpooled": {"id": "dynamiq", "pooled": False, "bits": 5.3},
    "tiles_steps1": {"id": "dynamiq", "scale_steps": 1, "bits": 2.9},
    "tiles_steps3": {"id": "dynamiq", "scale_steps": 3, "rounding": "stochastic"},
    "tiles_steps4": {"id": "dynamiq", "scale_steps": 4, "bits": 6.3},
    "tiles_group8": {"id": "dynamiq", "group": 8, "bits": 4.0},
    "tiles_group32": {"id": "dynamiq", "span": 512, "super_group": 512, "group": 32},
    "tiles_span1024": {"id": "dynamiq", "span": 1024, "super_group": 1024, "bits": 3.0},
    "tiles_bits_half": {"id": "dynamiq", "bits": 0.5, "hop_slope": 4.0},
    "tiles_bits8": {"id": "dynamiq", "bits": 8.0},
}
CONFIGS.update(TILES)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (ctx the payload was encoded with, out_ctx of the reduce)
CTX_PAIRS = (
    (HopContext(), HopContext()),
    (
        HopContext(seed=7, step=3, hop=1, num_hops=4, rank=2, offset=4096),
        HopContext(seed=7, step=3, hop=2, num_hops=4, rank=5, offset=4096),
    ),
    (
        HopContext(seed=2**40 + 5, step=2**33, hop=0, num_hops=3, rank=1, offset=2**32 - 17),
        HopContext(seed=2**40 + 5, step=2**33, hop=2, num_hops=3, rank=2, offset=2**32 - 17),
    ),
)


# -- comparisons ------------------------------------------------------------------------------


def kernels_of(codec: DynamiqCodec) -> dict[Any, str]:
    """The kernel each operation must launch: many spans a program (spans of one
    super-group), or one."""
    enc, dec = ("_dqt_encode_kernel", "_dqt_decode_kernel")
    if not kdyn.dynamiq_tiles.eligible(codec):
        enc, dec = ("_dq_encode_kernel", "_dq_decode_kernel")
    return {K.encode: enc, K.reduce: enc, K.decode: dec}


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn`` on the reference and on Triton (forced), with a proof that its kernel ran."""
    return _both(fn, *args, kernel=kernels_of(args[0])[fn])


def check_all(
    codec: DynamiqCodec, x: torch.Tensor, local: torch.Tensor, pair: Any, what: str
) -> None:
    """Encode, decode and reduce on the reference and on Triton: all bit-exact."""
    _check_all(codec, x, local, pair, what, fast="triton", kernels=kernels_of(codec))


# -- every configuration ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_bit_exact(name: str) -> None:
    """Random and edge-case inputs of 2.4 spans (a short last span and a short last group),
    every input dtype across the configurations, and hop contexts that move ``bits_k``."""
    codec = get_codec(CONFIGS[name])
    k = list(CONFIGS).index(name)
    dtype = DTYPES[k % 3]
    pair = CTX_PAIRS[k % 3]
    n = 2 * codec.span + codec.span * 2 // 5 + 1
    x = random_values(n, k).to(dtype).to(DEVICE)
    edge = edge_values(n, codec.super_group if codec.super_group >= 16 else 64, k)
    edge = edge.to(dtype).to(DEVICE)
    check_all(codec, x, edge, pair, f"{name} {dtype} random")
    check_all(codec, edge, x, CTX_PAIRS[(k + 1) % 3], f"{name} {dtype} edge")


@pytest.mark.parametrize("n", [1, 7, 300, 1024, 1025])
def test_remainders(n: int) -> None:
    """Block remainders: 1 value, a short group, a short super-group, one span exactly, one
    more than a span."""
    codec = get_codec(CONFIGS["correlated_slope"])
    dtype = DTYPES[n % 3]
    x = random_values(n, n).to(dtype).to(DEVICE)
    local = edge_values(n, 64, n).to(DTYPES[(n + 1) % 3]).to(DEVICE)
    pair = CTX_PAIRS[1]
    if n == 300:  # 32-bit hop counts (the correlated dither's strata)
        pair = (
            HopContext(seed=3, hop=2**32 - 3, num_hops=2**32 - 1, offset=2**40),
            HopContext(seed=3, hop=2**32 - 2, num_hops=2**32 - 1, offset=2**40),
        )
    check_all(codec, x, local, pair, f"n={n} {dtype}")


def test_empty_inputs_need_no_launch() -> None:
    codec = get_codec(SMALL)
    before = K.launch_counts()
    payload = K.encode(codec, torch.zeros(0, device=DEVICE), backend="triton")
    assert payload.numel() == 0
    assert K.decode(codec, payload, 0, backend="triton").numel() == 0
    assert K.reduce(codec, payload, torch.zeros(0, device=DEVICE), backend="triton").numel() == 0
    assert K.launch_counts() == before


@pytest.mark.parametrize("name", ["small", "correlated_slope", "tiles", "tiles_steps3"])
def test_arbitrary_payloads(name: str) -> None:
    """Random payload bytes (negative, NaN, Inf and subnormal scales, any group code, any
    body) decode and reduce like the reference."""
    codec = get_codec(CONFIGS[name])
    g = torch.Generator().manual_seed(11)
    ctx, out_ctx = CTX_PAIRS[1]
    for n in (5, 2100):
        payload = torch.randint(0, 256, (codec.encoded_nbytes(n, ctx),), generator=g)
        payload = payload.to(torch.uint8).to(DEVICE)
        got, want = both(K.decode, codec, payload, n, ctx)
        assert_values_equal(got, want, f"decode {name} n={n}")
        local = random_values(n, n).to(DEVICE)
        got, want = both(K.reduce, codec, payload, local, ctx, out_ctx)
        assert_bytes_equal(got, want, f"reduce {name} n={n}")


@pytest.mark.parametrize(
    "config",
    [SMALL, {**SMALL, "super_group": 1024, "rounding": "stochastic"}, CONFIGS["group3"]],
    ids=["tiles_of_one_row", "chunked_super_groups", "group3_two_rows"],
)
def test_tile_boundaries(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 256 values: many tiles per span (the packer carries a byte across tiles),
    super-groups cut into chunks (running absmax), tiles of several super-groups."""
    monkeypatch.setattr(kdyn, "tile_elems", lambda device: 256)
    codec = get_codec(config)
    meta = kdyn._meta(codec, 1300, torch.device(DEVICE))
    assert meta["BSG"] * meta["CG"] * meta["GP"] <= 256 < codec.span
    x = random_values(1300, 3).to(DEVICE)
    local = edge_values(1300, 64, 3).to(torch.bfloat16).to(DEVICE)
    check_all(codec, x, local, CTX_PAIRS[2], f"{config}")
    check_all(codec, local, x, CTX_PAIRS[1], f"{config} edge")


def test_which_configurations_take_the_many_spans_kernels() -> None:
    eligible = kdyn.dynamiq_tiles.eligible
    assert eligible(get_codec("dynamiq")) and all(eligible(get_codec(c)) for c in TILES.values())
    for other in (
        SMALL,  # four super-groups a span
        {"id": "dynamiq", "pooling": "span", "span": 65536, "super_group": 1024},
        {"id": "dynamiq", "span": 4096, "super_group": 4096, "group": 64},  # too long a span
        {"id": "dynamiq", "span": 256, "super_group": 256, "group": 4},  # groups under 8
        {"id": "dynamiq", "span": 960, "super_group": 960, "group": 16},  # 60 groups
    ):
        assert not eligible(get_codec(other)), other


@pytest.mark.parametrize(
    ("name", "fifths"),
    [("tiles", 37), ("tiles_correlated_slope", 37), ("tiles_group8", 37), ("tiles", 40)],
)
def test_spans_across_programs(name: str, fifths: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two spans a program: 7.4 spans take four programs, the last with a short span and a
    span past the end (nothing written, nothing read); 8 spans exactly fill four."""
    monkeypatch.setattr(kdyn.dynamiq_tiles, "tile_elems", lambda device: 512)
    codec = get_codec(CONFIGS[name])
    assert kdyn.dynamiq_tiles._meta(codec, torch.device(DEVICE))["P"] == 512 // codec.span
    n = codec.span * fifths // 5
    x = random_values(n, 4).to(DEVICE)
    local = edge_values(n, 64, 4).to(torch.float16).to(DEVICE)
    check_all(codec, x, local, CTX_PAIRS[1], name)
    check_all(codec, local, x, CTX_PAIRS[2], f"{name} edge")


@pytest.mark.parametrize("name", ["tiles", "tiles_bits_half"])
def test_tiles_nonfinite_zeros_and_empty_budgets(name: str) -> None:
    """Spans of one super-group: a span holding NaN or ±Inf decodes to NaN and no other
    does; an all-zero span has a zero scale, codes 15 and a zero body; a hop whose
    ``bits_k`` is 0 has no body."""
    codec = get_codec(CONFIGS[name])
    n = 4 * codec.span
    x = random_values(n, 5)
    x[10], x[300], x[600] = float("nan"), float("inf"), -float("inf")
    x[3 * codec.span :] = 0.0
    for ctx in (HopContext(), HopContext(hop=0, num_hops=3)):
        got, want = both(K.encode, codec, x.to(DEVICE), ctx)
        assert_bytes_equal(got, want, f"encode {ctx}")
        got_v, want_v = both(K.decode, codec, got, n, ctx)
        assert_values_equal(got_v, want_v, f"decode {ctx}")
        assert bool(got_v[:768].isnan().all()) and not bool(got_v[768:].isnan().any())
        assert bool((got_v[3 * codec.span :] == 0).all())
        got_r, want_r = both(K.reduce, codec, got, x.to(DEVICE), ctx, HopContext(hop=2, num_hops=3))
        assert_bytes_equal(got_r, want_r, f"reduce {ctx}")
    assert (codec._budget(codec.span, HopContext(hop=0, num_hops=3)) == 0) == (name != "tiles")


# -- real gradients and the default configuration ---------------------------------------------


def test_real_gradients_small_spans() -> None:
    """Real partial sums: worker 0's gradient encoded, then worker 1's added (ring hop)."""
    grads = load_slice()
    codec = get_codec({**SMALL, "rounding": "correlated", "hop_slope": 1.0})
    x = grads[0, 8192 - 1500 : 8192 + 1500].contiguous().to(DEVICE)
    local = grads[1, 8192 - 1500 : 8192 + 1500].contiguous().to(torch.bfloat16).to(DEVICE)
    check_all(codec, x, local, CTX_PAIRS[1], "real gradients")


@pytest.mark.parametrize(
    ("dtype", "spans"),
    # 40 spans and bf16 (~25 s each in the interpreter) with -m slow: the other kernel tests
    # cover bf16 inputs; 12 spans keep the case (many spans of real values, a short last
    # one) at a third of the time
    [
        (torch.float32, 12),
        pytest.param(torch.float32, 40, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 40, marks=pytest.mark.slow),
    ],
    ids=["fp32-12", "fp32-40", "bf16-40"],
)
def test_default_config_real_gradients(dtype: torch.dtype, spans: int) -> None:
    """The default codec (spans of 256) on ``spans`` + 0.4 spans of real gradients."""
    grads = load_slice()
    codec = get_codec("dynamiq")
    n = spans * codec.span + 100
    x = grads[:3].reshape(-1)[:n].contiguous().to(DEVICE)
    local = grads[3:6].reshape(-1)[:n].contiguous().to(dtype).to(DEVICE)
    ctx = HopContext(seed=1, step=9, hop=0, num_hops=7, rank=3)
    check_all(codec, x, local, (ctx, HopContext(seed=1, step=9, hop=1, num_hops=7, rank=4)), "")


# -- the NaN/Inf policy, zeros, budgets -------------------------------------------------------


def test_nonfinite_super_groups_decode_to_nan() -> None:
    """A super-group holding NaN gets a NaN scale, one holding ±Inf the scale Inf; both
    decode to NaN, the other super-groups do not. A finite value above ``max_input_abs``
    raises on both backends."""
    codec = get_codec(SMALL)
    x = random_values(1024, 5)
    x[600] = 3.39e38  # finite, but above bf16's largest (3.3895e38): its scale would be Inf
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="exceeds max_input_abs"):
            K.encode(codec, x.to(DEVICE), HopContext(), backend=backend)
    x[10] = float("nan")
    x[300] = float("inf")
    x[600] = -float("inf")
    got, want = both(K.encode, codec, x.to(DEVICE))
    assert_bytes_equal(got, want, "encode")
    scales = [s & 0xFFFF for s in got.cpu()[:8].view(torch.int16).tolist()]
    assert scales[0] & 0x7FFF > 0x7F80 and scales[1:3] == [0x7F80, 0x7F80], scales
    assert all(0 < s < 0x7F80 for s in scales[3:])
    got_v, want_v = both(K.decode, codec, got, 1024, HopContext())
    assert_values_equal(got_v, want_v, "decode")
    assert bool(got_v[:768].isnan().all()) and bool(got_v[768:].isfinite().all())


def test_zeros_and_empty_budget() -> None:
    """All zeros: zero scales, codes 15, an all-zero body, exact zeros back. A hop whose
    ``bits_k`` clamps to 0 has no body at all."""
    codec = get_codec({**SMALL, "bits": 0.5, "hop_slope": 4.0})
    ctx = HopContext(hop=0, num_hops=3)
    assert codec._budget(1024, ctx) == 0
    x = torch.zeros(1024, device=DEVICE)
    got, want = both(K.encode, codec, x, HopContext())
    assert_bytes_equal(got, want, "zeros")
    header = 2 * 4 + 64 // 2  # 4 scales, 64 codes
    assert not bool(got[:8].any()) and bool((got[8:header] == 0xFF).all())
    assert not bool(got[header:].any())
    assert bool((K.decode(codec, got, 1024, backend="triton") == 0).all())
    y = random_values(1024, 1).to(DEVICE)
    got, want = both(K.encode, codec, y, ctx)
    assert_bytes_equal(got, want, "no body")
    assert got.numel() == header
    got_v, want_v = both(K.decode, codec, got, 1024, ctx)
    assert_values_equal(got_v, want_v, "decode without body")
    got_r, want_r = both(K.reduce, codec, got, y, ctx, HopContext(hop=2, num_hops=3))
    assert_bytes_equal(got_r, want_r, "reduce into a body")


# -- the dispatcher ---------------------------------------------------------------------------


def test_dispatch_runs_the_dynamiq_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = get_codec(SMALL)
    assert K.has_kernels(codec, "encode") and K.has_kernels(codec, "reduce")
    x = random_values(700, 2).to(DEVICE)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    K._settings.refresh()  # (read once otherwise)
    before = K.launch_counts().get("_dq_encode_kernel", 0)
    payload = codec.encode(x)  # "auto": the kernel on CUDA, and on the CPU when asked
    assert K.last_backend() == "triton"
    assert K.launch_counts()["_dq_encode_kernel"] == before + 1
    assert_bytes_equal(payload, K.encode(codec, x, backend="reference"), "auto encode")
    monkeypatch.delenv("TRITON_INTERPRET")
    K._settings.refresh()
    if DEVICE == "cpu":
        codec.encode(x)
        assert K.last_backend() == "reference"  # the CPU without TRITON_INTERPRET


@pytest.mark.parametrize("coalesced", [False, True])
def test_tiles_bit_exact_with_either_value_layout(
    coalesced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values read (``x``) and written (decode) in the compute layout or coalesced
    (``dynamiq_tiles.X_COALESCED``, which the GPU check times both ways): the same bytes and
    values, a short last span and group included."""
    monkeypatch.setattr(kdyn.dynamiq_tiles, "X_COALESCED", coalesced)
    codec = get_codec(TILES["tiles"])
    n = 3 * codec.span + 37
    x = random_values(n, 11).to(DEVICE)
    local = random_values(n, 12).to(torch.bfloat16).to(DEVICE)
    check_all(codec, x, local, CTX_PAIRS[1], f"X_COALESCED={coalesced}")
