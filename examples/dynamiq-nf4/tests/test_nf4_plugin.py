"""The NF4 plugin: found through its entry point, conforms to dynamiq's codec contract, its
levels and wire bytes match independent computations, and it runs in dynamiq's engine."""

from __future__ import annotations

import doctest
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from dynamiq_nf4 import NF4_LEVELS, NF4Codec
from hypothesis import given
from hypothesis import strategies as st

from dynamiq.codecs import HopContext, get_codec, list_codecs
from dynamiq.collectives import AllReduceStats, allreduce, simulate_allreduce
from dynamiq.data import load_slice
from dynamiq.testing import check_golden, finite_tensors, run_conformance
from dynamiq.testing.distributed import run_gloo

FIXTURES = Path(__file__).parent / "fixtures"
#: frozen wire formats: fixture name -> config
GOLDEN: dict[str, dict[str, Any]] = {
    "nf4": {"id": "nf4"},
    "nf4_fp32_block7": {"id": "nf4", "scale_format": "fp32", "block_size": 7},
}


def test_docstring_examples() -> None:
    import dynamiq_nf4.codec

    result = doctest.testmod(dynamiq_nf4.codec, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0


# -- the entry point -------------------------------------------------------------------------

_LOOKUP = """
import json, sys
from importlib import metadata
eps = [ep for ep in metadata.entry_points(group="dynamiq.codecs") if ep.name == "nf4"]
from dynamiq.codecs import get_codec, list_codecs
before = "dynamiq_nf4" in sys.modules
codec = get_codec("nf4")
print(json.dumps({
    "entry_points": [[ep.value, ep.dist.name if ep.dist else None] for ep in eps],
    "imported_before_lookup": before,
    "imported_after_lookup": "dynamiq_nf4" in sys.modules,
    "class": type(codec).__module__ + "." + type(codec).__qualname__,
    "listed": "nf4" in list_codecs(),
    "config": codec.get_config(),
}))
"""


def test_found_through_the_entry_point_in_a_fresh_interpreter() -> None:
    """``get_codec("nf4")`` in a new process, with nothing imported by hand, loads the plugin
    from the installed distribution's entry point."""
    out = subprocess.run(
        [sys.executable, "-c", _LOOKUP], capture_output=True, text=True, check=True, timeout=120
    )
    got = json.loads(out.stdout)
    assert got["entry_points"] == [["dynamiq_nf4:NF4Codec", "dynamiq-nf4"]]
    assert got["imported_before_lookup"] is False
    assert got["imported_after_lookup"] is True
    assert got["class"] == "dynamiq_nf4.codec.NF4Codec"
    assert got["listed"] is True
    assert got["config"] == {"id": "nf4", "block_size": 64, "scale_format": "bf16"}


def test_registry_and_cli_see_it() -> None:
    from dynamiq.bench.cli import codec_table

    assert type(get_codec("nf4")) is NF4Codec
    assert "nf4" in list_codecs()
    assert get_codec({"id": "nf4", "scale_format": "fp32"}) == NF4Codec(scale_format="fp32")
    row = next(r for r in codec_table() if r["id"] == "nf4")
    assert row["bits/value"] == 4.25 and row["unbiased"] is False


# -- the conformance kit ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GOLDEN))
def test_conformance_kit(name: str) -> None:
    codec = get_codec(GOLDEN[name])
    run_conformance(codec)
    check_golden(codec, FIXTURES, name)


def test_every_fixture_is_checked() -> None:
    assert {p.name for p in FIXTURES.iterdir()} == set(GOLDEN)


@pytest.mark.parametrize(
    "config,exc,words",
    [
        ({"block_size": 1}, ValueError, "block_size must be in 2..1048576 (got 1)"),
        ({"block_size": 64.0}, TypeError, "block_size must be an int (got float 64.0)"),
        ({"block_size": True}, TypeError, "block_size must be an int"),
        ({"scale_format": "fp16"}, ValueError, "scale_format must be one of 'bf16', 'fp32'"),
        ({"bits": 4}, ValueError, "unknown config key(s) 'bits'"),
    ],
)
def test_bad_config_is_a_clear_error(config: dict, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc) as info:
        get_codec({"id": "nf4", **config})
    assert words in str(info.value)


def test_too_large_for_bf16_scales() -> None:
    x = torch.tensor([3.39e38, 1.0])  # above the largest bf16 value, 3.3895e38
    with pytest.raises(ValueError, match=r"max_input_abs=3\.38953.*scale_format='fp32'"):
        NF4Codec().encode(x)
    wide = NF4Codec(scale_format="fp32")
    y = wide.decode(wide.encode(x), 2)
    assert bool(((y.double() - x.double()).abs() <= wide.error_bound.max_abs_error(x)).all())


def test_nonfinite_blocks_get_the_canonical_nan_scale() -> None:
    codec = NF4Codec(block_size=4)
    x = torch.tensor([1.0, math.nan, 2.0, 3.0, -4.0, 0.0, 4.0, -4.0, -math.inf, 0.0])
    payload = codec.encode(x)
    scales = payload[:6].view(torch.int16).tolist()
    assert scales[0] == 0x7FC0 and scales[2] == 0x7FC0 and scales[1] == 0x4080  # 4.0 in bf16
    y = codec.decode(payload, 10)
    assert bool(y[:4].isnan().all()) and bool(y[8:].isnan().all())
    assert y[4:8].tolist() == [-4.0, 0.0, 4.0, -4.0]  # exact: levels ±1, 0 and the scale 4


# -- levels, codes and wire bytes against independent computations ----------------------------


def _phi_inv(p: float) -> float:
    """The standard normal quantile by bisection on ``Φ(x) = erfc(-x/√2)/2`` (independent of
    ``statistics.NormalDist``)."""
    lo, hi = -12.0, 12.0
    while True:
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            return mid
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid


def _independent_levels() -> list[float]:
    """QLoRA's construction: 8 positive quantiles between δ and 1/2, 7 negative, and 0."""
    delta = (1 - 1 / (2 * 15) + 1 - 1 / (2 * 16)) / 2
    pos = [_phi_inv(p) for p in np.linspace(delta, 0.5, 9)[:-1]]
    neg = [-_phi_inv(p) for p in np.linspace(delta, 0.5, 8)[:-1]]
    return sorted(v / pos[0] for v in [*pos, 0.0, *neg])


#: the NF4 table as published with QLoRA (bitsandbytes' ``create_normal_map``: scipy's
#: quantiles, an offset of 0.9677083 and fp32 rounding): a cross-check, not the source
QLORA_PUBLISHED = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def test_levels_match_an_independent_computation() -> None:
    ours = np.array(NF4_LEVELS, dtype=np.float64)
    indep = np.array(_independent_levels(), dtype=np.float64)
    assert np.all(np.diff(ours) > 0) and len(ours) == 16
    assert (ours[0], ours[7], ours[15]) == (-1.0, 0.0, 1.0)
    assert np.array_equal(ours.astype(np.float32), ours)  # fp32 values
    assert np.array_equal(indep.astype(np.float32).astype(np.float64), ours)
    # QLoRA's published table differs only by its rounded offset and fp32 arithmetic
    assert np.abs(ours - np.array(QLORA_PUBLISHED)).max() < 3e-7


def test_every_code_in_both_nibbles_decodes_to_its_level() -> None:
    """Exhaustive: the 256 byte values hold every (low, high) code pair."""
    levels = np.array(NF4_LEVELS, dtype=np.float32)
    for fmt, scale_bytes in (("bf16", b"\x00\x3e"), ("fp32", b"\x00\x00\x00\x3e")):  # 0.125
        codec = NF4Codec(block_size=512, scale_format=fmt)
        for numel in (512, 511):
            payload = torch.frombuffer(
                bytearray(scale_bytes + bytes(range(256))), dtype=torch.uint8
            )
            y = codec.decode(payload[: codec.encoded_nbytes(numel)], numel).numpy()
            byte = np.arange(256)
            want = np.stack([levels[byte & 0xF], levels[byte >> 4]], axis=1).reshape(-1)
            assert np.array_equal(y, (want * np.float32(0.125))[:numel]), (fmt, numel)


def _oracle(x: np.ndarray, block_size: int, scale_format: str) -> tuple[bytes, np.ndarray]:
    """NF4 payload and decoded values of finite fp32 ``x`` from the documented rule, in NumPy:
    scale = the smallest bf16 (by its bit pattern) or the fp32 absmax; code = argmin of the
    fp64 distance to the levels (ties to the lower level); nibbles low first."""
    levels = np.array(NF4_LEVELS, dtype=np.float32)
    scales, codes, decoded = bytearray(), [], []
    for start in range(0, x.size, block_size):
        blk = x[start : start + block_size]
        amax = np.float32(np.abs(blk).max())
        if scale_format == "bf16":
            bits = int(amax.view(np.uint32))
            hi = (bits >> 16) + (1 if bits & 0xFFFF else 0)
            scales += hi.to_bytes(2, "little")
            s = np.array([hi << 16], dtype=np.uint32).view(np.float32)[0]
            assert float(np.array([s], np.float32).astype(ml_dtypes.bfloat16)[0]) == float(s)
        else:
            s = amax
            scales += s.astype("<f4").tobytes()
        with np.errstate(all="ignore"):
            q = blk / s if s > 0 else np.zeros_like(blk)
        dist = np.abs(q.astype(np.float64)[:, None] - levels.astype(np.float64)[None, :])
        c = dist.argmin(axis=1)  # the first minimum: the lower level on a tie
        codes += c.tolist()
        decoded += (levels[c] * s).tolist()
    padded = codes + [0] * (len(codes) % 2)
    stream = bytes(lo | hi << 4 for lo, hi in zip(padded[0::2], padded[1::2], strict=True))
    return bytes(scales) + stream, np.array(decoded, dtype=np.float32)


@given(
    x=st.one_of(
        finite_tensors(64, max_abs=float.fromhex("0x1.fep127")),
        finite_tensors(7, max_abs=float.fromhex("0x1.fep127")),
    ),
    fmt=st.sampled_from(["bf16", "fp32"]),
    block_size=st.sampled_from([64, 7, 2]),
)
def test_wire_bytes_match_an_independent_numpy_encoder(
    x: torch.Tensor, fmt: str, block_size: int
) -> None:
    codec = NF4Codec(block_size=block_size, scale_format=fmt)
    xf = x.float().numpy()
    want_bytes, want_values = _oracle(xf, block_size, fmt)
    payload = codec.encode(x)
    assert payload.numpy().tobytes() == want_bytes
    got = codec.decode(payload, x.numel()).numpy()
    assert np.array_equal(got.view(np.uint32), want_values.view(np.uint32))


def test_rounding_edge_cases() -> None:
    """With scale 1: a value on a midpoint takes the lower level, one fp32 step above it the
    upper one; the levels themselves, ±0 and the ends are exact."""
    levels = np.array(NF4_LEVELS, dtype=np.float64)
    cases: list[tuple[float, int]] = [
        (1.0, 15),  # the block's absmax: scale 1, level +1
        (-1.0, 0),  # level -1
        (0.0, 7),  # zero
        (-0.0, 7),  # negative zero: level 0
    ]
    cases += [(float(v), k) for k, v in enumerate(levels)]  # every level maps to its code
    exact_mids = 0
    for k in range(15):
        mid = (levels[k] + levels[k + 1]) / 2
        f = float(np.float32(mid))
        above = float(np.nextafter(np.float32(mid), np.float32(2)))
        below = float(np.nextafter(np.float32(mid), np.float32(-2)))
        if f == mid:
            exact_mids += 1
            cases.append((f, k))  # on the midpoint: the lower level
        else:
            cases.append((f, k if f < mid else k + 1))  # nearest, whichever side fp32 fell
        cases += [(above, k + 1), (below, k)]  # one fp32 step either side
    assert exact_mids >= 1  # the tie rule is exercised
    codec = NF4Codec(block_size=2)
    for value, code in cases:
        payload = codec.encode(torch.tensor([1.0, value]))
        got = int(payload[2]) >> 4  # element 1: the high nibble after the bf16 scale
        assert got == code, f"{value!r} -> code {got}, expected {code}"


def test_bound_is_certified_and_tight_on_real_gradients() -> None:
    """On real gradients the error stays within the bound, and the witness reaches it."""
    from dynamiq.testing import check_bound_tight

    grads = load_slice()
    codec = NF4Codec()
    for w in range(grads.shape[0]):
        x = grads[w].contiguous()
        err = (codec.decode(codec.encode(x), x.numel()).double() - x.double()).abs()
        assert bool((err <= codec.error_bound.max_abs_error(x)).all())
    assert check_bound_tight(codec) > 0.999


# -- in the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["ring", "butterfly"])
@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_allreduce_in_the_simulator(schedule: str, world: int) -> None:
    """Real gradients through dynamiq's engine: every rank bit-identical, within the bound the
    engine composes, 4.25 bits/value on the wire."""
    grads = load_slice()
    numel = 8 * 64 * 60  # divisible into 2..8 chunks of whole blocks
    xs = [grads[r, :numel].contiguous() for r in range(world)]
    res = simulate_allreduce(xs, "nf4", schedule, sub_chunk=1024)
    for out in res.outputs[1:]:
        assert torch.equal(out.view(torch.int32), res.outputs[0].view(torch.int32))
    assert res.bound is not None and bool(torch.isfinite(res.bound).all())
    err = (res.outputs[0].double() - res.exact).abs()
    assert bool((err <= res.bound).all())
    assert 0 < res.vnmse < 0.1
    if schedule == "ring" or world & (world - 1) == 0:
        assert res.bits_per_value() == 4.25
    # a partial last block and a length no schedule divides evenly
    odd = simulate_allreduce([x[:1001] for x in xs], "nf4", schedule)
    assert odd.bound is not None
    assert bool(((odd.outputs[0].double() - odd.exact).abs() <= odd.bound).all())


def _gloo_allreduce(rank: int, world: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = load_slice()[rank, :numel].clone()
    stats = allreduce(x, "nf4", "ring", return_bound=True)
    assert isinstance(stats, AllReduceStats) and stats.bound is not None
    return x, stats.bound


@pytest.mark.slow
@pytest.mark.distributed
def test_allreduce_over_gloo_matches_the_simulator() -> None:
    """Two real gloo processes, each finding the plugin through the entry point, give the
    simulator's result bit for bit (slow: two spawned processes; the simulator runs the same
    engine in the default suite)."""
    numel = 5000
    results = run_gloo(_gloo_allreduce, 2, numel)
    assert all(status == "ok" for status, _ in results), results
    sim = simulate_allreduce([load_slice()[r, :numel].contiguous() for r in range(2)], "nf4")
    for _, (out, bound) in results:
        assert torch.equal(out.view(torch.int32), sim.outputs[0].view(torch.int32))
        assert bool(((out.double() - sim.exact).abs() <= bound).all())


def test_hop_context_is_irrelevant() -> None:
    """Nearest rounding: the bytes do not depend on where a chunk is in the collective."""
    x = load_slice()[0, :1000].contiguous()
    codec = NF4Codec()
    ctx = HopContext(seed=3, step=9, hop=2, num_hops=5, rank=1, offset=4096, world_size=8)
    assert torch.equal(codec.encode(x), codec.encode(x, ctx))
