"""Train a small byte-level transformer with DDP and the dynamiq communication hook.

CPU, 2 processes, gloo:
    torchrun --nproc-per-node 2 examples/train_ddp.py --codec mxfp8_e4m3 --steps 100

The same script, unchanged, uses NCCL and one GPU per process where CUDA is available.
Two nodes (run on each node, with its --node-rank; MASTER is node 0's address):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr MASTER \
        --master-port 29500 examples/train_ddp.py --codec mxfp8_e4m3 \
        --schedule hierarchical --intra-codec fp32
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from dynamiq.bench.ddp_train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--codec", default="mxfp8_e4m3", help="codec id or JSON config, or 'none' for plain DDP"
    )
    parser.add_argument("--schedule", default="ring", help="ring, butterfly, tree or hierarchical")
    parser.add_argument(
        "--ranks-per-node", type=int, default=0, help="hierarchical: ranks per node (0: local)"
    )
    parser.add_argument("--intra-codec", default=None, help="hierarchical: intra-node codec")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--error-feedback", action="store_true", help="keep encoding residuals")
    parser.add_argument("--json", metavar="FILE", help="write losses and hook stats (rank 0)")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    hook = None if args.codec == "none" else "dynamiq"
    codec = json.loads(args.codec) if args.codec.startswith("{") else args.codec
    options: dict = {
        "codec": codec,
        "schedule": args.schedule,
        "error_feedback": args.error_feedback,
    }
    if args.schedule == "hierarchical":
        per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        options["schedule_options"] = {"ranks_per_node": per_node, "intra_codec": args.intra_codec}
    result = train(rank, world, TrainConfig(steps=args.steps), hook, options)
    if rank == 0:
        last = sum(result.losses[-20:]) / len(result.losses[-20:])
        sent = sum(s["bytes_sent"] for s in result.hook_stats)
        print(
            f"{backend}, {world} ranks, codec {args.codec}, {args.schedule}: "
            f"final loss {last:.4f} after {args.steps} steps, {result.seconds:.1f} s, "
            f"{sent / max(len(result.hook_stats), 1) / 1e6:.3f} MB sent per step by rank 0"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"losses": result.losses, "hook_stats": result.hook_stats}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
