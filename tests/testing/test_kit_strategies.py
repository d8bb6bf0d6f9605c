"""The kit's strategies honour their parameters (size, shape, dtypes, ranks, fixed context
fields), and edge_tensors reaches what it aims at, judged by ml_dtypes casts
(dynamiq/testing/strategies.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dynamiq.codecs import HopContext, get_codec, list_codecs
from dynamiq.collectives.schedules import Schedule, validate
from dynamiq.testing import (
    codec_configs,
    edge_tensors,
    finite_tensors,
    hop_contexts,
    schedules,
    tensor_lists,
)

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(
    x=finite_tensors(size=17, dtypes=(torch.bfloat16,), max_abs=3.0),
    y=edge_tensors(8, size=(3, 9), dtypes=("float16",)),
    z=finite_tensors(shape=(2, 3, 4)),
)
def test_size_shape_and_dtype(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> None:
    assert x.shape == (17,) and x.dtype == torch.bfloat16
    assert float(x.float().abs().max()) <= 3.0
    assert 3 <= y.numel() <= 9 and y.dim() == 1 and y.dtype == torch.float16
    assert z.shape == (2, 3, 4)
    assert bool(torch.isfinite(x).all() and torch.isfinite(y).all() and torch.isfinite(z).all())


@FEW
@given(xs=tensor_lists(16, ranks=(2, 4), size=(1, 40)), ys=tensor_lists(ranks=3, shape=(5, 7)))
def test_tensor_lists(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    assert 2 <= len(xs) <= 4 and len({t.shape for t in xs}) == 1
    assert 1 <= xs[0].numel() <= 40 and all(t.dtype == torch.float32 for t in xs)
    assert len(ys) == 3 and all(t.shape == (5, 7) for t in ys)
    assert all(float(t.abs().max()) <= 2.0**100 for t in xs if t.numel())


@FEW
@given(data=st.data(), n=st.integers(1, 9))
def test_schedules_fit_the_world(data: st.DataObject, n: int) -> None:
    s = data.draw(schedules(n))
    assert isinstance(s, Schedule) and s.world_size == n
    validate(s)
    assert data.draw(schedules(n, names=["tree"])).name == "tree"


@FEW
@given(config=codec_configs(), named=codec_configs(["mxfp4", "nf4"], vary_int=False))
def test_codec_configs_build_codecs(config: dict, named: dict) -> None:
    codec = get_codec(config)
    assert codec.get_config() == config
    assert named in (get_codec("mxfp4").get_config(), get_codec("nf4").get_config())
    assert set(list_codecs()) >= {"mxfp4", "nf4"}


@FEW
@given(
    ctx=hop_contexts(seed=5, world_size=4, block_size=32, max_offset=4096),
    free=hop_contexts(),
)
def test_hop_contexts(ctx: HopContext, free: HopContext) -> None:
    assert ctx.seed == 5 and ctx.world_size == 4
    assert 0 <= ctx.rank < 4 and 1 <= ctx.contributions <= 4
    assert ctx.offset % 32 == 0 and 0 <= ctx.offset <= 4096
    assert 0 <= free.hop < free.num_hops and 0 <= free.rank < free.world_size


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"size": -1}, "size must be >= 0"),
        ({"size": (5, 2)}, "min <= max"),
        ({"size": 3, "shape": (3,)}, "size or shape"),
        ({"dtypes": ("float64",)}, "dtypes must be among"),
    ],
)
def test_bad_parameters_are_named(kw: dict, error: str) -> None:
    @settings(max_examples=1, database=None)
    @given(x=finite_tensors(**kw))
    def draw(x: torch.Tensor) -> None:
        pass

    with pytest.raises(ValueError, match=error):
        draw()


def _is_bf16_tie(v: np.ndarray) -> np.ndarray:
    """fp32 values exactly halfway between two neighbouring bf16 values (ml_dtypes)."""
    lo = v.astype(ml_dtypes.bfloat16).astype(np.float64)
    d = v.astype(np.float64) - lo
    step = np.spacing(lo.astype(ml_dtypes.bfloat16)).astype(np.float64)
    return (d != 0) & (np.abs(d) * 2 == np.abs(step))


def test_edge_tensors_reach_ties_boundaries_and_subnormals() -> None:
    """Over 200 derandomized draws of fp32 ``edge_tensors``: bf16 rounding ties, values one
    fp32 ulp off a power of two (a scale boundary), subnormal powers of two, fp16's smallest
    normal binade; each found."""
    seen = {"bf16 tie": 0, "ulp off a power of two": 0, "subnormal 2^k": 0, "fp16 2^-14": 0}

    @settings(
        max_examples=200,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(x=edge_tensors(32, dtypes=("float32",)))
    def draw(x: torch.Tensor) -> None:
        v = np.abs(x.numpy())
        v = v[(v > 0) & (v < 2.0**127)]  # (bf16's range)
        power = np.frexp(v.astype(np.float64))[0] == 0.5
        seen["bf16 tie"] += int(_is_bf16_tie(v).any())
        below = np.frexp(np.nextafter(v, np.float32(np.inf)).astype(np.float64))[0]
        off = (below == 0.5) & ~power  # one fp32 ulp below a power of two
        seen["ulp off a power of two"] += int(off.any())
        seen["subnormal 2^k"] += int((power & (v < 2.0**-126)).any())
        seen["fp16 2^-14"] += int(((v >= 2.0**-14) & (v < 2.0**-13)).any())

    draw()
    assert all(seen.values()), seen
