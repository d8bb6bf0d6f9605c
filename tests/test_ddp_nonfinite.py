"""Error feedback through non-finite steps and loss scaling (dynamiq/ddp.py, DynamiqState).

The hook keeps a bucket's residual from before a step whose all-reduced result is non-finite
(what GradScaler skips), and keeps residuals unscaled. Its premise: a non-finite gradient on
any rank makes the result non-finite on every rank (checked here for every registered codec
and schedule), so every rank takes the same decision without an extra message.

(No postponed annotations: DDP checks a hook's annotations as objects.)
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dynamiq.bench.ddp_train import TrainConfig, _batch, _loss, doc_text
from dynamiq.codecs import list_codecs
from dynamiq.collectives.api import simulate_allreduce
from dynamiq.data.model import ModelConfig, build_model
from dynamiq.testing.distributed import run_gloo

CFG = TrainConfig(d_model=32, n_layers=1, n_heads=4, seq_len=16, batch=4, steps=4)
MCFG = ModelConfig(d_model=32, n_layers=1, n_heads=4, seq_len=16)
INIT_SCALE = 2.0**10
OVERFLOW_STEP = 2


@pytest.mark.parametrize("name", list_codecs())
def test_one_nonfinite_input_makes_every_rank_output_nonfinite(name: str) -> None:
    """The premise of the hook's policy, for every registered codec and schedule."""
    gen = torch.Generator().manual_seed(0)
    cases = [("ring", 2, {}), ("butterfly", 4, {}), ("tree", 3, {})]
    cases.append(("hierarchical", 4, {"ranks_per_node": 2}))
    for schedule, world, options in cases:
        for bad in (math.inf, -math.inf, math.nan):
            xs = [torch.randn(3000, generator=gen) for _ in range(world)]
            xs[world - 1][1234] = bad
            res = simulate_allreduce(
                xs, name, schedule, threshold=0, return_bound=False, schedule_options=options
            )
            for r, out in enumerate(res.outputs):
                assert not bool(torch.isfinite(out).all()), (name, schedule, bad, r)
                assert torch.equal(out.view(torch.int32), res.outputs[0].view(torch.int32))


def _snapshot(state: object) -> dict:
    return {k: v.clone() for k, v in state.residuals.items()}  # type: ignore[attr-defined]


def _run(
    codec: str,
    rank: int,
    world: int,
    *,
    scaled: bool,
    steps: int,
    inject: bool,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """``steps`` AMP steps (``dtype`` autocast, GradScaler) of a small model through the hook
    with error feedback; at OVERFLOW_STEP (``inject``), rank 1's gradient gets one +inf."""
    import dynamiq.ddp as ddp_mod
    from dynamiq.ddp import DynamiqState, dynamiq_hook

    model = build_model(MCFG, 0)
    ddp = DDP(model, bucket_cap_mb=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=scaled)
    state = DynamiqState(codec=codec, error_feedback=True, threshold=0, grad_scaler=scaler)
    grads: dict[int, torch.Tensor] = {}  # per bucket index: the bucket's gradient
    works: dict[int, torch.Tensor] = {}  # and what the hook handed to allreduce

    def hook(st: DynamiqState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        grads[bucket.index()] = bucket.buffer().clone()
        return dynamiq_hook(st, bucket)

    real = ddp_mod.allreduce

    def spy(work: torch.Tensor, *args, **kw):  # type: ignore[no-untyped-def]
        works[kw["seed"] >> 20] = work.clone()  # the hook's seed: state.seed ^ (index << 20)
        return real(work, *args, **kw)

    ddp_mod.allreduce = spy
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = doc_text()
    out: dict = {"steps": []}
    try:
        for step in range(steps):
            grads.clear()
            works.clear()
            before = [p.detach().clone() for p in model.parameters()]
            scale = scaler.get_scale() if scaled else 1.0
            with torch.autocast("cpu", dtype=dtype):
                loss = _loss(ddp, _batch(data, CFG, rank, world, step))
            handle = None
            if inject and step == OVERFLOW_STEP and rank == 1:
                p0 = next(model.parameters())
                handle = p0.register_hook(
                    lambda g: g.flatten().index_fill(0, torch.tensor([0]), math.inf).view_as(g)
                )
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            moved = any(
                not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
            )
            out["steps"].append(
                {
                    "scale": scale,
                    "grads_finite": finite,
                    "moved": moved,
                    "residuals": _snapshot(state),
                    "buckets": [
                        {"index": i, "grad": g, "work": works[i]} for i, g in grads.items()
                    ],
                }
            )
    finally:
        ddp_mod.allreduce = real
        state.close()
    return out


def _job(rank: int, world: int, codecs: tuple[str, ...], dtype: torch.dtype) -> dict:
    out = {}
    for codec in codecs:
        out[codec] = _run(codec, rank, world, scaled=True, steps=4, inject=True, dtype=dtype)
        out[codec + "/unscaled"] = _run(
            codec, rank, world, scaled=False, steps=1, inject=False, dtype=dtype
        )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("codecs", "dtype"),
    [
        (("int8", "dynamiq"), torch.bfloat16),
        pytest.param(("int8",), torch.float16, marks=pytest.mark.slow),  # fp16 autocast
    ],
)
def test_overflow_step_keeps_residuals_and_scale_changes_keep_units(
    codecs: tuple[str, ...], dtype: torch.dtype
) -> None:
    results = run_gloo(_job, 2, codecs, dtype, timeout=240)
    assert all(s == "ok" for s, _ in results), results
    for codec in codecs:
        for _, res in results:
            steps = res[codec]["steps"]
            k = OVERFLOW_STEP
            # the steps before: finite, residuals non-zero and finite
            for s in steps[:k]:
                assert s["grads_finite"] and s["moved"]
                assert s["residuals"] and all(
                    bool(torch.isfinite(v).all()) for v in s["residuals"].values()
                )
            assert any(float(v.abs().max()) > 0 for v in steps[k - 1]["residuals"].values())
            # the overflow step: non-finite on every rank, skipped, the scale halved, and the
            # residuals exactly as they were before it
            bad = steps[k]
            assert not bad["grads_finite"] and not bad["moved"], codec
            assert steps[k + 1]["scale"] == bad["scale"] / 2
            assert bad["residuals"].keys() == steps[k - 1]["residuals"].keys()
            for i, v in bad["residuals"].items():
                assert torch.equal(v, steps[k - 1]["residuals"][i]), (codec, i)
            # the step after: finite again, and its input is the gradient plus the residual
            # from before the overflow times the new scale (residuals are kept unscaled)
            after = steps[k + 1]
            assert after["grads_finite"] and after["moved"], codec
            assert all(bool(torch.isfinite(v).all()) for v in after["residuals"].values())
            for b in after["buckets"]:
                kept = steps[k - 1]["residuals"][b["index"]]
                want = (b["grad"].float() + kept * after["scale"]).to(b["grad"].dtype)
                assert torch.equal(b["work"], want), (codec, b["index"])
            # units: the residuals of the first step with loss scaling (scale 2^10) are those
            # of the same step without it (powers of two scale exactly, up to bf16 underflow).
            # Not for fp16: without loss scaling its backward underflows (why GradScaler
            # exists), so that run's gradients are not the same; the check of the step after
            # the overflow (input = grad + residual · new scale) holds the units there.
            if dtype == torch.float16:
                continue
            plain = res[codec + "/unscaled"]["steps"][0]["residuals"]
            for i, v in steps[0]["residuals"].items():
                ref = plain[i]
                assert torch.allclose(v, ref, rtol=1e-2, atol=1e-3 * float(ref.abs().max())), (
                    codec,
                    i,
                    float((v - ref).abs().max()),
                    float(ref.abs().max()),
                )
