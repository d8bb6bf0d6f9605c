"""``dynamiq bench cluster``'s rows from the ranks' results, rotations pooled (no cluster)."""

from __future__ import annotations

import statistics

import pytest

from dynamiq.bench.cluster import ClusterBenchConfig, _pooled, _summarise

A = {"kind": "dynamiq", "codec": "int8", "schedule": "ring", "verify": False, "label": "a"}
B = {"kind": "torch", "dtype": "bf16", "label": "b"}


def _result(method: dict, times: list[float], tx: int) -> dict:
    stats = [
        {"bytes_sent": 100, "bytes_received": 100, "control_bytes_sent": 4, "seconds": {}}
        for _ in times
    ] if method["kind"] == "dynamiq" else []  # fmt: skip
    return {
        "method": method,
        "times": list(times),
        "cpu_times": [t / 2 for t in times],
        "stats": stats,
        "counters": {"tx_bytes": tx, "rx_bytes": tx},
    }


def _rank(times_a: list[list[float]], times_b: list[list[float]]) -> dict:
    """One rank's results of rotations A, B, A, B, ... (``tx`` 1000 bytes a call)."""
    results = []
    for ta, tb in zip(times_a, times_b, strict=True):
        results += [_result(A, ta, 1000 * len(ta)), _result(B, tb, 1000 * len(tb))]
    return {"results": results}


def test_rotations_pool_each_methods_calls_in_first_run_order() -> None:
    rank = _rank([[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]])
    got = _pooled(rank)["results"]
    assert [r["method"]["label"] for r in got] == ["a", "b"]
    assert got[0]["times"] == [1.0, 2.0, 3.0, 4.0] and got[1]["times"] == [5.0, 6.0, 7.0, 8.0]
    assert got[0]["cpu_times"] == [0.5, 1.0, 1.5, 2.0] and len(got[0]["stats"]) == 4
    assert got[0]["counters"] == {"tx_bytes": 4000, "rx_bytes": 4000}
    # the input is left as it was
    assert rank["results"][0]["times"] == [1.0, 2.0] and len(rank["results"]) == 4


def test_rows_of_pooled_rotations_are_medians_over_every_call() -> None:
    cfg = ClusterBenchConfig(ranks=2, numel=1000, baselines=("bf16",), rotations=2)
    ranks = [
        _rank([[1.0, 2.0], [3.0, 9.0]], [[5.0, 6.0], [7.0, 8.0]]),
        _rank([[1.5, 2.5], [2.0, 4.0]], [[5.5, 6.0], [7.0, 8.5]]),
    ]
    rows = _summarise(cfg, "100mbit", [_pooled(r) for r in ranks])
    assert len(rows) == 2
    a = next(r for r in rows if r["method"] == "dynamiq")
    slowest = [1.5, 2.5, 3.0, 9.0]  # each call's slowest rank
    assert a["repeats_s"] == slowest
    assert a["seconds"] == statistics.median(slowest)
    assert (a["seconds_min"], a["seconds_max"]) == (1.5, 9.0)
    assert a["wire MB/rank"] == pytest.approx(1000 / 1e6)  # 4000 bytes over 4 calls
    b = next(r for r in rows if r["method"] == "pytorch")
    assert b["seconds"] == statistics.median([5.5, 6.0, 7.0, 8.5])


def test_rotations_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="rotations must be >= 1"):
        ClusterBenchConfig(ranks=2, rotations=0)
