"""docs/design.md, "Public names": the table lists every public module's ``__all__`` exactly,
with its count, and the totals under it are the code's."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"
ROW = re.compile(r"^\| `(dynamiq[\w.]*)` \| (\d+) \| (.*) \|$")


def _section() -> str:
    text = DOC.read_text()
    start = text.index("### Public names")
    return text[start : text.index("\n## ", start)]


def _rows() -> dict[str, tuple[int, list[str]]]:
    rows = {}
    for line in _section().splitlines():
        m = ROW.match(line)
        if m:
            rows[m[1]] = (int(m[2]), re.findall(r"`([^`]+)`", m[3]))
    return rows


def test_the_table_is_every_modules_all() -> None:
    rows = _rows()
    assert len(rows) >= 10
    for module, (count, names) in rows.items():
        exported = importlib.import_module(module).__all__
        assert sorted(names) == sorted(exported), module
        assert count == len(exported), module


def test_the_totals_are_the_codes() -> None:
    rows = _rows()
    every = set().union(*(set(names) for _, names in rows.values()))
    core = set().union(
        *(
            set(rows[m][1])
            for m in ("dynamiq", "dynamiq.codecs", "dynamiq.collectives", "dynamiq.kernels")
        )
    )
    section = _section()
    assert f"**{len(every)} distinct names in all**" in section
    assert f"`dynamiq.kernels`) have {len(core)}." in section
