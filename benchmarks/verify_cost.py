"""What ``verify=True`` costs on the CPU path: ``python benchmarks/verify_cost.py``.

1. The checksum alone: CRC-32C (the ``crc32c`` package) and zlib's CRC-32 in GiB/s, next to
   the int8 codec's encode of the same buffer.
2. The all-reduce over 4 gloo ranks on loopback (the CPU kernels, no network limit), 16 MiB
   of real gradients per rank (the cached eval gradients, as ``dynamiq bench cluster``), each
   codec on the ring, interleaved: ``verify`` off, checksums only (``status=False``), and
   checksums with the status exchange (``verify=True``): median seconds, ratio to off.
3. The status exchange alone (``Status.exchange``) on 4 and 32 in-process ranks.
"""

from __future__ import annotations

import statistics
import sys
import time
import zlib
from typing import Any

import torch

from dynamiq.bench._cluster_worker import rank_buffer
from dynamiq.collectives.integrity import STATUS_WORDS, Status
from dynamiq.collectives.transport import LocalCluster, run_threads
from dynamiq.testing.distributed import run_gloo

CODECS: list[Any] = ["int8", "mxfp8_e4m3", "dynamiq", "thc", "omnireduce"]
NUMEL = 4 << 20  # 16 MiB of fp32
REPS = 5


def checksum_speed() -> None:
    import crc32c

    from dynamiq.codecs import get_codec

    x = rank_buffer("real", 0, 4, NUMEL, 0)
    data = x.view(torch.uint8).numpy().data
    fns = [("crc32c", lambda: crc32c.crc32c(data)), ("zlib.crc32", lambda: zlib.crc32(data))]
    for name, fn in fns:
        fn()
        t0 = time.perf_counter()
        for _ in range(REPS):
            fn()
        dt = (time.perf_counter() - t0) / REPS
        print(f"{name}: {x.numel() * 4 / dt / 2**30:.2f} GiB/s over 16 MiB")
    codec = get_codec("int8")
    codec.encode(x)
    t0 = time.perf_counter()
    for _ in range(REPS):
        codec.encode(x)
    dt = (time.perf_counter() - t0) / REPS
    print(f"int8 encode: {x.numel() * 4 / dt / 2**30:.2f} GiB/s of fp32 input")


#: the variants: verify off; checksums only (``status=False``: raised where found); both
VARIANTS = {"off": (False, False), "crc": (True, False), "on": (True, True)}


def _job(rank: int, world: int) -> dict[str, list[float]]:
    from dynamiq.codecs import get_codec
    from dynamiq.collectives import get_schedule
    from dynamiq.collectives.engine import run_schedule
    from dynamiq.collectives.transport import TorchDistTransport

    x = rank_buffer("real", rank, world, NUMEL, 0)
    tr = TorchDistTransport()
    sched = get_schedule("ring", world)
    times: dict[str, list[float]] = {}
    for _ in range(REPS + 1):  # the first round is a warm-up
        for codec in CODECS:
            c = get_codec(codec)
            for name, (verify, status) in VARIANTS.items():
                buf = x.clone()
                torch.distributed.barrier()
                t0 = time.perf_counter()
                run_schedule(tr, buf, c, sched, verify=verify, status=status, inplace=True)
                times.setdefault(f"{codec} {name}", []).append(time.perf_counter() - t0)
    return {k: v[1:] for k, v in times.items()}


def gloo_cost() -> None:
    results = run_gloo(_job, 4, timeout=1800)
    assert all(s == "ok" for s, _ in results), results
    print("| codec (ring, 4 gloo ranks, 16 MiB) | off (s) | checksums only | + status exchange |")
    print("|---|---|---|---|")
    for codec in CODECS:
        t = {n: max(statistics.median(v[f"{codec} {n}"]) for _, v in results) for n in VARIANTS}
        print(
            f"| {codec} | {t['off']:.3f} | {t['crc']:.3f} ({t['crc'] / t['off']:.3f}) | "
            f"{t['on']:.3f} ({t['on'] / t['off']:.3f}) |"
        )


def status_cost() -> None:
    for n in (4, 32):
        cluster = LocalCluster(n)

        def body(r: int, cluster: LocalCluster = cluster) -> float:
            tr = cluster.transport(r)
            ts = []
            for _ in range(50):
                t0 = time.perf_counter()
                Status(r).exchange(tr, 30.0, torch.device("cpu"))
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        sec = max(run_threads(n, body))
        rounds = (n - 1).bit_length()
        print(
            f"status exchange, n={n}: {1e6 * sec:.0f} us per call (in process), {rounds} rounds, "
            f"{rounds * 8 * STATUS_WORDS} B sent per rank"
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    parts = sys.argv[1:] or ["checksum", "status", "gloo"]
    if "checksum" in parts:
        checksum_speed()
    if "status" in parts:
        status_cost()
    if "gloo" in parts:
        gloo_cost()
