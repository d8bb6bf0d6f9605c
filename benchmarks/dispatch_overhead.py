"""Host time of one dispatched native-CPU call, against the native kernel called directly.

For every built-in codec with a native CPU kernel (docs/design.md, "Kernels"), on ``--numel``
values (4,096 by default) with one torch thread, the median time of one call of

* ``public``: the codec's own method (``codec.encode(x, ctx)``, ``codec.decode(...)``,
  ``codec.reduce(...)``: the default backend, which runs the native kernel at this size);
* ``cpu``: ``dynamiq.kernels.encode(codec, x, ctx, backend="cpu")`` (and ``decode``,
  ``reduce``);
* ``op``: the ``torch.library`` op (``torch.ops.dynamiq.encode.default`` ...,
  dynamiq/kernels/_ops.py) as a ``torch.compile`` graph calls it: its arguments (the codec's
  configuration, the hop context's ints, ``ctx.shared`` as tensors, the size) built once,
  ``backend="cpu"``;
* ``floor``: the native entry point itself (``dq_*_run``) on the very argument structure the
  dispatched call built, its output buffers already allocated: the kernel's own time.

``overhead = cpu - floor`` is what the dispatch costs on top of the kernel, ``op_overhead = op
- floor`` what the op costs. The floor is
captured by wrapping the library's entry point during one dispatched call and timing the
direct calls inside the wrapper, so every pointer it holds (DynamiQ's pooled budgets
included) is alive while it runs; it does not depend on how the dispatcher builds its
arguments. Codecs with a prologue run under the hop context a one-rank collective passes
(``ctx.shared`` its result). Codecs without a native kernel (``thc``, ``omnireduce``) are
listed with their ``public`` time only (their reference).

    python benchmarks/dispatch_overhead.py [--numel 4096] [--calls 2000] [--json]
    python benchmarks/dispatch_overhead.py --fresh [--calls 2000]

``--fresh`` times ``dynamiq`` at a new chunk of a pooled buffer each call (see :func:`fresh`):
what the engine pays, where no per-call memo is warm.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the native entry points a dispatched call may reach
ENTRY_POINTS = ("dq_int_run", "dq_mx_run", "dq_blk_run", "dq_pt_run", "dq_dyn_run")
OPS = ("encode", "decode", "reduce")


def _median_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    """Median of ``rounds * calls`` single-call times (µs), after a warm-up."""
    for _ in range(min(200, calls)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for _ in range(calls):
            t0 = clock()
            fn()
            samples.append(clock() - t0)
    return statistics.median(samples) / 1e3


def _floor_us(lib: Any, call: Callable[[], Any], calls: int) -> float | None:
    """The time of the native entry point ``call()`` reaches, called directly on the argument
    structure ``call()`` builds (``None`` when ``call()`` reaches none)."""
    found: list[float] = []
    saved = {name: getattr(lib, name) for name in ENTRY_POINTS}

    def wrap(name: str) -> Callable[[Any], int]:
        real = saved[name]

        def entry(ref: Any) -> int:
            status = int(real(ref))
            args = ref._obj  # the structure byref() points to, alive for this call
            found.append(_median_us(lambda: real(ctypes.byref(args)), calls))
            return status

        return entry

    try:
        for name in ENTRY_POINTS:
            setattr(lib, name, wrap(name))
        call()
    finally:
        for name, fn in saved.items():
            setattr(lib, name, fn)
    return found[0] if found else None


def _cases(codec: Any, n: int) -> dict[str, tuple[Callable[[], Any], ...]]:
    """op -> (public call, ``backend="cpu"`` call, the ``torch.library`` op as a compiled
    graph calls it: its arguments built once, ``backend="cpu"``)."""
    import torch

    import dynamiq.kernels as K
    from dynamiq.kernels import _ops

    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    local = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ctx = _context(codec, x, local)
    payload = codec.encode(x, ctx)
    key, ints, shared = _ops._codec_key(codec), _ops._ints(ctx), codec.shared_tensors(ctx.shared)
    nbytes = _ops._size(codec, n, ctx)
    ops = torch.ops.dynamiq
    return {
        "encode": (
            lambda: codec.encode(x, ctx),
            lambda: K.encode(codec, x, ctx, backend="cpu"),
            lambda: ops.encode.default(x, key, ints, shared, nbytes, "cpu"),
        ),
        "decode": (
            lambda: codec.decode(payload, n, ctx),
            lambda: K.decode(codec, payload, n, ctx, backend="cpu"),
            lambda: ops.decode.default(payload, n, key, ints, shared, "cpu"),
        ),
        "reduce": (
            lambda: codec.reduce(payload, local, ctx, ctx),
            lambda: K.reduce(codec, payload, local, ctx, ctx, backend="cpu"),
            lambda: ops.reduce.default(
                payload, local, key, ints, shared, ints, shared, nbytes, "cpu"
            ),
        ),
    }


def _context(codec: Any, x: Any, local: Any) -> Any:
    """The hop context of a one-rank collective: ``shared`` holds the codec's prologue result
    (the agreed tensor scale of ``nvfp4``, DynamiQ's pooled budgets) for ``x + local``, as
    the engine passes it, so no call computes statistics the prologue already agreed."""
    from dynamiq.codecs import HopContext

    stats = getattr(codec, "prologue_statistics", None)
    if not callable(stats):
        return HopContext()
    both = x + local
    part = stats(both, 0, None)
    if part is None:
        return HopContext()
    return HopContext(shared=codec.prologue_result(part, both.numel(), 1, None))


def measure(names: list[str], n: int, calls: int) -> list[dict[str, Any]]:
    from dynamiq.codecs import get_codec
    from dynamiq.kernels import cpu_native

    lib = cpu_native._load()
    rows = []
    for name in names:
        codec = get_codec(name)
        native = cpu_native.kernel(codec, "encode") is not None
        for op, (public, cpu, library) in _cases(codec, n).items():
            row: dict[str, Any] = {"codec": name, "op": op, "public_us": _median_us(public, calls)}
            if native:
                row["cpu_us"] = _median_us(cpu, calls)
                row["op_us"] = _median_us(library, calls)
                row["floor_us"] = _floor_us(lib, cpu, calls)
                if row["floor_us"] is not None:
                    row["overhead_us"] = row["cpu_us"] - row["floor_us"]
                    row["op_overhead_us"] = row["op_us"] - row["floor_us"]
            rows.append(row)
    return rows


def fresh(n: int, calls: int) -> dict[str, float]:
    """``dynamiq`` as the engine calls it: ``calls`` chunks of ``n`` values of one buffer
    pooled by one prologue, each call at the next chunk's offset (nothing memoized per call
    helps), ``backend="cpu"``; the median µs a call of encode, decode and reduce, each under
    its own prologue result (equal, not the same object: the payloads were made under
    another)."""
    import dataclasses

    import torch

    import dynamiq.kernels as K
    from dynamiq.codecs import get_codec

    codec = get_codec("dynamiq")
    total = n * calls
    x = torch.randn(total, generator=torch.Generator().manual_seed(0))
    local = torch.randn(total, generator=torch.Generator().manual_seed(1))

    def contexts() -> list[Any]:
        ctx = _context(codec, x, local)
        return [dataclasses.replace(ctx, offset=i * n) for i in range(calls)]

    xs = [x[i * n : (i + 1) * n] for i in range(calls)]
    ls = [local[i * n : (i + 1) * n] for i in range(calls)]
    made = contexts()
    payloads = [codec.encode(xi, c) for xi, c in zip(xs, made, strict=True)]
    ops = {
        "encode": lambda i, c: K.encode(codec, xs[i], c, backend="cpu"),
        "decode": lambda i, c: K.decode(codec, payloads[i], n, c, backend="cpu"),
        "reduce": lambda i, c: K.reduce(codec, payloads[i], ls[i], c, c, backend="cpu"),
    }
    out = {}
    clock = time.perf_counter_ns
    for op, call in ops.items():
        ctxs = contexts()
        samples = []
        for i, c in enumerate(ctxs):
            t0 = clock()
            call(i, c)
            samples.append(clock() - t0)
        out[f"{op}_us"] = statistics.median(samples) / 1e3
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("codecs", nargs="*", help="codec ids (default: every built-in)")
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--fresh", action="store_true", help="only dynamiq, each call at a new chunk (fresh)"
    )
    args = parser.parse_args(argv)
    import torch

    if args.fresh:
        torch.set_num_threads(1)
        print(json.dumps(fresh(args.numel, args.calls), indent=1))
        return 0

    from dynamiq.codecs import get_codec, list_codecs

    torch.set_num_threads(1)
    builtin = [c for c in list_codecs() if type(get_codec(c)).__module__.startswith("dynamiq.")]
    names = args.codecs or builtin
    rows = measure(names, args.numel, args.calls)
    if args.json:
        print(json.dumps({"numel": args.numel, "rows": rows}, indent=1))
        return 0
    print(f"µs a call, {args.numel} values, 1 thread (median)")
    print(
        '| codec | op | public | backend="cpu" | op (graph) | kernel (floor) | overhead | '
        "op overhead |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        keys = ("public_us", "cpu_us", "op_us", "floor_us", "overhead_us", "op_overhead_us")
        cells = [r.get(k) for k in keys]
        print(f"| {r['codec']} | {r['op']} | " + " | ".join(map(_fmt, cells)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
