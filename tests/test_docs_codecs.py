"""docs/codecs.md's generated table matches the registry."""

from __future__ import annotations

from pathlib import Path

from dynamiq.bench.cli import codec_table, markdown_table

DOC = Path(__file__).parents[1] / "docs" / "codecs.md"


def test_codec_table_in_docs_is_current() -> None:
    text = DOC.read_text()
    start = text.index("<!-- codec-table:start -->\n") + len("<!-- codec-table:start -->\n")
    end = text.index("\n<!-- codec-table:end -->")
    assert text[start:end] == markdown_table(codec_table()), (
        "regenerate with: dynamiq codecs --markdown"
    )
