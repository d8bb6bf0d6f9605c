"""One rank of ``dynamiq plan calibrate --host`` (started by :mod:`dynamiq.plan.calibrate` on
this machine, over loopback; not a public entry point).

``python -m dynamiq.plan._host_worker --rank R --world N --master ADDR:PORT --spec FILE
--out FILE`` joins a gloo group on loopback (no shaping: the network costs next to nothing)
and runs dynamiq's all-reduce as a training process would (one torch thread, the engine's
defaults) for every codec × schedule × size of the spec: a warm-up call, then ``repeats``
timed ones, all ranks starting together after a barrier. Reported per call: the CPU seconds
this process used (all its threads: the engine's and gloo's, and the kernel's work in its
system calls) and the wall seconds.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dynamiq.plan._link_worker import finish, join


def _data(numel: int, rank: int) -> torch.Tensor:
    """Real gradients (the shipped slice), repeated to ``numel`` values, shifted per rank."""
    from dynamiq.data import load_slice

    first = load_slice()[0].float()
    reps = -(-numel // first.numel())
    return first.repeat(reps)[:numel].roll(rank * 999).contiguous()


def _time(codec: Any, schedule: str, numel: int, rank: int, repeats: int) -> dict[str, Any]:
    from dynamiq.collectives import allreduce

    base = _data(numel, rank)
    cpu, wall = [], []
    for i in range(repeats + 1):
        x = base.clone()
        dist.barrier()
        c, t = time.process_time(), time.perf_counter()
        allreduce(x, codec, schedule)
        if i:  # the first call warms up: connections, kernel build, caches
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - t)
    return {"cpu_s": cpu, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    args, spec = join(argv, (__doc__ or "").splitlines()[0])
    result: dict[str, Any] = {"rank": args.rank, "runs": []}
    for codec in spec["codecs"]:
        for schedule in spec["schedules"]:
            for numel in spec["sizes"]:
                row = _time(codec, schedule, int(numel), args.rank, int(spec["repeats"]))
                result["runs"].append(
                    {"codec": codec, "schedule": schedule, "numel": int(numel), **row}
                )
    return finish(args, result)


if __name__ == "__main__":
    sys.exit(main())
