"""docs/testing.md names every public name of dynamiq.testing and its modules, and counts them
right (its example runs in tests/test_docs_guide.py)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import dynamiq.testing

DOC = Path(__file__).parents[2] / "docs" / "testing.md"


def _public_names() -> tuple[set[str], set[str]]:
    modules = [
        m.name
        for m in pkgutil.iter_modules(dynamiq.testing.__path__, "dynamiq.testing.")
        if not m.name.endswith("__main__")
    ]
    names = set(dynamiq.testing.__all__)
    for name in modules:
        names |= set(importlib.import_module(name).__all__)
    return names, set(dynamiq.testing.__all__)


def test_every_public_name_is_documented() -> None:
    text = DOC.read_text()
    names, _ = _public_names()
    missing = sorted(n for n in names if not re.search(rf"`{re.escape(n)}[`(]", text))
    assert not missing, f"docs/testing.md does not name {missing}"


def test_the_count_is_right() -> None:
    names, exported = _public_names()
    m = re.search(r"(\d+) in all \((\d+) exported by\s+`dynamiq.testing` itself\)", DOC.read_text())
    assert m, "docs/testing.md states no count"
    assert (int(m[1]), int(m[2])) == (len(names), len(exported))
