"""Real gradients for benchmarking compressed all-reduce codecs.

Three model families (:mod:`dynamiq.data.families`), each trained from scratch
on data that ships with a package: ``lm`` (the default, described below),
``mlm`` (a BERT-style masked-LM encoder on the same text,
:mod:`dynamiq.data.mlm`) and ``digits`` (a conv net on scikit-learn's bundled
digits, :mod:`dynamiq.data.digits`). Every function below takes ``family``.

For ``lm``, a ~3.3M-parameter byte-level transformer (:mod:`dynamiq.data.model`) is trained
for a few hundred AdamW steps on text that ships with CPython (the
``pydoc_data.topics`` documentation and standard-library sources, see
:mod:`dynamiq.data.corpus`); then each of ``W`` simulated data-parallel workers
runs one forward/backward on its own disjoint text shard at the trained
weights.  Each worker's gradients, flattened in a fixed parameter order, form
one fp32 row of a ``[W, N]`` array (:mod:`dynamiq.data.gradients`).

Two disjoint gradient sets exist: ``split="eval"`` for measuring codecs and
``split="fit"`` for fitting anything data-dependent (e.g. level tables), so
fitted tables are never evaluated on the data they were fitted to.

Public API:

* :func:`load_gradients` -- the full set, generated on first use (minutes on
  a 2-core CPU) and cached in ``$DYNAMIQ_CACHE`` or ``~/.cache/dynamiq``;
* :func:`load_slice` -- a small committed slice of the eval set (``[8, 32768]``
  for ``lm``), shipped as package data (no cache, no generation);
* :func:`gradient_stats` -- tail and spread statistics of a ``[W, N]`` array.

``python -m dynamiq.data [--family NAME]`` generates both splits and prints the statistics.
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from typing import Any

import numpy as np
import torch

from dynamiq.data.families import FAMILIES, Family, family_config
from dynamiq.data.gradients import load_or_generate

__all__ = ["FAMILIES", "gradient_stats", "load_gradients", "load_slice"]

#: the shape of the ``lm`` family's slice
SLICE_SHAPE: tuple[int, int] = (8, 32768)


def slice_file(family: str = "lm") -> str:
    """File name (package data of :mod:`dynamiq.data`) of ``family``'s committed slice."""
    family_config(family)  # raises on an unknown family
    return "slice.npz" if family == "lm" else f"slice-{family}.npz"


def _resolve(family: str, config: Family | None) -> Family:
    if config is None:
        return family_config(family)
    if config.name != family:
        raise ValueError(
            f"config is a {config.name!r} configuration but family is {family!r}; "
            f"pass family={config.name!r}"
        )
    return config


def load_gradients(
    split: str = "eval",
    workers: int = 32,
    *,
    regenerate: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    config: Family | None = None,
    family: str = "lm",
) -> torch.Tensor:
    """Per-worker real gradients of ``family`` as an fp32 tensor ``[workers, N]``.

    Row ``w`` is the flattened gradient (``named_parameters`` order, see the
    ``params`` list of the cache's JSON metadata) of worker ``w``'s mean loss
    on its own shard at the trained weights; ``N`` is the model's parameter
    count (``lm``: 3,323,648, ``mlm``: 2,518,529, ``digits``: 548,746 for the
    default configurations).

    Args:
        split: ``"eval"`` (for measuring) or ``"fit"`` (for fitting tables);
            the two use disjoint text.
        workers: number of workers (rows), ``1 <= workers <= config.max_workers``.
            Worker ``w``'s data does not depend on ``workers``, so a smaller
            request is served from a larger cache; a larger request than the
            cache holds regenerates the gradients (not the training).
        regenerate: recompute everything (training included) even if cached.
        cache_dir: cache directory; default ``$DYNAMIQ_CACHE`` or
            ``~/.cache/dynamiq``.
        progress: print progress (step, loss, elapsed) to stderr.
        config: generation configuration; default: the family's defaults
            (:class:`DataConfig`, :class:`MLMConfig`, :class:`DigitsConfig`).
        family: ``"lm"`` (default), ``"mlm"`` or ``"digits"``.

    Raises:
        ValueError: on an unknown split or family, a config of another family,
            or an out-of-range worker count.
    """
    if not isinstance(regenerate, bool):
        raise ValueError(f"regenerate must be a bool (got {regenerate!r})")
    cfg = _resolve(family, config)
    grads, _ = load_or_generate(
        split, workers, cfg, cache_dir=cache_dir, regenerate=regenerate, progress=progress
    )
    return torch.from_numpy(grads)


def _read_slice(family: str) -> dict[str, np.ndarray]:
    ref = resources.files(__name__).joinpath(slice_file(family))
    with ref.open("rb") as f, np.load(f, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def load_slice(family: str = "lm") -> torch.Tensor:
    """The committed fp32 slice ``[8, M]`` of ``family``'s eval gradients (package data).

    The same ``M`` coordinates of the first 8 eval workers. ``lm`` and ``mlm``
    (``M`` = 32768): four groups of 8192 from the token embedding, an attention
    ``qkv`` weight, an MLP ``fc1`` weight and the LayerNorm/bias parameters;
    ``digits`` (``M`` = 30,282): the convolutions, ``fc1`` and the classifier
    with every bias (:func:`load_slice_info` gives the coordinates).
    """
    grads = _read_slice(family)["gradients"]
    return torch.from_numpy(np.ascontiguousarray(grads, dtype=np.float32))


def load_slice_info(family: str = "lm") -> dict[str, Any]:
    """Where ``family``'s slice comes from.

    Returns a dict with ``indices`` (int64 ``[M]``: flat coordinates into
    the ``N`` values of a worker row of :func:`load_gradients`), ``segments``
    (name -> ``{"start": column of the slice, "params": parameter names}``;
    ``embedding``, ``attention``, ``mlp`` and ``norm_bias`` for ``lm``) and
    ``source`` (split, workers, data hash, creation date, torch version).
    Slices written with the families (all but ``lm``'s, which predates them)
    also give ``numel`` (``N``), ``train_loss_curve`` (the loss of every
    training step), ``worker_losses`` (of the 8 sliced workers) and
    ``full_stats`` (:func:`gradient_stats` of the whole eval split the slice
    was cut from).
    """
    data = _read_slice(family)
    names = [str(n) for n in data["segment_names"]]
    starts = [int(s) for s in data["segment_starts"]]
    extras: dict[str, Any] = {}
    if "train_loss_curve" in data:
        extras = {
            "numel": int(data["numel"]),
            "train_loss_curve": [float(v) for v in data["train_loss_curve"]],
            "worker_losses": [float(v) for v in data["worker_losses"]],
            "full_stats": json.loads(str(data["full_stats"])),
        }
    return {
        "indices": torch.from_numpy(data["indices"].astype(np.int64)),
        "segments": {
            name: {"start": start, "params": str(params).split(",")}
            for name, start, params in zip(names, starts, data["segment_params"], strict=True)
        },
        "source": str(data["source"]),
        **extras,
    }


def _moments(x: torch.Tensor) -> tuple[float, float, float]:
    """Kurtosis ``m4 / m2**2`` (central, population), ``max|x|``, RMS; fp64."""
    x = x.to(torch.float64)
    d = x - x.mean()
    d2 = d * d
    m2 = float(d2.mean())
    m4 = float((d2 * d2).mean())
    kurt = m4 / (m2 * m2) if m2 > 0 else math.nan
    rms = float(torch.sqrt((x * x).mean()))
    return kurt, float(x.abs().max()), rms


def gradient_stats(g: torch.Tensor) -> dict[str, float]:
    """Tail and spread statistics of a ``[workers, N]`` gradient array (computed in fp64).

    Keys (all floats):

    * ``workers``, ``numel`` -- the shape;
    * ``kurtosis`` / ``excess_kurtosis`` -- Pearson kurtosis ``m4 / m2**2``
      of each worker's values (central moments, population normalisation),
      averaged over workers; excess = kurtosis - 3 (0 for a Gaussian);
    * ``sum_kurtosis`` / ``sum_excess_kurtosis`` -- the same for the
      summed gradient ``g.sum(0)``;
    * ``norm_min``, ``norm_max``, ``norm_mean`` -- per-worker L2 norms;
      ``norm_max_min_ratio`` = max/min, ``norm_cv`` = population std / mean;
    * ``zero_fraction`` -- fraction of exact zeros in ``g``;
    * ``absmax_over_rms`` -- ``max|g_w| / rms(g_w)`` averaged over workers;
      ``sum_absmax_over_rms`` -- the same for the summed gradient.

    Raises:
        ValueError: if ``g`` is not a non-empty 2-D real tensor.
    """
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"g must be a torch.Tensor (got {type(g).__name__})")
    if g.ndim != 2:
        raise ValueError(f"g must be a 2-D tensor [workers, numel] (got shape {tuple(g.shape)})")
    if g.numel() == 0:
        raise ValueError(f"g must be non-empty (got shape {tuple(g.shape)})")
    if g.is_complex() or g.dtype == torch.bool:
        raise ValueError(f"g must be a real numeric tensor (got dtype {g.dtype})")
    workers, numel = g.shape
    kurts: list[float] = []
    peaks: list[float] = []
    norms: list[float] = []
    zeros = 0
    total = torch.zeros(numel, dtype=torch.float64)
    for row in g:
        r = row.to(torch.float64)
        kurt, absmax, rms = _moments(r)
        kurts.append(kurt)
        peaks.append(absmax / rms if rms > 0 else math.nan)
        norms.append(float(torch.linalg.vector_norm(r)))
        zeros += int((r == 0).sum())
        total += r
    s_kurt, s_absmax, s_rms = _moments(total)
    norm_arr = np.asarray(norms, dtype=np.float64)
    norm_mean = float(norm_arr.mean())
    norm_min = float(norm_arr.min())
    return {
        "workers": float(workers),
        "numel": float(numel),
        "kurtosis": float(np.mean(kurts)),
        "excess_kurtosis": float(np.mean(kurts)) - 3.0,
        "sum_kurtosis": s_kurt,
        "sum_excess_kurtosis": s_kurt - 3.0,
        "norm_min": norm_min,
        "norm_max": float(norm_arr.max()),
        "norm_mean": norm_mean,
        "norm_max_min_ratio": float(norm_arr.max()) / norm_min if norm_min > 0 else math.inf,
        "norm_cv": float(norm_arr.std()) / norm_mean if norm_mean > 0 else math.nan,
        "zero_fraction": zeros / (workers * numel),
        "absmax_over_rms": float(np.mean(peaks)),
        "sum_absmax_over_rms": s_absmax / s_rms if s_rms > 0 else math.nan,
    }
