"""The OmniReduce codec's Triton kernels against its PyTorch reference, bit for bit (docs/design.md,
"House style", item 7).

Every test computes the reference (``backend="reference"``) beside the kernels
(``backend="triton"``, forced) on the same device, with a proof that the kernel writing the
result launched, and compares with no tolerance: payloads byte for byte (every NaN a payload
carries is its value format's canonical NaN, fp32 included, so no NaN bits are the hardware's
choice), decoded fp32 values as int32 views with NaN by position. Densities 1, 0.5, 0.1 (and
others), every value format, block sizes from 1 to larger than a kernel tile (also in the
GPU's tiles), short last blocks, the rule with and without ``ctx.shared``, offsets, ties,
NaN/±Inf/zero/-0.0/subnormal/saturating blocks, arbitrary payloads; the canonical NaN's bytes.

On the CPU the reference's own pass-through conversions run on their PyTorch reference too
(``TRITON_INTERPRET`` is unset around each test; the dispatcher switches the interpreter on
for the Triton launches): the comparison does not rest on another Triton kernel. Without CUDA
the kernels run in Triton's interpreter; with CUDA the same tests run natively (``-m gpu``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_harness import (
    DEVICE,
    assert_bytes_equal,
    assert_values_equal,
    cycle_blocks,
    interpreted_imports,
    random_values,
)
from kernel_harness import both as _both

with interpreted_imports():
    import dynamiq.kernels as K
    from dynamiq.kernels import omnireduce as komni

from dynamiq.codecs import HopContext, OmniReduceCodec
from dynamiq.codecs.omnireduce import THRESHOLD_KEY, TIE_KEY

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]

_KERNEL = {K.encode: "_omni_write_kernel", K.reduce: "_omni_write_kernel"}
_KERNEL[K.decode] = "_omni_decode_kernel"


@pytest.fixture(autouse=True)
def _pure_reference(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """On the CPU, the reference's nested pass-through calls run their PyTorch reference."""
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        K._settings.refresh()  # (read once otherwise)
    yield


# -- comparisons ------------------------------------------------------------------------------


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn`` on the reference and on Triton (forced), with a proof that its kernel ran."""
    return _both(fn, *args, kernel=_KERNEL[fn])


def assert_payload_equal(
    codec: OmniReduceCodec, got: torch.Tensor, want: torch.Tensor, n: int, what: str
) -> None:
    """Same size and bitmap; values byte for byte (NaN included: it is canonical)."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, f"{what}: {got.numel()} bytes != {want.numel()}"
    head = -(-codec._nblocks(n) // 8)
    assert_bytes_equal(got[:head], want[:head], f"{what} bitmap")
    assert_bytes_equal(got[head:], want[head:], f"{what} values")


def fp32_values(codec: OmniReduceCodec, payload: torch.Tensor, n: int) -> torch.Tensor:
    """The int32 bit patterns of an fp32-valued payload's values (after its bitmap)."""
    head = -(-codec._nblocks(n) // 8)
    return payload.cpu()[head:].clone().view(torch.int32)


def check_all(
    codec: OmniReduceCodec,
    x: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    what: str,
) -> None:
    """Encode, decode and reduce on the reference and on Triton: all bit-exact."""
    n = x.numel()
    got, want = both(K.encode, codec, x, ctx)
    assert_payload_equal(codec, got, want, n, f"{what} encode")
    got_v, want_v = both(K.decode, codec, want, n, ctx)
    assert_values_equal(got_v, want_v, f"{what} decode")
    got_r, want_r = both(K.reduce, codec, want, local, ctx, out_ctx)
    assert_payload_equal(codec, got_r, want_r, n, f"{what} reduce")


# -- inputs -----------------------------------------------------------------------------------


def blocky(n: int, b: int, seed: int) -> torch.Tensor:
    """Mixed magnitudes within blocks (squares spread over 2^-80..2^80: the fp64 norms depend
    on the order of the sums), block scales 2^0..2^12, every fifth block zero."""
    g = torch.Generator().manual_seed(seed)
    x = random_values(n, seed, spread=20)
    scale = torch.exp2(torch.randint(0, 13, (-(-n // b),), generator=g).float())
    x = x * scale.repeat_interleave(b)[:n]
    for i in range(0, -(-n // b), 5):
        x[i * b : (i + 1) * b] = 0.0
    return x


def edge_values(n: int, b: int, seed: int) -> torch.Tensor:
    """Blocks of special content: zeros, -0.0, fp32 subnormals, huge values (beyond bf16's and
    fp16's largest), NaN, ±Inf, bf16/fp16 rounding ties, equal-norm blocks (ties of the rule),
    a tiny block."""
    g = torch.Generator().manual_seed(seed)
    kinds = [
        lambda m: torch.zeros(m),
        lambda m: -torch.zeros(m),
        lambda m: torch.randint(-(2**23), 2**23, (m,), generator=g).float() * 2.0**-149,
        lambda m: torch.where(torch.arange(m) % 3 == 0, 3.3999e38, -7.0e4),
        lambda m: torch.where(torch.arange(m) == m // 2, math.nan, 1.0),
        lambda m: torch.full((m,), 0.5).index_fill(0, torch.tensor([0]), math.inf),
        lambda m: torch.where(torch.arange(m) == m - 1, -math.inf, 3.0e-3),
        lambda m: torch.full((m,), 1.0 + 2.0**-8) * torch.where(torch.arange(m) % 2 == 0, 1, -1),
        lambda m: torch.full((m,), 0.75),
        lambda m: torch.full((m,), -0.75),
        lambda m: torch.full((m,), 1.0 + 2.0**-11),
        lambda m: torch.randn(m, generator=g) * 1e-30,
        lambda m: torch.full((m,), 0.75),
    ]
    return cycle_blocks(kinds, n, b)


def shared_rule(codec: OmniReduceCodec, whole: torch.Tensor) -> dict[str, Any] | None:
    """The rank's rule over a whole buffer (the prologue: no communication)."""
    return codec.prologue(whole, None)  # type: ignore[arg-type]


# -- configurations ---------------------------------------------------------------------------

#: (density, block_size, value_format)
CONFIGS = [
    (1.0, 256, "auto"),
    (1.0, 16, "bf16"),
    (1.0, 8, "fp16"),
    (0.5, 32, "auto"),
    (0.5, 8, "fp32"),
    (0.5, 1, "fp16"),
    (0.1, 16, "auto"),
    (0.1, 4, "fp16"),
    (0.1, 64, "fp32"),
    (0.3, 2, "bf16"),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize(("density", "bs", "fmt"), CONFIGS, ids=[str(c) for c in CONFIGS])
def test_configs_bit_exact(density: float, bs: int, fmt: str) -> None:
    """Random and edge-case inputs (a short last block) in every input dtype; the rule from
    the payload itself (with an offset) and from ``ctx.shared``."""
    codec = OmniReduceCodec(density=density, block_size=bs, value_format=fmt)
    k = CONFIGS.index((density, bs, fmt))
    n = bs * 27 + max(1, bs // 3)  # 28 blocks, the last one short
    x = blocky(n, bs, k).to(DTYPES[k % 3]).to(DEVICE)
    edge = edge_values(n, bs, k).to(DTYPES[(k + 1) % 3]).to(DEVICE)
    plain = HopContext(offset=bs * 1000 + 5)
    check_all(codec, x, edge, plain, HopContext(offset=bs * 1000 + 5, rank=1), f"{k} random")
    check_all(codec, edge, x, HopContext(), HopContext(), f"{k} edge")
    # the rule of a whole buffer this chunk is the second part of
    whole = torch.cat([blocky(bs * 9, bs, k + 50), edge.float().cpu()]).to(DEVICE)
    sx = HopContext(offset=bs * 9, shared=shared_rule(codec, whole))
    sl = HopContext(offset=bs * 9, shared=shared_rule(codec, torch.flip(whole, [0])))
    check_all(codec, edge, x, sx, sl, f"{k} shared")


@pytest.mark.parametrize("density", [1.0, 0.5, 0.1])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 65, 257])
def test_remainders(density: float, n: int) -> None:
    """Short inputs and short last blocks around the bitmap's bytes (8 blocks each)."""
    codec = OmniReduceCodec(density=density, block_size=8)
    x = blocky(n, 8, n).to(DEVICE)
    local = edge_values(n, 8, n).to(torch.bfloat16).to(DEVICE)
    check_all(codec, x, local, HopContext(offset=8 * n), HopContext(offset=8 * n), f"n={n}")


def test_ties_go_to_the_lower_global_index() -> None:
    """Every block has the same norm: the ``K``-th block (and so the sent ones) is decided by
    the global block index, with and without an offset, in the payload and in ``shared``."""
    codec = OmniReduceCodec(density=0.3, block_size=4)
    x = torch.tensor([0.5, -1.0, 2.0, 0.25]).repeat(20) * torch.tensor([1.0, -1.0]).repeat(40)
    x = x.to(DEVICE)
    local = torch.tensor([2.0, 0.5, -1.0, -0.25]).repeat(20).to(DEVICE)
    for off in (0, 4 * 7, 2**40):
        check_all(codec, x, local, HopContext(offset=off), HopContext(offset=off), f"off={off}")
    # the rule (τ, i*) on a tie in the middle of this chunk: blocks past i* are not sent
    norm = float(torch.tensor([0.5, -1.0, 2.0, 0.25]).double().square().sum())
    for tie in (-1, 3, 11, 10**6):
        ctx = HopContext(offset=0, shared={THRESHOLD_KEY: norm, TIE_KEY: tie})
        got, want = both(K.encode, codec, x, ctx)
        assert_payload_equal(codec, got, want, x.numel(), f"tie={tie}")
        got, want = both(K.reduce, codec, want, local, ctx, ctx)
        assert_payload_equal(codec, got, want, x.numel(), f"reduce tie={tie}")


@pytest.mark.parametrize("bs", [1, 8, 256, "tile", "4 tiles"])
def test_block_norms_are_the_reference_tree(bs: int | str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's fp64 block norms (alone and of ``decode(payload) + local``) equal the
    reference's pairwise tree bit for bit, also for blocks larger than a kernel tile (strided
    slices); on these magnitudes a plain sequential sum differs."""
    tile = komni.tile_elems(torch.device(DEVICE))
    b = {"tile": tile, "4 tiles": 4 * tile}.get(str(bs), bs)
    assert isinstance(b, int)
    n = 3 * b + max(1, b // 3)
    codec = OmniReduceCodec(density=1.0, block_size=b)
    x = random_values(n, b, spread=30).to(DEVICE)
    local = random_values(n, b + 1, spread=30).to(torch.bfloat16).to(DEVICE)
    payload = K.encode(codec, x, backend="reference")
    want = codec._norms(x.float())
    want_l = codec._norms(local.float())
    want_t = codec._norms(K.decode(codec, payload, n, backend="reference") + local.float())
    blocks, head = komni._unpack(codec, payload, n)
    with monkeypatch.context() as m:  # the launchers called directly
        if DEVICE == "cpu":
            m.setenv("TRITON_INTERPRET", "1")
        got, _ = komni._block_norms(codec, x, None)
        got_l, got_t = komni._block_norms(codec, local, komni._Incoming(payload, blocks, head))
    assert got_t is not None
    for g, w in ((got, want), (got_l, want_l), (got_t, want_t)):
        assert torch.equal(g.cpu().view(torch.int64), w.cpu().view(torch.int64))
    if b >= 256:  # the test can fail: a sequential sum of the same squares differs
        seq = x[: 3 * b].double().square().view(3, b).cumsum(1)[:, -1]
        assert bool((seq.cpu() != want[:3].cpu()).any())


@pytest.mark.parametrize("bs", [4, 256, pytest.param("2 tiles", marks=pytest.mark.slow)])
def test_threshold_on_a_block_norm(bs: int | str) -> None:
    """``ctx.shared``'s ``τ`` set to the reference norm of one block and ``i*`` just at and
    below its index: whether that block is sent depends on the last bit of its norm."""
    b = 2 * komni.tile_elems(torch.device(DEVICE)) if bs == "2 tiles" else bs
    assert isinstance(b, int)
    n = 6 * b
    x = random_values(n, 7, spread=30)
    x[b : 2 * b] = x[:b].flip(0)  # the same squares in another order
    norms = OmniReduceCodec(block_size=b)._norms(x)
    codec = OmniReduceCodec(density=0.5, block_size=b)
    x, local = x.to(DEVICE), random_values(n, 8).to(DEVICE)
    for j in range(4):
        for tie in (j - 1, j):
            ctx = HopContext(shared={THRESHOLD_KEY: float(norms[j]), TIE_KEY: tie})
            got, want = both(K.encode, codec, x, ctx)
            assert_payload_equal(codec, got, want, n, f"block {j} tie {tie}")
            got, want = both(K.reduce, codec, want, local, ctx, ctx)
            assert_payload_equal(codec, got, want, n, f"reduce block {j} tie {tie}")


def test_large_blocks() -> None:
    """Blocks larger than a kernel tile, with every density and the default block size."""
    bs = 4 * komni.tile_elems(torch.device(DEVICE))
    n = 3 * bs + 5
    x = random_values(n, 3, spread=30)
    x[bs : 2 * bs] = x[:bs].flip(0)
    x, local = x.to(DEVICE), random_values(n, 4, spread=30).to(torch.float16).to(DEVICE)
    for density in (1.0, 0.5):
        codec = OmniReduceCodec(density=density, block_size=bs)
        check_all(codec, x, local, HopContext(), HopContext(), f"bs={bs} density={density}")
    codec = OmniReduceCodec(density=0.5)  # block_size 256, bf16
    check_all(codec, x, local, HopContext(offset=256), HopContext(), "default blocks")


def test_nonfinite_zero_and_negative_zero_blocks() -> None:
    """NaN/±Inf blocks are always sent and take no place; all-zero blocks (``-0.0`` too) are
    never sent and decode to ``+0.0``; ``-0.0`` in a sent block stays ``-0.0``; a reduce adds
    ``+0.0`` where the payload has no block (``-0.0`` local values become ``+0.0``)."""
    b = 8
    x = torch.zeros(8 * b)
    x[b : 2 * b] = -0.0
    x[2 * b : 3 * b] = torch.tensor([-0.0, 1.0, -0.0, 2.0, 0.0, -3.0, -0.0, 4.0])
    x[3 * b + 2] = math.nan
    x[4 * b + 7] = -math.inf
    x[5 * b : 6 * b] = 1e-3
    x[6 * b] = math.inf
    x[6 * b + 1] = -math.inf  # Inf and -Inf: the square is Inf, never NaN
    local = -torch.zeros(8 * b)
    local[7 * b :] = 5.0
    local[3 * b + 1] = math.nan
    for density, fmt in ((1.0, "auto"), (0.1, "auto"), (0.1, "fp16"), (0.5, "fp32")):
        codec = OmniReduceCodec(density=density, block_size=b, value_format=fmt)
        check_all(codec, x.to(DEVICE), local.to(DEVICE), HopContext(), HopContext(), fmt)
        got = K.decode(codec, K.encode(codec, x.to(DEVICE), backend="triton"), x.numel(),
                       backend="triton").cpu()  # fmt: skip
        assert torch.equal(got[: 2 * b].view(torch.int32), torch.zeros(2 * b, dtype=torch.int32))
        assert math.isnan(float(got[3 * b + 2])) and float(got[6 * b]) == math.inf


def test_arbitrary_payloads() -> None:
    """Random bitmaps and value bytes (NaN, Inf, subnormal values; unused bitmap bits set)
    decode and reduce like the reference; wrong lengths raise the reference's errors."""
    g = torch.Generator().manual_seed(5)
    for fmt, bs, n in (("fp32", 4, 37), ("bf16", 8, 100), ("fp16", 2, 33)):
        codec = OmniReduceCodec(density=0.5, block_size=bs, value_format=fmt)
        nb = -(-n // bs)
        head = -(-nb // 8)
        bitmap = torch.randint(0, 256, (head,), generator=g).to(torch.uint8)
        sent = [(int(bitmap[i // 8]) >> (i % 8)) & 1 for i in range(nb)]
        count = sum(min(bs, n - i * bs) for i in range(nb) if sent[i])
        body = torch.randint(0, 256, (count * codec.values.dtype.itemsize,), generator=g)
        payload = torch.cat([bitmap, body.to(torch.uint8)]).to(DEVICE)
        got, want = both(K.decode, codec, payload, n, HopContext())
        assert_values_equal(got, want, f"decode {fmt}")
        local = random_values(n, 9).to(DEVICE)
        got, want = both(K.reduce, codec, payload, local, HopContext(), HopContext(offset=8))
        assert_payload_equal(codec, got, want, n, f"reduce {fmt}")
        for bad in (payload[:-1], torch.cat([payload, payload[:1]]), payload[: head - 1]):
            got, want = both(K.decode, codec, bad.contiguous(), n, HopContext())
            assert got is None and want is None  # both raised the same ValueError
            got, want = both(K.reduce, codec, bad.contiguous(), local, HopContext())
            assert got is None and want is None


def test_empty_inputs_need_no_launch() -> None:
    codec = OmniReduceCodec(density=0.5, block_size=16)
    before = K.launch_counts()
    payload = K.encode(codec, torch.zeros(0, device=DEVICE), backend="triton")
    assert payload.numel() == 0 and K.last_backend() == "triton"
    assert K.decode(codec, payload, 0, backend="triton").numel() == 0
    assert K.reduce(codec, payload, torch.zeros(0, device=DEVICE), backend="triton").numel() == 0
    assert K.launch_counts() == before


def test_registered_for_the_codec_only() -> None:
    """The built-in map names the class: every operation has a kernel, a subclass has none."""
    codec = OmniReduceCodec()
    assert all(K.has_kernels(codec, op) for op in ("encode", "decode", "reduce"))

    class Sub(OmniReduceCodec):
        codec_id = "omnireduce_sub_kernels_test"

    assert not K.has_kernels(Sub())


# -- NaN bits and the GPU's tile geometry (benchmarks/gpu_check.py on an H200) ----------------

#: the canonical quiet NaN every fp32 value of a payload is written with
CANONICAL_NAN = 0x7FC00000


def _nan_bits(*patterns: int) -> torch.Tensor:
    """fp32 values with the given bit patterns (NaN with payloads and signs)."""
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("density", [1.0, 0.5])
def test_fp32_values_carry_the_canonical_nan(density: float) -> None:
    """Every NaN of an fp32-valued payload is ``0x7fc00000``, from the reference and the
    kernels alike: whatever NaN the input held (sign, payload, signalling), and NaN made by a
    conversion (fp16/bf16 -> fp32: torch's CPU cast writes ``0x7fc00000`` in its vectorised
    body and ``0x7fffffff`` in its scalar tail, a GPU its own) or by a sum (``inf + -inf`` is
    ``0xffc00000`` on x86, ``0x7fffffff`` on a GPU). The expected bytes are built here: the
    input's fp32 bits with NaN replaced by position."""
    b = 4
    codec = OmniReduceCodec(density=density, block_size=b, value_format="fp32")
    odd = _nan_bits(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA5A5A5, 0xFFC00001)
    fp32 = torch.cat([odd, torch.tensor([1.0, -2.0, 3.0]), odd.flip(0), torch.tensor([0.5])])
    n = fp32.numel()  # 16: four blocks, each holding NaN (always sent)
    half = torch.full((n,), 1.5, dtype=torch.float16)
    half[torch.arange(n) % 4 == 1] = math.nan  # body and tail of torch's vectorised cast
    half[-1] = -math.nan
    brain = fp32.to(torch.bfloat16)
    for x in (fp32, half, brain):
        isnan = torch.isnan(x.float())
        want_bits = torch.where(isnan, CANONICAL_NAN, x.float().view(torch.int32))
        got, want = both(K.encode, codec, x.to(DEVICE), HopContext())
        assert_payload_equal(codec, got, want, n, f"encode {x.dtype}")
        assert torch.equal(fp32_values(codec, want, n), want_bits), f"{x.dtype}: NaN bits"
    # reduce: NaN + x, x + NaN, NaN + NaN (two payloads) and inf + -inf
    first = torch.tensor([math.inf, 1.0, math.nan, -math.inf] * 4)
    local = torch.cat([_nan_bits(0xFFC00001), torch.tensor([-math.inf, 2.0, math.inf] * 5)])
    payload = K.encode(codec, first.to(DEVICE), backend="reference")
    for loc in (local, local.to(torch.float16)):
        got, want = both(K.reduce, codec, payload, loc.to(DEVICE), HopContext(), HopContext())
        assert_payload_equal(codec, got, want, n, f"reduce {loc.dtype}")
        total = first + loc.float()
        want_bits = torch.where(torch.isnan(total), CANONICAL_NAN, total.view(torch.int32))
        assert torch.equal(fp32_values(codec, want, n), want_bits), f"reduce {loc.dtype}"


def gpu_check_input(n: int, b: int, seed: int, first: int) -> torch.Tensor:
    """Like ``benchmarks/gpu_check.py``'s edge-case input: blocks (kinds ``first``,
    ``first + 1``, ... mod 8) of zeros, fp32 subnormals, ±2^100, ties, a NaN, a -Inf, tiny
    values, normal values; and a NaN in the last element (the scalar tail of torch's vectorised
    fp16 -> fp32 cast)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g).double()
    i = torch.arange(n)
    k = (i // b + first) % 8
    e = torch.where(k == 0, 0.0, e)
    e = torch.where(k == 1, e * 2.0**-140, e)
    e = torch.where(k == 2, torch.sign(e) * 2.0**100, e)
    e = torch.where(k == 3, (i % 64 - 32 + 0.5) * 2.0**-3, e)
    e = torch.where((k == 4) & (i % b == 0), math.nan, e)
    e = torch.where((k == 5) & (i % b == 1), -math.inf, e)
    e = torch.where(k == 6, e * 2.0**-24, e)
    e[-1] = math.nan
    return e.float()


@pytest.mark.parametrize("fmt", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
def test_gpu_tile_geometry(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU check's ``omnireduce_d0.1_fp32_b8192`` case with the GPU's tiles (2048 values:
    a block of 8192 is 4 strided slices), under the interpreter on the CPU: an fp16 input
    holding NaN and ±Inf (2^100 overflows fp16), a short last block; encode, decode and reduce
    bit for bit, the payloads byte for byte (on an H200 the fp32 payloads differed in their
    NaN bits only)."""
    tile = komni.tile_elems(torch.device("cuda"))  # what a GPU runs (no GPU needed)
    assert tile < 8192
    monkeypatch.setattr(komni, "tile_elems", lambda device: tile)
    b = 8192
    n = 7 * b + 1699  # 8 blocks, the last one short (as 100003 = 12 · 8192 + 1699)
    codec = OmniReduceCodec(density=0.1, block_size=b, value_format=fmt)
    x = gpu_check_input(n, b, 7, first=1).to(torch.float16).to(DEVICE)
    local = random_values(n, 11, spread=20).to(torch.float16).to(DEVICE)  # overflows: ±Inf
    check_all(codec, x, local, HopContext(offset=2**32 - 40), HopContext(), f"{fmt} edge")
    check_all(codec, local, x, HopContext(), HopContext(offset=2**32 - 40), f"{fmt} random")
