"""The package's docstring examples run (docs/design.md, "House style", item 11)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import dynamiq

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(dynamiq.__path__, "dynamiq.")
    if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        pytest.skip(f"{name} needs Triton")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
