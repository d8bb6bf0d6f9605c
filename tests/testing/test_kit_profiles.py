"""Hypothesis profiles (dynamiq/testing/profiles.py): importing the kit never replaces the
caller's, an empty ``HYPOTHESIS_PROFILE`` means the default, the project's suite runs under
``dynamiq-<HYPOTHESIS_PROFILE>``. Each case runs in a fresh interpreter (profiles are
process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[2]

CALLER = """
from hypothesis import given, settings, strategies as st
settings.register_profile("ci", max_examples=7)  # the caller's own, named like Hypothesis'
settings.load_profile("ci")
import dynamiq.testing  # noqa: E402,F401
from dynamiq.testing import run_conformance  # noqa: E402
from dynamiq.testing.profiles import load_profile  # noqa: E402

runs = []

@given(st.integers())
def prop(i):
    runs.append(i)

prop()
load_profile("")  # empty: nothing to load, the caller's stays
print(settings.get_current_profile_name(), settings.default.max_examples, len(runs))
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )


def test_importing_the_kit_keeps_the_callers_profile() -> None:
    """The caller's ``max_examples=7`` stays 7 (it became 20), and their property runs 7
    examples."""
    out = _python(CALLER, HYPOTHESIS_PROFILE="thorough")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ci", "7", "7"]


def test_an_empty_profile_collects_the_project_suite(tmp_path: Path) -> None:
    """Collecting with tests/conftest.py and ``HYPOTHESIS_PROFILE=`` (it crashed): the
    default, ``dynamiq-dev``."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        textwrap.dedent("""
        from hypothesis import settings

        def test_profile():
            print("PROFILE", settings.get_current_profile_name(), settings.default.max_examples)
        """)
    )
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYPOTHESIS_PROFILE": ""}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(probe)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PROFILE dynamiq-dev 20" in out.stdout


LOADS = """
import os
from hypothesis import settings
from dynamiq.testing import load_profile

def show(*args, **kw):
    print(load_profile(*args, **kw), settings.default.max_examples)

for value in ("", "  ", "ci", "thorough"):
    os.environ["HYPOTHESIS_PROFILE"] = value
    show(default="dev")
show("default")
os.environ["HYPOTHESIS_PROFILE"] = ""
show()  # no default: nothing loaded, the current stays
os.environ["HYPOTHESIS_PROFILE"] = "nightly"
try:
    load_profile()
except ValueError as exc:
    print(exc)
"""


def test_load_profile() -> None:
    """Unset or empty: ``default``; ``ci`` is dynamiq's (200 examples), not Hypothesis'; an
    unknown name is named, with the known ones."""
    out = _python(LOADS)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:6] == [
        "dynamiq-dev 20",
        "dynamiq-dev 20",
        "dynamiq-ci 200",
        "dynamiq-thorough 2000",
        "default 100",
        "default 100",
    ]
    assert "unknown Hypothesis profile 'nightly'" in lines[6]
    assert "dev, ci, thorough" in lines[6]
