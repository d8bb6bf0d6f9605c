"""``dynamiq compare``: vNMSE and bits/value of codecs × schedules × world sizes on real
gradients of one or more model families (:mod:`dynamiq.data.families`), through the same
engine that runs over torch.distributed (in-process ranks).

vNMSE = ‖x̂ - x‖² / ‖x‖² with x the fp64 sum of the workers' gradients, reported as the median
(and max) over seeds; a seed permutes which worker's gradient each rank holds (so the ring
order changes) and seeds stochastic rounding. bits/value counts every byte a rank sends
(payloads and length headers) over the values those transfers carry (docs/design.md, "Measures").
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dynamiq.codecs import get_codec
from dynamiq.collectives import simulate_allreduce

__all__ = ["compare", "compare_families"]


def compare(
    grads: torch.Tensor,
    codecs: Sequence[Any],
    schedules: Sequence[str] = ("ring", "butterfly"),
    workers: Sequence[int] = (4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per (codec, schedule, workers): median/max vNMSE over ``seeds``, bits/value.

    ``grads`` is ``[W, N]`` fp32 with ``W >= max(workers)``.
    """
    if grads.dim() != 2 or grads.shape[0] < max(workers):
        raise ValueError(
            f"grads must be [W, N] with W >= {max(workers)} (got {tuple(grads.shape)})"
        )
    rows = []
    total = len(codecs) * len(schedules) * len(workers) * len(seeds)
    done = 0
    t0 = time.perf_counter()
    for spec in codecs:
        codec = get_codec(spec)
        name = spec if isinstance(spec, str) else codec.get_config()
        for schedule in schedules:
            for n in workers:
                errs, bpv = [], []
                for seed in seeds:
                    g = torch.Generator().manual_seed(1000 * seed + n)
                    pick = torch.randperm(grads.shape[0], generator=g)[:n]
                    xs = [grads[int(i)].contiguous() for i in pick]
                    res = simulate_allreduce(
                        xs, codec, schedule, seed=seed, return_bound=False, sub_chunk=1 << 20
                    )
                    errs.append(res.vnmse)
                    bpv.append(res.bits_per_value())
                    done += 1
                    if progress:
                        el = time.perf_counter() - t0
                        print(
                            f"\r[{done}/{total}] {name!s:<14} {schedule:<9} n={n:<3} "
                            f"{el:6.0f}s, eta {el / done * (total - done):5.0f}s",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                rows.append(
                    {
                        "codec": name,
                        "schedule": schedule,
                        "workers": n,
                        "bits/value": statistics.mean(bpv),
                        "vnmse median": statistics.median(errs),
                        "vnmse max": max(errs),
                    }
                )
    if progress:
        print(file=sys.stderr)
    return rows


# the grid of compare() (codecs x schedules x workers x seeds) plus which data to load
def compare_families(  # noqa: PLR0913
    families: Sequence[str],
    codecs: Sequence[Any],
    schedules: Sequence[str] = ("ring", "butterfly"),
    workers: Sequence[int] = (4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    split: str = "eval",
    numel: int = 0,
    progress: bool = True,
    load: Callable[..., torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """:func:`compare` on each family's gradients; every row starts with ``family`` and
    ``values`` (values per worker: the first ``numel``, or all when ``numel`` is 0).

    ``load(split, workers, family=..., progress=...)`` gives a family's ``[W, N]``
    gradients (default :func:`dynamiq.data.load_gradients`).

    Raises:
        ValueError: on an unknown family, or ``numel`` larger than a family's ``N``
            (checked for every family before any comparison runs).
    """
    from dynamiq.data.families import parse_families

    if load is None:
        from dynamiq.data import load_gradients

        load = load_gradients
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0 (got {numel!r})")
    names = parse_families(",".join(families))
    data = {}
    for name in names:
        grads = load(split, max(workers), family=name, progress=progress)
        if numel > grads.shape[1]:
            raise ValueError(
                f"numel={numel} is more than family {name}'s {grads.shape[1]} values per worker"
            )
        data[name] = grads[:, :numel] if numel else grads
    rows = []
    for name, grads in data.items():
        for row in compare(grads, codecs, schedules, workers, seeds, progress=progress):
            rows.append({"family": name, "values": int(grads.shape[1]), **row})
    return rows
