"""Final training loss of a small transformer on CPython's docs with plain DDP vs the dynamiq
hook (2 gloo ranks on loopback, same seed): the numbers behind tests/test_ddp.py.

    python benchmarks/ddp_loss.py --steps 300 --codecs int8,mxfp8_e4m3,mxfp4
"""

from __future__ import annotations

import argparse
import json

from dynamiq.bench.ddp_train import TrainConfig, train
from dynamiq.testing.distributed import run_gloo


def job(rank: int, world: int, hook: str | None, options: dict | None, steps: int) -> dict:
    cfg = TrainConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32, batch=4, steps=steps)
    res = train(rank, world, cfg, hook, options)
    return {"losses": res.losses, "seconds": res.seconds, "stats": res.hook_stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--codecs", default="int8,mxfp8_e4m3,mxfp4")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    rows = []
    runs: list[tuple[str, str | None, dict | None]] = [("plain DDP (fp32)", None, None)]
    runs += [(c, "dynamiq", {"codec": c}) for c in args.codecs.split(",")]
    for name, hook, options in runs:
        res = run_gloo(job, args.world, hook, options, args.steps, timeout=1200)
        bad = [v for s, v in res if s != "ok"]
        if bad:
            raise SystemExit(bad[0])
        finals = [sum(v["losses"][-20:]) / 20 for _, v in res]
        sent = [sum(s["bytes_sent"] for s in v["stats"]) / args.steps for _, v in res]
        rows.append(
            {
                "run": name,
                "final loss (mean of last 20 steps, ranks)": sum(finals) / len(finals),
                "first loss": res[0][1]["losses"][0],
                "bytes sent/step/rank": sum(sent) / len(sent) if sent[0] else None,
                "seconds": res[0][1]["seconds"],
            }
        )
        print(json.dumps(rows[-1]))
    base = rows[0]["final loss (mean of last 20 steps, ranks)"]
    for r in rows:
        r["vs plain"] = r["final loss (mean of last 20 steps, ranks)"] / base - 1
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
