"""The ``torch.library`` ops on a device (issue 18 item 3; a step of ``gpu_check.py``).

For each codec: ``torch.compile(fullgraph=True, backend="aot_eager")`` of encode, reduce and
decode on ``device`` tensors must give the eager bytes, and the graph must hold the three ops
(``torch.ops.dynamiq.*``); then the host time of one eager call of each operation against the
op called as a compiled graph calls it (arguments built once), on ``numel`` values: the median
of ``iters`` rounds of ``calls`` calls, synchronising once per round (the per-call time is
host-bound at this size on a GPU).

    python benchmarks/gpu_ops.py [--dry-run]
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

CODECS = ("int8", "mxfp8_e4m3", "dynamiq")


def _host_us(fn: Any, device: Any, calls: int, iters: int) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    rounds = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def check_ops(
    device: Any, numel: int = 4096, calls: int = 200, iters: int = 5, names: tuple = CODECS
) -> list[dict[str, Any]]:
    """One row per codec: ``compiled_equal``, ``ops_in_graph`` and the host µs a call (an
    error is reported in its row, and the next codec runs)."""
    rows = []
    for name in names:
        row: dict[str, Any] = {"codec": name, "numel": numel}
        try:
            row.update(_row(name, device, numel, calls, iters))
        except Exception as e:  # a step of a lent machine's run: report, go on
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
    return rows


def _row(name: str, device: Any, numel: int, calls: int, iters: int) -> dict[str, Any]:
    import torch

    from dynamiq.codecs import HopContext, get_codec
    from dynamiq.kernels import _ops

    codec = get_codec(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g).to(device)
    local = torch.randn(numel, generator=g).to(device)
    ctx, out = HopContext(num_hops=2), HopContext(hop=1, num_hops=2, contributions=2)

    def three(x: Any, local: Any) -> tuple[Any, ...]:
        p = codec.encode(x, ctx)
        r = codec.reduce(p, local, ctx, out)
        return p, r, codec.decode(r, local.numel(), out)

    seen: list[Any] = []

    def backend(gm: Any, inputs: Any) -> Any:
        seen.extend(n.target for n in gm.graph.nodes)
        return gm.forward

    want = three(x, local)
    torch._dynamo.reset()
    got = torch.compile(three, fullgraph=True, backend=backend)(x, local)
    row: dict[str, Any] = {
        "compiled_equal": all(torch.equal(a, b) for a, b in zip(want, got, strict=True)),
        "ops_in_graph": {"encode", "decode", "reduce"}
        <= {getattr(t, "_opname", None) for t in seen},
    }
    payload = want[0]
    key, ints, op = _ops._codec_key(codec), _ops._ints(ctx), torch.ops.dynamiq
    nbytes = codec.encoded_nbytes(numel, ctx)
    cases = {
        "encode": (
            lambda: codec.encode(x, ctx),
            lambda: op.encode.default(x, key, ints, [], payload.numel(), "auto"),
        ),
        "reduce": (
            lambda: codec.reduce(payload, local, ctx, ctx),
            lambda: op.reduce.default(payload, local, key, ints, [], ints, [], nbytes, "auto"),
        ),
        "decode": (
            lambda: codec.decode(payload, numel, ctx),
            lambda: op.decode.default(payload, numel, key, ints, [], "auto"),
        ),
    }
    for name_op, (eager, library) in cases.items():
        row[f"{name_op}_eager_us"] = _host_us(eager, device, calls, iters)
        row[f"{name_op}_op_us"] = _host_us(library, device, calls, iters)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, tiny counts")
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cpu" if args.dry_run else "cuda")
    calls, iters = (20, 2) if args.dry_run else (200, 5)
    print(json.dumps(check_ops(device, calls=calls, iters=iters), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
