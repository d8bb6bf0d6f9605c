"""How fast is the DynamiQ codec's PyTorch reference, before and after batching it?

Two measurements, each in one process so that the ratios share the machine's load:

``ops``: on ``--numel`` values (default 16M, heavy-tailed), the time of ``encode`` +
``decode`` and of the fused ``reduce`` for the first, span-by-span implementation (the
readable reference ``dynamiq/codecs/dynamiq_reference.py``, the "oracle" below; run once: it
is slow), the batched reference
(``_encode``/``_decode``/``_reduce``), the batched reference with its block functions compiled
(the CPU fast path, ``DYNAMIQ_CPU_COMPILE=1``), and ``mxfp8_e4m3``'s fused ``reduce`` on the
same fast path (``torch.compile``'d reference), checked bit for bit. Best of ``--iters``
interleaved runs (CPU time of the process and wall time).

``compare``: the wall time of a ``dynamiq compare`` command (what issue 5's sweeps run) with
the batched codec or, ``--oracle``, with the oracle patched in::

    python benchmarks/dynamiq_speed.py ops --threads 1
    python benchmarks/dynamiq_speed.py compare [--oracle] -- --codecs dynamiq --schedules ring \\
        --workers 8 --seeds 1 --numel 1048576 --quiet
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _patch_oracle() -> None:
    """Make every DynamiqCodec run the span-by-span oracle (encode, decode, bound)."""
    from dynamiq.codecs import DynamiqCodec
    from dynamiq.codecs.base import ErrorBound
    from dynamiq.codecs.dynamiq_reference import DynamiqReference

    def _encode(self: Any, x: Any, ctx: Any, **_: Any) -> Any:
        return DynamiqReference(self).encode(x, ctx)

    def _decode(self: Any, payload: Any, numel: int, ctx: Any, **_: Any) -> Any:
        return DynamiqReference(self).decode(payload, numel, ctx)

    def _reduce(self: Any, payload: Any, local: Any, ctx: Any, out_ctx: Any, **_: Any) -> Any:
        oracle = DynamiqReference(self)
        return oracle.encode(oracle.decode(payload, local.numel(), ctx) + local.float(), out_ctx)

    batched_bound = DynamiqCodec.error_bound

    def error_bound(self: Any) -> ErrorBound:
        eb = batched_bound.fget(self)  # type: ignore[attr-defined]
        return ErrorBound(
            formula=eb.formula,
            unbiased=eb.unbiased,
            max_abs=DynamiqReference(self).max_abs,
            witness=eb.witness,
            var=eb.var,
        )

    DynamiqCodec._encode = _encode  # type: ignore[method-assign]
    DynamiqCodec._decode = _decode  # type: ignore[method-assign]
    DynamiqCodec._reduce = _reduce  # type: ignore[method-assign]
    DynamiqCodec.error_bound = property(error_bound)  # type: ignore[method-assign,assignment]


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def cmd_ops(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from dynamiq import kernels
    from dynamiq.codecs import HopContext, get_codec
    from dynamiq.codecs.dynamiq_reference import DynamiqReference

    n = args.numel
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    b = torch.randn(n, generator=g)
    ctx = HopContext(hop=0, num_hops=2)
    out_ctx = HopContext(hop=1, num_hops=2, contributions=2)
    dq, mx = get_codec("dynamiq"), get_codec("mxfp8_e4m3")
    p = dq._encode(a, ctx)
    want_r = dq._reduce(p, b, ctx, out_ctx)
    res: dict[str, Any] = {"numel": n, "threads": torch.get_num_threads()}

    # the CPU fast path: first calls compile (DynamiQ's block functions; MXFP8's reference)
    kernels.set_cpu_compile(True)
    try:
        first = {}
        c, w, got = _timed(lambda: dq._encode(a, ctx, compiled=True))
        first["encode"], exact = w, bool(torch.equal(got, p))
        c, w, got = _timed(lambda: dq._decode(p, n, ctx, compiled=True))
        first["decode"] = w
        exact &= bool(torch.equal(got.view(torch.int32), dq._decode(p, n, ctx).view(torch.int32)))
        c, w, got = _timed(lambda: dq._reduce(p, b, ctx, out_ctx, compiled=True))
        first["reduce"], exact = w, exact and bool(torch.equal(got, want_r))
        pm = mx.encode(a, ctx)
        c, w, _ = _timed(lambda: kernels.reduce(mx, pm, b, ctx, out_ctx))
        first["mxfp8_e4m3 reduce"] = w
        res["first calls s (compile)"] = first
        res["compiled bit-exact"] = exact

        runs: dict[str, list[tuple[float, float]]] = {}
        cases: dict[str, Callable[[], Any]] = {
            "batched encode+decode": lambda: dq._decode(dq._encode(a, ctx), n, ctx),
            "batched reduce": lambda: dq._reduce(p, b, ctx, out_ctx),
            "compiled encode+decode": lambda: dq._decode(
                dq._encode(a, ctx, compiled=True), n, ctx, compiled=True
            ),
            "compiled reduce": lambda: dq._reduce(p, b, ctx, out_ctx, compiled=True),
            "mxfp8_e4m3 compiled reduce": lambda: kernels.reduce(mx, pm, b, ctx, out_ctx),
        }
        for _ in range(args.iters):
            for name, fn in cases.items():
                c, w, _ = _timed(fn)
                runs.setdefault(name, []).append((c, w))
    finally:
        kernels.set_cpu_compile(None)
    best = {
        k: {"cpu s": min(r[0] for r in v), "wall s": min(r[1] for r in v)} for k, v in runs.items()
    }

    if not args.skip_oracle:
        oracle = DynamiqReference(dq)
        c1, w1, po = _timed(lambda: oracle.encode(a, ctx))
        c2, w2, _ = _timed(lambda: oracle.decode(po, n, ctx))
        c3, w3, ro = _timed(lambda: oracle.encode(oracle.decode(p, n, ctx) + b, out_ctx))
        res["oracle bit-exact"] = bool(torch.equal(po, p) and torch.equal(ro, want_r))
        best["oracle encode+decode"] = {"cpu s": c1 + c2, "wall s": w1 + w2}
        best["oracle reduce"] = {"cpu s": c3, "wall s": w3}
    res["best"] = best
    return res


def cmd_compare(args: argparse.Namespace) -> dict[str, Any]:
    if args.oracle:
        _patch_oracle()
    from dynamiq.bench.cli import main

    t = time.perf_counter()
    rc = main(["compare", *args.rest])
    return {
        "implementation": "oracle" if args.oracle else "batched",
        "rc": rc,
        "wall s": time.perf_counter() - t,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ops", help="encode/decode/reduce times on --numel values")
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--skip-oracle", action="store_true")
    p.set_defaults(func=cmd_ops)
    p = sub.add_parser("compare", help="time a `dynamiq compare` command")
    p.add_argument("--oracle", action="store_true", help="with the span-by-span oracle")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the compare arguments")
    p.set_defaults(func=cmd_compare)
    args = parser.parse_args(argv)
    if getattr(args, "rest", None) and args.rest[0] == "--":
        args.rest = args.rest[1:]
    print(json.dumps(args.func(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
