"""The native CPU kernels (``dynamiq.kernels.cpu_native``) against the PyTorch references, bit
for bit (docs/design.md, "House style", item 7).

Every test computes the plain reference (the codec's own ``_encode`` / ``_decode`` /
``_reduce``) beside the native kernel (``backend="cpu"``, forced, so a kernel that cannot be
built fails the test instead of falling back) and compares payload bytes, or the int32 views
of fp32 values (NaN by position: which NaN an fp32 add or multiply returns is the hardware's
choice), with no tolerance. Inputs: edge tables (zeros, subnormals, ties, saturation, huge
blocks, NaN/±Inf blocks), every block remainder, fp32/bf16/fp16, hop contexts with offsets
across 2^32 and 2^63, arbitrary payload bytes, several threads, and Hypothesis.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_harness import assert_values_equal

import dynamiq.kernels as K
from dynamiq.codecs import Codec, HopContext, MXCodec, get_codec, list_codecs
from dynamiq.codecs.intq import IntCodec
from dynamiq.codecs.packing import pack_bits
from dynamiq.codecs.passthrough import BF16Codec
from dynamiq.kernels import cpu_native
from dynamiq.testing.strategies import finite_tensors, hop_contexts

if cpu_native._compiler() is None:
    pytest.skip(
        "no C++ compiler on this machine (CXX, g++, c++, clang++): the native CPU kernels "
        "cannot be built here",
        allow_module_level=True,
    )

#: every registered MX codec (a new element format is tested here without naming it)
MX_NAMES = [n for n in list_codecs() if isinstance(get_codec(n), MXCodec)]
SCALE_FORMATS = ["bf16", "fp16", "fp32", "e8m0"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# hop contexts: defaults; an offset whose low word wraps inside a block; one that wraps int64
CTXS = [
    HopContext(),
    HopContext(seed=7, step=3, hop=1, num_hops=3, rank=5, offset=2**32 - 9),
    HopContext(seed=2**40 + 1, step=10**9, hop=2, num_hops=3, rank=1023, offset=2**63 - 20),
]


def int_codec(
    bits: int = 8, block_size: int = 32, rounding: str = "nearest", fmt: str = "bf16"
) -> IntCodec:
    return IntCodec(bits=bits, block_size=block_size, rounding=rounding, scale_format=fmt)


INT_CODECS = [
    *(int_codec(b, 32, r, f) for b in range(2, 9) for f in SCALE_FORMATS for r in ("nearest",)),
    *(int_codec(b, 32, "stochastic", f) for b in (2, 5, 8) for f in SCALE_FORMATS),
    # block sizes: odd, even but not a multiple of 8, huge (tiles of 8 blocks of 4099)
    *(int_codec(b, bs, r, "bf16") for b in (3, 8) for bs in (2, 3, 12, 100, 4099)
      for r in ("nearest", "stochastic")),
    int_codec(4, 7, "nearest", "e8m0"),
    int_codec(6, 33, "stochastic", "fp16"),
]  # fmt: skip
ALL_CODECS = [*INT_CODECS, *(get_codec(n) for n in MX_NAMES)]


def cid(codec: Codec) -> str:
    if isinstance(codec, IntCodec):
        c = codec
        return f"int{c.bits}-bs{c.block_size}-{c.rounding[:5]}-{c.scale_format}"
    return codec.codec_id


pytestmark = pytest.mark.usefixtures("cpu_switches_cleared")


# -- comparisons --------------------------------------------------------------------------------


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype == torch.uint8, what
    assert got.shape == want.shape, what
    if not torch.equal(got, want):
        i = int((got != want).nonzero()[0, 0])
        raise AssertionError(f"{what}: byte {i} of {got.numel()} differs: {got[i]} != {want[i]}")


def _outcome(fn: Any, *args: Any) -> torch.Tensor | str:
    """The result, or the message of the ValueError the codec raises (block beyond
    max_input_abs): the kernel must raise the same."""
    try:
        return fn(*args)
    except ValueError as exc:
        return f"ValueError: {exc}"


def check_all(codec: Codec, x: torch.Tensor, local: torch.Tensor, ctx: HopContext,
              out_ctx: HopContext, what: str = "") -> None:  # fmt: skip
    """encode, decode and the fused reduce on the native backend == the plain reference."""
    n = x.numel()
    what = f"{cid(codec)} n={n} {x.dtype} {what}"
    want = _outcome(codec._encode, x, ctx)
    got = _outcome(K.encode, codec, x, ctx, "cpu")
    if isinstance(want, str):
        assert got == want, what
        return
    assert K.last_backend() == "cpu"
    assert isinstance(got, torch.Tensor)
    assert_bytes_equal(got, want, f"{what} encode")
    assert_values_equal(K.decode(codec, want, n, ctx, "cpu"), codec._decode(want, n, ctx), what)
    want_r = _outcome(codec._reduce, want, local, ctx, out_ctx)
    got_r = _outcome(K.reduce, codec, want, local, ctx, out_ctx, "cpu")
    if isinstance(want_r, str) or isinstance(got_r, str):
        assert got_r == want_r, f"{what} reduce"
    else:
        assert_bytes_equal(got_r, want_r, f"{what} reduce")


# -- inputs -------------------------------------------------------------------------------------


def random_values(n: int, seed: int, spread: int = 30) -> torch.Tensor:
    """Gaussian values times powers of two in 2^-spread .. 2^spread."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, spread + 1, (n,), generator=g).float()
    return torch.randn(n, generator=g) * torch.exp2(e)


def edge_values(codec: Codec) -> torch.Tensor:
    """Blocks of edge cases, one kind per block (the codec's block size), as fp32."""
    bs = codec.block_size
    blocks: list[list[float]] = []
    blocks.append([0.0] * bs)  # all-zero block: zero scale (E8M0: 2^-127)
    blocks.append([-0.0, 0.0] * (bs // 2) + [0.0] * (bs % 2))
    blocks.append([2.0**-149, -(2.0**-149), 2.0**-140, 2.0**-127, 1.5 * 2.0**-126])  # subnormals
    blocks.append([float.fromhex("0x1.fffffcp-127"), 2.0**-126, -(2.0**-133)])  # around min normal
    blocks.append([float("nan"), 1.0, -2.0])  # NaN block: NaN scale, codes 0
    blocks.append([float("inf"), 1.0])  # +Inf block
    blocks.append([-3.0, float("-inf")])  # -Inf block
    if isinstance(codec, IntCodec):
        qmax = codec.qmax
        s = 2.0**-3  # exact in every scale format: block absmax qmax * S gives scale S
        blocks.append([qmax * s] + [(k + 0.5) * s * (-1) ** k for k in range(min(qmax, bs - 1))])
        blocks.append([qmax * s] + [-(k + 0.5) * s for k in range(min(qmax, bs - 1))])
        # absmax on and one ulp around k * qmax * 2^e: the scale round-up boundary
        for e in (-20, 0, 7):
            for k in (1, 3, 5, 255):
                v = torch.tensor([k * qmax * 2.0**e], dtype=torch.float32)
                up = torch.nextafter(v, torch.tensor([float("inf")]))
                down = torch.nextafter(v, torch.tensor([0.0]))
                blocks.extend([[float(v)], [float(up), 1.0], [-float(down)]])
        top = codec.max_input_abs  # largest accepted block absmax
        blocks.append([top, -top / 3, top / 7])
        blocks.append([2.0**-149] * 3)  # tiny block: scale rounds up to the format's minimum
    else:
        fmt = codec.element  # type: ignore[attr-defined]
        table = fmt.decode_table()
        pos = table[torch.isfinite(table) & (table > 0)].double().unique()
        mids = ((pos[1:] + pos[:-1]) / 2).tolist()  # ties between neighbouring elements
        for k in (-130, -127, -3, 0, 5, 120):
            sc = 2.0**k
            blocks.append([fmt.max * sc] + [m * sc * (-1) ** i for i, m in enumerate(mids)])
            # just below 2^(emax + 1) X: saturates to max
            blocks.append([2.0 ** (fmt.emax + 1) * (1 - 2.0**-12) * sc, pos[0].item() * sc])
        blocks.append([float.fromhex("0x1.fffffep127"), -1.0])  # fp32 max: shared exponent 127
        blocks.append([2.0**-149] * 3)  # shared exponent clamped at -127
    # one pattern per block, repeated to fill it (huge blocks: 64 values a pattern)
    span = bs if bs <= 256 else 64
    out: list[float] = []
    for blk in blocks:
        out.extend((blk * (-(-span // len(blk))))[:span])
    return torch.tensor(out, dtype=torch.float64).to(torch.float32)


def clamp_to(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Finite values clamped into what the codec accepts (NaN/Inf kept)."""
    top = codec.max_input_abs
    return torch.where(torch.isfinite(x), x.clamp(-top, top), x)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return x
    # clamp finite values into the dtype's range so the cast does not make new Infs
    top = torch.finfo(dtype).max
    return torch.where(torch.isfinite(x), x.clamp(-top, top), x).to(dtype)


# -- bit-exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=cid)
def test_edge_table(codec: Codec) -> None:
    """Every edge block, on its own and followed by a remainder, fp32 / bf16 / fp16 inputs."""
    x = clamp_to(edge_values(codec), codec)
    local = clamp_to(random_values(x.numel(), 1, 4), codec)
    for dtype in DTYPES:
        xd, ld = as_dtype(x, dtype), as_dtype(local, dtype)
        check_all(codec, xd, ld, CTXS[0], CTXS[1], "edge")
        check_all(codec, xd[:-3], ld[:-3], CTXS[1], CTXS[2], "edge, remainder")


@pytest.mark.parametrize("codec", ALL_CODECS, ids=cid)
def test_random_values_and_remainders(codec: Codec) -> None:
    bs = codec.block_size
    lengths = sorted({0, 1, 7, 8, 9, 31, 33, bs - 1, bs + 1, 3 * bs + 5, 1000})
    for i, n in enumerate(lengths):
        x = clamp_to(random_values(n, 10 + i), codec)
        local = clamp_to(random_values(n, 20 + i), codec)
        ctx, out_ctx = CTXS[i % 3], CTXS[(i + 1) % 3]
        check_all(codec, as_dtype(x, DTYPES[i % 3]), as_dtype(local, DTYPES[i % 3]), ctx, out_ctx)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=cid)
def test_arbitrary_payload_bytes(codec: Codec) -> None:
    """decode and reduce of payloads no encoder wrote (NaN/Inf scales, -128 codes, ...)."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 45, 300):
        nbytes = codec.encoded_nbytes(n)
        payload = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        assert_values_equal(
            K.decode(codec, payload, n, CTXS[1], "cpu"), codec._decode(payload, n, CTXS[1])
        )
        local = random_values(n, n)
        want = _outcome(codec._reduce, payload, local, CTXS[1], CTXS[2])
        got = _outcome(K.reduce, codec, payload, local, CTXS[1], CTXS[2], "cpu")
        if isinstance(want, str) or isinstance(got, str):
            assert got == want
        else:
            assert_bytes_equal(got, want, f"{cid(codec)} reduce of arbitrary bytes")


@pytest.mark.parametrize("name", MX_NAMES)
def test_mx_every_code_decodes_like_the_table(name: str) -> None:
    """Every element code under the scales 2^0, 2^-127 (subnormal), 2^100 and NaN (0xff)."""
    codec = get_codec(name)
    bits = codec.element.bits  # type: ignore[attr-defined]
    codes = torch.arange(1 << bits).repeat(max(4, 128 >> bits))  # whole blocks of 32 per scale
    n = codes.numel()
    scales = torch.tensor([127, 0, 227, 0xFF], dtype=torch.uint8).repeat_interleave(n // 128)
    stream = pack_bits(codes.to(torch.uint8), bits)
    payload = torch.cat([scales, stream])
    assert_values_equal(
        K.decode(codec, payload, n, backend="cpu"), codec._decode(payload, n, CTXS[0])
    )


@pytest.mark.parametrize("name", MX_NAMES)
def test_mx_rounding_boundaries(name: str) -> None:
    """Every element value, every midpoint between neighbours (ties) and one fp32 ulp either
    side of it, at shared exponents from the clamped -127 to the largest, both signs."""
    codec = get_codec(name)
    fmt = codec.element  # type: ignore[attr-defined]
    table = fmt.decode_table()
    pos = table[torch.isfinite(table) & (table > 0)].unique()  # fp32, ascending
    mids = (pos[1:].double() + pos[:-1].double()) / 2  # exact in fp32 (one more bit)
    mids = torch.cat([mids, (pos[:1].double() / 2)]).float()  # half the smallest subnormal
    inf = torch.full_like(mids, float("inf"))
    vals = torch.cat([pos, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf)])
    beyond = torch.tensor([fmt.max * 1.0625, 2.0 ** (fmt.emax + 1) * (1 - 2.0**-20)])  # saturate
    vals = torch.cat([vals, beyond])
    blocks = []
    top = 127 - fmt.emax  # the largest shared exponent a finite block reaches
    for k in (-140, -127, -126, -100, -3, 0, 50, top - 2, top - 1, top):
        body = vals.double() * 2.0**k
        for i in range(0, body.numel(), 30):  # each block: its max sets the shared exponent k
            chunk = body[i : i + 30]
            sign = torch.where(torch.arange(chunk.numel()) % 2 == 0, 1.0, -1.0).double()
            blocks.append(torch.cat([torch.tensor([fmt.max * 2.0**k, -(2.0**k)]), chunk * sign]))
    x = torch.cat([b.float().clamp(-3e38, 3e38) for b in blocks])
    check_all(codec, x, random_values(x.numel(), 9), CTXS[0], CTXS[1], "boundaries")


@pytest.mark.parametrize("fmt", SCALE_FORMATS)
def test_int_block_beyond_max_input_abs_raises_like_the_reference(fmt: str) -> None:
    codec = int_codec(8, 32, "nearest", fmt)
    x = random_values(100, 0, 3)
    big = float(torch.nextafter(torch.tensor(codec.max_input_abs), torch.tensor(float("inf"))))
    x[40] = -big
    x[70] = big * 1.5
    want = _outcome(codec._encode, x, CTXS[0])
    assert isinstance(want, str) and "exceeds max_input_abs" in want
    assert _outcome(K.encode, codec, x, CTXS[0], "cpu") == want
    # a partial sum pushed beyond it by the local slice
    x = torch.full((64,), codec.max_input_abs * 0.75)
    payload = codec._encode(x, CTXS[0])
    want = _outcome(codec._reduce, payload, x, CTXS[0], CTXS[0])
    assert isinstance(want, str) and "exceeds max_input_abs" in want
    assert _outcome(K.reduce, codec, payload, x, CTXS[0], CTXS[0], "cpu") == want


def test_many_chunks_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs cut into several chunks and threads give the same bytes as one thread (3, 5, 6
    and 7-bit codes are packed with 8-byte stores inside a chunk: none may reach the next
    chunk's bytes)."""
    monkeypatch.setattr(cpu_native, "_PER_THREAD", 64)  # threads even for small inputs
    threads = torch.get_num_threads()
    codecs = [
        get_codec("int4"),
        int_codec(5, 12, "stochastic", "fp16"),
        get_codec("mxfp6_e2m3"),
        get_codec("int3"),
        int_codec(7, 12),
        int_codec(6, 100, "nearest", "e8m0"),
    ]
    try:
        for nt in (3, 1):
            torch.set_num_threads(nt)
            for codec in codecs:
                n = 3 * 4096 + 77
                x, local = random_values(n, 1), random_values(n, 2)
                check_all(codec, x, local, CTXS[1], CTXS[2], f"{nt} threads")
    finally:
        torch.set_num_threads(threads)


def test_eight_bit_codes_and_fp32_values_in_place_over_chunks_and_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8-bit codes are read from and written to the payloads in place, and fp32 values read
    where they lie (no staging copy): several chunks, a partial last one, 1 and 3 threads, fp32
    and bf16 inputs, the same bytes as the reference."""
    monkeypatch.setattr(cpu_native, "_PER_THREAD", 64)  # threads even for small inputs
    threads = torch.get_num_threads()
    codecs = [
        get_codec("int8"),
        int_codec(8, 24, "stochastic", "fp32"),
        int_codec(8, 5, "nearest", "e8m0"),
        get_codec("mxfp8_e4m3"),
        get_codec("mxint8"),
    ]
    try:
        for nt in (3, 1):
            torch.set_num_threads(nt)
            for i, codec in enumerate(codecs):
                n = 3 * 4096 + 77
                x = clamp_to(random_values(n, 30 + i), codec)
                local = clamp_to(random_values(n, 40 + i), codec)
                for dtype in (torch.float32, torch.bfloat16):
                    check_all(codec, as_dtype(x, dtype), as_dtype(local, dtype), CTXS[1],
                              CTXS[2], f"{nt} threads")  # fmt: skip
    finally:
        torch.set_num_threads(threads)


int_configs = st.builds(
    int_codec,
    bits=st.integers(2, 8),
    block_size=st.one_of(st.sampled_from([2, 8, 32, 64]), st.integers(2, 300)),
    rounding=st.sampled_from(["nearest", "stochastic"]),
    fmt=st.sampled_from(SCALE_FORMATS),
)
codecs_st = st.one_of(int_configs, st.sampled_from(MX_NAMES).map(get_codec))


@given(data=st.data(), codec=codecs_st, ctx=hop_contexts(), out_ctx=hop_contexts())
def test_hypothesis(
    data: st.DataObject, codec: Codec, ctx: HopContext, out_ctx: HopContext
) -> None:
    x = data.draw(finite_tensors(codec.block_size, max_abs=codec.max_input_abs), label="x")
    seed = data.draw(st.integers(0, 2**31), label="local seed")
    spread = data.draw(st.integers(0, 60), label="local spread")
    local = clamp_to(random_values(x.numel(), seed, spread), codec).to(x.dtype)
    check_all(codec, x, local, ctx, out_ctx, "hypothesis")


# -- the dispatcher -----------------------------------------------------------------------------


def test_auto_uses_the_native_kernels_for_large_cpu_inputs() -> None:
    codec = get_codec("mxfp4")
    n = cpu_native.MIN_NUMEL
    x, local = random_values(n, 0), random_values(n, 1)
    before = K.launch_counts().get("cpu_mx_encode", 0)
    payload = codec.encode(x)
    assert K.last_backend() == "cpu"
    assert K.launch_counts()["cpu_mx_encode"] == before + 1
    assert_bytes_equal(payload, codec._encode(x, HopContext()))
    out = torch.empty(n)
    assert codec.decode(payload, n, out=out) is out and K.last_backend() == "cpu"
    assert_values_equal(out, codec._decode(payload, n, HopContext()))
    want = codec._reduce(payload, local, HopContext(), HopContext())
    assert_bytes_equal(codec.reduce(payload, local), want)
    assert K.last_backend() == "cpu"
    codec.encode(x[: n - 1])  # below MIN_NUMEL: the reference
    assert K.last_backend() == "reference"
    K.encode(codec, x, backend="reference")  # the plain reference when asked
    assert K.last_backend() == "reference"


@pytest.mark.parametrize("how", ["env", "function", "compile"])
def test_auto_native_can_be_switched_off(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "env":
        monkeypatch.setenv("DYNAMIQ_CPU_KERNELS", "0")
        K.set_cpu_kernels(None)  # read the environment now (it is read once otherwise)
    elif how == "function":
        K.set_cpu_kernels(False)
    else:  # an explicit torch.compile opt-in takes precedence (a stand-in compiler here)
        monkeypatch.setattr(torch, "compile", lambda fn, dynamic=False: fn)
        K.set_cpu_compile(True)
    x = random_values(cpu_native.MIN_NUMEL, 0)
    get_codec("int8").encode(x)
    assert K.last_backend() == "reference"
    K.encode(get_codec("int8"), x, backend="cpu")  # forcing it still works
    assert K.last_backend() == "cpu"
    with pytest.raises(TypeError, match="enabled must be a bool or None"):
        K.set_cpu_kernels("yes")  # type: ignore[arg-type]


def test_forced_cpu_backend_errors() -> None:
    x = torch.zeros(cpu_native.MIN_NUMEL)

    class MyInt(IntCodec):  # a subclass may change what its reference computes
        codec_id: ClassVar[str] = "test_my_int"

    class MyBF16(BF16Codec):
        codec_id: ClassVar[str] = "test_my_bf16"

    for codec in (get_codec("omnireduce"), MyBF16(), MyInt()):
        with pytest.raises(NotImplementedError, match="no native CPU kernel for encode"):
            K.encode(codec, x, backend="cpu")
        codec.encode(x)  # auto: the reference
        assert K.last_backend() == "reference"
    meta = torch.empty(64, device="meta")
    with pytest.raises(ValueError, match="backend='cpu' runs CPU tensors"):
        K.encode(get_codec("int8"), meta, backend="cpu")
    with pytest.raises(ValueError, match="backend must be one of .*'cpu'"):
        K.encode(get_codec("int8"), x, backend="native")


# -- building, caching and the fallback ---------------------------------------------------------


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget the loaded library (restored afterwards) and use an empty cache directory."""
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "_FAILURE", None)
    monkeypatch.setenv("DYNAMIQ_CACHE", str(tmp_path))
    return tmp_path / "cpu-kernels"


def test_no_compiler_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, fresh_state: Path
) -> None:
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    codec = get_codec("int8")
    x = random_values(cpu_native.MIN_NUMEL, 0)
    with pytest.warns(cpu_native.CPUKernelsUnavailableWarning, match="no C\\+\\+ compiler"):
        payload = codec.encode(x)
    assert K.last_backend() == "reference"
    assert_bytes_equal(payload, codec._encode(x, HopContext()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: not again, and not retried
        codec.encode(x)
        assert not cpu_native.available()
    with pytest.raises(RuntimeError, match="native CPU kernels are unavailable"):
        K.encode(codec, x, backend="cpu")


def test_failed_build_falls_back(monkeypatch: pytest.MonkeyPatch, fresh_state: Path) -> None:
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.warns(cpu_native.CPUKernelsUnavailableWarning, match="false"):
        assert not cpu_native.available()
    assert not list(fresh_state.glob("*.so"))  # nothing half-written left in the cache


@pytest.mark.slow  # ~22 s: a real build into a fresh cache (the suite's first use builds too)
def test_builds_once_then_loads_from_the_cache(
    monkeypatch: pytest.MonkeyPatch, fresh_state: Path
) -> None:
    """A real build into an empty cache (a few seconds), then a load without building."""
    assert cpu_native.available()
    built = list(fresh_state.glob("*.so"))
    assert built == [cpu_native.library_path()]
    monkeypatch.setattr(cpu_native, "_LIB", None)

    def no_build(*args: Any) -> None:
        raise AssertionError("rebuilt although the library was cached")

    monkeypatch.setattr(cpu_native, "_build", no_build)
    codec = get_codec("mxfp8_e4m3")
    x = edge_values(codec)
    assert_bytes_equal(K.encode(codec, x, backend="cpu"), codec._encode(x, HopContext()))
