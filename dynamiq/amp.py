"""Error feedback through mixed precision: staged, unscaled residuals (one policy for the DDP
hook, ``dynamiq/ddp.py``, and the FSDP2 comm, ``dynamiq/fsdp.py``; docs/guide.md, "AMP").

The policy:

* A step's new residuals are **staged**, one per bucket (DDP) or FSDP module, and stored only
  when the step is over and the reduced result of every one of them was finite. A step with a
  NaN or ±Inf result anywhere (an overflow on any rank: GradScaler skips that step) leaves
  every residual as it was before it, so the next step adds finite residuals and is finite
  again. A residual holding a non-finite value is never stored (its key keeps its old one).
* Residuals are kept **unscaled**: with a ``grad_scaler`` (``torch.amp.GradScaler``) a
  residual is divided by the loss scale of the step that made it, and multiplied by the
  current scale when it is added back (the scales are powers of two: exact), so a scale
  change never mixes units and checkpoints hold unscaled residuals.

Who decides that a step is over and whether it was finite is the owner's: the DDP hook after
the last bucket (an all-reduced result is non-finite on every rank alike); the FSDP comm at
the end of backward, after one status exchange (a reduce-scatter leaves a non-finite value on
one rank's shard only).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["StagedResiduals"]


class StagedResiduals:
    """The staging of error-feedback residuals (a base of the states that keep them).

    The owner sets ``residuals``, ``_pending`` (dicts), ``_step_nonfinite`` (False),
    ``_lock`` (a ``threading.Lock``) and ``grad_scaler`` (a GradScaler or ``None``).
    """

    __slots__ = ("_lock", "_pending", "_step_nonfinite", "grad_scaler", "residuals")

    residuals: dict[Any, torch.Tensor]
    _pending: dict[Any, torch.Tensor]
    _step_nonfinite: bool
    _lock: threading.Lock
    grad_scaler: Any

    def _loss_scale(self, device: torch.device) -> torch.Tensor | None:
        """The loss scale of this backward pass (a 1-element fp32 tensor, copied: GradScaler
        updates its own in place), or ``None`` without an enabled ``grad_scaler``."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)  # the tensor itself: no host sync
        if scale is None:
            scale = torch.tensor([scaler.get_scale()])
        return scale.detach().to(device=device, dtype=torch.float32).reshape(1).clone()

    @staticmethod
    def _scaled(old: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """A stored (unscaled) residual in the units of this backward pass."""
        return old if scale is None else old * scale

    def _stage_residual(
        self, key: Any, residual: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        """Hold ``key``'s new residual (unscaled) until the step ends; a non-finite reduced
        ``out`` marks the step non-finite, a non-finite residual is dropped (``key`` keeps
        its old one)."""
        if scale is not None:
            residual = residual / scale
        finite_out = bool(torch.isfinite(out).all())
        finite_res = bool(torch.isfinite(residual).all())
        with self._lock:
            if not finite_out:
                self._step_nonfinite = True
            elif finite_res:
                self._pending[key] = residual

    def _end_step(self, failed: bool) -> None:
        """After the step's last reduction (``failed``: one of them raised): commit the staged
        residuals unless the step was non-finite, else keep them all as they were before."""
        with self._lock:
            if not (failed or self._step_nonfinite):
                self.residuals.update(self._pending)
            self._pending = {}
            self._step_nonfinite = False
