"""The plugin's tests need the package installed (its entry point is what they test)."""

from importlib import metadata

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        metadata.distribution("dynamiq-nf4")
    except metadata.PackageNotFoundError:
        raise pytest.UsageError(
            "the example plugin dynamiq-nf4 is not installed: run `make venv` or "
            "`pip install -e examples/dynamiq-nf4` first"
        ) from None
