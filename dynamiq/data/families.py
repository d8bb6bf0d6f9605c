"""The model families that produce real gradients, and what each must provide.

A family is a frozen configuration dataclass (hashed into the cache names) that
knows how to build its data source, its model and its loss; the pipeline of
:mod:`dynamiq.data.gradients` (train from scratch, then one forward/backward per
worker on a disjoint shard, cache) is the same for all of them:

* ``lm`` -- :class:`dynamiq.data.gradients.DataConfig`: a byte-level causal
  transformer on CPython's docs and stdlib sources (the original data set);
* ``mlm`` -- :class:`dynamiq.data.mlm.MLMConfig`: a BERT-style bidirectional
  encoder trained with token masking on the same text;
* ``digits`` -- :class:`dynamiq.data.digits.DigitsConfig`: a small conv net on
  scikit-learn's bundled 8x8 handwritten digits (``load_digits``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

__all__ = ["FAMILIES", "Family", "Source", "family_arg", "family_config", "parse_families"]

#: registered family names; the first is the default
FAMILIES: tuple[str, ...] = ("lm", "mlm", "digits")


class Source(Protocol):
    """A family's data: a training stream and disjoint per-worker shards of each split."""

    @property
    def sha256(self) -> str:
        """Hash of the data (part of the cache key)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Plain-JSON summary for the cache metadata (hash, sizes, regions)."""
        ...

    def train_batch(self, gen: torch.Generator, size: int) -> Any:
        """A random training batch of ``size`` examples drawn with ``gen``."""
        ...

    def worker_examples(self, split: str, worker: int) -> Any:
        """Worker ``worker``'s batch of ``split`` (the same for any number of workers)."""
        ...

    def worker_shard(self, split: str, worker: int) -> list[Any]:
        """JSON-ready ids of the examples in that batch (disjoint across workers and splits)."""
        ...


class Family(Protocol):
    """What :mod:`dynamiq.data.gradients` needs of a family's configuration."""

    @property
    def name(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def train_steps(self) -> int: ...

    @property
    def train_batch(self) -> int: ...

    @property
    def lr(self) -> float: ...

    @property
    def min_lr(self) -> float: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def grad_clip(self) -> float: ...

    @property
    def worker_batch(self) -> int: ...

    @property
    def max_workers(self) -> int: ...

    def validate(self) -> None: ...

    def to_dict(self) -> dict[str, Any]: ...

    def build_source(self) -> Source: ...

    def build_model(self) -> nn.Module: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def slice_segments(self, layout: list[dict[str, Any]]) -> list[tuple[str, np.ndarray]]: ...


def _configs() -> dict[str, Callable[[], Family]]:
    from dynamiq.data.digits import DigitsConfig
    from dynamiq.data.gradients import DataConfig
    from dynamiq.data.mlm import MLMConfig

    return {"lm": DataConfig, "mlm": MLMConfig, "digits": DigitsConfig}


def family_config(name: str) -> Family:
    """The default configuration of family ``name``.

    Raises:
        ValueError: on an unknown name (the message lists the known ones).
    """
    configs = _configs()
    if name not in configs:
        raise ValueError(f"unknown family {name!r}; known families: {', '.join(FAMILIES)}")
    return configs[name]()


def parse_families(spec: str) -> list[str]:
    """``"all"`` or a comma-separated list of family names, validated, in the given order.

    Raises:
        ValueError: on an empty list, an unknown or a repeated name.
    """
    if spec.strip() == "all":
        return list(FAMILIES)
    names = [s.strip() for s in spec.split(",")]
    if not names or any(not n for n in names):
        raise ValueError(f"families must be 'all' or a comma-separated list (got {spec!r})")
    for n in names:
        if n not in FAMILIES:
            raise ValueError(f"unknown family {n!r}; known families: {', '.join(FAMILIES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"families must not repeat (got {spec!r})")
    return names


def family_arg(text: str) -> list[str]:
    """``argparse`` type of a ``--family`` option: :func:`parse_families`, its error as
    the option's error."""
    try:
        return parse_families(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
