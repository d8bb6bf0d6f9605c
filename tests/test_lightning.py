"""The Lightning recipe (examples/train_lightning.py): DDP with dynamiq's comm hook and FSDP2
(``ModelParallelStrategy``) with ``dynamiq.fsdp.compress``, on 2 gloo ranks under torchrun.

Needs the ``lightning`` package (in the ``test`` extra). Nothing is downloaded; Lightning
writes nothing (no loggers, checkpoints or progress bars) and runs in a temporary directory,
which must stay empty but for the run's JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynamiq.testing.distributed import free_port

pytest.importorskip("lightning")

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parents[1] / "examples" / "train_lightning.py"
STEPS = 6


@pytest.mark.slow  # ~35 s of CPU: torchrun, 2 ranks importing torch and Lightning, 2 fits
def test_lightning_ddp_hook_and_fsdp2_comm_train_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    root = tmp_path / "root"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT)]
    cmd += ["--strategy", "ddp", "fsdp", "--steps", str(STEPS), "--codec", "int8"]
    cmd += ["--root", str(root), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for strategy in ("ddp", "fsdp"):
        assert f"Lightning {strategy}, gloo, 2 ranks, codec int8" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    ddp, fsdp = data["ddp"], data["fsdp"]
    # the hook ran in every step (Lightning's own DDPStrategy drops it on the CPU)
    assert [s["step"] for s in ddp["comm_stats"]] == list(range(STEPS))
    assert all(s["bytes_sent"] > 0 for s in ddp["comm_stats"])
    # the comm ran for every FSDP module with parameters (the 2 blocks and the root), every step
    modules = {s["module"] for s in fsdp["comm_stats"]}
    assert modules == {"<root>", "blocks.0", "blocks.1"}
    assert len(fsdp["comm_stats"]) == STEPS * len(modules)
    for run in (ddp, fsdp):
        losses = run["losses"]
        assert len(losses) == STEPS
        assert losses[-1] < 0.9 * losses[0]  # it learns
    # the same model, data and optimizer: the two strategies start alike and stay close
    assert ddp["losses"][0] == fsdp["losses"][0]
    assert abs(ddp["losses"][-1] - fsdp["losses"][-1]) <= 0.02 * ddp["losses"][-1]
    # nothing written but the JSON (the root dir Lightning was given stays empty or absent)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert written in (["run.json"], ["root", "run.json"]), written
