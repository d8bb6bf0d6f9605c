"""Keep docs/formats.md honest: every value list, table and worked example in it is re-checked.

The doc marks what is machine-checked:

* fenced blocks whose info string is ``values FMT`` (every non-negative code of a 4/6-bit
  format), ``grid FMT`` (every non-negative code of an 8-bit float, E rows x M columns),
  ``codes FMT`` (selected codes), ``encode FMT`` (``ElementFormat.encode`` cases), ``pack BITS``
  (``pack_bits`` examples), ``payload CODEC`` (codec payloads) and ``hash``;
* markdown tables preceded by ``<!-- finfo FMT -->`` or ``<!-- table NAME -->``.

Inside fenced blocks ``#`` starts a comment. Values are compared with
``ElementFormat.decode_table()`` *and* with ``ml_dtypes``; payload bytes with
``get_codec(...).encode`` *and* with an independent NumPy/``ml_dtypes`` recomputation of the
wire format the doc describes.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hash_reference import ref_hash, ref_keys

from dynamiq.codecs import HopContext, MXCodec, get_codec, list_codecs
from dynamiq.codecs.formats import ELEMENT_FORMATS
from dynamiq.codecs.hashing import hash_keys, hash_u32, uniform_open01
from dynamiq.codecs.packing import pack_bits, packed_nbytes, unpack_bits

DOC = Path(__file__).parents[1] / "docs" / "formats.md"

SUB_BYTE = ("float4_e2m1fn", "float6_e3m2fn", "float6_e2m3fn")
GRID = ("float8_e4m3fn", "float8_e5m2")
#: fences that are prose, not checked (any other tag must be one the tests know)
PLAIN_FENCES = frozenset({"text", "python", "pycon", "bash", "console", "json", "toml"})
#: every registered MX codec: formats.md documents each (a payload example, a table row)
MX_CODECS = tuple(n for n in list_codecs() if isinstance(get_codec(n), MXCodec))


# -- parsing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    kind: str
    arg: str
    lineno: int
    lines: tuple[str, ...]  # comment-stripped, non-blank
    raw: tuple[str, ...]  # as written (comments kept)

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.arg or 'x'}-L{self.lineno}"

    def fields(self) -> dict[str, str]:
        """``key: value`` lines (payload, pack and hash blocks)."""
        out: dict[str, str] = {}
        for line in self.lines:
            key, sep, value = line.partition(":")
            assert sep, f"{self.id}: expected 'key: value', got {line!r}"
            assert key.strip() not in out, f"{self.id}: duplicate key {key!r}"
            out[key.strip()] = value.strip()
        return out


@functools.cache
def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


@functools.cache
def blocks() -> tuple[Block, ...]:
    out: list[Block] = []
    lines = doc_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w+)(?:[ \t]+(\S+))?[ \t]*$", lines[i])
        if not lines[i].startswith("```"):
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"docs/formats.md:{start + 1}: unterminated fence"
        i += 1
        if m is None or m.group(1) in PLAIN_FENCES:
            continue
        stripped = tuple(s for s in (b.split("#", 1)[0].strip() for b in body) if s)
        out.append(Block(m.group(1), m.group(2) or "", start + 1, stripped, tuple(body)))
    return tuple(out)


def blocks_of(kind: str) -> list[Block]:
    return [b for b in blocks() if b.kind == kind]


def params(kind: str) -> list:
    return [pytest.param(b, id=b.id) for b in blocks_of(kind)]


@functools.cache
def tables() -> dict[str, list[dict[str, str]]]:
    """Markdown tables after ``<!-- finfo X -->`` / ``<!-- table X -->`` markers."""
    out: dict[str, list[dict[str, str]]] = {}
    lines = doc_text().splitlines()
    for n, line in enumerate(lines):
        m = re.match(r"^<!--\s*(finfo|table)\s+(\S+)\s*-->\s*$", line)
        if not m:
            continue
        key = f"{m.group(1)} {m.group(2)}"
        assert key not in out, f"duplicate marker {key!r}"
        rows = []
        j = n + 1
        while j < len(lines) and lines[j].startswith("|"):
            rows.append(
                [c.strip().strip("`").strip() for c in lines[j].strip().strip("|").split("|")]
            )
            j += 1
        assert len(rows) >= 3, f"docs/formats.md:{n + 1}: marker {key!r} not followed by a table"
        header, body = rows[0], rows[2:]
        out[key] = [dict(zip(header, r, strict=True)) for r in body]
    return out


def number(token: str) -> float:
    """A number as the doc writes it: ``448``, ``0.015625``, ``NaN``, ``-inf``, ``2^-6``."""
    token = token.strip()
    m = re.fullmatch(r"(-?)2\^(-?\d+)", token)
    if m:
        return (-1.0 if m.group(1) else 1.0) * 2.0 ** int(m.group(2))
    return float(token)


def number_list(text: str) -> list[float]:
    text = text.strip()
    assert text.startswith("[") and text.endswith("]"), text
    inner = text[1:-1].strip()
    return [number(t) for t in inner.split(",")] if inner else []


def hex_bytes(text: str) -> bytes:
    return bytes(int(t, 16) for t in text.replace("|", " ").split())


def same(a: float, b: float) -> bool:
    """Equal as fp32 values, NaN equal to NaN, signed zeros distinguished."""
    a32, b32 = np.float32(a), np.float32(b)
    if np.isnan(a32) or np.isnan(b32):
        return bool(np.isnan(a32) and np.isnan(b32))
    return bool(a32 == b32 and np.signbit(a32) == np.signbit(b32))


def ml_value(name: str, code: int) -> float:
    """The value of ``code`` according to ml_dtypes (or NumPy for MXINT8's int8)."""
    if name == "int8":
        return float(np.array([code], np.uint8).view(np.int8)[0]) * 2.0**-6
    return float(np.array([code], np.uint8).view(getattr(ml_dtypes, name))[0])


def fmt_bits(f, code: int) -> str:
    return format(code, f"0{f.bits}b")


# -- completeness ------------------------------------------------------------------------------


def test_doc_has_every_section() -> None:
    kinds = {(b.kind, b.arg) for b in blocks()}
    for name in SUB_BYTE:
        assert ("values", name) in kinds, name
    for name in GRID:
        assert ("grid", name) in kinds, name
    assert ("codes", "float8_e8m0fnu") in kinds and ("codes", "int8") in kinds
    for name in ELEMENT_FORMATS:
        assert ("encode", name) in kinds, name
        assert f"finfo {name}" in tables(), name
    assert ("pack", "4") in kinds and ("pack", "6") in kinds
    assert blocks_of("hash"), "hash example missing"
    codecs = {get_codec(b.arg).codec_id for b in blocks_of("payload")}
    assert set(MX_CODECS) | {"fp32", "bf16", "fp16", "int"} <= codecs
    for key in ("table passthrough", "table int-bits-per-value", "table mx"):
        assert key in tables(), key
    known = {"values", "grid", "codes", "encode", "pack", "payload", "hash"}
    assert {b.kind for b in blocks()} <= known, {b.kind for b in blocks()} - known


# -- element formats ---------------------------------------------------------------------------


def parse_code_lines(block: Block) -> dict[int, float]:
    f = ELEMENT_FORMATS[block.arg]
    out: dict[int, float] = {}
    for line in block.lines:
        code_s, bits_s, value_s = line.split()
        code = int(code_s, 16)
        assert bits_s.replace(".", "") == fmt_bits(f, code), f"{block.id}: {line!r}"
        assert code not in out, f"{block.id}: code 0x{code:02x} listed twice"
        out[code] = number(value_s)
    return out


def check_codes(name: str, listed: dict[int, float], where: str) -> None:
    table = ELEMENT_FORMATS[name].decode_table()
    for code, value in listed.items():
        assert same(value, float(table[code])), f"{where}: 0x{code:02x} is {float(table[code])!r}"
        assert same(value, ml_value(name, code)), f"{where}: 0x{code:02x} per ml_dtypes"


@pytest.mark.parametrize("block", params("values"))
def test_values_block_lists_every_nonnegative_code(block: Block) -> None:
    f = ELEMENT_FORMATS[block.arg]
    listed = parse_code_lines(block)
    assert sorted(listed) == list(range(1 << (f.bits - 1))), f"{block.id}: incomplete"
    check_codes(block.arg, listed, block.id)
    # the negative half is the positive half with the sign bit set
    table = f.decode_table()
    for code in listed:
        assert same(-float(table[code]), float(table[code | 1 << (f.bits - 1)]))


@pytest.mark.parametrize("block", params("grid"))
def test_grid_block_lists_every_nonnegative_code(block: Block) -> None:
    f = ELEMENT_FORMATS[block.arg]
    listed: dict[int, float] = {}
    for line in block.lines:
        tokens = line.split()
        e = int(tokens[0], 2)
        assert len(tokens[0]) == f.nexp, f"{block.id}: {line!r}"
        expected_label = "(sub)" if e == 0 else f"2^{e - f.bias}"
        assert tokens[1] == expected_label, f"{block.id}: {line!r}"
        assert len(tokens) == 2 + (1 << f.nmant), f"{block.id}: {line!r}"
        for m, tok in enumerate(tokens[2:]):
            listed[(e << f.nmant) | m] = number(tok)
    assert sorted(listed) == list(range(1 << (f.bits - 1))), f"{block.id}: incomplete"
    check_codes(block.arg, listed, block.id)


@pytest.mark.parametrize("block", params("codes"))
def test_codes_block(block: Block) -> None:
    check_codes(block.arg, parse_code_lines(block), block.id)


@pytest.mark.parametrize("name", list(ELEMENT_FORMATS))
def test_finfo_table(name: str) -> None:
    f = ELEMENT_FORMATS[name]
    rows = {r["field"]: r["value"].split()[0] for r in tables()[f"finfo {name}"]}
    expected = {
        "bits": f.bits,
        "nexp": f.nexp,
        "nmant": f.nmant,
        "bias": f.bias,
        "max": f.max,
        "tiny": f.tiny,
        "smallest_subnormal": f.smallest_subnormal,
        "eps": f.eps,
        "emax": f.emax,
    }
    assert set(rows) == set(expected), name
    for key, value in expected.items():
        assert number(rows[key]) == value, f"finfo {name}: {key} is {value!r}"
    if name == "int8":
        assert number(rows["max"]) == 127 / 64 and number(rows["tiny"]) == 2.0**-6
        return
    fi = ml_dtypes.finfo(getattr(ml_dtypes, name))
    assert number(rows["bits"]) == fi.bits
    assert number(rows["nexp"]) == fi.nexp and number(rows["nmant"]) == fi.nmant
    assert number(rows["max"]) == float(fi.max)
    assert number(rows["tiny"]) == float(fi.smallest_normal)
    assert number(rows["smallest_subnormal"]) == float(fi.smallest_subnormal)
    assert number(rows["eps"]) == float(fi.eps)
    assert number(rows["emax"]) == fi.maxexp - 1


def ml_cast_code(name: str, x: float) -> int:
    """The code ml_dtypes' cast (no saturation) gives; NumPy RNE + clamp for int8."""
    if name == "int8":
        if math.isnan(x):
            return 0
        q = int(np.clip(np.round(np.float64(np.float32(x)) * 64.0), -127, 127))
        return q & 0xFF
    with np.errstate(all="ignore"):
        arr = np.array([x], np.float32).astype(getattr(ml_dtypes, name))
    return int(arr.view(np.uint8)[0])


@pytest.mark.parametrize("block", params("encode"))
def test_encode_block(block: Block) -> None:
    f = ELEMENT_FORMATS[block.arg]
    table = f.decode_table()
    assert block.lines, block.id
    for raw in block.raw:
        line, _, note = raw.partition("#")
        if not line.strip():
            continue
        x_s, sat_s, sat_v, nosat_s, nosat_v = line.split()
        x = number(x_s)
        xt = torch.tensor([x], dtype=torch.float32)
        sat, nosat = int(sat_s, 16), int(nosat_s, 16)
        got_sat = int(f.encode(xt, saturate=True)[0])
        got_nosat = int(f.encode(xt, saturate=False)[0])
        assert sat == got_sat, f"{block.id}: encode({x_s}) is 0x{got_sat:02x}"
        assert nosat == got_nosat, f"{block.id}: encode({x_s}, saturate=False) is 0x{got_nosat:02x}"
        assert same(number(sat_v), float(table[sat])), f"{block.id}: value of {sat_s}"
        assert same(number(nosat_v), float(table[nosat])), f"{block.id}: value of {nosat_s}"
        if "differs from ml_dtypes" in note:
            assert ml_cast_code(block.arg, x) != nosat, f"{block.id}: {x_s} no longer differs"
            continue
        ref = ml_value(block.arg, ml_cast_code(block.arg, x))
        # NaN payloads and the sign of a NaN turned into zero are not part of the format
        ok = (math.isnan(ref) and math.isnan(table[nosat])) or ref == float(table[nosat])
        assert ok, f"{block.id}: ml_dtypes casts {x_s} to {ref!r}"


# -- packing -----------------------------------------------------------------------------------


def ref_pack(codes: list[int], bits: int) -> bytes:
    """The doc's definition: the integer sum(code[i] << (i*b)) written little-endian."""
    word = sum((c & ((1 << bits) - 1)) << (i * bits) for i, c in enumerate(codes))
    return word.to_bytes((len(codes) * bits + 7) // 8, "little")


def ref_unpack(data: bytes, bits: int, n: int) -> list[int]:
    word = int.from_bytes(data, "little")
    return [(word >> (i * bits)) & ((1 << bits) - 1) for i in range(n)]


@pytest.mark.parametrize("block", params("pack"))
def test_pack_block(block: Block) -> None:
    bits = int(block.arg)
    fields = block.fields()
    codes = [int(t, 16) for t in fields["codes"].split()]
    expected = hex_bytes(fields["hex"])
    got = pack_bits(torch.tensor(codes, dtype=torch.uint8), bits).numpy().tobytes()
    assert got == expected, f"{block.id}: pack_bits gives {got.hex(' ')}"
    assert ref_pack(codes, bits) == expected, f"{block.id}: not the documented bit order"
    assert len(expected) == packed_nbytes(len(codes), bits)
    back = unpack_bits(torch.frombuffer(bytearray(expected), dtype=torch.uint8), bits, len(codes))
    assert back.tolist() == codes


# -- hash --------------------------------------------------------------------------------------


def ref_uniform(h: int) -> float:
    return (2 * (h >> 9) + 1) * 2.0**-24


@pytest.mark.parametrize("block", params("hash"))
def test_hash_block(block: Block) -> None:
    fields = block.fields()
    seed, step, hop, rank = (int(fields[k]) for k in ("seed", "step", "hop", "rank"))
    keys = tuple(int(t, 16) for t in fields["keys"].split())
    assert keys == hash_keys(seed, step, hop, rank) == ref_keys(seed, step, hop, rank)
    index = [int(t) for t in fields["index"].split()]
    u32 = [int(t, 16) for t in fields["u32"].split()]
    u = [number(t) for t in fields["u"].split()]
    got = hash_u32(torch.tensor(index, dtype=torch.int64), hash_keys(seed, step, hop, rank))
    assert got.tolist() == u32 == [ref_hash(i, keys) for i in index]
    assert uniform_open01(got).tolist() == u == [ref_uniform(h) for h in u32]


# -- tables ------------------------------------------------------------------------------------


def eval_nbytes(formula: str, n: int) -> int:
    assert re.fullmatch(r"[\sceil()n+*/\d]+", formula), formula
    return eval(formula, {"__builtins__": {}}, {"ceil": math.ceil, "n": n})


SIZES = (0, 1, 2, 3, 7, 31, 32, 33, 64, 100, 1000, 4097)


def test_passthrough_table() -> None:
    rows = tables()["table passthrough"]
    assert {r["codec"] for r in rows} == {"fp32", "bf16", "fp16"}
    for r in rows:
        c = get_codec(r["codec"])
        assert int(r["bytes/value"]) == c.encoded_nbytes(1)
        assert number(r["bits/value"]) == c.bits_per_value()
        for n in SIZES:
            assert eval_nbytes(r["encoded_nbytes(n)"], n) == c.encoded_nbytes(n)


def test_int_bits_per_value_table() -> None:
    rows = tables()["table int-bits-per-value"]
    assert [r["codec"] for r in rows] == [f"int{b}" for b in range(2, 9)]
    for r in rows:
        for scale_format in ("bf16", "fp16", "fp32", "e8m0"):
            c = get_codec({"id": r["codec"], "scale_format": scale_format})
            assert number(r[scale_format]) == c.bits_per_value(), (r["codec"], scale_format)
            s = {"bf16": 2, "fp16": 2, "fp32": 4, "e8m0": 1}[scale_format]
            for n in SIZES:  # the documented formula
                assert c.encoded_nbytes(n) == -(-n // 32) * s + -(-n * c.bits // 8)


def test_mx_table() -> None:
    rows = tables()["table mx"]
    assert sorted(r["codec"] for r in rows) == sorted(MX_CODECS)  # each once, any order
    for r in rows:
        c = get_codec(r["codec"])
        assert r["element"] == c.element.name
        assert int(r["element bits"]) == c.element.bits
        assert int(r["emax"]) == c.element.emax
        assert number(r["bits/value"]) == c.bits_per_value()
        for n in SIZES:
            assert eval_nbytes(r["encoded_nbytes(n)"], n) == c.encoded_nbytes(n)


# -- payloads ----------------------------------------------------------------------------------


def code_bits(codec) -> int | None:
    element = getattr(codec, "elem", None) or getattr(codec, "element", None)
    if element is not None:
        return element.bits
    return getattr(codec, "bits", None)


def to_signed(code: int, bits: int) -> int:
    return code - (1 << bits) if code >= 1 << (bits - 1) else code


def oracle_passthrough(codec_id: str, x: np.ndarray) -> bytes:
    if codec_id == "fp32":
        return x.astype("<f4").tobytes()
    dtype = np.dtype("<f2") if codec_id == "fp16" else np.dtype(ml_dtypes.bfloat16)
    big = float(ml_dtypes.finfo(dtype).max)
    y = np.where(np.isinf(x), x, np.clip(x, -big, big))
    return y.astype(dtype).tobytes()


def oracle_mx(codec, x: np.ndarray, data: bytes) -> list[float]:
    """Recompute an MX payload from the OCP rule with ml_dtypes; returns its decoded values."""
    f = codec.element
    n = x.size
    nb = -(-n // 32)
    codes = ref_unpack(data[nb:], f.bits, n)
    out = []
    for i in range(n):
        blk = x[i // 32 * 32 : i // 32 * 32 + 32].astype(np.float64)
        amax = float(np.abs(blk).max())
        scale = data[i // 32]
        if not math.isfinite(amax):
            assert scale == 0xFF and codes[i] == 0, f"NaN block {i // 32}"
            out.append(math.nan)
            continue
        shared = -127 if amax == 0 else math.frexp(amax)[1] - 1 - f.emax
        shared = max(-127, min(127, shared))
        assert scale == shared + 127, f"scale byte of block {i // 32}"
        v = math.ldexp(float(x[i]), -shared)
        v = max(-f.max, min(f.max, v))  # saturation
        if f.name == "int8":
            want = int(np.round(v * 64)) & 0xFF
        else:
            with np.errstate(all="ignore"):
                want = int(np.array([v]).astype(getattr(ml_dtypes, f.name)).view(np.uint8)[0])
        assert codes[i] == want, f"element {i}: code 0x{codes[i]:02x}, expected 0x{want:02x}"
        out.append(ml_value(f.name, codes[i]) * 2.0**shared)
    return out


def oracle_block(codec, x: np.ndarray, data: bytes, ctx: HopContext) -> list[float]:
    """Recompute a block-format payload (rule "nearest", docs/formats.md) with ml_dtypes;
    returns its decoded values."""
    fe, fs = codec.elem, codec.scale_fmt
    n, bs = x.size, codec.block_size
    head = 4 if codec.tensor_scale and n else 0
    shared = ctx.shared or {}
    if "block.tensor_amax" in shared:
        a = float(np.array([shared["block.tensor_amax"]], np.int32).view(np.float32)[0])
        c = ctx.contributions
    else:
        fin = x[np.isfinite(x)]
        a, c = (float(np.abs(fin).max()) if fin.size else 0.0), 1
    top = math.floor(math.log2(fe.max * fs.max))
    e = math.frexp(a)[1] - 1 if a > 0 else -150
    k = min(max(e + 1 + math.ceil(math.log2(c)) - top, -117), 127 - top - 1)
    g = 2.0**k if head else 1.0
    if head:
        assert np.frombuffer(data[:4], "<f4")[0] == g, "tensor scale"
    nb = -(-n // bs)
    codes = ref_unpack(data[head + nb :], fe.bits, n)
    out = []
    for j in range(nb):
        blk = x[j * bs : (j + 1) * bs]
        code = data[head + j]
        if not np.isfinite(blk).all():
            assert code == fs.nan_code, f"block {j}: NaN scale expected"
            out += [math.nan] * blk.size
            continue
        t = np.float32(np.abs(blk).max()) / np.float32(fe.max * g)
        s8 = np.array([min(t, fs.max)], np.float32).astype(getattr(ml_dtypes, fs.name))
        assert code == int(s8.view(np.uint8)[0]), f"block {j}: scale byte 0x{code:02x}"
        S = float(s8.astype(np.float64)[0]) * g
        for i in range(j * bs, j * bs + blk.size):
            q = np.float32(x[i]) / np.float32(S) if S > 0 else np.float32(0)
            q = np.clip(q, -fe.max, fe.max)
            want = int(np.array([q]).astype(getattr(ml_dtypes, fe.name)).view(np.uint8)[0])
            assert codes[i] == want, f"element {i}: code 0x{codes[i]:x}, expected 0x{want:x}"
            out.append(ml_value(fe.name, codes[i]) * S)
    return out


def scale_array(fmt: str, raw: bytes) -> np.ndarray:
    dtype = {
        "bf16": np.dtype(ml_dtypes.bfloat16),
        "fp16": np.dtype("<f2"),
        "fp32": np.dtype("<f4"),
        "e8m0": np.dtype(ml_dtypes.float8_e8m0fnu),
    }[fmt]
    return np.frombuffer(raw, dtype=dtype).astype(np.float64)


def next_down(fmt: str, s: float) -> float | None:
    """The scale format's value just below ``s`` > 0 (None at the smallest one)."""
    if fmt == "e8m0":
        return None if s <= 2.0**-127 else s / 2
    dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[fmt]
    word = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}[fmt]
    bits = np.array([s], dtype=dtype).view(word)
    return float((bits - 1).view(dtype)[0]) if bits[0] > 0 else None


def oracle_int(codec, x: np.ndarray, data: bytes, ctx: HopContext) -> list[float]:
    """Recompute an int payload from the documented rule; returns its decoded values."""
    n, b, bs = x.size, codec.bits, codec.block_size
    qmax = (1 << (b - 1)) - 1
    nb = -(-n // bs)
    sbytes = {"bf16": 2, "fp16": 2, "fp32": 4, "e8m0": 1}[codec.scale_format]
    scales = scale_array(codec.scale_format, data[: nb * sbytes])
    codes = [to_signed(c, b) for c in ref_unpack(data[nb * sbytes :], b, n)]
    keys = ref_keys(ctx.seed, ctx.step, ctx.hop, ctx.rank)
    out = []
    for k in range(nb):
        blk = x[k * bs : (k + 1) * bs]
        s = float(scales[k])
        amax = float(np.abs(blk.astype(np.float64)).max())
        if not math.isfinite(amax):
            assert math.isnan(s), f"block {k}: NaN scale expected"
            assert all(c == 0 for c in codes[k * bs : (k + 1) * bs])
            out += [math.nan] * blk.size
            continue
        if amax == 0:
            assert s == (2.0**-127 if codec.scale_format == "e8m0" else 0.0), f"block {k}"
        else:
            assert s * qmax >= amax, f"block {k}: scale {s!r} too small"
            below = next_down(codec.scale_format, s)
            assert below is None or below * qmax < amax, f"block {k}: scale {s!r} not minimal"
        for j, v in enumerate(blk):
            i = k * bs + j
            q = np.float32(v) / np.float32(s) if s > 0 else np.float32(0)
            if codec.rounding == "nearest":
                want = int(np.round(q))
            else:
                u = np.float32(ref_uniform(ref_hash(ctx.offset + i, keys)))
                fl = np.floor(q)
                want = int(fl) + int(u < q - fl)
            assert codes[i] == want, f"element {i}: code {codes[i]}, expected {want}"
            out.append(float(np.float32(codes[i]) * np.float32(s)))
    return out


@pytest.mark.parametrize("block", params("payload"))
def test_payload_block(block: Block) -> None:
    fields = block.fields()
    assert {"input", "hex", "nbytes", "decoded"} <= set(fields), block.id
    config = json.loads(fields.get("config", "{}"))
    codec = get_codec({"id": block.arg, **config})
    ctx = HopContext(**json.loads(fields["ctx"])) if "ctx" in fields else HopContext()
    values = number_list(fields["input"])
    n = len(values)
    x = torch.tensor(values, dtype=torch.float32)
    expected = hex_bytes(fields["hex"])

    # the bytes are what the codec writes, and their size is encoded_nbytes(n)
    got = codec.encode(x, ctx).numpy().tobytes()
    assert got == expected, f"{block.id}: encode gives\n  {got.hex(' ')}"
    assert len(expected) == int(fields["nbytes"]) == codec.encoded_nbytes(n), block.id

    # scale section | codes section, and the listed codes
    bits = code_bits(codec)
    if "|" in fields["hex"]:
        assert bits is not None, block.id
        head = len(fields["hex"].split("|")[0].split())
        assert head == len(expected) - packed_nbytes(n, bits), f"{block.id}: '|' misplaced"
        if "codes" in fields:
            codes = [int(t, 16) for t in fields["codes"].split()]
            assert codes == ref_unpack(expected[head:], bits, n), f"{block.id}: codes"

    # decoding the doc's bytes gives the doc's values
    payload = torch.frombuffer(bytearray(expected), dtype=torch.uint8)
    decoded = codec.decode(payload, n, ctx).tolist()
    listed = number_list(fields["decoded"])
    assert len(listed) == n, block.id
    for i, (a, b) in enumerate(zip(listed, decoded, strict=True)):
        assert same(a, b), f"{block.id}: decoded[{i}] is {b!r}"

    # an independent recomputation of the documented wire format
    xn = x.numpy()
    if codec.codec_id in ("fp32", "bf16", "fp16"):
        assert oracle_passthrough(codec.codec_id, xn) == expected, f"{block.id}: oracle"
        return
    if codec.codec_id in MX_CODECS:
        ref = oracle_mx(codec, xn, expected)
    elif codec.codec_id == "block":
        ref = oracle_block(codec, xn, expected, ctx)
    else:
        assert codec.codec_id == "int", block.id
        ref = oracle_int(codec, xn, expected, ctx)
    for i, (a, b) in enumerate(zip(listed, ref, strict=True)):
        assert same(a, b), f"{block.id}: decoded[{i}] should be {b!r} by the documented rule"
