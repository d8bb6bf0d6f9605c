"""The CPU fast path: the codecs' PyTorch references through ``torch.compile`` (opt-in).

The reference is what runs on the CPU (docs/design.md, "Kernels"). Compiled by Inductor it is the
same computation (bit-exact: the same integer operations, one IEEE division, no contraction)
in a few fused C++ loops instead of dozens of full-tensor passes; on a 2-core machine that
measured 8-14x faster for 1M-value ``int8`` / ``mxfp8_e4m3`` encodes (see
``benchmarks/cpu_fast_path.py``). It costs 15-50 s of compilation per codec configuration,
operation and input dtype the first time (Inductor's on-disk cache makes later processes
faster), so it is off unless asked for: ``DYNAMIQ_CPU_COMPILE=1`` or :func:`set_cpu_compile`.
It applies to the built-in codecs whose reference does not read the hop context (the hash
keys of stochastic rounding would make one compilation per context) and to inputs of at
least :data:`MIN_NUMEL` values. A compilation that fails (no C++ compiler, an Inductor error)
falls back to the plain reference for that codec and operation, for good.

For the INT and MX codecs the default CPU fast path is the native kernels of
:mod:`dynamiq.kernels.cpu_native` (faster still, and one build per machine instead of one
compilation per configuration); switching this path on explicitly makes ``backend="auto"``
run it instead of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _settings

if TYPE_CHECKING:
    from dynamiq.codecs.base import Codec

__all__ = ["MIN_NUMEL", "cpu_compile_enabled", "failed", "run", "set_cpu_compile"]

#: smaller inputs run the plain reference (compiled code would not pay for its dispatch)
MIN_NUMEL = 1 << 16

_LOCK = threading.Lock()
_CACHE: dict[tuple[Any, str], Callable[..., Any] | None] = {}


def set_cpu_compile(enabled: bool | None) -> None:
    """Turn the compiled CPU reference on or off (``None``: follow ``DYNAMIQ_CPU_COMPILE``,
    read now; the environment is read at import and by the setters only:
    :mod:`dynamiq.kernels._settings`)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None (got {type(enabled).__name__})")
    _settings.override("cpu_compile", enabled)


def cpu_compile_enabled() -> bool:
    """Whether the compiled CPU reference is switched on."""
    return _settings.cpu_compile


def failed(codec: Codec, op: str) -> bool:
    """Whether compiling ``codec._{op}`` failed (it then runs plain, for good)."""
    with _LOCK:
        return _CACHE.get((codec, op), True) is None


def run(codec: Codec, op: str, *args: Any, dynamic_rows: bool = False) -> Any:
    """``codec._{op}(*args)``, compiled (compiled once per codec and operation, lazily).

    ``dynamic_rows``: only the first dimension of the tensor arguments of at least two
    dimensions varies between calls (the DynamiQ codec's block functions take any number of
    spans as rows): one compilation with that dimension symbolic and the rest static, instead
    of every dimension dynamic."""
    eager = getattr(codec, f"_{op}")
    key = (codec, op)
    with _LOCK:
        fn = _CACHE.get(key, eager)
    if fn is None:
        return eager(*args)
    try:
        if fn is eager:
            fn = torch.compile(eager, dynamic=None if dynamic_rows else True)
            with _LOCK:
                _CACHE[key] = fn
        if dynamic_rows:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] >= 2:
                    torch._dynamo.mark_dynamic(a, 0)
        return fn(*args)
    except Exception:
        # the reference's own errors (e.g. a block beyond max_input_abs) raise again here;
        # anything else was the compiler: use the plain reference from now on
        out = eager(*args)
        with _LOCK:
            _CACHE[key] = None
        return out
