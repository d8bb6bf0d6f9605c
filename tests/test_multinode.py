"""The documented multi-node launch, for real: two network namespaces are two "nodes", each
with its own address and a shaped link to the other, and each runs the command of
docs/collectives.md ("Launching") with its ``--node-rank``: ``torchrun --nnodes 2 …
--master-addr <node 0> examples/train_ddp.py --codec mxfp8_e4m3 --schedule hierarchical
--ranks-per-node … --intra-codec fp32``.

Both launches must succeed; rank 0's losses must be bit-identical to those of the same job on
one node (4 processes on loopback, same ranks, same schedule), which they can only be if the
other node's ranks took part correctly; and the compressed inter-node traffic must really
have crossed the link (the interfaces' own counters), compressed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamiq.bench.ddp_train import TrainConfig
from dynamiq.bench.netns import EmulatedCluster, NamespaceUnavailable, check_available
from dynamiq.codecs import get_codec
from dynamiq.data.model import ModelConfig, build_model

try:
    check_available()
    _REASON = ""
except NamespaceUnavailable as exc:
    _REASON = f"network namespaces are not available here: {exc}"

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(bool(_REASON), reason=_REASON or "available"),
]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS = 4
PER_NODE = 2
CODEC = "mxfp8_e4m3"
# the script's options of the documented multi-node command (docs/collectives.md)
SCRIPT = [
    str(ROOT / "examples" / "train_ddp.py"),
    "--codec",
    CODEC,
    "--schedule",
    "hierarchical",
    "--ranks-per-node",
    str(PER_NODE),
    "--intra-codec",
    "fp32",
    "--steps",
    str(STEPS),
]
ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)}


def _run(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-4000:]
        outs.append(out)
    return outs


def _run_two_nodes(tmp_path: Path) -> tuple[list[int], list[str]]:
    """Each namespace runs the documented command with its node rank; returns the bytes each
    node's interface sent and the two launches' output."""
    with EmulatedCluster(2, rate="1gbit") as cl:
        before = cl.counters()
        procs = []
        for node in range(2):
            launch = ["--nnodes", "2", "--nproc-per-node", str(PER_NODE)]
            launch += ["--node-rank", str(node), "--master-addr", cl.addresses[0]]
            launch += ["--master-port", "29500"]
            argv = [*TORCHRUN, *launch, *SCRIPT, "--json", str(tmp_path / f"node{node}.json")]
            procs.append(
                cl.popen(
                    node,
                    argv,
                    env=ENV,
                    cwd=str(ROOT),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = _run(procs, timeout=150)
        after = cl.counters()
    return [after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in range(2)], outs


@pytest.mark.slow  # ~35-55 s: two network namespaces, torchrun on each
def test_two_namespaces_run_the_documented_multinode_command(tmp_path: Path) -> None:
    # the reference: the same job on one node, 4 processes on loopback (same global ranks and
    # schedule), run alongside
    single_node = ["--standalone", "--nproc-per-node", str(2 * PER_NODE)]
    ref = subprocess.Popen(
        [*TORCHRUN, *single_node, *SCRIPT, "--json", str(tmp_path / "single.json")],
        cwd=str(ROOT),
        env={**os.environ, **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        sent, outs = _run_two_nodes(tmp_path)
        _run([ref], timeout=150)
    finally:
        if ref.poll() is None:  # a failure above: do not leave it running
            ref.kill()
            ref.communicate()

    # global rank 0 lives on node 0: it reports; node 1's ranks write nothing
    assert f"{2 * PER_NODE} ranks, codec {CODEC}, hierarchical" in outs[0]
    assert not (tmp_path / "node1.json").exists()
    multi = json.loads((tmp_path / "node0.json").read_text())
    assert len(multi["losses"]) == STEPS and all(math.isfinite(x) for x in multi["losses"])

    single = json.loads((tmp_path / "single.json").read_text())
    assert multi["losses"] == single["losses"]  # bit for bit

    # what crossed the link: per step, each node leader sends the other its half of every
    # bucket in the reduce-scatter and again in the all-gather: all N gradient values, in the
    # codec (MXFP8: 8.25 bits per value); inside a node fp32 travels on loopback, not the link
    cfg = TrainConfig()
    model = build_model(
        ModelConfig(
            d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, seq_len=cfg.seq_len
        ),
        cfg.seed,
    )
    numel = sum(p.numel() for p in model.parameters())
    compressed = STEPS * numel * get_codec(CODEC).bits_per_value() / 8
    for node in range(2):
        assert sent[node] >= 0.95 * compressed, (node, sent, compressed)
    # node 1 sends nothing but its leader's compressed halves (+ rendezvous, DDP set-up and
    # TCP overhead): well under what the same steps would cost in fp32
    assert sent[1] < compressed + 0.25 * STEPS * numel * 4, (sent, compressed)
