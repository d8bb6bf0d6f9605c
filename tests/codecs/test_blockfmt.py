"""Declarative block formats (dynamiq/codecs/blockfmt.py) and ``nvfp4`` against independent
references: ml_dtypes casts, the 16 E2M1 codes enumerated, the MX codecs' bytes, the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import pytest
import torch

from dynamiq.codecs import BlockCodec, HopContext, MXCodec, get_codec, list_codecs
from dynamiq.codecs.blockfmt import TENSOR_AMAX_KEY, finite_absmax_bits
from dynamiq.testing import check_allreduce_bound, check_block_locality
from dynamiq.testing.golden import golden_input

NVFP4 = get_codec("nvfp4")


def _sample(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g) / 3)
    x[::37] = 0.0
    x[5::41] *= 2.0**-60
    return x


def _ref_nvfp4(x: np.ndarray, amax: float, contributions: int = 1) -> bytes:
    """NVFP4 encoded with ml_dtypes casts (RNE, values clipped first: saturation), in numpy."""
    x = x.astype(np.float32)
    e = math.floor(math.log2(amax)) if amax > 0 else -150
    k = min(max(e + 1 + math.ceil(math.log2(contributions)) - 11, -117), 115)
    g = np.float32(2.0**k)
    blocks = -(-x.size // 16)
    xp = np.zeros(blocks * 16, np.float32)
    xp[: x.size] = x
    b = np.abs(xp.reshape(blocks, 16)).max(axis=1)
    t = b / np.float32(6.0 * 2.0**k)
    s8 = np.clip(t, 0, 448).astype(ml_dtypes.float8_e4m3fn)
    S = s8.astype(np.float32) * g
    Se = np.repeat(S, 16)[: x.size]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(Se > 0, x / np.where(Se > 0, Se, 1), 0).astype(np.float32)
    codes = np.clip(q, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    codes = np.where(Se > 0, codes, 0).astype(np.uint8)
    if codes.size % 2:
        codes = np.append(codes, 0).astype(np.uint8)
    packed = codes[0::2] | (codes[1::2] << 4)
    return g.tobytes() + s8.view(np.uint8).tobytes() + packed.astype(np.uint8).tobytes()


def test_e2m1_codes_enumerated() -> None:
    """Each of the 16 E2M1 codes in every nibble position decodes to ml_dtypes' value times
    the block and tensor scales."""
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    n = 32
    for scale_code, g in ((0x38, 1.0), (0x01, 2.0**-117), (0x7E, 2.0**20)):  # 1.0, 2^-9, 448
        vals = np.tile(codes, 2)
        packed = (vals[0::2] | (vals[1::2] << 4)).astype(np.uint8)
        head = np.array([g], np.float32).view(np.uint8)
        payload = np.concatenate([head, np.array([scale_code] * 2, np.uint8), packed])
        got = NVFP4.decode(torch.from_numpy(payload.copy()), n).numpy()
        s = np.array([scale_code], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        expect = np.tile(want, 2).astype(np.float64) * float(s[0]) * g
        assert np.array_equal(got.astype(np.float64), expect)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("contributions", [1, 3])
def test_nvfp4_matches_ml_dtypes(backend: str, contributions: int) -> None:
    """The reference and the native kernel write the ml_dtypes recomputation's bytes (the
    Triton kernels equal the reference: tests/kernels/test_kernels.py)."""
    from dynamiq import kernels

    n = 4099
    x = _sample(n, contributions)
    amax = float(x.abs().max()) * 1.5  # another rank's is larger
    bits = int(torch.tensor([amax]).view(torch.int32))
    ctx = HopContext(contributions=contributions, shared={TENSOR_AMAX_KEY: bits})
    amax32 = float(torch.tensor([amax]))
    want = _ref_nvfp4(x.numpy(), amax32, contributions)
    got = kernels.encode(NVFP4, x, ctx, backend=backend)
    assert got.numpy().tobytes() == want
    # standalone: the chunk's own absmax, one contribution
    want = _ref_nvfp4(x.numpy(), float(x.abs().max()))
    assert kernels.encode(NVFP4, x, backend=backend).numpy().tobytes() == want


def test_ties_and_scale_edges_match_ml_dtypes() -> None:
    """Element ties (x = 5·S, 0.75·S, ...), scales on E4M3 ties and its subnormals."""
    base = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -5.0, -0.25, 0.0, -0.0])
    blocks = []
    for t in (1.0, 1.0625, 1.1875, 2.0**-9, 3 * 2.0**-10, 2.0**-10, 448.0, 464.0, 500.0):
        blocks.append(torch.cat([base, base[:4]]) * t)
    x = torch.cat(blocks).float()
    ctx = HopContext(shared={TENSOR_AMAX_KEY: int(torch.tensor([1024.0]).view(torch.int32))})
    want = _ref_nvfp4(x.numpy(), 1024.0)  # G = 1: the scales are t, on E4M3's ties
    assert NVFP4.encode(x, ctx).numpy().tobytes() == want


@pytest.mark.parametrize("mx", [n for n in list_codecs() if isinstance(get_codec(n), MXCodec)])
def test_mx_declarations_give_the_mx_bytes(mx: str) -> None:
    """The MX codecs (every registered one, MXINT8 too) are block formats: declared so, the
    generic reference writes their bytes (and decodes to their values)."""
    codec = get_codec(mx)
    decl = BlockCodec(
        element=codec.element.name,  # type: ignore[attr-defined]
        block_size=32,
        scale="float8_e8m0fnu",
        scale_rule="floor",
        tensor_scale=False,
    )
    for x in (golden_input(32), _sample(1000, 3)):
        payload = codec.encode(x)
        assert torch.equal(decl.encode(x), payload)
        assert torch.equal(decl.decode(payload, x.numel()), codec.decode(payload, x.numel()))


def test_prologue_agrees_the_largest_finite_absmax() -> None:
    from dynamiq.collectives.handshake import local_prologues

    xs = [_sample(300, r) * 2.0**r for r in range(3)]
    xs[0][7] = math.inf
    xs[1][9] = math.nan
    shared, _ = local_prologues(NVFP4, xs)
    want = max(finite_absmax_bits(x) for x in xs)
    assert all(s == {TENSOR_AMAX_KEY: want} for s in shared)
    top = max(float(x[torch.isfinite(x)].abs().max()) for x in xs)
    assert want == int(torch.tensor([top]).view(torch.int32))


def _absmax_bits_numpy(x: torch.Tensor) -> int:
    a = x.float().numpy().astype(np.float64)
    a = np.abs(a[np.isfinite(a)])
    return 0 if a.size == 0 else int(np.float32(a.max()).view(np.uint32))


@pytest.mark.parametrize(
    "values",
    [
        [-0.0],
        [0.0, -0.0],
        [math.nan, 1.0],
        [math.nan],
        [math.inf, -2.0],
        [-math.inf],
        [2.0**-149, -(2.0**-149)],
        [2.0**-149, -(2.0**-133)],
        [-3.4028234663852886e38, 1.0],
        [-5.0, 5.0],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_absmax_bits_edges(values: list[float], dtype: torch.dtype) -> None:
    """Signed zeros, NaN and infinities (the slow path), subnormals, the fp32 extreme, ties
    of sign (the one-pass path) against numpy in fp64."""
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert finite_absmax_bits(x) == _absmax_bits_numpy(x)
    assert finite_absmax_bits(_sample(4097, 1).to(dtype)) == _absmax_bits_numpy(
        _sample(4097, 1).to(dtype)
    )


def test_block_locality_needs_the_prologue() -> None:
    """nvfp4 is block-local given the prologue's scale; the same format with the scale taken
    from each chunk (no prologue) is not, and the kit's check says so."""

    @dataclass(frozen=True, kw_only=True)
    class ChunkScaled(BlockCodec):
        codec_id: ClassVar[str] = "chunk_scaled_nvfp4"

        def prologue(self, x: torch.Tensor, comm: Any) -> None:
            return None

    x = torch.cat([_sample(64, 1) * 2.0**-30, _sample(64, 2)])
    check_block_locality(NVFP4, x)
    with pytest.raises(AssertionError, match="depends on the cut"):
        check_block_locality(ChunkScaled(), x)


@pytest.mark.parametrize("schedule", ["ring", "tree"])
def test_allreduce_bound_and_cut_invariance(schedule: str) -> None:
    xs = [_sample(700, r) * 2.0 ** (3 * r) for r in range(4)]
    ratio = check_allreduce_bound(xs, NVFP4, schedule, sub_chunks=(16, 48))
    assert 0 < ratio <= 1


def test_bad_declarations_are_named() -> None:
    with pytest.raises(ValueError, match="element"):
        BlockCodec(element="float5")
    with pytest.raises(ValueError, match="floor"):
        BlockCodec(scale="float8_e8m0fnu", scale_rule="floor", tensor_scale=True)
    with pytest.raises(ValueError, match="8-bit signed float"):
        BlockCodec(scale="float6_e3m2fn")
    with pytest.raises(ValueError, match="block_size"):
        BlockCodec(block_size=0)
    with pytest.raises(TypeError, match="tensor_scale"):
        BlockCodec(tensor_scale=1)  # type: ignore[arg-type]


def test_the_one_file_plugin_example_gets_native_kernels() -> None:
    """examples/block_format_plugin.py declares data only; it runs on the native kernels
    and its all-reduce stays within the certified bound (a subprocess: it registers a
    codec)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "block_format_plugin.py")],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    ).stdout  # fmt: skip
    assert "backend cpu" in out, out
    ratio = float(out.rsplit("=", 1)[1])
    assert 0 < ratio <= 1, out


@pytest.mark.parametrize("n", [2, 3])
def test_engine_prologue_matches_the_simulator(n: int) -> None:
    """Over the engine's transports (its prologue all-reduces the absmax by the ring of
    PrologueComm) every rank gets the simulator's bits."""
    from dynamiq.collectives import allreduce, simulate_allreduce
    from dynamiq.collectives.transport import LocalCluster, run_threads

    xs = [_sample(1000, r) * 2.0 ** (5 * r) for r in range(n)]
    want = simulate_allreduce(xs, "nvfp4", "ring", sub_chunk=64).outputs[0]
    bufs = [x.clone() for x in xs]
    cl = LocalCluster(n)
    run_threads(
        n,
        lambda r: allreduce(
            bufs[r], "nvfp4", "ring", sub_chunk=64, threshold=0, transport=cl.transport(r)
        ),
    )
    for got in bufs:  # reduced in place
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(bufs[0], xs[0])
