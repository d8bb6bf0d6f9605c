"""The chunking rule of custom collectives: nothing a codec decides may depend on how the
buffer is cut (docs/collectives.md, "Your own collective").

A collective cuts a rank's buffer into chunks and sub-chunks and encodes each piece apart. For
every rank to reach the same bytes whatever the cut (and the engine's result not to depend on
``sub_chunk``), a codec's decisions (scales, selected blocks, dither) must be functions of the
block-aligned data and the *global* offset alone. So:

* cut on multiples of every involved codec's ``block_size`` (:func:`block_cuts`);
* encode a piece ``[a, b)`` with ``ctx.offset`` = the global index of its first element
  (``dataclasses.replace(ctx, offset=base + a)``), and with the ``shared`` result of the
  codec's prologue, which was run on the whole buffer
  (:func:`~dynamiq.collectives.handshake.run_prologue`).

:func:`check_cut_invariance` checks a codec against the rule on given data.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dynamiq.codecs import Codec, HopContext

from .planning import chunk_bounds

__all__ = ["block_cuts", "check_cut_invariance"]


def block_cuts(numel: int, parts: int, *codecs: Codec) -> list[tuple[int, int]]:
    """``[start, end)`` of ``parts`` pieces of a ``numel``-element buffer, cut on multiples of
    every codec's block size, as even as the blocks allow (pieces may be empty)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1 (got {parts})")
    align = math.lcm(*(c.block_size for c in codecs)) if codecs else 1
    return chunk_bounds(numel, parts, align)


def check_cut_invariance(
    codec: Codec, x: torch.Tensor, ctx: HopContext, cuts: list[tuple[int, int]]
) -> None:
    """Raise ``AssertionError`` unless encoding the pieces ``cuts`` of ``x`` apart (each with
    its global offset ``ctx.offset + start``) decodes to the very bits of encoding ``x``
    whole with ``ctx``. The cuts must cover ``x`` in order and start on block multiples."""
    flat = x.reshape(-1)
    n = flat.numel()
    if [a for a, _ in cuts[1:]] != [b for _, b in cuts[:-1]] or (cuts and cuts[-1][1] != n):
        raise ValueError(f"cuts must cover [0, {n}) in order (got {cuts})")
    if cuts and cuts[0][0] != 0:
        raise ValueError(f"cuts must start at 0 (got {cuts[0]})")
    bad = [a for a, _ in cuts if a % codec.block_size]
    if bad:
        raise ValueError(f"cuts start off the codec's {codec.block_size}-element blocks: {bad}")
    whole = codec.decode(codec.encode(flat.contiguous(), ctx), n, ctx)
    for a, b in cuts:
        c = dataclasses.replace(ctx, offset=ctx.offset + a)
        piece = codec.decode(codec.encode(flat[a:b].contiguous(), c), b - a, c)
        same = piece.view(torch.int32) == whole[a:b].view(torch.int32)
        if not bool(same.all()):
            i = a + int((~same).nonzero()[0, 0])
            raise AssertionError(
                f"{codec!r}: element {i} decodes to {float(whole[i])!r} encoded whole but "
                f"{float(piece[i - a])!r} in the piece [{a}, {b}): a decision depends on the cut"
            )
