"""Shared pytest set-up: the Hypothesis profile from HYPOTHESIS_PROFILE (unset or empty:
``dev``; ``--hypothesis-profile`` wins), and a temporary directory for the subprocesses the
tests start."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import settings

from dynamiq.testing.profiles import load_profile


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("hypothesis_profile", None):
        load_profile(default="dev")


@pytest.fixture(scope="session", autouse=True)
def _children_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``TMPDIR`` of every subprocess a test starts: a directory under pytest's own temporary
    directory (which pytest prunes), so that what torchrun leaves behind
    (``torchelastic_*`` directories, six a run) does not pile up in /tmp. This process keeps
    its own temporary directory (Inductor's and Triton's caches stay warm)."""
    tempfile.tempdir = tempfile.gettempdir()
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("children"))
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(autouse=True)
def _kernel_switches_follow_the_environment() -> Iterator[None]:
    """The dispatcher reads ``DYNAMIQ_CPU_KERNELS``, ``DYNAMIQ_CPU_COMPILE`` and
    ``TRITON_INTERPRET`` once (``dynamiq/kernels/_settings.py``): read them again before each
    test (after the fixtures that set them) and after it (``monkeypatch`` has restored them).
    A test that changes one mid-way calls ``_settings.refresh()`` itself."""
    settings_module = sys.modules.get("dynamiq.kernels._settings")
    if settings_module is not None:
        settings_module.refresh()
    yield
    settings_module = sys.modules.get("dynamiq.kernels._settings")
    if settings_module is not None:
        settings_module.refresh()


@pytest.fixture
def quarter_examples() -> Iterator[None]:
    """The test runs under a quarter of the profile's Hypothesis examples (at least 10): for
    the conformance kit over frozen variants of a codec whose default configuration runs the
    kit at the full count (`dev` 5, `ci` 50, `thorough` 500). The profile in force is restored
    afterwards."""
    before = settings.get_current_profile_name()
    n = max(10, settings.default.max_examples // 4)
    settings.register_profile("dynamiq-tests-quarter", parent=settings.default, max_examples=n)
    settings.load_profile("dynamiq-tests-quarter")
    try:
        yield
    finally:
        settings.load_profile(before)
