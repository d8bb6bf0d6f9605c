"""Early sends to another peer or not: the engine against its previous policy on the emulated
cluster (4 ranks, one namespace each; needs root), docs/benchmarks.md, "Reduce-scatter without
the up-front copy; early sends only on the same connection".

    sudo .venv/bin/python -m benchmarks.send_ahead --rate 100mbit --codecs fp32,mxfp8_e4m3,dynamiq

Both policies post the next round's receives a round ahead. ``same`` (the engine's): a piece
of the next round goes out during this round only to this round's peer. ``any`` (before): to
whichever peer the next round sends to. Calls alternate between the two, ``--repeats`` each
after a warm-up; the table gives the slowest rank's median seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

from dynamiq.collectives.engine import RunConfig, ScheduleRun


class _AnyPeer(ScheduleRun):
    """The previous policy: the next round's sends start early whatever their peer."""

    def _send_ahead(self, k: int) -> bool:
        return bool(self.overlap and k + 1 < len(self.plan))


def _worker() -> int:
    import torch.distributed as dist

    from dynamiq.codecs import get_codec
    from dynamiq.collectives import get_schedule
    from dynamiq.collectives.transport import TorchDistTransport
    from dynamiq.data import load_slice
    from dynamiq.plan._link_worker import finish, join

    args, spec = join(sys.argv[1:], "send_ahead rank")
    n, r = dist.get_world_size(), dist.get_rank()
    tr = TorchDistTransport()
    rows = load_slice()
    row = rows[r % rows.shape[0]]
    numel = int(spec["numel"])
    x0 = row.repeat(-(-numel // row.numel()))[:numel].contiguous()
    out: dict[str, list[float]] = {}
    for codec in spec["codecs"]:
        for sched in spec["schedules"]:
            for i in range(int(spec["repeats"]) + 1):
                for policy, cls in (("any", _AnyPeer), ("same", ScheduleRun)):
                    x = x0.clone()
                    dist.barrier()
                    t = time.perf_counter()
                    c, s = get_codec(codec), get_schedule(sched, n)
                    cls(tr, x, c, s, RunConfig(inplace=True)).run()
                    if i:
                        key = f"{codec}|{sched}|{policy}"
                        out.setdefault(key, []).append(time.perf_counter() - t)
    return finish(args, out)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--codecs", default="fp32,mxfp8_e4m3,dynamiq")
    p.add_argument("--schedules", default="butterfly")
    p.add_argument("--size-mib", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the table here too")
    a = p.parse_args()
    from dynamiq.bench.netns import EmulatedCluster
    from dynamiq.plan.calibrate import _run_ranks

    spec = {
        "numel": int(a.size_mib * 2**20) // 4,
        "codecs": a.codecs.split(","),
        "schedules": a.schedules.split(","),
        "repeats": a.repeats,
        "timeout": 300,
    }
    with EmulatedCluster(4, a.rate, 0.1) as cl, tempfile.TemporaryDirectory() as tmp:
        per_rank = _run_ranks(cl, spec, tmp, worker="benchmarks.send_ahead")
    rows: list[dict[str, Any]] = []
    print("| codec | schedule | any peer s | same peer s | same / any |\n|---|---|---:|---:|---:|")
    for codec in spec["codecs"]:
        for sched in spec["schedules"]:
            med = {}
            for policy in ("any", "same"):
                key = f"{codec}|{sched}|{policy}"
                reps = len(per_rank[0][key])
                med[policy] = statistics.median(
                    max(pr[key][i] for pr in per_rank) for i in range(reps)
                )
            rows.append({"codec": codec, "schedule": sched, "rate": a.rate, **med})
            print(
                f"| {codec} | {sched} | {med['any']:.3f} | {med['same']:.3f} | "
                f"{med['same'] / med['any']:.3f} |"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(_worker() if "--rank" in sys.argv else main())
