"""GPU check of the Triton kernels: bit-exactness, then fused-reduce speed (docs/design.md,
"Measures").

Needs only this checkout, torch, Triton >= 3.6 and a CUDA GPU (no network). For every codec with
kernels it

1. checks the kernels bit for bit against the PyTorch reference computed on the same machine:
   on the GPU (random, edge-case and block-remainder inputs, fp32/bf16/fp16, encode, decode and
   reduce) and, for small inputs, against the reference on the CPU too (wire bytes must not
   depend on the device);
2. (after the headline timing) runs :mod:`gpu_ops`: ``torch.compile`` of the codecs' calls on
   the device gives the eager bytes through the ``torch.library`` ops, and the host time of an
   eager call against the op's;
3. times, on ``--numel`` values (default 64M), the fused ``reduce`` kernel against the unfused
   ``decode + add + encode`` (Triton kernels, with an fp32 tensor in memory between them) and
   against the torch reference, and relates the fused kernel to the memory roofline: the bytes
   it must move (incoming payload + local slice + outgoing payload) at the copy bandwidth
   measured with ``torch.clone`` of a large tensor.

The exactness checks run one codec per worker process, ``--jobs`` at a time (default: the CPU
count, at most 16): compiling the ~300 kernel variants (about 10 minutes on one core, 70 % of
it THC's 16384-value blocks) is most of the check's time, and the processes share Triton's
on-disk cache, so the timing step finds its kernels compiled.

The two headline codecs (int8, mxfp8_e4m3) are timed first, before the checks, and the JSON
is rewritten after every step; with ``--deadline S`` whatever would start after S seconds is
skipped and reported as such, so a run on a lent machine ends with its results written.

Prints a table and writes everything to ``--out`` (JSON). ``--dry-run`` runs the same code on
the CPU with tiny sizes through Triton's interpreter (its timings mean nothing), so the script
can be checked without a GPU. ``--compile-only ARCH`` compiles every kernel the checks launch
for ``sm_ARCH`` (e.g. 90) without a GPU, with Triton's bundled ``ptxas``.

    python benchmarks/gpu_check.py --out gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: codecs timed; the first two are the headline
TIMED = ["int8", "mxfp8_e4m3", "int4", "mxfp4", "mxfp6_e3m2", "bf16", "fp32", "dynamiq"]
TIMED += ["omnireduce", "thc"]
#: non-default configurations checked beside the registered names
EXTRA = {
    "int4_stochastic": {"id": "int", "bits": 4, "rounding": "stochastic"},
    "int3_fp16_stochastic": {
        "id": "int",
        "bits": 3,
        "scale_format": "fp16",
        "rounding": "stochastic",
    },
    "int6_fp32": {"id": "int", "bits": 6, "scale_format": "fp32"},
    "int5_e8m0": {"id": "int", "bits": 5, "scale_format": "e8m0"},
    "int3_block3": {"id": "int", "bits": 3, "block_size": 3},
    "int8_block4100": {"id": "int", "bits": 8, "block_size": 4100},
    "dynamiq_stochastic": {"id": "dynamiq", "rounding": "stochastic", "span": 4096},
    "dynamiq_correlated_slope": {
        "id": "dynamiq",
        "rounding": "correlated",
        "hop_slope": 1.0,
        "bits": 3.5,
        "span": 2048,
        "super_group": 256,
    },
    "dynamiq_uniform_k1": {"id": "dynamiq", "levels": "uniform", "scale_steps": 1, "span": 8192},
    "dynamiq_unpooled_k3": {"id": "dynamiq", "pooled": False, "scale_steps": 3, "span": 4096},
    "dynamiq_g3_k4": {
        "id": "dynamiq",
        "group": 3,
        "super_group": 96,
        "span": 960,
        "scale_steps": 4,
    },
    "dynamiq_sg8192_b7": {"id": "dynamiq", "super_group": 8192, "span": 16384, "bits": 7.5},
    "thc_widen": {"id": "thc", "variant": "widen"},
    "thc_max_b256_seg4": {"id": "thc", "scale": "max", "block_size": 256, "scale_blocks": 4},
    "omnireduce_d0.1": {"id": "omnireduce", "density": 0.1},
    "omnireduce_d0.5_fp16_b32": {
        "id": "omnireduce",
        "density": 0.5,
        "block_size": 32,
        "value_format": "fp16",
    },
    "omnireduce_d0.1_fp32_b8192": {  # blocks of 4 GPU tiles: strided slices
        "id": "omnireduce",
        "density": 0.1,
        "block_size": 8192,
        "value_format": "fp32",
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON results path")
    parser.add_argument("--numel", type=float, default=64 * 2**20, help="values per timing")
    parser.add_argument("--local-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions (median)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes")
    parser.add_argument("--compile-only", type=int, metavar="ARCH", help="e.g. 90: no GPU")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="codecs checked at a time in worker processes (default: the CPU count, at most "
        "16; 1 with --dry-run). Compiling the ~300 kernel variants is most of the check's "
        "time, one CPU core per process",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=0,
        help="seconds after which checks and timings not yet started are skipped (and "
        "reported as such) so the run ends with its results written; 0: none",
    )
    parser.add_argument(
        "--check",
        default="",
        help="comma-separated name prefixes: check the exactness of these codecs only "
        "(default: every codec with kernels)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the geometry sweep")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import torch

    if args.compile_only:
        return compile_only(args.compile_only)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on the CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    numel = 4096 if args.dry_run else int(args.numel)
    results: dict[str, Any] = {"environment": environment(device)}
    print(json.dumps(results["environment"], indent=1))
    jobs = args.jobs if args.jobs is not None else (1 if args.dry_run else _cpu_count(16))
    deadline = time.monotonic() + args.deadline if args.deadline else math.inf
    out = Path(args.out)
    iters = 2 if args.dry_run else args.iters
    local_dtype = getattr(torch, args.local_dtype)

    def save() -> None:  # after every step: a run cut short still leaves what it measured
        out.write_text(json.dumps(results, indent=1) + "\n")

    # the headline codecs first (their kernels compile in seconds), then the exactness of
    # every codec, then the timing of the others, whose kernels the checks have compiled
    timing = results["timing"] = {}
    time_kernels(device, numel, local_dtype, iters, TIMED[:2], out=timing, save=save)
    # the torch.library ops on the device: compiled bytes equal, host µs a call (issue 18)
    from gpu_ops import check_ops

    results["ops"] = check_ops(
        device, calls=2 if args.dry_run else 200, iters=1 if args.dry_run else 5
    )
    save()
    if not args.no_sweep:
        results["sweep"] = sweep_rows(device, numel, local_dtype, iters, deadline)
        save()
    t0 = time.perf_counter()
    results["exactness"] = check_exactness(
        device, small=args.dry_run, jobs=max(1, jobs), deadline=deadline, only=args.check
    )
    results["exactness_seconds"] = time.perf_counter() - t0
    save()
    time_kernels(
        device, numel, local_dtype, iters, TIMED[2:], deadline=deadline, out=timing, save=save
    )
    failures = [r for r in results["exactness"] if not r["ok"]]
    unchecked = [r["codec"] for r in results["exactness"] if r.get("skipped")]
    untimed = [n for n in TIMED if n not in timing["codecs"]]
    results["ok"] = not failures and not unchecked
    results["unchecked"], results["untimed"] = unchecked, untimed
    save()
    print(f"\nwrote {out}")
    if unchecked or untimed:
        print(f"past the deadline: not checked {unchecked}, not timed {untimed}")
    bad = [r for r in failures if not r.get("skipped")]
    if bad:
        print(f"{len(bad)} bit-exactness failures, e.g. {bad[0]}")
        return 1
    return 0 if results["ok"] else 3


def _cpu_count(cap: int) -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, cap))


def environment(device: Any) -> dict[str, Any]:
    import torch
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}")
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


# -- 1. bit-exactness -------------------------------------------------------------------------


def _codecs() -> dict[str, Any]:
    import dynamiq.kernels as K
    from dynamiq.codecs import get_codec, list_codecs

    named = {n: get_codec(n) for n in list_codecs() if K.has_kernels(get_codec(n))}
    return {**named, **{n: get_codec(c) for n, c in EXTRA.items()}}


def _inputs(codec: Any, n: int, seed: int) -> list[Any]:
    """Random mixed magnitudes, and blocks of zeros, subnormals, huge values, ties, NaN, ±Inf."""
    import torch

    g = torch.Generator().manual_seed(seed)
    top = min(codec.max_input_abs, 2.0**100)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = (x * torch.exp2(torch.randint(-40, 41, (n,), generator=g).double())).clamp(-top, top)
    b = codec.block_size
    e = torch.randn(n, generator=g).double()
    k = torch.arange(n) // max(b, 1) % 8
    e = torch.where(k == 0, 0.0, e)
    e = torch.where(k == 1, e * 2.0**-140, e)
    e = torch.where(k == 2, torch.sign(e) * top, e)
    e = torch.where(k == 3, (torch.arange(n) % 64 - 32 + 0.5) * 2.0**-3, e)
    e = torch.where((k == 4) & (torch.arange(n) % max(b, 1) == 0), math.nan, e)
    e = torch.where((k == 5) & (torch.arange(n) % max(b, 1) == 1), -math.inf, e)
    e = torch.where(k == 6, e * 2.0**-24, e)
    return [x.float(), e.float()]


def _same(codec: Any, got: Any, want: Any) -> bool:
    """Bytes equal (every NaN a codec writes is canonical); fp32 values (decoded outputs and
    the ``fp32`` codec's payloads, which carry fp32 sums) with NaN compared by position, since
    which NaN bits an fp32 add returns is the hardware's choice."""
    import torch

    from dynamiq.codecs.passthrough import FP32Codec

    if got is None or want is None:
        return got is want
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype == torch.uint8 and not isinstance(codec, FP32Codec):
        return bool(torch.equal(got, want))
    g, w = got.view(torch.float32), want.view(torch.float32)
    if not torch.equal(g.isnan(), w.isnan()):
        return False
    return bool(
        torch.equal(g.nan_to_num(0.0).view(torch.int32), w.nan_to_num(0.0).view(torch.int32))
    )


def _run(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except ValueError as exc:  # the INT codecs beyond max_input_abs: both must raise alike
        return ("ValueError", str(exc))


def _check_codec(name: str, codec: Any, device: Any, small: bool) -> dict[str, Any]:
    """Every kernel of one codec against the reference: the report row."""
    import torch

    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext

    ctx = HopContext(seed=7, step=3, hop=1, num_hops=4, rank=2, offset=2**32 - 40)
    out_ctx = HopContext(seed=7, step=3, hop=2, num_hops=4, rank=5, offset=2**32 - 40)
    sizes = (0, 1, 31, 33, 1000) if small else (0, 1, 31, 33, 1000, 100_003, 1 << 20)
    ok, cases, first_bad = True, 0, None
    t0 = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in sizes:
            for i, x in enumerate(_inputs(codec, n, n + 1)):
                x = x.to(dtype)
                local = _inputs(codec, n, n + 2)[1 - i].to(dtype)
                # the reference on the same device, and on the CPU for small sizes
                cpu = torch.device("cpu")
                refs = [device] + ([cpu] if n <= 1000 and device != cpu else [])
                got_p = _run(K.encode, codec, x.to(device), ctx, backend="triton")
                for rdev in refs:
                    want_p = _run(K.encode, codec, x.to(rdev), ctx, backend="reference")
                    checks = [("encode", got_p, want_p)]
                    if isinstance(want_p, tuple):
                        raised = isinstance(got_p, tuple) and got_p == want_p
                        checks = [("encode raises", raised, True)]
                    else:
                        got_v = K.decode(codec, want_p.to(device), n, ctx, backend="triton")
                        want_v = K.decode(codec, want_p, n, ctx, backend="reference")
                        got_r = _run(
                            K.reduce,
                            codec,
                            want_p.to(device),
                            local.to(device),
                            ctx,
                            out_ctx,
                            backend="triton",
                        )
                        want_r = _run(
                            K.reduce,
                            codec,
                            want_p,
                            local.to(rdev),
                            ctx,
                            out_ctx,
                            backend="reference",
                        )
                        checks += [("decode", got_v, want_v)]
                        if isinstance(want_r, tuple) or isinstance(got_r, tuple):
                            raised = isinstance(got_r, tuple) and got_r == want_r
                            checks += [("reduce raises", raised, True)]
                        else:
                            checks += [("reduce", got_r, want_r)]
                    for op, got, want in checks:
                        cases += 1
                        same = got is want if isinstance(want, bool) else _same(codec, got, want)
                        if not same and first_bad is None:
                            first_bad = f"{op} {dtype} n={n} input {i} ref on {rdev}"
                        ok &= same
    assert K.last_backend() == "reference"
    return {
        "codec": name,
        "ok": ok,
        "cases": cases,
        "first_mismatch": first_bad,
        "seconds": time.perf_counter() - t0,
    }


def _check_in_worker(name: str, device_type: str, small: bool) -> dict[str, Any]:
    """``_check_codec`` in a worker process (it compiles its own kernels: compiling is what
    takes the time, one CPU core per process; the Triton cache on disk is shared)."""
    import torch

    try:
        return _check_codec(name, _codecs()[name], torch.device(device_type), small)
    except Exception as exc:  # a crash is a failed check, reported with the rest
        return {
            "codec": name,
            "ok": False,
            "cases": 0,
            "first_mismatch": f"{type(exc).__name__}: {exc}",
            "seconds": 0.0,
        }


def _print_row(row: dict[str, Any]) -> None:
    first = f"  first: {row['first_mismatch']}" if row["first_mismatch"] else ""
    verdict = "ok" if row["ok"] else "skipped" if row.get("skipped") else "MISMATCH"
    print(
        f"  {row['codec']:26s} {verdict:9s} {row['cases']:5d} cases {row['seconds']:6.1f}s{first}",
        flush=True,
    )


def _skipped(name: str) -> dict[str, Any]:
    return {
        "codec": name,
        "ok": False,
        "skipped": True,
        "cases": 0,
        "first_mismatch": "not checked: past the deadline",
        "seconds": 0.0,
    }


def check_exactness(
    device: Any, small: bool, jobs: int = 1, deadline: float = math.inf, only: str = ""
) -> list[dict[str, Any]]:
    """Every codec with kernels (and the EXTRA configurations; ``only``: those whose names
    start with one of its comma-separated prefixes), ``jobs`` codecs at a time in worker
    processes (``jobs=1``: in this process). Codecs not done by ``deadline``
    (``time.monotonic()``) are reported as skipped, and their workers stopped."""
    prefixes = tuple(p for p in only.split(",") if p)
    names = [n for n in _codecs() if not prefixes or n.startswith(prefixes)]
    print(f"\nbit-exactness (Triton vs reference), {len(names)} codecs, {jobs} at a time")
    if jobs <= 1:
        rows = []
        for name in names:
            if time.monotonic() > deadline:
                rows.append(_skipped(name))
            else:
                rows.append(_check_codec(name, _codecs()[name], device, small))
            _print_row(rows[-1])
        return rows
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures import TimeoutError as FuturesTimeout

    done: dict[str, dict[str, Any]] = {}
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
    # the slowest to compile first (THC's 16384-value tiles, then DynamiQ): the critical path
    slow_first = sorted(names, key=lambda n: (not n.startswith("thc"), not n.startswith("dyn")))
    futures = {pool.submit(_check_in_worker, n, device.type, small): n for n in slow_first}
    left = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
    try:
        for fut in as_completed(futures, timeout=left):
            row = fut.result()
            done[row["codec"]] = row
            _print_row(row)
    except FuturesTimeout:
        print("  past the deadline: stopping the checks still running")
        workers = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            proc.terminate()
        for name in names:
            if name not in done:
                done[name] = _skipped(name)
                _print_row(done[name])
    else:
        pool.shutdown()
    return [done[n] for n in names]


# -- 2. timing --------------------------------------------------------------------------------


def _timer(device: Any, iters: int) -> Callable[[Callable[[], Any]], float]:
    import torch

    def measure(fn: Callable[[], Any]) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure


def _device_seconds(fn: Callable[[], Any], iters: int) -> dict[str, Any]:
    """What the GPU itself spends per call of ``fn`` (its kernels and copies, from the
    profiler), without the host's launch gaps and syncs between calls; and the wall time per
    call of ``iters`` back-to-back calls (``burst``)."""
    import torch

    if not torch.cuda.is_available():
        return {"device_seconds": math.nan, "burst_seconds": math.nan, "kernels": []}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    burst = start.elapsed_time(end) / 1e3 / iters
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        us = sum(e.time_range.elapsed_us() for e in events)
        if not us:  # older layouts: the per-name totals
            us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
        names = sorted({e.name[:60] for e in events})
        secs = us / 1e6 / iters if us else math.nan  # nothing recorded: unknown, not 0
        return {"device_seconds": secs, "burst_seconds": burst, "kernels": names}
    except Exception as exc:  # the profiler is a diagnostic: report, do not fail the run
        return {"device_seconds": math.nan, "burst_seconds": burst, "kernels": [repr(exc)]}


def sweep_rows(
    device: Any, numel: int, local_dtype: Any, iters: int, deadline: float = math.inf
) -> list[dict[str, Any]]:
    """The 8-bit INT and MX fused reduce in each geometry: the general ``[ROWS, G, 8]``
    kernel, and the rows kernel at several values per program and warps per program (the
    defaults in ``kernels.intq`` / ``kernels.mx`` are chosen from this table). Every
    geometry's output must equal the default's bytes."""
    import torch

    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext, get_codec
    from dynamiq.kernels import intq as kintq
    from dynamiq.kernels import mx as kmx

    measure = _timer(device, iters)
    g = torch.Generator(device=device).manual_seed(1)
    rows: list[dict[str, Any]] = []
    geometry = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]
    if device.type != "cuda":
        geometry = [(256, 4), (4096, 8)]
    configs = [(False, 0, 4)] + [(True, t, w) for t, w in geometry]
    print("\nsweep: 8-bit fused reduce per kernel geometry (ms per call; device ms)")
    for name, module in (("int8", kintq), ("mxfp8_e4m3", kmx)):
        codec = get_codec(name)
        local = torch.randn(numel, device=device, generator=g).to(local_dtype)
        ctx = HopContext()
        payload = K.encode(codec, torch.randn(numel, device=device, generator=g), ctx)
        want = K.reduce(codec, payload, local, ctx, ctx, backend="triton")
        saved = (module.ROWS_PATH, module.NUM_WARPS, module.tile_elems)
        for rows_path, tile, warps in configs:
            if time.monotonic() > deadline:
                break
            module.ROWS_PATH, module.NUM_WARPS = rows_path, warps
            if tile:
                module.tile_elems = lambda d, t=tile: t
            try:

                def fused(c: Any = codec, p: Any = payload, x: Any = local, a: Any = ctx) -> Any:
                    return K.reduce(c, p, x, a, a, backend="triton")

                same = bool(torch.equal(fused(), want))
                t = measure(fused)
                dev = _device_seconds(fused, iters)
            finally:
                module.ROWS_PATH, module.NUM_WARPS, module.tile_elems = saved
            row = {
                "codec": name,
                "rows_kernel": rows_path,
                "tile": tile or "default",
                "num_warps": warps if rows_path else "default",
                "seconds": t,
                "device_seconds": dev["device_seconds"],
                "burst_seconds": dev["burst_seconds"],
                "kernels": dev["kernels"],
                "same_bytes": same,
            }
            rows.append(row)
            print(
                f"  {name:11s} {'rows' if rows_path else 'general':8s} tile {tile or '-':>5} "
                f"warps {warps}: {t * 1e3:7.3f} ms; device {dev['device_seconds'] * 1e3:7.3f} ms;"
                f" burst {dev['burst_seconds'] * 1e3:7.3f} ms; same bytes {same}",
                flush=True,
            )
        del local, payload, want
    return rows


class _OneRank:
    """The exchange a codec's ``prologue`` gets, for a world of one rank (``rank`` and
    ``world_size`` too: the pooled DynamiQ's statistics read them)."""

    rank, world_size = 0, 1

    def allgather(self, tensor: Any) -> list[Any]:
        return [tensor]


def time_kernels(
    device: Any,
    numel: int,
    local_dtype: Any,
    iters: int,
    names: list[str],
    deadline: float = math.inf,
    out: dict[str, Any] | None = None,
    save: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Time ``names`` into ``out`` (``save()`` after each codec), skipping what would start
    after ``deadline``. The copy is timed at every call; the roofline uses the fastest copy
    of the run (the conservative fraction)."""
    import torch

    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext, get_codec

    measure = _timer(device, iters)
    big = torch.randn(numel, device=device)
    copy_s = measure(big.clone)
    copy_dev = _device_seconds(big.clone, iters)
    del big
    out = {} if out is None else out
    copies = out.setdefault("copy_seconds", [])
    copies.append(copy_s)
    copy_bw = 2 * numel * 4 / min(copies)
    dev_copies = out.setdefault("copy_device_seconds", [])
    dev_copies.append(copy_dev["device_seconds"])
    copy_bw_dev = 2 * numel * 4 / min(dev_copies)
    out["copy_device_bandwidth_gbs"] = copy_bw_dev / 1e9
    out.update(numel=numel, local_dtype=str(local_dtype).split(".")[-1])
    out["copy_bandwidth_gbs"] = copy_bw / 1e9
    out.setdefault("codecs", {})
    print(
        f"\ntiming on {numel} values, local {out['local_dtype']}; "
        f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (torch clone, read + write; "
        f"{copy_bw_dev / 1e9:.0f} GB/s from the device time)"
    )
    head = ("codec", "fused ms", "unfused ms", "torch ms", "GB/s", "roofline", "vs unfused")
    print("  {:12s} {:>9s} {:>10s} {:>9s} {:>7s} {:>9s} {:>10s}".format(*head))
    g = torch.Generator(device=device).manual_seed(0)
    for name in names:
        if time.monotonic() > deadline:
            print(f"  {name:12s} not timed: past the deadline")
            continue
        codec = get_codec(name)
        local = torch.randn(numel, device=device, generator=g).to(local_dtype)
        first = torch.randn(numel, device=device, generator=g)
        # a hop inside a collective: one contribution in, two out, with what a codec's
        # prologue agrees on (THC's scales, OmniReduce's threshold) from a one-rank exchange
        prologue = getattr(codec, "prologue", None)
        shared = prologue(first, _OneRank()) if callable(prologue) else None
        c_in = HopContext(contributions=1, shared=shared)
        c_out = HopContext(contributions=2, shared=shared)
        payload = K.encode(codec, first, c_in, backend="triton")
        del first

        def fused(
            c: Any = codec, p: Any = payload, x: Any = local, a: Any = c_in, b: Any = c_out
        ) -> Any:
            return K.reduce(c, p, x, a, b, backend="triton")

        def unfused(
            c: Any = codec, p: Any = payload, x: Any = local, a: Any = c_in, b: Any = c_out
        ) -> Any:
            return K.encode(
                c, K.decode(c, p, x.numel(), a, backend="triton") + x.float(), b, backend="triton"
            )

        def reference(
            c: Any = codec, p: Any = payload, x: Any = local, a: Any = c_in, b: Any = c_out
        ) -> Any:
            return K.reduce(c, p, x, a, b, backend="reference")

        before = sum(K.launch_counts().values())
        t_fused = measure(fused)
        assert sum(K.launch_counts().values()) > before, "the fused kernel did not run"
        t_unfused = measure(unfused)
        t_ref = measure(reference) if device.type == "cuda" or numel <= 4096 else math.nan
        dev = _device_seconds(fused, iters)
        moved = 2 * payload.numel() + local.numel() * local.element_size()
        roofline = moved / copy_bw
        row = {
            "fused_seconds": t_fused,
            "unfused_seconds": t_unfused,
            "reference_seconds": t_ref,
            "bytes_moved": moved,
            "fused_bandwidth_gbs": moved / t_fused / 1e9,
            "roofline_fraction": roofline / t_fused,
            "speedup_vs_unfused": t_unfused / t_fused,
            "speedup_vs_reference": t_ref / t_fused,
            "fused_device_seconds": dev["device_seconds"],
            "fused_burst_seconds": dev["burst_seconds"],
            "fused_kernels": dev["kernels"],
            # the fused kernel's device time against the copy kernel's: the roofline without
            # the host's share of a call (its launch, and the error check's sync)
            "roofline_fraction_device": moved / copy_bw_dev / dev["device_seconds"],
        }
        if name == "thc" and time.monotonic() < deadline:
            # the warps per program of its 16384-value tiles (16 by default): the choice
            # was made from ptxas's register counts, not timed; time the alternatives here
            # (4 and 8 spill: the slowest to compile)
            from dynamiq.kernels import thc as kthc

            _time_variants(
                row, "num_warps", kthc, "WARPS_OVERRIDE", (16, 32, 8, 4), fused, reference,
                measure, deadline,
            )  # fmt: skip
        if name == "dynamiq" and time.monotonic() < deadline:
            # the many-spans kernel's values read and written coalesced (the default) or in
            # the compute layout: fewer instructions a value, more cache lines a load
            from dynamiq.kernels import dynamiq_tiles

            _time_variants(
                row, "x_coalesced", dynamiq_tiles, "X_COALESCED", (True, False), fused,
                reference, measure, deadline,
            )  # fmt: skip
        out["codecs"][name] = row
        print(
            f"  {name:12s} {t_fused * 1e3:9.3f} {t_unfused * 1e3:10.3f} {t_ref * 1e3:9.3f} "
            f"{row['fused_bandwidth_gbs']:7.0f} {row['roofline_fraction']:9.0%} "
            f"{row['speedup_vs_unfused']:9.2f}x   device {dev['device_seconds'] * 1e3:.3f} ms "
            f"{row['roofline_fraction_device']:.0%}, burst {dev['burst_seconds'] * 1e3:.3f} ms"
        )
        del local, payload
        save()
    return out


def _time_variants(
    row: dict[str, Any],
    label: str,
    module: Any,
    attr: str,
    values: tuple[Any, ...],
    fused: Callable[[], Any],
    reference: Callable[[], Any],
    measure: Any,
    deadline: float,
) -> None:
    """The fused reduce timed with ``module.attr`` set to each of ``values`` in turn (then
    restored), and its bytes compared with the reference's each time: into ``row`` as
    ``fused_seconds_by_<label>`` and ``same_bytes_by_<label>``."""
    import torch

    want = reference()
    saved = getattr(module, attr)
    by: dict[str, float] = row.setdefault(f"fused_seconds_by_{label}", {})
    same: dict[str, bool] = row.setdefault(f"same_bytes_by_{label}", {})
    try:
        for value in values:
            if time.monotonic() > deadline:
                break
            setattr(module, attr, value)
            by[str(value)] = measure(fused)
            same[str(value)] = bool(torch.equal(fused(), want))
    finally:
        setattr(module, attr, saved)
    print(
        f"  fused ms by {label} (same bytes as the reference): "
        + ", ".join(f"{k}: {t * 1e3:.3f} ({same[k]})" for k, t in by.items())
    )


# -- compile only (no GPU) --------------------------------------------------------------------


#: integer kernel arguments that are 64-bit (the others are 32-bit)
_WIDE_ARGS = ("offset", "key0", "key1", "offset_in", "rkey0", "rkey1")


def launch_signature(
    kernel: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> tuple[dict[str, str], dict[str, Any], int]:
    """``(signature, constexprs, num_warps)`` of a launch ``kernel[grid](*args, **kw)``, as
    ``triton.compile`` takes them (upper-case arguments are the constexprs)."""
    import torch

    ptr = {torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8", torch.float32: "fp32"}
    ptr.update({torch.int64: "i64", torch.float64: "fp64"})
    params = {**dict(zip(kernel.arg_names, args, strict=False)), **kw}
    const = {k: v for k, v in params.items() if k.isupper()}
    sig = {}
    for k in kernel.arg_names:
        v = params[k]
        if k in const:
            sig[k] = "constexpr"
        elif isinstance(v, torch.Tensor):
            sig[k] = "*" + ptr[v.dtype]
        else:
            sig[k] = "i64" if k in _WIDE_ARGS else "i32"
    return sig, const, int(kw.get("num_warps", 4))  # the launcher's choice (default 4)


def compile_only(arch: int) -> int:
    """Compile every distinct kernel launch of the checks for ``sm_{arch}`` (no device)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext
    from dynamiq.kernels import block, hashing, intq, mx, passthrough
    from dynamiq.kernels import dynamiq as kdynamiq
    from dynamiq.kernels import omnireduce as komni
    from dynamiq.kernels import thc as kthc

    launches: dict[str, tuple[Any, dict[str, str], dict[str, Any], int]] = {}

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            def launch(*args: Any, **kw: Any) -> None:
                sig, const, warps = launch_signature(self.kernel, args, kw)
                key = f"{self.kernel.fn.__name__}{sorted(sig.items())}{sorted(const.items())}"
                launches[key + str(warps)] = (self.kernel, sig, const, warps)

            return launch

    tiles = kdynamiq.dynamiq_tiles
    for module in (hashing, intq, mx, passthrough, block, kdynamiq, tiles, komni, kthc):
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel"):
                setattr(module, attr, Recorder(value))
        module.tile_elems = lambda device: 2048  # type: ignore[attr-defined]  # GPU geometry
    ctx = HopContext(seed=1, hop=1, num_hops=4)  # num_hops > 1: DynamiQ's correlated variant
    families = {"passthrough": passthrough, "intq": intq, "mx": mx, "dynamiq": kdynamiq}
    families["block"] = block
    families["omnireduce"] = komni
    families["thc"] = kthc
    for codec in _codecs().values():
        family = families[K.declared_family(codec) or ""]  # the launchers, directly
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(100_000, dtype=dtype)  # launch geometry of real sizes
            p = family.encode(codec, x, ctx)
            if family is komni:  # its size depends on the norms, which the recorder skips
                p = K.encode(codec, x, ctx, backend="reference")
            if family is kthc:  # valid ranges; then the homomorphic reduce (agreed scales)
                p = K.encode(codec, x, ctx, backend="reference")
                shared = codec.prologue(x, type("One", (), {"allgather": lambda s, t: [t]})())
                for k_in, k_out in ((1, 2), (3, 40)):  # table indices, then 11-bit sums
                    c_in = HopContext(contributions=k_in, shared=shared)
                    c_out = HopContext(contributions=k_out, shared=shared)
                    p_in = K.encode(codec, x, c_in, backend="reference")
                    family.encode(codec, x, c_in)
                    family.reduce(codec, p_in, x, c_in, c_out)
            family.decode(codec, p, x.numel(), ctx)
            family.reduce(codec, p, x, ctx, ctx)
    hashing.hash_u32(torch.arange(10), (1, 2))
    hashing.uniform_open01(torch.arange(10), (1, 2))
    target = GPUTarget("cuda", arch, 32)
    print(f"compiling {len(launches)} kernel variants for sm_{arch} (Triton {triton.__version__})")
    failures = 0
    for kernel, sig, const, warps in launches.values():
        t0 = time.perf_counter()
        src = ASTSource(
            fn=kernel,
            signature=sig,
            constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
        )
        try:
            options = {"enable_fp_fusion": False, "num_warps": warps}
            compiled = triton.compile(src, target=target, options=options)
            assert "cubin" in compiled.asm
            status = "ok"
        except Exception as exc:  # report every failure, not just the first
            failures += 1
            status = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        secs = time.perf_counter() - t0
        print(f"  {kernel.fn.__name__:26s} {secs:5.1f}s {status}  warps={warps} {const}")
    print(f"{len(launches) - failures}/{len(launches)} compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
