"""Checks of a codec inside the engine (docs/testing.md, "Checks"): the certified bound of a
whole multi-hop all-reduce, and block locality, the rule that nothing a codec decides depends
on how the engine cuts the buffer (dynamiq/collectives/cuts.py).

Both raise ``AssertionError`` naming the codec and the failing element.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dynamiq.codecs import Codec, HopContext, get_codec

__all__ = ["check_allreduce_bound", "check_block_locality", "exact_sum"]


def exact_sum(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The element-wise sum of ``tensors`` (any shapes of one size) as fp64, correctly rounded
    (``math.fsum`` per element, independent of the engine), and the half ulp of fp64 that
    rounding may have cost (0 where the sum is exact in fp64)."""
    cols = np.stack([t.detach().reshape(-1).double().cpu().numpy() for t in tensors], axis=1)
    total = np.array([math.fsum(row) for row in cols], dtype=np.float64)
    half_ulp = np.spacing(np.abs(total)) / 2
    return torch.from_numpy(total), torch.from_numpy(half_ulp)


def check_allreduce_bound(
    tensors: Sequence[torch.Tensor],
    codec: Codec | str | dict[str, Any],
    schedule: Any = "ring",
    *,
    sub_chunks: Sequence[int] = (),
    **options: Any,
) -> float:
    """Run the all-reduce of ``tensors`` (one per simulated rank) with ``codec`` and
    ``schedule`` (:func:`dynamiq.collectives.simulate_allreduce`, which takes ``options``)
    and check its accumulated certified bound against the exact sum (:func:`exact_sum`):
    every rank gets the same bits and the same bound; the bound is finite where every input
    is; ``|output - sum| <= bound`` everywhere (``op="avg"``: against the sum over the ranks).
    With ``sub_chunks``, the run is repeated at each of those sub-chunk sizes and must give
    the same bits (the result may not depend on the cut). Returns the largest
    ``error / bound`` (0 where the bound is 0 and so is the error)."""
    from dynamiq.collectives import simulate_allreduce

    c = get_codec(codec)
    res = simulate_allreduce(list(tensors), c, schedule, **options)
    exact, slack = exact_sum(tensors)
    if options.get("op", "sum") == "avg":
        exact, slack = exact / len(tensors), slack / len(tensors)
    out0 = res.outputs[0]
    for r, (out, st) in enumerate(zip(res.outputs, res.stats, strict=True)):
        if not torch.equal(out.view(torch.int32), out0.view(torch.int32)):
            raise AssertionError(f"{c!r}: rank {r}'s result differs from rank 0's")
        same = st.bound is not None and torch.equal(st.bound, res.bound)  # type: ignore[arg-type]
        if not same:
            raise AssertionError(f"{c!r}: rank {r}'s bound differs from rank 0's")
    bound = res.bound
    assert bound is not None, f"{c!r}: the engine returned no bound"
    finite_in = torch.stack([torch.isfinite(t.reshape(-1)) for t in tensors]).all(dim=0)
    spoiled = finite_in & ~torch.isfinite(bound)
    if bool(spoiled.any()):
        i = int(spoiled.nonzero()[0, 0])
        raise AssertionError(f"{c!r}: non-finite bound {float(bound[i])} at {i}, inputs finite")
    err = (out0.double() - exact).abs()
    bad = torch.isfinite(bound) & ~(err <= bound + slack)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise AssertionError(
            f"{c!r} over {getattr(schedule, 'name', schedule)} on {len(tensors)} ranks: "
            f"|output - exact sum| = {float(err[i])!r} > bound "
            f"{float(bound[i])!r} at element {i} of {err.numel()} (output {float(out0[i])!r}, "
            f"exact {float(exact[i])!r}, inputs {[float(t.reshape(-1)[i]) for t in tensors]})"
        )
    for sub in sub_chunks:
        again = simulate_allreduce(list(tensors), c, schedule, **{**options, "sub_chunk": sub})
        diff = again.outputs[0].view(torch.int32) != out0.view(torch.int32)
        if bool(diff.any()):
            i = int(diff.nonzero()[0, 0])
            raise AssertionError(
                f"{c!r}: element {i} is {float(again.outputs[0][i])!r} with sub_chunk={sub} "
                f"but {float(out0[i])!r} with the first run's: the result depends on the cut"
            )
    ok = torch.isfinite(bound) & (bound > 0)
    return float((err[ok] / bound[ok]).max()) if bool(ok.any()) else 0.0


def _default_cuts(n: int, codec: Codec) -> list[list[tuple[int, int]]]:
    """Every block apart; the first block and the rest; two and three block-aligned pieces."""
    from dynamiq.collectives.cuts import block_cuts

    b = codec.block_size
    every = [(a, min(a + b, n)) for a in range(0, n, b)]
    first = [(0, b), (b, n)] if n > b else []
    out = [every, first, block_cuts(n, 2, codec), block_cuts(n, 3, codec)]
    return [cut for cut in out if len(cut) > 1]


def check_block_locality(
    codec: Codec,
    x: torch.Tensor,
    ctx: HopContext | None = None,
    cuts: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> None:
    """Encoding pieces of ``x`` apart decodes to the very bits of encoding ``x`` whole, for
    each list of ``[start, end)`` pieces in ``cuts`` (default: every block apart, the first
    block and the rest, two and three block-aligned pieces). Each piece is encoded with its
    global offset (``ctx.offset + start``) and, for a codec with a prologue (and ``ctx``
    without ``shared``), the prologue's result on the whole of ``x`` as one rank's buffer
    (offset 0), as the engine does. A codec with, say, a per-tensor scale of its own fails:
    its result would depend on the engine's ``sub_chunk``."""
    from dynamiq.collectives.cuts import check_cut_invariance
    from dynamiq.collectives.handshake import local_prologues

    flat = x.reshape(-1).contiguous()
    ctx = ctx or HopContext()
    if callable(getattr(codec, "prologue", None)) and ctx.shared is None:
        # ``x`` is the whole buffer the prologue sees: its element 0 is at global index 0
        shared, _ = local_prologues(codec, [flat])
        ctx = dataclasses.replace(ctx, offset=0, shared=shared[0])
    all_cuts = _default_cuts(flat.numel(), codec) if cuts is None else cuts
    for cut in all_cuts:
        pieces = [(int(a), int(e)) for a, e in cut]
        try:
            check_cut_invariance(codec, flat, ctx, pieces)
        except AssertionError as exc:
            raise AssertionError(f"block locality, pieces {pieces[:4]}...: {exc}") from None
