"""Certified bounds where they slip: subnormal powers of two, ties, scale boundaries, and one
NaN/Inf among finite values (dynamiq/testing/strategies.py ``edge_tensors``;
dynamiq/codecs/dynamiq_codec.py's bound)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from dynamiq.codecs import DynamiqCodec, get_codec
from dynamiq.collectives.api import simulate_allreduce
from dynamiq.testing import check_bound_sound
from dynamiq.testing.strategies import codec_inputs

SMALL = {"span": 1024, "super_group": 256, "group": 16}
N_SEARCH = 400


def _old_bound(codec: DynamiqCodec, x: torch.Tensor) -> torch.Tensor:
    """The bound as it was: ``s·(m_w + 2^-22)``, without the absolute term."""
    patch = pytest.MonkeyPatch()
    patch.setattr(DynamiqCodec, "_bound_abs", 0.0)
    try:
        return codec.error_bound.max_abs_error(x)
    finally:
        patch.undo()


def test_constant_subnormal_block_is_within_the_bound() -> None:
    """The reported slip: a constant block of 2^-133 errs by 3.51025e-42, above the old bound
    3.50970e-42; the bound now covers it."""
    x = torch.full((1024,), 2.0**-133)
    codec = get_codec("dynamiq")
    assert isinstance(codec, DynamiqCodec)
    err = (codec.decode(codec.encode(x), 1024).double() - x.double()).abs()
    assert float(err.max()) == pytest.approx(3.510252653133667e-42, rel=1e-9)
    old, new = _old_bound(codec, x), codec.error_bound.max_abs_error(x)
    assert not bool((err <= old).all())
    assert bool((err <= new).all())
    gap = new - old
    assert bool(((gap >= 0) & (gap <= 2.0**-149)).all())  # 1.4e-45 more, no more


def test_edge_strategies_find_the_old_subnormal_slip() -> None:
    """The conformance kit's inputs (``codec_inputs``, half of them ``edge_tensors``) find the
    old bound's violation within 300 derandomized examples, and every input they flag is within
    the current bound."""
    codec = DynamiqCodec(**SMALL)
    found: list[torch.Tensor] = []

    @settings(
        max_examples=N_SEARCH,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(x=codec_inputs(codec))
    def search(x: torch.Tensor) -> None:
        y = codec.decode(codec.encode(x), x.numel())
        err = (y.double() - x.double()).abs()
        slip = err > _old_bound(codec, x)
        if bool(slip.any()):
            found.append(x)
            assert bool((y[slip].abs() < 2.0**-126).all())  # it is the subnormal slip

    search()
    assert found, "the edge strategies did not find the old bound's subnormal slip"
    for x in found:
        check_bound_sound(codec, x)  # the current bound holds there


def test_one_inf_spoils_only_its_super_group_through_the_engine() -> None:
    """The multi-hop bound (return_bound) of dynamiq: an Inf makes the bound of its own
    super-group infinite (it decodes to NaN) and leaves every other value's bound finite and
    sound (it used to be NaN over the whole 65536-value span)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(70000, generator=gen) for _ in range(2)]
    xs[1][70000 - 5000] = math.inf
    res = simulate_allreduce(xs, "dynamiq", "ring", threshold=0, return_bound=True)
    sg = get_codec("dynamiq").super_group
    own = torch.zeros(70000, dtype=torch.bool)
    first = (70000 - 5000) // sg * sg
    own[first : first + sg] = True
    assert res.bound is not None
    assert not bool(torch.isfinite(res.bound[own]).any())
    assert bool(torch.isfinite(res.bound[~own]).all())
    err = (res.outputs[0].double() - res.exact)[~own].abs()
    assert bool((err <= res.bound[~own]).all())
