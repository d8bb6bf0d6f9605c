"""The FSDP2 comm's error feedback through AMP overflow steps (dynamiq/fsdp.py, dynamiq/amp.py).

The policy is the DDP hook's (tests/test_ddp_nonfinite.py): a backward whose reduced
gradient holds NaN/±Inf on any rank (GradScaler skips the step) leaves every residual as it
was before it, the next step is finite again, and residuals are kept unscaled. Under FSDP2 the
non-finite value lands on one rank's shard only, so the ranks exchange a flag at the end of
backward: both ranks' residuals must stay, also the one whose own shard was finite.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from dynamiq.bench.ddp_train import TrainConfig, _batch, doc_text
from dynamiq.data.model import build_model, lm_loss
from dynamiq.testing.distributed import run_gloo

pytestmark = pytest.mark.distributed

CFG = TrainConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, batch=4)
INIT_SCALE = 2.0**10
OVERFLOW_STEP = 1


def _run(
    rank: int, world: int, codec: str, mode: Any, *, scaled: bool, steps: int, dtype: Any
) -> dict[str, Any]:
    """``steps`` AMP steps (``dtype`` autocast, GradScaler) of the tiny transformer under FSDP2
    with dynamiq's comm and error feedback ``mode``; at OVERFLOW_STEP (``scaled`` only) rank 1's
    gradient of the last block gets one +inf, in rank 0's shard."""
    from torch.distributed.fsdp import fully_shard

    import dynamiq.fsdp as fsdp_mod

    model = build_model(CFG.model_config(), 0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=scaled)
    state = fsdp_mod.compress(
        model, codec=codec, error_feedback=mode, threshold=0, grad_scaler=scaler
    )
    seen: dict[str, dict[str, torch.Tensor]] = {}  # per module: what FSDP passed, what ran
    real_call, real_rs = fsdp_mod.DynamiqReduceScatter.__call__, fsdp_mod.reduce_scatter

    def call(self: Any, *a: Any, **kw: Any) -> None:
        inp = kw["input_tensor"] if "input_tensor" in kw else a[1]
        if poison and self.name == "blocks.1":
            inp.view(-1)[0] = math.inf  # an element of rank 0's shard: rank 1's stays finite
        seen[self.name] = {"input": inp.detach().reshape(-1).clone()}
        real_call(self, *a, **kw)

    def spy(x: torch.Tensor, *a: Any, **kw: Any) -> Any:
        name = next(n for n, c in state.comms.items() if c.index << 20 == kw["seed"] ^ state.seed)
        seen[name]["work"] = x.detach().clone()
        return real_rs(x, *a, **kw)

    fsdp_mod.DynamiqReduceScatter.__call__ = call  # type: ignore[method-assign]
    fsdp_mod.reduce_scatter = spy
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = doc_text()
    poison = False
    out: dict[str, Any] = {"steps": []}
    try:
        for step in range(steps):
            seen.clear()
            before = [p.detach().full_tensor().clone() for p in model.parameters()]
            scale = scaler.get_scale() if scaled else 1.0
            poison = scaled and step == OVERFLOW_STEP and rank == 1
            with torch.autocast("cpu", dtype=dtype):
                loss = lm_loss(model, _batch(data, CFG, rank, world, step))
            scaler.scale(loss).backward()
            grads = [p.grad.full_tensor() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            after = [p.detach().full_tensor() for p in model.parameters()]
            out["steps"].append(
                {
                    "scale": scale,
                    "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
                    "moved": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                    "residuals": {k: v.clone() for k, v in state.residuals.items()},
                    "seen": {k: dict(v) for k, v in seen.items()},
                }
            )
    finally:
        fsdp_mod.DynamiqReduceScatter.__call__ = real_call  # type: ignore[method-assign]
        fsdp_mod.reduce_scatter = real_rs
    out["shard"] = {k: c.index for k, c in state.comms.items()}
    return out


def _direct(rank: int, world: int) -> dict[str, Any]:
    """The comm called outside backward (each call its own step): a finite call, then one
    with +inf in rank 1's input, in rank 0's range."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dynamiq.fsdp

    model = build_model(CFG.model_config(), 0)
    fully_shard(model)
    # shard-local: rank 1's residual (of its own range) is finite, yet must not be stored
    state = dynamiq.fsdp.compress(model, codec="int8", error_feedback="shard", threshold=0)
    comm, s = state.comms["<root>"], 1000
    x = torch.randn(world * s, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(s)
    kept = []
    for inp in (x, _bad_input(x, rank), x):
        comm(out, inp.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
        kept.append((bool(torch.isfinite(out).all()), state.residuals["<root>"].clone()))
    return {"kept": kept, "calls": dict(state.calls)}


def _bad_input(x: torch.Tensor, rank: int) -> torch.Tensor:
    bad = x.clone()
    if rank == 1:
        bad[0] = math.inf  # in rank 0's range
    return bad


def _job(rank: int, world: int, cases: list[tuple[str, Any]], dtype: Any) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    res: dict[str, Any] = {"direct": _direct(rank, world)}
    for codec, mode in cases:
        key = f"{codec}/{mode}"
        res[key] = _run(rank, world, codec, mode, scaled=True, steps=3, dtype=dtype)
        res[key + "/unscaled"] = _run(rank, world, codec, mode, scaled=False, steps=1, dtype=dtype)
    return res


BF16_CASES = [("int8", True), ("dynamiq", "shard")]


@pytest.fixture(scope="module")
def bf16() -> list[tuple[str, Any]]:
    results = run_gloo(_job, 2, BF16_CASES, torch.bfloat16, timeout=300)
    assert all(s == "ok" for s, _ in results), results
    return results


def test_direct_calls_outside_backward_are_steps_of_their_own(bf16: list) -> None:
    for rank, (_, res) in enumerate(bf16):
        (ok0, r0), (ok1, r1), (ok2, r2) = res["direct"]["kept"]
        assert ok0 and ok2 and float(r0.abs().max()) > 0
        assert ok1 == (rank == 1)  # the inf lands on rank 0's shard only
        assert torch.equal(r1, r0), rank  # the non-finite call kept the residual, both ranks
        assert bool(torch.isfinite(r2).all()) and not torch.equal(r2, r0)  # the next one did
        assert res["direct"]["calls"] == {"<root>": 3}


@pytest.mark.parametrize(
    ("cases", "dtype"),
    [
        (BF16_CASES, torch.bfloat16),
        pytest.param([("int8", "shard")], torch.float16, marks=pytest.mark.slow),
    ],
)
def test_overflow_step_keeps_residuals_and_scale_changes_keep_units(
    cases: list[tuple[str, Any]], dtype: Any, request: pytest.FixtureRequest
) -> None:
    if dtype == torch.bfloat16:
        results = request.getfixturevalue("bf16")
    else:
        results = run_gloo(_job, 2, cases, dtype, timeout=300)
        assert all(s == "ok" for s, _ in results), results
    for codec, mode in cases:
        key = f"{codec}/{mode}"
        for rank, (_, res) in enumerate(results):
            steps, k = res[key]["steps"], OVERFLOW_STEP
            for s in steps[:k]:  # before: finite, trained, residuals finite
                assert s["grads_finite"] and s["moved"], (key, rank)
                assert s["residuals"] and all(
                    bool(torch.isfinite(v).all()) for v in s["residuals"].values()
                )
            assert any(float(v.abs().max()) > 0 for v in steps[k - 1]["residuals"].values())
            # the overflow step: non-finite (on rank 0's shard only), skipped, the scale
            # halved, and both ranks' residuals exactly as before it
            bad = steps[k]
            assert not bad["grads_finite"] and not bad["moved"], (key, rank)
            assert steps[k + 1]["scale"] == bad["scale"] / 2
            kept = steps[k - 1]["residuals"]
            assert bad["residuals"].keys() == kept.keys()
            for name, v in bad["residuals"].items():
                assert torch.equal(v, kept[name]), (key, rank, name)
            # the step after: finite, trained; what ran is FSDP's input plus the residual from
            # before the overflow times the new scale (kept unscaled)
            nxt = steps[k + 1]
            assert nxt["grads_finite"] and nxt["moved"], (key, rank)
            assert all(bool(torch.isfinite(v).all()) for v in nxt["residuals"].values())
            assert nxt["seen"].keys() == kept.keys()
            for name, seen in nxt["seen"].items():
                want = seen["input"].float().clone()
                old = kept[name] * nxt["scale"]
                if mode == "shard":
                    n = want.numel() // 2
                    want[rank * n : (rank + 1) * n] += old
                else:
                    want += old
                assert torch.equal(seen["work"], want), (key, rank, name)
            # units: the first step's residuals with loss scaling (2^10) are those without it
            # (scaling by a power of two is exact, up to underflow). Not for fp16, whose
            # unscaled backward underflows (why GradScaler exists).
            if dtype == torch.float16:
                continue
            plain = res[key + "/unscaled"]["steps"][0]["residuals"]
            for name, v in steps[0]["residuals"].items():
                ref = plain[name]
                tol = 1e-3 * float(ref.abs().max())
                assert torch.allclose(v, ref, rtol=1e-2, atol=tol), (key, name)
