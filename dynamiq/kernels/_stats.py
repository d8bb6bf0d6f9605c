"""Launch bookkeeping of the kernels (no Triton import): tests use it to prove a kernel ran."""

from __future__ import annotations

import threading
from collections import Counter

_LOCK = threading.Lock()
_LAUNCHES: Counter[str] = Counter()


def record_launch(kernel: str) -> None:
    """Count one launch of ``kernel`` (its function name)."""
    with _LOCK:
        _LAUNCHES[kernel] += 1


def launch_counts() -> dict[str, int]:
    """A copy of the launch counters: kernel function name -> launches in this process."""
    with _LOCK:
        return dict(_LAUNCHES)
