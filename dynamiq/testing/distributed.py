"""Run a function on N gloo ranks in spawned processes on loopback (for tests and examples)."""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_gloo"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    pg_timeout: float,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        try:
            out = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(out, buf)  # plain bytes: tensors must outlive this process
            queue.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    exitcodes: list[int | None] | None = None,
) -> list[tuple[str, Any]]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` under gloo.

    ``fn`` must be importable (module level). Returns ``[(status, value)]`` per rank, where
    status is ``"ok"`` (value: the return value) or ``"error"`` (value: the traceback text);
    a rank that reported nothing within ``timeout`` seconds shows as ``("missing", None)``.
    ``exitcodes``, when given, receives each process's exit code (negative: killed by that
    signal; ``None``: still running, then killed).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, pg_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: list[tuple[str, Any]] = [("missing", None)] * world_size
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    waiting, gone_since = set(range(world_size)), None
    try:
        while waiting and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                # a rank whose process exited without reporting (killed) never will
                if all(not procs[r].is_alive() for r in waiting):
                    gone_since = gone_since or time.monotonic()
                    if time.monotonic() - gone_since > 2.0:
                        break
                continue
            if status == "ok":
                value = torch.load(io.BytesIO(value), weights_only=False)
            results[rank] = (status, value)
            waiting.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=10)
            code = p.exitcode
            if p.is_alive():
                p.kill()
                p.join()
            if exitcodes is not None:
                exitcodes.append(code)
    return results
