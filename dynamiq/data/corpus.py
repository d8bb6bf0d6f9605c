"""Real text that ships with CPython, split into disjoint regions.

The corpus is built from two sources that every CPython installation has, so
nothing is ever downloaded:

* the reference documentation in :mod:`pydoc_data.topics` (about 0.46 MB of
  English prose with code samples), and
* the standard-library sources (``*.py`` under ``sysconfig.get_paths()["stdlib"]``),
  skipping test suites, ``site-packages`` and generated tables.  A deterministic
  subset is taken: files are ordered by the SHA-256 of their relative path
  (a stable pseudo-shuffle, so the subset is not alphabetically biased) and
  whole files are taken until ``stdlib_bytes`` is reached.

The documents are shuffled with a local ``random.Random(seed)`` and joined
with blank lines into one byte string, which is cut into three disjoint
regions::

    [ eval region | fit region | train region ]

The eval and fit regions each hold ``max_workers * worker_batch`` windows of
``seq_len + 1`` bytes; worker ``i`` of a split takes the windows
``perm[i * worker_batch:(i + 1) * worker_batch]`` of a seeded permutation of
that split's windows, so every worker gets its own disjoint text and the first
``k`` workers of a larger set are the same as a ``k``-worker set.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["SPLITS", "Corpus", "build_corpus", "stdlib_files"]

SPLITS: tuple[str, ...] = ("eval", "fit")

# Directory names never read from the standard library: test suites, third-party
# packages, bytecode caches, the generated documentation module (it is the
# pydoc source already) and the generated codec tables.
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "pydoc_data",
        "encodings",
        "ensurepip",
    }
)
_SEPARATOR = b"\n\n"


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the eligible ``*.py`` files of the standard library, sorted."""
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    found: list[Path] = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue  # build-specific, not text written by people
        found.append(rel)
    return sorted(found)


@dataclass(frozen=True)
class Corpus:
    """The assembled byte corpus and its region boundaries (byte offsets)."""

    data: bytes
    sha256: str
    documents: int
    doc_bytes: int
    stdlib_bytes: int
    regions: dict[str, tuple[int, int]]
    window: int
    worker_batch: int
    max_workers: int
    seed: int

    def train_tensor(self) -> torch.Tensor:
        """The training region as a ``uint8`` tensor."""
        lo, hi = self.regions["train"]
        return torch.frombuffer(bytearray(self.data[lo:hi]), dtype=torch.uint8)

    @functools.cached_property
    def _train_bytes(self) -> torch.Tensor:
        return self.train_tensor()

    def train_batch(self, gen: torch.Generator, size: int) -> torch.Tensor:
        """``[size, window]`` int64 windows at uniform random offsets of the train region."""
        text = self._train_bytes
        if text.numel() < self.window:
            raise ValueError(
                f"train region must hold at least {self.window} bytes (got {text.numel()})"
            )
        starts = torch.randint(0, text.numel() - self.window + 1, (size,), generator=gen)
        return text[starts[:, None] + torch.arange(self.window)].long()

    def worker_examples(self, split: str, worker: int) -> torch.Tensor:
        """Worker ``worker``'s batch of ``split`` (:meth:`worker_batch_tensor`)."""
        return self.worker_batch_tensor(split, worker)

    def worker_shard(self, split: str, worker: int) -> list[list[int]]:
        """The ``[start, end)`` byte ranges of the worker's windows, as JSON-ready lists."""
        return [[a, b] for a, b in self.worker_windows(split, worker)]

    def describe(self) -> dict[str, Any]:
        """Plain-JSON summary (hash, sizes, regions) for the cache metadata."""
        return {
            "sha256": self.sha256,
            "bytes": len(self.data),
            "documents": self.documents,
            "pydoc_topics_bytes": self.doc_bytes,
            "stdlib_bytes": self.stdlib_bytes,
            "regions": {k: list(v) for k, v in self.regions.items()},
            "window": self.window,
        }

    def worker_windows(self, split: str, worker: int) -> list[tuple[int, int]]:
        """Absolute ``[start, end)`` byte ranges of the windows of ``worker`` in ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
        if not 0 <= worker < self.max_workers:
            raise ValueError(f"worker must be in [0, {self.max_workers}) (got {worker})")
        lo, _ = self.regions[split]
        perm = self._permutation(split)
        ids = perm[worker * self.worker_batch : (worker + 1) * self.worker_batch]
        return [(lo + w * self.window, lo + (w + 1) * self.window) for w in ids]

    def worker_batch_tensor(self, split: str, worker: int) -> torch.Tensor:
        """The ``[worker_batch, window]`` int64 byte batch of one worker."""
        rows = [list(self.data[a:b]) for a, b in self.worker_windows(split, worker)]
        return torch.tensor(rows, dtype=torch.int64)

    def _permutation(self, split: str) -> list[int]:
        n = self.max_workers * self.worker_batch
        gen = torch.Generator().manual_seed(self.seed * 1000 + 1 + SPLITS.index(split))
        perm: list[int] = torch.randperm(n, generator=gen).tolist()
        return perm


@functools.lru_cache(maxsize=4)
def build_corpus(
    *,
    seq_len: int,
    worker_batch: int,
    max_workers: int,
    stdlib_bytes: int,
    include_docs: bool = True,
    seed: int = 0,
    min_train_windows: int = 64,
) -> Corpus:
    """Read the CPython docs and stdlib sources and cut them into eval/fit/train regions.

    Raises ``ValueError`` if the text is too small for the requested regions.
    """
    for name, value in (
        ("seq_len", seq_len),
        ("worker_batch", worker_batch),
        ("max_workers", max_workers),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    if stdlib_bytes < 0:
        raise ValueError(f"stdlib_bytes must be >= 0 (got {stdlib_bytes})")

    docs: list[bytes] = []
    doc_bytes = 0
    if include_docs:
        from pydoc_data.topics import topics

        for key in sorted(topics):
            text = topics[key].encode("utf-8")
            docs.append(text)
            doc_bytes += len(text)

    base = Path(sysconfig.get_paths()["stdlib"])
    taken = 0
    if stdlib_bytes > 0:
        ordered = sorted(
            stdlib_files(base), key=lambda p: hashlib.sha256(p.as_posix().encode()).hexdigest()
        )
        for rel in ordered:
            if taken >= stdlib_bytes:
                break
            text = (base / rel).read_bytes()
            if not text.strip():
                continue
            docs.append(text)
            taken += len(text)

    random.Random(seed).shuffle(docs)
    data = _SEPARATOR.join(docs)

    window = seq_len + 1
    split_bytes = max_workers * worker_batch * window
    need = 2 * split_bytes + min_train_windows * window
    if len(data) < need:
        raise ValueError(
            f"corpus must hold at least {need} bytes for max_workers={max_workers}, "
            f"worker_batch={worker_batch}, seq_len={seq_len} (got {len(data)}); "
            "raise stdlib_bytes or lower max_workers"
        )
    regions = {
        "eval": (0, split_bytes),
        "fit": (split_bytes, 2 * split_bytes),
        "train": (2 * split_bytes, len(data)),
    }
    return Corpus(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        documents=len(docs),
        doc_bytes=doc_bytes,
        stdlib_bytes=taken,
        regions=regions,
        window=window,
        worker_batch=worker_batch,
        max_workers=max_workers,
        seed=seed,
    )
