"""Multi-hop all-reduce: any codec × any schedule × torch.distributed or the simulator."""

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
from .engine import WIRE_VERSION, ConfigMismatchError, plan_schedule, run_schedule
from .planning import chunk_sizes
from .schedules import (
    Schedule,
    ScheduleError,
    Step,
    butterfly,
    get_schedule,
    hierarchical,
    list_schedules,
    ring,
    tree,
)
from .transport import LocalCluster, LocalTransport, PeerTimeoutError, TorchDistTransport

__all__ = [
    "WIRE_VERSION",
    "AllReduceHandle",
    "AllReduceStats",
    "ConfigMismatchError",
    "LocalCluster",
    "LocalTransport",
    "PeerTimeoutError",
    "Schedule",
    "ScheduleError",
    "Shard",
    "SimResult",
    "Step",
    "TorchDistTransport",
    "all_gather",
    "allreduce",
    "butterfly",
    "chunk_sizes",
    "get_schedule",
    "hierarchical",
    "list_schedules",
    "plan_schedule",
    "reduce_scatter",
    "ring",
    "run_schedule",
    "simulate_allreduce",
    "tree",
]
