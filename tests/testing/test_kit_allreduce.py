"""check_allreduce_bound and check_block_locality (dynamiq/testing/allreduce.py): they pass
the codecs that ship, on real gradients and on the kit's strategies, and fail a bound too
small and a result that depends on the cut."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit_mutants import PerTensorScale

from dynamiq.codecs import Codec, ErrorBound, HopContext, get_codec
from dynamiq.data import load_slice
from dynamiq.testing import (
    check_allreduce_bound,
    check_block_locality,
    exact_sum,
    schedules,
    tensor_lists,
)


def test_exact_sum_is_correctly_rounded() -> None:
    """Against exact rational arithmetic: 2^100 + 2^-149 - 2^100 is 2^-149 (fp64 in rank
    order gives 0), and a sum inexact in fp64 is within the half ulp reported."""
    xs = [torch.tensor([2.0**100, 3.0]), torch.tensor([2.0**-149, -(2.0**-140)])]
    xs.append(torch.tensor([-(2.0**100), 2.0**-149]))
    assert float(xs[0][0].double() + xs[1][0].double() + xs[2][0].double()) == 0.0
    total, half_ulp = exact_sum(xs)
    assert float(total[0]) == 2.0**-149 and float(half_ulp[0]) == 2.0**-202
    exact = sum(Fraction(float(t[1])) for t in xs)
    assert abs(Fraction(float(total[1])) - exact) <= Fraction(float(half_ulp[1]))
    assert Fraction(float(total[1])) != exact  # (not exact in fp64)


@pytest.mark.parametrize("name", ["int8", "mxfp4", "dynamiq", "thc", "bf16"])
def test_real_gradients_within_the_bound(name: str) -> None:
    """Four workers' real gradients (the language model's packaged slice), ring and
    butterfly: every element within the accumulated bound, which is not loose."""
    grads = load_slice()[:4, :8192]
    xs = [g.contiguous() for g in grads]
    for schedule in ("ring", "butterfly"):
        ratio = check_allreduce_bound(xs, name, schedule, seed=3)
        assert 0.0 < ratio <= 1.0
        assert ratio > (0.05 if name != "thc" else 1e-4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    name=st.sampled_from(["int4", "mxfp8_e4m3", "nf4", "fp16", "omnireduce"]),
    op=st.sampled_from(["sum", "avg"]),
)
def test_strategy_cases_within_the_bound(data: st.DataObject, name: str, op: str) -> None:
    codec = get_codec(name)
    limit = min(codec.max_input_abs, 2.0**100) / 64
    xs = data.draw(tensor_lists(codec.block_size, ranks=(1, 5), max_abs=limit))
    sched = data.draw(schedules(len(xs)))
    check_allreduce_bound(xs, codec, sched, op=op, sub_chunks=(codec.block_size,))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _HalfBound(Codec):
    """int8 with half its bound: the engine's accumulated bound is then too small."""

    codec_id = "_kit_half_bound"

    @property
    def block_size(self) -> int:
        return 32

    def encoded_nbytes(self, numel: int, ctx: HopContext | None = None) -> int | None:
        return get_codec("int8").encoded_nbytes(numel, ctx)

    def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        return get_codec("int8").encode(x, ctx)

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        return get_codec("int8").decode(payload, numel, ctx)

    @property
    def error_bound(self) -> ErrorBound:
        true = get_codec("int8").error_bound
        return dataclasses.replace(true, max_abs=lambda x, ctx: true.max_abs_error(x, ctx) / 2)


def test_a_bound_too_small_fails() -> None:
    xs = [g.contiguous() for g in load_slice()[:3, :4096]]
    with pytest.raises(AssertionError, match=r"\|output - exact sum\| = .* > bound"):
        check_allreduce_bound(xs, _HalfBound(), "ring")


def test_a_result_that_depends_on_the_cut_fails() -> None:
    """The per-tensor-scale toy: sound hop by hop (so the bound holds), but the engine's
    result changes with ``sub_chunk``; and the direct locality check fails it."""
    xs = [g.contiguous() for g in load_slice()[:2, :1024]]
    codec = PerTensorScale()
    assert check_allreduce_bound(xs, codec, "ring") <= 1.0
    with pytest.raises(AssertionError, match="depends on the cut"):
        check_allreduce_bound(xs, codec, "ring", sub_chunks=(16,))
    with pytest.raises(AssertionError, match="depends on the cut"):
        check_block_locality(codec, xs[0])
    check_allreduce_bound(xs, "int8", "ring", sub_chunks=(32, 96))


@pytest.mark.parametrize("name", ["thc", "omnireduce", "dynamiq"])
def test_block_locality_with_a_prologue(name: str) -> None:
    """Codecs that agree on something over the whole buffer first are local given it."""
    x = load_slice()[0, :4096].contiguous()
    check_block_locality(get_codec(name), x, HopContext(seed=9))
