"""Tests for the model families of ``dynamiq.data`` (``lm``, ``mlm``, ``digits``).

Fast: each family's committed slice (shape, recorded statistics, loss curve),
BERT masking against its definition, tiny end-to-end generations (determinism,
disjoint shards), and ``compare`` on each slice. The full data sets are never
generated here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dynamiq.data as dd
from dynamiq.bench.cli import main as cli_main
from dynamiq.bench.compare import compare, compare_families
from dynamiq.data import gradients as gr
from dynamiq.data.__main__ import main as data_main
from dynamiq.data.digits import DigitsConfig
from dynamiq.data.families import parse_families
from dynamiq.data.gradients import DataConfig
from dynamiq.data.mlm import MASK_ID, MLMConfig, mask_bytes
from dynamiq.data.model import ModelConfig

NEW = ("mlm", "digits")

# Recorded in docs/benchmarks.md ("More model families"): the shape of each slice, the
# parameter count N and the eval split's statistics (32 workers) at generation.
SLICE_COLS = {"lm": 32768, "mlm": 32768, "digits": 30282}
NUMEL = {"lm": 3_323_648, "mlm": 2_518_529, "digits": 548_746}
# the first training step's loss is that of a near-uniform prediction (ln of the classes)
CLASSES = {"mlm": MASK_ID + 1, "digits": 10}

TINY: dict[str, dd.Family] = {
    "lm": DataConfig(
        model=ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16),
        stdlib_bytes=20_000,
        include_docs=False,
        train_steps=6,
        train_batch=4,
        worker_batch=2,
        max_workers=4,
    ),
    "mlm": MLMConfig(
        d_model=32,
        n_layers=1,
        n_heads=2,
        seq_len=16,
        stdlib_bytes=20_000,
        include_docs=False,
        train_steps=6,
        train_batch=4,
        worker_batch=2,
        max_workers=4,
    ),
    "digits": DigitsConfig(
        channels=(4, 8), hidden=16, train_steps=6, train_batch=8, worker_batch=4, max_workers=4
    ),
}


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- registry


def test_registry() -> None:
    assert dd.FAMILIES == ("lm", "mlm", "digits")
    for name in dd.FAMILIES:
        assert dd.family_config(name).name == name
    assert parse_families("all") == ["lm", "mlm", "digits"]
    assert parse_families("digits,lm") == ["digits", "lm"]
    for bad, msg in (
        ("bert", r"unknown family 'bert'; known families: lm, mlm, digits"),
        ("lm,lm", r"families must not repeat"),
        ("lm,", r"comma-separated list"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_families(bad)
    with pytest.raises(ValueError, match=r"unknown family 'x'"):
        dd.family_config("x")


def test_config_of_another_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config is a 'digits' configuration but family is 'mlm'"):
        dd.load_gradients(family="mlm", config=DigitsConfig(), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_parameter_counts() -> None:
    for name in dd.FAMILIES:
        model = dd.family_config(name).build_model()
        assert sum(p.numel() for p in model.parameters()) == NUMEL[name]
    assert NUMEL["mlm"] > 1 << 21 and NUMEL["digits"] > 1 << 19  # the compare buffer sizes


def test_digits_without_sklearn_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"needs scikit-learn .*dynamiq-allreduce\[data\]"):
        DigitsConfig().build_source()


# --------------------------------------------------------------------------- slices


@pytest.mark.parametrize("family", dd.FAMILIES)
def test_slice_shape(family: str) -> None:
    g = dd.load_slice(family)
    assert tuple(g.shape) == (8, SLICE_COLS[family]) and g.dtype == torch.float32
    assert bool(torch.isfinite(g).all())
    info = dd.load_slice_info(family)
    idx = info["indices"]
    assert idx.shape == (SLICE_COLS[family],) and idx.unique().numel() == idx.numel()
    assert int(idx.max()) < NUMEL[family]
    for i in range(8):
        for j in range(i + 1, 8):
            assert not torch.equal(g[i], g[j])


@pytest.mark.parametrize("family", NEW)
def test_slice_records_the_full_split(family: str) -> None:
    info = dd.load_slice_info(family)
    assert info["numel"] == NUMEL[family]
    full = info["full_stats"]
    assert full["workers"] == 32 and full["numel"] == NUMEL[family]
    assert full["kurtosis"] > 30  # heavy tails: ten times the Gaussian's 3
    assert full["norm_max_min_ratio"] > 1.0
    # the slice's own statistics are those of its rows (fp64, recomputed here)
    mine = dd.gradient_stats(dd.load_slice(family))
    rows = dd.load_slice(family).double()
    assert mine["norm_max"] == pytest.approx(float(rows.norm(dim=1).max()), rel=1e-12)
    assert len(info["worker_losses"]) == 8 and all(v >= 0 for v in info["worker_losses"])


# The eval split's statistics recorded in docs/benchmarks.md ("More model families").
RECORDED = {
    "mlm": {"kurtosis": 4910, "norm_max_min_ratio": 2.219, "absmax_over_rms": 177.7},
    "digits": {"kurtosis": 1175, "norm_max_min_ratio": 3757728, "absmax_over_rms": 67.28},
}


@pytest.mark.parametrize("family", NEW)
def test_slice_recorded_statistics(family: str) -> None:
    full = dd.load_slice_info(family)["full_stats"]
    for key, value in RECORDED[family].items():
        assert full[key] == pytest.approx(value, rel=1e-3), key


def test_family_traits() -> None:
    digits = dd.load_slice_info("digits")["full_stats"]
    assert digits["norm_max_min_ratio"] > 1e5  # converged: most workers' batches are easy
    assert 0.3 < digits["zero_fraction"] < 0.45  # ReLU units dead for a whole batch
    mlm = dd.load_slice_info("mlm")["full_stats"]
    # the output projection is tied to the embedding: every row gets a gradient
    assert mlm["zero_fraction"] < 1e-4
    lm = dd.gradient_stats(dd.load_slice("lm"))
    assert lm["zero_fraction"] > 0.05  # lm's untied embedding: rows of absent bytes are 0


@pytest.mark.parametrize("family", NEW)
def test_loss_curve_fell(family: str) -> None:
    curve = dd.load_slice_info(family)["train_loss_curve"]
    cfg = dd.family_config(family)
    assert len(curve) == cfg.train_steps
    assert curve[0] == pytest.approx(math.log(CLASSES[family]), abs=0.25)
    k = max(1, len(curve) // 20)
    first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
    assert last < 0.7 * first


# --------------------------------------------------------------------------- masking


def test_mask_bytes_follows_bert() -> None:
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 256, (400, 64), generator=gen)
    inputs, labels = mask_bytes(windows, 0.15, torch.Generator().manual_seed(1))
    chosen = labels != -100
    assert torch.equal(labels[chosen], windows[chosen])
    assert torch.equal(inputs[~chosen], windows[~chosen])  # unchosen bytes are untouched
    assert bool(chosen.any(dim=1).all())  # every window has a target
    frac = float(chosen.double().mean())
    assert 0.14 < frac < 0.16
    masked = float((inputs[chosen] == MASK_ID).double().mean())
    kept = float((inputs[chosen] == windows[chosen]).double().mean())
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13  # 80 % [MASK]; 10 % kept (+ 1/256)
    assert int(inputs.max()) <= MASK_ID and int(inputs[inputs != MASK_ID].max()) < 256
    again = mask_bytes(windows, 0.15, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


def test_mask_bytes_one_target_even_when_unlikely() -> None:
    windows = torch.zeros((50, 8), dtype=torch.int64)
    _, labels = mask_bytes(windows, 1e-9, torch.Generator().manual_seed(2))
    assert torch.equal((labels != -100).sum(dim=1), torch.ones(50, dtype=torch.int64))


# --------------------------------------------------------------------------- generation


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _generate(cfg: dd.Family, cache: Path) -> tuple[np.ndarray, dict[str, Any], str]:
    grads, meta = gr.load_or_generate("eval", 3, cfg, cache_dir=cache, progress=False)
    (npy,) = cache.glob(f"{cfg.name}-gradients-v1-eval-*.npy")
    return grads, meta, _sha(npy)


@pytest.mark.parametrize("family", NEW)
def test_generation_is_deterministic(family: str, tmp_path: Path, one_thread: None) -> None:
    cfg = TINY[family]
    a, meta, sha_a = _generate(cfg, tmp_path / "a")
    b, _, sha_b = _generate(cfg, tmp_path / "b")
    assert sha_a == sha_b and np.array_equal(a, b)  # same seed: the same bytes
    c, _, sha_c = _generate(dataclasses.replace(cfg, seed=1), tmp_path / "c")  # type: ignore[type-var]
    assert sha_c != sha_a and not np.array_equal(a, c)
    assert a.shape == (3, meta["numel"]) and meta["family"] == family
    assert meta["config"] == cfg.to_dict()
    assert len(meta["train"]["train_loss_curve"]) == cfg.train_steps
    # the model file is the family's own (no collision with lm's names)
    assert len(list((tmp_path / "a").glob(f"{family}-model-v1-*.pt"))) == 1


def _ids(meta: dict[str, Any]) -> list[Any]:
    return [json.dumps(x) for shard in meta["worker_shards"] for x in shard]


@pytest.mark.parametrize("family", NEW)
def test_shards_are_disjoint(family: str, tmp_path: Path, one_thread: None) -> None:
    cfg = TINY[family]
    _, ev = gr.load_or_generate("eval", 4, cfg, cache_dir=tmp_path, progress=False)
    _, fit = gr.load_or_generate("fit", 4, cfg, cache_dir=tmp_path, progress=False)
    ids_e, ids_f = _ids(ev), _ids(fit)
    assert len(ids_e) == len(set(ids_e)) == 4 * cfg.worker_batch  # no example twice
    assert not set(ids_e) & set(ids_f)  # eval and fit never share an example
    regions = ev["data"]["regions"]
    (e0, e1), (f0, f1), (t0, t1) = regions["eval"], regions["fit"], regions["train"]
    assert e1 <= f0 and f1 <= t0 < t1
    if family == "digits":  # image ids: the permuted regions, train never shares them
        src = cfg.build_source()
        assert isinstance(src, dd.digits.DigitsSource)
        perm = src._perm.tolist()
        assert set(map(int, ids_e)) <= set(perm[e0:e1])
        assert set(map(int, ids_f)) <= set(perm[f0:f1])
        assert not set(perm[t0:t1]) & (set(map(int, ids_e)) | set(map(int, ids_f)))
    else:  # byte ranges inside each split's region, non-overlapping
        spans = [json.loads(x) for x in ids_e]
        assert all(e0 <= a < b <= e1 for a, b in spans)
        spans.sort()
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))


def test_worker_batch_independent_of_worker_count(tmp_path: Path, one_thread: None) -> None:
    cfg = TINY["mlm"]
    two, _ = gr.load_or_generate("fit", 2, cfg, cache_dir=tmp_path / "a", progress=False)
    four, _ = gr.load_or_generate("fit", 4, cfg, cache_dir=tmp_path / "b", progress=False)
    assert np.array_equal(two, four[:2])  # same masks and text for worker 0 and 1


def test_main_rejects_too_many_workers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        data_main(["--family", "digits", "--workers", "33"])
    assert exc.value.code == 2
    assert "--workers must be <= 32 for family digits" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        data_main(["--family", "gpt"])
    assert "unknown family 'gpt'" in capsys.readouterr().err


# --------------------------------------------------------------------------- compare


@pytest.mark.parametrize("family", dd.FAMILIES)
def test_compare_on_each_family(family: str) -> None:
    grads = dd.load_slice(family)
    rows = compare(grads, ["int8", "bf16"], ["ring"], [4], [0], progress=False)
    assert [r["codec"] for r in rows] == ["int8", "bf16"]
    for r in rows:
        assert 0 < r["vnmse median"] < 1e-2
    # int8's 32-value blocks with a bf16 scale: 8.5 bits/value (+ length headers)
    assert 8.5 <= rows[0]["bits/value"] < 8.6


def test_compare_families_tags_rows() -> None:
    def load(split: str, workers: int, *, family: str, progress: bool) -> torch.Tensor:
        assert split == "eval" and workers == 4
        return dd.load_slice(family)

    rows = compare_families(
        ["all"], ["int8"], ["ring", "butterfly"], [4], [0], numel=8192, progress=False, load=load
    )
    assert [(r["family"], r["schedule"]) for r in rows] == [
        (f, s) for f in dd.FAMILIES for s in ("ring", "butterfly")
    ]
    assert all(r["values"] == 8192 for r in rows)
    # each family's numbers are its own data's
    assert len({r["vnmse median"] for r in rows}) == len(rows)
    with pytest.raises(ValueError, match=r"numel=40000 is more than family digits's 30282 values"):
        compare_families(["digits"], ["int8"], ["ring"], [4], [0], numel=40000, load=load)


def test_cli_compare_unknown_family(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", "--family", "resnet"])
    assert exc.value.code == 2
    assert "unknown family 'resnet'; known families: lm, mlm, digits" in capsys.readouterr().err


def _compare_all() -> Any:
    import importlib.util

    name = "compare_all_families_under_test"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_all.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_compare_all_reports_every_family() -> None:
    mod = _compare_all()
    rows = []
    # DynamiQ wins on lm (vNMSE 1e-3 against 2e-3) and loses on digits (4e-3 against 2e-3)
    for family, dq in (("lm", 1e-3), ("digits", 4e-3)):
        for s in mod.SCHEDULES:
            for n in mod.WORKERS:
                for codec, bpv, err in (("dynamiq", 4.97, dq), ("mxfp8_e4m3", 8.25, 2e-3)):
                    rows.append(
                        {
                            "codec": codec,
                            "key": mod.key(codec),
                            "family": family,
                            "values": 524288,
                            "schedule": s,
                            "workers": n,
                            "bits/value": bpv,
                            "vnmse median": err,
                            "vnmse max": err,
                        }
                    )
    md = mod.tables(rows)
    assert "### family `lm`, 524,288 values per worker" in md
    assert "### family `digits`, 524,288 values per worker" in md
    versus = md.split("### DynamiQ (default) against `mxfp8_e4m3`, every family")[1]
    lines = {ln.split("|")[1].strip(): ln for ln in versus.splitlines() if ln.startswith("| ")}
    assert lines["lm"].count("| 2 ") == 8  # 2e-3 / 1e-3 in every cell
    assert lines["digits"].count("**0.5**") == 8  # a loss, in bold
    assert "| 524,288 | 4.970 | 8.250 |" in lines["digits"]
    # rows cached before the families are lm's full buffers
    legacy = [{k: v for k, v in r.items() if k not in ("family", "values")} for r in rows[:16]]
    assert "### Every codec" in mod.tables(legacy).splitlines()[0]
