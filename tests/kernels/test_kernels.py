"""Triton kernels against their PyTorch references, bit for bit (docs/design.md,
"House style", item 7).

Every test computes the reference (the codec's ``_encode``/``_decode``/``_reduce`` through
``backend="reference"``) beside the kernel (``backend="triton"``, forced) on the same device,
and compares bytes (payloads) or int32 views (fp32 values) with no tolerance. Two NaN rules:
fp32 *values* (decoded outputs, and the payloads of the ``fp32`` codec, which carry the sum
``partial + local`` as fp32) compare NaN by position, since which NaN bits an fp32 add or
multiply returns is the hardware's choice; every NaN a codec *writes* (scales, converted
values) is canonical and compares byte for byte.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is imported and while these tests run, unset for the rest of the suite,
which keeps the CPU reference: ``kernel_harness.py``); with CUDA the same tests run natively
(``-m gpu`` selects them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_harness import (
    DEVICE,
    assert_bytes_equal,
    assert_values_equal,
    both,
    cycle_blocks,
    interpreted_imports,
    random_values,
)

with interpreted_imports():
    import triton
    import triton.language as tl

    from dynamiq.kernels import _common
    from dynamiq.kernels import hashing as khash
    from dynamiq.kernels import intq as kintq
    from dynamiq.kernels import mx as kmx
    from dynamiq.kernels import passthrough as kpass
KERNEL_MODULES = (_common, khash, kintq, kmx, kpass)  # imported above, in the right mode

import dynamiq.kernels as K  # noqa: E402
from dynamiq.codecs import Codec, HopContext, get_codec, list_codecs  # noqa: E402
from dynamiq.codecs.formats import ELEMENT_FORMATS, ElementFormat  # noqa: E402
from dynamiq.codecs.hashing import hash_keys, hash_u32, uniform_open01  # noqa: E402
from dynamiq.codecs.passthrough import FP32Codec  # noqa: E402
from dynamiq.testing.golden import fixture_context  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]


FIXTURES = Path(__file__).parents[1] / "fixtures"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (0, 1, 31, 33, 1000)

#: registered names with kernels, plus non-default configurations
KERNEL_NAMES = [n for n in list_codecs() if K.has_kernels(get_codec(n))]
EXTRA_CONFIGS: dict[str, dict[str, Any]] = {
    "int4_stochastic": {"id": "int", "bits": 4, "rounding": "stochastic"},
    "int3_stochastic_fp16": {
        "id": "int",
        "bits": 3,
        "rounding": "stochastic",
        "scale_format": "fp16",
    },
    "int8_stochastic_e8m0": {
        "id": "int",
        "bits": 8,
        "rounding": "stochastic",
        "scale_format": "e8m0",
    },
    "int5_fp16": {"id": "int", "bits": 5, "scale_format": "fp16"},
    "int6_fp32": {"id": "int", "bits": 6, "scale_format": "fp32"},
    "int2_e8m0": {"id": "int", "bits": 2, "scale_format": "e8m0"},
    "int3_block3": {"id": "int", "bits": 3, "block_size": 3},  # tiles of 8 blocks
    "int7_block12_fp32": {"id": "int", "bits": 7, "block_size": 12, "scale_format": "fp32"},
    "int4_block100_stochastic": {
        "id": "int",
        "bits": 4,
        "block_size": 100,
        "rounding": "stochastic",
    },
}
CONFIGS = {**{n: n for n in KERNEL_NAMES}, **EXTRA_CONFIGS}
CTXS = (
    HopContext(),
    HopContext(seed=7, step=3, hop=1, num_hops=4, rank=2, offset=4096),
    HopContext(seed=2**40 + 5, step=2**33, hop=6, num_hops=7, rank=2**32 - 1, offset=2**32 - 17),
)


# -- comparisons ------------------------------------------------------------------------------


def assert_payload_equal(codec: Codec, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Payloads: identical bytes (``fp32`` payloads hold fp32 sums: NaN by position)."""
    assert got.dtype == torch.uint8 and got.shape == want.shape, what
    if isinstance(codec, FP32Codec):
        assert_values_equal(got.view(torch.float32), want.view(torch.float32), what)
    else:
        assert_bytes_equal(got, want, what)


# -- inputs -----------------------------------------------------------------------------------


def edge_values(n: int, block: int, max_abs: float, seed: int) -> torch.Tensor:
    """Blocks of special content: zeros, fp32/bf16/fp16 subnormals, huge, ties, NaN, ±Inf,
    -0.0, one large value among tiny ones."""
    g = torch.Generator().manual_seed(seed)
    top = float(torch.tensor(max_abs, dtype=torch.float32))
    kinds = [
        lambda m: torch.zeros(m),
        lambda m: -torch.zeros(m),
        lambda m: torch.randint(-(2**23), 2**23, (m,), generator=g).float() * 2.0**-149,
        lambda m: torch.randint(-1023, 1024, (m,), generator=g).float() * 2.0**-24,  # fp16 sub
        lambda m: torch.randint(-127, 128, (m,), generator=g).float() * 2.0**-133,  # bf16 sub
        lambda m: torch.full((m,), top) * torch.linspace(-1, 1, m),
        lambda m: (torch.arange(m) - m // 2 + 0.5) * 2.0**-3,  # ties at every scale
        lambda m: torch.where(torch.arange(m) == m // 2, float("nan"), 1.0),
        lambda m: torch.where(torch.arange(m) == 0, float("inf"), -2.0),
        lambda m: torch.where(torch.arange(m) == m - 1, float("-inf"), 3.0e-3),
        lambda m: torch.where(torch.arange(m) == 1, 1.0e4, 1.0e-30),
    ]
    return cycle_blocks(kinds, n, block)


def inputs(codec: Codec, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    max_abs = min(codec.max_input_abs, 2.0**100)
    xs = [random_values(n, seed, max_abs), edge_values(n, codec.block_size, max_abs, seed)]
    return [x.to(dtype).to(DEVICE) for x in xs]


# -- the counter hash -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed,step,hop,rank", [(0, 0, 0, 0), (1, 2, 3, 4), (2**63 - 1, 2**40, 7, 2**32 - 1)]
)
def test_hash_matches_reference(seed: int, step: int, hop: int, rank: int) -> None:
    keys = hash_keys(seed, step, hop, rank)
    starts = (0, 2**31 - 100, 2**32 - 300, 2**40 + 12345, 2**63 - 2000)
    idx = torch.cat([torch.arange(s, s + 600, dtype=torch.int64) for s in starts])
    g = torch.Generator().manual_seed(seed % 1000)
    idx = torch.cat([idx, torch.randint(0, 2**62, (2000,), generator=g, dtype=torch.int64)])
    before = K.launch_counts().get("_hash_kernel", 0)
    got = khash.hash_u32(idx.to(DEVICE), keys).cpu()
    assert torch.equal(got, hash_u32(idx, keys))
    u = khash.uniform_open01(idx.to(DEVICE), keys).cpu()
    assert torch.equal(u.view(torch.int32), uniform_open01(hash_u32(idx, keys)).view(torch.int32))
    assert K.launch_counts()["_hash_kernel"] == before + 2


# -- element formats, every code and a sweep of inputs ----------------------------------------


@functools.cache
def _element_probe() -> Any:
    """A kernel around ``encode_element`` / ``decode_element`` (defined on first use, while
    the interpreter mode is on)."""

    @triton.jit
    def _element_probe_kernel(
        x_ptr,  # int32 fp32 bits
        code_ptr,  # int32 codes out
        dec_ptr,  # fp32 decode of the code inputs
        cin_ptr,  # int32 codes in
        n,
        ncodes,
        scale_exp,
        NEXP: tl.constexpr,
        NMANT: tl.constexpr,
        BIAS: tl.constexpr,
        BITS: tl.constexpr,
        SPECIALS: tl.constexpr,
        MAX_CODE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        bits = tl.load(x_ptr + offs, mask=m, other=0)
        code = _common.encode_element(bits, scale_exp, NMANT, BIAS, BITS, SPECIALS, MAX_CODE)
        tl.store(code_ptr + offs, code, mask=m)
        mc = offs < ncodes
        c = tl.load(cin_ptr + offs, mask=mc, other=0)
        tl.store(
            dec_ptr + offs, _common.decode_element(c, NEXP, NMANT, BIAS, BITS, SPECIALS), mask=mc
        )

    return _element_probe_kernel


@pytest.mark.parametrize("name", [n for n in ELEMENT_FORMATS if n != "float8_e8m0fnu"])
def test_element_formats_match_reference(name: str) -> None:
    """Every code decodes like ``decode_table``; every bf16 value (as fp32) plus random fp32
    bit patterns encode like ``ElementFormat.encode`` at several power-of-two scales, those
    within ``encode_element``'s domain: finite, ``|x| * 2^-scale_exp < 2^16`` (what a block
    whose shared exponent comes from its maximum holds; 2^16 is above every format's range)."""
    fmt: ElementFormat = ELEMENT_FORMATS[name]
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=g, dtype=torch.int64)
    x_all = torch.cat([(torch.arange(65536, dtype=torch.int32) << 16), rand.to(torch.int32)])
    codes_in = torch.arange(1 << fmt.bits, dtype=torch.int32)
    for scale_exp in (0, -127, 5, 100):
        y = x_all.view(torch.float32).double().abs() * 2.0**-scale_exp
        x = x_all[y.isfinite() & (y < 2.0**16)]
        assert x.numel() > 1000, "the sweep lost its inputs"
        n = x.numel()
        code = torch.empty(n, dtype=torch.int32, device=DEVICE)
        dec = torch.empty(codes_in.numel(), dtype=torch.float32, device=DEVICE)
        with K._kernel_scope(torch.device(DEVICE)):
            _element_probe()[(triton.cdiv(n, 8192),)](
                x.to(DEVICE), code, dec, codes_in.to(DEVICE), n, codes_in.numel(), scale_exp,
                NEXP=fmt.nexp, NMANT=fmt.nmant, BIAS=fmt.bias, BITS=fmt.bits,
                SPECIALS=_common.SPECIALS[fmt.specials], MAX_CODE=fmt.max_code, BLOCK=8192,
            )  # fmt: skip
        want = fmt.encode(x.view(torch.float32), scale_exp, saturate=True)
        assert torch.equal(code.cpu().to(torch.uint8), want), f"{name} encode, scale 2^{scale_exp}"
        assert_values_equal(dec.cpu(), fmt.decode_table(), f"{name} decode")


# -- every codec: encode, decode, reduce ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_codec_kernels_bit_exact(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(CONFIGS[name])
    for n in LENGTHS:
        for i, x in enumerate(inputs(codec, n, dtype, seed=n)):
            ctx = CTXS[(n + i) % len(CTXS)]
            out_ctx = CTXS[(n + i + 1) % len(CTXS)]
            what = f"{name} {dtype} n={n} input {i}"
            got, want = both(K.encode, codec, x, ctx)
            if want is None:
                continue
            assert_payload_equal(codec, got, want, f"encode {what}")
            got_v, want_v = both(K.decode, codec, want, n, ctx)
            assert_values_equal(got_v, want_v, f"decode {what}")
            local = inputs(codec, n, dtype, seed=n + 1)[1 - i]
            got, want = both(K.reduce, codec, want, local, ctx, out_ctx)
            if want is not None:
                assert_payload_equal(codec, got, want, f"reduce {what}")


#: codecs with a fixed payload size (random bytes are a payload); data-dependent sizes
#: (omnireduce) build their arbitrary payloads in their own test files
FIXED_SIZE = [n for n in CONFIGS if get_codec(CONFIGS[n]).encoded_nbytes(1) is not None]


@pytest.mark.parametrize("name", FIXED_SIZE)
def test_codec_kernels_on_arbitrary_payloads(name: str) -> None:
    """Random payload bytes (every code: NaN codes, -2^(b-1), scales 0x00/0xfe/0xff, NaN and
    Inf scales) decode and reduce like the reference."""
    codec = get_codec(CONFIGS[name])
    g = torch.Generator().manual_seed(11)
    for n in (1, 37, 700):
        nbytes = codec.encoded_nbytes(n)
        payload = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).to(DEVICE)
        got, want = both(K.decode, codec, payload, n)
        assert_values_equal(got, want, f"decode {name} n={n}")
        local = random_values(n, n, 1e3).to(DEVICE)
        got, want = both(K.reduce, codec, payload, local, HopContext(seed=1, offset=n))
        if want is not None:
            assert_payload_equal(codec, got, want, f"reduce {name} n={n}")


@pytest.mark.parametrize(
    "config",
    [
        {"id": "int", "bits": 3, "block_size": 5000},  # more than MAX_TILE: two-pass path
        {"id": "int", "bits": 8, "block_size": 4100, "rounding": "stochastic"},
        {"id": "int", "bits": 5, "block_size": 4099, "scale_format": "fp16"},
    ],
    ids=["b5000", "b4100_stochastic", "b4099_fp16"],
)
def test_int_huge_blocks(config: dict[str, Any]) -> None:
    codec = get_codec(config)
    assert 8 // math.gcd(codec.block_size, 8) * codec.block_size > kintq.MAX_TILE
    ctx = HopContext(seed=3, rank=1, offset=10**6)
    for n in (1, 4101, 9000):
        x = edge_values(n, 1500, 1e4, n).to(DEVICE)
        got, want = both(K.encode, codec, x, ctx)
        assert_payload_equal(codec, got, want, f"encode n={n}")
        local = random_values(n, n, 1e4).to(torch.bfloat16).to(DEVICE)
        got, want = both(K.reduce, codec, want, local, ctx, HopContext(seed=4))
        assert_payload_equal(codec, got, want, f"reduce n={n}")
        got_v, want_v = both(K.decode, codec, want, n, ctx)
        assert_values_equal(got_v, want_v, f"decode n={n}")
        assert "_int_quantize_kernel" in K.launch_counts()


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "e8m0"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_scales_round_up_exactly(fmt: str, bits: int) -> None:
    """The integer scale computation equals the reference's fp64 round-up: block maxima on
    and one ulp around ``k * qmax * 2^e`` for every exponent, subnormals, and the limit."""
    codec = get_codec({"id": "int", "bits": bits, "block_size": 2, "scale_format": fmt})
    e = torch.arange(-149, 128, dtype=torch.float64)
    k = torch.tensor([1.0, 3.0, 5.0, 127.0, 129.0, 255.0, 1.5, 1.75]).double()
    y = (k[None, :] * codec.qmax * torch.exp2(e[:, None])).reshape(-1).float()
    y = y[torch.isfinite(y) & (y > 0)]
    big = torch.full_like(y, 3e38)
    y = torch.cat([y, torch.nextafter(y, torch.zeros_like(y)), torch.nextafter(y, big)])
    limit = torch.tensor([codec.max_input_abs], dtype=torch.float32)
    y = torch.cat([y[y <= limit], limit, torch.nextafter(limit, torch.zeros(1))])
    x = torch.stack([y, -y / 3], dim=1).reshape(-1).to(DEVICE)  # block = (absmax, smaller)
    got, want = both(K.encode, codec, x)
    assert_payload_equal(codec, got, want, f"int{bits} {fmt} scales")


def test_int_beyond_max_input_abs_raises_like_reference() -> None:
    for config in ({"id": "int", "bits": 8}, {"id": "int", "bits": 4, "scale_format": "fp16"}):
        codec = get_codec(config)
        x = torch.ones(100)
        x[40] = float(torch.nextafter(torch.tensor(codec.max_input_abs), torch.tensor(3e38)))
        got, want = both(K.encode, codec, x.to(DEVICE))
        assert got is None and want is None  # both raised the same ValueError
        # a reduce whose partial sum overflows the limit raises too
        half = torch.full((100,), codec.max_input_abs * 0.75)
        payload = codec.encode(half.to(DEVICE))
        got, want = both(K.reduce, codec, payload, half.to(DEVICE))
        assert got is None and want is None


def _fixture_codec(name: str) -> Any:
    return get_codec(json.loads((FIXTURES / name / "config.json").read_text())["codec"])


_FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
_WITH_KERNELS = [n for n in _FIXTURE_NAMES if K.has_kernels(_fixture_codec(n))]
_WITHOUT_KERNELS = [n for n in _FIXTURE_NAMES if n not in _WITH_KERNELS]


def test_every_built_in_codec_has_kernels() -> None:
    """Every codec with golden fixtures (the built-ins, the plugin's are elsewhere) has Triton
    kernels for all three operations (forcing Triton on a codec without them is a clear
    error: see the plugin test below)."""
    assert _WITHOUT_KERNELS == []
    for name in _WITH_KERNELS:
        codec = _fixture_codec(name)
        assert all(K.has_kernels(codec, op) for op in ("encode", "decode", "reduce")), name


@pytest.mark.parametrize("name", _WITH_KERNELS)
def test_golden_fixtures_on_triton(name: str) -> None:
    """The frozen wire bytes of ``tests/fixtures`` come out of the kernels too."""
    folder = FIXTURES / name
    meta = json.loads((folder / "config.json").read_text())
    codec = get_codec(meta["codec"])
    x = torch.frombuffer(bytearray((folder / "input.bin").read_bytes()), dtype=torch.float32)
    expected = torch.frombuffer(bytearray((folder / "payload.bin").read_bytes()), dtype=torch.uint8)
    ctx, pieces = fixture_context(codec, meta, x)  # a pooled fixture: its prologue's pieces
    if len(pieces) > 1:
        ctxs = [dataclasses.replace(ctx, offset=ctx.offset + a) for a, _ in pieces]
        parts = [
            K.encode(codec, x[a:b].contiguous().to(DEVICE), c, backend="triton").cpu()
            for (a, b), c in zip(pieces, ctxs, strict=True)
        ]
        assert torch.equal(torch.cat(parts), expected), f"{name}: wire bytes differ"
        at, out = 0, []
        for (a, b), c, p in zip(pieces, ctxs, parts, strict=True):
            out.append(K.decode(codec, expected[at : at + p.numel()].to(DEVICE), b - a, c,
                                backend="triton").cpu())  # fmt: skip
            at += p.numel()
        want = torch.frombuffer(
            bytearray((folder / "decoded.bin").read_bytes()), dtype=torch.float32
        )
        assert_values_equal(torch.cat(out), want, f"{name} decode")
        return
    got = K.encode(codec, x.to(DEVICE), ctx, backend="triton").cpu()
    assert torch.equal(got, expected), f"{name}: wire bytes differ from the golden fixture"
    decoded = K.decode(codec, expected.to(DEVICE), x.numel(), ctx, backend="triton").cpu()
    want = torch.frombuffer(bytearray((folder / "decoded.bin").read_bytes()), dtype=torch.float32)
    assert_values_equal(decoded, want, f"{name} decode")


# -- the dispatcher ---------------------------------------------------------------------------


def test_auto_uses_triton_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = get_codec("mxfp4")
    x = random_values(64, 0, 100.0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    K._settings.refresh()  # (read once otherwise)
    codec.encode(x)
    assert K.last_backend() == "reference"  # CPU without TRITON_INTERPRET: the fast path
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        K._settings.refresh()
        before = sum(K.launch_counts().values())
        assert torch.equal(codec.encode(x), K.encode(codec, x, backend="reference"))
        assert sum(K.launch_counts().values()) == before + 1
    else:
        codec.encode(x.cuda())
        assert K.last_backend() == "triton"


def test_codec_methods_go_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    K._settings.refresh()
    codec = get_codec("int4")
    x = random_values(100, 1, 10.0).to(DEVICE)
    payload = codec.encode(x)
    assert K.last_backend() == "triton"
    out = torch.empty(100, device=DEVICE)
    assert codec.decode(payload, 100, out=out) is out
    assert K.last_backend() == "triton"
    assert_values_equal(out.cpu(), K.decode(codec, payload, 100, backend="reference").cpu())
    codec.reduce(payload, x)
    assert K.last_backend() == "triton"
    # validation happens before any kernel, with the codec's messages
    with pytest.raises(ValueError, match="payload has 3 bytes"):
        K.reduce(codec, payload[:3], x, backend="triton")
    with pytest.raises(TypeError, match="x must have dtype"):
        K.encode(codec, x.double(), backend="triton")


def test_bad_backend() -> None:
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'reference'"):
        K.encode(get_codec("fp16"), torch.zeros(4), backend="cuda")


def test_plugin_codecs_run_on_reference_until_they_register_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True, kw_only=True)
    class HalfCodec(FP32Codec):  # a subclass does not inherit the fp32 kernels
        codec_id: ClassVar[str] = "test_half"

        def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            return super()._encode(x.float() * 0.5, ctx)

    monkeypatch.setattr(K, "_PLUGINS", {})
    codec = HalfCodec()
    x = torch.arange(8.0, device=DEVICE)
    assert not K.has_kernels(codec)
    assert torch.equal(K.encode(codec, x).view(torch.float32), x * 0.5)
    assert K.last_backend() == "reference"
    with pytest.raises(NotImplementedError, match="no Triton kernel for encode"):
        K.encode(codec, x, backend="triton")

    calls = []

    def encode_kernel(c: Codec, v: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        calls.append(ctx)
        return kpass.encode(c, v * 0.5, ctx)

    K.register_kernels(HalfCodec, encode=encode_kernel)
    assert K.has_kernels(codec, "encode") and not K.has_kernels(codec, "decode")
    assert torch.equal(K.encode(codec, x, backend="triton").view(torch.float32), x * 0.5)
    assert K.last_backend() == "triton" and calls == [HopContext()]
    K.decode(codec, K.encode(codec, x, backend="reference"), 8)
    assert K.last_backend() == "reference"  # no decode kernel: the reference
    with pytest.raises(ValueError, match="already registered"):
        K.register_kernels(HalfCodec, encode=encode_kernel)
    K.register_kernels(HalfCodec, decode=kpass.decode, replace=True)
    with pytest.raises(ValueError, match="already registered"):
        K.register_kernels(FP32Codec, encode=encode_kernel)
    with pytest.raises(TypeError, match="Codec subclass"):
        K.register_kernels(int, encode=encode_kernel)  # type: ignore[arg-type]


def test_codecs_without_kernels_fall_back_to_reference() -> None:
    """Every registered codec runs under ``auto``; codecs without kernels on the reference."""
    for name in list_codecs():
        codec = get_codec(name)
        if K.has_kernels(codec):
            continue
        x = random_values(2 * codec.block_size + 3, 5, 10.0).to(DEVICE)
        payload = K.encode(codec, x)
        assert K.last_backend() == "reference"
        assert torch.equal(payload, K.encode(codec, x, backend="reference"))
        with pytest.raises(NotImplementedError):
            K.encode(codec, x, backend="triton")


def test_empty_inputs_need_no_launch() -> None:
    for name in ("int4", "mxfp6_e2m3", "bf16"):
        codec = get_codec(name)
        before = K.launch_counts()
        p = K.encode(codec, torch.zeros(0, device=DEVICE), backend="triton")
        assert p.numel() == 0 and K.launch_counts() == before
        assert K.decode(codec, p, 0, backend="triton").numel() == 0
        assert K.reduce(codec, p, torch.zeros(0, device=DEVICE), backend="triton").numel() == 0


def test_kernel_modules_are_not_imported_by_dynamiq() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, dynamiq; c = dynamiq.get_codec('int4');"
        "c.decode(c.encode(torch.ones(40)), 40);"
        "assert 'triton' not in sys.modules, 'triton imported';"
        "assert not [m for m in sys.modules if m.startswith('dynamiq.kernels.') "
        "and m not in ('dynamiq.kernels._stats', 'dynamiq.kernels._compiled', "
        "'dynamiq.kernels.cpu_native', 'dynamiq.kernels._libcache', "  # its cache
        "'dynamiq.kernels._declared', "  # the declared families' names (no kernels)
        "'dynamiq.kernels._ops', "  # the torch.library ops (they call the dispatcher)
        "'dynamiq.kernels._settings')], "  # the switches read from the environment
        "'kernel modules imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_cpu_tensors_after_a_compiled_import_raise_every_time() -> None:
    """Once a kernel module is loaded compiled (as for CUDA tensors), a CPU call on the Triton
    backend raises, the first time and from the dispatcher's cache of loaded modules alike."""
    import subprocess
    import sys

    code = (
        "import torch, dynamiq, dynamiq.kernels as K; c = dynamiq.get_codec('int8');"
        "import triton; K._builtin('intq', interpret=False);"
        "assert K._LOADED['intq'][1] is False\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        K.encode(c, torch.ones(64), backend='triton')\n"
        "    except RuntimeError as e:\n"
        "        assert 'TRITON_INTERPRET=1' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_plugins_register_cpu_kernels_as_they_register_triton_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``register_kernels(..., backend="cpu")``: the CPU implementation runs CPU tensors under
    ``auto`` (at every size, while CPU kernels are on) and ``backend="cpu"``, reports
    ``last_backend() == "cpu"``, is separate from the class's Triton kernels, and follows the
    same registration rules."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True, kw_only=True)
    class ThirdCodec(FP32Codec):
        codec_id: ClassVar[str] = "test_third"

        def _encode(self, x: torch.Tensor, ctx: HopContext) -> torch.Tensor:
            return super()._encode(x.float() * 0.25, ctx)

    monkeypatch.setattr(K, "_PLUGINS", {})
    codec = ThirdCodec()
    x = torch.arange(16.0)
    assert not K.has_kernels(codec, backend="cpu")
    with pytest.raises(NotImplementedError, match="no native CPU kernel"):
        K.encode(codec, x, backend="cpu")
    calls: list[int] = []

    def cpu_encode(c: Codec, v: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        calls.append(v.numel())
        return (v.float() * 0.25).view(torch.uint8).clone()

    K.register_kernels(ThirdCodec, encode=cpu_encode, backend="cpu")
    assert K.has_kernels(codec, "encode", backend="cpu")
    assert not K.has_kernels(codec, "decode", backend="cpu")
    assert not K.has_kernels(codec)  # no Triton kernel: a separate registration
    want = K.encode(codec, x, backend="reference")
    assert torch.equal(codec.encode(x), want) and K.last_backend() == "cpu"
    assert torch.equal(K.encode(codec, x, backend="cpu"), want) and calls == [16, 16]
    with pytest.raises(NotImplementedError, match="registered no CPU kernel for decode"):
        K.decode(codec, want, 16, backend="cpu")
    K.decode(codec, want, 16)
    assert K.last_backend() == "reference"  # no decode kernel: the reference
    K.set_cpu_kernels(False)
    try:
        codec.encode(x)
        assert K.last_backend() == "reference" and calls == [16, 16]
    finally:
        K.set_cpu_kernels(None)
    with pytest.raises(ValueError, match="cpu kernels for .* already registered"):
        K.register_kernels(ThirdCodec, encode=cpu_encode, backend="cpu")
    K.register_kernels(ThirdCodec, encode=cpu_encode, backend="cpu", replace=True)
    with pytest.raises(ValueError, match="backend must be one of 'triton', 'cpu'"):
        K.register_kernels(ThirdCodec, encode=cpu_encode, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        K.has_kernels(codec, backend="auto")
    with pytest.raises(ValueError, match="already registered"):
        K.register_kernels(FP32Codec, encode=cpu_encode, backend="cpu")
