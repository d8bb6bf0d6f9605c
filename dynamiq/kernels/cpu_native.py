"""The CPU fast path: native kernels of the built-in codecs but THC and OmniReduce (docs/design.md,
"Kernels").

The codecs' PyTorch references make dozens of full-tensor passes; on the CPU this module runs
the same computation as one C++ loop per tile of blocks (``csrc/cpu_kernels.cpp``; DynamiQ:
per span, ``csrc/dynamiq_kernels.cpp``; the pass-through codecs:
``csrc/passthrough_kernels.cpp``): the fused ``reduce`` decodes the incoming payload, adds the
local slice in fp32, recomputes the block statistics, rounds and packs without an
fp32 tensor in memory (DynamiQ: a span-sized scratch per thread, since a span's widths depend
on all of its scales), on ``torch.get_num_threads()`` threads. It is **bit-exact** with the
references (same payload bytes, same decoded values): the same fp32 operations in the same
order, no FMA contraction, IEEE division, the references' own fp32 tables (DynamiQ's level,
rounding and group-scale tables are passed in from :mod:`dynamiq.codecs.dynamiq_codec`), and
integer arithmetic for scales, element formats, rounding decisions, DynamiQ's bit widths
(water-filling), packing and the counter hash of stochastic and correlated rounding
(``tests/kernels/test_cpu_fast_path_native.py``, ``test_cpu_native_dynamiq.py``,
``test_cpu_native_passthrough.py``).

It covers :class:`~dynamiq.codecs.intq.IntCodec` (every ``bits``, ``block_size``,
``rounding`` and ``scale_format``), the six MX codecs and
:class:`~dynamiq.codecs.dynamiq_codec.DynamiqCodec` (every ``bits``, ``span``,
``super_group``, ``group``, ``levels``, ``rounding``, ``hop_slope``, ``pooled`` and
``scale_steps``), the pass-through codecs ``fp32``, ``bf16`` and ``fp16``, and every
declared block format the generic kernel implements (:class:`~dynamiq.codecs.BlockCodec`
with ``fits_kernels()``: ``nvfp4``, plugins' subclasses; ``dq_blk_run``), with
fp32/bf16/fp16 inputs. The results do not depend on the thread count.

**Build.** The library is compiled the first time it is needed with the system C++ compiler
(``$CXX``, else ``g++``, ``c++`` or ``clang++``; ``-O3 -march=native -ffp-contract=off``, a
few seconds) and cached in ``$DYNAMIQ_CACHE/cpu-kernels`` (default
``~/.cache/dynamiq/cpu-kernels``) under a name that hashes the sources (``csrc/``), the
flags, the compiler and the CPU, so later processes load it in milliseconds and a home
directory shared by different machines never runs code built for another CPU. Nothing is
downloaded. The cache loads only what this user built (:mod:`dynamiq.kernels._libcache`): the
directory and its ancestors must be owned by this user or root and writable by no one else
(sticky ancestors such as ``/tmp`` are fine), else a private 0700 directory is used, with an
:class:`UnsafeCacheWarning`; the library is written atomically with its SHA-256 beside it,
checked before ``dlopen``, and a damaged file is rebuilt. Without a compiler, or if the
build fails, one :class:`CPUKernelsUnavailableWarning` says why and the codecs run on their
PyTorch reference, as before. On a CPU with AVX-512 (and BMI2), the DynamiQ kernel's full
groups of 16, 32 or 64 values run as vector code with in-register tables; with AVX2 (BMI2,
F16C) but not AVX-512, full groups of a multiple of 8 values (``csrc/dynamiq_avx2.h``);
elsewhere, portable loops give the same bytes.

**Dispatch** (:mod:`dynamiq.kernels`): ``backend="auto"`` runs these kernels on CPU tensors of
at least :data:`MIN_NUMEL` values (unless ``DYNAMIQ_CPU_KERNELS=0``, :func:`set_cpu_kernels`
``(False)``, or the ``torch.compile`` path was switched on explicitly); ``backend="cpu"``
forces them (an error if they cannot run); ``backend="reference"`` is the plain reference.
Which codecs: those whose class declares a family with an entry point here
(``kernel_family``: :mod:`dynamiq.kernels._declared`). Per codec configuration the argument
structure is filled once (:class:`_Native`; DynamiQ's per-call fields once per call
signature, memoized: :meth:`_Native._dyn_filled`); a call copies it and sets the buffers,
the length and the thread count, and takes arguments the dispatcher validated already (the
module's own :func:`encode`, :func:`decode` and :func:`reduce` check theirs).

**Shared with csrc/, checked at load**: each argument structure's size and field offsets
(``_LAYOUTS``), and the scale-format and specials codes of :mod:`dynamiq.codecs.wire_codes`,
from which the build generates ``dq_codes.h`` (``_check_codes``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dynamiq.codecs import wire_codes

from . import _libcache, _settings
from ._declared import declared_family
from ._libcache import UnsafeCacheWarning
from ._stats import record_launch

if TYPE_CHECKING:
    from dynamiq.codecs.base import Codec, HopContext
    from dynamiq.codecs.formats import ElementFormat

__all__ = [
    "MIN_NUMEL",
    "CPUKernelsUnavailableWarning",
    "UnsafeCacheWarning",
    "available",
    "cpu_kernels_enabled",
    "decode",
    "encode",
    "kernel",
    "library_path",
    "reduce",
    "set_cpu_kernels",
]

#: ``backend="auto"`` uses the native kernels for CPU tensors of at least this many values
MIN_NUMEL = 1 << 12

#: values per thread below which fewer threads are started (thread start-up is ~20 us)
_PER_THREAD = 1 << 16

_CSRC = Path(__file__).with_name("csrc")
#: the translation units of the library (one shared object)
SOURCES = (
    _CSRC / "cpu_kernels.cpp",
    _CSRC / "dynamiq_kernels.cpp",
    _CSRC / "dynamiq_pool.cpp",
    _CSRC / "passthrough_kernels.cpp",
)
#: what they include
HEADERS = (_CSRC / "common.h", _CSRC / "dynamiq_avx2.h")
#: and the header of the shared codes the build generates (``dynamiq/codecs/wire_codes.py``)
_CODES_H = "dq_codes.h"
#: no -ffast-math (IEEE division, subnormals kept), no FMA contraction: bit-exactness
FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",  # lets GCC vectorize branch-free code; changes no value
    "-fPIC",
    "-shared",
    "-std=c++17",
)
_LINK = ("-pthread",)
#: ``DYNAMIQ_CPU_SANITIZE=address``: a debugging build under AddressSanitizer (its own cache
#: entry); the process must preload the compiler's libasan: ``make sanitize`` does both
_SANITIZE = {"address": ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address")}
_ABI_VERSION = 8


class CPUKernelsUnavailableWarning(RuntimeWarning):
    """The native CPU kernels could not be built or loaded; the PyTorch reference runs."""


# -- the argument structures of csrc/cpu_kernels.cpp ------------------------------------------


#: the fields every argument structure starts with, in this order
_COMMON_FIELDS: list[tuple[str, Any]] = [
    ("op", ctypes.c_int32),
    ("in_kind", ctypes.c_int32),
    ("x", ctypes.c_void_p),
    ("inp", ctypes.c_void_p),
    ("out", ctypes.c_void_p),
    ("out_values", ctypes.c_void_p),
    ("n", ctypes.c_int64),
]


class _IntArgs(ctypes.Structure):
    _fields_ = [  # the C struct dq_int_args
        *_COMMON_FIELDS,
        ("block_size", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("fmt", ctypes.c_int32),
        ("stochastic", ctypes.c_int32),
        ("key0", ctypes.c_uint32),
        ("key1", ctypes.c_uint32),
        ("offset", ctypes.c_uint64),
        ("max_in_bits", ctypes.c_uint32),
        ("nthreads", ctypes.c_int32),
        ("worst", ctypes.c_uint32),
    ]


#: an element format's integer parameters, in the order of the C structs (``_mx_format``)
_FORMAT_FIELDS = ("specials", "nmant", "bias", "bits", "max_code", "nan_code", "inf_code", "emax")


class _MXArgs(ctypes.Structure):
    _fields_ = [  # the C struct dq_mx_args
        *_COMMON_FIELDS,
        ("specials", ctypes.c_int32),
        ("nmant", ctypes.c_int32),
        ("bias", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("max_code", ctypes.c_int32),
        ("nan_code", ctypes.c_int32),
        ("inf_code", ctypes.c_int32),
        ("emax", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
    ]


class _BlkArgs(ctypes.Structure):
    _fields_ = [  # the C struct dq_blk_args (csrc/cpu_kernels.cpp)
        *_COMMON_FIELDS,
        ("block_size", ctypes.c_int64),
        *[(f"e_{k}", ctypes.c_int32) for k in _FORMAT_FIELDS],
        *[(f"s_{k}", ctypes.c_int32) for k in _FORMAT_FIELDS if k not in ("bits", "inf_code")],
        ("header", ctypes.c_int32),
        ("g_out_bits", ctypes.c_uint32),
        ("e_max", ctypes.c_float),
        ("nthreads", ctypes.c_int32),
    ]


class _PTArgs(ctypes.Structure):
    _fields_ = [  # the C struct dq_pt_args (csrc/passthrough_kernels.cpp)
        *_COMMON_FIELDS,
        ("out_kind", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
    ]


#: one payload's fields of ``dq_dyn_args`` (``{name}_{in|out}{tail}``)
_DYN_SIDE: list[tuple[str, str, Any]] = [
    ("budget", "_full", ctypes.c_int64),
    ("budget", "_last", ctypes.c_int64),
    ("budget", "_of", ctypes.c_void_p),
    ("offset", "_of", ctypes.c_void_p),
    ("offset", "_base", ctypes.c_int64),
]


class _DynArgs(ctypes.Structure):
    _fields_ = [  # the C struct dq_dyn_args (csrc/dynamiq_kernels.cpp)
        *_COMMON_FIELDS,
        ("span", ctypes.c_int64),
        ("super_group", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("scale_steps", ctypes.c_int32),
        ("pooled", ctypes.c_int32),
        ("rounding", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
        *[
            (f"{name}_{side}{tail}", kind)
            for side in ("in", "out")
            for name, tail, kind in _DYN_SIDE
        ],
        ("key0", ctypes.c_uint32),
        ("key1", ctypes.c_uint32),
        ("shift_key0", ctypes.c_uint32),
        ("shift_key1", ctypes.c_uint32),
        ("offset", ctypes.c_uint64),
        ("hop", ctypes.c_uint64),
        ("num_hops", ctypes.c_uint64),
        ("num_hops_f32", ctypes.c_float),
        ("levels", ctypes.c_void_p),
        ("base", ctypes.c_void_p),
        ("key", ctypes.c_void_p),
        ("lower", ctypes.c_void_p),
        ("gap", ctypes.c_void_p),
        ("eyt", ctypes.c_void_p),
        ("eyt5", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("steps", ctypes.c_void_p),
        ("powers", ctypes.c_void_p),
    ]


#: the ``struct`` code of each field type of the argument structures (addresses: 64 bits)
_PACK_CODE = {
    ctypes.c_int32: "i",
    ctypes.c_uint32: "I",
    ctypes.c_int64: "q",
    ctypes.c_uint64: "Q",
    ctypes.c_void_p: "Q",
    ctypes.c_float: "f",
}


def _packer(mirror: type[ctypes.Structure], first: str, last: str) -> tuple[struct.Struct, int]:
    """A ``struct.Struct`` writing the fields ``first`` .. ``last`` of ``mirror`` at once
    (``pack_into(args, at, ...)``), and ``at``, their start; ``RuntimeError`` unless they lie
    contiguous, without padding."""
    names = [f[0] for f in mirror._fields_]
    at, fmt = getattr(mirror, first).offset, "<"
    for name, kind, *_ in mirror._fields_[names.index(first) : names.index(last) + 1]:
        fmt += _PACK_CODE[kind]
        field = getattr(mirror, name)
        if field.offset + field.size != at + struct.calcsize(fmt):
            raise RuntimeError(f"{mirror.__name__}.{name} does not follow {first} contiguously")
    return struct.Struct(fmt), at


#: ``dq_dyn_args``' per-call fields, written in one pack: each payload's two uniform budgets,
#: pooled budgets, offsets and offset base, then the hash keys, offset, hop, num_hops (and
#: as fp32)
_DYN_HOP, _DYN_HOP_AT = _packer(_DynArgs, "budget_in_full", "num_hops_f32")

_OP = {"encode": 0, "reduce": 1, "decode": 2}
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SCALE_FMT = {name: f.code for name, f in wire_codes.SCALE_FORMATS.items()}
_SPECIALS = wire_codes.SPECIALS
_ROUNDING = {"nearest": 0, "stochastic": 1, "correlated": 2}

# -- switch -----------------------------------------------------------------------------------


def set_cpu_kernels(enabled: bool | None) -> None:
    """Let ``backend="auto"`` use the CPU kernels (native, and those registered with
    ``register_kernels(..., backend="cpu")``) or not (``None``: follow ``DYNAMIQ_CPU_KERNELS``,
    on unless it is ``0``/``false``/``no``/``off``, read now; the
    environment is read at import and by the setters only: :mod:`dynamiq.kernels._settings`)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None (got {type(enabled).__name__})")
    _settings.override("cpu_kernels", enabled)


def cpu_kernels_enabled() -> bool:
    """Whether ``backend="auto"`` may use the native CPU kernels (they may still be
    unavailable: see :func:`available`)."""
    return _settings.cpu_kernels


# -- build and load ---------------------------------------------------------------------------

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_FAILURE: str | None = None  # why the library is unavailable (set once; not retried)


def _cache_dir() -> Path:
    """``$DYNAMIQ_CACHE/cpu-kernels`` (default ``~/.cache/dynamiq/cpu-kernels``) if it is safe
    to load libraries from, else a private directory (with a warning; see ``_libcache``)."""
    env = os.environ.get("DYNAMIQ_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "dynamiq"
    return _libcache.cache_dir(base / "cpu-kernels")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or cxx
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and feature flags (Linux: the first
    processor's entry of /proc/cpuinfo)."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # end of the first processor's entry
                key = line.split(":", 1)[0].strip()
                if key in ("vendor_id", "model name", "flags", "Features", "CPU part"):
                    parts.append(line.strip())
    except OSError:
        pass
    return "\n".join(parts)


def _flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile flags, link flags): ``FLAGS`` and ``_LINK``, or their sanitized variant."""
    mode = os.environ.get("DYNAMIQ_CPU_SANITIZE", "")
    if not mode:
        return FLAGS, _LINK
    if mode not in _SANITIZE:
        raise RuntimeError(
            f"DYNAMIQ_CPU_SANITIZE={mode!r} is not one of {sorted(_SANITIZE)} (or empty)"
        )
    extra = _SANITIZE[mode]
    base = tuple(f for f in FLAGS if not f.startswith("-O"))
    return (*base, *extra), (*_LINK, extra[-1])


def library_path(compiler: str | None = None) -> Path:
    """Where the library built for this source, compiler and CPU is cached."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    h.update(_CODES_H.encode() + b"\0" + wire_codes.c_header().encode())
    flags, link = _flags()
    for part in (*flags, *link, "-march=native", str(compiler or _compiler()), _cpu_identity()):
        h.update(b"\0" + part.encode())
    return _cache_dir() / f"dynamiq_cpu_kernels-v{_ABI_VERSION}-{h.hexdigest()[:16]}.so"


def _build(cxx: str, dest: Path) -> None:
    """Compile the library to ``dest`` and record its SHA-256 beside it, atomically:
    temporary files in the cache directory renamed into place, the library first (the
    caller, ``_libcache.load``, holds the cache's build lock). Says so on stderr first: the
    build takes tens of seconds, once per machine and compiler."""
    print(
        f"dynamiq: building the native CPU kernels into {dest} (once per machine; "
        "this takes a while) ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=dest.parent) as include:
        (Path(include) / _CODES_H).write_text(wire_codes.c_header(), encoding="utf-8")
        _compile(cxx, dest, ("-I", include))


def _compile(cxx: str, dest: Path, include: tuple[str, ...]) -> None:
    errors = []
    # -march=native where the compiler knows it; a portable build otherwise
    for arch in (("-march=native",), ()):
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=dest.parent)
        os.close(fd)
        digest: Path | None = None
        flags, link = _flags()
        cmd = [cxx, *flags, *arch, *include, "-o", tmp, *map(str, SOURCES), *link]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode == 0:
                os.chmod(tmp, 0o755)  # whatever the umask: writable by this user only
                digest = _libcache.write_digest(Path(tmp), dest)
                os.replace(tmp, dest)
                os.replace(digest, _libcache.digest_path(dest))
                return
            errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()[-2000:]}")
        finally:
            for left in (tmp, digest):
                if left is not None and os.path.exists(left):
                    os.unlink(left)
    raise RuntimeError("; ".join(errors))


def _load() -> ctypes.CDLL:
    """The loaded library (built on first use); raises ``RuntimeError`` saying why not."""
    global _LIB, _FAILURE
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        if _FAILURE is None:
            try:
                _LIB = _open()
            except Exception as exc:  # no compiler, build error, unloadable library
                _FAILURE = str(exc) or type(exc).__name__
                warnings.warn(
                    f"dynamiq: the native CPU kernels are unavailable ({_FAILURE}); the "
                    "pass-through, INT, MX and DynamiQ codecs run on their PyTorch reference on "
                    "the CPU (slower, same results). Set DYNAMIQ_CPU_KERNELS=0 to skip them.",
                    CPUKernelsUnavailableWarning,
                    stacklevel=2,
                )
        if _LIB is None:
            raise RuntimeError(f"the native CPU kernels are unavailable: {_FAILURE}")
        return _LIB


def _open() -> ctypes.CDLL:
    if sys.byteorder != "little":
        raise RuntimeError("they assume a little-endian machine (the wire format's byte order)")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    path = library_path(cxx)
    lib = _libcache.load(path, functools.partial(_build, cxx))
    lib.dq_abi_version.restype = ctypes.c_int
    if lib.dq_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"{path} has ABI version {lib.dq_abi_version()}, not {_ABI_VERSION}")
    lib.dq_int_run.argtypes = [ctypes.POINTER(_IntArgs)]
    lib.dq_int_run.restype = ctypes.c_int
    lib.dq_mx_run.argtypes = [ctypes.POINTER(_MXArgs)]
    lib.dq_mx_run.restype = ctypes.c_int
    lib.dq_dyn_run.argtypes = [ctypes.POINTER(_DynArgs)]
    lib.dq_dyn_run.restype = ctypes.c_int
    lib.dq_blk_run.argtypes = [ctypes.POINTER(_BlkArgs)]
    lib.dq_blk_run.restype = ctypes.c_int
    lib.dq_pt_run.argtypes = [ctypes.POINTER(_PTArgs)]
    lib.dq_pt_run.restype = ctypes.c_int
    lib.dq_dyn_group_absmax.argtypes = [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int32,
    ]  # fmt: skip
    lib.dq_dyn_group_absmax.restype = ctypes.c_int
    _check_layouts(lib, path)
    _check_codes(lib, path)
    return lib


def _check_codes(lib: ctypes.CDLL, path: Path) -> None:
    """Raise ``RuntimeError`` unless the library was compiled with the codes of
    :mod:`dynamiq.codecs.wire_codes` (``dq_codes``: a library built from another table, or C++ code
    naming a scale format or specials the table lacks, or lacking one it has)."""
    buf = (ctypes.c_int64 * 256)()
    lib.dq_codes.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    lib.dq_codes.restype = ctypes.c_int64
    got = list(buf[: lib.dq_codes(buf, len(buf))])
    want = wire_codes.reported()
    if got != want:
        raise RuntimeError(
            f"{path}: compiled with the scale-format and specials codes {got}, not those of "
            f"dynamiq/codecs/wire_codes.py ({want})"
        )


#: the C structures whose layout the library reports (``DQ_LAYOUT`` in ``csrc/common.h``) and
#: their mirrors here
_LAYOUTS: dict[str, type[ctypes.Structure]] = {
    "dq_dyn_args": _DynArgs,
    "dq_int_args": _IntArgs,
    "dq_mx_args": _MXArgs,
    "dq_blk_args": _BlkArgs,
    "dq_pt_args": _PTArgs,
}


def _check_layouts(lib: ctypes.CDLL, path: Path) -> None:
    """Raise ``RuntimeError`` unless each mirrored structure has the C struct's size and field
    offsets, in order (a mismatch would pass wrong arguments to a kernel: a crash or wrong
    bytes). It catches added, removed, resized and moved fields; two adjacent fields of one
    type swapped on one side only keep every offset, so that needs the tests."""
    buf = (ctypes.c_int64 * 128)()
    for name, mirror in _LAYOUTS.items():
        fn = getattr(lib, f"{name}_layout")
        fn.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        fn.restype = ctypes.c_int64
        got = list(buf[: fn(buf, len(buf))])
        fields = [f[0] for f in mirror._fields_]
        want = [ctypes.sizeof(mirror), *(getattr(mirror, f).offset for f in fields)]
        if got != want:
            raise RuntimeError(
                f"{path}: struct {name} (size, then field offsets: {got}) does not match its "
                f"ctypes mirror {mirror.__name__} ({want}; fields {', '.join(fields)}): "
                "cpu_native.py and csrc/ disagree"
            )


def available() -> bool:
    """Whether the native CPU kernels can run here (builds them on the first call; a failure
    warns once and is not retried in this process)."""
    try:
        _load()
    except RuntimeError:
        return False
    return True


# -- which codecs -----------------------------------------------------------------------------


def _family(codec: Codec) -> str | None:
    """The kernel family ``codec`` declares (:mod:`dynamiq.kernels._declared`) if it has a
    native entry point here (``"passthrough"``, ``"intq"``, ``"mx"``, ``"dynamiq"``,
    ``"block"``), else ``None``."""
    family = declared_family(codec)
    return family if family in _TEMPLATES else None


def kernel(codec: Codec, op: str, *, required: bool = False) -> Callable[..., Any] | None:
    """The native implementation of ``op`` for ``codec``, with the dispatcher's signature and
    no checks of its own (the dispatcher validated the arguments), or ``None`` when there is
    none or the library is unavailable (``required``: raise instead)."""
    family = _family(codec)
    if family is None:
        if required:
            raise NotImplementedError(
                f"codec {codec.codec_id!r} ({type(codec).__qualname__}) has no native CPU "
                f"kernel for {op} (only the built-in pass-through, INT, MX, DynamiQ and "
                "block-format codecs have); use backend='reference'"
            )
        return None
    if required:
        _load()
    elif not available():
        return None
    return getattr(_native(codec, family), op)


# -- launchers ----------------------------------------------------------------------------------


def _threads(n: int) -> int:
    return max(1, min(torch.get_num_threads(), -(-n // _PER_THREAD)))


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the native CPU kernels take CPU tensors (got {t.device})")


def _check_values(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _KIND:
        raise TypeError(
            f"the native CPU kernels take {name} as float32, bfloat16 or float16 (got {t.dtype})"
        )
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor (got shape {tuple(t.shape)})")


def _check_payload(codec: Codec, payload: torch.Tensor, numel: int, ctx: HopContext) -> None:
    if payload.dtype != torch.uint8:
        raise TypeError(f"payload must have dtype torch.uint8 (got {payload.dtype})")
    expected = codec.encoded_nbytes(numel, ctx)
    if payload.dim() != 1 or not payload.is_contiguous() or payload.numel() != expected:
        raise ValueError(
            f"payload must be a contiguous 1-D tensor of {expected} bytes (what "
            f"{codec.codec_id} encodes {numel} values in; got shape {tuple(payload.shape)})"
        )


def _block_exp(codec: Any, x: torch.Tensor, ctx: HopContext, total: Any = None) -> int:
    """The outgoing tensor-scale exponent: from the prologue's result, else from the values'
    absmax (``total()``: the fused reduce's sum, computed first outside a collective)."""
    from dynamiq.codecs.blockfmt import TENSOR_AMAX_KEY, finite_absmax_bits

    shared = ctx.shared
    if not codec.tensor_scale or (shared is not None and TENSOR_AMAX_KEY in shared):
        return codec.tensor_exp_of(x, ctx)
    return codec.tensor_exp(finite_absmax_bits(total() if total is not None else x), 1)


# -- one codec configuration's native kernel ------------------------------------------------


def _int_template(codec: Any) -> _IntArgs:
    return _IntArgs(
        block_size=codec.block_size,
        bits=codec.bits,
        fmt=_SCALE_FMT[codec.scale_format],
        stochastic=int(codec.rounding == "stochastic"),
        max_in_bits=_f32_bits(codec.max_input_abs),
    )


def _mx_template(codec: Any) -> _MXArgs:
    return _MXArgs(**_mx_format(codec.element))


def _block_template(codec: Any) -> _BlkArgs:
    e = _mx_format(codec.elem)
    s = _mx_format(codec.scale_fmt)
    return _BlkArgs(
        block_size=codec.block_size,
        **{f"e_{k}": v for k, v in e.items()},
        **{f"s_{k}": v for k, v in s.items() if k not in ("bits", "inf_code")},
        e_max=codec.elem.max,
    )


@functools.lru_cache(maxsize=1024)
def _dyn_keys(seed: int, step: int, hop: int, rank: int) -> tuple[int, int, int, int]:
    """DynamiQ's hash keys of the dither and of the correlated shift of a hop context."""
    from dynamiq.codecs.hashing import hash_keys

    return (*hash_keys(seed, step, hop, rank), *hash_keys(seed, step, 0xFFFFFFFF, 0xFFFFFFFF))


def _dyn_template(codec: Any) -> _DynArgs:
    tables = _dynamiq_tables(codec)
    args = _DynArgs(
        span=codec.span,
        super_group=codec.super_group,
        group=codec.group,
        scale_steps=codec.scale_steps,
        pooled=int(codec.pooled),
        rounding=_ROUNDING[codec.rounding],
        **{name: t.data_ptr() for name, t in tables.items()},
    )
    # the template holds the very tensors it points into: the cache above may hand another
    # thread a second dict of equal tables (lru_cache does not lock its computation), and a
    # pointer into a dict nothing holds dangles (seen: a garbage Q refused by the kernel)
    args.tables = tables
    return args


def _pt_template(codec: Any) -> _PTArgs:
    return _PTArgs(out_kind=_KIND[codec.dtype])


#: family -> (its argument structure's fields that depend only on the configuration, the
#: native entry point)
_TEMPLATES: dict[str, tuple[Callable[[Any], ctypes.Structure], str]] = {
    "dynamiq": (_dyn_template, "dq_dyn_run"),
    "intq": (_int_template, "dq_int_run"),
    "mx": (_mx_template, "dq_mx_run"),
    "block": (_block_template, "dq_blk_run"),
    "passthrough": (_pt_template, "dq_pt_run"),
}
#: the most argument structures a memo of DynamiQ's keeps (:meth:`_Native._dyn_filled`)
_MAX_MEMO = 1024
#: the names :func:`record_launch` counts (``cpu_<name>_<op>``)
_LAUNCH_NAME = {"intq": "int"}


class _Native:
    """The native kernel of one codec configuration: its argument structure filled once, so
    a call copies it and sets only what changes per call (buffers, length, threads; the hash
    keys of stochastic rounding, a block format's tensor scale; DynamiQ's budgets, pooled
    spans and hop fields, from memoized values: :meth:`_dyn_fields`). ``encode``, ``decode``
    and ``reduce`` take the dispatcher's (already validated) arguments."""

    def __init__(self, codec: Any, family: str) -> None:
        self.lib = _load()
        self.family = family
        name = _LAUNCH_NAME.get(family, family)
        self.launches = {op: f"cpu_{name}_{op}" for op in _OP}
        check_range = getattr(codec, "check_range", None)  # DynamiQ: outside a collective
        self.check_range = check_range if callable(check_range) else None
        make, self.entry = _TEMPLATES[family]
        self.template = make(codec)
        self.stochastic = family == "intq" and codec.rounding == "stochastic"
        #: DynamiQ: its wire description, and the uniform budgets (bits) of a full and of
        #: the short last span per (hop, num_hops, last span's length)
        self.wire: Any = codec.wire() if family == "dynamiq" else None
        self.budgets: dict[tuple[int, int, int], tuple[int, int]] = {}
        #: DynamiQ: filled argument structures that depend on no prologue result
        #: (:meth:`_dyn_filled`)
        self.memo: dict[Any, Any] = {}

    def encode(self, codec: Any, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        if self.check_range is not None:
            self.check_range(x, ctx)
        n = x.numel()
        out = torch.empty(codec.encoded_nbytes(n, ctx) or 0, dtype=torch.uint8)
        if n:
            g = _block_exp(codec, x, ctx) if self.family == "block" else 0
            ptrs = (x.data_ptr(), None, out.data_ptr(), None)
            self._run(codec, "encode", n, (ctx, ctx), _KIND[x.dtype], ptrs, g)
        return out

    def decode(self, codec: Any, payload: torch.Tensor, numel: int, ctx: HopContext) -> Any:
        out = torch.empty(numel, dtype=torch.float32)
        if numel:
            ptrs = (None, payload.data_ptr(), None, out.data_ptr())
            self._run(codec, "decode", numel, (ctx, ctx), 0, ptrs, 0)
        return out

    def reduce(
        self, codec: Any, payload: torch.Tensor, local: torch.Tensor, ctx: Any, out_ctx: Any
    ) -> torch.Tensor:
        n = local.numel()
        out = torch.empty(codec.encoded_nbytes(n, out_ctx) or 0, dtype=torch.uint8)
        if n:
            g = 0
            if self.family == "block":  # the sum's absmax, unless the prologue agreed on one

                def total() -> torch.Tensor:
                    return self.decode(codec, payload, n, ctx) + local.float()

                g = _block_exp(codec, local, out_ctx, total)
            ptrs = (local.data_ptr(), payload.data_ptr(), out.data_ptr(), None)
            self._run(codec, "reduce", n, (out_ctx, ctx), _KIND[local.dtype], ptrs, g)
        return out

    def _run(
        self,
        codec: Any,
        op: str,
        n: int,
        ctxs: tuple[HopContext, HopContext],
        in_kind: int,
        ptrs: tuple[int | None, int | None, int | None, int | None],
        g_exp: int,
    ) -> None:
        """One native call: ``ctxs`` the outgoing payload's context (the dither) and the
        incoming one's, ``ptrs`` the addresses of ``x``, ``inp``, ``out`` and ``out_values``
        (``None``: unused), ``g_exp`` a block format's outgoing tensor-scale exponent."""
        ctx, in_ctx = ctxs
        filled = self._dyn_filled(codec, n, ctx, in_ctx) if self.family == "dynamiq" else None
        args: Any = type(self.template).from_buffer_copy(filled or self.template)
        args.op = _OP[op]
        args.in_kind = in_kind
        args.x, args.inp, args.out, args.out_values = ptrs
        args.n = n
        args.nthreads = _threads(n)
        if self.family == "intq":
            self._int_fields(args, ctx)
        elif self.family == "block":
            args.header = codec.header_nbytes(n)
            args.g_out_bits = _pow2_bits(g_exp)
        # (looked up per call: benchmarks/dispatch_overhead.py times the entry point)
        _check_status(getattr(self.lib, self.entry)(ctypes.byref(args)))
        if self.family == "intq" and args.worst:
            _out_of_range(codec, args.worst)
        record_launch(self.launches[op])

    def _int_fields(self, args: Any, ctx: HopContext) -> None:
        if self.stochastic:  # the keys are read by stochastic rounding only
            from dynamiq.codecs.hashing import hash_keys

            args.key0, args.key1 = hash_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
        args.offset = ctx.offset

    def _dyn_filled(
        self, codec: Any, n: int, ctx: HopContext, in_ctx: HopContext
    ) -> ctypes.Structure:
        """DynamiQ's template with its per-call fields filled (:meth:`_dyn_fields`), memoized
        per ``n`` and the values of the two contexts' fields that it reads: here when
        neither context holds a prologue result the fields depend on, in that result's own
        memo when both hold the same one (the entry holds this object: its key's identity
        stays its own), not at all when they hold different ones."""
        memo = self.wire.memo(ctx)
        two = in_ctx is not ctx and in_ctx.shared is not ctx.shared
        if two and (memo is not None or self.wire.memo(in_ctx) is not None):
            return self._dyn_new(codec, n, ctx, in_ctx)
        if memo is None:
            memo = self.memo
        key = (
            self, n, ctx.seed, ctx.step, ctx.hop, ctx.num_hops, ctx.rank, ctx.offset,
            in_ctx.hop, in_ctx.num_hops, in_ctx.offset,
        )  # fmt: skip
        got = memo.get(key)
        if got is None:
            if len(memo) >= _MAX_MEMO:
                memo.clear()
            got = memo[key] = self._dyn_new(codec, n, ctx, in_ctx)
        return got

    def _dyn_new(self, codec: Any, n: int, ctx: HopContext, in_ctx: HopContext) -> Any:
        args = type(self.template).from_buffer_copy(self.template)
        self._dyn_fields(codec, args, n, ctx, in_ctx)
        return args

    def _dyn_fields(
        self, codec: Any, args: Any, n: int, ctx: HopContext, in_ctx: HopContext
    ) -> None:
        """DynamiQ's per-call fields: ``in_ctx`` the incoming payload's context (decode,
        reduce), ``ctx`` the outgoing payload's (encode, reduce: the dither and the budget).
        Every value comes from a memo keyed on values (the budgets here, the hash keys in
        :func:`_dyn_keys`) or held by ``ctx.shared`` (the pooled spans: the prologue's
        result memoizes them, and the caller holds it until the kernel is done); they are
        written in one pack (``_DYN_HOP``: the fields ``budget_in_full`` .. ``num_hops_f32``)."""
        rest = n % codec.span
        _DYN_HOP.pack_into(
            args, _DYN_HOP_AT,
            *self._dyn_side(codec, n, rest, in_ctx), *self._dyn_side(codec, n, rest, ctx),
            *_dyn_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank),
            ctx.offset, ctx.hop, ctx.num_hops, float(ctx.num_hops),  # fp32 as torch divides
        )  # fmt: skip

    def _dyn_side(self, codec: Any, n: int, rest: int, c: HopContext) -> tuple[int, ...]:
        """One payload's uniform budgets (bits: a full span's, the short last one's; unread
        by the kernel when pooled), and its pooled spans' budgets, offsets and offset base
        (``0, 0, 0``: uniform)."""
        wire = self.wire
        pooled = wire.native_spans(n, c)
        key = (c.hop, c.num_hops, rest)
        uniform = self.budgets.get(key)
        if uniform is None:
            if len(self.budgets) >= 4096:
                self.budgets.clear()
            uniform = self.budgets[key] = (wire.budget(codec.span, c), wire.budget(rest, c))
        return (*uniform, *(pooled or (0, 0, 0)))


def _out_of_range(codec: Any, worst_bits: int) -> None:
    worst = struct.unpack("<f", struct.pack("<I", worst_bits))[0]
    raise ValueError(
        f"int codec: a block absmax of {worst!r} "
        f"exceeds max_input_abs={codec.max_input_abs!r}: its scale is beyond "
        f"scale_format={codec.scale_format!r}; use a wider scale_format ('fp32')"
    )


@functools.lru_cache(maxsize=64)
def _native_cached(codec: Any, family: str) -> _Native:
    return _Native(codec, family)


def _native(codec: Any, family: str) -> _Native:
    """The :class:`_Native` of ``codec``'s configuration (cached by value)."""
    try:
        return _native_cached(codec, family)
    except TypeError:  # an unhashable configuration: built each time
        return _Native(codec, family)


@functools.lru_cache(maxsize=32)
def _dynamiq_tables(codec: Any) -> dict[str, torch.Tensor]:
    """The reference's own tables of a DynamiQ configuration (``codec.wire()``; contiguous
    CPU tensors; the template that points into them holds them, :func:`_dyn_template`):
    levels and rounding cells, the priorities ``Q``, and the 16 group-scale steps and powers
    of the group scale ``(S * steps[e]) * powers[e]``."""
    wire = codec.wire()
    t = wire.tables
    out = {
        "levels": t.levels,
        "base": t.base,
        "key": t.key,
        "lower": t.lower,
        "gap": t.gap,
        "eyt": _eytzinger_rows(t, codec.rounding != "nearest", None),
        "eyt5": _eytzinger_rows(t, codec.rounding != "nearest", 5),
        "q": torch.tensor(wire.priorities, dtype=torch.int64),
        "steps": wire.group_steps,
        "powers": wire.group_powers,
    }
    dtypes = {"base": torch.int32, "q": torch.int64}
    return {name: v.to(dtypes.get(name, torch.float32)).contiguous() for name, v in out.items()}


def _eytzinger_rows(tables: Any, stretched: bool, depth: int | None) -> torch.Tensor:
    """``[9 * 2^d]`` fp32 (``d = depth``, or 8): for each width ``w >= 1``, the ``2^w - 1``
    ascending thresholds whose count below ``y`` is the level index (nearest: the round-up
    points, the keys of the cell table; stochastic: the levels ``1 .. 2^w - 1``, the level 0
    compared on its own), read from the reference's own tables, as a search tree of ``depth``
    levels (``None``: ``w`` levels; a deeper tree is padded with +inf, which never counts) in
    Eytzinger order (node ``k`` at ``k``, children ``2k`` and ``2k + 1``; ``k = 0`` unused).
    Rows of widths above ``depth`` are left +inf."""
    size = 1 << (depth or 8)
    rows = torch.full((9, size), math.inf, dtype=torch.float32)
    keys_all = tables.key.view(9, -1)
    for w in range(1, 9 if depth is None else depth + 1):
        keys = torch.unique(keys_all[w][torch.isfinite(keys_all[w])])  # sorted
        want = (1 << w) if stretched else (1 << w) - 1
        if keys.numel() != want:  # pragma: no cover - the reference's tables are built so
            raise RuntimeError(f"width {w}: {keys.numel()} rounding keys, not {want}")
        if stretched:
            keys = keys[1:]  # the levels above level 0
        n = (1 << (depth or w)) - 1
        order = iter(keys.tolist() + [math.inf] * (n - keys.numel()))

        def fill(k: int, order: Any = order, w: int = w, n: int = n) -> None:
            if k > n:
                return
            fill(2 * k)
            rows[w, k] = next(order)
            fill(2 * k + 1)

        fill(1)
    return rows.reshape(-1)


@functools.cache
def _mx_format(fmt: ElementFormat) -> dict[str, int]:
    """The element format as the kernel takes it: its integer parameters."""
    return {
        "specials": _SPECIALS[fmt.specials],
        "nmant": fmt.nmant,
        "bias": fmt.bias,
        "bits": fmt.bits,
        "max_code": fmt.max_code,
        "nan_code": fmt.nan_code or 0,
        "inf_code": fmt.inf_code or 0,
        "emax": fmt.emax,
    }


def _f32_bits(x: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


@functools.lru_cache(maxsize=512)
def _pow2_bits(k: int) -> int:
    """The fp32 bits of ``2^k`` (a block format's tensor scale; memoized)."""
    return _f32_bits(2.0**k)


def _check_status(status: int) -> None:
    if status != 0:
        raise MemoryError("the native CPU kernel could not allocate its buffers or threads")


def group_absmax(x: torch.Tensor, group: int) -> torch.Tensor:
    """The largest finite ``|x|`` of each group of ``group`` values of ``x`` (a contiguous 1-D
    CPU tensor of fp32, bf16 or fp16 whose length is a multiple of ``group``), as fp32: NaN
    and ±Inf count as 0 (the pooled DynamiQ codec's prologue statistics,
    ``_dynamiq_pool._finite_absmax``)."""
    _check_device(x)
    _check_values("x", x)
    n = x.numel()
    if group < 1 or n % group:
        raise ValueError(f"{n} values are not whole groups of {group}")
    out = torch.empty(n // group, dtype=torch.float32)
    if n:
        status = _load().dq_dyn_group_absmax(
            x.data_ptr(), _KIND[x.dtype], n, group, out.data_ptr(), _threads(n)
        )
        _check_status(status)
    return out


@functools.cache
def _pool_lib() -> ctypes.CDLL:
    """The library with the pooled prologue's functions declared (``csrc/dynamiq_pool.cpp``)."""
    lib = _load()
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.dq_dyn_pool_levels.argtypes = [p, i32, i64, i64, p, p, p, i64, i32, p, p, p, i32]
    lib.dq_dyn_pool_demand.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, i64, p]
    lib.dq_dyn_pool_distribute.argtypes = [p, p, i64, p, p, i64, p]
    for fn in (lib.dq_dyn_pool_levels, lib.dq_dyn_pool_demand, lib.dq_dyn_pool_distribute):
        fn.restype = ctypes.c_int
    return lib


def pool_levels(
    x: torch.Tensor, group: int, table: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Pass 1 of the pooled prologue's demand (``_dynamiq_pool._native_demand``) over ``x``
    (a contiguous 1-D CPU tensor of fp32, bf16 or fp16) cut into groups of ``group`` from 0,
    the last maybe short: each group's level (int16; ``-32768`` for a finite absmax of 0),
    the histogram of the live groups' levels from ``table["l_min"]`` weighted by their sizes
    (int64), and the largest finite ``|x|``. ``table``: ``_dynamiq_pool.level_table``."""
    _check_device(x)
    _check_values("x", x)
    if group < 1:
        raise ValueError(f"group must be positive (got {group})")
    n = x.numel()
    levels = torch.empty(-(-n // group), dtype=torch.int16)
    all_thr = table["all"]
    hist = torch.empty(all_thr.numel() + 1, dtype=torch.int64)
    top = ctypes.c_uint32(0)
    status = _pool_lib().dq_dyn_pool_levels(
        x.data_ptr(), _KIND[x.dtype], n, group, table["row"].data_ptr(),
        table["base"].data_ptr(), all_thr.data_ptr(), all_thr.numel(), table["l_min"],
        levels.data_ptr(), hist.data_ptr(), ctypes.byref(top), _threads(n),
    )  # fmt: skip
    _check_status(status)
    return levels, hist, struct.unpack("<f", struct.pack("<I", top.value))[0]


def pool_demand(
    levels: torch.Tensor,
    n: int,
    group: int,
    regions: list[tuple[int, int]],
    span: int,
    tau: int,
    count: torch.Tensor,
    q_lo: int,
) -> torch.Tensor:
    """Pass 2: the demand (bits, int64) of every span of ``regions`` (each starting on a
    multiple of ``group``) of the ``n`` values whose group ``levels`` :func:`pool_levels`
    gave, at the water-filling threshold ``tau`` (``count``: ``_priority_tables``' widths)."""
    ok = levels.dtype == torch.int16 and levels.numel() == -(-n // group) and span >= group > 0
    ok = ok and all(0 <= a <= b <= n and a % group == 0 for a, b in regions)
    if not ok or count.numel() < 1 or levels.device.type != "cpu":
        raise ValueError(
            f"pool_demand: {levels.numel()} int16 group levels, regions {list(regions)[:4]}... "
            f"on whole groups of {group} of {n} values, spans of {span} expected"
        )
    bounds = torch.tensor(regions, dtype=torch.int64).reshape(-1)
    count = count.to(torch.int64).contiguous()
    n_spans = sum(-(-(b - a) // span) for a, b in regions)
    out = torch.empty(n_spans, dtype=torch.int64)
    _pool_lib().dq_dyn_pool_demand(
        levels.data_ptr(), n, group, bounds.data_ptr(), len(regions), span, tau,
        count.data_ptr(), count.numel(), q_lo, out.data_ptr(),
    )  # fmt: skip
    return out


def pool_distribute(
    demand: torch.Tensor, lens: torch.Tensor, first: list[int], total: torch.Tensor
) -> torch.Tensor:
    """``_dynamiq_pool._distribute`` (int64 CPU tensors; segment ``s`` holds the spans
    ``first[s]:first[s + 1]``)."""
    demand, lens = demand.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    total = total.to(torch.int64).contiguous()
    n = lens.numel()
    ordered = list(first) == sorted(first)
    if demand.numel() != n or not first or first[0] != 0 or first[-1] != n or not ordered:
        raise ValueError(f"pool_distribute: segment starts {first[:4]}... do not cut {n} spans")
    if total.numel() != len(first) - 1 or bool((total < 0).any() | (demand < 0).any()):
        raise ValueError("pool_distribute: one total a segment, totals and demand >= 0")
    starts = torch.tensor(first, dtype=torch.int64)
    out = torch.empty(lens.numel(), dtype=torch.int64)
    status = _pool_lib().dq_dyn_pool_distribute(
        demand.data_ptr(), lens.data_ptr(), lens.numel(), starts.data_ptr(),
        total.data_ptr(), total.numel(), out.data_ptr(),
    )  # fmt: skip
    _check_status(status)
    return out


def encode(codec: Codec, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
    """``codec.encode(x, ctx)`` by the native CPU kernel (checked here; the dispatcher calls
    the unchecked :func:`kernel`)."""
    _check_device(x)
    _check_values("x", x)
    return kernel(codec, "encode", required=True)(codec, x, ctx)  # type: ignore[misc]


def decode(codec: Codec, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
    """``codec.decode(payload, numel, ctx)`` by the native CPU kernel."""
    _check_device(payload)
    _check_payload(codec, payload, numel, ctx)
    return kernel(codec, "decode", required=True)(codec, payload, numel, ctx)  # type: ignore[misc]


def reduce(
    codec: Codec,
    payload: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
) -> torch.Tensor:
    """``codec.reduce(payload, local, ctx, out_ctx)`` by the native CPU kernel: one pass over
    memory, no fp32 tensor in memory."""
    _check_device(payload, local)
    _check_values("local", local)
    _check_payload(codec, payload, local.numel(), ctx)
    fn = kernel(codec, "reduce", required=True)
    return fn(codec, payload, local, ctx, out_ctx)  # type: ignore[misc]
