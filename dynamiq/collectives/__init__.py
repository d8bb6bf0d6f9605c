"""Multi-hop all-reduce: any codec × any schedule × torch.distributed or the simulator.

What a user needs is here; the parts stay importable from their modules:
:mod:`~dynamiq.collectives.engine` (``ScheduleRun``, ``run_schedule``),
:mod:`~dynamiq.collectives.planning` (``plan_schedule``, ``chunk_layout``),
:mod:`~dynamiq.collectives.balance` (bytes per round at scale, without the ranks' buffers),
:mod:`~dynamiq.collectives.schedules` (``Step``, ``ScheduleError``, ``ring``, ``butterfly``,
``tree``, ``hierarchical``), :mod:`~dynamiq.collectives.transport` (``Transport``,
``TorchDistTransport``, ``LocalCluster``, ``LocalTransport``),
:mod:`~dynamiq.collectives.handshake` (prologues, the configuration handshake,
``WIRE_VERSION``) and :mod:`~dynamiq.collectives.bounds` (composing certified bounds).
"""

from .api import (
    AllReduceHandle,
    AllReduceStats,
    Shard,
    SimResult,
    all_gather,
    allreduce,
    reduce_scatter,
    simulate_allreduce,
)
from .handshake import ConfigMismatchError
from .options import CollectiveOptions
from .planning import chunk_sizes
from .schedules import Schedule, get_schedule, list_schedules
from .transport import PeerTimeoutError

__all__ = [
    "AllReduceHandle",
    "AllReduceStats",
    "CollectiveOptions",
    "ConfigMismatchError",
    "PeerTimeoutError",
    "Schedule",
    "Shard",
    "SimResult",
    "all_gather",
    "allreduce",
    "chunk_sizes",
    "get_schedule",
    "list_schedules",
    "reduce_scatter",
    "simulate_allreduce",
]
