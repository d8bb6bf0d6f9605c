"""Fixtures of the kernel tests (the harness itself is ``kernel_harness.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[None]:
    """Keep ``TRITON_INTERPRET=1`` while a Triton kernel test module runs on a machine without
    CUDA (Triton imports parts of itself lazily and checks the mode then); the rest of the
    suite runs without it. Modules opt in with ``pytest.mark.usefixtures``."""
    if torch.cuda.is_available():
        yield
        return
    from dynamiq.kernels import _settings

    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    _settings.refresh()  # (the dispatcher reads it once otherwise)
    yield
    patch.undo()
    _settings.refresh()


@pytest.fixture
def cpu_switches_cleared(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ``DYNAMIQ_CPU_KERNELS``, ``DYNAMIQ_CPU_COMPILE`` or ``TRITON_INTERPRET`` from the
    environment during a native CPU kernel test, and the programmatic switches reset after
    it."""
    from dynamiq.kernels import _compiled, _settings, cpu_native

    for name in ("DYNAMIQ_CPU_KERNELS", "DYNAMIQ_CPU_COMPILE", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    _settings.refresh()  # (read once otherwise)
    yield
    cpu_native.set_cpu_kernels(None)
    _compiled.set_cpu_compile(None)
