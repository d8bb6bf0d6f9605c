"""The pooled DynamiQ default against ``balance=1e6`` (no cap) and the span design, on
``benchmarks/scale.py``'s gradients (docs/benchmarks.md, "Scale with the pooled default").

    python benchmarks/scale_balance.py 128 ring,butterfly   # -> balance-128.json (cwd)
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks.*

from benchmarks.scale import gradients
from dynamiq.codecs import get_codec
from dynamiq.collectives import get_schedule
from dynamiq.collectives.simulator import simulate_schedule

torch.set_num_threads(1)
g, _ = gradients(1024, 1 << 16, 80, 1, progress=False)
n = int(sys.argv[1])
out = []
for sched in sys.argv[2].split(","):
    s = get_schedule(sched, n)
    xs = [g[r].contiguous() for r in range(n)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    for name, cfg in [
        ("default", {}),
        ("balance=1e6", {"balance": 1e6}),
        ("balance_slack=0", {"balance_slack": 0}),
        (
            "span design (pooling=span, span=65536, super_group=1024, bits=4.7)",
            {"pooling": "span", "span": 65536, "super_group": 1024, "bits": 4.7},
        ),
    ]:
        c0 = time.process_time()
        run = simulate_schedule(xs, get_codec({"id": "dynamiq", **cfg}), s, return_bound=False)
        err = run.results[0].output.double() - exact
        v = float(err.square().sum() / exact.square().sum())
        sent = sum(r.bytes_sent for r in run.results)
        row = {
            "ranks": n,
            "schedule": sched,
            "config": name,
            "vnmse": v,
            "bits_per_value": 8 * sent / n / (2 * (n - 1) / n * g.shape[1]),
            "cpu_seconds": time.process_time() - c0,
        }
        print(json.dumps(row), flush=True)
        out.append(row)
Path(f"balance-{n}.json").write_text(json.dumps(out, indent=1))
