"""Cost per call of the configuration check (``handshake.agree``: the digest exchange) on N
in-process ranks (threads over LocalTransport): ``python benchmarks/agree_cost.py``."""

from __future__ import annotations

import statistics
import time

import torch

from dynamiq.collectives.handshake import agree
from dynamiq.collectives.transport import LocalCluster, run_threads

DESC = {"wire_version": 1, "codec": {"id": "int", "bits": 8}, "numel": 1 << 20, "step": 7}
REPS = 50


def measure(n: int) -> tuple[float, int]:
    """(slowest rank's median seconds per call, bytes each rank sent per call)."""
    cluster = LocalCluster(n)

    def body(r: int) -> tuple[float, int]:
        tr = cluster.transport(r)
        times, sent = [], 0
        for _ in range(REPS):
            t0 = time.perf_counter()
            sent = agree(tr, DESC, 30.0)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), sent

    out = run_threads(n, body)
    return max(t for t, _ in out), out[0][1]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for n in (4, 32):
        sec, sent = measure(n)
        rounds = (n - 1).bit_length()
        print(f"n={n}: {1e6 * sec:.0f} us per call, {sent} B sent per rank, {rounds} rounds")
