"""docs/codecs.md's generated table matches the registry."""

from __future__ import annotations

from pathlib import Path

from dynamiq.bench.cli import codec_table, markdown_table
from dynamiq.codecs import get_codec

DOC = Path(__file__).parents[1] / "docs" / "codecs.md"


def test_codec_table_in_docs_is_current() -> None:
    text = DOC.read_text()
    start = text.index("<!-- codec-table:start -->\n") + len("<!-- codec-table:start -->\n")
    end = text.index("\n<!-- codec-table:end -->")
    # the page documents the codecs that ship with dynamiq; installed plugins (such as
    # examples/dynamiq-nf4) add rows to `dynamiq codecs`, not to this page
    rows = [r for r in codec_table() if type(get_codec(r["id"])).__module__.startswith("dynamiq.")]
    assert text[start:end] == markdown_table(rows), (
        "regenerate with: dynamiq codecs --markdown (leaving out the rows of installed plugins)"
    )
