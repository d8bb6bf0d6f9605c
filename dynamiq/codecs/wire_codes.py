"""The integer codes the kernels take for a scale format and for an element format's specials,
defined once (docs/design.md, "Kernels"): the Triton kernels' meta-parameters
(``dynamiq/kernels/intq.py``, ``_common.py``, ``block.py``), the native kernels' arguments
(``dynamiq/kernels/cpu_native.py``) and the C++ header ``dq_codes.h`` that the native build
generates from this module (:func:`c_header`; ``csrc/`` includes it, and the library reports
what it was compiled with: ``dq_codes``, checked when it loads).

Here, not in ``dynamiq/kernels``: the codecs read the scale formats' sizes, and
``import dynamiq.codecs`` imports no kernel module.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SCALE_FORMATS", "SPECIALS", "ScaleFormat", "c_header", "reported"]


class ScaleFormat(NamedTuple):
    """A scale format of the INT codecs: its code, significant bits ``p``, the exponent of its
    smallest positive value ``gmin``, its bytes, and the bits it stores a NaN as."""

    code: int
    p: int
    gmin: int
    nbytes: int
    nan_bits: int


#: scale format -> its parameters (codes 0, 1, ...: the C++ tables are indexed by them)
SCALE_FORMATS: dict[str, ScaleFormat] = {
    "bf16": ScaleFormat(0, 8, -133, 2, 0x7FC0),
    "fp16": ScaleFormat(1, 11, -24, 2, 0x7E00),
    "fp32": ScaleFormat(2, 24, -149, 4, 0x7FC00000),
    "e8m0": ScaleFormat(3, 1, -127, 1, 0xFF),
}

#: an element format's ``specials`` -> its code (``ElementFormat.specials``; the kernels take
#: these four)
SPECIALS: dict[str, int] = {"ieee": 0, "fn": 1, "none": 2, "int": 3}


def _ordered(table: dict[str, int]) -> list[str]:
    names = sorted(table, key=table.__getitem__)
    if [table[k] for k in names] != list(range(len(names))):
        raise ValueError(f"codes must be 0, 1, ... (got {table})")
    return names


def c_header() -> str:
    """The text of ``dq_codes.h``: an enumerator per code and the scale formats' tables
    indexed by code."""
    scales = _ordered({k: v.code for k, v in SCALE_FORMATS.items()})
    specials = _ordered(SPECIALS)

    def row(field: str, fmt: str = "{}") -> str:
        return ", ".join(fmt.format(getattr(SCALE_FORMATS[k], field)) for k in scales)

    enum_s = ", ".join(f"DQ_SCALE_{k.upper()} = {SCALE_FORMATS[k].code}" for k in scales)
    enum_e = ", ".join(f"DQ_SPEC_{k.upper()} = {SPECIALS[k]}" for k in specials)
    return "\n".join(
        [
            "// Generated from dynamiq/codecs/wire_codes.py when the native library is built",
            "// (dynamiq/kernels/cpu_native.py): edit that module, not this file.",
            "#pragma once",
            "#include <cstdint>",
            f"enum {{ {enum_s}, DQ_SCALE_FORMATS = {len(scales)} }};",
            f"enum {{ {enum_e}, DQ_SPECIALS = {len(specials)} }};",
            "// indexed by a DQ_SCALE_* code: significant bits, exponent of the smallest value,",
            "// bytes, the bits of a NaN",
            f"constexpr int DQ_SCALE_P[DQ_SCALE_FORMATS] = {{{row('p')}}};",
            f"constexpr int DQ_SCALE_GMIN[DQ_SCALE_FORMATS] = {{{row('gmin')}}};",
            f"constexpr int DQ_SCALE_BYTES[DQ_SCALE_FORMATS] = {{{row('nbytes')}}};",
            "constexpr uint32_t DQ_SCALE_NAN[DQ_SCALE_FORMATS] = "
            f"{{{row('nan_bits', '0x{:X}u')}}};",
            "",
        ]
    )


def reported() -> list[int]:
    """What the library's ``dq_codes`` (``csrc/cpu_kernels.cpp``) reports when it was compiled
    from this module: the code of each scale format and of each specials by the names the
    C++ code uses (in this module's order), then each scale format's ``p``, ``gmin``, bytes
    and NaN bits, in code order. A scale format or specials that the C++ code does not name
    makes the lengths differ."""
    out = [f.code for f in SCALE_FORMATS.values()] + list(SPECIALS.values())
    for name in _ordered({k: v.code for k, v in SCALE_FORMATS.items()}):
        f = SCALE_FORMATS[name]
        out += [f.p, f.gmin, f.nbytes, f.nan_bits]
    return out
