"""Family ``digits``: a small conv net trained from scratch on scikit-learn's bundled digits.

The data are the 1,797 8x8 grey-level handwritten digits that ship inside
scikit-learn (``sklearn.datasets.load_digits``: read from the package, never
downloaded; install the ``data`` extra). Pixels (0..16) are mapped to
``x / 8 - 1`` in [-1, 1]. A seeded permutation of the images is cut into
three disjoint regions::

    [ eval: max_workers * worker_batch | fit: the same | train: the rest ]

and worker ``w`` of a split takes the images ``w * worker_batch`` to
``(w + 1) * worker_batch`` of its region, so the first ``k`` workers of a
larger set are a ``k``-worker set. Training batches are drawn uniformly (with
replacement) from the train region.

The model: conv 3x3 (1 -> 32) + ReLU, conv 3x3 (32 -> 64) + ReLU, 2x2 max-pool,
a linear layer 1024 -> 512 + ReLU and a linear classifier 512 -> 10 (548,746
parameters, over the 2^19 values a compare buffer takes); the loss is the mean
cross-entropy of the labels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dynamiq.data.corpus import SPLITS
from dynamiq.data.model import seeded

__all__ = ["DigitsConfig", "DigitsNet", "DigitsSource", "load_digit_images"]


def load_digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: ``uint8`` images ``[1797, 8, 8]`` (0..16) and ``int64`` labels.

    Raises:
        ImportError: if scikit-learn is not installed (with the extra to install).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the 'digits' family needs scikit-learn (pip install 'dynamiq-allreduce[data]')"
        ) from exc
    bunch = load_digits()
    images = np.asarray(bunch.images).astype(np.uint8)
    labels = np.asarray(bunch.target).astype(np.int64)
    return images, labels


@dataclass(frozen=True)
class DigitsConfig:
    """Everything that determines the ``digits`` gradients (hashed into the cache name)."""

    name: ClassVar[str] = "digits"
    channels: tuple[int, int] = (32, 64)
    hidden: int = 512
    seed: int = 0
    train_steps: int = 300
    train_batch: int = 64
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    worker_batch: int = 8
    max_workers: int = 32

    def validate(self) -> None:
        """Raise ``ValueError`` if a field is out of range."""
        if len(self.channels) != 2 or any(
            not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in self.channels
        ):
            raise ValueError(f"channels must be two integers >= 1 (got {self.channels!r})")
        for key in ("hidden", "train_steps", "train_batch", "worker_batch", "max_workers"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1 (got {value!r})")
        for key in ("warmup_steps", "seed"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0 (got {getattr(self, key)})")
        for key in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be a finite number >= 0 (got {value!r})")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of the configuration."""
        out = dataclasses.asdict(self)
        out["channels"] = list(self.channels)
        return out

    def build_source(self) -> DigitsSource:
        """The digits, permuted and cut into eval/fit/train regions.

        Raises:
            ValueError: if the 1,797 images cannot hold both splits and 64 training images.
        """
        images, labels = load_digit_images()
        return DigitsSource(images, labels, self.worker_batch, self.max_workers, self.seed)

    def build_model(self) -> DigitsNet:
        """A freshly initialised net from ``seed`` (the caller's RNG state is kept)."""
        return seeded(lambda: DigitsNet(self), self.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy (nats) of an ``(images, labels)`` batch."""
        images, labels = batch
        return F.cross_entropy(model(images).float(), labels)

    def slice_segments(self, layout: list[dict[str, Any]]) -> list[tuple[str, np.ndarray]]:
        """Three groups of flat coordinates: ``conv`` (the first 8192: conv1 and the start
        of conv2), ``fc1`` (16384 centred in ``fc1.weight``), ``head_bias`` (``fc2.weight``
        and every bias not in ``conv``)."""
        by_name = {str(p["name"]): p for p in layout}

        def span(name: str) -> np.ndarray:
            p = by_name[name]
            return np.arange(int(p["offset"]), int(p["offset"]) + int(p["numel"]), dtype=np.int64)

        fc1 = span("fc1.weight")
        mid = (fc1.size - 16384) // 2
        conv = np.arange(min(8192, int(by_name["fc1.weight"]["offset"])), dtype=np.int64)
        biases = [
            span(str(p["name"]))
            for p in layout
            if str(p["name"]).endswith(".bias") and int(p["offset"]) >= conv.size
        ]
        return [
            ("conv", conv),
            ("fc1", fc1[max(0, mid) : max(0, mid) + 16384]),
            ("head_bias", np.concatenate([span("fc2.weight"), *biases])),
        ]


class DigitsSource:
    """The permuted digits and their regions (see the module docstring)."""

    def __init__(
        self, images: np.ndarray, labels: np.ndarray, worker_batch: int, max_workers: int, seed: int
    ) -> None:
        split_size = worker_batch * max_workers
        need = 2 * split_size + 64
        if images.shape[0] < need:
            raise ValueError(
                f"the digits must hold at least {need} images for max_workers={max_workers}, "
                f"worker_batch={worker_batch} (got {images.shape[0]}); lower max_workers"
            )
        self._x = torch.from_numpy(images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)
        self._y = torch.from_numpy(labels)
        digest = hashlib.sha256(images.tobytes() + labels.tobytes())
        self._sha256 = digest.hexdigest()
        gen = torch.Generator().manual_seed(seed * 1000 + 5)
        self._perm = torch.randperm(images.shape[0], generator=gen)
        self.batch_size = worker_batch
        self.max_workers = max_workers
        self.regions = {
            "eval": (0, split_size),
            "fit": (split_size, 2 * split_size),
            "train": (2 * split_size, images.shape[0]),
        }

    @property
    def sha256(self) -> str:
        return self._sha256

    def describe(self) -> dict[str, Any]:
        return {
            "sha256": self._sha256,
            "images": int(self._x.shape[0]),
            "image_shape": list(self._x.shape[1:]),
            "source": "sklearn.datasets.load_digits",
            "regions": {k: list(v) for k, v in self.regions.items()},
        }

    def _batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._x[ids], self._y[ids]

    def train_batch(self, gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.regions["train"]
        pick = torch.randint(lo, hi, (size,), generator=gen)
        return self._batch(self._perm[pick])

    def _worker_ids(self, split: str, worker: int) -> torch.Tensor:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
        if not 0 <= worker < self.max_workers:
            raise ValueError(f"worker must be in [0, {self.max_workers}) (got {worker})")
        lo = self.regions[split][0] + worker * self.batch_size
        return self._perm[lo : lo + self.batch_size]

    def worker_examples(self, split: str, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(self._worker_ids(split, worker))

    def worker_shard(self, split: str, worker: int) -> list[int]:
        """Indices (into ``load_digits()``) of the worker's images."""
        ids: list[int] = self._worker_ids(split, worker).tolist()
        return ids


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool, two linear layers (see the module docstring)."""

    def __init__(self, cfg: DigitsConfig) -> None:
        super().__init__()
        cfg.validate()
        c1, c2 = cfg.channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc1 = nn.Linear(c2 * 16, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, 10]`` of ``[batch, 1, 8, 8]`` images."""
        h = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))
