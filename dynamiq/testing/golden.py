"""Golden fixtures: frozen wire bytes per codec under ``<fixtures_dir>/<name>/``.

Each fixture holds ``config.json`` (codec config, hop context, numel), ``input.bin`` (fp32
little-endian), ``payload.bin`` (the encoded bytes) and ``decoded.bin`` (fp32 little-endian).
A fixture with a ``prologue`` (``{"ranks": n}``) freezes a codec whose wire sizes come from a
prologue (pooled DynamiQ): ``n`` ranks (rank 0 holds the input; rank ``r`` the input rolled by
``97 r`` and scaled by ``2^-r``; the input's first third is scaled by ``2^-24``) run it in
process over the ring's even chunks, free to re-cut them; ``shared.json`` holds the agreed
chunk bounds, ``statistics.bin`` rank 0's prologue message (a prologue that is one
all-reduce of ``prologue_statistics``), and the payload is rank 0's chunks encoded one after
the other at their offsets.
:func:`check_golden` re-encodes the input and compares bytes, so any change to a wire format
fails loudly. Regenerate (only for a deliberate, documented format change) with::

    python -m dynamiq.testing --write tests/fixtures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dynamiq.codecs import Codec, HopContext, get_codec, list_codecs

__all__ = [
    "EXTRA_FIXTURES",
    "check_golden",
    "fixture_context",
    "fixture_name",
    "golden_input",
    "write_golden",
]

#: Non-default configurations frozen beside the registered names.
EXTRA_FIXTURES: dict[str, dict[str, Any]] = {
    "int4_stochastic_fp16": {
        "codec": {"id": "int", "bits": 4, "rounding": "stochastic", "scale_format": "fp16"},
        "ctx": {"seed": 7, "step": 3, "hop": 1, "num_hops": 4, "rank": 2, "offset": 4096},
    },
    "int3_e8m0_block64": {
        "codec": {"id": "int", "bits": 3, "block_size": 64, "scale_format": "e8m0"},
        "ctx": {},
    },
    "int6_fp32": {"codec": {"id": "int", "bits": 6, "scale_format": "fp32"}, "ctx": {}},
    "dynamiq_span": {
        "codec": {
            "id": "dynamiq",
            "bits": 4.7,
            "span": 65536,
            "super_group": 1024,
            "pooling": "span",
        },
        "ctx": {},
    },
    "dynamiq_small_correlated": {
        "codec": {
            "id": "dynamiq",
            "bits": 3.5,
            "span": 1024,
            "super_group": 256,
            "rounding": "correlated",
            "hop_slope": 1.0,
        },
        "ctx": {"seed": 11, "step": 2, "hop": 2, "num_hops": 5, "rank": 3, "offset": 2048},
    },
    "dynamiq_pooled": {
        "codec": {"id": "dynamiq"},
        "ctx": {"seed": 3, "rank": 0},
        "prologue": {"ranks": 3},
        "input_block": 1024,
    },
    # the pooled default without `balance_slack` (chunks capped at `balance` only)
    "dynamiq_pooled_strict": {
        "codec": {"id": "dynamiq", "balance_slack": 0},
        "ctx": {"seed": 3, "rank": 0},
        "prologue": {"ranks": 3},
        "input_block": 1024,
    },
    "nvfp4_prologue": {
        "codec": {"id": "nvfp4"},
        "ctx": {"hop": 1, "num_hops": 2, "contributions": 2},
        "prologue": {"ranks": 3},
    },
    "block_e4m3_b32_e5m2": {
        "codec": {
            "id": "block",
            "element": "float8_e4m3fn",
            "block_size": 32,
            "scale": "float8_e5m2",
            "tensor_scale": False,
        },
        "ctx": {},
    },
    "dynamiq_uniform_stochastic": {
        "codec": {
            "id": "dynamiq",
            "bits": 4.7,
            "span": 2048,
            "super_group": 1024,
            "levels": "uniform",
            "rounding": "stochastic",
            "scale_steps": 1,
        },
        "ctx": {"seed": 5, "rank": 1},
    },
}


def golden_input(block_size: int) -> torch.Tensor:
    """A deterministic input: magnitudes from subnormal to large, zeros, ±0, ties, a partial
    last block."""
    n = max(min(3 * block_size + 5, 4099), 101)
    k = torch.arange(n, dtype=torch.float64)
    x = torch.sin(k * 0.37) * torch.exp2(torch.remainder(k * 7, 51) - 40)
    x[::17] = 0.0
    x[5] = -0.0
    x[7] = 2.0**-140
    x[9] = 3.0 * 2.0**-130
    x[11] = 1.5
    x[13] = -2.5
    return x.float()


def fixture_name(codec: Codec) -> str:
    """The registered name of ``codec`` (its preset or id)."""
    for name in [*list_codecs(), *list_codecs(all_names=True)]:  # presets first
        if get_codec(name) == codec:
            return name
    raise ValueError(f"{codec!r} has no registered name; pass name= explicitly")


def _read_f32(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)


def _pooled(
    codec: Codec, x: torch.Tensor, ctx: HopContext, ranks: int
) -> tuple[HopContext, list[tuple[int, int]]]:
    """The context holding the prologue's result of ``ranks`` in-process ranks (see the
    module docstring), and the chunks rank 0 encodes."""
    from dynamiq.collectives.handshake import local_prologues  # the engine's own prologue
    from dynamiq.collectives.planning import CHUNK_BOUNDS_KEY, chunk_bounds

    xs = [x] + [torch.roll(x, 97 * r) * 2.0**-r for r in range(1, ranks)]
    chunks = chunk_bounds(x.numel(), ranks, codec.block_size)
    shared = local_prologues(codec, xs, chunks, timeout=60.0, recut_align=codec.block_size)[0][0]
    assert shared is not None, f"{codec!r} ran no prologue"
    return dataclasses.replace(ctx, shared=shared), list(shared.get(CHUNK_BOUNDS_KEY, chunks))


def _statistics(codec: Codec, x: torch.Tensor, ranks: int) -> torch.Tensor | None:
    """Rank 0's prologue message (its ``prologue_statistics`` over the ring's even chunks) as
    bytes, or ``None`` for a prologue of another kind."""
    from dynamiq.collectives.planning import chunk_bounds

    stats = getattr(codec, "prologue_statistics", None)
    if not callable(stats):
        return None
    got = stats(x, 0, chunk_bounds(x.numel(), ranks, codec.block_size))
    return None if got is None else got.contiguous().view(torch.uint8).reshape(-1)


def _encode(codec: Codec, x: torch.Tensor, ctx: HopContext, pieces: list) -> torch.Tensor:
    parts = [
        codec.encode(x[a:b].contiguous(), dataclasses.replace(ctx, offset=ctx.offset + a))
        for a, b in pieces
        if b > a
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _decode(codec: Codec, payload: torch.Tensor, ctx: HopContext, pieces: list) -> torch.Tensor:
    if len(pieces) == 1:  # the whole input (sizes may depend on the data: OmniReduce)
        (a, b), c = pieces[0], dataclasses.replace(ctx, offset=ctx.offset + pieces[0][0])
        return codec.decode(payload, b - a, c)
    out, at = [], 0
    for a, b in pieces:
        if b > a:
            c = dataclasses.replace(ctx, offset=ctx.offset + a)
            size = codec.encoded_nbytes(b - a, c)
            assert size is not None
            out.append(codec.decode(payload[at : at + size], b - a, c))
            at += size
    return torch.cat(out)


def fixture_context(
    codec: Codec, meta: dict[str, Any], x: torch.Tensor
) -> tuple[HopContext, list[tuple[int, int]]]:
    """The context and the pieces (``[start, end)``, encoded one after the other) of a
    fixture's payload, from its ``config.json`` (``meta``) and input ``x``."""
    ctx = HopContext(**meta["ctx"])
    if "prologue" not in meta:
        return ctx, [(0, x.numel())]
    return _pooled(codec, x, ctx, meta["prologue"]["ranks"])


def write_golden(
    codec: Codec,
    fixtures_dir: str | Path,
    name: str | None = None,
    ctx: HopContext | None = None,
    prologue: dict[str, int] | None = None,
    input_block: int | None = None,
) -> Path:
    """Write the fixture of ``codec`` (see the module docstring); returns its folder."""
    name = name or fixture_name(codec)
    folder = Path(fixtures_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    ctx = ctx or HopContext()
    x = golden_input(input_block or codec.block_size)
    pieces = [(0, x.numel())]
    ctx_fields = {k: v for k, v in vars(ctx).items() if k != "shared"}
    if prologue:  # its first third 2^24 times smaller: a budget uneven enough to re-cut
        x = torch.cat([x[: x.numel() // 3] * 2.0**-24, x[x.numel() // 3 :]])
        ctx, pieces = _pooled(codec, x, ctx, prologue["ranks"])
        (folder / "shared.json").write_text(json.dumps({"chunk_bounds": pieces}) + "\n")
        stats = _statistics(codec, x, prologue["ranks"])
        if stats is not None:
            (folder / "statistics.bin").write_bytes(stats.numpy().tobytes())
    payload = _encode(codec, x, ctx, pieces)
    decoded = _decode(codec, payload, ctx, pieces)
    meta: dict[str, Any] = {"codec": codec.get_config(), "ctx": ctx_fields, "numel": x.numel()}
    if prologue:
        meta["prologue"] = prologue
    (folder / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    (folder / "input.bin").write_bytes(x.numpy().astype("<f4").tobytes())
    (folder / "payload.bin").write_bytes(payload.numpy().tobytes())
    (folder / "decoded.bin").write_bytes(decoded.numpy().astype("<f4").tobytes())
    return folder


def check_golden(codec: Codec, fixtures_dir: str | Path, name: str | None = None) -> None:
    """Encoding the fixture's input gives its bytes; decoding gives its values, bit for bit."""
    folder = Path(fixtures_dir) / (name or fixture_name(codec))
    if not folder.is_dir():
        raise AssertionError(f"no golden fixture for {codec!r} at {folder}")
    meta = json.loads((folder / "config.json").read_text())
    assert get_codec(meta["codec"]) == codec, f"{folder}: config {meta['codec']} != {codec!r}"
    x = _read_f32(folder / "input.bin")
    assert x.numel() == meta["numel"]
    ctx, pieces = fixture_context(codec, meta, x)
    if "prologue" in meta:
        frozen = json.loads((folder / "shared.json").read_text())["chunk_bounds"]
        assert pieces == [tuple(p) for p in frozen], f"{folder}: chunk bounds {pieces}"
        if (folder / "statistics.bin").is_file():
            want_stats = (folder / "statistics.bin").read_bytes()
            got_stats = _statistics(codec, x, meta["prologue"]["ranks"])
            assert got_stats is not None and got_stats.numpy().tobytes() == want_stats, (
                f"{codec!r}: prologue statistics differ from {folder}/statistics.bin"
            )
    expected = torch.frombuffer(bytearray((folder / "payload.bin").read_bytes()), dtype=torch.uint8)
    payload = _encode(codec, x, ctx, pieces)
    if not torch.equal(payload, expected):
        diff = (payload != expected).nonzero() if payload.shape == expected.shape else None
        where = f"first differing byte {int(diff[0, 0])}" if diff is not None else "size"
        raise AssertionError(f"{codec!r}: wire bytes differ from {folder} ({where})")
    decoded = _decode(codec, expected, ctx, pieces)
    want = _read_f32(folder / "decoded.bin")
    assert torch.equal(decoded.view(torch.int32), want.view(torch.int32)), f"{folder}: decode"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DIR", required=True, help="fixtures folder")
    parser.add_argument(
        "--only", default="", help="comma-separated codec names (default: every built-in one)"
    )
    args = parser.parse_args(argv)
    # built-in codecs only: a plugin package ships (and checks) its own fixtures
    names = [n for n in list_codecs() if type(get_codec(n)).__module__.startswith("dynamiq.")]
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(names) - set(EXTRA_FIXTURES))
    if unknown:
        parser.error(f"unknown fixture names: {', '.join(unknown)}")
    for name in names:
        if only and name not in only:
            continue
        print(write_golden(get_codec(name), args.write, name))
    for name, spec in EXTRA_FIXTURES.items():
        if only and name not in only:
            continue
        codec, ctx = get_codec(spec["codec"]), HopContext(**spec["ctx"])
        extra = {k: spec[k] for k in ("prologue", "input_block") if k in spec}
        print(write_golden(codec, args.write, name, ctx, **extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
