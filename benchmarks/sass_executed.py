"""Executed SASS instructions per value of the pooled DynamiQ fused reduce, without a GPU.

Issue 14 asks for the fused reduce's *executed* instructions per value (loop bodies times
trip counts), target <= 60. The method, on the CPU:

1. **The launch.** Record the Triton launch ``kernels.dynamiq.reduce`` makes for ``--numel``
   values of real gradients (the ``lm`` family's eval rows) under the default codec's pooled
   prologue result (one rank), with the GPU tile geometry; compile it for ``sm_ARCH``
   (``triton.compile``, no device), disassemble the cubin with Triton's bundled ``nvdisasm
   -gi`` (SASS with the source line, and the call sites it was inlined at, of every
   instruction).
2. **Which instructions run, how often.** Run the same launch under ``TRITON_INTERPRET=1``
   with a line tracer: per program, how many times each source line runs in each inlining
   context (the chain of call sites up to the kernel). An instruction runs as often as its
   context's loop nest: in a Triton program every thread runs every instruction of the
   program's (uniform) control flow once per iteration, so a chain the interpreter never
   reached is a branch not taken (0), and the others run once per iteration of their
   enclosing loops.
3. **Loops.** Back edges in the SASS (a branch to an address at or before its own) mark the
   loops; each loop's trip count per program comes from the interpreter's count of its
   source loop header (the most common innermost line among the loop's instructions that is
   a ``for``/``while`` header): the header line runs once per iteration plus once on exit.
   Executed = the reached instructions, plus ``(trips - 1) x body`` for each loop.

Values per thread: the program's values over its threads (``P`` spans of ``SPAN`` values,
``num_warps x 32`` threads). Where a SASS loop's line info names only the kernel's own lines
(the call sites of what was inlined into it), its source loop is the one loop header the
interpreter ran under that call site. The data: ``--numel`` values of the ``lm`` family's
eval gradients from ``--offset`` (2^20 by default: the first 65,536 values are 76 % all-zero
spans, which skip the threshold search). ``--span-kernel`` measures the span-a-program kernel
(:mod:`dynamiq.kernels.dynamiq`) on the same codec. Caveats, printed with the numbers: code
the compiler hoisted out of a loop still counts at its loop's trips (over-counts), and an
instruction whose line info is only a call site counts as reached when the call site is.

    python benchmarks/sass_executed.py                    # default codec, 16,384 values
    python benchmarks/sass_executed.py --numel 65536 --json
    python benchmarks/sass_executed.py --numel 65536 --span-kernel

It also prints (JSON: ``reached_per_value_by_call``) the reached instructions a value by the
kernel's line they come from: nvdisasm's line info names only the kernel's own lines (the
calls of the helpers inlined into it), so that is the finest split it gives.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check

_LOC = re.compile(r'File "([^"]+)", line (\d+)')
_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(\S.*?)\s*;")


def _inputs(numel: int) -> tuple[Any, Any, Any, Any]:
    """(codec, values, payload, context) of the default codec under its pooled prologue."""
    from dynamiq import kernels as K
    from dynamiq.codecs import HopContext, get_codec
    from dynamiq.data import load_gradients

    class One:  # a one-rank prologue communicator
        rank, world_size = 0, 1

        def allreduce(self, t: Any, op: str) -> Any:
            return t

    codec = get_codec("dynamiq")
    g = load_gradients("eval", 16, family="lm", progress=False).reshape(-1)
    g = g[_OPTS["offset"] : _OPTS["offset"] + numel].contiguous()
    ctx = HopContext(shared=codec.prologue(g, One()))
    return codec, g, K.encode(codec, g, ctx, backend="reference"), ctx


#: the run's choices (``main``; the trace's child gets them as arguments): the first value of
#: the gradients used, and whether to force the span-a-program kernel
_OPTS: dict[str, Any] = {"offset": 1 << 20, "span_kernel": False}


@contextlib.contextmanager
def _gpu_tiles() -> Iterator[None]:
    """The GPU's tile geometry (``tile_elems``) in both DynamiQ kernel modules, and (option
    ``--span-kernel``) the span-a-program kernel for every configuration."""
    from dynamiq.kernels import dynamiq as kd

    mods = (kd, kd.dynamiq_tiles)
    saved = [m.tile_elems for m in mods]
    eligible = kd.dynamiq_tiles.eligible
    for m in mods:
        m.tile_elems = lambda device: 2048  # type: ignore[assignment]
    if _OPTS["span_kernel"]:
        kd.dynamiq_tiles.eligible = lambda codec: False  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, t in zip(mods, saved, strict=True):
            m.tile_elems = t  # type: ignore[assignment]
        kd.dynamiq_tiles.eligible = eligible  # type: ignore[assignment]


def _kernel_name(codec: Any) -> str:
    """The fused reduce's kernel function: many spans a program, or one."""
    from dynamiq.kernels import dynamiq_tiles

    with _gpu_tiles():
        tiles = dynamiq_tiles.eligible(codec)
    return "_dqt_encode_kernel" if tiles else "_dq_encode_kernel"


def _sass(arch: int, numel: int) -> tuple[list[tuple[int, str, tuple]], dict[str, Any]]:
    """The SASS of the recorded launch: ``(address, text, inlining chain)`` per instruction,
    and its constexprs and warps."""
    import triton
    from gpu_check import launch_signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dynamiq.kernels import dynamiq as kd

    launches: list[Any] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*a: Any, **kw: Any) -> None:
                launches.append((self.kernel, *launch_signature(self.kernel, a, kw)))

            return launch

    mods = (kd, kd.dynamiq_tiles)
    saved = [{k: v for k, v in vars(m).items() if k.endswith("_kernel")} for m in mods]
    for m, kernels in zip(mods, saved, strict=True):
        for k, v in kernels.items():
            setattr(m, k, Recorder(v))
    try:
        with _gpu_tiles():
            codec, g, p, ctx = _inputs(numel)
            kd.reduce(codec, p, g, ctx, ctx)
    finally:
        for m, kernels in zip(mods, saved, strict=True):
            vars(m).update(kernels)
    kernel, sig, const, warps = launches[-1]
    src = ASTSource(
        fn=kernel,
        signature=sig,
        constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
    )
    opts = {"enable_fp_fusion": False, "num_warps": warps}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        run = [str(tools / "nvdisasm"), "-gi", "-c", str(cubin)]
        text = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    out, chain, labels, pending = [], (), {}, []
    for line in text.splitlines():
        if line.strip().startswith("//## File"):
            chain = tuple((os.path.basename(f), int(n)) for f, n in _LOC.findall(line))
        elif m := re.match(r"(\.L_x_\d+):", line.strip()):
            pending.append(m.group(1))
        elif m := _INS.match(line):
            a = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, a))
            pending = []
            out.append((a, m.group(2), chain))
    # branch targets as addresses (nvdisasm names them by label)
    out = [
        (a, re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels.get(m.group(1), -1)), t), c)
        for a, t, c in out
    ]
    return out, {**const, "num_warps": warps}


def _trace(numel: int) -> tuple[int, dict[tuple, int]]:
    """Programs run, and per inlining chain of ``dynamiq/kernels`` lines, how many times the
    interpreter ran it (the launch of :func:`_sass`, under ``TRITON_INTERPRET=1``, which
    Triton reads at import: in a child process)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = [sys.executable, __file__, "--trace", "--numel", str(numel)]
    run += ["--offset", str(_OPTS["offset"])] + ["--span-kernel"] * _OPTS["span_kernel"]
    got = json.loads(
        subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    )
    return got["programs"], {tuple(map(tuple, c)): n for c, n in got["counts"]}


def _trace_here(numel: int) -> dict[str, Any]:
    """:func:`_trace`'s child: the counts, as JSON-ready lists."""
    from dynamiq.kernels import dynamiq as kd

    kdir = os.path.dirname(os.path.realpath(kd.__file__))
    counts: collections.Counter[tuple] = collections.Counter()
    programs = [0]
    from dynamiq.codecs import get_codec

    name = _kernel_name(get_codec("dynamiq"))

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(kdir):
            return None
        if event == "call" and frame.f_code.co_name == name:
            programs[0] += 1
        if event == "line":
            chain, f = [], frame
            while f is not None:
                if f.f_code.co_filename.startswith(kdir):
                    chain.append((os.path.basename(f.f_code.co_filename), f.f_lineno))
                    if f.f_code.co_name == name:
                        counts[tuple(chain)] += 1
                        break
                f = f.f_back
        return tracer

    with _gpu_tiles():
        codec, g, p, ctx = _inputs(numel)
        sys.settrace(tracer)
        try:
            kd.reduce(codec, p, g, ctx, ctx)
        finally:
            sys.settrace(None)
    return {"programs": programs[0], "counts": [[list(c), n] for c, n in counts.items()]}


def _loop_headers() -> set[tuple[str, int]]:
    """``(file, line)`` of every ``for``/``while`` statement in ``dynamiq/kernels``."""
    from dynamiq.kernels import dynamiq as kd

    kdir = Path(kd.__file__).parent
    out = set()
    for path in kdir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.For, ast.While)):
                out.add((path.name, node.lineno))
    return out


def _header_by_call_site(
    chains: list[tuple], counts: dict[tuple, int], headers: set[tuple[str, int]]
) -> tuple | None:
    """The source loop of a SASS loop whose line info names only the kernel's own lines (the
    call sites of the functions inlined into it): the one loop header the interpreter ran
    under the body's most common call site, if there is exactly one."""
    sites = collections.Counter(c[-1] for c in chains if c)
    if not sites:
        return None
    site = sites.most_common(1)[0][0]
    found = [c for c in counts if c[0] in headers and c[-1] == site and len(c) > 1]
    return found[0] if len(found) == 1 else None


def estimate(arch: int, numel: int) -> dict[str, Any]:
    """The numbers (see the module docstring)."""
    sass, meta = _sass(arch, numel)
    programs, counts = _trace(numel)
    headers = _loop_headers()
    reached = [counts.get(c, 0) > 0 if c else True for _, _, c in sass]
    addr = {a: i for i, (a, _, _) in enumerate(sass)}
    loops = []
    for i, (a, text, _) in enumerate(sass):
        hit = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not hit or int(hit.group(1), 16) > a or int(hit.group(1), 16) not in addr:
            continue
        first = addr[int(hit.group(1), 16)]
        body = range(first, i + 1)
        inner = collections.Counter(
            next((c[k:] for k in range(len(c)) if c[k] in headers), None)
            for _, _, c in (sass[j] for j in body)
            if c
        )
        inner.pop(None, None)
        header = inner.most_common(1)[0][0] if inner else None
        if header is None:
            header = _header_by_call_site([sass[j][2] for j in body], counts, headers)
        runs = counts.get(header, 0) / programs if header else 0.0
        # a header line runs once per iteration and once more on exit, per entry
        entries = 1.0 if reached[first] else 0.0
        trips = max(runs - entries, 0.0) / max(entries, 1.0) if header else 1.0
        loops.append({
            "body": len(body), "header": header, "trips": round(trips, 3), "known": bool(header)
        })  # fmt: skip
    base = sum(reached)
    extra = sum(max(lp["trips"] - 1, 0.0) * lp["body"] for lp in loops)
    per_thread = meta["SPAN"] * meta.get("P", 1) / (32 * meta["num_warps"])
    executed = base + extra
    return {
        "numel": numel,
        "programs": programs,
        "values_per_thread": per_thread,
        "static_instructions": len(sass),
        "reached_instructions": base,
        "loop_extra_instructions": round(extra, 1),
        "executed_per_thread": round(executed, 1),
        "executed_per_value": round(executed / per_thread, 1),
        "loops": loops,
        # the interpreter's runs per program of every loop header it reached (iterations plus
        # one exit per entry), by inlining chain: where the SASS names no header, these say
        # what trip count the unnamed loops can have
        "source_loop_headers": {
            " < ".join(f"{f}:{n}" for f, n in c): round(k / programs, 3)
            for c, k in sorted(counts.items())
            if c[0] in headers
        },
        "constexprs": {k: v for k, v in meta.items() if not k.startswith("Q")},
        "reached_per_value_by_call": _by_call(sass, reached, per_thread),
    }


def _by_call(sass: list[tuple[int, str, tuple]], reached: list[bool], per: float) -> dict:
    """Reached instructions a value by the kernel's own line they come from (the outermost
    of their inlining chain: the call of a helper, or a statement of the kernel), largest
    first; loop trips beyond the first not included. nvdisasm's line info may name only the
    kernel's lines, so this is the finest split it allows."""
    by: collections.Counter[str] = collections.Counter()
    lines: dict[str, list[str]] = {}
    for (_, _, chain), hit in zip(sass, reached, strict=True):
        if not hit:
            continue
        f, n = chain[-1] if chain else ("?", 0)
        if f not in lines:
            path = Path(__file__).resolve().parents[1] / "dynamiq" / "kernels" / f
            lines[f] = path.read_text().splitlines() if path.exists() else []
        text = lines[f][n - 1].strip() if 0 < n <= len(lines[f]) else ""
        by[f"{f}:{n} {text[:60]}"] += 1
    return {k: round(v / per, 1) for k, v in by.most_common()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H200)")
    parser.add_argument("--numel", type=int, default=1 << 14, help="values (64 programs: 16K)")
    parser.add_argument("--offset", type=int, default=1 << 20, help="first value of the data")
    parser.add_argument(
        "--span-kernel", action="store_true", help="force the span-a-program kernel"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    _OPTS.update(offset=args.offset, span_kernel=args.span_kernel)
    if args.trace:
        print(json.dumps(_trace_here(args.numel)))
        return 0
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("run without TRITON_INTERPRET (the SASS needs the compiler)")
    got = estimate(args.arch, args.numel)
    if args.json:
        print(json.dumps(got, indent=1, default=str))
        return 0
    print(
        f"dynamiq fused reduce, sm_{args.arch}: {got['static_instructions']} SASS instructions, "
        f"{got['reached_instructions']} reached on {got['numel']} values "
        f"({got['programs']} programs), loops add {got['loop_extra_instructions']}; "
        f"{got['values_per_thread']:g} value(s) a thread: "
        f"~{got['executed_per_value']} executed per value (target <= 60)"
    )
    for lp in got["loops"]:
        named = lp["header"] or "not named by the line info: 1 trip assumed"
        print(f"  SASS loop of {lp['body']} instructions, header {named}, trips {lp['trips']}")
    print("  source loop headers reached, runs per program (iterations + exits):")
    for where, runs in got["source_loop_headers"].items():
        print(f"    {where}: {runs}")
    print("  reached instructions a value by the kernel's line (loop trips apart):")
    for where, per in got["reached_per_value_by_call"].items():
        print(f"    {per:6.1f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
