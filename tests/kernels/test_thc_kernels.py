"""THC's Triton kernels against its PyTorch reference, bit for bit (docs/design.md,
"House style", item 7).

Every test computes the reference (``backend="reference"``) beside the kernel
(``backend="triton"``, forced) on the same device and compares payload bytes, or the int32
views of fp32 values (NaN by position), with no tolerance, and checks that a THC kernel
launched. Blocks are small (8 .. 256 values) so that Triton's interpreter runs every
configuration in seconds; one test runs the default configuration (blocks of 16384).

Contexts come with and without agreed scales (``ctx.shared`` from the codec's ``prologue``
over a fake all-gather): with them the homomorphic reduce runs, without them every encode
takes its two-kernel path and the reduce re-encodes ``decode(payload) + local``.

Without CUDA the kernels run in Triton's interpreter (``kernel_harness.py``); with CUDA the
same tests run natively (``-m gpu`` selects them).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from kernel_harness import DEVICE, assert_bytes_equal, assert_values_equal, interpreted_imports
from kernel_harness import both as _both

with interpreted_imports():
    import dynamiq.kernels as K
    from dynamiq.kernels import thc as kthc

from dynamiq.codecs import HopContext, ThcCodec
from dynamiq.codecs.thc import SHARED_KEY

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("triton_interpreter")]

_KERNEL = {K.decode: "_thc_decode_kernel"}


class _World:
    """A fake communicator: the all-gather of ``ranks`` tensors (this rank's first)."""

    def __init__(self, *others: torch.Tensor) -> None:
        self.others = others

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t, *self.others]


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn`` on the reference and on Triton (forced), with a proof that a kernel ran."""
    return _both(fn, *args, kernel=_KERNEL.get(fn))


def gaussian(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(DEVICE)


def agreed(codec: ThcCodec, numel: int, seed: int) -> dict[str, Any]:
    """Agreed scales of a buffer of ``numel`` values over two ranks."""
    mine = gaussian(numel, seed).cpu()
    other = ThcCodec.prologue(codec, gaussian(numel, seed + 1).cpu() * 3, _World())[SHARED_KEY]
    return codec.prologue(mine, _World(torch.tensor(other, dtype=torch.float32)))


def check_all(
    codec: ThcCodec,
    x: torch.Tensor,
    local: torch.Tensor,
    ctx: HopContext,
    out_ctx: HopContext,
    what: str,
) -> None:
    """Encode, decode and reduce (of the reference's payload) on both backends: all equal."""
    n = x.numel()
    got, want = both(K.encode, codec, x, ctx)
    if want is None:  # both raised the same ValueError
        return
    assert_bytes_equal(got, want, f"{what}: encode")
    got_v, want_v = both(K.decode, codec, want, n, ctx)
    assert_values_equal(got_v, want_v, f"{what}: decode")
    got_r, want_r = both(K.reduce, codec, want, local, ctx, out_ctx)
    if want_r is not None:
        assert_bytes_equal(got_r, want_r, f"{what}: reduce")


def contexts(
    k_in: int, k_out: int, offset: int, shared: dict[str, Any] | None
) -> tuple[HopContext, HopContext]:
    ctx = HopContext(
        seed=7, step=3, hop=1, num_hops=8, rank=2, contributions=k_in, offset=offset,
        shared=shared,
    )  # fmt: skip
    out_ctx = HopContext(
        seed=7, step=3, hop=2, num_hops=8, rank=5, contributions=k_out, offset=offset,
        shared=shared,
    )  # fmt: skip
    return ctx, out_ctx


# -- every configuration ------------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "requantize_64": {"block_size": 64},
    "widen_64": {"block_size": 64, "variant": "widen"},
    "requantize_256_max_seg2": {"block_size": 256, "scale": "max", "scale_blocks": 2},
    "widen_256_one_segment": {"block_size": 256, "variant": "widen", "scale_blocks": 0},
    "requantize_growth1_clip": {"block_size": 128, "growth": 1.0, "clip": 3.0},
    "table5_seed": {"block_size": 32, "table": (0, 2, 5, 8, 10), "rotation_seed": 2**40 + 3},
    "widen_block8": {"block_size": 8, "variant": "widen", "scale_blocks": 3},
    "requantize_block2": {"block_size": 2, "scale": "max"},
}
#: (k_in, k_out) of a reduce: one hop, several, widening to 9+ bits, m = 0 (no homomorphism)
KS = ((1, 2), (2, 5), (3, 40), (4, 4))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("with_shared", [True, False], ids=["agreed", "local"])
def test_configs_bit_exact(name: str, with_shared: bool) -> None:
    """2.4 blocks plus a short last block (zero-padded to a power of two), random values,
    contexts with and without agreed scales, and several contribution counts."""
    codec = ThcCodec(**CONFIGS[name])
    i = list(CONFIGS).index(name)
    n = 2 * codec.block_size + codec.block_size * 2 // 5 + 1
    offset = 3 * codec.block_size
    shared = agreed(codec, offset + n, i) if with_shared else None
    for j, (k_in, k_out) in enumerate(KS):
        x = gaussian(n, 10 * i + j, scale=math.sqrt(k_in))
        local = gaussian(n, 10 * i + j + 5, scale=2.0**-j)
        ctx, out_ctx = contexts(k_in, k_out, offset, shared)
        check_all(codec, x, local, ctx, out_ctx, f"{name} k={k_in}->{k_out}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs(dtype: torch.dtype) -> None:
    codec = ThcCodec(block_size=64, variant="widen")
    n = 200
    shared = agreed(codec, n, 3)
    for shared_ in (shared, None):
        ctx, out_ctx = contexts(2, 3, 0, shared_)
        x = gaussian(n, 1).to(dtype)
        check_all(codec, x, gaussian(n, 2).to(dtype), ctx, out_ctx, f"{dtype}")


@pytest.mark.parametrize("n", [1, 5, 64, 65, 100])
def test_remainders(n: int) -> None:
    """A single value, a short block alone, one block exactly, one more, a long tail."""
    codec = ThcCodec(block_size=64)
    shared = agreed(codec, n, n)
    ctx, out_ctx = contexts(1, 2, 0, shared)
    check_all(codec, gaussian(n, n), gaussian(n, n + 1), ctx, out_ctx, f"n={n}")


def test_offsets_across_2_32() -> None:
    """Global indices beyond 2^32 (the hash's high word) and a payload re-encoded at another
    offset (no homomorphic path)."""
    codec = ThcCodec(block_size=64, scale_blocks=0)
    n = 300
    shared = {SHARED_KEY: 0.75}
    for offset in (2**32 - 100, 2**40 + 64):
        ctx, out_ctx = contexts(2, 3, offset, shared)
        check_all(codec, gaussian(n, 1), gaussian(n, 2), ctx, out_ctx, f"offset {offset}")
        moved = HopContext(contributions=3, offset=offset + 64, shared=shared)
        p = K.encode(codec, gaussian(n, 3), ctx, backend="reference")
        got, want = both(K.reduce, codec, p, gaussian(n, 4), ctx, moved)
        assert_bytes_equal(got, want, "reduce to another offset")


def test_default_config() -> None:
    """The default codec: blocks of 16384 (14 butterfly stages), a short last block."""
    codec = ThcCodec()
    n = 16384 + 3000
    shared = agreed(codec, n, 0)
    ctx, out_ctx = contexts(1, 2, 0, shared)
    check_all(codec, gaussian(n, 0), gaussian(n, 1), ctx, out_ctx, "default")
    got, want = both(K.encode, codec, gaussian(n, 2), HopContext())
    assert_bytes_equal(got, want, "default, local scales")


@pytest.mark.parametrize("tile", [64, 128], ids=["one_block", "two_blocks"])
def test_program_boundaries(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One or two blocks per program: many programs, each writing whole bytes of 4-bit and
    11-bit codes, the short last block in a program of its own."""
    monkeypatch.setattr(kthc, "tile_elems", lambda device: tile)
    for variant in ("requantize", "widen"):
        codec = ThcCodec(block_size=64, variant=variant)
        n = 64 * 7 + 20
        x, local = gaussian(n, 1), gaussian(n, 2)
        x[64 * 4] = math.nan
        for shared in (agreed(codec, n, 4), None):
            ctx, out_ctx = contexts(3, 40, 0, shared)
            check_all(codec, x, local, ctx, out_ctx, f"{variant} tile {tile}")


# -- NaN/Inf, zeros, errors ---------------------------------------------------------------------


def test_nonfinite_blocks() -> None:
    """Blocks holding NaN or ±Inf are flagged and decode to NaN; in a reduce the incoming
    flags, a local NaN block (the re-encode of every block) and a local Inf block."""
    codec = ThcCodec(block_size=64, variant="widen")
    n = 64 * 5 + 10
    x = gaussian(n, 1)
    x[3] = math.nan
    x[64 * 2 + 7] = -math.inf
    x[-1] = math.inf  # the short last block
    local = gaussian(n, 2)
    local[64 * 3 + 1] = math.nan
    for shared in (agreed(codec, n, 1), None):
        ctx, out_ctx = contexts(2, 4, 0, shared)
        check_all(codec, x, local, ctx, out_ctx, f"nan in both, shared={shared is not None}")
        check_all(codec, gaussian(n, 3), local, ctx, out_ctx, "a local NaN block only")
        check_all(codec, x, gaussian(n, 4), ctx, out_ctx, "incoming NaN blocks only")
    got, _ = both(K.encode, codec, x, HopContext())
    values = K.decode(codec, got, n, HopContext(), backend="triton").cpu()
    assert bool(values[:64].isnan().all()) and bool(values[128:192].isnan().all())
    assert bool(values[64:128].isfinite().all()) and bool(values[-10:].isnan().all())


def test_zeros_and_empty() -> None:
    codec = ThcCodec(block_size=64)
    x = torch.zeros(200, device=DEVICE)
    x[70] = -0.0
    for shared in (agreed(codec, 200, 0), None, {SHARED_KEY: 0.0}):
        ctx, out_ctx = contexts(1, 2, 0, shared)
        check_all(codec, x, x, ctx, out_ctx, f"zeros {shared}")
    before = K.launch_counts()
    empty = torch.zeros(0, device=DEVICE)
    payload = K.encode(codec, empty, backend="triton")
    assert payload.numel() == 0
    assert K.decode(codec, payload, 0, backend="triton").numel() == 0
    assert K.reduce(codec, payload, empty, backend="triton").numel() == 0
    assert K.launch_counts() == before


def test_beyond_max_input_abs_raises_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Encode and both reduce paths raise the reference's ValueError (``both`` compares the
    messages); the re-encode of a sum beyond the range too, found by a program other than
    the one holding the NaN block (one block per program)."""
    monkeypatch.setattr(kthc, "tile_elems", lambda device: 64)
    codec = ThcCodec(block_size=64)
    n = 200
    big = gaussian(n, 1)
    big[100] = codec.max_input_abs * 2
    shared = agreed(codec, n, 1)
    ctx, out_ctx = contexts(1, 2, 0, shared)
    assert both(K.encode, codec, big, ctx) == (None, None)
    assert both(K.encode, codec, big, HopContext()) == (None, None)
    payload = K.encode(codec, gaussian(n, 2), ctx, backend="reference")
    assert both(K.reduce, codec, payload, big, ctx, out_ctx) == (None, None)
    assert both(K.reduce, codec, payload, big, ctx, HopContext()) == (None, None)
    # local within the range, the sum beyond it, in a block the homomorphic path cannot
    # take (a local NaN elsewhere): every block is re-encoded and range-checked
    near = gaussian(n, 3)
    near[:64] = codec.max_input_abs
    near[150] = math.nan
    hctx, hout = contexts(1, 2, 0, {SHARED_KEY: codec.max_input_abs})
    p = K.encode(codec, near.nan_to_num(0.0), hctx, backend="reference")
    with pytest.raises(ValueError, match="exceeds max_input_abs"):
        codec.reduce(p, near, hctx, hout)
    assert both(K.reduce, codec, p, near, hctx, hout) == (None, None)
    # the same without the NaN: every block is homomorphic, nothing is range-checked
    got, want = both(K.reduce, codec, p, near.nan_to_num(0.0), hctx, hout)
    assert_bytes_equal(got, want, "homomorphic near the range")


def test_arbitrary_payloads() -> None:
    """Random payload bytes: table indices beyond a 5-entry table, any ranges (negative, NaN
    and Inf ranges raise alike) decode and reduce like the reference."""
    codec = ThcCodec(block_size=32, table=(0, 2, 5, 8, 10))
    g = torch.Generator().manual_seed(11)
    n = 100
    shared = agreed(codec, n, 5)
    for trial in range(6):
        ctx, out_ctx = contexts(1, 2, 0, shared if trial % 2 else None)
        payload = torch.randint(0, 256, (codec.encoded_nbytes(n, ctx),), generator=g)
        payload = payload.to(torch.uint8)
        if trial >= 2:  # sane ranges, random codes (indices 5..7 are corrupt)
            payload[:16] = torch.tensor([0.5, 1.0, 2.0, 0.25]).view(torch.uint8)
        if trial >= 4:  # valid indices only: codes < 5 everywhere
            body = payload[17:]
            body.copy_(torch.zeros_like(body))
        payload = payload.to(DEVICE)
        got, want = both(K.decode, codec, payload, n, ctx)
        if want is not None:
            assert_values_equal(got, want, f"decode {trial}")
        got, want = both(K.reduce, codec, payload, gaussian(n, trial), ctx, out_ctx)
        if want is not None:
            assert_bytes_equal(got, want, f"reduce {trial}")


def test_mismatched_ranges_reencode() -> None:
    """A payload encoded without the agreed scales (other ranges): the reduce re-encodes
    those blocks, homomorphically adds the rest."""
    codec = ThcCodec(block_size=64, scale_blocks=1)
    n = 256
    shared = agreed(codec, n, 2)
    ctx, out_ctx = contexts(1, 3, 0, shared)
    payload = K.encode(codec, gaussian(n, 1), HopContext(), backend="reference")
    # segments 1 and 3 with the agreed range: homomorphic there
    agreed_p = K.encode(codec, gaussian(n, 1), ctx, backend="reference")
    payload[4:8] = agreed_p[4:8]
    payload[12:16] = agreed_p[12:16]
    got, want = both(K.reduce, codec, payload, gaussian(n, 2), ctx, out_ctx)
    assert_bytes_equal(got, want, "mixed ranges")


def test_malformed_shared_raises_alike() -> None:
    codec = ThcCodec(block_size=64)
    x = gaussian(300, 1)
    for bad in ((1.0,), (1.0, -2.0, 1.0, 1.0, 1.0)):
        ctx = HopContext(shared={SHARED_KEY: bad})
        assert both(K.encode, codec, x, ctx) == (None, None)
    with pytest.raises(TypeError, match="must be a number or a sequence"):
        K.encode(codec, x, HopContext(shared={SHARED_KEY: object()}), backend="triton")


# -- the dispatcher ---------------------------------------------------------------------------


def test_dispatch_runs_the_thc_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = ThcCodec(block_size=64)
    assert K.has_kernels(codec, "encode") and K.has_kernels(codec, "reduce")
    x = gaussian(130, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    K._settings.refresh()  # (read once otherwise)
    before = K.launch_counts().get("_thc_encode_kernel", 0)
    payload = codec.encode(x)  # "auto": the kernel on CUDA, and on the CPU when asked
    assert K.last_backend() == "triton"
    assert K.launch_counts()["_thc_encode_kernel"] == before + 2  # two passes: local scales
    assert_bytes_equal(payload, K.encode(codec, x, backend="reference"), "auto encode")
    assert kthc.SRC_ROTATED == 2
