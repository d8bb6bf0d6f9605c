"""The compiled CPU reference (``DYNAMIQ_CPU_COMPILE=1``): opt-in, fallbacks, bit-exactness.

The dispatch logic is tested with a stand-in for ``torch.compile`` (fast); the real compiler is
tested under ``-m slow`` (it takes minutes on a small machine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import dynamiq.kernels as K
from dynamiq.codecs import HopContext, get_codec
from dynamiq.kernels import _compiled

N = _compiled.MIN_NUMEL + 77


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DYNAMIQ_CPU_COMPILE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # these tests are about the torch.compile path: keep the native kernels out of "auto"
    monkeypatch.setenv("DYNAMIQ_CPU_KERNELS", "0")
    K.set_cpu_kernels(None)  # read the environment now (it is read once otherwise)
    _compiled._CACHE.clear()
    yield
    _compiled.set_cpu_compile(None)
    _compiled._CACHE.clear()


class FakeCompile:
    """Stands in for ``torch.compile``: records what is compiled and calls."""

    def __init__(self, fail: bool = False) -> None:
        self.compiled: list[Any] = []
        self.calls = 0
        self.fail = fail

    def __call__(self, fn: Callable[..., Any], dynamic: bool = False) -> Callable[..., Any]:
        assert dynamic
        self.compiled.append(fn)

        def run(*args: Any) -> Any:
            self.calls += 1
            if self.fail:
                raise RuntimeError("InductorError: no working C++ compiler")
            return fn(*args)

        return run


def _x(n: int = N) -> torch.Tensor:
    return torch.linspace(-3, 3, n)


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    get_codec("int8").encode(_x())
    assert fake.compiled == [] and K.last_backend() == "reference"


@pytest.mark.parametrize("how", ["env", "function"])
def test_opt_in_compiles_each_codec_and_op_once(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    fake = FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    if how == "env":
        monkeypatch.setenv("DYNAMIQ_CPU_COMPILE", "1")
        K.set_cpu_compile(None)  # read the environment now
    else:
        K.set_cpu_compile(True)
    codec = get_codec("int8")
    x = _x()
    p = codec.encode(x)
    assert torch.equal(p, K.encode(codec, x, backend="reference"))  # same path, same bytes
    codec.decode(p, N)
    codec.reduce(p, x)
    codec.encode(x[:-5])
    assert [f.__name__ for f in fake.compiled] == ["_encode", "_decode", "_reduce"]
    assert fake.calls == 5  # the explicit backend="reference" call above is compiled too
    assert K.last_backend() == "reference"


def test_only_large_inputs_of_builtin_context_free_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    K.set_cpu_compile(True)
    get_codec("mxfp4").encode(_x(_compiled.MIN_NUMEL - 1))  # small: plain reference
    stochastic = get_codec({"id": "int", "bits": 4, "rounding": "stochastic"})
    stochastic.encode(_x(), HopContext(seed=3))  # reads the context: plain reference
    assert fake.compiled == []
    get_codec("mxfp4").encode(_x())
    assert len(fake.compiled) == 1


def test_compiler_failure_falls_back_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCompile(fail=True)
    monkeypatch.setattr(torch, "compile", fake)
    K.set_cpu_compile(True)
    codec = get_codec("bf16")
    x = _x()
    want = codec._encode(x, HopContext())
    assert torch.equal(codec.encode(x), want)
    assert torch.equal(codec.encode(x), want)
    assert fake.calls == 1  # not retried


def test_reference_errors_still_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    K.set_cpu_compile(True)
    x = _x()
    x[7] = 2.0**127 * 1.5
    with pytest.raises(ValueError, match="exceeds max_input_abs"):
        get_codec("int8").encode(x)
    assert _compiled._CACHE  # the compiled function is kept


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, importing Inductor
@pytest.mark.parametrize("name", ["int8", "mxfp8_e4m3", "mxfp4", "bf16"])
def test_compiled_reference_is_bit_exact(name: str) -> None:
    """The real ``torch.compile`` (needs a C++ compiler; minutes on a small machine)."""
    codec = get_codec(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g) * torch.exp2(torch.randint(-30, 30, (N,), generator=g).float())
    x[::97] = 0.0
    x[1::101] = 2.0**-140
    x[2::4099] = float("nan")
    x[3::5003] = float("-inf")
    x[4::64] = torch.arange(len(x[4::64])).remainder(16).float() + 0.5  # ties
    local = torch.randn(N, generator=g)
    plain = K.encode(codec, x, backend="reference")
    K.set_cpu_compile(True)
    for inp in (x, x.to(torch.bfloat16)):
        assert torch.equal(codec.encode(inp), K.encode(codec, inp, backend="reference"))
    assert torch.equal(codec.encode(x), plain)
    K.set_cpu_compile(False)
    want_v = codec.decode(plain, N)
    want_r = codec.reduce(plain, local)
    K.set_cpu_compile(True)
    got_v = codec.decode(plain, N)
    assert torch.equal(got_v.isnan(), want_v.isnan())
    assert torch.equal(
        got_v.nan_to_num(0.0).view(torch.int32), want_v.nan_to_num(0.0).view(torch.int32)
    )
    assert torch.equal(codec.reduce(plain, local), want_r)
    assert all(fn is not None for fn in _compiled._CACHE.values()), "fell back to eager"
