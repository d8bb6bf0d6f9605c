"""``dynamiq bench kernels``: the fused ``reduce`` against the unfused path and the memory
roofline, as ratios measured in one run (docs/design.md, "Measures").

For each codec, on one device: (a) the fused ``reduce`` through the dispatcher on
``backend`` (``"auto"``: Triton on CUDA; on the CPU the native CPU kernels of the INT and MX
codecs, :mod:`dynamiq.kernels.cpu_native`, or the ``torch.compile``'d reference when
``compile=True``, else the reference); (b) the unfused path on the same backend,
``encode(decode(payload) + local)`` as two dispatched calls and an add; (c) the plain PyTorch
reference (``_decode``, add, ``_encode``); (d) a plain ``torch.add`` of two fp32 tensors of the
same length, returning a new tensor as ``reduce`` does, and also into a preallocated output
(no page faults for a fresh 4-byte-per-value buffer); (e) the memory roofline: the bytes the
fused kernel must move (incoming payload + local slice + outgoing payload) divided by the
device's measured copy bandwidth (the best copy of ``numel`` fp32 values into an allocated
tensor, timed in every round beside the other paths).
Each of (a), (b), (d) is timed in steady state, as an all-reduce calls it hop after hop: one
untimed call, then ``burst`` timed calls in a row, whose median is one sample; the paths take
turns, ``iters`` rounds, and a time is the median of its rounds, so that other load on the
machine slows all alike. (Timing single calls interleaved with the other paths measured the C
library's heap rather than the kernels: whichever path ran before decided whether the next
call's output came from freed memory or from fresh pages, and the fused/unfused ratio swung
between 1.6 and 7.7 on a quiet machine.) The plain reference, seconds per call, is timed once
per round. (a) is checked bit for bit against (c).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

from dynamiq.codecs import HopContext, get_codec

__all__ = ["bench_kernels"]

# the payload is a first encoding (hop 0); the result the second (hop 1, two contributions)
CTX = HopContext(hop=0, num_hops=2)
OUT_CTX = HopContext(hop=1, num_hops=2, contributions=2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing: Windows)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _steady(fn: Callable[[], Any], device: torch.device, burst: int) -> tuple[float, float]:
    """Median seconds of ``burst`` consecutive calls after one untimed call (which settles the
    allocator for this path: freed blocks of the previous call's size are reused), and the
    minor page faults per timed call (fresh pages the kernel had to map and zero)."""
    fn()
    f0 = _minor_faults()
    t = statistics.median(_time(fn, device) for _ in range(burst))
    return t, (_minor_faults() - f0) / burst


@dataclass
class _Setup:
    """The buffers and settings every codec of a ``bench_kernels`` run is timed with."""

    dev: torch.device
    numel: int
    iters: int
    burst: int
    compile: bool
    backend: str
    a: torch.Tensor  # the encoded values
    b: torch.Tensor  # the local slice added by reduce
    c: torch.Tensor  # torch.add's preallocated output
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    copy_times: list[float] = field(default_factory=list)  # every round: the best is the bw


def _setup(numel: int, device: str, iters: int, burst: int, compile: bool, backend: str) -> _Setup:
    dev = torch.device(device)
    copy_src = torch.ones(numel, device=dev)
    copy_dst = torch.empty_like(copy_src)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(numel, generator=g).to(dev)
    b = torch.randn(numel, generator=g).to(dev)
    c = torch.empty_like(a)
    return _Setup(dev, numel, iters, burst, compile, backend, a, b, c, copy_src, copy_dst)


def _measure(s: _Setup, name: str, codec: Any) -> dict[str, Any]:
    """One codec's row (all but the bandwidth columns); adds its copy times to ``s``."""
    from dynamiq import kernels

    a, b, c, numel, backend = s.a, s.b, s.c, s.numel, s.backend
    payload = codec.encode(a, CTX)

    def fused() -> torch.Tensor:
        return kernels.reduce(codec, payload, b, CTX, OUT_CTX, backend=backend)

    def unfused() -> torch.Tensor:
        y = kernels.decode(codec, payload, numel, CTX, backend=backend) + b
        return kernels.encode(codec, y, OUT_CTX, backend=backend)

    def plain() -> torch.Tensor:
        return codec._encode(codec._decode(payload, numel, CTX) + b, OUT_CTX)

    t0 = time.perf_counter()
    got = fused()
    first = time.perf_counter() - t0
    ran = "compiled" if s.compile and s.dev.type == "cpu" else kernels.last_backend()
    unfused()
    exact = bool(torch.equal(got, plain()))
    times: dict[str, list[float]] = {k: [] for k in ("fused", "unfused", "plain", "add")}
    times["add_out"] = []
    faults: dict[str, list[float]] = {k: [] for k in ("fused", "unfused", "add", "add_out")}
    for _ in range(s.iters):
        for key, fn in (
            ("fused", fused),
            ("unfused", unfused),
            ("add", lambda: torch.add(a, b)),
            ("add_out", lambda: torch.add(a, b, out=c)),
        ):
            t, f = _steady(fn, s.dev, s.burst)
            times[key].append(t)
            faults[key].append(f)
        s.copy_times.append(_steady(lambda: s.copy_dst.copy_(s.copy_src), s.dev, s.burst)[0])
        times["plain"].append(_time(plain, s.dev))
    t_f = statistics.median(times["fused"])
    t_u = statistics.median(times["unfused"])
    t_p = statistics.median(times["plain"])
    t_a = statistics.median(times["add"])
    t_ao = statistics.median(times["add_out"])
    return {
        "codec": name,
        "backend": ran or "",
        "bit-exact": exact,
        "first call s": first,
        "fused s": t_f,
        "unfused s": t_u,
        "plain reference s": t_p,
        "torch.add s": t_a,
        "torch.add into out s": t_ao,
        "speed-up over unfused": t_u / t_f,
        # the conservative ratio: the fastest round of the unfused path (the one that found
        # the most of its buffers already mapped) over the fused median
        "speed-up over fastest unfused": min(times["unfused"]) / t_f,
        "fused page faults/call": statistics.median(faults["fused"]),
        "unfused page faults/call": statistics.median(faults["unfused"]),
        "speed-up over plain": t_p / t_f,
        "fused / torch.add": t_f / t_a,
        "fused / torch.add into out": t_f / t_ao,
        "bytes moved": payload.numel() * 2 + numel * b.element_size(),
    }


def bench_kernels(
    codecs: Sequence[str],
    numel: int = 1 << 24,
    device: str = "cpu",
    *,
    iters: int = 5,
    burst: int = 3,
    compile: bool = False,
    progress: bool = True,
    backend: str = "auto",
) -> list[dict[str, Any]]:
    """One row per codec: fused, unfused, plain-reference and ``torch.add`` seconds, the
    speed-ups, and the fraction of the roofline. ``backend`` is the dispatcher's (``"cpu"``
    forces the native CPU kernels). Unknown codec ids raise before anything is timed."""
    from dynamiq import kernels

    if backend not in kernels.BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, kernels.BACKENDS))} (got {backend!r})"
        )
    if iters < 1 or burst < 1:
        raise ValueError(f"iters and burst must be at least 1 (got {iters} and {burst})")
    resolved = [get_codec(name) for name in codecs]  # UnknownCodecError names the known ids
    s = _setup(numel, device, iters, burst, compile, backend)
    rows: list[dict[str, Any]] = []
    if s.dev.type == "cpu":
        kernels._compiled.set_cpu_compile(compile)
    try:
        for i, (name, codec) in enumerate(zip(codecs, resolved, strict=True)):
            if progress:
                print(f"\r[{i + 1}/{len(codecs)}] {name:<14}", end="", file=sys.stderr, flush=True)
            rows.append(_measure(s, name, codec))
        # the copy bandwidth: the best copy of the whole run (one slow measurement at the
        # start, under a burst of other load, once made every fraction of roofline 5x too high)
        bw = 2 * 4 * numel / min(s.copy_times, default=math.inf)
        for row in rows:
            row["copy bandwidth GB/s"] = bw / 1e9
            row["roofline s"] = row["bytes moved"] / bw
            row["fraction of roofline"] = row["roofline s"] / row["fused s"]
    finally:
        if s.dev.type == "cpu":
            kernels._compiled.set_cpu_compile(None)
        if progress:
            print(file=sys.stderr)
    return rows
