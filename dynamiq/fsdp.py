"""FSDP2 (``torch.distributed.fsdp.fully_shard``): a compressed reduce-scatter of gradients.

One line in a training script, after ``fully_shard``::

    state = dynamiq.fsdp.compress(model, codec="dynamiq", schedule="ring")

FSDP2 reduce-scatters each FSDP module's flat gradient once per backward through the module's
``ReduceScatter`` comm (``torch.distributed.fsdp._fully_shard._fsdp_api``); :func:`compress`
gives *every* FSDP module under ``model`` a :class:`DynamiqReduceScatter` (FSDP uses the comm
only of the module it is set on: setting it on the root alone changes nothing). Each call runs
:func:`dynamiq.collectives.reduce_scatter` with caller-given chunk bounds, so rank ``r`` ends
with exactly the elements ``[r·S, (r+1)·S)`` FSDP expects.

Semantics of ``op``: ``SUM``, ``AVG`` (divide by the world size after the sum) and
``ReduceOp.PREMUL_SUM(f)`` (what FSDP passes when ``set_gradient_divide_factor`` differs from
the world size; the sum is multiplied by ``f`` after it, which equals the pre-multiplied sum
up to fp32 rounding). The input may be fp32 or bf16 (``MixedPrecisionPolicy.reduce_dtype``):
the engine sums in fp32 and the result is rounded once to the output's dtype.

Memory and limits:

* ``error_feedback=True`` keeps, per FSDP module, what every encoding of this rank lost. In a
  ring every rank re-encodes partial sums of every chunk, so this residual is the whole
  *unsharded* gradient in fp32 (4 bytes a parameter on every rank: more than the sharded
  parameters, gradients and Adam state together at 8 ranks). ``error_feedback="shard"`` keeps
  only the rank's own range (4·S bytes) between steps: the error of the final encoding of
  its shard, the one the result carries; the partial sums' errors are dropped. (During a
  call either mode has the engine fill a full-size fp32 residual, freed when it returns.)
* The call blocks the backward thread until the shard is done (FSDP passes no ``async_op``).
  On CUDA it is host-driven too (it does not enqueue on FSDP's reduce-scatter stream).
* HSDP: FSDP2's native HSDP (a 2-D mesh) all-reduces across replicas with its own
  ``dist.all_reduce``, which no hook replaces in torch 2.13 (``set_all_reduce_hook`` runs
  *after* it), so it is not compressed. Compressed HSDP: shard with ``fully_shard`` over the
  1-D shard mesh and pass ``process_group`` (the shard group) and ``replicate_group``; every
  FSDP module then also gets an all-reduce hook (``set_all_reduce_hook``) that averages its
  output shard across the replicas with :func:`dynamiq.collectives.allreduce` (no error
  feedback on that hop). Both groups are used as given: make them for dynamiq alone (e.g.
  ``dist.new_subgroups_by_enumeration``), apart from the mesh's own.
* A module FSDP gives several parameter groups (``shard_placement_fn`` with several meshes)
  cannot take a custom comm: :func:`compress` raises naming it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from dynamiq.amp import StagedResiduals
from dynamiq.codecs import Codec, get_codec
from dynamiq.collectives.api import (
    DEFAULT_THRESHOLD,
    AllReduceStats,
    Shard,
    _bounds_by_chunk,
    allreduce,
    reduce_scatter,
)
from dynamiq.collectives.engine import agree
from dynamiq.collectives.integrity import Status
from dynamiq.collectives.options import CollectiveOptions, OptionKeywords, merge_options
from dynamiq.collectives.schedules import Schedule, get_schedule
from dynamiq.collectives.transport import TorchDistTransport

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DynamiqReduceScatter", "FSDPState", "ReplicaAllReduce", "compress"]

_EF_MODES = (False, True, "shard")


def _op_of(op: Any) -> tuple[str, float]:
    """``("sum" | "avg", factor)`` of a ``ReduceOp`` (``PREMUL_SUM(f)``: ``("sum", f)``)."""
    kind = getattr(op, "op", op)  # a ReduceOp object wraps its RedOpType
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, float | int):
            raise ValueError(f"PREMUL_SUM with a tensor factor is not supported (got {factor!r})")
        return "sum", float(factor)
    if kind == dist.ReduceOp.SUM:
        return "sum", 1.0
    if kind == dist.ReduceOp.AVG:
        return "avg", 1.0
    raise ValueError(f"dynamiq.fsdp: op must be SUM, AVG or PREMUL_SUM (got {op!r})")


class FSDPState(StagedResiduals):
    """Configuration, persistent transport, error-feedback memory and statistics of the
    comms :func:`compress` installs (one state for all FSDP modules of a model).

    ``stats`` holds one dict per call (``module``, ``call``, ``numel``, ``op``, bytes sent and
    received, seconds per phase; ``collective: "replica_allreduce"`` for compressed HSDP's
    hook); ``calls`` counts the calls of each module (``"<name> (replicas)"``: its hook's);
    ``bounds`` (``return_bound=True``) the certified per-element bound of each module's last
    output shard (fp64, in the output's units, including its rounding to the output dtype).

    The configuration is a :class:`~dynamiq.collectives.CollectiveOptions` (``options=``,
    or its fields as keywords: ``seed``, ``threshold``, ``sub_chunk``, ``timeout``,
    ``return_bound``, ``schedule_options``, ``verify``), as for
    :class:`~dynamiq.ddp.DynamiqState`; the codec defaults to ``"dynamiq"``.
    ``error_feedback``: ``False``, ``True`` (a residual the size of the unsharded gradient)
    or ``"shard"`` (the rank's own shard);
    ``replicate_group``: compressed HSDP across replicas;
    ``grad_scaler``: the ``torch.amp.GradScaler`` scaling the loss, so that error feedback
    keeps its residuals unscaled.

    **Non-finite steps and loss scaling** (error feedback): the DDP hook's policy
    (``dynamiq/amp.py``). The residuals of a backward pass are staged and stored at its end
    only if every FSDP module's reduced shard was finite *on every rank* (a reduce-scatter
    leaves a NaN or ±Inf on the owner's shard only, so the ranks exchange one status message,
    ``ceil(log2 n)`` rounds of 64 bytes, at the end of each backward with error feedback on);
    else every residual stays as it was (GradScaler skips that step). Residuals are kept
    unscaled. A comm called outside backward ends its own step.
    """

    def __init__(
        self,
        codec: Any = None,
        schedule: str | Schedule | None = None,
        process_group: Any = None,
        *,
        options: CollectiveOptions | None = None,
        error_feedback: bool | str = False,
        replicate_group: Any = None,
        grad_scaler: Any = None,
        **keywords: Unpack[OptionKeywords],
    ):
        if error_feedback not in _EF_MODES:
            raise ValueError(
                f"error_feedback must be False, True or 'shard' (got {error_feedback!r})"
            )
        opts = merge_options("FSDPState", options, codec=codec, schedule=schedule, **keywords)
        self.options = opts.replace(
            codec=get_codec(opts.codec if opts.codec is not None else "dynamiq"),
            threshold=opts.threshold if opts.threshold is not None else DEFAULT_THRESHOLD,
            return_bound=bool(opts.return_bound),
        )
        if process_group is None:  # dynamiq's point-to-point traffic apart from FSDP's own
            process_group = dist.new_group(backend=dist.get_backend())
        self.process_group = process_group
        self.transport = TorchDistTransport(process_group)
        nccl = dist.get_backend(process_group) == "nccl"  # NCCL moves CUDA tensors only
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )
        self.replicate_group = replicate_group
        self.replicate_transport = (
            TorchDistTransport(replicate_group) if replicate_group is not None else None
        )
        # fail here, not in the first backward, on a schedule that cannot own FSDP's ranges
        n = self.transport.world_size
        _bounds_by_chunk(get_schedule(self.schedule, n, **self.schedule_options), [(0, 0)] * n)
        self.error_feedback = error_feedback
        self.residuals: dict[str, torch.Tensor] = {}
        self.grad_scaler = grad_scaler
        self._pending: dict[str, torch.Tensor] = {}  # this backward's residuals, not yet kept
        self._step_nonfinite = False
        self._step_task: int | None = None  # the backward whose residuals are staged
        self.calls: dict[str, int] = {}
        self.bounds: dict[str, torch.Tensor] = {}
        self.stats: list[dict[str, Any]] = []
        self.comms: dict[str, DynamiqReduceScatter] = {}
        self._lock = threading.Lock()

    # the options' fields, read by the comms
    @property
    def codec(self) -> Codec:
        """The codec of the gradients (a :class:`~dynamiq.codecs.Codec`)."""
        return get_codec(self.options.codec)  # type: ignore[arg-type]  # resolved in __init__

    @property
    def schedule(self) -> str | Schedule:
        return self.options.schedule

    @property
    def schedule_options(self) -> dict[str, Any]:
        return dict(self.options.schedule_options or {})

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def threshold(self) -> int:
        assert self.options.threshold is not None  # set in __init__
        return self.options.threshold

    @property
    def sub_chunk(self) -> int:
        return self.options.sub_chunk

    @property
    def timeout(self) -> float:
        return self.options.timeout

    @property
    def return_bound(self) -> bool:
        return bool(self.options.return_bound)

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on (checked by :func:`compress`)."""
        sched = self.schedule if isinstance(self.schedule, str) else self.schedule.digest()
        return {
            "dynamiq.fsdp": 1,
            "codec": self.codec.get_config(),
            "schedule": sched,
            "schedule_options": self.schedule_options,
            "error_feedback": self.error_feedback,
            "seed": self.seed,
            "threshold": self.threshold,
            "sub_chunk": self.sub_chunk,
            "return_bound": self.return_bound,
            "replicas": self.replicate_transport.world_size if self.replicate_transport else 1,
            "modules": sorted(self.comms),
        }

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Call counters (the codecs' step) and error-feedback residuals, for checkpoints."""
        with self._lock:
            return {
                "codec": self.codec.get_config(),
                "error_feedback": self.error_feedback,
                "calls": dict(self.calls),
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (codec and error-feedback mode must match)."""
        if get_codec(state["codec"]) != self.codec:
            raise ValueError(
                f"checkpoint was made with codec {state['codec']}, this state uses "
                f"{self.codec.get_config()}"
            )
        if state["error_feedback"] != self.error_feedback:
            raise ValueError(
                f"checkpoint has error_feedback={state['error_feedback']!r}, this state "
                f"{self.error_feedback!r}"
            )
        with self._lock:
            self.calls = {str(k): int(v) for k, v in state["calls"].items()}
            self.residuals = {str(k): v.clone() for k, v in state["residuals"].items()}
            self._pending, self._step_nonfinite, self._step_task = {}, False, None

    # -- the end of a step (error feedback) -----------------------------------------------

    def _begin_call(self) -> None:
        """Before a comm call with error feedback: inside backward, make sure the end of this
        backward ends the step (a staged step whose backward failed is dropped)."""
        task = torch._C._current_graph_task_id()  # -1 outside backward
        if self._step_task is not None and self._step_task != task:
            self._end_step(failed=True)  # its backward raised before its end
            self._step_task = None
        if task != -1 and self._step_task is None:
            self._step_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)

    def _finish_step(self) -> None:
        """End the step on every rank alike: merge the ranks' non-finite flags (one status
        exchange), then commit or drop the staged residuals (``dynamiq/amp.py``)."""
        self._step_task = None
        status = Status(self.transport.rank)
        if self._step_nonfinite:
            status.record("nonfinite")
        try:
            status.exchange(self.transport, self.timeout, self.device)
        except BaseException:
            self._end_step(failed=True)
            raise
        with self._lock:
            self._step_nonfinite = status.has("nonfinite")
        self._end_step(failed=False)


class DynamiqReduceScatter(ReduceScatter):
    """FSDP2's ``ReduceScatter`` comm backed by :func:`dynamiq.collectives.reduce_scatter`,
    for the FSDP module ``name`` (the ``index``-th one :func:`compress` found)."""

    def __init__(self, state: FSDPState, name: str, index: int):
        self.state = state
        self.name = name
        self.index = index

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check(self, output: torch.Tensor, inp: torch.Tensor, group: Any) -> int:
        st = self.state
        n = st.transport.world_size
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        mine = dist.get_process_group_ranks(st.process_group)
        if ranks is not None and list(ranks) != list(mine):
            raise ValueError(
                f"dynamiq.fsdp: FSDP module {self.name!r} reduce-scatters over ranks {ranks}, "
                f"the state's process_group has ranks {mine} (HSDP: shard over the 1-D shard "
                "mesh and pass its group as process_group, and replicate_group)"
            )
        s = output.numel()
        if inp.numel() != n * s:
            raise ValueError(
                f"dynamiq.fsdp: module {self.name!r}: input has {inp.numel()} elements, "
                f"output {s}, world size {n}"
            )
        return s

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (this rank's ``[r·S,
        (r+1)·S)``); runs to completion (``async_op`` is accepted and ignored)."""
        t0 = time.perf_counter()
        st = self.state
        s = self._check(output_tensor, input_tensor, group)
        how, factor = _op_of(op)
        r, n = st.transport.rank, st.transport.world_size
        x = input_tensor.reshape(-1)
        with st._lock:
            step = st.calls.get(self.name, 0)
            st.calls[self.name] = step + 1
            old = st.residuals.get(self.name)
        residual = scale = None
        if st.error_feedback:
            st._begin_call()
            scale = st._loss_scale(x.device)  # residuals are kept unscaled
            x = x.float()  # fp32 in any case (the engine works on a copy: the input stays)
            if st.error_feedback == "shard":
                if old is not None and old.numel() == s:
                    x = x.clone()
                    x[r * s : (r + 1) * s] += st._scaled(old, scale)
            elif old is not None and old.numel() == x.numel():
                x = x + st._scaled(old, scale)
            residual = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        codec = st.codec if x.numel() >= st.threshold else get_codec("fp32")
        try:
            shard = self._reduce(x, codec, step, s, n, residual)
        except BaseException:
            if residual is not None:
                with st._lock:
                    st._step_nonfinite = True  # keep no residual of a failed step
                if st._step_task is None:
                    st._end_step(failed=True)
            raise
        self._finish(output_tensor, shard, how, factor, n)
        if residual is not None:
            keep = (
                residual[r * s : (r + 1) * s].clone() if st.error_feedback == "shard" else residual
            )
            st._stage_residual(self.name, keep, output_tensor, scale)
            if st._step_task is None:  # called outside backward: its own step
                st._finish_step()
        stats = shard.stats
        assert stats is not None
        with st._lock:
            st.stats.append(
                {
                    "module": self.name,
                    "call": step,
                    "op": how if factor == 1.0 else f"premul_sum({factor!r})",
                    "numel": x.numel(),
                    "codec": stats.codec,
                    "bytes_sent": stats.bytes_sent,
                    "bytes_received": stats.bytes_received,
                    "seconds": {**stats.seconds, "comm_total": time.perf_counter() - t0},
                }
            )
        return None

    def _reduce(
        self,
        x: torch.Tensor,
        codec: Codec,
        step: int,
        s: int,
        n: int,
        residual: torch.Tensor | None,
    ) -> Shard:
        st = self.state
        shard = reduce_scatter(
            x,
            codec,
            st.schedule,
            seed=st.seed ^ (self.index << 20),
            step=step,
            op="sum",
            sub_chunk=st.sub_chunk,
            timeout=st.timeout,
            transport=st.transport,
            schedule_options=st.schedule_options,
            chunk_bounds=[(q * s, (q + 1) * s) for q in range(n)],
            residual=residual,
            return_bound=st.return_bound,
            verify=st.options.verify,
        )
        assert isinstance(shard, Shard)  # synchronous
        return shard

    def _finish(self, out: torch.Tensor, shard: Shard, how: str, factor: float, n: int) -> None:
        """Scale the fp32 sum (AVG: ``/n``; PREMUL_SUM: ``×f``), round it to the output
        dtype into ``out``, and extend the certified bound by each rounding."""
        v = shard.values
        bound = shard.stats.bound if shard.stats is not None else None
        scale = 1.0 / n if how == "avg" else factor
        if scale != 1.0:
            v = v / n if how == "avg" else v * factor
            if bound is not None:
                bound = bound * abs(scale) + v.double().abs() * 2.0**-24 + 2.0**-150
        cast = v.to(out.dtype)
        if bound is not None:
            bound = bound + (cast.double() - v.double()).abs()
            with self.state._lock:
                self.state.bounds[self.name] = bound
        out.view(-1).copy_(cast)


class ReplicaAllReduce:
    """The all-reduce hook of compressed HSDP: averages FSDP module ``name``'s output shard
    across the replicas (``FSDPState.replicate_group``), in place."""

    def __init__(self, state: FSDPState, name: str, index: int):
        self.state = state
        self.name = name
        self.index = index

    def __call__(self, reduce_output: torch.Tensor) -> None:
        st = self.state
        assert st.replicate_transport is not None
        t0 = time.perf_counter()
        key = f"{self.name} (replicas)"  # its own step counter, in state_dict's "calls"
        with st._lock:
            step = st.calls.get(key, 0)
            st.calls[key] = step + 1
        stats = allreduce(
            reduce_output,
            st.codec if reduce_output.numel() >= st.threshold else "fp32",
            st.schedule,
            seed=st.seed ^ (self.index << 20) ^ (1 << 40),
            step=step,
            op="avg",
            threshold=0,
            sub_chunk=st.sub_chunk,
            timeout=st.timeout,
            transport=st.replicate_transport,
            schedule_options=st.schedule_options,
            verify=st.options.verify,
        )
        assert isinstance(stats, AllReduceStats)
        with st._lock:
            st.stats.append(
                {
                    "module": self.name,
                    "call": step,
                    "collective": "replica_allreduce",
                    "numel": reduce_output.numel(),
                    "codec": stats.codec,
                    "bytes_sent": stats.bytes_sent,
                    "bytes_received": stats.bytes_received,
                    "seconds": {**stats.seconds, "comm_total": time.perf_counter() - t0},
                }
            )


def _is_native_hsdp(m: FSDPModule) -> bool:
    groups = getattr(m._get_fsdp_state(), "_fsdp_param_groups", [])
    return any(bool(getattr(g, "_is_hsdp", False)) for g in groups)


def _fsdp_modules(module: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def compress(
    module: torch.nn.Module,
    codec: Any = "dynamiq",
    schedule: str | Schedule = "ring",
    **options: Any,
) -> FSDPState:
    """Give every FSDP module under ``module`` (``module`` included) a compressed
    reduce-scatter; returns the :class:`FSDPState` (statistics, ``state_dict``).

    ``options``: the keyword arguments of :class:`FSDPState` (``process_group``,
    ``error_feedback``, ``grad_scaler``: AMP, ``seed``, ``threshold``, ``sub_chunk``,
    ``timeout``, ``return_bound``, ``schedule_options``, ``replicate_group``: compressed
    HSDP, see the module docstring).
    Collective: call it on every rank, after ``fully_shard``; ranks that disagree on the
    configuration raise :class:`ConfigMismatchError` here.
    """
    found = _fsdp_modules(module)
    if not found:
        raise ValueError(
            f"dynamiq.fsdp.compress: no FSDP module under {type(module).__name__} "
            "(call torch.distributed.fsdp.fully_shard on it and its blocks first)"
        )
    state = FSDPState(codec, schedule, **options)
    for index, (name, m) in enumerate(found):
        label = name or "<root>"
        comm = DynamiqReduceScatter(state, label, index)
        try:
            m.set_custom_reduce_scatter(comm)
        except ValueError as exc:
            raise ValueError(
                f"dynamiq.fsdp.compress: FSDP module {label!r} ({type(m).__name__}) cannot "
                f"take a custom reduce-scatter: {exc}"
            ) from exc
        state.comms[label] = comm
        if state.replicate_group is not None:
            if _is_native_hsdp(m):
                raise ValueError(
                    f"dynamiq.fsdp.compress: FSDP module {label!r} is native HSDP (a 2-D "
                    "mesh), which all-reduces across replicas itself: with replicate_group, "
                    "shard it over the 1-D shard mesh"
                )
            m.set_all_reduce_hook(ReplicaAllReduce(state, label, index))
    agree(state.transport, state.describe(), state.timeout, state.device)
    return state
