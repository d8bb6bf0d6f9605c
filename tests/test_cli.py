"""The ``dynamiq`` command line."""

from __future__ import annotations

import json

import pytest

from dynamiq.bench.cli import main
from dynamiq.codecs import list_codecs


def test_codecs_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codecs", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == list_codecs()
    assert all({"bits/value", "unbiased", "bound |x̂ - x| <="} <= set(r) for r in rows)


def test_demo_reports_every_codec_within_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in out["errors"]] == list_codecs()
    assert all(r["bound use"] <= 1.0 for r in out["errors"])
    assert out["slice_stats"]["kurtosis"] > 30
    # the real multi-process all-reduce: every rank bit-identical, fp32 exact up to summation
    # order, compressed codecs send what their bits/value says
    ar = {(r["codec"], r["schedule"]): r for r in out["allreduce"]}
    assert set(ar) == {
        (c, s)
        for c in ("fp32", "bf16", "mxfp8_e4m3", "int8", "dynamiq")
        for s in ("ring", "butterfly")
    }
    assert all(r["bit-identical"] for r in ar.values())
    assert ar[("fp32", "ring")]["vnmse"] < 1e-12
    assert ar[("bf16", "ring")]["bits/value"] == pytest.approx(16, rel=1e-3)
    assert ar[("dynamiq", "butterfly")]["bits/value"] < 5.0
    assert 0 < ar[("dynamiq", "ring")]["vnmse"] < ar[("mxfp8_e4m3", "ring")]["vnmse"]


def test_bench_kernels_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                "kernels",
                "--numel",
                "5000",
                "--codecs",
                "int8,bf16",
                "--json",
                "--iters",
                "2",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["codec"] for r in rows] == ["int8", "bf16"]
    assert all(r["bit-exact"] for r in rows)
    for r in rows:
        assert r["fused s"] > 0 and r["unfused s"] > 0 and r["copy bandwidth GB/s"] > 0
        assert r["speed-up over fastest unfused"] <= r["speed-up over unfused"]
        assert r["roofline s"] == pytest.approx(r["bytes moved"] / (r["copy bandwidth GB/s"] * 1e9))
        assert r["fused page faults/call"] >= 0 and r["unfused page faults/call"] >= 0


def test_bench_kernels_unknown_codec_fails_before_timing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "kernels", "--numel", "5000", "--codecs", "int8,int9", "--json"]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""  # no row was timed
    assert "unknown codec 'int9'" in out.err and "int8" in out.err  # lists the known ids


def test_help_explains_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    for option in ("--codecs", "--schedules", "--workers", "--seeds", "--split", "--json"):
        assert option in text
