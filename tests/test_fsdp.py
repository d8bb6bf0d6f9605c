"""dynamiq.fsdp: the compressed reduce-scatter comm under FSDP2 on real gloo processes.

One spawned job per world size runs every scenario (spawning costs more than the scenarios);
the tests below check its parts.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from dynamiq.bench.ddp_train import TrainConfig, _batch, doc_text
from dynamiq.data.model import build_model, lm_loss
from dynamiq.testing.distributed import run_gloo

pytestmark = pytest.mark.distributed

CFG = TrainConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32, batch=4)


def _model(
    comm: dict[str, Any] | None,
    *,
    mp: Any = None,
    reshard: bool = True,
    factor: float | None = None,
    seed: int = 0,
) -> tuple[torch.nn.Module, Any]:
    """The tiny transformer, its blocks and itself under ``fully_shard``; ``comm``: the
    keyword arguments of ``dynamiq.fsdp.compress`` (None: FSDP's own reduce-scatter)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dynamiq.fsdp

    kw: dict[str, Any] = {"reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=mp)
    model = build_model(CFG.model_config(), seed)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if factor is not None:  # per FSDP module (the setter does not recurse)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(factor)
    state = dynamiq.fsdp.compress(model, **comm) if comm is not None else None
    return model, state


def _backward(model: torch.nn.Module, step: int, micro: int = 1) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for m in range(micro):
        model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
        lm_loss(model, _batch(doc_text(), CFG, rank, world, step * micro + m)).backward()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (all-gathered from the shards)."""
    return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _run(comm: dict[str, Any] | None, micro: int = 1, **kw: Any) -> tuple[dict, Any]:
    model, state = _model(comm, **kw)
    _backward(model, 0, micro)
    return _grads(model), state


def _local_abs_sum() -> dict[str, torch.Tensor]:
    """Σ over ranks of |local gradient| (plain model, this step's batches): the scale of
    the fp32 summation slack."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(CFG.model_config(), 0)
    lm_loss(model, _batch(doc_text(), CFG, rank, world, 0)).backward()
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().abs()
        dist.all_reduce(g)
        out[n] = g
    return out


def _comm_cases(rank: int, world: int) -> list[dict[str, Any]]:
    """The comm called directly on heavy-tailed inputs of an odd shard size, against the
    exact (fp64) reduction of what every rank passed."""
    import dynamiq.fsdp

    model, _ = _model(None)
    out = []
    s = 1001
    g = torch.Generator().manual_seed(rank + 17)
    x = torch.randn(world * s, generator=g) * torch.rand(world * s, generator=g) ** 4 * 3
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    ops = [
        ("sum", dist.ReduceOp.SUM, 1.0),
        ("avg", dist.ReduceOp.AVG, 1.0 / world),
        ("premul", dist.ReduceOp.PREMUL_SUM(0.3), 0.3),
    ]
    for codec in ("int8", "dynamiq"):
        state = dynamiq.fsdp.compress(model, codec=codec, return_bound=True, threshold=0)
        comm = state.comms["<root>"]
        for dtype in (torch.float32, torch.bfloat16):
            for name, op, scale in ops:
                inp = x.to(dtype)
                ref = torch.stack([p.to(dtype).double() for p in parts]).sum(0) * scale
                res = torch.empty(s, dtype=dtype)
                comm(res, inp.clone(), dist.group.WORLD, op)
                err = (res.double() - ref[rank * s : (rank + 1) * s]).abs()
                bound = state.bounds["<root>"]
                out.append(
                    {
                        "case": (codec, str(dtype), name),
                        "err": err,
                        "bound": bound,
                        "op": state.stats[-1]["op"],
                        "input_unchanged": torch.equal(inp, x.to(dtype)),
                    }
                )
    return out


def _errors(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _job(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    import dynamiq.fsdp
    from dynamiq.collectives import ConfigMismatchError

    fp32 = {"codec": "fp32", "threshold": 0}
    res: dict[str, Any] = {}
    plain, _ = _run(None)
    ours, state = _run(fp32)
    fsdp_names = [
        n or "<root>" for n, m in _model(None)[0].named_modules() if isinstance(m, FSDPModule)
    ]
    res["avg"] = (plain, ours, dict(state.calls), fsdp_names, [r["op"] for r in state.stats])
    res["abs_sum"] = _local_abs_sum()
    if world > 2:
        res["hsdp"] = _hsdp()
        return res
    res["bf16"] = (_run(None, mp=torch.bfloat16)[0], _run(fp32, mp=torch.bfloat16)[0])
    acc_plain, _ = _run(None, micro=2)
    acc_ours, acc_state = _run(fp32, micro=2)
    res["accum"] = (acc_plain, acc_ours, dict(acc_state.calls))
    res["noreshard"] = (_run(None, reshard=False)[0], _run(fp32, reshard=False)[0])
    div, div_state = _run(fp32, factor=3.0)
    res["divide"] = (plain, div, sorted({r["op"] for r in div_state.stats}))
    res["int8"] = _run({"codec": "int8"})[0]
    res["comm"] = _comm_cases(rank, world)
    # error feedback: the residual's memory, and a checkpoint round trip
    ef = {}
    for mode in (True, "shard"):
        model, st = _model({"codec": "int8", "error_feedback": mode})
        for step in range(2):
            _backward(model, step)
        sd = st.state_dict()
        fresh = dynamiq.fsdp.FSDPState("int8", error_feedback=mode)
        fresh.load_state_dict(sd)
        ef[str(mode)] = {
            "sizes": {k: v.numel() for k, v in st.residuals.items()},
            "numels": {r["module"]: r["numel"] for r in st.stats},
            "nonzero": all(bool(v.abs().sum() > 0) for v in st.residuals.values()),
            "roundtrip": all(torch.equal(fresh.residuals[k], v) for k, v in st.residuals.items())
            and fresh.calls == st.calls == dict.fromkeys(st.calls, 2),
        }
    res["ef"] = ef
    # configuration errors, raised on every rank
    res["mismatch"] = _errors(
        lambda: dynamiq.fsdp.compress(_model(None)[0], codec="int8" if rank == 0 else "dynamiq")
    )
    res["mismatch_type"] = ConfigMismatchError.__name__
    res["tree"] = _errors(lambda: dynamiq.fsdp.compress(_model(None)[0], schedule="tree"))
    res["groups"] = _errors(lambda: dynamiq.fsdp.compress(_two_group_model()))
    res["no_fsdp"] = _errors(lambda: dynamiq.fsdp.compress(torch.nn.Linear(2, 2)))
    return res


def _hsdp() -> dict[str, Any]:
    """FSDP2's native HSDP (2 replicas × 2 shards) against compressed HSDP (1-D shard mesh,
    dynamiq's reduce-scatter and replica all-reduce), one backward each, codec fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dynamiq.fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build(m: Any) -> torch.nn.Module:
        model = build_model(CFG.model_config(), 0)
        for block in model.blocks:
            fully_shard(block, mesh=m)
        fully_shard(model, mesh=m)
        return model

    native = build(mesh)
    _backward(native, 0)
    shard, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    replica, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    ours = build(mesh["shard"])
    state = dynamiq.fsdp.compress(
        ours, codec="fp32", threshold=0, process_group=shard, replicate_group=replica
    )
    _backward(ours, 0)
    refused = _errors(
        lambda: dynamiq.fsdp.compress(build(mesh), process_group=shard, replicate_group=replica)
    )
    kinds = sorted({(r["module"], r.get("collective", "rs")) for r in state.stats})
    return {"native": _grads(native), "ours": _grads(ours), "kinds": kinds, "refused": refused}


def _two_group_model() -> torch.nn.Module:
    """A module whose second linear layer FSDP shards over another mesh (two param groups)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(), "cpu"), shard_mesh_dim=0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    outer = torch.nn.Sequential(inner)

    def place(p: torch.nn.Parameter) -> Any:
        return ShardPlacementResult(Shard(0), other) if p is inner[1].weight else None

    fully_shard(
        inner, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), shard_placement_fn=place
    )
    return outer


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    results = run_gloo(_job, 2, timeout=300)
    assert all(s == "ok" for s, _ in results), results
    return [r for _, r in results]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp32_codec_equals_default_fsdp2_bit_for_bit_at_2_ranks(two: list) -> None:
    for res in two:
        plain, ours, calls, names, ops = res["avg"]
        assert _equal(plain, ours)
        assert any(float(g.abs().sum()) > 0 for g in ours.values())
        # the comm ran once for every FSDP module (the root and each block)
        assert sorted(calls) == sorted(names) and len(names) == CFG.n_layers + 1
        assert set(calls.values()) == {1}
        assert set(ops) == {"avg"}


def test_bf16_reduce_dtype_reshard_and_accumulation_match_default(two: list) -> None:
    for res in two:
        # bf16: (a + b) is exact in fp32, then one rounding to bf16 as gloo's bf16 sum does
        assert _equal(*res["bf16"])
        plain, ours, calls = res["accum"]
        assert _equal(plain, ours)
        assert set(calls.values()) == {1}  # no communication in the no-sync micro-batch
        assert _equal(*res["noreshard"])
        assert not _equal(res["avg"][0], res["accum"][0])  # accumulation changed something


def test_gradient_divide_factor_uses_premul_sum(two: list) -> None:
    # gloo has no PREMUL_SUM: FSDP's own reduce-scatter cannot run this at all on the CPU
    for res in two:
        avg, div, ops = res["divide"]
        assert ops == [f"premul_sum({1 / 3.0!r})"]
        for k in avg:  # (a + b) / 3 against ((a + b) / 2) * (2 / 3): two fp32 roundings apart
            want = avg[k].double() * (2 / 3)
            assert bool(((div[k].double() - want).abs() <= want.abs() * 2.0**-22 + 1e-38).all())


def test_direct_calls_stay_within_the_certified_bound(two: list) -> None:
    for res in two:
        seen = set()
        for case in res["comm"]:
            seen.add(case["case"])
            assert case["input_unchanged"]
            err, bound = case["err"], case["bound"]
            assert bound.shape == err.shape
            assert bool((err <= bound).all()), (case["case"], float((err - bound).max()))
            assert float(err.max()) > 0  # lossy
            assert case["op"] == {"sum": "sum", "avg": "avg"}.get(
                case["case"][2], "premul_sum(0.3)"
            )
        assert len(seen) == 12


def test_int8_gradients_are_close_to_default(two: list) -> None:
    for res in two:
        plain, q = res["avg"][0], res["int8"]
        num = sum(float((plain[k] - q[k]).double().square().sum()) for k in plain)
        den = sum(float(plain[k].double().square().sum()) for k in plain)
        assert 0 < num / den < 1e-3


def test_error_feedback_memory_and_checkpoint(two: list) -> None:
    for res in two:
        full, shard = res["ef"]["True"], res["ef"]["shard"]
        assert full["sizes"] == full["numels"]  # the whole unsharded gradient, per module
        assert shard["sizes"] == {k: v // 2 for k, v in shard["numels"].items()}
        assert full["nonzero"] and shard["nonzero"]
        assert full["roundtrip"] and shard["roundtrip"]


def test_configuration_errors_are_clear_on_every_rank(two: list) -> None:
    for res in two:
        assert res["mismatch"].startswith(res["mismatch_type"]), res["mismatch"]
        assert "codec" in res["mismatch"]
        assert res["tree"].startswith("ValueError") and "'tree'" in res["tree"]
        assert res["groups"].startswith("ValueError") and "'0'" in res["groups"]
        assert "param groups" in res["groups"]
        assert "no FSDP module" in res["no_fsdp"]


@pytest.mark.slow  # ~20-30 s: 4 ranks
def test_fp32_codec_within_the_fp32_slack_at_4_ranks() -> None:
    results = run_gloo(_job, 4, timeout=300)
    assert all(s == "ok" for s, _ in results), results
    world = 4
    for _, res in results:
        plain, ours, calls, names, _ = res["avg"]
        assert sorted(calls) == sorted(names) and set(calls.values()) == {1}
        for k in plain:
            # each is within n - 1 additions and one division (relative 2^-24 each) of the
            # exact mean, on partial sums bounded by Σ|g_i|
            slack = 2 * world * 2.0**-24 * 1.01 * res["abs_sum"][k].double() / world
            diff = (plain[k].double() - ours[k].double()).abs()
            assert bool((diff <= slack + 2.0**-140).all()), k
        # compressed HSDP: a reduce-scatter over 2 shards, then an all-reduce over 2
        # replicas, against FSDP2's native HSDP (the same two steps): each is within 3
        # roundings (two pair sums, the sum of the halves; halving is exact) of relative
        # size 2^-24 on values bounded by Σ|g_i| / 4, the difference within twice that
        hsdp = res["hsdp"]
        assert hsdp["kinds"] == sorted(
            (n, kind) for n in calls for kind in ("rs", "replica_allreduce")
        )
        for k, native in hsdp["native"].items():
            slack = 2 * 3 * 2.0**-24 * 1.01 * res["abs_sum"][k].double() / world
            diff = (native.double() - hsdp["ours"][k].double()).abs()
            assert bool((diff <= slack + 2.0**-140).all()), k
        assert "native HSDP" in hsdp["refused"]


def _train(rank: int, world: int, comm: dict[str, Any] | None, seed: int, steps: int) -> list:
    """``steps`` AdamW steps of the tiny transformer under FSDP2; this rank's losses."""
    from dynamiq.bench.ddp_train import adamw

    model, _state = _model(comm, seed=seed)  # the state must live as long as the model
    opt = adamw(model.parameters(), CFG.lr)
    losses = []
    for step in range(steps):
        batch = _batch(doc_text(), CFG, rank, world, step + 10_000 * seed)
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _job_train(rank: int, world: int, steps: int) -> dict[str, list]:
    warnings.simplefilter("ignore")
    runs = {
        "fsdp2 seed 0": (None, 0),
        "fsdp2 seed 1": (None, 1),
        "int8": ({"codec": "int8"}, 0),
        "dynamiq": ({"codec": "dynamiq"}, 0),
    }
    return {name: _train(rank, world, comm, seed, steps) for name, (comm, seed) in runs.items()}


@pytest.mark.slow
def test_int8_and_dynamiq_train_like_default_fsdp2() -> None:
    steps = 300
    results = run_gloo(_job_train, 2, steps, timeout=3000)
    assert all(s == "ok" for s, _ in results), results

    def tail(name: str) -> float:  # mean over ranks of the last 50 steps' mean loss
        return sum(sum(r[name][-50:]) / 50 for _, r in results) / len(results)

    base, other = tail("fsdp2 seed 0"), tail("fsdp2 seed 1")
    spread = abs(base - other) / base
    allowed = max(0.02, 2 * spread)
    first = results[0][1]["fsdp2 seed 0"][0]
    assert base < 0.8 * first  # it learned
    report = {n: tail(n) for n in results[0][1]}
    print(f"last-50 mean losses {report}; seed spread {spread:.4f}; allowed {allowed:.4f}")
    for name in ("int8", "dynamiq"):
        assert results[0][1][name][0] == first  # same seed, same start
        assert abs(tail(name) - base) / base <= allowed, (name, report, allowed)


@pytest.mark.slow  # ~12-18 s: torchrun, 2 ranks, the example end to end
def test_example_script_under_torchrun(tmp_path: Any) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dynamiq.testing.distributed import free_port

    script = Path(__file__).parents[1] / "examples" / "train_fsdp.py"
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    cmd += [
        "--codec",
        "mxfp8_e4m3",
        "--steps",
        "6",
        "--error-feedback",
        "shard",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gloo, 2 ranks, FSDP2, codec mxfp8_e4m3: final loss" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["losses"]) == 6
    stats = data["comm_stats"]
    assert len(stats) == 6 * (TrainConfig().n_layers + 1)  # every FSDP module, every step
    assert all(s["bytes_sent"] > 0 for s in stats)
