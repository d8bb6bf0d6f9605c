"""One rank of ``dynamiq bench cluster`` (started by :mod:`dynamiq.bench.cluster` inside the
rank's network namespace; not a public entry point).

``python -m dynamiq.bench._cluster_worker --rank R --world N --master ADDR:PORT --spec FILE
--out FILE``: joins the gloo group over the shaped link, builds this rank's buffer, and for
every method of the spec runs ``warmup`` untimed and ``repeats`` timed all-reduces, each
started together after a barrier. It reads its own interface's counters after the barriers
that open and close the timed repeats and writes everything it measured to ``--out`` (JSON);
with ``save_outputs`` (a directory) in the spec it also saves each method's last result
(``<label>-<rank>.pt``), for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dynamiq.bench.netns import interface_counters


def rank_buffer(data: str, rank: int, world: int, numel: int, seed: int) -> torch.Tensor:
    """This rank's fp32 buffer of ``numel`` values.

    ``real``: rows ``rank, rank + world, …`` of the cached real eval gradients (one per
    simulated worker; disjoint between ranks), concatenated and cut to ``numel``; ``slice``:
    the committed slice's rows, tiled; ``randn``: seeded Gaussian values, scale ``1 + rank``.
    """
    if data == "randn":
        g = torch.Generator().manual_seed(seed * 1009 + rank)
        return torch.randn(numel, generator=g) * (1 + rank)
    if data == "slice":
        from dynamiq.data import load_slice

        rows = load_slice()
        row = rows[rank % rows.shape[0]]
        return row.repeat(-(-numel // row.numel()))[:numel].contiguous()
    if data == "real":
        from dynamiq.data import load_gradients

        grads = load_gradients("eval", 32, progress=False)
        parts = [grads[w] for w in range(rank, grads.shape[0], world)]
        out = torch.cat(parts) if parts else grads[rank % grads.shape[0]]
        while out.numel() < numel:
            out = torch.cat([out, out])
        return out[:numel].clone()
    raise ValueError(f"data must be 'real', 'slice' or 'randn' (got {data!r})")


def _run_method(
    method: dict[str, Any], x: torch.Tensor, spec: dict[str, Any], transport: Any
) -> dict[str, Any]:
    from dynamiq.collectives import AllReduceStats, allreduce

    warmup, repeats = int(spec["warmup"]), int(spec["repeats"])
    times: list[float] = []
    cpu_times: list[float] = []
    stats: list[dict[str, Any]] = []
    before = None
    for it in range(warmup + repeats):
        buf = x.clone()
        dist.barrier()
        if it == warmup:
            before = interface_counters(spec["ifname"])
        st: Any = None
        c0 = time.process_time()  # this rank's CPU time, all its threads (gloo's I/O too)
        t0 = time.perf_counter()
        if spec.get("collective") == "reduce_scatter":
            buf, st = _reduce_scatter(method, buf, spec, transport)
        elif method["kind"] == "torch":
            if method["dtype"] == "bf16":  # what bf16_compress_hook does with a bucket
                half = buf.to(torch.bfloat16)
                dist.all_reduce(half)
                buf.copy_(half)
            else:
                dist.all_reduce(buf)
        else:
            st = allreduce(
                buf,
                method["codec"],
                method["schedule"],
                transport=transport,
                sub_chunk=int(spec["sub_chunk"]),
                timeout=float(spec["timeout"]),
                verify=bool(method.get("verify", False)),
            )
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if it == warmup + repeats - 1 and spec.get("save_outputs"):
            path = os.path.join(spec["save_outputs"], f"{method['label']}-{dist.get_rank()}.pt")
            torch.save(buf, path)
        if it >= warmup:
            times.append(elapsed)
            cpu_times.append(cpu)
            if isinstance(st, AllReduceStats):
                stats.append(
                    {
                        "bytes_sent": st.bytes_sent,
                        "bytes_received": st.bytes_received,
                        "control_bytes_sent": st.control_bytes_sent,
                        "seconds": dict(st.seconds),
                    }
                )
    dist.barrier()
    after = interface_counters(spec["ifname"])
    assert before is not None
    return {
        "times": times,
        "cpu_times": cpu_times,
        "stats": stats,
        "counters": {k: after[k] - before[k] for k in after},
    }


def _reduce_scatter(
    method: dict[str, Any], x: torch.Tensor, spec: dict[str, Any], transport: Any
) -> tuple[torch.Tensor, Any]:
    """This rank's range ``[r·S, (r+1)·S)`` of the sum (what FSDP2 asks for) and the stats."""
    from dynamiq.collectives import Shard, reduce_scatter

    n, r = dist.get_world_size(), dist.get_rank()
    s = x.numel() // n
    if method["kind"] == "torch":
        src = x.to(torch.bfloat16) if method["dtype"] == "bf16" else x
        out = torch.empty(s, dtype=src.dtype)
        dist.reduce_scatter_tensor(out, src)
        return out.float(), None
    shard = reduce_scatter(
        x,
        method["codec"],
        method["schedule"],
        transport=transport,
        sub_chunk=int(spec["sub_chunk"]),
        timeout=float(spec["timeout"]),
        verify=bool(method.get("verify", False)),
        chunk_bounds=[(q * s, (q + 1) * s) for q in range(n)],
    )
    assert isinstance(shard, Shard) and shard.ranges == [(r * s, (r + 1) * s)]
    return shard.values, shard.stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    p.add_argument("--spec", required=True, help="JSON file: methods and settings")
    p.add_argument("--out", required=True, help="JSON file to write the measurements to")
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    torch.set_num_threads(int(spec.get("threads", 1)))
    if spec.get("compile"):
        from dynamiq.kernels import set_cpu_compile

        set_cpu_compile(True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=float(spec["timeout"])),
    )
    from dynamiq.collectives.transport import TorchDistTransport

    # one persistent transport, as the DDP hook keeps (no per-call setup); the configuration
    # check (a digest exchange, log2 n rounds) is part of every timed call
    transport = TorchDistTransport()
    x = rank_buffer(spec["data"], args.rank, args.world, int(spec["numel"]), int(spec["seed"]))
    results = []
    methods = spec["methods"]
    for k, method in enumerate(methods):
        t0 = time.perf_counter()
        res = _run_method(method, x, spec, transport)
        results.append({"method": method, **res})
        if args.rank == 0 and spec.get("progress", True):
            label = method.get("label", str(method))
            med = sorted(res["times"])[len(res["times"]) // 2]
            print(
                f"  [{spec.get('tag', '')}{k + 1}/{len(methods)}] {label:<28} "
                f"median {med:7.3f} s ({time.perf_counter() - t0:.0f} s with warm-up)",
                file=sys.stderr,
                flush=True,
            )
    with open(args.out + ".tmp", "w") as f:
        json.dump({"rank": args.rank, "results": results}, f)
    os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
