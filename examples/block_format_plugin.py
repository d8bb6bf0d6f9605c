"""A new block format in one file, with fused kernels and no kernel code.

Declaring the data is all it takes: a :class:`~dynamiq.codecs.BlockCodec` subclass with its
own defaults (here E4M3 elements, an E4M3 scale per 32 values, the per-tensor scale agreed
through the prologue) gets the generic Triton kernels (CUDA tensors, or the interpreter) and
native CPU kernels of ``dynamiq.kernels.block``, bit-exact with the reference, the
prologue, the certified bound and the conformance kit. A package would ship it through the
``dynamiq.codecs`` entry point instead of calling ``register_codec``.

    python examples/block_format_plugin.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dynamiq.codecs import BlockCodec, get_codec, register_codec
from dynamiq.collectives import simulate_allreduce
from dynamiq.kernels import last_backend


@register_codec
@dataclass(frozen=True, kw_only=True)
class FP8Block32(BlockCodec):
    """E4M3 elements, one E4M3 scale per 32 values, an agreed per-tensor scale (8.25 b/v)."""

    codec_id: ClassVar[str] = "fp8_block32"
    presets: ClassVar[dict] = {}
    element: str = "float8_e4m3fn"
    block_size: int = 32
    scale: str = "float8_e4m3fn"


def main() -> None:
    codec = get_codec("fp8_block32")
    x = torch.randn(1 << 16)
    y = codec.decode(codec.encode(x), x.numel())
    print(f"{codec!r}: {codec.bits_per_value():.3f} bits/value, backend {last_backend()}")
    print(f"max error {float((y - x).abs().max()):.3g} <= bound "
          f"{float(codec.error_bound.max_abs_error(x).max()):.3g}")  # fmt: skip
    grads = [torch.randn(1 << 14) * 2.0**r for r in range(4)]
    res = simulate_allreduce(grads, codec, "ring")
    exact = torch.stack(grads).double().sum(0)
    err = float(((res.outputs[0].double() - exact).abs() / res.bound.clamp(min=1e-300)).max())
    print(f"4-rank ring all-reduce: largest error / certified bound = {err:.3f}")


if __name__ == "__main__":
    main()
