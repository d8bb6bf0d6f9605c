"""The test kit fails broken codecs (tests/testing/kit_mutants.py): a bound one ulp too small,
a codec whose result depends on the cut, a wrong ``encoded_nbytes``; and passes the real ones
(tests/codecs/test_conformance.py runs it on every codec that ships)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from kit_mutants import HalfUlpInt, PerTensorScale, Shrunk, WrongSize, registered

from dynamiq.codecs import get_codec
from dynamiq.testing import (
    check_bad_input,
    check_block_locality,
    check_bound_edges,
    check_bound_sound,
    check_bound_tight,
    check_config,
    check_encoded_nbytes,
    check_nonfinite,
    check_roundtrip,
    run_conformance,
)
from dynamiq.testing.golden import golden_input
from dynamiq.testing.strategies import codec_inputs


@pytest.fixture(autouse=True)
def _mutants_registered() -> object:
    with registered(Shrunk, HalfUlpInt, WrongSize, PerTensorScale):
        yield


def test_a_tie_reaches_the_bf16_bound_exactly() -> None:
    """Independent of the kit: 1 + 2^-8 is the midpoint of bf16's 1 and 1 + 2^-7, so its
    error is 2^-8, the bound itself; one ulp less is unsound there."""
    codec = get_codec("bf16")
    x = torch.tensor([1 + 2.0**-8])
    err = (codec.decode(codec.encode(x), 1).double() - x.double()).abs()
    assert float(err) == 2.0**-8 == float(codec.error_bound.max_abs_error(x))


@pytest.mark.parametrize("inner", ["bf16", "fp16", "dynamiq"])
def test_a_bound_one_ulp_too_small_fails_the_kit(inner: str) -> None:
    """The codecs whose bound is reached exactly somewhere: one fp64 ulp less fails the
    kit's fixed edge battery, whatever the example count, and so ``run_conformance``."""
    shrunk = Shrunk(inner=inner)
    with pytest.raises(AssertionError, match=r"error .* > bound"):
        check_bound_edges(shrunk)
    with pytest.raises(AssertionError, match=r"error .* > bound"):
        run_conformance(shrunk)
    assert check_bound_edges(get_codec(inner)) == 1.0  # the real bound: reached, not passed


def test_an_int_bound_one_ulp_below_a_tie_fails_the_kit() -> None:
    """INT on a tie errs by exactly S/2 (the witness's ties, S = 2^-3: codes k or k + 1 for
    (k + 1/2)/8); a bound of S/2 less one ulp fails the kit."""
    codec = HalfUlpInt(bits=4)
    x = torch.tensor([7 / 8, 2.5 / 8])  # absmax 7/8: S = 1/8, exact in bf16
    err = (codec.decode(codec.encode(x), 2).double() - x.double()).abs()
    assert float(err[1]) == 1 / 16
    assert float(codec.error_bound.max_abs_error(x)[1]) < 1 / 16
    with pytest.raises(AssertionError, match=r"error .* > bound"):
        check_bound_edges(codec)
    with pytest.raises(AssertionError, match=r"error .* > bound"):
        run_conformance(codec)
    assert check_bound_edges(get_codec("int4")) < 1.0  # the real one holds, with its slack


def test_a_per_tensor_scale_passed_the_old_checks_and_fails_locality() -> None:
    """The toy per-tensor-scale codec passes every check the kit had before (config, bad
    input, NaN/Inf, tightness, round trip and soundness on the kit's inputs), and fails
    the block-locality check, in ``run_conformance`` too."""
    codec = PerTensorScale()
    check_config(codec)
    check_bad_input(codec)
    check_nonfinite(codec)
    assert check_bound_tight(codec) > 0.99

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(x=codec_inputs(codec))
    def old_checks(x: torch.Tensor) -> None:
        check_roundtrip(codec, x)
        check_bound_sound(codec, x)

    old_checks()
    with pytest.raises(AssertionError, match="depends on the cut"):
        check_block_locality(codec, golden_input(16))
    with pytest.raises(AssertionError, match="block locality"):
        run_conformance(codec)
    check_block_locality(get_codec("int8"), golden_input(32))  # a block scale is local


def test_a_wrong_encoded_nbytes_is_named() -> None:
    """The kit names the codec, ``encoded_nbytes`` and both sizes, before any other check
    trips on the size."""
    codec = WrongSize(bits=4)
    n, wrote = 0, codec.encode(torch.zeros(0)).numel()
    expected = rf"WrongSize\(bits=4.*encoded_nbytes\({n}\) is {wrote + 1} but encode wrote {wrote}"
    with pytest.raises(AssertionError, match=expected):
        check_encoded_nbytes(codec)
    with pytest.raises(AssertionError, match=r"encoded_nbytes\(\d+\) is \d+ but encode wrote"):
        run_conformance(codec)
    check_encoded_nbytes(get_codec("int4"))
