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
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    yield
    patch.undo()
