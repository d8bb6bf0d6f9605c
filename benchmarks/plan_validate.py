"""``dynamiq plan`` against ``dynamiq bench cluster``: predicted, measured, error %.

    python benchmarks/plan_validate.py --bench r.json --kernels k.json --network n.json [...]

Each ``--bench`` file is a ``dynamiq bench cluster --json`` result; its rate's prediction uses
the ``--network`` calibration (``dynamiq plan calibrate --network``) and the ``--kernels``
table (``dynamiq plan calibrate --kernels``) given with it, in order (one of each per bench
file, or one for all), and with ``--host`` the CPU floor of ``dynamiq plan calibrate --host``
(the ``bound`` column: ``cpu`` where it decides). The parameters come from those
microbenchmarks only; the measurement is read after the prediction and feeds nothing back.
Prints a Markdown table (``--json``: the rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from dynamiq.plan.api import predict


def rows_for(
    bench: dict[str, Any], kernels: str, network: str, host: str | None = None
) -> list[dict[str, Any]]:
    cfg = bench["meta"]["config"]
    out = []
    for run in bench["runs"]:
        rate = run["rate"]
        # codec ids only: a configured codec (a dict) has no row in the kernel table
        measured = [
            r for r in run["rows"] if r["method"] == "dynamiq" and isinstance(r["codec"], str)
        ]
        codecs = list(dict.fromkeys(r["codec"] for r in measured))
        schedules = list(dict.fromkeys(r["schedule"] for r in measured))
        pred = predict(
            cfg["ranks"],
            codecs,
            schedules,
            size_mib=cfg["numel"] * 4 / 2**20,
            sub_chunk=cfg["sub_chunk"],
            profile="emulated",
            rate=rate,
            kernel_table=kernels,
            network_table=network,
            host_table=host,
        )
        by = {(p["codec"], p["schedule"]): p for p in pred["results"]}
        for r in measured:
            p = by[(r["codec"], r["schedule"])]
            out.append(
                {
                    "ranks": cfg["ranks"],
                    "rate": rate,
                    "codec": r["codec"],
                    "schedule": r["schedule"],
                    "predicted s": p["seconds"],
                    "bound": p.get("bound", "schedule"),
                    "measured s": r["seconds"],
                    "error %": 100 * (p["seconds"] - r["seconds"]) / r["seconds"],
                    "predicted bits/value": p["bits_per_value"],
                    # (files of before the identifier keys: "bits/value")
                    "measured bits/value": r.get("bits_per_value", r.get("bits/value")),
                    "load": run.get("load_average_1min"),
                }
            )
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = (
        "ranks",
        "rate",
        "codec",
        "schedule",
        "predicted s",
        "bound",
        "measured s",
        "error %",
        "predicted bits/value",
        "measured bits/value",
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(
                f"{v:+.1f}" if c == "error %" else f"{v:.4g}" if isinstance(v, float) else str(v)
            )
        lines.append("| " + " | ".join(cells) + " |")
    errs = [abs(r["error %"]) for r in rows]
    if errs:
        within = sum(e <= 15 for e in errs)
        lines.append("")
        lines.append(
            f"{within} of {len(errs)} cells within 15 %; median |error| "
            f"{statistics.median(errs):.1f} %, largest {max(errs):.1f} %."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--bench", action="append", required=True, help="dynamiq bench cluster JSON")
    p.add_argument("--kernels", action="append", required=True, help="kernel calibration JSON")
    p.add_argument("--network", action="append", required=True, help="network calibration JSON")
    p.add_argument(
        "--host", default=None, help="host CPU table (dynamiq plan calibrate --host), optional"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    n = len(args.bench)
    for name in ("kernels", "network"):
        given = getattr(args, name)
        if len(given) not in (1, n):
            p.error(f"--{name}: give one, or one per --bench ({n})")
    rows: list[dict[str, Any]] = []
    for i, path in enumerate(args.bench):
        with open(path) as f:
            bench = json.load(f)
        k = args.kernels[i if len(args.kernels) == n else 0]
        net = args.network[i if len(args.network) == n else 0]
        rows += rows_for(bench, k, net, args.host)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
