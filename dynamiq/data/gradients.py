"""Train a family's model from scratch and compute per-worker gradients, with caching.

Pipeline (:func:`generate`), the same for every family of
:mod:`dynamiq.data.families` (the configuration object says which;
:class:`DataConfig`, the byte-level transformer ``lm``, is the default):

1. build the family's data source and model from its configuration;
2. training from scratch: ``train_steps`` of AdamW (linear warm-up, cosine
   decay, gradient clipping) on random batches of the *train* region;
3. for each worker ``w`` of the requested split, one forward/backward of the
   family's loss on that worker's own batch at the trained weights; all
   parameter gradients are flattened and concatenated in
   ``model.named_parameters()`` order into one fp32 row.

The trained weights and each split's ``[workers, N]`` fp32 array are cached in
``cache_dir`` under names carrying the family (none for ``lm``), a format
version and a hash of the configuration and data (``[<family>-]model-v1-<hash>.pt``,
``[<family>-]gradients-v1-<split>-<hash>.npy`` with a sibling ``.json`` of metadata).
Every file is written to a temporary name and renamed into place, and the
JSON is written last, so an interrupted run never leaves a cache that loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

import numpy as np
import torch
from torch import nn

from dynamiq.data.corpus import SPLITS, Corpus, build_corpus
from dynamiq.data.families import Family, Source
from dynamiq.data.model import ModelConfig, TinyTransformer, build_model, lm_loss, param_layout

__all__ = [
    "FORMAT_VERSION",
    "SLICE_RUN",
    "SLICE_WORKERS",
    "DataConfig",
    "default_cache_dir",
    "generate",
    "gradient_paths",
    "load_or_generate",
    "slice_segments",
    "train_model",
    "worker_gradient",
    "write_slice",
]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class DataConfig:
    """Family ``lm``: everything that determines its gradients (hashed into the cache name).

    The number of workers is *not* part of the configuration: worker ``i``'s
    batch does not depend on how many workers are generated, so a cache with
    ``W`` workers serves any request for ``<= W`` workers.
    """

    name: ClassVar[str] = "lm"
    model: ModelConfig = field(default_factory=ModelConfig)
    seed: int = 0
    stdlib_bytes: int = 4_000_000
    include_docs: bool = True
    train_steps: int = 500
    train_batch: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    worker_batch: int = 8
    max_workers: int = 256

    def validate(self) -> None:
        """Raise ``ValueError`` if a field is out of range."""
        self.model.validate()
        for name in ("train_steps", "train_batch", "worker_batch", "max_workers"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")
        for name in ("stdlib_bytes", "warmup_steps", "seed"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (got {value})")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (got {value!r})")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of the configuration."""
        return dataclasses.asdict(self)

    def build_corpus(self) -> Corpus:
        """The corpus this configuration reads."""
        return build_corpus(
            seq_len=self.model.seq_len,
            worker_batch=self.worker_batch,
            max_workers=self.max_workers,
            stdlib_bytes=self.stdlib_bytes,
            include_docs=self.include_docs,
            seed=self.seed,
        )

    def build_source(self) -> Corpus:
        """The data source: the corpus (windows of ``seq_len + 1`` bytes)."""
        return self.build_corpus()

    def build_model(self) -> TinyTransformer:
        """A freshly initialised transformer from ``seed``."""
        return build_model(self.model, self.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean next-byte cross-entropy of a ``[batch, seq_len + 1]`` byte tensor."""
        return lm_loss(model, batch)

    def slice_segments(self, layout: list[dict[str, Any]]) -> list[tuple[str, np.ndarray]]:
        """The committed slice's coordinates (:func:`slice_segments`)."""
        return slice_segments(layout)


def default_cache_dir() -> Path:
    """``$DYNAMIQ_CACHE`` if set, else ``~/.cache/dynamiq``."""
    env = os.environ.get("DYNAMIQ_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dynamiq"


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _model_key(cfg: Family, source: Source) -> str:
    obj: dict[str, Any] = {"version": FORMAT_VERSION, "config": cfg.to_dict()}
    obj["corpus"] = source.sha256
    if cfg.name != "lm":  # lm's keys predate the families and stay as they were
        obj["family"] = cfg.name
    return _hash(obj)


def _prefix(cfg: Family) -> str:
    return "" if cfg.name == "lm" else f"{cfg.name}-"


def gradient_paths(cache_dir: Path, split: str, cfg: Family, source: Source) -> tuple[Path, Path]:
    """The ``.npy`` and ``.json`` cache paths of ``split`` under ``cfg``."""
    key = _hash({"model": _model_key(cfg, source), "split": split})
    stem = f"{_prefix(cfg)}gradients-v{FORMAT_VERSION}-{split}-{key}"
    return cache_dir / f"{stem}.npy", cache_dir / f"{stem}.json"


def _model_path(cache_dir: Path, cfg: Family, source: Source) -> Path:
    return cache_dir / f"{_prefix(cfg)}model-v{FORMAT_VERSION}-{_model_key(cfg, source)}.pt"


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[dynamiq.data] {msg}", file=sys.stderr, flush=True)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary file in the same directory, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cache files and the slice are not secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _lr_at(step: int, cfg: Family) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.train_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * frac))


def train_model(
    cfg: Family, source: Source, *, progress: bool = True
) -> tuple[nn.Module, list[float]]:
    """Training from scratch on the train region; returns the model and the per-step loss curve."""
    model = cfg.build_model()
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 7)
    losses: list[float] = []
    start = time.perf_counter()
    every = max(1, cfg.train_steps // 20)
    for step in range(cfg.train_steps):
        lr = _lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = cfg.loss(model, source.train_batch(gen, cfg.train_batch))
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.item()))
        if step % every == 0 or step == cfg.train_steps - 1:
            recent = losses[-every:]
            _log(
                progress,
                f"{cfg.name} train step {step + 1}/{cfg.train_steps}  loss {losses[-1]:.4f}  "
                f"(mean of last {len(recent)}: {sum(recent) / len(recent):.4f})  lr {lr:.2e}  "
                f"elapsed {time.perf_counter() - start:.1f}s",
            )
    model.eval()
    return model, losses


def _trained_model(
    cfg: Family, source: Source, cache_dir: Path, *, regenerate: bool, progress: bool
) -> tuple[nn.Module, dict[str, Any]]:
    """Load the trained weights from the cache or train (and cache) them."""
    path = _model_path(cache_dir, cfg, source)
    if path.exists() and not regenerate:
        _log(progress, f"loading trained model from {path}")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            model = cfg.build_model()
            model.load_state_dict(blob["state_dict"])
            info: dict[str, Any] = json.loads(blob["info"])
        except Exception as exc:  # any unreadable cache entry (truncated, foreign) is rebuilt
            _log(progress, f"cannot load {path} ({exc.__class__.__name__}); retraining")
        else:
            model.eval()
            return model, info
    _log(progress, f"training {cfg.name} model ({cfg.train_steps} steps, batch {cfg.train_batch})")
    t0 = time.perf_counter()
    model, losses = train_model(cfg, source, progress=progress)
    tail = losses[-max(1, len(losses) // 20) :]
    info = {
        "train_seconds": time.perf_counter() - t0,
        "train_loss_curve": losses,
        "final_train_loss": sum(tail) / len(tail),
        "final_train_loss_window": len(tail),
        "trained_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    blob = {"state_dict": model.state_dict(), "info": json.dumps(info)}
    _atomic_write(path, lambda f: torch.save(blob, f))
    _log(
        progress,
        f"trained in {info['train_seconds']:.1f}s, "
        f"final loss {info['final_train_loss']:.4f}; saved {path}",
    )
    return model, info


def worker_gradient(cfg: Family, model: nn.Module, batch: Any) -> tuple[np.ndarray, float]:
    """Flat fp32 gradient (``named_parameters`` order) of the family's loss on ``batch``; loss."""
    model.zero_grad(set_to_none=True)
    loss = cfg.loss(model, batch)
    torch.autograd.backward(loss)
    parts = []
    for _, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(grad.detach().reshape(-1))
    flat = torch.cat(parts).to(torch.float32).numpy()
    model.zero_grad(set_to_none=True)
    return flat, float(loss.item())


def generate(
    split: str,
    workers: int,
    cfg: Family | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    regenerate: bool = False,
    progress: bool = True,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Compute and cache the ``[workers, N]`` fp32 gradients of ``split``; return them and metadata.

    Always recomputes the gradients (use :func:`load_or_generate` to use the
    cache); the trained weights are reused from the cache unless
    ``regenerate`` is true.
    """
    cfg = DataConfig() if cfg is None else cfg
    cfg.validate()
    _check_split_workers(split, workers, cfg)
    root = default_cache_dir() if cache_dir is None else Path(cache_dir)
    t_start = time.perf_counter()
    _log(progress, f"building the {cfg.name} data")
    source = cfg.build_source()
    model, train_info = _trained_model(cfg, source, root, regenerate=regenerate, progress=progress)
    layout = param_layout(model)
    numel = sum(int(p["numel"]) for p in layout)
    grads = np.empty((workers, numel), dtype=np.float32)
    losses: list[float] = []
    shards: list[list[Any]] = []
    t0 = time.perf_counter()
    every = max(1, workers // 8)
    for w in range(workers):
        grads[w], loss = worker_gradient(cfg, model, source.worker_examples(split, w))
        losses.append(loss)
        shards.append(source.worker_shard(split, w))
        if w % every == 0 or w == workers - 1:
            _log(
                progress,
                f"{cfg.name} {split} gradients: worker {w + 1}/{workers}  loss {loss:.4f}  "
                f"elapsed {time.perf_counter() - t0:.1f}s",
            )
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "family": cfg.name,
        "split": split,
        "workers": workers,
        "numel": numel,
        "dtype": "float32",
        "config": cfg.to_dict(),
        "params": layout,
        "data": source.describe(),
        "worker_shards": shards,
        "worker_losses": losses,
        "train": train_info,
        "gradient_seconds": time.perf_counter() - t0,
        "total_seconds": time.perf_counter() - t_start,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }
    npy, js = gradient_paths(root, split, cfg, source)
    js.unlink(missing_ok=True)  # the entry is incomplete until the new JSON lands
    _atomic_write(npy, lambda f: np.save(f, grads, allow_pickle=False))
    text = json.dumps(meta, indent=1).encode()

    def write_json(f: IO[bytes]) -> None:
        f.write(text)

    _atomic_write(js, write_json)
    _log(progress, f"wrote {npy} ({grads.nbytes / 2**20:.0f} MiB)")
    return grads, meta


def _check_split_workers(split: str, workers: int, cfg: Family) -> None:
    if split not in SPLITS:
        raise ValueError(
            f"split must be one of {', '.join(repr(s) for s in SPLITS)} (got {split!r})"
        )
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise ValueError(f"workers must be an integer (got {workers!r})")
    if workers < 1:
        raise ValueError(f"workers must be >= 1 (got {workers})")
    if workers > cfg.max_workers:
        raise ValueError(
            f"workers must be <= max_workers={cfg.max_workers} of the configuration "
            f"(got {workers}); the text reserved for each split only holds that many worker batches"
        )


def _read_cache(npy: Path, js: Path, workers: int) -> tuple[np.ndarray, dict[str, Any]] | None:
    """First ``workers`` rows of a complete cache entry; ``None`` if absent, small or corrupt."""
    if not (js.exists() and npy.exists()):
        return None
    try:
        meta = dict(json.loads(js.read_text()))
        arr = np.load(npy, mmap_mode="r", allow_pickle=False)
        if arr.dtype != np.float32 or arr.shape != (meta["workers"], meta["numel"]):
            return None
        if arr.shape[0] < workers:
            return None
        out = np.array(arr[:workers])
        if "data" not in meta:  # an lm entry written before the families: same content
            meta["family"] = "lm"
            meta["data"] = meta.pop("corpus")
            meta["worker_shards"] = meta.pop("worker_windows")
        meta["cached_workers"] = meta["workers"]
        meta["workers"] = workers
        meta["worker_shards"] = meta["worker_shards"][:workers]
        meta["worker_losses"] = meta["worker_losses"][:workers]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out, meta


def load_or_generate(
    split: str,
    workers: int,
    cfg: Family | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    regenerate: bool = False,
    progress: bool = True,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Cached ``[workers, N]`` gradients of ``split`` and metadata, generating them if needed.

    A cache entry holding more workers is sliced; one holding fewer is
    regenerated with the requested number of workers (reusing the cached
    trained weights).
    """
    cfg = DataConfig() if cfg is None else cfg
    cfg.validate()
    _check_split_workers(split, workers, cfg)
    root = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if not regenerate:
        npy, js = gradient_paths(root, split, cfg, cfg.build_source())
        hit = _read_cache(npy, js, workers)
        if hit is not None:
            _log(progress, f"loaded {split} gradients {hit[0].shape} from {npy}")
            return hit
        _log(
            progress,
            f"no usable {cfg.name} cache for split={split!r}, workers={workers} at {npy}; "
            "generating",
        )
    return generate(split, workers, cfg, cache_dir=root, regenerate=regenerate, progress=progress)


SLICE_WORKERS = 8
SLICE_RUN = 8192


def slice_segments(
    layout: list[dict[str, Any]], run: int = SLICE_RUN
) -> list[tuple[str, np.ndarray]]:
    """Coordinates of the committed slice: four groups of ``run`` flat indices.

    * ``embedding``: token-embedding rows from byte 32 (space, punctuation,
      digits: bytes every worker sees), contiguous;
    * ``attention``: a contiguous run centred in the second block's fused
      ``qkv.weight``;
    * ``mlp``: a contiguous run centred in the third block's ``fc1.weight``;
    * ``norm_bias``: the first ``run`` coordinates of all 1-D parameters
      (LayerNorm gains/biases and linear biases) in flattening order.
    """
    by_name = {str(p["name"]): p for p in layout}
    n_blocks = sum(1 for name in by_name if name.endswith(".qkv.weight"))

    def centred(name: str) -> np.ndarray:
        p = by_name[name]
        numel, offset = int(p["numel"]), int(p["offset"])
        if numel < run:
            raise ValueError(
                f"parameter {name} must have >= {run} values for the slice (got {numel})"
            )
        start = offset + (numel - run) // 2
        return np.arange(start, start + run, dtype=np.int64)

    emb = by_name["tok_emb.weight"]
    emb_numel, emb_offset = int(emb["numel"]), int(emb["offset"])
    d_model = int(emb["shape"][1])
    first = min(32 * d_model, emb_numel - run)
    if first < 0:
        raise ValueError(
            f"tok_emb.weight must have >= {run} values for the slice (got {emb_numel})"
        )
    small = np.concatenate(
        [
            np.arange(int(p["offset"]), int(p["offset"]) + int(p["numel"]), dtype=np.int64)
            for p in layout
            if len(p["shape"]) == 1
        ]
    )
    if small.size < run:
        raise ValueError(
            f"1-D parameters must have >= {run} values for the slice (got {small.size})"
        )
    return [
        ("embedding", np.arange(emb_offset + first, emb_offset + first + run, dtype=np.int64)),
        ("attention", centred(f"blocks.{min(1, n_blocks - 1)}.qkv.weight")),
        ("mlp", centred(f"blocks.{min(2, n_blocks - 1)}.fc1.weight")),
        ("norm_bias", small[:run]),
    ]


def write_slice(
    grads: np.ndarray,
    meta: dict[str, Any],
    path: str | os.PathLike[str],
    cfg: Family | None = None,
    *,
    extras: bool = True,
) -> np.ndarray:
    """Write the slice (first ``SLICE_WORKERS`` workers at ``cfg.slice_segments``) to ``path``.

    With ``extras`` (the default) the file also records the family, its
    training loss curve, the sliced workers' losses and the statistics of the
    whole split (``full_stats``, JSON), so tests can check them without the cache.
    """
    from dynamiq.data import gradient_stats

    cfg = DataConfig() if cfg is None else cfg
    if grads.shape[0] < SLICE_WORKERS:
        raise ValueError(
            f"workers must be >= {SLICE_WORKERS} to write the slice (got {grads.shape[0]})"
        )
    segments = cfg.slice_segments(meta["params"])
    indices = np.concatenate([idx for _, idx in segments])
    values = np.ascontiguousarray(grads[:SLICE_WORKERS][:, indices], dtype=np.float32)
    starts = np.cumsum([0] + [idx.size for _, idx in segments[:-1]]).astype(np.int64)
    arrays: dict[str, np.ndarray] = {
        "gradients": values,
        "indices": indices,
        "segment_names": np.array([name for name, _ in segments]),
        "segment_starts": starts,
        "segment_params": np.array(
            [",".join(_params_of(meta["params"], idx)) for _, idx in segments]
        ),
        "source": np.array(
            f"split={meta['split']} workers=0..{SLICE_WORKERS - 1} "
            f"corpus={meta['data']['sha256'][:16]} created_at={meta['created_at']} "
            f"torch={meta['torch_version']}"
        ),
    }
    if extras:
        full = gradient_stats(torch.from_numpy(grads))
        arrays["family"] = np.array(cfg.name)
        arrays["numel"] = np.array(int(meta["numel"]), dtype=np.int64)
        arrays["train_loss_curve"] = np.asarray(meta["train"]["train_loss_curve"], dtype=np.float64)
        arrays["worker_losses"] = np.asarray(
            meta["worker_losses"][:SLICE_WORKERS], dtype=np.float64
        )
        arrays["full_stats"] = np.array(json.dumps(full, sort_keys=True))

    def write(f: IO[bytes]) -> None:
        np.savez_compressed(f, **arrays)  # type: ignore[arg-type]

    _atomic_write(Path(path), write)
    return values


def _params_of(layout: list[dict[str, Any]], indices: np.ndarray) -> list[str]:
    """Names of the parameters the flat ``indices`` fall in, in flattening order."""
    names: list[str] = []
    for p in layout:
        lo, hi = int(p["offset"]), int(p["offset"]) + int(p["numel"])
        if bool(((indices >= lo) & (indices < hi)).any()):
            names.append(str(p["name"]))
    return names
