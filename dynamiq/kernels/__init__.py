"""Kernel dispatch: Triton kernels where they can run, the codec's PyTorch reference elsewhere.

Implements docs/design.md, "Kernels". :func:`encode`, :func:`decode` and :func:`reduce` take a
``backend``:

* ``"reference"``: the codec's own ``_encode`` / ``_decode`` / ``_reduce`` (pure PyTorch, any
  device);
* ``"triton"``: the codec's Triton kernel, natively on CUDA tensors and through Triton's
  interpreter on CPU tensors (slow: for tests). Triton fixes the mode when it is imported,
  from ``TRITON_INTERPRET``, which this never sets: CPU tensors raise unless it was ``1``
  then. Raises if Triton is not installed or the codec has no kernel for the
  operation;
* ``"cpu"``: the native CPU kernels of the pass-through, INT, MX, DynamiQ and block-format
  codecs
  (:mod:`dynamiq.kernels.cpu_native`: C++ built once per machine and cached, bit-exact with
  the reference). Raises if they cannot be built or the codec has none;
* ``"auto"`` (what :class:`~dynamiq.codecs.Codec`'s own methods use): Triton for CUDA tensors,
  and for CPU tensors when ``TRITON_INTERPRET=1`` is set; on other CPU tensors of at least
  ``cpu_native.MIN_NUMEL`` values the native CPU kernels (unless ``DYNAMIQ_CPU_KERNELS=0``
  or the ``torch.compile`` path below is switched on); the reference otherwise, and for
  codecs without kernels.

``DYNAMIQ_CPU_KERNELS``, ``DYNAMIQ_CPU_COMPILE`` and ``TRITON_INTERPRET`` are read when this
module is imported and again whenever :func:`set_cpu_kernels` or :func:`set_cpu_compile` runs,
never per call (:mod:`dynamiq.kernels._settings`).

**Which kernels.** A codec class declares its family in ``kernel_family`` (read at the first
dispatch; ``import dynamiq.codecs`` imports no kernel module): the Triton module
``dynamiq.kernels.<family>`` and, but for ``"thc"`` and ``"omnireduce"``, a native CPU entry
point (:mod:`dynamiq.kernels._declared`). Plugins declare a family or call
:func:`register_kernels`, once per backend: Triton kernels (CUDA tensors) and CPU kernels
(CPU tensors) are registered the same way and chosen as the built-ins' are.

**Traced and fake calls.** While ``torch.compile`` traces a call, and for fake, meta or other
subclassed tensors, the call goes through the ``torch.library`` ops of
:mod:`dynamiq.kernels._ops` (registered when this module is imported), whose implementation
is this dispatch; eager calls on plain tensors do not (:func:`_routed`).

**Per call.** What a call runs is resolved once per codec (by identity; the cache holds the
codec), operation, device type and backend, and cached until a setter or
:func:`register_kernels` changes something; the public methods validate their arguments once
and call the dispatcher's validated entry points; a native kernel's argument structure is
built once per codec configuration (``benchmarks/dispatch_overhead.py`` measures the cost).

Every built-in codec has Triton kernels, bit-exact with its reference:
:mod:`dynamiq.kernels.passthrough` (``fp32``/``bf16``/``fp16``), :mod:`~dynamiq.kernels.intq`,
:mod:`~dynamiq.kernels.mx`, :mod:`~dynamiq.kernels.dynamiq`, :mod:`~dynamiq.kernels.thc`,
:mod:`~dynamiq.kernels.omnireduce` and :mod:`~dynamiq.kernels.block` (the block formats of
:mod:`dynamiq.codecs.blockfmt`, plugins' included). Plugin codecs add others with
:func:`register_kernels`.
Kernels belong to a class, not to its subclasses (a subclass may change what the reference
computes): a subclass runs on its reference until it declares or registers kernels itself
(``BlockCodec`` declares for its subclasses that keep the reference).

On the CPU the reference can run compiled by ``torch.compile`` (bit-exact, several times
faster on large inputs, but 15-50 s of compilation per codec configuration the first time):
opt in with ``DYNAMIQ_CPU_COMPILE=1`` or :func:`set_cpu_compile` (see
:mod:`dynamiq.kernels._compiled`).

``import dynamiq`` does not import Triton: it is imported the first time the Triton backend is
chosen. :func:`last_backend` and :func:`launch_counts` tell a test which path ran.

>>> import torch, dynamiq
>>> codec = dynamiq.get_codec("int8")
>>> x = torch.linspace(-1, 1, 64)
>>> bool(torch.equal(encode(codec, x, backend="reference"), codec.encode(x)))
True
>>> last_backend()
'reference'
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import _compiled, _ops, _settings, cpu_native
from ._compiled import set_cpu_compile
from ._declared import declared_family, own_family
from ._stats import launch_counts
from .cpu_native import set_cpu_kernels

# the kernels import the codecs, never the reverse at import time (dynamiq/codecs/base.py
# imports this module at a codec method's first call)
from dynamiq.codecs.base import check_ctx, check_values, check_int  # isort: skip

if TYPE_CHECKING:
    from dynamiq.codecs.base import Codec, HopContext

__all__ = [
    "BACKENDS",
    "KernelSet",
    "decode",
    "encode",
    "has_kernels",
    "last_backend",
    "launch_counts",
    "reduce",
    "register_kernels",
    "set_cpu_compile",
    "set_cpu_kernels",
]

#: the accepted values of ``backend``
BACKENDS = ("auto", "triton", "reference", "cpu")
_OPS = ("encode", "decode", "reduce")

EncodeKernel = Callable[["Codec", torch.Tensor, "HopContext"], torch.Tensor]
DecodeKernel = Callable[["Codec", torch.Tensor, int, "HopContext"], torch.Tensor]
ReduceKernel = Callable[
    ["Codec", torch.Tensor, torch.Tensor, "HopContext", "HopContext"], torch.Tensor
]


@dataclass(frozen=True)
class KernelSet:
    """The kernels of a codec class on one backend (``None``: that operation runs on the
    reference). Each takes already validated arguments, with ``ctx`` never ``None``:
    ``encode(codec, x, ctx)``, ``decode(codec, payload, numel, ctx)``,
    ``reduce(codec, payload, local, ctx, out_ctx)``."""

    encode: EncodeKernel | None = None
    decode: DecodeKernel | None = None
    reduce: ReduceKernel | None = None


#: registered kernels: (codec class, backend) -> its kernels
_PLUGINS: dict[tuple[type, str], KernelSet] = {}
#: the backends :func:`register_kernels` takes
_REGISTRABLE = ("triton", "cpu")
_LOCK = threading.Lock()
_LOCAL = threading.local()


def register_kernels(
    codec_cls: type[Codec],
    *,
    encode: EncodeKernel | None = None,
    decode: DecodeKernel | None = None,
    reduce: ReduceKernel | None = None,
    backend: str = "triton",
    replace: bool = False,
) -> None:
    """Register kernels for ``codec_cls`` (exactly that class, not its subclasses).

    ``backend="triton"`` (default): Triton kernels, run for CUDA tensors (and for CPU tensors
    through the interpreter under ``backend="triton"`` or ``TRITON_INTERPRET=1``), so a plugin
    may import Triton inside them. ``backend="cpu"``: implementations for CPU tensors, run under
    ``backend="cpu"`` and, while :func:`set_cpu_kernels` is on, ``"auto"`` (as the built-ins'
    native kernels are). Operations left ``None`` run on the codec's reference. Registering a
    class twice for one backend, or one that declares a ``kernel_family``, raises
    ``ValueError`` unless ``replace=True``.
    """
    from dynamiq.codecs.base import Codec

    if not (isinstance(codec_cls, type) and issubclass(codec_cls, Codec)):
        raise TypeError(f"register_kernels takes a Codec subclass (got {codec_cls!r})")
    _check_registrable(backend)
    given = {"encode": encode, "decode": decode, "reduce": reduce}
    for op, fn in given.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{op} must be callable or None (got {type(fn).__name__})")
    if all(fn is None for fn in given.values()):
        raise ValueError("register_kernels needs at least one of encode, decode, reduce")
    key = (codec_cls, backend)
    with _LOCK:
        if (key in _PLUGINS or own_family(codec_cls)) and not replace:
            raise ValueError(
                f"{backend} kernels for {codec_cls.__module__}.{codec_cls.__qualname__} are "
                "already registered (or declared: kernel_family); pass replace=True to "
                "override them"
            )
        _PLUGINS[key] = KernelSet(encode=encode, decode=decode, reduce=reduce)
        _settings.changed()


def _check_registrable(backend: str) -> None:
    if backend not in _REGISTRABLE:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, _REGISTRABLE))} (got {backend!r})"
        )


def has_kernels(codec: Codec, op: str | None = None, *, backend: str = "triton") -> bool:
    """Whether ``codec`` has a kernel for ``op`` (any of them when ``op`` is None) on
    ``backend``: ``"triton"`` (registered or declared Triton kernels) or ``"cpu"``
    (registered CPU kernels, or the built-in native ones of its declared family)."""
    if op is not None and op not in _OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, _OPS))} (got {op!r})")
    _check_registrable(backend)
    ks = _PLUGINS.get((type(codec), backend))
    if ks is not None:
        return any(getattr(ks, o) is not None for o in ([op] if op else _OPS))
    if backend == "cpu":
        return cpu_native._family(codec) is not None
    return declared_family(codec) is not None


def last_backend() -> str | None:
    """The backend (``"triton"``, ``"cpu"`` or ``"reference"``) of this thread's last
    dispatched call."""
    return getattr(_LOCAL, "backend", None)


# -- the three operations -------------------------------------------------------------------


def encode(
    codec: Codec, x: torch.Tensor, ctx: HopContext | None = None, backend: str = "auto"
) -> torch.Tensor:
    """``codec.encode(x, ctx)`` on ``backend`` (same checks, same bytes)."""
    ctx = check_ctx(ctx)
    check_values("x", x)
    return _encode(codec, x, ctx, backend)


def decode(
    codec: Codec,
    payload: torch.Tensor,
    numel: int,
    ctx: HopContext | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` on ``backend``: an fp32 tensor."""
    ctx = check_ctx(ctx)
    check_int("numel", numel, 0)
    codec.check_payload(payload, numel, ctx)
    return _decode(codec, payload, numel, ctx, backend)


def reduce(
    codec: Codec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext | None = None,
    out_ctx: HopContext | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)`` on ``backend``: the fused
    decompress-accumulate-recompress (one pass over memory on the Triton backend)."""
    ctx = check_ctx(ctx)
    out_ctx = ctx if out_ctx is None else check_ctx(out_ctx)
    check_values("local", local)
    if isinstance(payload, torch.Tensor) and payload.device != local.device:
        raise ValueError(
            f"payload and local must be on the same device "
            f"(got {payload.device} and {local.device})"
        )
    codec.check_payload(payload, local.numel(), ctx)
    return _reduce(codec, payload, local, ctx, out_ctx, backend)


# the validated operations (Codec's own methods call these after their checks: each argument
# is checked once)


def _encode(codec: Codec, x: torch.Tensor, ctx: HopContext, backend: str) -> torch.Tensor:
    if _routed(x):
        return _ops.encode(codec, x, ctx, backend)
    return _encode_direct(codec, x, ctx, backend)


def _encode_direct(codec: Codec, x: torch.Tensor, ctx: HopContext, backend: str) -> torch.Tensor:
    plan = _plan(codec, "encode", x, backend)
    numel = x.numel()
    fn = plan.pick(numel)
    if fn is None:
        _LOCAL.backend = "reference"
        out = _reference(codec, "encode", x.device, numel, x, ctx)
        _LOCAL.backend = "reference"
        return out
    _LOCAL.backend = plan.backend
    out = fn(codec, x, ctx)
    _LOCAL.backend = plan.backend  # again: the kernel may have dispatched other calls
    return out


def _decode(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: HopContext, backend: str
) -> torch.Tensor:
    if _routed(payload):
        return _ops.decode(codec, payload, numel, ctx, backend)
    return _decode_direct(codec, payload, numel, ctx, backend)


def _decode_direct(
    codec: Codec, payload: torch.Tensor, numel: int, ctx: HopContext, backend: str
) -> torch.Tensor:
    plan = _plan(codec, "decode", payload, backend)
    fn = plan.pick(numel)
    if fn is None:
        _LOCAL.backend = "reference"
        out = _reference(codec, "decode", payload.device, numel, payload, numel, ctx)
        _LOCAL.backend = "reference"
        return out
    _LOCAL.backend = plan.backend
    out = fn(codec, payload, numel, ctx)
    _LOCAL.backend = plan.backend
    return out


def _reduce(
    codec: Codec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    backend: str,
) -> torch.Tensor:
    if _routed(local) or type(payload) is not torch.Tensor:
        return _ops.reduce(codec, payload, local, ctx, out_ctx, backend)
    return _reduce_direct(codec, payload, local, ctx, out_ctx, backend)


def _reduce_direct(
    codec: Codec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    backend: str,
) -> torch.Tensor:
    plan = _plan(codec, "reduce", local, backend)
    numel = local.numel()
    fn = plan.pick(numel)
    if fn is None:
        _LOCAL.backend = "reference"
        out = _reference(codec, "reduce", local.device, numel, payload, local, ctx, out_ctx)
        _LOCAL.backend = "reference"
        return out
    _LOCAL.backend = plan.backend
    out = fn(codec, payload, local, ctx, out_ctx)
    _LOCAL.backend = plan.backend
    return out


def _routed(t: torch.Tensor) -> bool:
    """Whether a call goes through the ``torch.library`` ops (:mod:`dynamiq.kernels._ops`):
    while ``torch.compile`` traces it, and for tensors that hold no data of their own (fake,
    meta and other subclasses); plain eager tensors call the kernels directly."""
    return _is_compiling() or type(t) is not torch.Tensor or t.is_meta


_is_compiling = torch.compiler.is_compiling


def _reference(codec: Codec, op: str, device: torch.device, numel: int, *args: Any) -> Any:
    """The codec's reference; on the CPU, compiled when that is switched on (opt-in)."""
    if _settings.cpu_compile and numel >= _compiled.MIN_NUMEL and device.type == "cpu":
        family = declared_family(codec)
        if family == "dynamiq":  # compiles its own per-block functions
            return getattr(codec, f"_{op}")(*args, compiled=True)
        if _compilable(codec, family):
            return _compiled.run(codec, op, *args)
    return getattr(codec, f"_{op}")(*args)


def _compilable(codec: Codec, family: str | None) -> bool:
    # built-in references that do not read the hop context (no recompilation per context;
    # DynamiQ's budget and span loop read it, a declared block format the prologue's result)
    if family in (None, "dynamiq", "block"):
        return False
    return getattr(codec, "rounding", "nearest") == "nearest"


# -- backend choice, resolved once per codec, operation, device type and backend -------------


class _Plan:
    """What one ``(codec, op, device type, backend)`` resolves to: ``fn`` the kernel with the
    dispatcher's signature (``None``: the reference), ``backend`` its name for
    :func:`last_backend`, ``min_numel`` the size below which the reference runs instead
    (``backend="auto"`` on the CPU). ``pending``: the native kernel is looked up (and the
    library built) at the first call that needs it, not before."""

    __slots__ = ("backend", "codec", "fn", "generation", "min_numel", "op", "pending")

    def __init__(self, codec: Codec, op: str, fn: Any, backend: str, generation: int) -> None:
        self.codec = codec
        self.op = op
        self.fn = fn
        self.backend = backend
        self.generation = generation
        self.min_numel = 0
        self.pending = False

    def pick(self, numel: int) -> Any:
        """The kernel for ``numel`` values, or ``None`` for the reference."""
        if numel < self.min_numel:
            return None
        if self.pending:
            self.fn = cpu_native.kernel(self.codec, self.op)  # None: unavailable here
            self.pending = False
        return self.fn


#: resolved plans: (id(codec), op, device type, backend) -> plan (holding the codec, so the id
#: is not reused while it is cached); cleared when full
_PLANS: dict[tuple[int, str, str, str], _Plan] = {}
_MAX_PLANS = 512


def _plan(codec: Codec, op: str, t: torch.Tensor, backend: str) -> _Plan:
    key = (id(codec), op, "cpu" if t.is_cpu else t.device.type, backend)
    plan = _PLANS.get(key)
    if plan is None or plan.codec is not codec or plan.generation != _settings.generation:
        plan = _resolve(codec, op, key[2], backend)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _resolve(codec: Codec, op: str, device: str, backend: str) -> _Plan:
    """Choose the Triton (or native CPU) implementation of ``op``, or the reference; raises
    what a forced backend cannot do."""
    generation = _settings.generation
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))} (got {backend!r})"
        )
    if backend == "triton":
        fn = _kernel(codec, op, device)
        if fn is None:
            raise NotImplementedError(
                f"codec {codec.codec_id!r} ({type(codec).__qualname__}) has no Triton kernel "
                f"for {op}; register one with dynamiq.kernels.register_kernels or use "
                "backend='reference'"
            )
        return _Plan(codec, op, _scoped(fn) if device == "cpu" else fn, "triton", generation)
    cpu_set = _PLUGINS.get((type(codec), "cpu"))
    if backend == "cpu":
        if device != "cpu":
            raise ValueError(f"backend='cpu' runs CPU tensors (got {device} tensors)")
        if cpu_set is not None:
            return _Plan(codec, op, _registered_cpu(codec, op, cpu_set), "cpu", generation)
        return _Plan(codec, op, cpu_native.kernel(codec, op, required=True), "cpu", generation)
    if backend == "auto" and _auto_triton(device) and has_kernels(codec, op):
        fn = _kernel(codec, op, device)
        return _Plan(codec, op, _scoped(fn) if device == "cpu" else fn, "triton", generation)
    # "auto" on CPU tensors while CPU kernels are on: registered ones at every size, the
    # native ones from MIN_NUMEL
    cpu_on = device == "cpu" and _settings.cpu_kernels and not _settings.cpu_compile
    if backend == "auto" and cpu_set is not None:
        return _Plan(codec, op, getattr(cpu_set, op) if cpu_on else None, "cpu", generation)
    plan = _Plan(codec, op, None, "cpu", generation)
    if backend == "auto" and cpu_on and cpu_native._family(codec) is not None:
        plan.min_numel, plan.pending = cpu_native.MIN_NUMEL, True
    return plan


def _registered_cpu(codec: Codec, op: str, ks: KernelSet) -> Any:
    fn = getattr(ks, op)
    if fn is None:
        raise NotImplementedError(
            f"codec {codec.codec_id!r} ({type(codec).__qualname__}) registered no CPU kernel "
            f"for {op}; use backend='reference'"
        )
    return fn


def _scoped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a Triton kernel run on CPU tensors) inside :func:`_kernel_scope`."""
    cpu = torch.device("cpu")

    def run(*args: Any) -> Any:
        with _kernel_scope(cpu):
            return fn(*args)

    return run


def _auto_triton(device: str) -> bool:
    if device == "cuda":
        return _triton_installed()
    # the CPU: only when the user asked for the interpreter (and Triton can still use it)
    if device != "cpu" or not _settings.interpret:
        return False
    if "triton" in sys.modules:
        return _triton_interpreting()
    return _triton_installed()


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def _triton_installed() -> bool:
    if "triton" in sys.modules:
        return True
    return importlib.util.find_spec("triton") is not None


def _kernel(codec: Codec, op: str, device: str) -> Any:
    if device not in ("cuda", "cpu"):
        raise RuntimeError(
            f"the Triton backend runs on CUDA tensors (natively) and CPU tensors (interpreter), "
            f"not on {device}; use backend='reference'"
        )
    if not _triton_installed():
        raise ImportError(
            "backend='triton' needs Triton (pip install 'triton>=3.6', or the "
            "dynamiq-allreduce[kernels] extra); use backend='reference' without it"
        )
    ks = _PLUGINS.get((type(codec), "triton"))
    if ks is not None:
        return getattr(ks, op)
    name = declared_family(codec)
    if name is None:
        return None
    return getattr(_builtin(name, interpret=device == "cpu"), op)


# -- loading the built-in kernel modules ------------------------------------------------------

#: kernel modules loaded by :func:`_builtin`: name -> (module, whether interpreted)
_LOADED: dict[str, tuple[types.ModuleType, bool]] = {}
_COMPILED_MODE = (
    "the Triton backend runs CPU tensors through Triton's interpreter, but Triton was imported "
    "without TRITON_INTERPRET=1: set it before Triton is imported, or use backend='reference' "
    "(or CUDA tensors)"
)
_SET_IT = (
    "the Triton backend runs CPU tensors through Triton's interpreter, which Triton chooses "
    "when it is imported: set TRITON_INTERPRET=1 in the environment before the first Triton "
    "call (dynamiq never changes the environment), or use backend='reference' or 'cpu'"
)


def _builtin(name: str, *, interpret: bool) -> types.ModuleType:
    """The kernel module ``name``, its kernels compiled or interpreted like Triton's own.

    Triton fixes when it is imported whether ``@triton.jit`` functions, its own included, are
    compiled or interpreted (``TRITON_INTERPRET``), and reads its knob again later: this holds
    the knob at that mode (:func:`_pin_mode`). CPU tensors need the interpreter: the
    environment must say so before Triton is imported (this never sets it).
    """
    loaded = _LOADED.get(name)
    if loaded is not None and sys.modules.get(f"{__name__}.{name}") is loaded[0]:
        # imported before, in the mode Triton runs in for the rest of the process: skip the
        # checks (they cost more than a launch); a CPU call still needs the interpreter
        if interpret and not loaded[1]:
            raise RuntimeError(_COMPILED_MODE)
        return loaded[0]
    with _LOCK:
        if interpret and "triton" not in sys.modules and not _interpret_env():
            raise RuntimeError(_SET_IT)
        interpreted = _triton_interpreting()
        if interpret and not interpreted:
            raise RuntimeError(_COMPILED_MODE)
        _pin_mode(interpreted)
        module = importlib.import_module(f"{__name__}.{name}")
        if _is_interpreted(module) != interpreted:
            raise RuntimeError(
                f"{module.__name__} was imported while TRITON_INTERPRET differed from the mode "
                "Triton was imported in; import it through dynamiq.kernels, and set "
                "TRITON_INTERPRET before importing Triton"
            )
        _LOADED[name] = (module, interpreted)
        return module


def _pin_mode(interpreted: bool) -> None:
    """Hold Triton's ``interpret`` knob at the mode Triton was imported in, in the knob's own
    in-process slot (``triton.knobs``), not in the environment: Triton reads it again when it
    decorates a function and while it runs one, and a mode other than its import-time one
    would mix compiled and interpreted functions."""
    from triton import knobs

    knobs.runtime.__dict__["interpret"] = interpreted  # (the knob's setter writes os.environ)
    if bool(knobs.runtime.interpret) != interpreted:
        raise RuntimeError(
            "dynamiq could not hold Triton's interpret knob at the mode Triton was imported in "
            "(an unsupported Triton version?); keep TRITON_INTERPRET as it was then"
        )


def _is_interpreted(module: types.ModuleType) -> bool:
    """Whether the ``@triton.jit`` functions of ``module`` run in Triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return any(isinstance(v, InterpretedFunction) for v in vars(module).values())


def _triton_interpreting() -> bool:
    """Whether Triton (imported here if needed) runs ``@triton.jit`` functions interpreted."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@contextlib.contextmanager
def _kernel_scope(device: torch.device) -> Iterator[None]:
    """Run a Triton kernel. On the CPU, Triton's interpreter runs it (Triton checks the mode
    lazily: its knob, held by :func:`_pin_mode`), computing with NumPy, whose warnings about
    IEEE results (Inf - Inf, overflow to Inf) are expected: silence them there."""
    if device.type != "cpu":
        yield
        return
    import numpy as np

    with np.errstate(all="ignore"):
        yield
