"""FSDP2 with ``dynamiq.fsdp`` on 2 gloo ranks on this machine's loopback: what the blocking
comm costs, and what error feedback keeps in memory and buys.

``overhead``: median seconds of one reduce-scatter of a small buffer (the fixed per-call cost
of the persistent transport: no handshake after the first call) through ``dynamiq.fsdp``'s
comm with ``codec="fp32"`` and through gloo's ``reduce_scatter_tensor``; and median step time
(forward, backward, AdamW) of the tiny transformer with FSDP2's own reduce-scatter and with
the comm (fp32, dynamiq), which block backward while they run.

``ef``: mean loss of the last 50 of ``--steps`` steps with a lossy codec, error feedback off,
``True`` (whole unsharded gradient kept) and ``"shard"`` (this rank's shard only), beside
FSDP2's own; and the residual bytes each mode keeps per rank.

    python benchmarks/fsdp_costs.py overhead
    python benchmarks/fsdp_costs.py ef --codec mxfp4 --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from dynamiq.bench.ddp_train import TrainConfig, _batch, adamw, doc_text
from dynamiq.data.model import build_model, lm_loss
from dynamiq.testing.distributed import run_gloo

CFG = TrainConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32, batch=4)


def _model(comm: dict[str, Any] | None) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    import dynamiq.fsdp

    model = build_model(CFG.model_config(), 0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, (dynamiq.fsdp.compress(model, **comm) if comm is not None else None)


def _steps(model: torch.nn.Module, steps: int) -> tuple[list[float], list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = adamw(model.parameters(), CFG.lr)
    losses, times = [], []
    for step in range(steps):
        batch = _batch(doc_text(), CFG, rank, world, step)
        dist.barrier()
        t0 = time.perf_counter()
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return losses, times


def _overhead(rank: int, world: int, calls: int, steps: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    model, state = _model({"codec": "fp32", "threshold": 0})
    comm = state.comms["<root>"]
    for numel in (1024, 1 << 16):
        x = torch.randn(world * numel)
        y = torch.empty(numel)
        for name in ("dynamiq fp32", "gloo"):
            ts = []
            for k in range(calls + 1):  # the first call agrees on the configuration
                dist.barrier()
                t0 = time.perf_counter()
                if name == "gloo":
                    dist.reduce_scatter_tensor(y, x, op=dist.ReduceOp.AVG)
                else:
                    comm(y, x, dist.group.WORLD, dist.ReduceOp.AVG)
                if k:
                    ts.append(time.perf_counter() - t0)
            out[f"call {name} {numel}"] = statistics.median(ts)
    for label, cfg in (("fsdp2", None), ("dynamiq fp32", {"codec": "fp32"}), ("dynamiq", {})):
        model, st = _model(cfg)
        _, times = _steps(model, steps)
        out[f"step {label}"] = statistics.median(times[2:])
        if st is not None:
            comm_s = [r["seconds"]["comm_total"] for r in st.stats[2 * 3 :]]
            out[f"comm per step {label}"] = sum(comm_s) / (steps - 2)
    return out


def _ef(rank: int, world: int, codec: str, steps: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for label, cfg in (
        ("fsdp2", None),
        (f"{codec} ef off", {"codec": codec}),
        (f"{codec} ef full", {"codec": codec, "error_feedback": True}),
        (f"{codec} ef shard", {"codec": codec, "error_feedback": "shard"}),
    ):
        model, st = _model(cfg)
        losses, _ = _steps(model, steps)
        mean = torch.tensor(sum(losses[-50:]) / 50, dtype=torch.float64)
        dist.all_reduce(mean)
        res = sum(v.numel() * v.element_size() for v in st.residuals.values()) if st else 0
        out[label] = {"last50": float(mean) / world, "residual bytes": res}
    out["param bytes per rank"] = sum(
        p.to_local().numel() * 4 for p in _model(None)[0].parameters()
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["overhead", "ef"])
    parser.add_argument("--codec", default="mxfp4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    if args.what == "overhead":
        res = run_gloo(_overhead, 2, args.calls, min(args.steps, 30), timeout=1800)
    else:
        res = run_gloo(_ef, 2, args.codec, args.steps, timeout=3600)
    if any(s != "ok" for s, _ in res):
        print(res, file=sys.stderr)
        return 1
    print(json.dumps(res[0][1], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
