"""Train a small byte-level transformer with FSDP2 (``fully_shard``) and dynamiq's compressed
reduce-scatter.

CPU, 2 processes, gloo:
    torchrun --nproc-per-node 2 examples/train_fsdp.py --codec dynamiq --steps 100

The same script, unchanged, uses NCCL and one GPU per process where CUDA is available.
``--codec none`` trains with FSDP2's own reduce-scatter, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dynamiq.fsdp
from dynamiq.bench.ddp_train import TrainConfig, _batch, adamw, doc_text
from dynamiq.data.model import build_model, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="dynamiq", help="codec id, or 'none' for plain FSDP2")
    parser.add_argument("--schedule", default="ring", help="ring or (2^k ranks) butterfly")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--bf16-reduce", action="store_true", help="reduce_dtype=bfloat16")
    parser.add_argument(
        "--error-feedback",
        choices=["off", "full", "shard"],
        default="off",
        help="keep encoding residuals: of the whole gradient, or of this rank's shard only",
    )
    parser.add_argument("--json", metavar="FILE", help="write losses and comm stats (rank 0)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    cfg = TrainConfig(steps=args.steps)

    model = build_model(cfg.model_config(), cfg.seed).to(device)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if args.bf16_reduce else None)
    for block in model.blocks:  # FSDP2: each block, then the root
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    state = None
    if args.codec != "none":
        ef = {"off": False, "full": True, "shard": "shard"}[args.error_feedback]
        # the one line: every FSDP module's reduce-scatter goes through dynamiq
        state = dynamiq.fsdp.compress(model, args.codec, args.schedule, error_feedback=ef)

    opt = adamw(model.parameters(), cfg.lr)
    data = doc_text()
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        loss = lm_loss(model, _batch(data, cfg, rank, world, step).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    if rank == 0:
        last = sum(losses[-20:]) / len(losses[-20:])
        sent = sum(s["bytes_sent"] for s in state.stats) / cfg.steps if state else 0.0
        print(
            f"{backend}, {world} ranks, FSDP2, codec {args.codec}: final loss {last:.4f} "
            f"after {cfg.steps} steps, {seconds:.1f} s, "
            f"{sent / 1e6:.3f} MB sent per step by rank 0 through dynamiq"
        )
        if args.json:
            with open(args.json, "w") as f:
                stats = state.stats if state else []
                json.dump({"losses": losses, "seconds": seconds, "comm_stats": stats}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
