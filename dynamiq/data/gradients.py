"""Train the byte-level transformer and compute per-worker gradients, with caching.

Pipeline (:func:`generate`):

1. build the corpus (:mod:`dynamiq.data.corpus`) and the model
   (:mod:`dynamiq.data.model`) from :class:`DataConfig`;
2. warm-up training: ``train_steps`` of AdamW (linear warm-up, cosine decay,
   gradient clipping) on random windows of the *train* region;
3. for each worker ``w`` of the requested split, one forward/backward of the
   mean next-byte cross-entropy on that worker's own batch at the trained
   weights; all parameter gradients are flattened and concatenated in
   ``model.named_parameters()`` order into one fp32 row.

The trained weights and each split's ``[workers, N]`` fp32 array are cached in
``cache_dir`` under names carrying a format version and a hash of the
configuration and corpus (``model-v1-<hash>.pt``,
``gradients-v1-<split>-<hash>.npy`` with a sibling ``.json`` of metadata).
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
from typing import IO, Any

import numpy as np
import torch

from dynamiq.data.corpus import SPLITS, Corpus, build_corpus
from dynamiq.data.model import ModelConfig, TinyTransformer, build_model, param_layout

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
    """Everything that determines the generated gradients (hashed into the cache name).

    The number of workers is *not* part of the configuration: worker ``i``'s
    batch does not depend on how many workers are generated, so a cache with
    ``W`` workers serves any request for ``<= W`` workers.
    """

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


def default_cache_dir() -> Path:
    """``$DYNAMIQ_CACHE`` if set, else ``~/.cache/dynamiq``."""
    env = os.environ.get("DYNAMIQ_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dynamiq"


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _model_key(cfg: DataConfig, corpus: Corpus) -> str:
    return _hash({"version": FORMAT_VERSION, "config": cfg.to_dict(), "corpus": corpus.sha256})


def gradient_paths(
    cache_dir: Path, split: str, cfg: DataConfig, corpus: Corpus
) -> tuple[Path, Path]:
    """The ``.npy`` and ``.json`` cache paths of ``split`` under ``cfg``."""
    key = _hash({"model": _model_key(cfg, corpus), "split": split})
    stem = f"gradients-v{FORMAT_VERSION}-{split}-{key}"
    return cache_dir / f"{stem}.npy", cache_dir / f"{stem}.json"


def _model_path(cache_dir: Path, cfg: DataConfig, corpus: Corpus) -> Path:
    return cache_dir / f"model-v{FORMAT_VERSION}-{_model_key(cfg, corpus)}.pt"


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


def _lr_at(step: int, cfg: DataConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.train_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * frac))


def train_model(
    cfg: DataConfig, corpus: Corpus, *, progress: bool = True
) -> tuple[TinyTransformer, list[float]]:
    """Warm-up training on the train region; returns the model and the per-step loss curve."""
    model = build_model(cfg.model, cfg.seed)
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
    text = corpus.train_tensor()
    window = corpus.window
    if text.numel() < window:
        raise ValueError(f"train region must hold at least {window} bytes (got {text.numel()})")
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 7)
    offsets = torch.arange(window)
    losses: list[float] = []
    start = time.perf_counter()
    every = max(1, cfg.train_steps // 20)
    for step in range(cfg.train_steps):
        lr = _lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, text.numel() - window + 1, (cfg.train_batch,), generator=gen)
        batch = text[starts[:, None] + offsets].long()
        loss = model.loss(batch)
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
                f"train step {step + 1}/{cfg.train_steps}  loss {losses[-1]:.4f}  "
                f"(mean of last {len(recent)}: {sum(recent) / len(recent):.4f})  lr {lr:.2e}  "
                f"elapsed {time.perf_counter() - start:.1f}s",
            )
    model.eval()
    return model, losses


def _trained_model(
    cfg: DataConfig, corpus: Corpus, cache_dir: Path, *, regenerate: bool, progress: bool
) -> tuple[TinyTransformer, dict[str, Any]]:
    """Load the trained weights from the cache or train (and cache) them."""
    path = _model_path(cache_dir, cfg, corpus)
    if path.exists() and not regenerate:
        _log(progress, f"loading trained model from {path}")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            model = build_model(cfg.model, cfg.seed)
            model.load_state_dict(blob["state_dict"])
            info: dict[str, Any] = json.loads(blob["info"])
        except Exception as exc:  # any unreadable cache entry (truncated, foreign) is rebuilt
            _log(progress, f"cannot load {path} ({exc.__class__.__name__}); retraining")
        else:
            model.eval()
            return model, info
    _log(
        progress,
        f"training model ({cfg.train_steps} steps, batch {cfg.train_batch}x{cfg.model.seq_len})",
    )
    t0 = time.perf_counter()
    model, losses = train_model(cfg, corpus, progress=progress)
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


def worker_gradient(model: TinyTransformer, batch: torch.Tensor) -> tuple[np.ndarray, float]:
    """Flat fp32 gradient (``named_parameters`` order) of the mean loss on ``batch``, and loss."""
    model.zero_grad(set_to_none=True)
    loss = model.loss(batch)
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
    cfg: DataConfig | None = None,
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
    _log(progress, "building corpus from pydoc_data.topics and the stdlib sources")
    corpus = cfg.build_corpus()
    model, train_info = _trained_model(cfg, corpus, root, regenerate=regenerate, progress=progress)
    layout = param_layout(model)
    numel = sum(int(p["numel"]) for p in layout)
    grads = np.empty((workers, numel), dtype=np.float32)
    losses: list[float] = []
    windows: list[list[list[int]]] = []
    t0 = time.perf_counter()
    every = max(1, workers // 8)
    for w in range(workers):
        grads[w], loss = worker_gradient(model, corpus.worker_batch_tensor(split, w))
        losses.append(loss)
        windows.append([[a, b] for a, b in corpus.worker_windows(split, w)])
        if w % every == 0 or w == workers - 1:
            _log(
                progress,
                f"{split} gradients: worker {w + 1}/{workers}  loss {loss:.4f}  "
                f"elapsed {time.perf_counter() - t0:.1f}s",
            )
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "split": split,
        "workers": workers,
        "numel": numel,
        "dtype": "float32",
        "config": cfg.to_dict(),
        "params": layout,
        "corpus": {
            "sha256": corpus.sha256,
            "bytes": len(corpus.data),
            "documents": corpus.documents,
            "pydoc_topics_bytes": corpus.doc_bytes,
            "stdlib_bytes": corpus.stdlib_bytes,
            "regions": {k: list(v) for k, v in corpus.regions.items()},
            "window": corpus.window,
        },
        "worker_windows": windows,
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
    npy, js = gradient_paths(root, split, cfg, corpus)
    js.unlink(missing_ok=True)  # the entry is incomplete until the new JSON lands
    _atomic_write(npy, lambda f: np.save(f, grads, allow_pickle=False))
    text = json.dumps(meta, indent=1).encode()

    def write_json(f: IO[bytes]) -> None:
        f.write(text)

    _atomic_write(js, write_json)
    _log(progress, f"wrote {npy} ({grads.nbytes / 2**20:.0f} MiB)")
    return grads, meta


def _check_split_workers(split: str, workers: int, cfg: DataConfig) -> None:
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
        meta["cached_workers"] = meta["workers"]
        meta["workers"] = workers
        meta["worker_windows"] = meta["worker_windows"][:workers]
        meta["worker_losses"] = meta["worker_losses"][:workers]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out, meta


def load_or_generate(
    split: str,
    workers: int,
    cfg: DataConfig | None = None,
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
        corpus = cfg.build_corpus()
        npy, js = gradient_paths(root, split, cfg, corpus)
        hit = _read_cache(npy, js, workers)
        if hit is not None:
            _log(progress, f"loaded {split} gradients {hit[0].shape} from {npy}")
            return hit
        _log(
            progress, f"no usable cache for split={split!r}, workers={workers} at {npy}; generating"
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
    grads: np.ndarray, meta: dict[str, Any], path: str | os.PathLike[str]
) -> np.ndarray:
    """Write the slice (first ``SLICE_WORKERS`` workers at :func:`slice_segments`) to ``path``."""
    if grads.shape[0] < SLICE_WORKERS:
        raise ValueError(
            f"workers must be >= {SLICE_WORKERS} to write the slice (got {grads.shape[0]})"
        )
    segments = slice_segments(meta["params"])
    indices = np.concatenate([idx for _, idx in segments])
    values = np.ascontiguousarray(grads[:SLICE_WORKERS][:, indices], dtype=np.float32)
    starts = np.cumsum([0] + [idx.size for _, idx in segments[:-1]]).astype(np.int64)
    names = np.array([name for name, _ in segments])
    params = np.array([",".join(_params_of(meta["params"], idx)) for _, idx in segments])
    source = np.array(
        f"split={meta['split']} workers=0..{SLICE_WORKERS - 1} "
        f"corpus={meta['corpus']['sha256'][:16]} created_at={meta['created_at']} "
        f"torch={meta['torch_version']}"
    )

    def write(f: IO[bytes]) -> None:
        np.savez_compressed(
            f,
            gradients=values,
            indices=indices,
            segment_names=names,
            segment_starts=starts,
            segment_params=params,
            source=source,
        )

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
