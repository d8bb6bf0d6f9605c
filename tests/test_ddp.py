"""The DDP communication hook over real gloo processes.

(No postponed annotations: DDP checks a hook's annotations as objects.)
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dynamiq.bench.ddp_train import TrainConfig, _batch, _loss, doc_text, train
from dynamiq.data.model import ModelConfig, build_model
from dynamiq.testing.distributed import run_gloo

pytestmark = pytest.mark.distributed

CFG = TrainConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32, batch=4, steps=300)


def _grads(hook: str | None, options: dict | None, dtype: torch.dtype = torch.float32) -> list:
    """One forward/backward of rank's batch through DDP; the averaged gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(
        d_model=CFG.d_model, n_layers=CFG.n_layers, n_heads=CFG.n_heads, seq_len=CFG.seq_len
    )
    model = build_model(mcfg, 0).to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.05)
    state = None
    if hook == "dynamiq":
        from dynamiq.ddp import DynamiqState, dynamiq_hook

        state = DynamiqState(**(options or {}))
        ddp.register_comm_hook(state, dynamiq_hook)
    batch = _batch(doc_text(), CFG, rank, world, 0)
    _loss(ddp, batch).backward()
    out = [p.grad.detach().clone() for p in model.parameters()]
    if state is not None:
        state.close()
    return out


def _local_grads() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(
        d_model=CFG.d_model, n_layers=CFG.n_layers, n_heads=CFG.n_heads, seq_len=CFG.seq_len
    )
    model = build_model(mcfg, 0)
    model.loss(_batch(doc_text(), CFG, rank, world, 0)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _job_fp32_equals_plain(rank: int, world: int) -> dict:
    plain = _grads(None, None)
    hooked = _grads("dynamiq", {"codec": "fp32", "threshold": 0})
    local = _local_grads()
    gathered = []
    for g in local:
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        gathered.append(torch.stack(parts))
    return {"plain": plain, "hooked": hooked, "local": gathered}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fp32_hook_equals_plain_ddp(world: int) -> None:
    results = run_gloo(_job_fp32_equals_plain, world, timeout=180)
    assert all(s == "ok" for s, _ in results), results
    for _, res in results:
        for plain, hooked, parts in zip(res["plain"], res["hooked"], res["local"], strict=True):
            if world == 2:
                assert torch.equal(plain, hooked)  # (a + b) / 2 is exact either way
            else:
                # each is within n roundings (n - 1 additions, one division by n) of relative
                # size 2^-24 on values bounded by Σ|g_i| / n (plain DDP divides first)
                slack = 2 * world * 2.0**-24 * 1.01 * parts.double().abs().sum(0)
                diff = (plain.double() - hooked.double()).abs()
                assert bool((diff <= slack / world + 2.0**-140).all())
    # and every rank has the same gradients
    assert all(
        torch.equal(a, b)
        for a, b in zip(results[0][1]["hooked"], results[1][1]["hooked"], strict=True)
    )


def _job_train(rank: int, world: int, hook: str | None, options: dict | None) -> list:
    return train(rank, world, CFG, hook, options).losses


@pytest.mark.slow  # ~40-70 s: 2 ranks train twice; `dynamiq bench train` measures the same
def test_int8_training_loss_within_2_percent_of_plain_ddp() -> None:
    plain = run_gloo(_job_train, 2, None, None, timeout=400)
    hooked = run_gloo(_job_train, 2, "dynamiq", {"codec": "int8"}, timeout=400)
    assert all(s == "ok" for s, _ in plain + hooked), (plain, hooked)

    def final(results: list) -> float:
        return sum(sum(losses[-20:]) / 20 for _, losses in results) / len(results)

    p, h = final(plain), final(hooked)
    assert plain[0][1][0] == hooked[0][1][0]  # same seed: same first loss
    assert p < 0.8 * plain[0][1][0]  # it learned
    assert abs(h - p) / p < 0.02, (h, p)


def _job_overlap(rank: int, world: int) -> dict:
    """The first bucket's all-reduce may not finish before backward has produced the last
    bucket: if the hook blocked backward until its bucket was reduced, this would deadlock
    (and the gate would time out)."""
    import dynamiq.ddp as ddp_mod

    last_hooked = threading.Event()
    gate = {"ok": True, "t_last_hook": None, "t_first_done": None}
    real_allreduce = ddp_mod.allreduce
    first = {"seen": False}

    def gated_allreduce(*args, **kw):  # type: ignore[no-untyped-def]
        if not first["seen"]:
            first["seen"] = True
            gate["ok"] = last_hooked.wait(timeout=30)
            out = real_allreduce(*args, **kw)
            gate["t_first_done"] = time.perf_counter()
            return out
        return real_allreduce(*args, **kw)

    ddp_mod.allreduce = gated_allreduce

    def hook(
        state: ddp_mod.DynamiqState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        fut = ddp_mod.dynamiq_hook(state, bucket)
        if bucket.is_last():
            gate["t_last_hook"] = time.perf_counter()
            last_hooked.set()
        return fut

    mcfg = ModelConfig(d_model=32, n_layers=4, n_heads=4, seq_len=32)
    model = build_model(mcfg, 0)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = ddp_mod.DynamiqState(codec="int8")
    ddp.register_comm_hook(state, hook)
    _loss(ddp, _batch(doc_text(), CFG, rank, world, 0)).backward()
    state.close()
    ddp_mod.allreduce = real_allreduce
    return gate


@pytest.mark.slow  # ~22 s: a timing-shaped check; the hook's numerics run by default
def test_hook_overlaps_backward() -> None:
    results = run_gloo(_job_overlap, 2, timeout=120)
    for status, gate in results:
        assert status == "ok", gate
        assert gate["ok"], "the hook blocked backward until its bucket was reduced"
        assert gate["t_last_hook"] < gate["t_first_done"]


def _job_state(rank: int, world: int) -> dict:
    from dynamiq.ddp import DynamiqState, dynamiq_hook

    mcfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32)
    out: dict = {}
    # fp32 with static_graph; bf16 with no_sync gradient accumulation (PyTorch's reducer does
    # not support no_sync before the first synced step of a static graph)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(mcfg, 0).to(dtype)
        static = dtype == torch.float32
        ddp = DDP(model, bucket_cap_mb=0.05, static_graph=static)
        state = DynamiqState(codec="mxfp4", error_feedback=True, schedule="butterfly")
        ddp.register_comm_hook(state, dynamiq_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        data = doc_text()
        for step in range(3):
            if not static:
                with ddp.no_sync():  # gradient accumulation: no communication
                    _loss(ddp, _batch(data, CFG, rank, world, 100 + step)).backward()
            _loss(ddp, _batch(data, CFG, rank, world, step)).backward()
            opt.step()
            opt.zero_grad()
        sd = state.state_dict()
        fresh = DynamiqState(codec="mxfp4", error_feedback=True)
        fresh.load_state_dict(sd)
        out[str(dtype)] = {
            "iter": sd["iter"],
            "n_residuals": len(sd["residuals"]),
            "residual_norm": float(sum(v.norm() for v in sd["residuals"].values())),
            "restored": all(
                torch.equal(sd["residuals"][k], fresh.residuals[k]) for k in sd["residuals"]
            ),
            "steps_recorded": len(state.stats),
            "bytes": [s["bytes_sent"] for s in state.stats],
            "checksum": float(sum(p.double().sum() for p in model.parameters())),
        }
        try:
            DynamiqState(codec="int8").load_state_dict(sd)
            out[str(dtype)]["mismatch"] = "accepted"
        except ValueError as exc:
            out[str(dtype)]["mismatch"] = str(exc)
        state.close()
        fresh.close()
    return out


@pytest.mark.slow  # ~25-40 s
def test_state_dict_error_feedback_bf16_no_sync_static_graph() -> None:
    results = run_gloo(_job_state, 2, timeout=180)
    assert all(s == "ok" for s, _ in results), results
    for dtype in ("torch.float32", "torch.bfloat16"):
        a, b = results[0][1][dtype], results[1][1][dtype]
        assert a["iter"] == 3 and a["steps_recorded"] == 3 and all(x > 0 for x in a["bytes"])
        assert a["n_residuals"] >= 1 and a["residual_norm"] > 0 and a["restored"]
        assert "codec" in a["mismatch"]
        assert a["checksum"] == b["checksum"]  # replicas stay identical


@pytest.mark.slow  # ~15-22 s: torchrun, 2 ranks, the example end to end
def test_example_script_under_torchrun(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dynamiq.testing.distributed import free_port

    script = Path(__file__).parents[1] / "examples" / "train_ddp.py"
    out = tmp_path / "run.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        "--codec",
        "mxfp4",
        "--schedule",
        "butterfly",
        "--steps",
        "15",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gloo, 2 ranks, codec mxfp4, butterfly: final loss" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["losses"]) == 15 and len(data["hook_stats"]) == 15
    assert all(s["bytes_sent"] > 0 for s in data["hook_stats"])
