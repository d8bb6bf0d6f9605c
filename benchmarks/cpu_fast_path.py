"""Does ``torch.compile`` make the CPU reference faster, bit for bit? (docs/design.md, "Kernels").

For a few codecs: compile cost, bit-exactness of the compiled reference against the plain one
(random and edge-case inputs, a block remainder), and the time of both (interleaved, minimum
of ``--iters`` runs, so that other load on the machine hurts both alike). Writes JSON to
``--out``. The compiled path is what ``DYNAMIQ_CPU_COMPILE=1`` switches on
(:mod:`dynamiq.kernels._compiled`).

    python benchmarks/cpu_fast_path.py --numel 1048576 --out cpu_fast_path.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CODECS = ["int8", "mxfp8_e4m3", "int4", "mxfp4", "bf16"]


def _inputs(n: int, seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    e = x.clone()
    e[::97] = 0.0
    e[1::101] = 2.0**-140
    e[2::4099] = float("nan")
    e[3::5003] = float("inf")
    e[4::64] = (torch.arange(len(e[4::64])) % 16 + 0.5).float()
    return [x, e]


def _same(a: Any, b: Any) -> bool:
    import torch

    if a.dtype == torch.uint8:
        return bool(torch.equal(a, b))
    return bool(
        torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--out", default="cpu_fast_path.json")
    args = parser.parse_args(argv)
    import torch

    from dynamiq.codecs import HopContext, get_codec

    n = args.numel
    ctx = HopContext()
    results: dict[str, Any] = {"numel": n, "threads": torch.get_num_threads(), "codecs": {}}
    print(f"{n} values, {torch.get_num_threads()} threads")
    print(f"  {'codec':12s} {'op':7s} {'compile s':>9s} {'exact':>6s} {'eager ms':>9s} "
          f"{'compiled ms':>11s} {'speedup':>8s}")  # fmt: skip
    ok = True
    for name in args.codecs.split(","):
        codec = get_codec(name)
        xs = _inputs(n, 1)
        local = _inputs(n, 2)[0]
        payload = codec._encode(xs[0], ctx)
        calls = {
            "encode": [(x, ctx) for x in xs] + [(xs[1][: n - 77], ctx)],
            "decode": [(payload, n, ctx)],
            "reduce": [(payload, local, ctx, ctx)],
        }
        for op, arglist in calls.items():
            eager = getattr(codec, f"_{op}")
            compiled = torch.compile(eager, dynamic=True)
            t0 = time.perf_counter()
            outs = [compiled(*a) for a in arglist]
            compile_s = time.perf_counter() - t0
            exact = all(_same(o, eager(*a)) for o, a in zip(outs, arglist, strict=True))
            ok &= exact
            te, tc = [], []
            for _ in range(args.iters):
                t = time.perf_counter()
                eager(*arglist[0])
                te.append(time.perf_counter() - t)
                t = time.perf_counter()
                compiled(*arglist[0])
                tc.append(time.perf_counter() - t)
            row = {
                "compile_seconds": compile_s,
                "exact": exact,
                "eager_ms": min(te) * 1e3,
                "compiled_ms": min(tc) * 1e3,
                "speedup": min(te) / min(tc),
            }
            results["codecs"].setdefault(name, {})[op] = row
            print(f"  {name:12s} {op:7s} {compile_s:9.1f} {exact!s:>6s} {row['eager_ms']:9.1f} "
                  f"{row['compiled_ms']:11.1f} {row['speedup']:7.1f}x", flush=True)  # fmt: skip
    results["all_exact"] = ok
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
