"""DDP communication hook (docs/design.md, "DDP hook"; "House style", item 9).

One line in a training script::

    from dynamiq.ddp import DynamiqState, dynamiq_hook
    model.register_comm_hook(DynamiqState(codec="mxfp8_e4m3", schedule="ring"), dynamiq_hook)

The hook follows PyTorch's contract (``default_hooks.allreduce_hook``): it returns a Future
holding a tensor of the bucket's shape, averaged over the ranks. gloo's point-to-point calls
give no futures, so the hook hands the bucket to the state's communication thread and returns
at once; backward keeps running while buckets are reduced, and DDP waits on the futures at the
end of backward.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as
objects.)
"""

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dynamiq.amp import StagedResiduals
from dynamiq.codecs import Codec, get_codec
from dynamiq.collectives.api import DEFAULT_THRESHOLD, allreduce
from dynamiq.collectives.options import CollectiveOptions, OptionKeywords, merge_options
from dynamiq.collectives.schedules import Schedule
from dynamiq.collectives.transport import TorchDistTransport

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DynamiqState", "dynamiq_hook"]


class DynamiqState(StagedResiduals):
    """State of :func:`dynamiq_hook`: the collective's configuration and per-bucket memory.

    Args:
        codec: codec id, config or Codec for the gradient buckets (default
            ``"mxfp8_e4m3"``, or ``options.codec``).
        schedule: ``"ring"``, ``"butterfly"``, ``"tree"``, ``"hierarchical"`` or a Schedule.
        process_group: ranks to reduce over; by default a new group over all ranks is made
            (collectively, so construct the state on every rank in the same order), which keeps
            the hook's point-to-point traffic apart from DDP's own.
        options: a :class:`~dynamiq.collectives.options.CollectiveOptions`; the keywords
            below replace its fields. ``op`` is always ``"avg"`` (DDP's contract) and
            ``step`` the state's own counter.
        error_feedback: keep, per rank and per position, what every encoding of this rank lost
            (its own gradient and the partial sums it re-encodes) and add it to the next step's
            gradient, so no lost mass is forgotten.
        seed: seed of stochastic rounding (the step counter and bucket offset are mixed in).
        threshold: buckets with fewer elements go uncompressed (fp32); default
            :data:`~dynamiq.collectives.options.DEFAULT_THRESHOLD`.
        sub_chunk, timeout, schedule_options, verify: as for
            :func:`~dynamiq.collectives.allreduce` (``timeout``: seconds to wait for a peer
            before raising ``PeerTimeoutError``; ``schedule_options``: e.g.
            ``ranks_per_node``).
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss (mixed precision), so that
            error feedback can keep its residuals unscaled (see below).

    ``stats`` holds one dict per completed step: bytes sent and received, seconds per phase.
    A failed all-reduce fails ``backward()`` with a ``RuntimeError`` whose text starts with
    the error's name and message (DDP's reducer keeps only the text); ``last_error`` holds
    the error itself (``PeerTimeoutError``, ``IntegrityError``, ...), to re-raise or inspect.
    ``close()`` stops the communication thread and closes the state's transport.

    **Non-finite steps and loss scaling** (error feedback; ``dynamiq/amp.py``, docs/guide.md,
    "AMP").
    A step in which the all-reduced result of any bucket holds NaN or ±Inf (a non-finite
    gradient on any rank: every built-in codec and schedule then gives a non-finite result on
    every rank, ``tests/test_ddp_nonfinite.py``, so all ranks agree without a message) leaves
    every residual as it was before the step: the residuals of a step are kept only when its
    last bucket is done and all were finite. So a step that GradScaler skips changes no
    residual, and the next finite step starts from finite residuals; a residual with a
    non-finite entry is never stored either (that bucket keeps its old one). Residuals are
    kept **unscaled**: with ``grad_scaler``, the residual of a step is divided by the loss
    scale that step used and multiplied by the current scale when it is added back (GradScaler's
    scales are powers of two: exact), so a scale change (halved after an overflow, doubled
    after a run of good steps) never mixes units; :meth:`state_dict` holds unscaled residuals.
    """

    __slots__ = (  # and StagedResiduals' (residuals, grad_scaler, ...)
        "_queue",
        "_thread",
        "error_feedback",
        "iter",
        "last_error",
        "options",
        "process_group",
        "stats",
        "transport",
    )

    def __init__(
        self,
        codec: Any = None,
        schedule: str | Schedule | None = None,
        process_group: Any = None,
        *,
        options: CollectiveOptions | None = None,
        error_feedback: bool = False,
        grad_scaler: Any = None,
        **keywords: "Unpack[OptionKeywords]",
    ):
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DynamiqState needs an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group() first (e.g. under torchrun)"
            )
        opts = merge_options("DynamiqState", options, codec=codec, schedule=schedule, **keywords)
        self.options = opts.replace(
            codec=get_codec(opts.codec if opts.codec is not None else "mxfp8_e4m3"),
            threshold=opts.threshold if opts.threshold is not None else DEFAULT_THRESHOLD,
            op="avg",
        )
        if process_group is None:
            process_group = dist.new_group(backend=dist.get_backend())
        self.process_group = process_group
        self.transport = TorchDistTransport(process_group)
        self.error_feedback = bool(error_feedback)
        self.grad_scaler = grad_scaler
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self._pending: dict[int, torch.Tensor] = {}  # this step's residuals, not yet kept
        self._step_nonfinite = False
        self.stats: list[dict[str, Any]] = []
        self.last_error: BaseException | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dynamiq-comm")
        self._thread.start()

    @property
    def codec(self) -> Codec:
        """The codec of the buckets."""
        codec = self.options.codec
        assert isinstance(codec, Codec)  # resolved in __init__
        return codec

    # -- the communication thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the communication thread (FIFO: buckets keep their order)."""
        self._queue.put(job)

    def close(self) -> None:
        """Stop the communication thread (after the jobs already submitted) and close the
        state's transport (it made it; the process group stays)."""
        self._queue.put(None)
        self._thread.join()
        self.transport.close()

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals (unscaled, fp32, one per bucket index), the step counter,
        and what :meth:`load_state_dict` checks them against: the codec, world size, rank
        and bucket layout (``{index: numel}``)."""
        with self._lock:
            return {
                "iter": self.iter,
                "codec": self.codec.get_config(),
                "world_size": self.transport.world_size,
                "rank": self.transport.rank,
                "buckets": {k: v.numel() for k, v in self.residuals.items()},
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ``ValueError`` naming the mismatch unless the
        checkpoint was made with the same codec, world size and rank, its residuals are
        1-D fp32 and finite and match its bucket layout, and (if this state has residuals
        already) the layout is this state's. (Checkpoints without ``world_size``, ``rank``
        or ``buckets`` entries skip those checks.)"""
        _check_checkpoint(self, state)
        with self._lock:
            self.iter = int(state["iter"])
            self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
            self._pending = {}
            self._step_nonfinite = False

    def _record(self, info: dict[str, Any]) -> None:
        with self._lock:
            if not self.stats or self.stats[-1]["step"] != info["step"]:
                self.stats.append(
                    {
                        "step": info["step"],
                        "bytes_sent": 0,
                        "bytes_received": 0,
                        "seconds": {},
                        "buckets": 0,
                    }
                )
            rec = self.stats[-1]
            rec["bytes_sent"] += info["bytes_sent"]
            rec["bytes_received"] += info["bytes_received"]
            rec["buckets"] += 1
            for k, v in info["seconds"].items():
                rec["seconds"][k] = rec["seconds"].get(k, 0.0) + v


def _check_checkpoint(owner: DynamiqState, state: dict[str, Any]) -> None:
    """The checks of :meth:`DynamiqState.load_state_dict` (``ValueError`` naming the first
    mismatch)."""
    if not isinstance(state, dict) or not {"iter", "codec", "residuals"} <= state.keys():
        raise ValueError("not a DynamiqState checkpoint: needs 'iter', 'codec' and 'residuals'")
    if get_codec(state["codec"]) != owner.codec:
        raise ValueError(
            f"checkpoint was made with codec {state['codec']}, this state uses "
            f"{owner.codec.get_config()}"
        )
    here = {"world_size": owner.transport.world_size, "rank": owner.transport.rank}
    for key, value in here.items():
        if key in state and state[key] != value:
            raise ValueError(f"checkpoint was made with {key} {state[key]}, this state has {value}")
    if isinstance(state["iter"], bool) or not isinstance(state["iter"], int) or state["iter"] < 0:
        raise ValueError(f"checkpoint iter must be an int >= 0 (got {state['iter']!r})")
    residuals = state["residuals"]
    _check_residuals(residuals)
    layout = _check_layout(state.get("buckets"), residuals)
    with owner._lock:
        mine = {k: v.numel() for k, v in owner.residuals.items()}
    if mine and mine != {int(k): n for k, n in layout.items()}:
        raise ValueError(
            f"checkpoint bucket layout {_layout_text(layout)} differs from this state's "
            f"{_layout_text(mine)} (other model, bucket_cap_mb or DDP options?)"
        )


def _check_residuals(residuals: dict[Any, Any]) -> None:
    """Each residual of a checkpoint is a finite 1-D float32 tensor."""
    for k, v in residuals.items():
        where = f"checkpoint residual of bucket {k}"
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32 or v.dim() != 1:
            got = f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{where} must be a 1-D float32 tensor (got {got})")
        bad = int((~torch.isfinite(v)).sum())
        if bad:
            raise ValueError(f"{where} has {bad} non-finite values (NaN or Inf)")


def _check_layout(layout: dict[Any, int] | None, residuals: dict[Any, Any]) -> dict[Any, int]:
    """The checkpoint's bucket layout (an older checkpoint's residuals are its layout),
    checked against its residuals."""
    if layout is None:
        layout = {k: v.numel() for k, v in residuals.items()}
    if set(layout) != set(residuals):
        raise ValueError(
            f"checkpoint bucket layout lists buckets {sorted(layout)}, its residuals "
            f"{sorted(residuals)}"
        )
    for k, v in residuals.items():
        if v.numel() != layout[k]:
            raise ValueError(
                f"checkpoint residual of bucket {k} has {v.numel()} values, its bucket layout "
                f"says {layout[k]}"
            )
    return layout


def _layout_text(layout: dict[Any, Any]) -> str:
    items = sorted((int(k), n) for k, n in layout.items())
    text = ", ".join(f"{k}: {n}" for k, n in items[:6])
    return "{" + text + (", ..." if len(items) > 6 else "") + "}"


def dynamiq_hook(
    state: DynamiqState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Compressed all-reduce of one gradient bucket, off the backward thread.

    1. Take the bucket's flat gradient (fp32, bf16 or fp16); with error feedback, add this
       rank's residual of the same bucket from the previous step (in fp32, times the loss
       scale with a ``grad_scaler``).
    2. Hand it to the communication thread and return a Future at once.
    3. On the thread: all-reduce with the codec and schedule (every rank ends bit-identical),
       dividing by the world size; with error feedback, the residual of every encoding this
       rank does is kept for the next step (unscaled; not if the result is non-finite: see
       :class:`DynamiqState`).
    4. Complete the Future with the averaged bucket, or fail it with the error, which
       ``backward()`` then raises as itself (``PeerTimeoutError``, ``IntegrityError``, ...).
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    grad = bucket.buffer()
    index = bucket.index()
    is_last = bucket.is_last()
    step = state.iter
    if is_last:
        state.iter += 1
    # 1. local gradient (+ residual); DDP reuses the buffer, so the thread works on a copy
    numel = grad.numel()
    residual = None
    scale = None
    if state.error_feedback:
        scale = state._loss_scale(grad.device)
        old = state.residuals.get(index)
        if old is not None and old.numel() == numel:  # buckets are rebuilt after step 0
            wanted = grad.float() + state._scaled(old, scale)  # kept unscaled
            work = wanted.to(grad.dtype)
            # a bf16/fp16 bucket cannot hold all of it: what the cast drops is kept too
            residual = wanted - work.float()
        else:
            work = grad.clone()
            residual = torch.zeros(numel, dtype=torch.float32, device=grad.device)
    else:
        work = grad.clone()

    def job() -> None:
        # 3. all-reduce on the communication thread
        try:
            t0 = time.perf_counter()
            stats = allreduce(
                work,
                options=state.options,
                seed=state.options.seed ^ (index << 20),
                step=step,
                transport=state.transport,
                residual=residual,
            )
            if residual is not None:
                state._stage_residual(index, residual, work, scale)
                if is_last:
                    state._end_step(failed=False)
            info = {
                "step": step,
                "bytes_sent": stats.bytes_sent,
                "bytes_received": stats.bytes_received,
                "seconds": {**stats.seconds, "hook_total": time.perf_counter() - t0},
            }
            state._record(info)
            # 4. complete the future
            fut.set_result(work)
        except BaseException as exc:
            if state.error_feedback:
                with state._lock:
                    state._step_nonfinite = True  # keep no residual of a failed step
                if is_last:
                    state._end_step(failed=True)
            state.last_error = exc
            fut.set_exception(exc)  # type: ignore[arg-type]

    state.submit(job)
    # A Future completed by ``set_exception`` holds the exception as its *value*, which DDP's
    # reducer would try to read as a Tensor ("Unable to cast <PeerTimeoutError> to Tensor");
    # a callback that re-raises it fails the chained Future instead, and DDP raises that (as
    # a RuntimeError with the error's name and text: the type is lost in torch's C++).
    return fut.then(_value)


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.value()  # raises the error the job failed with
