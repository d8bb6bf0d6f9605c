"""The plugin's tests need the package installed (its entry point is what they test); they
run under dynamiq's Hypothesis profile named by HYPOTHESIS_PROFILE (unset or empty: ``dev``),
unless ``--hypothesis-profile`` names one (docs/testing.md, "Profiles")."""

from importlib import metadata

import pytest

from dynamiq.testing import load_profile


def pytest_configure(config: pytest.Config) -> None:
    try:
        metadata.distribution("dynamiq-nf4")
    except metadata.PackageNotFoundError:
        raise pytest.UsageError(
            "the example plugin dynamiq-nf4 is not installed: run `make venv` or "
            "`pip install -e examples/dynamiq-nf4` first"
        ) from None
    if not config.getoption("hypothesis_profile", None):
        load_profile(default="dev")
