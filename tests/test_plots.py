"""PNG plots of comparison rows, and the "DynamiQ tuned to a codec's bits/value" matching of
``benchmarks/compare_all.py``."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dynamiq.bench.plots import codec_family, codec_label, plot_compare

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[dict[str, Any]]:
    rows = []
    for schedule in ("ring", "butterfly"):
        for n in (4, 8, 16, 32):
            for bits, err in ((3.0, 1e-2), (5.0, 1e-3), (8.0, 1e-4)):
                codec = {"id": "dynamiq", "bits": bits}
                rows.append(_row(codec, schedule, n, bits + 0.27, err))
            rows.append(_row("int8", schedule, n, 8.5, 2e-4 if schedule == "ring" else 5e-5))
            rows.append(_row("mxfp4", schedule, n, 4.25, 3e-2))
            rows.append(_row("fp32", schedule, n, 32.0, 0.0))
    return rows


def _row(codec: Any, schedule: str, n: int, bpv: float, err: float) -> dict[str, Any]:
    mod = _compare_all()
    return {
        "codec": codec,
        "key": mod.key(codec),
        "schedule": schedule,
        "workers": n,
        "bits/value": bpv,
        "vnmse median": err,
        "vnmse max": err,
    }


def _compare_all() -> ModuleType:
    name = "compare_all_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "compare_all.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_plot_compare_writes_a_png(tmp_path: Path) -> None:
    out = plot_compare(_rows(), tmp_path / "sub" / "cmp.png", panels=[("ring", 8), ("ring", 32)])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 300


def test_plot_compare_rejects_no_rows(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no rows"):
        plot_compare([], tmp_path / "x.png")


def test_families_and_labels() -> None:
    assert codec_family("int4") == codec_family({"id": "int8"}) == "INT"
    assert codec_family({"id": "dynamiq", "bits": 3.0}) == "DynamiQ"
    assert codec_family({"id": "dynamiq", "levels": "uniform"}).startswith("DynamiQ {")
    assert codec_family({"id": "thc", "variant": "widen"}) == "THC (widen)"
    assert codec_label({"id": "omnireduce", "density": 0.25}) == "omnireduce density=0.25"


def test_tuned_comparison_picks_the_largest_budget_not_above() -> None:
    mod = _compare_all()
    sweep = [{"id": "dynamiq", "bits": b} for b in (3.0, 5.0, 8.0)]
    old = mod.SETS["sweep"]
    mod.SETS["sweep"] = sweep
    try:
        md = mod.tables(_rows())
    finally:
        mod.SETS["sweep"] = old
    lines = {ln.split("|")[1].strip(): ln for ln in md.splitlines() if ln.startswith("| `")}
    tuned = [ln for ln in md.split("### DynamiQ tuned")[1].splitlines() if ln.startswith("| `")]
    by_codec = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in tuned}
    # int8 (8.5 bits) meets DynamiQ at 8.27 bits: ring 2e-4/1e-4 = 2, butterfly 0.5 -> not
    # lower everywhere
    assert by_codec["`int8`"][1] == "8.270"
    assert by_codec["`int8`"][2:6] == ["2"] * 4 and by_codec["`int8`"][6:10] == ["0.5"] * 4
    assert by_codec["`int8`"][-1] == "**no**"
    # mxfp4 (4.25) meets DynamiQ at 3.27: 3e-2/1e-2 = 3 everywhere
    assert by_codec["`mxfp4`"][2:10] == ["3"] * 8 and by_codec["`mxfp4`"][-1] == "yes"
    # fp32 is lossless: no DynamiQ point beats vNMSE 0
    assert by_codec["`fp32`"][-1] == "**no**"
    assert "`dynamiq bits=5.0`" in lines
