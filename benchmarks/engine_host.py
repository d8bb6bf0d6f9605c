"""The engine's host cost: ``ranks`` gloo processes on loopback (no shaping) run dynamiq's
all-reduce; per codec, the slowest rank's wall time and the CPU of all ranks (their
processes' CPU: the engine, its kernels, gloo's threads, the sockets' system calls), median
of ``--repeats`` calls after a warm-up.

    python benchmarks/engine_host.py --codecs fp32,int8,mxfp4 --schedule ring
    python benchmarks/engine_host.py --numel 1048576 --sub-chunk 4096   # many small pieces

With small pieces the per-piece work of the engine and the dispatcher shows; A/B two
checkouts by running it with ``PYTHONPATH`` set to each, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    from dynamiq.collectives import allreduce
    from dynamiq.data import load_slice

    first = load_slice()[0].float()
    n = args.numel
    base = first.repeat(-(-n // first.numel()))[:n].roll(rank * 999).contiguous()
    for codec in args.codecs.split(","):
        walls, cpus = [], []
        for i in range(args.repeats + 1):
            x = base.clone()
            dist.barrier()
            c, t = time.process_time(), time.perf_counter()
            allreduce(x, codec, args.schedule, sub_chunk=args.sub_chunk)
            if i:
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
        wall = torch.tensor([statistics.median(walls)], dtype=torch.float64)
        cpu = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        if rank == 0:
            row: dict[str, Any] = {
                "codec": codec,
                "schedule": args.schedule,
                "numel": n,
                "sub_chunk": args.sub_chunk,
                "wall_s": wall.item(),
                "cpu_s_all_ranks": cpu.item(),
            }
            print(json.dumps(row) if args.json else f"{codec:12} wall {row['wall_s']:.3f} s, "
                  f"CPU of all ranks {row['cpu_s_all_ranks']:.3f} s", flush=True)  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--codecs", default="fp32,int8,mxfp4")
    p.add_argument("--schedule", default="ring")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--numel", type=int, default=1 << 24, help="fp32 values per rank")
    p.add_argument("--sub-chunk", type=int, default=1 << 18)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON object per codec")
    args = p.parse_args(argv)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
