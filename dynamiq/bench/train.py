"""``dynamiq bench train``: time-to-accuracy of gradient all-reduce methods (issue 6, item 3).

A byte-level transformer (:mod:`dynamiq.data.model`) learns CPython's documentation
(``pydoc_data.topics``; the last ``val_fraction`` of the text is held out for validation, the
rest is cut into one disjoint shard per worker) with ``W`` data-parallel workers, once per
all-reduce *method*:

* ``fp32`` — plain DDP (gloo's fp32 all-reduce of the averaged gradients);
* ``bf16`` — PyTorch's ``bf16_compress_hook``;
* ``powersgd`` — PyTorch's ``powerSGD_hook`` (error feedback and warm start on);
* any codec id (``mxfp8_e4m3``, ``mxfp4``, ``thc``, ``omnireduce``, ``dynamiq``, ...) — the
  dynamiq DDP hook (:func:`dynamiq.ddp.dynamiq_hook`, ring schedule, error feedback on unless
  ``error_feedback=False``).

What is measured (docs/design.md, "Measures"):

1. **Convergence**, in one process with each method's exact numerics: one model replica (all
   workers hold identical weights after every step), each worker's gradient from its own
   batches, then DDP's buckets (the same layout DDP builds: one bucket at step 0, rebuilt
   from the order gradients became ready) reduced by the method: ``fp32`` as the correctly
   rounded sum of ``g_w / W``; ``bf16`` as the hook does it (cast, divide, sum in bf16, cast
   back; summed in rank order, gloo's ring may add in another order for ``W > 2``); codecs
   through :func:`dynamiq.ddp.dynamiq_hook` itself, on ``W`` in-process ranks. PowerSGD's
   numerics are not emulated: it trains with real DDP over gloo on loopback. The validation
   loss is recorded every ``eval_every`` steps.
2. **Step time** of real DDP (gloo, the real hooks) on the emulated cluster
   (:class:`dynamiq.bench.netns.EmulatedCluster`: one network namespace per rank, links shaped
   with ``tc``), the mean over ``timing_steps`` steps after ``timing_warmup``; beside it the
   compute-only time (forward, backward and optimiser step without communication), the
   hook's codec time (encode, reduce, decode) and the bytes on the wire per step, read from
   each rank's interface.
3. **Time to accuracy** per seed: the target is the ``bf16`` run's validation loss at step
   ``steps`` (the same seed's run); steps to target = the first evaluated step whose validation
   loss is at or below it (every method trains ``steps * (1 + extra)`` steps, with the same
   constant learning rate after warm-up, so a slightly slower method can still reach it);
   TTA = steps to target x mean step time. The final loss compared is each method's
   validation loss at step ``steps``.
4. **Validation** of that model: ``bf16`` and ``dynamiq`` trained for real on the cluster
   until the first seed's target is reached; the measured training time against the
   prediction.

Where the code is: :mod:`dynamiq.bench.train_setup` (configuration, methods, data, learning
rate), :mod:`dynamiq.bench.train_emulated` (1, in process), :mod:`dynamiq.bench.train_ranks`
(2 and 4, the real DDP ranks and their launchers), :mod:`dynamiq.bench.train_report` (table,
verdict and plots); this module runs the benchmark and holds the command line. The model,
text, windows, loss and optimiser are those of :mod:`dynamiq.bench.ddp_train`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dynamiq.bench.args import print_json
from dynamiq.bench.train_emulated import RunResult, train_inprocess
from dynamiq.bench.train_ranks import Progress, run_cluster, run_loopback, train_ddp
from dynamiq.bench.train_report import plot_curves, plot_tta, summary_lines, table_rows
from dynamiq.bench.train_setup import (
    BASELINES,
    DEFAULT_METHODS,
    QUICK,
    SCHEDULES,
    BenchTrainError,
    TTAConfig,
    evaluate,
    method_label,
    parse_methods,
    train_batch,
    val_batch,
)

__all__ = [
    "BASELINES",
    "DEFAULT_METHODS",
    "BenchTrainError",
    "TTAConfig",
    "add_parser",
    "evaluate",
    "run_benchmark",
    "train_batch",
    "train_ddp",
    "train_inprocess",
    "val_batch",
]

#: where step time is measured (``--network``)
NETWORKS = ("cluster", "loopback", "none")


# -- the benchmark --------------------------------------------------------------------------


def _steps_to(curve: Sequence[Sequence[float]], target: float) -> int | None:
    """The first evaluated step (after step 0) whose validation loss is <= ``target``."""
    for step, v in curve:
        if step > 0 and v <= target:
            return int(step)
    return None


def _curve(points: Sequence[Sequence[float]]) -> list[tuple[int, float]]:
    """A validation curve read back from JSON: ``[(step, loss)]``."""
    return [(int(a), float(b)) for a, b in points]


def _at(curve: Sequence[Sequence[float]], step: int) -> float:
    for s, v in curve:
        if s == step:
            return float(v)
    raise KeyError(step)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, {platform.platform()}"


def run_benchmark(
    cfg: TTAConfig,
    methods: Sequence[str] = DEFAULT_METHODS,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    network: str = "cluster",
    validate: bool = True,
    progress: bool = True,
    timeout: float = 7200.0,
    convergence_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Convergence, step time, TTA and validation, as described in the module docstring.

    ``network``: ``"cluster"`` (the emulated cluster: needs root and network namespaces),
    ``"loopback"`` (real DDP over gloo on 127.0.0.1: no shaping, so step times are compute
    and codec only) or ``"none"`` (convergence only). ``convergence_from``: the result of an
    earlier run with the same model, data and optimiser settings, methods and seeds, whose
    validation curves are reused (to measure step times on another network without
    training again). Returns a JSON-safe dict.
    """
    cfg.validate()
    names = parse_methods(methods)
    seed_list = list(seeds)
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds must be distinct and at least one (got {seed_list})")
    if network not in NETWORKS:
        raise ValueError(f"network must be 'cluster', 'loopback' or 'none' (got {network!r})")
    cluster: Any = None
    if network == "cluster":
        from dynamiq.bench.netns import EmulatedCluster, NamespaceUnavailable, check_available

        try:
            check_available()
        except NamespaceUnavailable as exc:
            raise BenchTrainError(
                f"the emulated cluster is not available here: {exc}. Use --network loopback "
                "(step times without a shaped network) or --network none (convergence only)"
            ) from None
        cluster = EmulatedCluster(cfg.workers, rate=cfg.rate, delay_ms=cfg.delay_ms)
    show = Progress(progress)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": _machine(),
        "config": cfg.to_dict(),
        "methods": names,
        "seeds": seed_list,
        "network": network,
        "max_steps": cfg.max_steps,
    }
    seconds: dict[str, float] = {}

    # 1. convergence
    t0 = time.perf_counter()
    if convergence_from is None:
        runs = _convergence(cfg, names, seed_list, show, timeout)
    else:
        runs = _saved_convergence(convergence_from, cfg, names, seed_list)
        result["convergence_reused_from"] = convergence_from.get("date")
    seconds["convergence"] = time.perf_counter() - t0
    targets = {s: _at(runs["bf16"][s].curve, cfg.steps) for s in seed_list}
    result["target"], conv = _convergence_summary(cfg, names, seed_list, runs, targets)
    result["convergence"] = conv

    # 2. step time and 4. validation, in one multi-rank job on the network
    timing: dict[str, Any] = {}
    validation: dict[str, Any] | None = None
    if network != "none":
        t0 = time.perf_counter()
        val_methods = ["bf16", "dynamiq"] if (validate and "dynamiq" in names) else []
        per_rank = _network_runs(
            cfg, names, seed_list[0], targets[seed_list[0]], val_methods, cluster, show, timeout
        )
        if cluster is not None:
            result["shaping"] = per_rank.pop()
        timing = _timing_summary(names, per_rank)
        if val_methods:
            validation = _validation_summary(
                names, val_methods, per_rank, conv, timing, seed_list[0], targets
            )
        seconds["network"] = time.perf_counter() - t0
    result["step_time"] = timing
    result["validation"] = validation

    # 3. TTA
    rate = None
    if network == "cluster":
        from dynamiq.bench.netns import parse_rate

        rate = parse_rate(cfg.rate)
    rows = _tta_rows(names, seed_list, conv, timing, rate)
    result["tta"] = rows
    result["verdict"] = _verdict(rows, conv, result["target"]["tolerance"], validation)
    seconds["total"] = time.perf_counter() - t_start
    result["seconds"] = seconds
    return result


def _convergence(
    cfg: TTAConfig, methods: list[str], seeds: list[int], show: Progress, timeout: float
) -> dict[str, dict[int, RunResult]]:
    """Every method's validation curves: in process, PowerSGD over loopback gloo."""
    runs: dict[str, dict[int, RunResult]] = {m: {} for m in methods}
    for m in methods:
        if m == "powersgd":
            continue
        for s in seeds:
            label = f"convergence {m} seed {s}"

            def tick(step: int, val: float | None, label: str = label) -> None:
                show(f"{label}: step {step}/{cfg.max_steps} val {val:.4f}")

            run = train_inprocess(m, cfg, s, progress=tick)
            runs[m][s] = run
            final = _at(run.curve, cfg.steps)
            show.line(f"{label}: val loss at step {cfg.steps} {final:.4f} ({run.seconds:.0f} s)")
    if "powersgd" in methods:
        jobs = [
            {"method": "powersgd", "seed": s, "steps": cfg.max_steps, "eval_every": cfg.eval_every}
            for s in seeds
        ]
        t0 = time.perf_counter()
        label = "convergence powersgd (gloo, loopback)"
        per_rank = run_loopback(
            {"cfg": cfg.to_dict(), "runs": jobs}, cfg.workers, show, label, timeout
        )
        for s, r in zip(seeds, per_rank[0], strict=True):
            runs["powersgd"][s] = RunResult(
                method="powersgd",
                seed=s,
                curve=_curve(r["curve"]),
                train_losses=r["losses"],
                seconds=(time.perf_counter() - t0) / len(seeds),
            )
            final = _at(runs["powersgd"][s].curve, cfg.steps)
            show.line(f"convergence powersgd seed {s}: val loss at step {cfg.steps} {final:.4f}")
    return runs


#: settings that do not change the training trajectories (only where and how time is taken)
_TIMING_FIELDS = ("rate", "delay_ms", "timing_warmup", "timing_steps", "compute_steps")


def _saved_convergence(
    saved: dict[str, Any], cfg: TTAConfig, methods: list[str], seeds: list[int]
) -> dict[str, dict[int, RunResult]]:
    """The validation curves of an earlier result, checked to belong to this configuration."""
    try:
        old = {k: v for k, v in saved["config"].items() if k not in _TIMING_FIELDS}
        conv = saved["convergence"]
    except (KeyError, TypeError, AttributeError):
        raise ValueError("the saved result has no 'config' and 'convergence'") from None
    new = {k: v for k, v in cfg.to_dict().items() if k not in _TIMING_FIELDS}
    diff = sorted(k for k in new if old.get(k) != new[k])
    if diff:
        k = diff[0]
        raise ValueError(
            f"the saved result was trained with {k}={old.get(k)!r}, this run asks for "
            f"{k}={new[k]!r}: its convergence cannot be reused"
        )
    runs: dict[str, dict[int, RunResult]] = {}
    for m in methods:
        if m not in conv:
            raise ValueError(f"the saved result has no convergence runs of {m!r}")
        runs[m] = {}
        for s in seeds:
            per = conv[m]["seeds"].get(str(s))
            if per is None:
                raise ValueError(f"the saved result has no seed {s} of {m!r}")
            runs[m][s] = RunResult(
                method=m,
                seed=s,
                curve=_curve(per["curve"]),
                train_losses=[],
                seconds=float(per["seconds"]),
                bytes_per_step=per["payload_bytes_per_step"],
            )
    return runs


def _convergence_summary(
    cfg: TTAConfig,
    methods: list[str],
    seeds: list[int],
    runs: dict[str, dict[int, RunResult]],
    targets: dict[int, float],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the target and tolerance, per method: curves, finals, steps to target)."""
    finals_bf16 = [targets[s] for s in seeds]
    bf16_mean = statistics.fmean(finals_bf16)
    bf16_std = statistics.stdev(finals_bf16) if len(seeds) > 1 else 0.0
    tolerance = max(0.001 * bf16_mean, 2 * bf16_std)
    conv: dict[str, Any] = {}
    for m in methods:
        per: dict[str, Any] = {}
        for s in seeds:
            run = runs[m][s]
            per[str(s)] = {
                "curve": [[int(a), float(b)] for a, b in run.curve],
                "final": _at(run.curve, cfg.steps),
                "last": run.curve[-1][1],
                "steps_to_target": _steps_to(run.curve, targets[s]),
                "seconds": run.seconds,
                "payload_bytes_per_step": run.bytes_per_step,
            }
        finals = [per[str(s)]["final"] for s in seeds]
        mean = statistics.fmean(finals)
        conv[m] = {
            "seeds": per,
            "final_mean": mean,
            "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_vs_bf16": mean - bf16_mean,
            "within_tolerance": abs(mean - bf16_mean) <= tolerance,
        }
    target = {
        "rule": "per seed: the bf16 run's validation loss at step `steps` (same seed)",
        "per_seed": {str(s): targets[s] for s in seeds},
        "bf16_final_mean": bf16_mean,
        "bf16_final_std": bf16_std,
        "tolerance": tolerance,
        "tolerance_rule": "max(0.1% of bf16's mean final loss, 2 sigma of bf16's finals)",
    }
    return target, conv


def _network_runs(
    cfg: TTAConfig,
    methods: list[str],
    seed: int,
    target: float,
    val_methods: list[str],
    cluster: Any,
    show: Progress,
    timeout: float,
) -> list[Any]:
    """One multi-rank job: a timing run per method, then the validation runs to ``target``.

    Returns per rank the list of run results (and, on the cluster, its shaping last)."""
    jobs: list[dict[str, Any]] = []
    for m in methods:
        warm = cfg.timing_warmup + (cfg.powersgd_start if m == "powersgd" else 0)
        jobs.append(
            {
                "method": m,
                "seed": seed,
                "steps": warm + cfg.timing_steps,
                "timing_warmup": warm,
                "compute_steps": cfg.compute_steps,
            }
        )
    for m in val_methods:
        jobs.append(
            {
                "method": m,
                "seed": seed,
                "steps": cfg.max_steps,
                "eval_every": cfg.eval_every,
                "target": target,
            }
        )
    spec = {"cfg": cfg.to_dict(), "runs": jobs}
    if cluster is None:
        out: list[Any] = run_loopback(spec, cfg.workers, show, "loopback", timeout)
    else:
        with cluster as cl:
            out = list(run_cluster(cl, spec, cfg.workers, show, "cluster", timeout))
            out.append(dict(cl.shaping))
    show.line("step time and validation runs: done")
    return out


def _timing_summary(methods: list[str], per_rank: list[Any]) -> dict[str, Any]:
    """Per method: mean step time (rank 0 and every rank), compute time, hook phases,
    payload and wire bytes per step."""
    timing: dict[str, Any] = {}
    for i, m in enumerate(methods):
        r0 = per_rank[0][i]
        wires = [pr[i]["wire_bytes_per_step"] for pr in per_rank]
        timing[m] = {
            "step_seconds": r0["timed_mean"],
            "step_seconds_ranks": [pr[i]["timed_mean"] for pr in per_rank],
            "step_seconds_all": r0["step_times"],
            "compute_seconds": r0["compute_mean"],
            "hook_phases": r0["phases"],
            "payload_bytes_per_step": r0["payload_bytes_per_step"],
            "wire_tx_bytes_per_step": (
                statistics.fmean(w["tx"] for w in wires) if all(wires) else None
            ),
        }
    return timing


def _validation_summary(
    methods: list[str],
    val_methods: list[str],
    per_rank: list[Any],
    conv: dict[str, Any],
    timing: dict[str, Any],
    seed: int,
    targets: dict[int, float],
) -> dict[str, Any]:
    """Measured training time to the target against steps-to-target x step time."""
    validation: dict[str, Any] = {}
    for j, m in enumerate(val_methods):
        r0 = per_rank[0][len(methods) + j]
        predicted_steps = conv[m]["seeds"][str(seed)]["steps_to_target"]
        step_t = timing[m]["step_seconds"]
        reached = r0["reached"]
        measured = sum(r0["step_times"]) if reached else None
        predicted = predicted_steps * step_t if predicted_steps else None
        validation[m] = {
            "seed": seed,
            "target": targets[seed],
            "steps_measured": reached,
            "steps_predicted": predicted_steps,
            "tta_measured": measured,
            "tta_predicted": predicted,
            "error": (measured / predicted - 1) if (measured and predicted) else None,
            "curve": r0["curve"],
            "mean_step_seconds": statistics.fmean(r0["step_times"]),
        }
    return validation


def _tta_rows(
    methods: list[str],
    seeds: list[int],
    conv: dict[str, Any],
    timing: dict[str, Any],
    rate_bps: int | None = None,
) -> list[dict[str, Any]]:
    """One row per method: finals, steps to target, step time, TTA per seed and mean.

    With ``rate_bps`` (the cluster's link rate) also the *wire-bound* step, a projection
    rather than a measurement: compute time + the bytes this rank put on its link / the
    rate, i.e. the step if encoding, reducing and decoding cost nothing and transfers were
    perfectly pipelined; and the TTA that step would give."""
    rows = []
    for m in methods:
        c = conv[m]
        steps = [c["seeds"][str(s)]["steps_to_target"] for s in seeds]
        t = timing.get(m, {})
        step_t = t.get("step_seconds")
        ttas = [n * step_t if (n is not None and step_t) else None for n in steps]
        got = [x for x in ttas if x is not None]
        payload = (
            t.get("payload_bytes_per_step")
            if m == "powersgd"
            else statistics.fmean(c["seeds"][str(s)]["payload_bytes_per_step"] for s in seeds)
        )
        rows.append(
            {
                "method": m,
                "label": method_label(m),
                "final_mean": c["final_mean"],
                "final_std": c["final_std"],
                "final_vs_bf16": c["final_vs_bf16"],
                "steps_to_target": steps,
                "step_seconds": step_t,
                "compute_seconds": t.get("compute_seconds"),
                "wire_tx_bytes_per_step": t.get("wire_tx_bytes_per_step"),
                "payload_bytes_per_step": payload,
                "tta_seconds": ttas,
                "tta_mean": statistics.fmean(got) if (got and len(got) == len(seeds)) else None,
            }
        )
        wire, comp = t.get("wire_tx_bytes_per_step"), t.get("compute_seconds")
        ideal = comp + wire * 8 / rate_bps if (rate_bps and wire and comp) else None
        rows[-1]["wire_bound_step_seconds"] = ideal
        all_reached = all(n is not None for n in steps)
        rows[-1]["wire_bound_tta_mean"] = (
            statistics.fmean(n * ideal for n in steps if n is not None)
            if (ideal and all_reached)
            else None
        )
    bf = next(r for r in rows if r["method"] == "bf16")
    for r in rows:
        ok = bf["tta_mean"] and r["tta_mean"]
        r["tta_speedup_vs_bf16"] = bf["tta_mean"] / r["tta_mean"] if ok else None
    return rows


def _vs_best(
    base: list[dict[str, Any]], mine: dict[str, Any], key: str
) -> tuple[str, float] | None:
    """(the baseline row with the lowest ``key``, its ``key`` / ``mine``'s), where known."""
    known = [r for r in base if r[key] is not None]
    if not known or mine[key] is None:
        return None
    best = min(known, key=lambda r: r[key])
    return best["method"], best[key] / mine[key]


def _verdict(
    rows: list[dict[str, Any]],
    conv: dict[str, Any],
    tolerance: float,
    validation: dict[str, Any] | None,
) -> dict[str, Any]:
    """The issue's numbers: dynamiq's TTA against the best baseline, its final loss
    against bf16's, and the validation error."""
    out: dict[str, Any] = {}
    by = {r["method"]: r for r in rows}
    if "dynamiq" in by:
        base = [by[m] for m in BASELINES if m in by]
        if (vs := _vs_best(base, by["dynamiq"], "tta_mean")) is not None:
            out["best_baseline"], out["tta_speedup_vs_best_baseline"] = vs
            out["tta_target_met"] = vs[1] >= 1.3
        if (vs := _vs_best(base, by["dynamiq"], "wire_bound_tta_mean")) is not None:
            out["wire_bound_best_baseline"], out["wire_bound_tta_speedup_vs_best_baseline"] = vs
        out["final_loss_gap"] = conv["dynamiq"]["final_vs_bf16"]
        out["final_loss_tolerance"] = tolerance
        out["final_loss_met"] = bool(conv["dynamiq"]["within_tolerance"])
    if validation:
        errs = {m: v["error"] for m, v in validation.items()}
        out["validation_errors"] = errs
        out["validation_met"] = all(e is not None and abs(e) <= 0.15 for e in errs.values())
    return out


# -- command line ---------------------------------------------------------------------------


class _Opt(NamedTuple):
    """A command-line option that sets one :class:`TTAConfig` field (its type and default
    are the field's)."""

    flag: str
    field: str
    help: str
    choices: tuple[str, ...] | None = None


#: the options that set one field, in groups, each group in ``--help`` order
_SIZE_OPTIONS = (
    _Opt("--workers", "workers", "data-parallel workers W"),
    _Opt("--steps", "steps", "bf16's training budget: its validation loss here is the target"),
    _Opt(
        "--extra",
        "extra",
        "every run trains steps x (1 + extra), so slower methods can reach the target",
    ),
    _Opt("--eval-every", "eval_every", "steps between evals"),
    _Opt("--val-windows", "val_windows", "validation windows"),
    _Opt("--d-model", "d_model", "model width"),
    _Opt("--layers", "n_layers", "transformer blocks"),
    _Opt("--heads", "n_heads", "attention heads"),
    _Opt("--seq-len", "seq_len", "bytes per window"),
    _Opt("--batch", "batch", "windows per worker per step"),
    _Opt("--lr", "lr", "AdamW learning rate (constant)"),
    _Opt("--warmup", "warmup", "linear warm-up steps"),
    _Opt("--bucket-cap-mb", "bucket_cap_mb", "DDP bucket size cap (MiB)"),
)
_HOOK_OPTIONS = (
    _Opt(
        "--schedule",
        "schedule",
        "hop schedule of the dynamiq hook (fp32 and bf16 use gloo's own all-reduce)",
        SCHEDULES,
    ),
    _Opt("--powersgd-rank", "powersgd_rank", "PowerSGD matrix rank"),
    _Opt(
        "--powersgd-start",
        "powersgd_start",
        "PowerSGD compresses from this step (plain all-reduce before)",
    ),
)
_TIMING_OPTIONS = (
    _Opt("--rate", "rate", "link rate of the emulated cluster (tc)"),
    _Opt("--delay-ms", "delay_ms", "link delay (ms)"),
    _Opt("--timing-warmup", "timing_warmup", "untimed steps per method"),
    _Opt("--timing-steps", "timing_steps", "timed steps per method"),
)


def _add_options(p: argparse.ArgumentParser, options: Sequence[_Opt]) -> None:
    d = TTAConfig()
    for o in options:
        default = getattr(d, o.field)
        p.add_argument(o.flag, type=type(default), default=default, choices=o.choices, help=o.help)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


#: the one-line help of ``dynamiq bench train``
HELP = "time-to-accuracy: training convergence x step time on the emulated cluster"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``train`` to the ``dynamiq bench`` sub-commands."""
    p: argparse.ArgumentParser = sub.add_parser(
        "train",
        help=HELP,
        description=(
            "Time to accuracy of gradient all-reduce methods. A byte-level transformer learns "
            "CPython's documentation with W data-parallel workers for each method: fp32 "
            "(plain DDP), bf16 (PyTorch's bf16_compress_hook), powersgd (PyTorch's "
            "powerSGD_hook) or a codec id (the dynamiq DDP hook). Convergence comes from "
            "in-process training with each method's exact numerics (PowerSGD: real DDP over "
            "gloo on loopback); step time from real DDP on the emulated cluster (one network "
            "namespace per rank, links shaped with tc; needs root). TTA = steps to the bf16 "
            "run's final validation loss x step time. Finally bf16 and dynamiq train for "
            "real on the cluster to that loss, to check the prediction. Progress goes to "
            "stderr; the table (or --json) to stdout; PNGs and results.json to --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated: fp32, bf16, powersgd or codec ids (must include bf16)",
    )
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    _add_options(p, _SIZE_OPTIONS)
    p.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="run the dynamiq hook without error feedback",
    )
    _add_options(p, _HOOK_OPTIONS)
    p.add_argument(
        "--network",
        choices=NETWORKS,
        default="cluster",
        help="where step time is measured: the emulated cluster (root), gloo on loopback "
        "(no shaping), or nowhere (convergence only, no TTA)",
    )
    _add_options(p, _TIMING_OPTIONS)
    p.add_argument(
        "--no-validate",
        action="store_true",
        help="skip the real end-to-end runs of bf16 and dynamiq to the target",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 2 workers, 30 steps, 2 seeds (tests; overrides the sizes above)",
    )
    p.add_argument(
        "--out",
        default="dynamiq-bench-train",
        help="directory for results.json, loss_curves.png and tta.png ('' for none)",
    )
    p.add_argument(
        "--convergence-from",
        default="",
        metavar="JSON",
        help="reuse the validation curves of an earlier results.json (same model, data, "
        "optimiser, methods and seeds) and only measure step times, e.g. at another --rate",
    )
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per multi-rank job")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_cmd, check=check_args)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[TTAConfig, int]:
    """The configuration and number of seeds the command line asks for."""
    options = (*_SIZE_OPTIONS, *_HOOK_OPTIONS, *_TIMING_OPTIONS)
    kw: dict[str, Any] = {o.field: getattr(args, _dest(o.flag)) for o in options}
    kw["error_feedback"] = not args.no_error_feedback
    seeds = args.seeds
    if args.quick:
        kw.update(QUICK)
        seeds = min(seeds, 2)
    cfg = TTAConfig(**kw)
    cfg.validate()
    if isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds must be >= 1 (got {seeds})")
    return cfg, seeds


def _write_outputs(result: dict[str, Any], out: Path) -> None:
    """results.json and the PNGs in ``out``; their paths go to ``result["files"]``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot_curves(result, out / "loss_curves.png")
    files = ["results.json", "loss_curves.png"]
    if result["step_time"]:
        plot_tta(result, out / "tta.png")
        files.append("tta.png")
    result["files"] = [str(out / f) for f in files]


def check_args(args: argparse.Namespace) -> None:
    """Every argument of ``dynamiq bench train``, before any model is built: raises
    ``ValueError`` naming the problem; sets ``args.tta`` (config, seeds, methods, the saved
    result of ``--convergence-from`` or ``None``)."""
    cfg, nseeds = config_from_args(args)
    methods = parse_methods(args.methods)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds (got {args.timeout})")
    saved = None
    if args.convergence_from:
        try:
            saved = json.loads(Path(args.convergence_from).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read --convergence-from: {exc}") from None
    args.tta = (cfg, nseeds, methods, saved)


def _cmd(args: argparse.Namespace) -> int:
    from dynamiq.bench.cli import format_table

    cfg, nseeds, methods, saved = args.tta
    try:
        result = run_benchmark(
            cfg,
            methods,
            range(nseeds),
            network=args.network,
            validate=not args.no_validate,
            progress=not args.quiet,
            timeout=args.timeout,
            convergence_from=saved,
        )
    except (ValueError, BenchTrainError) as exc:
        print(f"dynamiq bench train: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        _write_outputs(result, Path(args.out))
    if args.json:
        print_json(result, indent=1)
    else:
        rows = table_rows(result)
        print(format_table(rows, list(rows[0])))
        print()
        for line in summary_lines(result):
            print(line)
        if args.out:
            print(f"written: {', '.join(result['files'])}")
    return 0
