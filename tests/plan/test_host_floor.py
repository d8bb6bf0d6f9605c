"""The CPU floor of ranks sharing one machine (``dynamiq plan calibrate --host``,
dynamiq/plan/calibrate.py): its arithmetic, how ``predict`` applies it, the table's checks,
and one real calibration on two local ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dynamiq.bench.cli import main
from dynamiq.plan.api import predict
from dynamiq.plan.calibrate import calibrate_host, host_floor


def _table(per_value: float, ranks: int = 4, cores: int = 2) -> dict[str, Any]:
    row = {"overhead": 0.01, "per_value": per_value, "cpu_s_per_rank": {}, "wall_s": {}}
    return {
        "kind": "dynamiq-plan-host",
        "date": "d",
        "machine": "m",
        "ranks": ranks,
        "cores": cores,
        "sizes": [],
        "codecs": {"mxfp4": {"ring": row}},
    }


def _write(tmp_path: Path, table: dict[str, Any]) -> str:
    path = tmp_path / "host.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_floor_is_the_larger_of_cpu_over_cores_and_the_loopback_time() -> None:
    t = _table(1e-8)
    # cpu per rank = 0.01 + 1e-8 * 1e6 = 0.02 s; 4 ranks on 2 cores
    assert host_floor(t, "mxfp4", "ring", 10**6) == pytest.approx(4 * 0.02 / 2)
    # the loopback all-reduce took longer than its CPU over the cores: that decides
    row = t["codecs"]["mxfp4"]["ring"]
    row["wall_s"] = {"1000000": 0.05, "2000000": 0.09}  # the line 0.01 + 4e-8 n
    assert host_floor(t, "mxfp4", "ring", 10**6) == pytest.approx(0.05)
    assert host_floor(t, "mxfp4", "ring", 3 * 10**6) == pytest.approx(0.13)
    row["wall_s"] = {"1000000": 0.001, "2000000": 0.002}  # faster than the CPU allows
    assert host_floor(t, "mxfp4", "ring", 10**6) == pytest.approx(4 * 0.02 / 2)
    assert host_floor(t, "mxfp4", "butterfly", 10**6) is None
    assert host_floor(t, "int8", "ring", 10**6) is None


def test_predict_takes_the_larger_of_floor_and_schedule(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"size_mib": 64, "rate": "1gbit"}
    plain = predict(4, ["mxfp4"], ["ring"], **kw)["results"][0]
    assert "bound" not in plain
    slow = predict(4, ["mxfp4"], ["ring"], host_table=_write(tmp_path, _table(1e-7)), **kw)
    r = slow["results"][0]
    numel = 64 * 2**20 // 4
    assert r["bound"] == "cpu"
    assert r["cpu_floor_s"] == pytest.approx(4 * (0.01 + 1e-7 * numel) / 2)
    assert r["seconds"] == r["cpu_floor_s"] > r["schedule_s"] == pytest.approx(plain["seconds"])
    fast = predict(4, ["mxfp4"], ["ring"], host_table=_write(tmp_path, _table(0.0)), **kw)
    r = fast["results"][0]
    assert r["bound"] == "schedule" and r["seconds"] == pytest.approx(plain["seconds"])
    # a codec the table does not have: no floor
    other = predict(4, ["int8"], ["ring"], host_table=_write(tmp_path, _table(1e-7)), **kw)
    assert "bound" not in other["results"][0]


@pytest.mark.parametrize(
    ("change", "kw", "message"),
    [
        ({"kind": "dynamiq-plan-kernels"}, {}, "not a `dynamiq plan calibrate --host` table"),
        ({"ranks": 8}, {}, "measured with 8 ranks, not 4"),
        ({}, {"profile": "ib100"}, "emulated profile only"),
    ],
)
def test_table_checks(
    tmp_path: Path, change: dict[str, Any], kw: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path, {**_table(1e-8), **change})
    with pytest.raises(ValueError, match=message):
        predict(4, ["mxfp4"], ["ring"], host_table=path, **kw)


def test_cli_names_a_missing_table_and_a_mixed_calibration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--host-table", "/nonexistent/host.json"]) == 2
    assert "host table /nonexistent/host.json" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--host", "--kernels"]) == 2
    assert "--host is a table of its own" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--host", "--size-mib", "0"]) == 2
    assert "--size-mib must be positive" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--host", "--schedules", "rng"]) == 2
    assert "rng" in capsys.readouterr().err


@pytest.mark.distributed
def test_calibrate_host_on_two_local_ranks() -> None:
    t = calibrate_host(["fp32", "int8"], ["ring"], ranks=2, sizes_mib=(0.25, 1.0), repeats=1)
    assert t["kind"] == "dynamiq-plan-host" and t["ranks"] == 2
    assert t["sizes"] == [2**16, 2**18]
    for codec in ("fp32", "int8"):
        row = t["codecs"][codec]["ring"]
        assert set(row["cpu_s_per_rank"]) == {str(2**16), str(2**18)}
        assert all(v > 0 for v in row["cpu_s_per_rank"].values())
        assert all(v > 0 for v in row["wall_s"].values())
        floor = host_floor(t, codec, "ring", 2**18)
        assert floor is not None and floor > 0
