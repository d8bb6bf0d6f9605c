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
from dynamiq.plan.calibrate import _socket_cpu, calibrate_host, host_floor
from dynamiq.plan.costs import CodecCost, Cost, Host, Link
from dynamiq.plan.model import Cluster, simulate


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


def test_the_links_cpu_beyond_loopback_adds_to_both_floors() -> None:
    t = _table(1e-8)  # cpu per rank 0.02 s at 1e6 values; 4 ranks on 2 cores
    assert host_floor(t, "mxfp4", "ring", 10**6, extra_cpu=0.005) == pytest.approx(2 * 0.025)
    t["codecs"]["mxfp4"]["ring"]["wall_s"] = {"1000000": 0.05, "2000000": 0.09}
    # the loopback time plus the extra CPU on the cores: 0.05 + 2 * 0.005
    assert host_floor(t, "mxfp4", "ring", 10**6, extra_cpu=0.005) == pytest.approx(0.06)
    assert host_floor(t, "mxfp4", "ring", 10**6) == pytest.approx(0.05)


def test_predict_counts_the_links_cpu_per_byte(tmp_path: Path) -> None:
    net = {
        "kind": "dynamiq-plan-network",
        "ranks": 4,
        "rates": {
            "1gbit": {
                "rate_bps": 1e9,
                "latency_s": 1e-4,
                "efficiency": 0.9,
                "send_per_byte_s": 0.0,
                "extra_cpu_per_byte_s": 2e-9,
            }
        },
    }
    npath = tmp_path / "net.json"
    npath.write_text(json.dumps(net))
    numel = 64 * 2**20 // 4
    t = _table(1e-8)
    t["codecs"]["mxfp4"]["ring"]["wall_s"] = {str(numel // 4): 0.1, str(numel): 0.4}
    kw: dict[str, Any] = {"size_mib": 64, "rate": "1gbit", "host_table": _write(tmp_path, t)}
    with_cpu = predict(4, ["mxfp4"], ["ring"], network_table=str(npath), **kw)["results"][0]
    net["rates"]["1gbit"]["extra_cpu_per_byte_s"] = 0.0
    npath.write_text(json.dumps(net))
    without = predict(4, ["mxfp4"], ["ring"], network_table=str(npath), **kw)["results"][0]
    sent = with_cpu["bytes_sent_per_rank"]
    assert with_cpu["link_cpu_s"] == pytest.approx(2e-9 * 2 * sent)  # sent and received
    assert without["link_cpu_s"] == 0.0
    # 4 ranks on 2 cores: the loopback line's 0.4 s plus twice the links' CPU per rank
    assert with_cpu["cpu_floor_s"] == pytest.approx(0.4 + 2 * with_cpu["link_cpu_s"])
    assert without["cpu_floor_s"] == pytest.approx(0.4)
    assert with_cpu["step_overhead_s"] > without["step_overhead_s"]
    with pytest.raises(ValueError, match="link CPU per byte must be >= 0"):
        Link(1e9, cpu_per_byte_s=-1.0)


def test_predict_takes_the_larger_of_floor_and_schedule(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"size_mib": 64, "rate": "1gbit"}
    plain = predict(4, ["mxfp4"], ["ring"], **kw)["results"][0]
    assert "bound" not in plain
    numel = 64 * 2**20 // 4
    slow = predict(4, ["mxfp4"], ["ring"], host_table=_write(tmp_path, _table(1e-7)), **kw)
    r = slow["results"][0]
    # 1.69 s of CPU a rank (and the shaped links' own, beyond loopback's), 4 ranks on 2
    # cores: the simulated cores cannot do it faster
    link = r["link_cpu_s"]
    assert link >= 0
    assert r["cpu_floor_s"] == pytest.approx(4 * (0.01 + 1e-7 * numel + link) / 2)
    # the simulated cores reach that floor (to rounding: either may be named the bound)
    assert r["schedule_s"] == pytest.approx(r["cpu_floor_s"], rel=1e-9)
    assert r["seconds"] == max(r["schedule_s"], r["cpu_floor_s"])
    # the loopback run took longer still: that decides
    t = _table(1e-7)
    t["codecs"]["mxfp4"]["ring"]["wall_s"] = {str(numel // 4): 2.0, str(numel): 8.0}
    r = predict(4, ["mxfp4"], ["ring"], host_table=_write(tmp_path, t), **kw)["results"][0]
    assert r["bound"] == "cpu" and r["seconds"] == r["cpu_floor_s"]
    assert r["cpu_floor_s"] == pytest.approx(8.0 + 4 * r["link_cpu_s"] / 2)
    fast = predict(4, ["mxfp4"], ["ring"], host_table=_write(tmp_path, _table(0.0)), **kw)
    r = fast["results"][0]
    # the kernels alone already cost more CPU than the table says: no overhead beyond the
    # shaped links' own CPU, no floor
    assert r["step_overhead_s"] * r["cpu_steps_per_rank"] <= r["link_cpu_s"] * (1 + 1e-9)
    assert r["bound"] == "schedule" and r["seconds"] == r["schedule_s"]
    # a codec the table does not have: the plain model, no floor
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


@pytest.mark.distributed
def test_the_links_cpu_is_measured_against_the_same_stream_on_loopback() -> None:
    size = 1 << 22
    shaped = [{"patterns": {"stream": {"cpu_seconds": [0.5]}}} for _ in range(2)]
    got = _socket_cpu(shaped, 2, size, repeats=1)
    assert got["cpu_per_byte_s"] == pytest.approx(0.5 / (2 * size))
    # two real ranks on loopback moved the same bytes: some CPU, far less than 60 ns a byte
    assert 0 < got["loopback_cpu_per_byte_s"] < got["cpu_per_byte_s"]
    assert got["extra_cpu_per_byte_s"] == pytest.approx(
        got["cpu_per_byte_s"] - got["loopback_cpu_per_byte_s"]
    )
    cheap = [{"patterns": {"stream": {"cpu_seconds": [0.0]}}} for _ in range(2)]
    assert _socket_cpu(cheap, 2, size, repeats=1)["extra_cpu_per_byte_s"] == 0.0


# -- the ranks' CPU steps on shared cores ---------------------------------------------------


def _fast_cluster(n: int) -> Cluster:
    return Cluster(n, Link(1e15, 0.0))  # the links cost next to nothing: the CPU decides


COSTS = CodecCost(Cost(1e-4), Cost(2e-4), Cost(5e-5))


def test_as_many_cores_as_ranks_is_a_core_per_rank() -> None:
    mine = simulate("fp32", "ring", _fast_cluster(4), 1 << 16, COSTS, Host(), sub_chunk=4096)
    pool = simulate("fp32", "ring", _fast_cluster(4), 1 << 16, COSTS, Host(cores=4), sub_chunk=4096)
    assert pool.seconds == pytest.approx(mine.seconds, rel=1e-12)
    assert pool.phases["cores"] == 0.0


def test_one_core_runs_every_ranks_cpu_one_after_another() -> None:
    p = simulate("fp32", "ring", _fast_cluster(4), 1 << 16, COSTS, Host(cores=1), sub_chunk=4096)
    alone = simulate("fp32", "ring", _fast_cluster(4), 1 << 16, COSTS, Host(), sub_chunk=4096)
    assert p.seconds >= 4 * p.cpu_seconds_per_rank * (1 - 1e-9)
    assert p.cpu_seconds_per_rank == pytest.approx(alone.cpu_seconds_per_rank, rel=1e-12)
    assert p.phases["cores"] > 0 and p.seconds > 2 * alone.seconds


def test_step_overhead_is_added_to_every_cpu_step() -> None:
    base = simulate("fp32", "ring", _fast_cluster(2), 1 << 14, COSTS, Host(), sub_chunk=4096)
    more = simulate(
        "fp32", "ring", _fast_cluster(2), 1 << 14, COSTS, Host(step_overhead=1e-3), sub_chunk=4096
    )
    assert more.cpu_steps_per_rank == base.cpu_steps_per_rank > 0
    assert more.cpu_seconds_per_rank == pytest.approx(
        base.cpu_seconds_per_rank + 1e-3 * base.cpu_steps_per_rank, rel=1e-9
    )
    with pytest.raises(ValueError, match="cores must be >= 1"):
        Host(cores=0)
    with pytest.raises(ValueError, match="step_overhead"):
        Host(step_overhead=-1.0)


def test_with_a_host_table_a_ranks_cpu_is_the_measured_one(tmp_path: Path) -> None:
    """The host table's CPU per rank beyond the kernels' is spread over the rank's steps:
    the predicted CPU of a rank is the measured one."""
    numel = 64 * 2**20 // 4
    t = _table(3e-8)  # 0.01 + 3e-8 n s a rank
    out = predict(4, ["mxfp4"], ["ring"], size_mib=64, rate="1gbit", host_table=_write(tmp_path, t))
    r = out["results"][0]
    cpu = sum(v for k, v in r["phases"].items() if k not in ("wait", "cores"))
    assert r["step_overhead_s"] > 0
    assert cpu == pytest.approx(0.01 + 3e-8 * numel + r["link_cpu_s"], rel=1e-6)
    assert r["seconds"] >= r["schedule_s"] and r["seconds"] >= r["cpu_floor_s"]
