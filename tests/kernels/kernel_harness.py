"""The harness of the Triton kernel tests (``test_kernels.py``, ``test_dynamiq_kernels.py``).

Triton decides when it is imported whether ``@triton.jit`` functions (its own too) run in its
interpreter, so a kernel test module imports Triton and the kernel modules inside
:func:`interpreted_imports`; the ``triton_interpreter`` fixture (``conftest.py``) keeps the
interpreter on while its tests run. On a machine with CUDA the same tests run natively.

Then: bit-exact comparisons (:func:`assert_values_equal`, :func:`assert_bytes_equal`), the
reference beside the kernel (:func:`both`), and inputs (:func:`random_values`,
:func:`cycle_blocks`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import dynamiq.kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def interpreted_imports() -> Iterator[None]:
    """Run the imports of the block with ``TRITON_INTERPRET=1`` when there is no CUDA device
    (restored afterwards); skip the calling module without Triton, or when Triton was already
    imported in compiled mode."""
    saved = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip(
            "triton", reason="the kernel tests need Triton >= 3.6 (pip install 'triton>=3.6')"
        )
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    import triton.language as tl

    if DEVICE == "cpu" and type(tl.zeros).__name__ != "InterpretedFunction":
        pytest.skip(
            "Triton was imported in compiled mode before this module could set "
            "TRITON_INTERPRET=1: run the kernel tests first or on their own (or with "
            "TRITON_INTERPRET=1 set)",
            allow_module_level=True,
        )


# -- comparisons ------------------------------------------------------------------------------


def assert_values_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """fp32 tensors: identical bits, NaN compared by position."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype == torch.float32, what
    assert got.shape == want.shape, what
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ"
    g = torch.where(nan_g, 0.0, got).view(torch.int32)
    w = torch.where(nan_w, 0.0, want).view(torch.int32)
    if not torch.equal(g, w):
        i = int((g != w).nonzero()[0, 0])
        raise AssertionError(f"{what}: value {i} differs: {got[i].item()!r} != {want[i].item()!r}")


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """uint8 payloads: identical bytes."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype == torch.uint8 and got.shape == want.shape, what
    if not torch.equal(got, want):
        i = int((got != want).nonzero()[0, 0])
        raise AssertionError(f"{what}: byte {i} of {got.numel()} differs: {got[i]} != {want[i]}")


def both(
    fn: Any, *args: Any, kernel: str | None = None, fast: str = "triton", **kw: Any
) -> tuple[Any, Any]:
    """``fn`` (``K.encode``, ``K.decode`` or ``K.reduce``) on the reference and on the
    ``fast`` backend (forced: ``"triton"``, or ``"cpu"`` for the native CPU kernels): the two
    results, or ``(None, None)`` when both raise the same ``ValueError``; with a proof that
    the fast path ran: ``kernel`` launched once more (not at all for an empty input), or
    (without a name) some kernel launched for a non-empty input."""
    before = K.launch_counts()
    try:
        want = fn(*args, **kw, backend="reference")
    except ValueError as exc:
        with pytest.raises(ValueError) as info:
            fn(*args, **kw, backend=fast)
        assert str(info.value) == str(exc)
        return None, None
    assert K.last_backend() == "reference"
    got = fn(*args, **kw, backend=fast)
    assert K.last_backend() == fast
    after = K.launch_counts()
    nonempty = (args[2] if fn is K.decode else args[2 if fn is K.reduce else 1].numel()) > 0
    if kernel is not None:
        launches = after.get(kernel, 0) - before.get(kernel, 0)
        assert launches == int(nonempty), f"{kernel} launched {launches} times"
    elif nonempty:
        assert sum(after.values()) > sum(before.values()), "no kernel launched"
    return got, want


# -- inputs -----------------------------------------------------------------------------------


def random_values(
    n: int, seed: int, max_abs: float | None = None, *, spread: int = 40
) -> torch.Tensor:
    """Mixed magnitudes (a normal times ``2^-spread .. 2^spread``), every 13th value zero,
    exact powers of two; clamped to ``±max_abs`` if given."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).double())
    x[::13] = 0.0
    x[5::17] = torch.exp2(torch.randint(-20, 20, (len(x[5::17]),), generator=g).double())
    if max_abs is not None:
        x = x.clamp(-max_abs, max_abs)
    return x.float()


def cycle_blocks(
    kinds: Sequence[Callable[[int], torch.Tensor]], n: int, block: int
) -> torch.Tensor:
    """``n`` fp32 values: blocks of ``block`` values made by each of ``kinds`` in turn."""
    parts: list[torch.Tensor] = []
    k = 0
    while sum(p.numel() for p in parts) < n:
        parts.append(kinds[k % len(kinds)](block).float())
        k += 1
    return torch.cat(parts)[:n] if parts else torch.zeros(0)
