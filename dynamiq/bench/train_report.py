"""``dynamiq bench train``'s report: the terminal table, the verdict as sentences and the two
PNGs (validation loss curves; TTA and where a step's time goes), all read from the result
:func:`dynamiq.bench.train.run_benchmark` returns.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamiq.bench.train_setup import BASELINES, TORCH_METHODS, method_label

__all__ = ["plot_curves", "plot_tta", "summary_lines", "table_rows"]


def _fmt_steps(steps: Sequence[int | None]) -> str:
    return "/".join("-" if s is None else str(s) for s in steps)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted by ``spec`` (with ``suffix``), or ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The terminal table: one row per method."""
    out = []
    for r in result["tta"]:
        wire = r["wire_tx_bytes_per_step"]
        out.append(
            {
                "method": r["label"],
                "final val loss": f"{r['final_mean']:.4f} ± {r['final_std']:.4f}",
                "vs bf16": f"{r['final_vs_bf16']:+.4f}",
                "steps to target": _fmt_steps(r["steps_to_target"]),
                "step (s)": _fmt(r["step_seconds"], ".3f"),
                "compute (s)": _fmt(r["compute_seconds"], ".3f"),
                "wire MB/step": _fmt(None if wire is None else wire / 1e6, ".3f"),
                "wire-bound step (s)": _fmt(r["wire_bound_step_seconds"], ".3f"),
                "TTA (s)": _fmt(r["tta_mean"], ".1f"),
                "TTA vs bf16": _fmt(r["tta_speedup_vs_bf16"], ".2f", "x"),
            }
        )
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The verdict as sentences."""
    t = result["target"]
    v = result["verdict"]
    lines = [
        f"target: per seed, bf16's validation loss at step {result['config']['steps']} "
        f"(mean {t['bf16_final_mean']:.4f}, sigma {t['bf16_final_std']:.4f}); every run "
        f"trains {result['max_steps']} steps; '-' = not reached",
    ]
    if "tta_speedup_vs_best_baseline" in v:
        lines.append(
            f"dynamiq TTA vs best of {', '.join(BASELINES)} ({v['best_baseline']}): "
            f"{v['tta_speedup_vs_best_baseline']:.2f}x (goal >= 1.3x: "
            f"{'met' if v['tta_target_met'] else 'NOT met'})"
        )
    elif "final_loss_gap" in v:
        lines.append("dynamiq TTA: not available (no step times, or a target not reached)")
    if "wire_bound_tta_speedup_vs_best_baseline" in v:
        lines.append(
            "projection, not a measurement: with steps at compute + wire bytes / link rate "
            "(codec work free, transfers perfectly pipelined), dynamiq's TTA vs the best "
            f"baseline ({v['wire_bound_best_baseline']}) would be "
            f"{v['wire_bound_tta_speedup_vs_best_baseline']:.2f}x"
        )
    if "final_loss_gap" in v:
        lines.append(
            f"dynamiq final loss vs bf16: {v['final_loss_gap']:+.4f} (tolerance "
            f"{v['final_loss_tolerance']:.4f}: {'met' if v['final_loss_met'] else 'NOT met'})"
        )
    if result.get("validation"):
        parts = []
        for m, val in result["validation"].items():
            if val["error"] is None:
                parts.append(f"{m}: target not reached in the real run")
            else:
                parts.append(
                    f"{m}: measured {val['tta_measured']:.1f} s vs predicted "
                    f"{val['tta_predicted']:.1f} s ({val['error']:+.1%}; steps "
                    f"{val['steps_measured']} vs {val['steps_predicted']})"
                )
        ok = "met" if v.get("validation_met") else "NOT met"
        lines.append(
            f"validation on the {result['network']} (within 15%: {ok}): " + "; ".join(parts)
        )
    return lines


def _style(method: str, i: int) -> dict[str, Any]:
    """Line style of a method: its own colour; dynamiq thick, PyTorch's hooks dashed."""
    style: dict[str, Any] = {"color": f"C{i % 10}", "lw": 1.3, "label": method_label(method)}
    if method == "dynamiq":
        style["lw"] = 2.4
    elif method in TORCH_METHODS:
        style["ls"] = "--"
    return style


def plot_curves(result: dict[str, Any], path: Path) -> None:
    """Left: validation loss against step, mean over seeds. Right: each run's validation
    loss minus the same seed's bf16 run's, mean over seeds with the min-max band."""
    from dynamiq.bench.plots import require_matplotlib

    plt = require_matplotlib()
    fig, (ax, ad) = plt.subplots(1, 2, figsize=(12, 4.6))
    conv = result["convergence"]
    seeds = [str(s) for s in result["seeds"]]

    def curve(m: str, s: str) -> dict[int, float]:
        return {int(a): float(b) for a, b in conv[m]["seeds"][s]["curve"] if int(a) > 0}

    base = {s: curve("bf16", s) for s in seeds}
    lo, hi = math.inf, -math.inf
    diff_points: list[tuple[int, float]] = []
    for i, m in enumerate(result["methods"]):
        curves = {s: curve(m, s) for s in seeds}
        steps = sorted(set.intersection(*(set(c) for c in curves.values())))
        mean = [statistics.fmean(curves[s][t] for s in seeds) for t in steps]
        ax.plot(steps, mean, **_style(m, i))
        finite = [x for x in mean if math.isfinite(x)]
        if finite:
            lo = min(lo, min(finite))
            hi = max(hi, finite[len(finite) // 3])
        both = [t for t in steps if all(t in base[s] for s in seeds)]
        diffs = [[curves[s][t] - base[s][t] for s in seeds] for t in both]
        diff_points += [(t, y) for t, d in zip(both, diffs, strict=True) for y in d]
        style = _style(m, i)
        ad.plot(both, [statistics.fmean(d) for d in diffs], **style)
        if m != "bf16" and len(seeds) > 1:
            ad.fill_between(
                both,
                [min(d) for d in diffs],
                [max(d) for d in diffs],
                color=style["color"],
                alpha=0.12,
            )
    tgt = result["target"]["bf16_final_mean"]
    ax.axhline(tgt, color="k", ls=":", lw=0.8, label="target (bf16 at the budget, mean)")
    for a in (ax, ad):
        a.axvline(result["config"]["steps"], color="k", ls=":", lw=0.8)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    if math.isfinite(lo) and hi > lo:
        ax.set_ylim(lo - 0.05 * (hi - lo), hi)
    tol = result["target"]["tolerance"]
    ad.axhspan(-tol, tol, color="k", alpha=0.07, label=f"final-loss tolerance (±{tol:.3g})")
    ax.set_ylabel("validation loss (nats/byte)")
    ad.set_ylabel("validation loss - same seed's bf16")
    c = result["config"]
    ax.set_title(
        f"{c['workers']} workers, d_model {c['d_model']}, {c['n_layers']} layers, "
        f"lr {c['lr']:g}: mean of {len(seeds)} seeds",
        fontsize=10,
    )
    ad.set_title("against bf16_compress_hook (band: min-max over seeds)", fontsize=10)
    ax.legend(fontsize=7)
    ad.legend(fontsize=7, loc="upper right")
    late = [y for x, y in diff_points if x >= result["config"]["steps"] // 3 and math.isfinite(y)]
    if late:
        span = max(abs(min(late)), abs(max(late)), 2 * tol)
        ad.set_ylim(-1.2 * span, 1.2 * span)
    ad.set_xlim(left=result["config"]["steps"] // 5)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_tta(result: dict[str, Any], path: Path) -> None:
    """TTA per method (mean over seeds, min-max whiskers) and where a step's time goes."""
    from dynamiq.bench.plots import require_matplotlib

    plt = require_matplotlib()
    rows = [r for r in result["tta"] if r["step_seconds"] is not None]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8))
    labels = [r["label"] for r in rows]
    y = list(range(len(rows)))
    for i, r in enumerate(rows):
        got = [t for t in r["tta_seconds"] if t is not None]
        if r["tta_mean"] is not None:
            a1.barh(i, r["tta_mean"], color="C0" if r["method"] != "dynamiq" else "C3")
            a1.errorbar(
                r["tta_mean"],
                i,
                xerr=[[r["tta_mean"] - min(got)], [max(got) - r["tta_mean"]]],
                color="k",
                capsize=3,
                lw=0.8,
            )
            a1.text(max(got), i, f"  {r['tta_mean']:.3g} s", va="center", fontsize=8)
        else:
            a1.text(0, i, " target not reached by every seed", va="center", fontsize=8)
    a1.set_yticks(y, labels, fontsize=8)
    a1.invert_yaxis()
    a1.set_xlabel("time to bf16's final validation loss (s)")
    a1.set_title(f"TTA on the {result['network']}", fontsize=10)
    comp = [r["compute_seconds"] or 0.0 for r in rows]
    codec = []
    for r in rows:
        ph = result["step_time"][r["method"]]["hook_phases"]
        codec.append(sum(ph.get(k, 0.0) for k in ("encode", "reduce", "decode")))
    rest = [max(r["step_seconds"] - c - k, 0.0) for r, c, k in zip(rows, comp, codec, strict=True)]
    a2.barh(y, comp, color="C2", label="compute (fwd, bwd, optimiser)")
    a2.barh(y, codec, left=comp, color="C1", label="codec CPU (encode, reduce, decode)")
    left = [c + k for c, k in zip(comp, codec, strict=True)]
    a2.barh(y, rest, left=left, color="C7", label="rest: transfer, waiting")
    a2.set_yticks(y, [""] * len(y))
    a2.invert_yaxis()
    a2.set_xlabel("seconds per step (rank 0)")
    a2.set_title("where a step's time goes", fontsize=10)
    a2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
