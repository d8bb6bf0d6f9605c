"""DDP communication hook (DESIGN.md, "DDP hook"; STYLE.md item 9).

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

from dynamiq.codecs import Codec, get_codec
from dynamiq.collectives.api import DEFAULT_THRESHOLD, allreduce
from dynamiq.collectives.options import CollectiveOptions, OptionKeywords, merge_options
from dynamiq.collectives.schedules import Schedule
from dynamiq.collectives.transport import TorchDistTransport

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DynamiqState", "dynamiq_hook"]


class DynamiqState:
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
        sub_chunk, timeout, schedule_options: as for
            :func:`~dynamiq.collectives.allreduce` (``timeout``: seconds to wait for a peer
            before raising ``PeerTimeoutError``; ``schedule_options``: e.g.
            ``ranks_per_node``).

    ``stats`` holds one dict per completed step: bytes sent and received, seconds per phase.
    ``close()`` stops the communication thread and closes the state's transport.
    """

    __slots__ = (
        "_lock",
        "_queue",
        "_thread",
        "error_feedback",
        "iter",
        "options",
        "process_group",
        "residuals",
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
        **keywords: "Unpack[OptionKeywords]",
    ):
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
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.stats: list[dict[str, Any]] = []
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
        """Error-feedback residuals and the step counter, for checkpoints."""
        with self._lock:
            return {
                "iter": self.iter,
                "codec": self.codec.get_config(),
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the codec must match the saved one)."""
        if get_codec(state["codec"]) != self.codec:
            raise ValueError(
                f"checkpoint was made with codec {state['codec']}, this state uses "
                f"{self.codec.get_config()}"
            )
        with self._lock:
            self.iter = int(state["iter"])
            self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}

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


def dynamiq_hook(
    state: DynamiqState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Compressed all-reduce of one gradient bucket, off the backward thread.

    1. Take the bucket's flat gradient (fp32, bf16 or fp16); with error feedback, add this
       rank's residual of the same bucket from the previous step (in fp32).
    2. Hand it to the communication thread and return a Future at once.
    3. On the thread: all-reduce with the codec and schedule (every rank ends bit-identical),
       dividing by the world size; with error feedback, the residual of every encoding this
       rank does is kept for the next step.
    4. Complete the Future with the averaged bucket (or the error, which DDP re-raises).
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
    if state.error_feedback:
        old = state.residuals.get(index)
        if old is not None and old.numel() == numel:  # buckets are rebuilt after step 0
            wanted = grad.float() + old
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
                with state._lock:
                    state.residuals[index] = residual
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
            fut.set_exception(exc)  # type: ignore[arg-type]

    state.submit(job)
    return fut
