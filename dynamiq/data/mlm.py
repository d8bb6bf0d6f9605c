"""Family ``mlm``: a BERT-style masked-LM encoder trained from scratch on CPython's text.

Differs from the ``lm`` family's model (:mod:`dynamiq.data.model`) where BERT
differs from GPT: bidirectional attention, post-LayerNorm blocks, a LayerNorm
on the embeddings, an MLM head (dense + GELU + LayerNorm) whose output
projection is tied to the token embedding, and a loss on masked positions only.
The text and its eval/fit/train regions are those of
:mod:`dynamiq.data.corpus` (windows of ``seq_len`` bytes).

Masking follows BERT: each byte is chosen with probability ``mask_prob`` (at
least one per window); a chosen byte becomes the ``[MASK]`` id 256 with
probability 0.8, a uniformly random byte with probability 0.1, and stays
itself otherwise; the loss is the mean cross-entropy of the chosen bytes. The
training batches draw their masks from the training generator; worker ``w`` of
a split draws its masks from a generator seeded by (seed, split, ``w``), so a
worker's batch does not depend on how many workers are generated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dynamiq.data.corpus import SPLITS, Corpus, build_corpus
from dynamiq.data.model import seeded

__all__ = ["MASK_ID", "MLMConfig", "MLMEncoder", "MLMSource", "mask_bytes"]

#: the ``[MASK]`` token id (bytes are 0..255)
MASK_ID = 256
_IGNORE = -100


@dataclass(frozen=True)
class MLMConfig:
    """Everything that determines the ``mlm`` gradients (hashed into the cache name).

    The defaults give 2,518,529 parameters (over the 2^21 values a compare
    buffer takes), trained for 200 AdamW steps.
    """

    name: ClassVar[str] = "mlm"
    d_model: int = 256
    n_layers: int = 3
    n_heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4
    mask_prob: float = 0.15
    seed: int = 0
    stdlib_bytes: int = 4_000_000
    include_docs: bool = True
    train_steps: int = 200
    train_batch: int = 16
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    worker_batch: int = 8
    max_workers: int = 256

    def validate(self) -> None:
        """Raise ``ValueError`` if a field is out of range."""
        for key in ("d_model", "n_layers", "n_heads", "mlp_ratio", "train_steps", "train_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1 (got {value!r})")
        for key in ("worker_batch", "max_workers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1 (got {getattr(self, key)})")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (got {self.seq_len})")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                "d_model must be divisible by n_heads "
                f"(got d_model={self.d_model}, n_heads={self.n_heads})"
            )
        if not (isinstance(self.mask_prob, float) and 0.0 < self.mask_prob <= 1.0):
            raise ValueError(f"mask_prob must be a float in (0, 1] (got {self.mask_prob!r})")
        for key in ("stdlib_bytes", "warmup_steps", "seed"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0 (got {getattr(self, key)})")
        for key in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be a finite number >= 0 (got {value!r})")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of the configuration."""
        return dataclasses.asdict(self)

    def build_source(self) -> MLMSource:
        """The CPython text, cut into windows of ``seq_len`` bytes, with BERT masking."""
        corpus = build_corpus(
            seq_len=self.seq_len - 1,  # the corpus' windows are seq_len + 1 bytes
            worker_batch=self.worker_batch,
            max_workers=self.max_workers,
            stdlib_bytes=self.stdlib_bytes,
            include_docs=self.include_docs,
            seed=self.seed,
        )
        return MLMSource(corpus, self.mask_prob, self.seed)

    def build_model(self) -> MLMEncoder:
        """A freshly initialised encoder from ``seed`` (the caller's RNG state is kept)."""
        return seeded(lambda: MLMEncoder(self), self.seed)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy (nats) of the masked bytes of an ``(inputs, labels)`` batch."""
        inputs, labels = batch
        logits = model(inputs)
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=_IGNORE
        )

    def slice_segments(self, layout: list[dict[str, Any]]) -> list[tuple[str, np.ndarray]]:
        """The ``lm`` slice's four groups (embedding, attention, MLP, 1-D parameters)."""
        from dynamiq.data.gradients import slice_segments

        return slice_segments(layout)


def mask_bytes(
    windows: torch.Tensor, mask_prob: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of ``[batch, seq]`` byte ids: ``(inputs, labels)``, labels -100 if unchosen."""
    b, t = windows.shape
    chosen = torch.rand((b, t), generator=gen) < mask_prob
    first = torch.randint(0, t, (b,), generator=gen)
    chosen[torch.arange(b), first] |= ~chosen.any(dim=1)  # at least one target per window
    action = torch.rand((b, t), generator=gen)
    noise = torch.randint(0, 256, (b, t), generator=gen)
    inputs = windows.clone()
    inputs[chosen & (action < 0.8)] = MASK_ID
    swap = chosen & (action >= 0.8) & (action < 0.9)
    inputs[swap] = noise[swap]
    labels = torch.where(chosen, windows, torch.full_like(windows, _IGNORE))
    return inputs, labels


class MLMSource:
    """The corpus' windows with BERT masking (see the module docstring)."""

    def __init__(self, corpus: Corpus, mask_prob: float, seed: int) -> None:
        self.corpus = corpus
        self.mask_prob = mask_prob
        self.seed = seed

    @property
    def sha256(self) -> str:
        return self.corpus.sha256

    def describe(self) -> dict[str, Any]:
        return {**self.corpus.describe(), "mask_prob": self.mask_prob, "mask_id": MASK_ID}

    def train_batch(self, gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return mask_bytes(self.corpus.train_batch(gen, size), self.mask_prob, gen)

    def worker_examples(self, split: str, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.corpus.worker_batch_tensor(split, worker)
        gen = torch.Generator().manual_seed(
            (self.seed * 1000 + 11 + SPLITS.index(split)) * 100_000 + worker
        )
        return mask_bytes(windows, self.mask_prob, gen)

    def worker_shard(self, split: str, worker: int) -> list[list[int]]:
        return self.corpus.worker_shard(split, worker)


class _PostLNBlock(nn.Module):
    """BERT block: x = LN(x + attn(x)), then x = LN(x + mlp(x)); attention is bidirectional."""

    def __init__(self, cfg: MLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.n_heads
        q, k, v = (
            z.view(b, t, self.n_heads, hd).transpose(1, 2) for z in self.qkv(x).split(d, dim=2)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = self.ln1(x + self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class MLMEncoder(nn.Module):
    """Byte-level BERT-style encoder; ``forward`` gives logits over the 257 ids."""

    def __init__(self, cfg: MLMConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        vocab = MASK_ID + 1
        self.tok_emb = nn.Embedding(vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.ln_emb = nn.LayerNorm(cfg.d_model)
        self.blocks = nn.ModuleList(_PostLNBlock(cfg) for _ in range(cfg.n_layers))
        self.head_dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.head_ln = nn.LayerNorm(cfg.d_model)
        self.head_bias = nn.Parameter(torch.zeros(vocab))
        for name, p in self.named_parameters():  # BERT init: N(0, 0.02), zero biases
            if p.ndim >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, time, 257]`` (the output projection is ``tok_emb.weight``)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length must be <= {self.cfg.seq_len} (got {t})")
        x = self.ln_emb(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        h = self.head_ln(F.gelu(self.head_dense(x)))
        return F.linear(h, self.tok_emb.weight, self.head_bias)
