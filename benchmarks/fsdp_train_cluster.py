"""FSDP2 training on the emulated cluster: step time and loss of default FSDP2 (fp32 and bf16
reduce) against ``dynamiq.fsdp.compress`` (issue 16's training benchmark).

    sudo python benchmarks/fsdp_train_cluster.py --ranks 4 --rate 100mbit --steps 300 \
        --methods fp32,bf16,mxfp8_e4m3,dynamiq --json out.json

Each method trains ``examples/train_fsdp.py`` (a byte-level transformer on CPython's docs,
every block and the root ``fully_shard``-ed) from the same seed, one gloo rank per network
namespace of :class:`dynamiq.bench.netns.EmulatedCluster`, links shaped to ``--rate``, one
torch thread per rank. ``fp32`` and ``bf16`` are FSDP2's own reduce-scatter
(``MixedPrecisionPolicy.reduce_dtype`` fp32 or bf16); any other method is a codec id for
``dynamiq.fsdp.compress`` (ring). Reported per method: seconds per step (the whole run over
its steps, rank 0), the mean loss of the last 50 steps, and the bytes rank 0 sent through
dynamiq per step. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dynamiq.bench.netns import EmulatedCluster

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_fsdp.py"
PORT = 29531


def run_method(method: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Train ``method`` once on a fresh cluster; rank 0's losses and statistics."""
    out = os.path.join(tmp, f"{method}.json")
    argv = [sys.executable, str(EXAMPLE), "--steps", str(args.steps), "--json", out]
    argv += ["--codec", "none" if method in ("fp32", "bf16") else method]
    if method == "bf16":
        argv.append("--bf16-reduce")
    with EmulatedCluster(args.ranks, rate=args.rate) as cl:
        env = {
            "MASTER_ADDR": cl.addresses[0],
            "MASTER_PORT": str(PORT),
            "WORLD_SIZE": str(args.ranks),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        t0 = time.perf_counter()
        procs = [
            cl.popen(r, argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(args.ranks)
        ]
        codes = [p.wait(timeout=args.timeout) for p in procs]
        wall = time.perf_counter() - t0
        shaping = cl.shaping
    if any(codes):
        raise SystemExit(f"{method}: a rank exited with {codes}")
    with open(out) as f:
        res = json.load(f)
    losses = res["losses"]
    sent = sum(s["bytes_sent"] for s in res["comm_stats"]) / args.steps
    return {
        "method": method,
        "seconds_per_step": res["seconds"] / args.steps,
        "wall_s": wall,
        "loss_last50": sum(losses[-50:]) / len(losses[-50:]),
        "bytes_sent_per_step_rank0": sent,
        "losses": losses,
        "shaping": shaping,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--methods", default="fp32,bf16,mxfp8_e4m3,dynamiq")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            row = run_method(method, args, tmp)
            rows.append(row)
            print(
                f"{method:12s} {row['seconds_per_step'] * 1e3:8.1f} ms/step  loss(last 50) "
                f"{row['loss_last50']:.4f}  {row['bytes_sent_per_step_rank0'] / 1e6:.3f} MB/step",
                flush=True,
            )
    base = {r["method"]: r for r in rows}
    for r in rows:
        if "bf16" in base:
            r["step_speedup_vs_bf16"] = base["bf16"]["seconds_per_step"] / r["seconds_per_step"]
    if args.json:
        meta = {"ranks": args.ranks, "rate": args.rate, "steps": args.steps}
        meta["load_average_end"] = list(os.getloadavg())
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
