"""The scale-format and specials codes are defined once (``dynamiq/codecs/wire_codes.py``): the
native build generates ``dq_codes.h`` from them, the library reports what it was compiled
with and a library that disagrees is refused at load, and no other copy of the tables exists
in the package's Python or C++ sources."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dynamiq.codecs import wire_codes
from dynamiq.kernels import cpu_native

NATIVE = cpu_native._compiler() is not None
ROOT = Path(__file__).resolve().parents[2] / "dynamiq"


def test_the_generated_header_is_the_table() -> None:
    """``dq_codes.h`` read back (its enumerators and code-indexed arrays) is the table."""
    text = wire_codes.c_header()
    enums = {k: int(v) for k, v in re.findall(r"\b(DQ_\w+) = (-?\d+)", text)}
    for name, f in wire_codes.SCALE_FORMATS.items():
        assert enums[f"DQ_SCALE_{name.upper()}"] == f.code
    for name, code in wire_codes.SPECIALS.items():
        assert enums[f"DQ_SPEC_{name.upper()}"] == code
    assert enums["DQ_SCALE_FORMATS"] == len(wire_codes.SCALE_FORMATS)
    arrays = {
        k: [int(v, 0) for v in re.findall(r"-?(?:0x[0-9A-F]+|\d+)", body)]
        for k, body in re.findall(r"(DQ_SCALE_\w+)\[DQ_SCALE_FORMATS\] = \{([^}]*)\}", text)
    }
    by_code = sorted(wire_codes.SCALE_FORMATS.values(), key=lambda f: f.code)
    assert arrays["DQ_SCALE_P"] == [f.p for f in by_code]
    assert arrays["DQ_SCALE_GMIN"] == [f.gmin for f in by_code]
    assert arrays["DQ_SCALE_BYTES"] == [f.nbytes for f in by_code]
    assert arrays["DQ_SCALE_NAN"] == [f.nan_bits for f in by_code]


def test_codes_must_count_from_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ tables are indexed by code: a gap is refused when the header is generated."""
    monkeypatch.setitem(wire_codes.SPECIALS, "int", 5)
    with pytest.raises(ValueError, match="codes must be 0, 1"):
        wire_codes.c_header()


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native CPU kernels cannot run")
def test_a_library_of_other_codes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded library reports the table's codes; against another table (two scale codes
    swapped, a specials the C++ code does not name) it is a ``RuntimeError`` naming the file,
    and the cached library's name changes with the table (a library built from another
    table is never picked up)."""
    lib = cpu_native._load()
    path = cpu_native.library_path()
    cpu_native._check_codes(lib, path)
    bf16, fp16 = wire_codes.SCALE_FORMATS["bf16"], wire_codes.SCALE_FORMATS["fp16"]
    monkeypatch.setitem(wire_codes.SCALE_FORMATS, "bf16", bf16._replace(code=fp16.code))
    monkeypatch.setitem(wire_codes.SCALE_FORMATS, "fp16", fp16._replace(code=bf16.code))
    assert cpu_native.library_path() != path
    with pytest.raises(RuntimeError, match="not those of dynamiq/codecs/wire_codes.py"):
        cpu_native._check_codes(lib, path)
    monkeypatch.undo()
    monkeypatch.setitem(wire_codes.SPECIALS, "fnu", 4)
    with pytest.raises(RuntimeError, match="compiled with the scale-format and specials codes"):
        cpu_native._check_codes(lib, path)


def test_no_other_copy_of_the_codes() -> None:
    """No Python module of the package spells a code table out again (``"e8m0": 3``,
    ``"int": 3``), and no C++ source compares a scale format or defines a specials code with
    a number instead of the generated names."""
    py = re.compile(r"""["'](?:e8m0|ieee|fn)["']\s*:\s*\(?\d""")  # (not "fp32": value kinds)
    for path in ROOT.rglob("*.py"):
        if path.name != "wire_codes.py":
            assert not py.search(path.read_text(encoding="utf-8")), path
    cpp = re.compile(r"\bfmt\s*[=!]=\s*\d|\bSPEC_\w+\s*=\s*\d|FMT_(?:P|GMIN|BYTES|NAN)\b")
    for path in (ROOT / "kernels" / "csrc").iterdir():
        assert not cpp.search(path.read_text(encoding="utf-8")), path


def test_the_triton_functions_compare_named_codes() -> None:
    """The Triton JIT functions compare a specials or scale-format meta-parameter with the
    constexpr names derived from the table, never a number (``SPECIALS == 3``), and those
    names hold the table's codes."""
    from dynamiq.kernels import _common, intq

    literal = re.compile(r"\b(?:E_|S_)?(?:SPECIALS|FMT)\s*[=!]=\s*\d")
    for path in (ROOT / "kernels").glob("*.py"):
        assert not literal.search(path.read_text(encoding="utf-8")), path
    for name in ("ieee", "fn", "int"):
        assert getattr(_common, f"SPEC_{name.upper()}").value == wire_codes.SPECIALS[name]
    for name, f in wire_codes.SCALE_FORMATS.items():
        assert getattr(intq, f"FMT_{name.upper()}").value == f.code
