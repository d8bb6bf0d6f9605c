"""``dynamiq bench train``: the in-process numerics against real DDP, and the command end to end.

(No postponed annotations needed here; DDP runs in the spawned ranks of ``run_gloo``.)
"""

import json
import math

import pytest
import torch

from dynamiq.bench.cli import main
from dynamiq.bench.train import QUICK, TTAConfig, _steps_to, run_benchmark, train_inprocess
from dynamiq.bench.train_ranks import _loopback_job
from dynamiq.testing.distributed import run_gloo

# the quick model with a small bucket cap, so DDP's rebuilt layout has several buckets
CFG = TTAConfig(**{**QUICK, "bucket_cap_mb": 0.02})
STEPS = 3


def _real(methods: list[str], world: int, cfg: TTAConfig = CFG, seed: int = 1) -> list[list]:
    """Averaged gradients of the first STEPS steps of real DDP on ``world`` gloo ranks."""
    runs = [{"method": m, "seed": seed, "steps": STEPS, "capture_grads": STEPS} for m in methods]
    res = run_gloo(_loopback_job, world, {"cfg": cfg.to_dict(), "runs": runs}, timeout=300)
    assert all(status == "ok" for status, _ in res), res
    return [[run["grads"] for run in value] for _, value in res]  # [rank][method][step]


@pytest.mark.distributed
def test_inprocess_numerics_equal_real_ddp_on_two_ranks() -> None:
    """fp32 (plain DDP), PyTorch's bf16 hook and the dynamiq hook (error feedback, DDP's
    bucket rebuild after step 0) give bit-identical averaged gradients in process and over
    two real gloo ranks, step after step."""
    methods = ["fp32", "bf16", "dynamiq"]
    real = _real(methods, 2)
    mine = {}
    for i, m in enumerate(methods):
        run = train_inprocess(m, CFG, 1, steps=STEPS, capture_grads=STEPS)
        assert len(run.extra["buckets"]) > 1  # the rebuilt layout was exercised
        mine[m] = run.grads
        for rank in range(2):
            for step in range(STEPS):
                assert torch.equal(run.grads[step], real[rank][i][step]), (m, rank, step)
    # the three really are different numerics (the comparison could fail)
    assert not torch.equal(mine["fp32"][0], mine["bf16"][0])
    assert not torch.equal(mine["fp32"][0], mine["dynamiq"][0])


@pytest.mark.slow
@pytest.mark.distributed
def test_inprocess_numerics_against_real_ddp_on_four_ranks() -> None:
    """On 4 ranks the dynamiq hook is still bit-identical; gloo adds fp32 and bf16 in its own
    ring order, so the first step's average differs from ours by at most what two orders
    of W - 1 roundings can: 2 (W - 1) u sum_i |t_i| with t_i = g_i / W and u the unit
    roundoff (2^-24 fp32; 2^-8 bf16), plus our own final rounding (fp32)."""
    cfg = TTAConfig(**{**QUICK, "bucket_cap_mb": 0.02, "workers": 4})
    methods = ["fp32", "bf16", "dynamiq"]
    real = _real(methods, 4, cfg)
    for i, m in enumerate(methods):
        run = train_inprocess(m, cfg, 1, steps=STEPS, capture_grads=STEPS)
        for rank in range(4):
            if m == "dynamiq":
                for step in range(STEPS):
                    assert torch.equal(run.grads[step], real[rank][i][step])
                continue
            terms = _local_terms(cfg, m)
            u = 2.0**-24 if m == "fp32" else 2.0**-8
            slack = 2 * 3 * u * 1.01 * terms.abs().sum(0) + 2.0**-24 * terms.sum(0).abs()
            diff = (run.grads[0].double() - real[rank][i][0].double()).abs()
            assert bool((diff <= slack + 2.0**-140).all()), m


def _local_terms(cfg: TTAConfig, method: str) -> torch.Tensor:
    """Each worker's first-step gradient as the collective adds it: g / W (bf16: rounded)."""
    from dynamiq.bench.ddp_train import lm_loss
    from dynamiq.bench.train_setup import text_splits, threads, train_batch
    from dynamiq.data.model import build_model

    train, _ = text_splits(cfg)
    rows = []
    for w in range(cfg.workers):
        model = build_model(cfg.model_config(), 1)
        with threads(1):
            lm_loss(model, train_batch(train, cfg, 1, 0, w)).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if method == "bf16":
            g = g.to(torch.bfloat16).float()
        rows.append(g.double() / cfg.workers)
    return torch.stack(rows)


@pytest.mark.distributed
def test_quick_run_writes_results_and_pngs(tmp_path, capsys) -> None:
    argv = ["bench", "train", "--quick", "--methods", "fp32,bf16,dynamiq", "--quiet"]
    assert main([*argv, "--network", "loopback", "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["tta"] == out["tta"]
    for name in ("loss_curves.png", "tta.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = out["config"]
    assert out["methods"] == ["fp32", "bf16", "dynamiq"] and out["seeds"] == [0, 1]
    assert out["max_steps"] == 30 and cfg["workers"] == 2
    # convergence: one curve per method and seed, from the initial weights to max_steps
    for m in out["methods"]:
        for s in ("0", "1"):
            run = out["convergence"][m]["seeds"][s]
            assert [p[0] for p in run["curve"]] == list(range(0, 31, cfg["eval_every"]))
            assert run["curve"][-1][1] < run["curve"][0][1] - 0.5  # it learns
            assert run["final"] == dict(map(tuple, run["curve"]))[cfg["steps"]]
    # the target is bf16's own final loss, which bf16 reaches at the budget at the latest
    for s in ("0", "1"):
        assert out["target"]["per_seed"][s] == out["convergence"]["bf16"]["seeds"][s]["final"]
        assert out["convergence"]["bf16"]["seeds"][s]["steps_to_target"] <= cfg["steps"]
    rows = {r["method"]: r for r in out["tta"]}
    for r in rows.values():
        assert r["step_seconds"] > 0 and r["compute_seconds"] > 0
        for n, t in zip(r["steps_to_target"], r["tta_seconds"], strict=True):
            assert (t is None) == (n is None)
            if n is not None:
                assert t == pytest.approx(n * r["step_seconds"])
    assert rows["bf16"]["tta_speedup_vs_bf16"] == 1.0
    assert rows["dynamiq"]["payload_bytes_per_step"] < rows["bf16"]["payload_bytes_per_step"]
    assert {"final_loss_gap", "final_loss_tolerance", "final_loss_met"} <= set(out["verdict"])
    # the real end-to-end runs follow the in-process curves exactly (2 ranks: same numerics)
    for m in ("bf16", "dynamiq"):
        val = out["validation"][m]
        curve = out["convergence"][m]["seeds"]["0"]["curve"]
        assert val["curve"] == curve[: len(val["curve"])]
        assert val["steps_measured"] == val["steps_predicted"]
        if val["steps_measured"] is not None:
            assert val["tta_measured"] > 0 and math.isfinite(val["error"])
    assert out["validation"]["bf16"]["steps_measured"] is not None
    # the convergence can be reused to time another network without training again
    again = ["--convergence-from", str(tmp_path / "results.json"), "--network", "none"]
    assert main([*argv, *again, "--out", "", "--json"]) == 0
    reused = json.loads(capsys.readouterr().out)
    assert reused["convergence"] == out["convergence"] and reused["step_time"] == {}


def test_steps_to_target() -> None:
    curve = [(0, 1.0), (10, 3.0), (20, 2.4), (30, 2.6), (40, 2.0)]
    assert _steps_to(curve, 2.5) == 20  # the first evaluation at or below, noise and all
    assert _steps_to(curve, 2.0) == 40
    assert _steps_to(curve, 1.5) is None  # step 0 (initial weights) does not count


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "fp32,mxfp8_e4m3"], "methods must include bf16"),
        (["--methods", "bf16,nope"], "unknown method 'nope'"),
        (["--methods", "bf16,bf16"], "method 'bf16' is listed twice"),
        (["--steps", "25", "--eval-every", "10"], "steps must be a multiple of eval_every"),
        (["--rate", "fast"], "rate must be a number followed by bit"),
        (["--workers", "0"], "workers must be an integer >= 1 (got 0)"),
        (["--d-model", "30", "--heads", "4"], "d_model must be divisible by n_heads"),
        (["--extra", "-1"], "extra must be a number"),
        (["--seeds", "0"], "seeds must be >= 1"),
        (["--convergence-from", "/nonexistent/results.json"], "cannot read --convergence-from"),
    ],
)
def test_bad_options_are_clear_errors(argv: list[str], message: str, capsys) -> None:
    assert main(["bench", "train", *argv, "--quiet", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dynamiq bench train ")  # the subcommand's usage, then why
    assert "\ndynamiq bench train: error: " in err and message in err


def test_unavailable_cluster_says_what_to_do(monkeypatch) -> None:
    from dynamiq.bench import netns

    def refuse() -> None:
        raise netns.NamespaceUnavailable("creating network namespaces needs root")

    monkeypatch.setattr(netns, "check_available", refuse)
    with pytest.raises(RuntimeError, match="needs root.*--network loopback"):
        run_benchmark(TTAConfig(**QUICK), ["bf16"], [0], network="cluster", progress=False)


def test_convergence_from_other_settings_is_refused() -> None:
    saved = {"config": {**TTAConfig(**QUICK).to_dict(), "d_model": 32}, "convergence": {}}
    with pytest.raises(ValueError, match="trained with d_model=32"):
        run_benchmark(TTAConfig(**QUICK), ["bf16"], [0], network="none", convergence_from=saved)


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_on_the_emulated_cluster(tmp_path, capsys) -> None:
    from dynamiq.bench import netns

    try:
        netns.check_available()
    except netns.NamespaceUnavailable as exc:
        pytest.skip(f"no emulated cluster here: {exc}")
    argv = ["bench", "train", "--quick", "--methods", "bf16,dynamiq", "--quiet", "--json"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shaping"]["rate"] == "100mbit"
    rows = {r["method"]: r for r in out["tta"]}
    # bytes on the wire, read from each rank's interface: dynamiq sends well under bf16
    assert 0 < rows["dynamiq"]["wire_tx_bytes_per_step"] < rows["bf16"]["wire_tx_bytes_per_step"]
    for m in ("bf16", "dynamiq"):
        assert out["validation"][m]["steps_measured"] == out["validation"][m]["steps_predicted"]
