"""The dispatcher's resolution (``dynamiq/kernels/__init__.py``): kernels declared by the codec
classes (``kernel_family``, ``dynamiq/kernels/_declared.py``), the cache of resolved kernels
and its invalidation, the switches read once, and no kernel import from ``dynamiq.codecs``.

The per-call cost this cache exists for is measured by ``benchmarks/dispatch_overhead.py``
(docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import dynamiq.kernels as K
from dynamiq.codecs import BlockCodec, Codec, HopContext, get_codec, list_codecs
from dynamiq.kernels import _declared, _settings, cpu_native

BUILTIN = [c for c in list_codecs() if type(get_codec(c)).__module__.startswith("dynamiq.")]
NATIVE = cpu_native._compiler() is not None


@pytest.fixture(autouse=True)
def _switches(cpu_switches_cleared: None) -> None:
    """No switch from the environment; the setters reset afterwards."""


def test_importing_the_codecs_imports_no_kernel_module() -> None:
    """``import dynamiq.codecs`` (and ``import dynamiq``) loads no module of
    ``dynamiq.kernels``; the first codec method call does."""
    code = (
        "import sys, dynamiq, dynamiq.codecs\n"
        "print(sorted(m for m in sys.modules if m.startswith('dynamiq.kernels')))\n"
        "import torch\n"
        "dynamiq.get_codec('int8').encode(torch.zeros(8))\n"
        "print('dynamiq.kernels' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split("\n")
    assert out[0] == "[]", out
    assert out[1] == "True", out


_TRITON = importlib.util.find_spec("triton") is not None
_NO_ENV = (
    "import os, torch, dynamiq.kernels as K, dynamiq\n"
    "before = dict(os.environ)\n"
    "try:\n"
    "    K.encode(dynamiq.get_codec('int8'), torch.ones(64), backend='triton')\n"
    "except RuntimeError as e:\n"
    "    print('raised:', e)\n"
    "print(dict(os.environ) == before)\n"
)
_KEEP_MODE = (
    "import os, torch, dynamiq.kernels as K, dynamiq\n"
    "c, x = dynamiq.get_codec('int8'), torch.linspace(-1, 1, 64)\n"
    "a = K.encode(c, x, backend='triton')\n"
    "del os.environ['TRITON_INTERPRET']\n"  # (the caller's change: the mode stays Triton's)
    "before = dict(os.environ)\n"
    "b = K.reduce(c, a, x, backend='triton')\n"
    "print(bool(torch.equal(b, c.reduce(a, x))), dict(os.environ) == before)\n"
)


@pytest.mark.skipif(not _TRITON, reason="Triton is not installed")
def test_the_dispatcher_never_changes_the_environment() -> None:
    """Forcing the Triton backend on CPU tensors without ``TRITON_INTERPRET=1`` is a named
    error, not a change to the environment; with it, Triton's mode is held in its own knob,
    so the caller's later change of the variable changes nothing and nothing is written
    back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _NO_ENV], capture_output=True, text=True, env=env, timeout=300
    )
    assert "raised:" in out.stdout and "set TRITON_INTERPRET=1" in out.stdout, out
    assert out.stdout.strip().endswith("True"), out
    out = subprocess.run(
        [sys.executable, "-c", _KEEP_MODE],
        capture_output=True,
        text=True,
        env={**env, "TRITON_INTERPRET": "1"},
        timeout=300,
    )
    assert out.stdout.split() == ["True", "True"], out


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_codecs_declare_their_kernel_family(name: str) -> None:
    """Every built-in codec class names its family in its own body, and the family is a
    Triton module of the package (the dispatcher reads nothing else: no table of classes)."""
    cls = type(get_codec(name))
    family = vars(cls).get("kernel_family")
    assert family in _declared.FAMILIES, (name, family)
    assert importlib.util.find_spec(f"dynamiq.kernels.{family}") is not None
    assert K.has_kernels(get_codec(name))


def _keeps_reference(cls: type[Codec]) -> type[Codec]:
    """A subclass of ``cls`` that changes nothing (a new id only)."""
    sub = type(f"Same{cls.__name__}", (cls,), {"codec_id": f"test_same_{cls.__name__.lower()}"})
    sub.__annotations__ = {"codec_id": ClassVar[str]}
    return dataclasses.dataclass(frozen=True, kw_only=True)(sub)


@pytest.mark.parametrize("name", BUILTIN)
def test_kernels_belong_to_the_declaring_class(name: str) -> None:
    """A subclass runs on its reference until it declares kernels itself, even one that
    changes nothing; a :class:`BlockCodec` subclass that keeps the reference is declared for
    by its base (the generic kernels compute what the declared data says)."""
    codec = get_codec(name)
    sub = _keeps_reference(type(codec))(**{f.name: getattr(codec, f.name) for f in _fields(codec)})
    inherits = isinstance(codec, BlockCodec)
    assert K.has_kernels(sub) is inherits
    x = torch.linspace(-3, 3, cpu_native.MIN_NUMEL)
    if not inherits:
        with pytest.raises(NotImplementedError, match="no native CPU kernel"):
            K.encode(sub, x, backend="cpu")
    elif NATIVE:
        assert torch.equal(K.encode(sub, x, backend="cpu"), codec._encode(x, HopContext()))


def _fields(codec: Codec) -> tuple[Any, ...]:
    return dataclasses.fields(codec)  # type: ignore[arg-type]


def test_a_subclass_that_overrides_the_reference_declares_nothing() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Changed(BlockCodec):
        codec_id: ClassVar[str] = "test_changed_block"

        def _decode(self, payload: torch.Tensor, numel: int, ctx: HopContext) -> torch.Tensor:
            return super()._decode(payload, numel, ctx) * 2

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Redeclared(Changed):  # ... until it declares a family again
        codec_id: ClassVar[str] = "test_redeclared_block"
        kernel_family: ClassVar[str | None] = "block"

    assert Changed.kernel_family is None and not K.has_kernels(Changed())
    assert K.has_kernels(Redeclared())
    assert _declared.own_family(Codec) is None


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native CPU kernels cannot run")
def test_cached_resolution_follows_the_switches() -> None:
    """The resolved kernel is cached per codec, operation, device and backend; the setters
    invalidate it at once, and each call still reports its backend and counts its launch."""
    codec = get_codec("int8")
    x = torch.linspace(-1, 1, cpu_native.MIN_NUMEL)
    want = codec._encode(x, HopContext())
    for _ in range(2):
        before = K.launch_counts().get("cpu_int_encode", 0)
        assert torch.equal(codec.encode(x), want)
        assert K.last_backend() == "cpu"
        assert K.launch_counts()["cpu_int_encode"] == before + 1
    codec.encode(x[:-1])  # below MIN_NUMEL: the reference, same plan
    assert K.last_backend() == "reference"
    K.set_cpu_kernels(False)
    assert torch.equal(codec.encode(x), want)
    assert K.last_backend() == "reference"
    K.set_cpu_kernels(None)
    codec.encode(x)
    assert K.last_backend() == "cpu"
    # an equal codec (another instance) resolves the same way
    assert torch.equal(get_codec("int8").encode(x), want) and K.last_backend() == "cpu"


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native CPU kernels cannot run")
def test_the_environment_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DYNAMIQ_CPU_KERNELS`` is read at import and by the setters, not per call."""
    codec = get_codec("mxfp4")
    x = torch.linspace(-1, 1, cpu_native.MIN_NUMEL)
    codec.encode(x)
    assert K.last_backend() == "cpu"
    monkeypatch.setenv("DYNAMIQ_CPU_KERNELS", "0")
    codec.encode(x)
    assert K.last_backend() == "cpu"  # not read again yet
    K.set_cpu_kernels(None)  # follow the environment: read it now
    codec.encode(x)
    assert K.last_backend() == "reference"
    assert not _settings.cpu_kernels and not K.cpu_native.cpu_kernels_enabled()


def test_bad_backends_and_arguments_still_raise() -> None:
    """Errors are not cached: each bad call raises, a good one after it runs."""
    codec = get_codec("int8")
    x = torch.zeros(64)
    for _ in range(2):
        with pytest.raises(ValueError, match="backend must be one of"):
            K.encode(codec, x, backend="native")
        with pytest.raises(TypeError, match="x must have dtype"):
            codec.encode(x.double())
        with pytest.raises(ValueError, match="payload has"):
            codec.decode(torch.zeros(3, dtype=torch.uint8), 64)
    assert torch.equal(K.encode(codec, x), codec._encode(x, HopContext()))


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native CPU kernels cannot run")
def test_a_struct_mirror_unlike_the_c_struct_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library reports each argument structure's size and field offsets
    (``csrc/common.h``, ``DQ_LAYOUT``); a ctypes mirror that differs is a ``RuntimeError``
    when the library loads (the kernels then run on the reference, with a warning), never a
    call with misplaced arguments."""
    lib = cpu_native._load()
    cpu_native._check_layouts(lib, Path("lib.so"))  # the real mirrors match
    fields = cpu_native._PTArgs._fields_

    class Short(ctypes.Structure):  # a field missing
        _fields_ = [f for f in fields if f[0] != "out_kind"]

    class Wide(ctypes.Structure):  # a field of the wrong width: the offsets after it move
        _fields_ = [(n, ctypes.c_int64 if n == "in_kind" else t) for n, t in fields]

    for mirror in (Short, Wide):
        monkeypatch.setitem(cpu_native._LAYOUTS, "dq_pt_args", mirror)
        with pytest.raises(RuntimeError, match=f"dq_pt_args .* ctypes mirror {mirror.__name__}"):
            cpu_native._check_layouts(lib, Path("lib.so"))
    monkeypatch.undo()

    class NoBase(ctypes.Structure):  # DynamiQ's: a per-payload offset base missing
        _fields_ = [f for f in cpu_native._DynArgs._fields_ if f[0] != "offset_in_base"]

    monkeypatch.setitem(cpu_native._LAYOUTS, "dq_dyn_args", NoBase)
    with pytest.raises(RuntimeError, match="dq_dyn_args .* ctypes mirror NoBase"):
        cpu_native._check_layouts(lib, Path("lib.so"))


def test_a_packed_field_range_must_be_contiguous() -> None:
    """DynamiQ's per-call fields are written by one ``struct`` pack built from the mirror
    (``cpu_native._packer``): its offsets are the mirror's, and a range with padding inside
    (``dq_int_args``: 4 bytes before ``offset``) is refused, not packed out of place."""
    pack, at = cpu_native._packer(cpu_native._DynArgs, "budget_in_full", "num_hops_f32")
    assert at == cpu_native._DynArgs.budget_in_full.offset
    end = cpu_native._DynArgs.num_hops_f32
    assert at + pack.size == end.offset + end.size
    with pytest.raises(RuntimeError, match="_IntArgs.offset does not follow bits"):
        cpu_native._packer(cpu_native._IntArgs, "bits", "offset")
