"""What a butterfly's partner switches cost on the emulated links, without the engine.

    python benchmarks/exchange_probe.py --rate 100mbit --round-mib 4,16 --repeats 5

Four ranks in an emulated cluster (root) run, with gloo and no codec
(:mod:`dynamiq.plan._link_worker`), three rounds of ``R`` bytes each way in three patterns:
a ring (to ``r + 1``, from ``r - 1``), an exchange with a fixed partner (``r ^ 1``), and the
engine's butterfly at 4 ranks (``r ^ 2``, ``r ^ 1``, ``r ^ 2``), each with its receives
posted a round ahead as the engine posts them and without. Prints, per pattern, the median
over repeats of the slowest rank's seconds, and while the butterfly runs, the largest send
queue ``ss`` saw on any connection (bytes a rank's socket still held after gloo had called
the send complete). Issue 19's "The butterfly's partner switches" in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time

from dynamiq.bench.netns import EmulatedCluster
from dynamiq.plan.calibrate import _run_ranks

N = 4


def patterns(nbytes: int, piece: int) -> tuple[dict[str, list], list[str]]:
    pc = max(1, nbytes // piece)
    shapes = {
        "ring": [[[[(r + 1) % N, (r - 1) % N, nbytes, pc]]] * 3 for r in range(N)],
        "fixed": [[[[r ^ 1, r ^ 1, nbytes, pc]]] * 3 for r in range(N)],
        "butterfly": [[[[r ^ m, r ^ m, nbytes, pc]] for m in (2, 1, 2)] for r in range(N)],
    }
    out, ahead = {}, []
    for name, rounds in shapes.items():
        for mode in ("ahead", "after"):
            key = f"{name}-{nbytes / 2**20:g}MiB-{mode}"
            out[key] = rounds
            if mode == "ahead":
                ahead.append(key)
    return out, ahead


def _sample_send_queues(cl: EmulatedCluster, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        for ns in cl.namespaces:
            argv = ["ip", "netns", "exec", ns, "ss", "-tnH", "state", "established"]
            for line in subprocess.run(argv, capture_output=True, text=True).stdout.splitlines():
                f = line.split()
                if len(f) >= 2 and f[1].isdigit():
                    peak[0] = max(peak[0], int(f[1]))
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--round-mib", default="4,16", help="bytes a round each way, MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--piece", type=int, default=1 << 18, help="bytes a message")
    args = p.parse_args()
    pats: dict[str, list] = {}
    ahead: list[str] = []
    for mib in (float(x) for x in args.round_mib.split(",")):
        more, more_ahead = patterns(int(mib * 2**20), args.piece)
        pats |= more
        ahead += more_ahead
    spec = {
        "pingpong_iters": 5,
        "pingpong_bytes": 8,
        "repeats": args.repeats,
        "patterns": pats,
        "ahead": ahead,
        "timeout": 600,
    }
    peak, stop = [0], threading.Event()
    with EmulatedCluster(N, args.rate, 0.1) as cl, tempfile.TemporaryDirectory() as tmp:
        sampler = threading.Thread(target=_sample_send_queues, args=(cl, stop, peak))
        sampler.start()
        try:
            per_rank = _run_ranks(cl, spec, tmp)
        finally:
            stop.set()
            sampler.join()
    print(f"{args.rate}, {N} ranks, {args.repeats} repeats; largest send queue {peak[0]} bytes")
    for name in pats:
        reps = [
            max(pr["patterns"][name]["seconds"][i] for pr in per_rank) for i in range(args.repeats)
        ]
        print(
            f"{name:28s} median {statistics.median(reps):.4f} s  "
            f"min {min(reps):.4f}  max {max(reps):.4f}"
        )


if __name__ == "__main__":
    main()
