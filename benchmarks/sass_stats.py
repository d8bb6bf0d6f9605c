"""SASS instructions per value of a codec's fused ``reduce`` kernel for a GPU, without a GPU.

Records the Triton launch ``K.reduce`` makes on a CUDA-sized input (geometry of
``tile_elems("cuda")``), compiles it for ``sm_ARCH`` with the divisibility hints a real launch
gets (16-byte aligned pointers, sizes divisible by 16), disassembles the cubin with Triton's
bundled ``cuobjdump`` and prints the instruction count per value (static count / values per
thread), registers, spills and the widths of the global loads and stores. A proxy for the
kernel's arithmetic cost (``docs/benchmarks.md``, "Kernels on a GPU"); run it with the Triton
version the GPU will run.

    python benchmarks/sass_stats.py int8 mxfp8_e4m3
    python benchmarks/sass_stats.py int8 --general      # the general [ROWS, G, 8] kernel
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("codecs", nargs="+", help="INT or MX codec ids, e.g. int8 mxfp8_e4m3")
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    parser.add_argument("--general", action="store_true", help="the general kernels")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dynamiq.kernels as K
    from dynamiq.codecs import HopContext, get_codec
    from dynamiq.kernels import intq, mx

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    from gpu_check import launch_signature

    launches: list[tuple[Any, dict[str, str], dict[str, Any], int]] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*a: Any, **kw: Any) -> None:
                launches.append((self.kernel, *launch_signature(self.kernel, a, kw)))

            return launch

    for module in (intq, mx):
        module.ROWS_PATH = not args.general
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel"):
                setattr(module, attr, Recorder(value))
    tile = int(intq.tile_elems(torch.device("cuda")))
    intq.tile_elems = mx.tile_elems = lambda device: tile  # type: ignore[assignment]
    intq._check_error = lambda codec, err: None  # type: ignore[assignment]
    for name in args.codecs:
        codec = get_codec(name)
        family = {"intq": intq, "mx": mx}[K.declared_family(codec) or ""]
        x = torch.ones(1 << 16)
        ctx = HopContext()
        launches.clear()
        family.reduce(codec, K.encode(codec, x, ctx, backend="reference"), x, ctx, ctx)
        kernel, sig, const, warps = launches[-1]
        hints = [["tt.divisibility", 16]]
        attrs = {(i,): hints for i, k in enumerate(kernel.arg_names) if sig[k] != "constexpr"}
        attrs = {i: h for i, h in attrs.items() if sig[kernel.arg_names[i[0]]] != "i64"}
        src = ASTSource(
            fn=kernel,
            signature=sig,
            constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
            attrs=attrs,
        )
        opts = {"enable_fp_fusion": False, "num_warps": warps}
        compiled = triton.compile(src, target=GPUTarget("cuda", args.arch, 32), options=opts)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            run = [str(tools / "cuobjdump"), "-sass", str(cubin)]
            sass = subprocess.run(run, capture_output=True, text=True, check=True).stdout
            run = [str(tools / "cuobjdump"), "-res-usage", str(cubin)]
            res = subprocess.run(run, capture_output=True, text=True, check=True).stdout
        ops: collections.Counter[str] = collections.Counter()
        for line in sass.splitlines():
            m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
            if m:
                ops[m.group(2).split(".")[0]] += 1
        per_thread = tile / (32 * warps)
        mem = collections.Counter(re.findall(r"(?:ld|st)\.global[a-z0-9.]*", compiled.asm["ptx"]))
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        print(
            f"{name}: {kernel.fn.__name__}, {tile} values/program, {warps} warps, "
            f"registers {regs and regs.group(1)}, stack {stack and stack.group(1)} B, "
            f"{sum(ops.values())} SASS instructions = "
            f"{sum(ops.values()) / per_thread:.1f} per value (static count)"
        )
        print("  global memory ops (PTX):", dict(mem))
        print("  most frequent:", ", ".join(f"{o} {k}" for o, k in ops.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
