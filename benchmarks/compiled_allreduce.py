"""What ``allreduce`` costs inside ``torch.compile`` against eager: 2 gloo ranks on loopback,
one step (``x * 0.5``, the all-reduce in place, ``+ 1``) eager and compiled with
``fullgraph=True``, alternated call by call, median seconds a step after a warm-up.
``--collective halves``: the step is ``reduce_scatter`` then ``all_gather`` instead.

    python benchmarks/compiled_allreduce.py --numel 4096 --numel 1048576 --backend aot_eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _step(x: Any, codec: str) -> Any:
    from dynamiq.collectives import allreduce

    y = x * 0.5
    allreduce(y, codec, "ring", threshold=0)
    return y + 1.0


def _halves(x: Any, codec: str) -> Any:
    from dynamiq.collectives import all_gather, reduce_scatter

    shard = reduce_scatter(x * 0.5, codec, "ring", threshold=0)
    full, _ = all_gather(shard, codec, "ring", threshold=0)
    return full + 1.0


def _job(
    rank: int,
    world: int,
    numels: list[int],
    codecs: list[str],
    backend: str,
    calls: int,
    collective: str = "allreduce",
):
    step = _halves if collective == "halves" else _step
    import torch

    torch.set_num_threads(1)
    rows = []
    for codec in codecs:
        for numel in numels:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            torch._dynamo.reset()
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            t0 = time.perf_counter()
            first = compiled(x, codec)
            compile_s = time.perf_counter() - t0
            same = bool(torch.equal(first, step(x, codec)))
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for i in range(calls + 3):
                for name, fn in (("eager", step), ("compiled", compiled)):
                    t0 = time.perf_counter()
                    fn(x, codec)
                    if i >= 3:
                        times[name].append(time.perf_counter() - t0)
            eager, comp = (statistics.median(times[k]) for k in ("eager", "compiled"))
            rows.append(
                {
                    "codec": codec,
                    "numel": numel,
                    "eager_s": eager,
                    "compiled_s": comp,
                    "ratio": comp / eager,
                    "first_call_s": compile_s,
                    "same_bytes": same,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, action="append")
    parser.add_argument("--codec", action="append")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--collective", choices=("allreduce", "halves"), default="allreduce")
    args = parser.parse_args(argv)
    from dynamiq.testing.distributed import run_gloo

    numels = args.numel or [4096, 1 << 20]
    codecs = args.codec or ["int8", "dynamiq"]
    job_args = (numels, codecs, args.backend, args.calls, args.collective)
    res = run_gloo(_job, 2, *job_args, timeout=1800)
    for status, value in res:
        if status != "ok":
            print(status, value, file=sys.stderr)
            return 1
    rows = res[0][1]
    for row in rows:
        print(json.dumps({"backend": args.backend, "collective": args.collective, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
