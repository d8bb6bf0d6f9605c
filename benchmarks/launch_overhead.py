"""Host time of one ``K.reduce(..., backend="triton")`` call outside Triton: the dispatcher's
checks and the launcher's Python, with every Triton kernel of the INT and MX families replaced
by a no-op (so neither Triton's launch path nor a GPU is involved).

On an H200 a 64M-value int8 / mxfp8_e4m3 reduce costs 0.25–0.28 ms a call for 0.10 ms of GPU
time (docs/benchmarks.md, "Kernels on a GPU"); this measures the part of that gap that is
dynamiq's own Python.

    python benchmarks/launch_overhead.py int8 mxfp8_e4m3 int4 mxfp4
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("codecs", nargs="+")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors on the Triton backend (never launched)
    import torch

    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext, get_codec
    from dynamiq.kernels import intq, mx

    class NoLaunch:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *a, **kw: None

    for module in (intq, mx):
        for attr in list(vars(module)):
            if attr.endswith("_kernel"):
                setattr(module, attr, NoLaunch())
    ctx = HopContext()
    for name in args.codecs:
        codec = get_codec(name)
        x = torch.randn(1 << 16)
        payload = K.encode(codec, x, ctx, backend="reference")
        for _ in range(100):
            K.reduce(codec, payload, x, ctx, ctx, backend="triton")
        t0 = time.perf_counter()
        for _ in range(args.calls):
            K.reduce(codec, payload, x, ctx, ctx, backend="triton")
        per_call = (time.perf_counter() - t0) / args.calls
        print(f"{name:12s} {per_call * 1e6:6.1f} µs a call (dispatcher + launcher, no launch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
