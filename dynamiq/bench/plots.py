"""PNG plots of benchmark results (matplotlib, imported only when a plot is asked for).

``plot_compare`` draws ``dynamiq compare`` rows as vNMSE against bits/value: one panel per
(schedule, workers), one line per codec family (every configuration of a codec id is a point
on its line, e.g. DynamiQ swept over budgets, INT over bit widths).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["codec_family", "codec_label", "plot_compare", "require_matplotlib"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or an ImportError saying how to get it."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "PNG plots need matplotlib: pip install 'dynamiq-allreduce[bench]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _config(codec: Any) -> dict[str, Any]:
    """The codec's id and its knobs that differ from the registered defaults."""
    if isinstance(codec, str):
        return {"id": codec}
    if not isinstance(codec, dict):
        raise TypeError(f"codec must be an id or a config dict (got {type(codec).__name__})")
    from dynamiq.codecs import get_codec

    try:
        defaults = get_codec(codec["id"]).get_config()
    except Exception:  # an unknown plugin id: keep every knob
        defaults = {}
    return {k: v for k, v in codec.items() if k == "id" or k not in defaults or defaults[k] != v}


# codec ids drawn as one line per family, in this order, and their line labels
_FAMILIES: dict[str, tuple[str, ...]] = {
    "INT": ("int2", "int3", "int4", "int5", "int6", "int7", "int8", "int"),
}


def codec_family(codec: Any) -> str:
    """The line a row belongs to: the codec id, or a family name for INT/MX/pass-through."""
    cid = _config(codec)["id"]
    for family, ids in _FAMILIES.items():
        if cid in ids:
            return family
    if cid == "thc":
        return f"THC ({_config(codec).get('variant', 'requantize')})"
    if cid == "omnireduce":
        return "OmniReduce"
    if cid == "dynamiq":
        cfg = _config(codec)
        knobs = {k: v for k, v in cfg.items() if k not in ("id", "bits")}
        return "DynamiQ" + (f" {json.dumps(knobs, sort_keys=True)}" if knobs else "")
    return str(cid)


def codec_label(codec: Any) -> str:
    """A short name of one configuration (``dynamiq bits=3.98``, ``omnireduce density=0.25``)."""
    cfg = _config(codec)
    cid = cfg.pop("id")
    return cid + "".join(f" {k}={v}" for k, v in sorted(cfg.items()))


def _draw_panel(
    ax: Any,
    rows: Sequence[dict[str, Any]],
    schedule: str,
    workers: int,
    color: dict[str, Any],
    floor: float,
) -> None:
    """One (schedule, workers) panel: a line per codec family; lossless points at ``floor``."""
    lines: dict[str, list[tuple[float, float, str]]] = {}
    for r in rows:
        if r["schedule"] != schedule or int(r["workers"]) != workers:
            continue
        lines.setdefault(codec_family(r["codec"]), []).append(
            (float(r["bits/value"]), float(r["vnmse median"]), codec_label(r["codec"]))
        )
    for family, pts in lines.items():
        pts.sort()
        xs = [p[0] for p in pts]
        ys = [max(p[1], floor) for p in pts]
        if family.startswith("DynamiQ"):
            ax.plot(xs, ys, "-o", label=family, linewidth=2.2, markersize=4, c=color[family])
        elif len(pts) > 1:
            ax.plot(xs, ys, "--s", label=family, linewidth=1.0, markersize=4, c=color[family])
        else:
            ax.plot(xs, ys, "D", label=family, markersize=5, c=color[family])
        for x, y, p in zip(xs, ys, pts, strict=True):
            if p[1] < floor:
                ax.annotate(f"{p[2]}: {p[1]:.0e}", (x, y), fontsize=6, rotation=90)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{schedule}, {workers} workers", fontsize=10)
    ax.set_xlabel("bits/value (everything sent)")
    ax.grid(True, which="both", alpha=0.3)


def _legend(fig: Any, axes: Any) -> dict[str, Any]:
    """One legend for the figure, every panel's labels once; returns label -> handle."""
    handles, labels = axes.flat[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    for ax in axes.flat[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(
        list(seen.values()), list(seen), loc="lower center", ncol=min(len(seen), 4), fontsize=8
    )
    return seen


def plot_compare(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    panels: Sequence[tuple[str, int]] | None = None,
    title: str = "",
) -> Path:
    """Write a PNG of vNMSE (log) against bits/value (one panel per (schedule, workers)).

    ``rows`` are ``dynamiq compare`` rows (``codec``, ``schedule``, ``workers``,
    ``bits/value``, ``vnmse median``). Points with vNMSE 0 (lossless) are drawn at the
    panel's floor and marked. Returns the path written.
    """
    if not rows:
        raise ValueError("no rows to plot")
    plt = require_matplotlib()
    if panels is None:
        panels = sorted({(str(r["schedule"]), int(r["workers"])) for r in rows})
    cols = min(len(panels), 2)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(4.2 * cols, 3.6 * nrows), squeeze=False, sharey=True
    )
    # lossless and near-lossless points (fp32, OmniReduce at density 1) would squash the
    # lossy codecs' range: they are drawn at the floor and labelled
    floor = 1e-7
    families = list(dict.fromkeys(codec_family(r["codec"]) for r in rows))
    cmap = plt.get_cmap("tab20")
    color = {f: cmap(i % 20) for i, f in enumerate(families)}
    color.update({f: "black" for f in families if f == "DynamiQ"})
    for ax, (schedule, workers) in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, rows, schedule, workers, color, floor)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("vNMSE (median of seeds)")
    seen = _legend(fig, axes)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * math.ceil(len(seen) / 4), 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
