"""The ``dynamiq`` command line: output, help, and arguments checked before any work."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import pytest

from dynamiq.bench.args import identifier, json_keys
from dynamiq.bench.cli import build_parser, main
from dynamiq.codecs import get_codec, list_codecs

IDENT = re.compile(r"[a-z_][a-z0-9_]*")


def _status(argv: list[str]) -> Any:
    """``main``'s exit status; argparse's own errors (a bad type or choice) exit instead."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _keys(obj: Any) -> set[str]:
    """Every dict key in ``obj``, at any depth."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


def test_codecs_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codecs", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == list_codecs()
    assert all(set(r) == {"id", "bits_per_value", "unbiased", "bound_abs_error"} for r in rows)
    for r in rows:
        codec = get_codec(r["id"])
        assert r["bound_abs_error"] == codec.error_bound.formula
        assert r["bits_per_value"] == codec.bits_per_value()


def test_demo_reports_every_codec_within_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(IDENT.fullmatch(k) for k in _keys(out)), sorted(_keys(out))
    assert [r["id"] for r in out["errors"]] == list_codecs()
    assert all(r["bound_use"] <= 1.0 for r in out["errors"])
    assert all(r["chain_hops"] == 7 for r in out["errors"])  # the slice's 8 workers
    assert out["slice_stats"]["kurtosis"] > 30
    # the real multi-process all-reduce: every rank bit-identical, fp32 exact up to summation
    # order, compressed codecs send what their bits/value says
    ar = {(r["codec"], r["schedule"]): r for r in out["allreduce"]}
    assert set(ar) == {
        (c, s)
        for c in ("fp32", "bf16", "mxfp8_e4m3", "int8", "dynamiq")
        for s in ("ring", "butterfly")
    }
    assert all(r["bit_identical"] for r in ar.values())
    assert ar[("fp32", "ring")]["vnmse"] < 1e-12
    assert ar[("bf16", "ring")]["bits_per_value"] == pytest.approx(16, rel=1e-3)
    assert ar[("dynamiq", "butterfly")]["bits_per_value"] < 5.0
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
    assert all(IDENT.fullmatch(k) for k in _keys(rows))
    assert [r["codec"] for r in rows] == ["int8", "bf16"]
    assert all(r["bit_exact"] for r in rows)
    for r in rows:
        assert r["fused_s"] > 0 and r["unfused_s"] > 0 and r["copy_bandwidth_gb_per_s"] > 0
        assert r["speed_up_over_fastest_unfused"] <= r["speed_up_over_unfused"]
        roofline = r["bytes_moved"] / (r["copy_bandwidth_gb_per_s"] * 1e9)
        assert r["roofline_s"] == pytest.approx(roofline)
        assert r["fused_page_faults_per_call"] >= 0 and r["unfused_page_faults_per_call"] >= 0


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


# -- JSON keys --------------------------------------------------------------------------------


def test_column_titles_become_identifiers() -> None:
    cases = {
        "bits/value": "bits_per_value",
        "bound |x̂ - x| <=": "bound_abs_error",
        "vnmse median": "vnmse_median",
        "bit-exact": "bit_exact",
        "copy bandwidth GB/s": "copy_bandwidth_gb_per_s",
        "fused / torch.add into out": "fused_over_torch_add_into_out",
        "cpu s/rank": "cpu_s_per_rank",
        "vs pytorch bf16": "vs_pytorch_bf16",
    }
    assert {k: identifier(k) for k in cases} == cases
    # data used as keys (sysctl names, seed numbers) is not renamed, nested or not
    data = {"sysctls": {"net.ipv4.tcp_mtu_probing": "1"}, "seeds": {"0": {"bits/value": 4}}}
    assert json_keys(data) == {
        "sysctls": {"net.ipv4.tcp_mtu_probing": "1"},
        "seeds": {"0": {"bits_per_value": 4}},
    }
    # a title whose identifier is taken keeps its title: no value is lost
    assert json_keys({"a b": 1, "a_b": 2}) == {"a b": 1, "a_b": 2}


# -- help and usage ---------------------------------------------------------------------------


def _leaf_commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _leaf_commands(sub, f"{prefix} {name}".strip())
    return out or [prefix]


def test_top_level_help_lists_every_command_on_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    leaves = _leaf_commands(build_parser())
    assert {"codecs", "demo", "compare", "bench kernels", "bench cluster", "bench train"} <= set(
        leaves
    )
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for command in leaves:
        mine = [line for line in lines if re.match(rf"\s+dynamiq {command}\s{{2,}}\S", line)]
        assert len(mine) == 1, (command, lines)


@pytest.mark.parametrize(
    "argv",
    [
        ["codecs", "--bogus"],
        ["compare", "--bogus", "1"],
        ["bench", "kernels", "--bogus"],
        ["bench", "cluster", "--bogus"],
        ["bench", "train", "--bogus"],
    ],
)
def test_unknown_arguments_print_the_subcommand_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    command = " ".join(a for a in argv if not a.startswith("-") and a != "1")
    assert err.startswith(f"usage: dynamiq {command} ")
    assert f"dynamiq {command}: error: unrecognized arguments: --bogus" in err


# -- every argument checked before any work ---------------------------------------------------


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every builder of data, models, clusters or measurements fails the test if called."""
    import dynamiq.bench.cluster as cluster
    import dynamiq.bench.compare as compare
    import dynamiq.bench.demo as demo
    import dynamiq.bench.kernels as kernels
    import dynamiq.bench.train as train
    import dynamiq.data as data

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("expensive work started before the arguments were checked")

    for module, name in [
        (data, "load_gradients"),
        (compare, "compare"),
        (demo, "multiprocess_allreduce"),
        (kernels, "bench_kernels"),
        (cluster, "check_available"),
        (cluster, "run_cluster_bench"),
        (train, "run_benchmark"),
    ]:
        monkeypatch.setattr(module, name, forbidden)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--codecs", "nope"], "unknown codec 'nope'; known codecs: bf16"),
        (["compare", "--codecs", "int8,int9"], "unknown codec 'int9'"),
        (["compare", "--codecs", '["int8", {"id": "int", "bits": 9}]'], "bits must be in 2..8"),
        (["compare", "--codecs", '["int8", '], "--codecs is not a valid JSON list"),
        (["compare", "--codecs", '{"id": "int" "bits": 4}'], "line 1, column 14"),
        (["compare", "--schedules", "rng"], "unknown schedule 'rng'"),
        (["compare", "--schedules", ""], "--schedules must name at least one schedule"),
        (["compare", "--workers", "4,x"], "--workers must be comma-separated integers"),
        (["compare", "--workers", "0"], "--workers must be in 1..256 (got 0)"),
        (["compare", "--seeds", "0"], "--seeds must be >= 1 (got 0)"),
        (["compare", "--split", "test"], "--split must be one of eval, fit"),
        (["compare", "--numel", "-1"], "--numel must be >= 0"),
        (["compare", "--plot", "/nonexistent/dir/x.png"], "does not exist"),
        (["demo", "--world-size", "3"], "--world-size must divide the slice's 8 workers"),
        (["demo", "--world-size", "1"], "--world-size must be in 2..8"),
        (["bench", "kernels", "--codecs", "int9"], "unknown codec 'int9'"),
        (["bench", "kernels", "--codecs", ""], "--codecs must name at least one codec"),
        (["bench", "kernels", "--numel", "0"], "--numel must be >= 1"),
        (["bench", "kernels", "--iters", "0"], "--iters must be >= 1"),
        (["bench", "kernels", "--device", "tpu"], "--device must be cpu or cuda"),
        (["bench", "cluster", "--codecs", "nope"], "unknown codec 'nope'"),
        (["bench", "cluster", "--schedules", "rng"], "unknown schedule 'rng'"),
        (["bench", "cluster", "--ranks", "1"], "ranks must be in 2..64"),
        (["bench", "cluster", "--rate", "fast"], "rate"),
        (["bench", "cluster", "--size-mib", "0"], "--size-mib must be a positive number"),
        (["bench", "cluster", "--sysctl", "net.x"], "--sysctl takes KEY=VALUE"),
        (["bench", "train", "--methods", "bf16,nope"], "unknown method 'nope'"),
        (["bench", "train", "--schedule", "rng"], "invalid choice: 'rng'"),
        (["bench", "train", "--steps", "25", "--eval-every", "10"], "multiple of eval_every"),
        (["bench", "train", "--timeout", "0"], "--timeout must be a positive number"),
    ],
)
def test_bad_arguments_fail_before_any_work(
    argv: list[str], message: str, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _status(argv) == 2
    err = capsys.readouterr().err
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert err.startswith(f"usage: dynamiq {command} "), err
    assert f"dynamiq {command}: error: " in err and message in err, err


def test_good_arguments_reach_the_work(
    no_work: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checks pass what they parsed on to the work, unchanged."""
    import dynamiq.bench.compare as compare
    import dynamiq.data as data

    seen: dict[str, Any] = {}

    def fake_compare(
        grads: Any, codecs: Any, schedules: Any, workers: Any, seeds: Any, **kw: Any
    ) -> list[dict[str, Any]]:
        seen.update(codecs=codecs, schedules=schedules, workers=workers, seeds=list(seeds))
        return [{"codec": "int8", "bits/value": 8.5, "vnmse median": 1e-4}]

    monkeypatch.setattr(data, "load_gradients", lambda *a, **k: __import__("torch").zeros(8, 64))
    monkeypatch.setattr(compare, "compare", fake_compare)
    codecs = '["int8", {"id": "int", "bits": 4}]'
    argv = ["compare", "--codecs", codecs, "--schedules", "ring,tree", "--workers", "2,4"]
    assert main([*argv, "--seeds", "2", "--json", "--quiet"]) == 0
    assert seen == {
        "codecs": ["int8", {"id": "int", "bits": 4}],
        "schedules": ["ring", "tree"],
        "workers": [2, 4],
        "seeds": [0, 1],
    }
    assert json.loads(capsys.readouterr().out) == [  # compare's rows start with the family
        {"family": "lm", "values": 64, "codec": "int8", "bits_per_value": 8.5, "vnmse_median": 1e-4}
    ]
