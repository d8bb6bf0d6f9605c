"""The conformance kit over every registered codec and the frozen extra configurations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from dynamiq.codecs import HopContext, IntCodec, get_codec, list_codecs
from dynamiq.testing import check_bound_tight, check_unbiased, run_conformance
from dynamiq.testing.golden import EXTRA_FIXTURES, check_golden

FIXTURES = Path(__file__).parents[1] / "fixtures"
EXTRA_CONFIGS = [s["codec"] for s in EXTRA_FIXTURES.values() if "prologue" not in s] + [
    {"id": "int", "bits": 8, "rounding": "stochastic", "scale_format": "e8m0"},
    {"id": "int", "bits": 2, "rounding": "stochastic", "block_size": 7},
    {"id": "int", "bits": 5, "block_size": 1000, "scale_format": "fp32"},
]
#: the codecs that ship with dynamiq: their golden bytes live in tests/fixtures. Installed
#: plugins (e.g. examples/dynamiq-nf4) are registered too and run the kit with their own
#: fixtures, in their own tests.
BUILTIN = [n for n in list_codecs() if type(get_codec(n)).__module__.startswith("dynamiq.")]


@pytest.mark.parametrize("name", BUILTIN)
def test_registered_codec_conforms(name: str) -> None:
    run_conformance(name, fixtures_dir=FIXTURES)


@pytest.mark.usefixtures("quarter_examples")  # variants: the defaults run the full count
@pytest.mark.parametrize("config", EXTRA_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_extra_config_conforms(config: dict) -> None:
    run_conformance(config)


@pytest.mark.parametrize("name", list(EXTRA_FIXTURES))
def test_extra_golden_fixtures(name: str) -> None:
    check_golden(get_codec(EXTRA_FIXTURES[name]["codec"]), FIXTURES, name)


def test_every_registered_name_has_a_fixture() -> None:
    assert {p.name for p in FIXTURES.iterdir()} == set(BUILTIN) | set(EXTRA_FIXTURES)


def test_golden_detects_a_changed_byte(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(FIXTURES / "mxfp4", tmp_path / "mxfp4")
    payload = tmp_path / "mxfp4" / "payload.bin"
    raw = bytearray(payload.read_bytes())
    raw[40] ^= 0x10
    payload.write_bytes(bytes(raw))
    with pytest.raises(AssertionError, match="wire bytes differ.*first differing byte 40"):
        check_golden(get_codec("mxfp4"), tmp_path)


def test_golden_detects_a_changed_prologue_message(tmp_path: Path) -> None:
    """The pooled fixture freezes rank 0's prologue statistics (a byte a span)."""
    import shutil

    shutil.copytree(FIXTURES / "dynamiq_pooled", tmp_path / "dynamiq_pooled")
    stats = tmp_path / "dynamiq_pooled" / "statistics.bin"
    raw = bytearray(stats.read_bytes())
    from dynamiq.collectives.planning import chunk_bounds

    numel = (FIXTURES / "dynamiq_pooled" / "input.bin").stat().st_size // 4
    spans = sum(-(-(b - a) // 256) for a, b in chunk_bounds(numel, 3, 256))
    assert len(raw) == spans + 2  # a byte a span of each chunk, and the two flags
    raw[5] ^= 0x01
    stats.write_bytes(bytes(raw))
    spec = EXTRA_FIXTURES["dynamiq_pooled"]["codec"]
    with pytest.raises(AssertionError, match="prologue statistics differ"):
        check_golden(get_codec(spec), tmp_path, "dynamiq_pooled")


@pytest.mark.parametrize("name", list_codecs())
def test_bounds_are_tight(name: str) -> None:
    assert check_bound_tight(get_codec(name)) >= 0.5


@dataclass(frozen=True, kw_only=True)
class _BiasedInt(IntCodec):
    """Stochastic INT whose decode is off by S/32: a bias the unbiasedness test must catch."""

    codec_id: ClassVar[str] = "_biased_int_test_only"

    def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
        y = super()._decode(payload, numel, ctx)
        s = self.error_bound.max_abs_error(y, ctx).float()  # ~ S
        return y + s / 32


def test_unbiasedness_test_has_power() -> None:
    """The statistical test accepts the stochastic codec (5σ) and rejects a bias of S/32."""
    good = IntCodec(bits=4, rounding="stochastic")
    assert abs(check_unbiased(good)) <= 5.0
    with pytest.raises(AssertionError, match="z-score"):
        check_unbiased(_BiasedInt(bits=4, rounding="stochastic"))


def test_stochastic_variance_bound_holds_empirically() -> None:
    """Mean squared error over 300 seeds stays below the declared per-element variance bound
    (summed over elements; the sample mean of a bounded variable, 5σ margin)."""
    codec = IntCodec(bits=3, rounding="stochastic", block_size=16)
    k = torch.arange(256, dtype=torch.float64)
    x = (torch.sin(k) * 2 + 0.1).float()
    sq = torch.zeros(256, dtype=torch.float64)
    trials = 300
    for t in range(trials):
        ctx = HopContext(seed=t)
        sq += (codec.decode(codec.encode(x, ctx), 256, ctx).double() - x.double()).square()
    mse = sq.sum() / trials
    var = codec.error_bound.variance(x).sum()
    assert mse <= var
    assert mse >= 0.3 * var  # and the bound is not loose: uniform fractions give ~2/3 of it
