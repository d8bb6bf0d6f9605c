"""A small byte-level causal transformer used to produce real gradients.

The model is deliberately plain ``torch.nn`` (no fused kernels, no dropout) so
that the gradients it produces are reproducible on CPU and representative of
what a data-parallel worker would all-reduce: a token embedding, a learned
position embedding, ``n_layers`` pre-LayerNorm blocks (multi-head causal
self-attention and a GELU MLP, both with biases), a final LayerNorm and an
untied output projection.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyTransformer", "build_model", "lm_loss", "param_layout"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the byte-level transformer.

    The defaults give a model of about 3.3M parameters (well over the 2M values
    per worker the data set needs).
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4

    def validate(self) -> None:
        """Raise ``ValueError`` if a field is out of range."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if self.vocab_size > 256:
            raise ValueError(
                f"vocab_size must be <= 256 for a byte-level model (got {self.vocab_size})"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                "d_model must be divisible by n_heads "
                f"(got d_model={self.d_model}, n_heads={self.n_heads})"
            )


class _Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(d, dim=2)
        hd = d // self.n_heads
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.n_heads, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x


class TinyTransformer(nn.Module):
    """Byte-level causal language model (pre-LayerNorm GPT-style)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02) weights, zero biases, residual projections
        # scaled down by sqrt(2 * n_layers).  Uses the (forked) global RNG.
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                continue  # LayerNorm weights stay 1, biases 0 (nn defaults / zeroed below)
            std = resid_std if name.endswith(("proj.weight", "fc2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return logits ``[batch, time, vocab]`` for byte ids ``idx`` ``[batch, time]``."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length must be <= {self.cfg.seq_len} (got {t})")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of a ``[batch, seq_len + 1]`` byte tensor."""
        return lm_loss(self, batch)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats, computed in fp32) of a ``[batch, seq_len + 1]``
    byte tensor; ``model`` (a :class:`TinyTransformer`) may be wrapped in DDP."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


_M = TypeVar("_M", bound=nn.Module)


def seeded(factory: Callable[[], _M], seed: int) -> _M:
    """``factory()`` with the RNG seeded by ``seed``, without touching the caller's RNG state
    (every family's freshly initialised model)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def build_model(cfg: ModelConfig, seed: int) -> TinyTransformer:
    """Build a freshly initialised model from ``seed`` without touching the caller's RNG state."""
    return seeded(lambda: TinyTransformer(cfg), seed)


def param_layout(model: nn.Module) -> list[dict[str, Any]]:
    """Name, offset, shape and numel of every parameter in flattening order."""
    layout: list[dict[str, Any]] = []
    offset = 0
    for name, p in model.named_parameters():
        layout.append({"name": name, "offset": offset, "shape": list(p.shape), "numel": p.numel()})
        offset += p.numel()
    return layout
