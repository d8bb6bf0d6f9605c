"""Multi-hop all-reduce: any codec × any schedule × torch.distributed or the simulator."""

from .api import AllReduceHandle, AllReduceStats, SimResult, allreduce, simulate_allreduce
from .engine import WIRE_VERSION, ConfigMismatchError, plan_schedule, run_schedule
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
    "SimResult",
    "Step",
    "TorchDistTransport",
    "allreduce",
    "butterfly",
    "get_schedule",
    "hierarchical",
    "list_schedules",
    "plan_schedule",
    "ring",
    "run_schedule",
    "simulate_allreduce",
    "tree",
]
