"""Wire trace of the engine, to show that a change to it keeps every byte.

For 289 runs (12 codecs, among them a data-dependent one and one with a prologue, x 6
schedule shapes x full runs with and without bounds and error feedback, and the
reduce-scatter and all-gather halves), every rank's ``isend``/``irecv`` in order (peer,
dtype, size, a hash of the bytes sent), its output, bound and residual hashes and its
counters, written as JSON. Run it before and after a change and compare the files::

    PYTHONPATH=. python benchmarks/wire_trace.py before.json [lockstep]
    ... change the engine ...
    PYTHONPATH=. python benchmarks/wire_trace.py after.json [lockstep] && cmp before.json after.json

``lockstep`` runs the rounds without overlap (the CUDA path), on the CPU.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dynamiq.codecs import Codec, get_codec
from dynamiq.collectives import api
from dynamiq.collectives import engine as eng
from dynamiq.collectives.schedules import get_schedule
from dynamiq.collectives.transport import LocalCluster, run_threads

LOCKSTEP = len(sys.argv) > 2 and sys.argv[2] == "lockstep"


def h(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class Tracing:
    def __init__(self, inner: Any, log: list[Any]):
        self.inner, self.log = inner, log
        self.rank, self.world_size = inner.rank, inner.world_size

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        self.log.append(("s", dst, str(t.dtype), t.numel(), h(t)))
        return self.inner.isend(t, dst)

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        self.log.append(("r", src, str(t.dtype), t.numel()))
        return self.inner.irecv(t, src)

    def close(self) -> None:
        pass


def xs_for(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(numel, generator=g) * torch.exp2(
            torch.randint(-6, 7, (numel,), generator=g)
        )
        x[numel // 5 : numel // 2] = 0.0
        out.append(x)
    return out


def run_case(
    codec: Any,
    sched_name: str,
    n: int,
    opts: dict | None,
    numel: int,
    sub: int,
    bound: bool,
    resid: bool,
    rounds: str = "all",
) -> dict[str, Any]:
    c = codec if isinstance(codec, Codec) else get_codec(codec)
    sched = get_schedule(sched_name, n, **(opts or {}))
    xs = xs_for(n, numel, 7)
    cl = LocalCluster(n)
    logs: list[list[Any]] = [[] for _ in range(n)]
    res_t = [torch.zeros(numel) if resid else None for _ in range(n)]

    def body(r: int) -> dict[str, Any]:
        tr = Tracing(cl.transport(r), logs[r])
        kw: dict[str, Any] = {}
        x = xs[r]
        if rounds == "rs":
            kw = {"rounds": (0, sched.reduce_rounds), "outputs": sched.owned_chunks(r)}
            # the chunks it does not keep are never written: in place they hold the input
            # (in a fresh buffer, whatever memory held), so the output's hash is the same
            # from run to run
            kw["inplace"] = True
            x = xs[r].clone()
        elif rounds == "ag":
            kw = {"rounds": (sched.reduce_rounds, sched.num_rounds)}
        if LOCKSTEP:
            kw["overlap"] = False
        res = eng.run_schedule(
            tr,
            x,
            c,
            sched,
            seed=11,
            step=3,
            sub_chunk=sub,
            return_bound=bound,
            timeout=60.0,
            # (a pooled codec's prologue describes this buffer from its first value: no offset)
            base_offset=64 if rounds == "all" and not callable(getattr(c, "prologue", None)) else 0,
            residual=res_t[r],
            **kw,
        )
        out = {
            "out": h(res.output),
            "bound": h(res.bound) if res.bound is not None else None,
            "resid": h(res_t[r]) if res_t[r] is not None else None,
            "sent": res.bytes_sent,
            "recv": res.bytes_received,
            "bsent": res.bound_bytes_sent,
            "csent": res.control_bytes_sent,
        }
        return out

    outs = run_threads(n, body, on_error=cl.aborted.set)
    return {"ranks": outs, "logs": logs}


def main() -> None:
    # the engine tests' codecs: one of data-dependent size, one with a prologue
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "collectives"))
    test_engine = importlib.import_module("test_engine")
    codecs: list[Any] = [
        "fp32",
        "bf16",
        "int8",
        "mxfp8_e4m3",
        "mxfp4",
        "nf4",
        "dynamiq",
        "thc",
        "omnireduce",
        {"id": "int", "bits": 4, "rounding": "stochastic"},
        test_engine._SparseFP32(),
        test_engine._AgreedInt8(bits=8),
    ]
    scheds = [
        ("ring", 4, None),
        ("butterfly", 6, None),
        ("tree", 5, None),
        ("hierarchical", 6, {"ranks_per_node": 3, "intra_codec": "fp32"}),
        ("hierarchical", 4, {"ranks_per_node": 2}),
        ("ring", 1, None),
    ]
    results: dict[str, Any] = {}
    for codec in codecs:
        for s, n, o in scheds:
            for numel, sub, bound, resid in [
                (3000, 256, True, True),
                (1000, 1 << 18, False, False),
            ]:
                key = json.dumps([str(codec)[:40], s, n, o, numel, sub, bound, resid])
                results[key] = run_case(codec, s, n, o, numel, sub, bound, resid)
            for part in ("rs", "ag"):
                key = json.dumps([str(codec)[:40], s, n, o, part])
                results[key] = run_case(codec, s, n, o, 2000, 128, False, False, part)
    # the public api: simulate_allreduce (avg, bf16 in), allreduce/reduce_scatter over LocalCluster
    xs = [x.bfloat16() for x in xs_for(4, 1500, 3)]
    sim = api.simulate_allreduce(xs, "int8", "butterfly", seed=2, op="avg", sub_chunk=128)
    results["sim"] = {
        "outs": [h(o) for o in sim.outputs],
        "bound": h(sim.bound),
        "sent": sim.bytes_sent,
        "vnmse": sim.vnmse,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, sort_keys=True, indent=0)
    print(len(results), "cases")


if __name__ == "__main__":
    main()
