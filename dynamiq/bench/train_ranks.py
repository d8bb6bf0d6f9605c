"""``dynamiq bench train``'s real DDP runs: one gloo rank per process, over loopback or on the
emulated cluster (:class:`dynamiq.bench.netns.EmulatedCluster`), with the real hooks; and the
launchers that start the ranks and show their progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from dynamiq.bench.ddp_train import lm_loss, param_checksum, register_hook
from dynamiq.bench.train_emulated import dynamiq_options, flat_grad
from dynamiq.bench.train_setup import (
    TORCH_METHODS,
    BenchTrainError,
    TTAConfig,
    evaluate,
    make_optimizer,
    set_lr,
    text_splits,
    train_batch,
    val_batch,
)
from dynamiq.data.model import build_model

__all__ = ["Progress", "run_cluster", "run_loopback", "train_ddp", "worker_main"]


def _register_hook(ddp: Any, method: str, cfg: TTAConfig, seed: int) -> Any:
    """Register ``method``'s communication hook on ``ddp``; return its state (or None)."""
    if method == "fp32":
        return register_hook(ddp, None)
    if method == "bf16":
        return register_hook(ddp, "bf16")
    if method == "powersgd":
        options = {
            "matrix_approximation_rank": cfg.powersgd_rank,
            "start_powerSGD_iter": cfg.powersgd_start,
            "random_seed": seed,
        }
        return register_hook(ddp, "powersgd", options)
    return register_hook(ddp, "dynamiq", dynamiq_options(method, cfg, seed))


def _iface_of(address: str) -> str | None:
    """The name of this network namespace's interface holding IPv4 ``address``."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(res[20:24]) == address:
            return name
    return None


def _iface_bytes(name: str | None) -> tuple[int, int] | None:
    """(tx, rx) bytes of interface ``name`` in this process's network namespace."""
    if name is None:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            iface, rest = line.split(":", 1)
            if iface.strip() == name:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    return None


def _write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` as JSON, atomically (readers never see half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _status(path: str | None, **info: Any) -> None:
    if path:
        _write_json(path, info)


def train_ddp(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Real DDP training runs on an initialised gloo group, one per ``spec["runs"]`` entry.

    A run: ``method``, ``seed``, ``steps``; optional ``eval_every`` (rank 0 evaluates and
    says when to stop), ``target`` (stop at the first evaluation at or below it),
    ``timing_warmup`` (steps left out of the mean step time), ``compute_steps`` (extra
    forward/backward/optimiser steps without communication, timed, at the end),
    ``capture_grads``. Returns one dict per run (rank 0's holds the curve).
    """
    cfg = TTAConfig.from_dict(spec["cfg"])
    train, val_text = text_splits(cfg)
    val = val_batch(val_text, cfg)
    out = []
    for k, run in enumerate(spec["runs"]):
        status = functools.partial(
            _status, spec.get("status"), run=k, runs=len(spec["runs"]), method=run["method"]
        )
        out.append(_train_run(rank, cfg, run, (train, val), status, spec.get("iface")))
    return out


def _train_run(
    rank: int,
    cfg: TTAConfig,
    run: dict[str, Any],
    data: tuple[Any, Any],
    status: Callable[..., None],
    iface: str | None,
) -> dict[str, Any]:
    """One run of :func:`train_ddp` on this rank (``data``: the training text and the
    validation batch)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    train, val = data
    method, seed, steps = run["method"], int(run["seed"]), int(run["steps"])
    eval_every = int(run.get("eval_every", 0))
    warm = int(run.get("timing_warmup", 0))
    model = build_model(cfg.model_config(), seed)
    ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb)
    state = _register_hook(ddp, method, cfg, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg)
    curve = [(0, evaluate(model, val))] if (eval_every and rank == 0) else []
    times: list[float] = []
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    reached = None
    dist.barrier()
    net0 = None
    for step in range(steps):
        if step == warm:
            net0 = _iface_bytes(iface)
        t0 = time.perf_counter()
        set_lr(opt, cfg, step)
        batch = train_batch(train, cfg, seed, step, rank)
        loss = lm_loss(ddp, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step < int(run.get("capture_grads", 0)):
            grads.append(flat_grad(params))
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if eval_every and (step + 1) % eval_every == 0:
            if _evaluate_and_stop(rank, model, val, curve, run.get("target"), status, step, steps):
                reached = step + 1
                break
        elif rank == 0 and (step + 1) % 5 == 0:
            status(step=step + 1, steps=steps)
    net1 = _iface_bytes(iface)
    done = len(times)
    n_compute = int(run.get("compute_steps") or 0)
    compute = _compute_only(ddp, opt, train, cfg, seed, steps, rank, n_compute)
    phases, payload = _hook_summary(method, state, warm)
    wire = None
    if net0 is not None and net1 is not None and done > warm:
        wire = {
            "tx": (net1[0] - net0[0]) / (done - warm),
            "rx": (net1[1] - net0[1]) / (done - warm),
        }
    result = {
        "method": method,
        "seed": seed,
        "rank": rank,
        "curve": curve,
        "losses": losses,
        "step_times": times,
        "timed_mean": statistics.fmean(times[warm:]) if done > warm else None,
        "compute_mean": statistics.fmean(compute) if compute else None,
        "phases": phases,
        "payload_bytes_per_step": payload,
        "wire_bytes_per_step": wire,
        "reached": reached,
        "grads": grads,
        "checksum": param_checksum(params),
    }
    dist.barrier()
    return result


def _evaluate_and_stop(
    rank: int,
    model: torch.nn.Module,
    val: Any,
    curve: list[tuple[int, float]],
    target: float | None,
    status: Callable[..., None],
    step: int,
    steps: int,
) -> bool:
    """Rank 0 evaluates after ``step`` (appending to ``curve``) and tells every rank whether
    the target is reached."""
    import torch.distributed as dist

    stop = torch.zeros(1)
    if rank == 0:
        v = evaluate(model, val)
        curve.append((step + 1, v))
        if target is not None and v <= target:
            stop[0] = 1
        status(step=step + 1, steps=steps, val=v)
    dist.broadcast(stop, 0)
    return bool(stop[0])


def _compute_only(
    ddp: Any,
    opt: torch.optim.Optimizer,
    train: Any,
    cfg: TTAConfig,
    seed: int,
    steps: int,
    rank: int,
    count: int,
) -> list[float]:
    """Seconds of ``count`` forward/backward/optimiser steps without communication."""
    import torch.distributed as dist

    compute: list[float] = []
    if count:
        dist.barrier()
        for j in range(count):
            t0 = time.perf_counter()
            with ddp.no_sync():
                batch = train_batch(train, cfg, seed, steps + j, rank)
                opt.zero_grad(set_to_none=True)
                lm_loss(ddp, batch).backward()
            opt.step()
            compute.append(time.perf_counter() - t0)
    return compute


def _hook_summary(method: str, state: Any, warm: int) -> tuple[dict[str, float], float | None]:
    """Mean seconds per phase and payload bytes per step of the dynamiq hook's timed steps
    (closing its state); nothing for PyTorch's methods."""
    phases: dict[str, float] = {}
    payload = None
    if method not in TORCH_METHODS and state is not None:
        timed = [r for r in state.stats if r["step"] >= warm]
        for r in timed:
            for key, v in r["seconds"].items():
                phases[key] = phases.get(key, 0.0) + v / len(timed)
        if timed:
            payload = sum(r["bytes_sent"] for r in timed) / len(timed)
        state.close()
    return phases, payload


def _loopback_job(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``run_gloo`` entry point (module level, so spawned processes can import it)."""
    return train_ddp(rank, world, spec)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """One rank in a namespace of the emulated cluster: ``SPEC RANK OUT`` (JSON files)."""
    spec_path, rank_s, out_path = list(sys.argv[1:] if argv is None else argv)
    rank = int(rank_s)
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(spec["world"])
    log = open(f"{out_path}.log", "w")  # noqa: SIM115 - stays open for the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        spec["iface"] = _iface_of(spec["addresses"][rank])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{spec['addresses'][0]}:{spec['port']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=float(spec.get("pg_timeout", 300))),
        )
        try:
            res = train_ddp(rank, world, spec)
        finally:
            dist.destroy_process_group()
        payload: Any = {"status": "ok", "runs": _jsonable(res)}
    except BaseException as exc:
        payload = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        payload["traceback"] = traceback.format_exc()
    _write_json(out_path, payload)
    return 0 if payload["status"] == "ok" else 1


def _jsonable(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "grads"} for r in runs]


class Progress:
    """Progress on stderr: an updating line on a terminal (at most 4 updates a second),
    only the finished lines otherwise; nothing when off."""

    def __init__(self, on: bool):
        self.on = on and sys.stderr is not None
        self.tty = self.on and sys.stderr.isatty()
        self.width = 0
        self.last = 0.0

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.tty and now - self.last >= 0.25:
            self.last = now
            pad = max(self.width - len(text), 0)
            print("\r" + text + " " * pad, end="", file=sys.stderr, flush=True)
            self.width = len(text)

    def line(self, text: str) -> None:
        if self.on:
            if self.tty:
                print("\r" + " " * self.width + "\r", end="", file=sys.stderr)
            print(text, file=sys.stderr, flush=True)
            self.width = 0


def _poll_status(path: str, show: Progress, label: str) -> None:
    try:
        with open(path) as f:
            st = json.load(f)
    except (OSError, ValueError):
        return
    val = f" val {st['val']:.4f}" if "val" in st else ""
    show(
        f"{label}: run {st['run'] + 1}/{st['runs']} {st['method']} "
        f"step {st['step']}/{st['steps']}{val}"
    )


def run_loopback(
    spec: dict[str, Any], world: int, show: Progress, label: str, timeout: float
) -> list[list[dict[str, Any]]]:
    """All runs of ``spec`` on ``world`` gloo ranks over loopback (spawned processes)."""
    from dynamiq.testing.distributed import run_gloo

    with tempfile.TemporaryDirectory(prefix="dynamiq-train-") as tmp:
        spec = {**spec, "status": os.path.join(tmp, "status.json")}
        box: dict[str, Any] = {}

        def go() -> None:
            box["res"] = run_gloo(_loopback_job, world, spec, timeout=timeout, pg_timeout=300)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.5)
            _poll_status(spec["status"], show, label)
        results = box.get("res")
    if results is None:
        raise BenchTrainError(f"{label}: the gloo ranks did not start")
    bad = [(r, v) for r, (s, v) in enumerate(results) if s != "ok"]
    if bad:
        rank, err = bad[0]
        raise BenchTrainError(f"{label}: rank {rank} failed: {err or 'no result in time'}")
    return [v for _, v in results]


def run_cluster(
    cl: Any, spec: dict[str, Any], world: int, show: Progress, label: str, timeout: float
) -> list[list[dict[str, Any]]]:
    """All runs of ``spec`` on ``world`` ranks, one per namespace of the cluster ``cl``."""
    with tempfile.TemporaryDirectory(prefix="dynamiq-train-") as tmp:
        spec = {
            **spec,
            "world": world,
            "addresses": list(cl.addresses),
            "port": random.randint(20000, 60000),
            "status": os.path.join(tmp, "status.json"),
        }
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        cmd = (
            "import sys; from dynamiq.bench.train_ranks import worker_main; sys.exit(worker_main())"
        )
        env = {"OMP_NUM_THREADS": "1"}
        procs = [
            cl.popen(
                r,
                [sys.executable, "-c", cmd, spec_path, str(r), outs[r]],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise BenchTrainError(f"{label}: no result within {timeout:g} s")
                if any(p.poll() not in (None, 0) for p in procs):
                    failed_at = failed_at or now
                    if now - failed_at > 10:  # the others are stuck waiting for it
                        break
                time.sleep(0.5)
                _poll_status(spec["status"], show, label)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for r in range(world):
            try:
                with open(outs[r]) as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                log = ""
                with contextlib.suppress(OSError):
                    log = Path(f"{outs[r]}.log").read_text()[-2000:]
                results.append({"status": "error", "error": f"no result; log: {log}"})
    for r, res in enumerate(results):
        if res["status"] != "ok":
            raise BenchTrainError(f"{label}: rank {r} failed: {res['error']}")
    return [res["runs"] for res in results]
