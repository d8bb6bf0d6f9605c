"""One rank of ``dynamiq plan calibrate --network`` (started by :mod:`dynamiq.plan.calibrate`
inside the rank's namespace of an emulated cluster; not a public entry point).

``python -m dynamiq.plan._link_worker --rank R --world N --master ADDR:PORT --spec FILE
--out FILE`` joins a gloo group over the shaped links and runs, with torch.distributed's
``isend``/``irecv`` as the engine's transport does, no codec and no engine:

* ``pingpong``: rank 0 and rank 1 bounce a small tensor (the others wait): half the median
  round trip is the latency α of a message;
* every *pattern* of the spec: per rank, a list of rounds, each a list of transfers
  ``[send_to, recv_from, nbytes, pieces]`` (``-1``: none) that run at once; a round posts its
  receives, sends its pieces back to back (the transfers' pieces interleaved), and waits for
  all of them; all ranks start together after a barrier. A transfer with a fifth element
  ``1`` is *lock-step*, as the engine moves a payload of data-dependent size: each piece goes
  as an 8-byte length header then the payload, and its receiver posts the header's receive,
  waits for it, then posts the payload's and waits for that, piece after piece. A pattern
  named in the spec's ``ahead`` list posts each round's receives a round ahead, as the engine
  does (a peer that finishes its round first sends its next round at once); ``repeats_of``
  gives a pattern its own number of repeats. Reported:
  each repeat's seconds (this rank), the seconds spent inside ``isend`` calls, and the
  process's CPU seconds (its threads and the system calls that move the bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _pingpong(rank: int, iters: int, nbytes: int) -> list[float]:
    buf = torch.zeros(max(1, nbytes), dtype=torch.uint8)
    rtts = []
    for _ in range(iters + 5):
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        rtts.append(time.perf_counter() - t)
    return rtts[5:]


_Round = tuple[list[tuple[int, int, torch.Tensor]], list[tuple[int, torch.Tensor]], list[Any]]


def _round_plan(transfers: list[list[int]]) -> _Round:
    """A round's sends ``(piece index, peer, buffer)`` (the transfers' pieces interleaved; a
    lock-step piece's length header first), receives posted at once ``(peer, buffer)``, and
    lock-step receives ``(peer, header, buffer)``, received one after another."""
    sends: list[tuple[int, int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    lockstep: list[Any] = []
    for send_to, recv_from, nbytes, pieces, *flag in transfers:
        size = -(-nbytes // max(1, pieces))
        for i in range(pieces):
            if send_to >= 0:
                if flag and flag[0]:
                    sends.append((i, send_to, torch.full((1,), size, dtype=torch.int64)))
                sends.append((i, send_to, torch.ones(size, dtype=torch.uint8)))
            if recv_from >= 0 and flag and flag[0]:
                hdr = torch.empty(1, dtype=torch.int64)
                lockstep.append((recv_from, hdr, torch.empty(size, dtype=torch.uint8)))
            elif recv_from >= 0:
                recvs.append((recv_from, torch.empty(size, dtype=torch.uint8)))
    sends.sort(key=lambda s: s[0])  # (stable: a header stays before its payload)
    return sends, recvs, lockstep


def _pattern(
    rank: int, rounds: list[list[list[int]]], ahead: bool = False
) -> tuple[float, float, float]:
    """Run this rank's rounds once; (seconds, seconds inside isend, process CPU seconds).
    ``ahead``: the next round's receives are posted before this round's sends, as the
    engine posts them (so a peer that moves on early sends at once)."""
    plan = [_round_plan(transfers) for transfers in rounds]
    posted: dict[int, list[Any]] = {}

    def post(k: int) -> None:
        if k < len(plan) and k not in posted:
            posted[k] = [w for src, b in plan[k][1] if (w := dist.irecv(b, src)) is not None]

    dist.barrier()
    in_send = 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    for k, (sends, _, lockstep) in enumerate(plan):
        post(k)
        if ahead:
            post(k + 1)
        works = posted.pop(k)
        for _, dst, b in sends:
            t = time.perf_counter()
            w = dist.isend(b, dst)
            assert w is not None
            works.append(w)
            in_send += time.perf_counter() - t
        for src, hdr, b in lockstep:
            for buf in (hdr, b):
                w = dist.irecv(buf, src)
                assert w is not None
                w.wait()
        for w in works:
            w.wait()
    return time.perf_counter() - t0, in_send, time.process_time() - c0


def join(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, dict[str, Any]]:
    """A calibration rank's start (this module's and :mod:`dynamiq.plan._host_worker`'s):
    its arguments, its spec (JSON), one torch thread, and the gloo group joined."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=float(spec.get("timeout", 300))),
    )
    return args, spec


def finish(args: argparse.Namespace, result: dict[str, Any]) -> int:
    """Write this rank's result (atomically) once every rank is done, and leave the group."""
    dist.barrier()
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args, spec = join(argv, (__doc__ or "").splitlines()[0])
    result: dict[str, Any] = {"rank": args.rank}
    dist.barrier()
    rtts = _pingpong(args.rank, int(spec["pingpong_iters"]), int(spec["pingpong_bytes"]))
    result["pingpong_rtt_median"] = statistics.median(rtts)
    result["patterns"] = {}
    for name, per_rank in spec["patterns"].items():
        rounds = per_rank[args.rank]
        ahead = name in spec.get("ahead", ())
        _pattern(args.rank, rounds, ahead)  # warm-up: the connections exist, TCP has ramped
        times, sends, cpus = [], [], []
        for _ in range(int(spec.get("repeats_of", {}).get(name, spec["repeats"]))):
            t, s, c = _pattern(args.rank, rounds, ahead)
            times.append(t)
            sends.append(s)
            cpus.append(c)
        result["patterns"][name] = {"seconds": times, "isend_seconds": sends, "cpu_seconds": cpus}
    return finish(args, result)


if __name__ == "__main__":
    sys.exit(main())
