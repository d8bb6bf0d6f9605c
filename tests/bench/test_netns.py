"""The emulated cluster: namespaces that reach each other over shaped links, a gloo all-reduce
between them that matches the in-process simulator bit for bit, interface counters that see
the bytes we account for, and nothing left behind (also after an exception)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dynamiq.bench._cluster_worker import rank_buffer
from dynamiq.bench.cli import main
from dynamiq.bench.cluster import run_workers
from dynamiq.bench.netns import EmulatedCluster, NamespaceUnavailable, check_available
from dynamiq.collectives import simulate_allreduce

try:
    check_available()
    _REASON = ""
except NamespaceUnavailable as exc:
    _REASON = f"network namespaces are not available here: {exc}"

needs_netns = pytest.mark.skipif(bool(_REASON), reason=_REASON or "available")

RATE = "400mbit"

_SERVER = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 5001))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
data = c.recv(100)
c.sendall(b"pong:" + data)
c.close()
"""

_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5001), timeout=10)
c.sendall(sys.argv[2].encode())
print(c.recv(100).decode())
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _left_behind(cl: EmulatedCluster) -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(cl.name + "-")}


@needs_netns
@pytest.mark.distributed
def test_addresses_reachable_and_removed_on_exit() -> None:
    with EmulatedCluster(2, rate=RATE) as cl:
        assert len(set(cl.addresses)) == 2
        assert _left_behind(cl) == {*cl.namespaces, cl.hub}
        assert cl.shaping["qdisc"] in ("netem", "tbf")
        if cl.shaping["qdisc"] == "tbf":  # the fallback says what it could not do
            assert cl.shaping["delay_applied"] is False
            assert "delay" in cl.shaping["delay_not_applied_because"]
        # each namespace has exactly lo and its veth, with its own address
        show = subprocess.run(
            ["ip", "-n", cl.namespaces[1], "-brief", "addr"], capture_output=True, text=True
        ).stdout
        assert cl.addresses[1] in show and cl.addresses[0] not in show
        server = cl.popen(0, [sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        client = cl.popen(
            1,
            [sys.executable, "-c", _CLIENT, cl.addresses[0], "ping-from-1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = client.communicate(timeout=30)
        assert out.strip() == "pong:ping-from-1"
        assert server.wait(timeout=30) == 0
        server.stdout.close()
        counters = cl.counters()
        assert counters[1]["tx_packets"] > 0 and counters[0]["rx_bytes"] > 0
    assert _left_behind(cl) == set()


@needs_netns
@pytest.mark.distributed
def test_exception_inside_with_removes_everything() -> None:
    with pytest.raises(ZeroDivisionError), EmulatedCluster(2, rate=RATE) as cl:
        sleeper = cl.popen(1, ["sleep", "60"])
        1 / 0  # noqa: B018
    assert _left_behind(cl) == set()
    assert sleeper.poll() is not None  # killed with its namespace


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="rate must be"):
        EmulatedCluster(2, rate="fast")
    with pytest.raises(ValueError, match="n must be"):
        EmulatedCluster(0)
    with pytest.raises(ValueError, match="name must be"):
        EmulatedCluster(2, name="has space")
    with pytest.raises(ValueError, match=r"net\.\* names"):
        EmulatedCluster(2, sysctls={"kernel.panic": "1"})
    with pytest.raises(ValueError, match="plain word"):
        EmulatedCluster(2, sysctls={"net.ipv4.tcp_slow_start_after_idle": "0; reboot"})


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NamespaceUnavailable, match="needs root"):
        check_available()
    with pytest.raises(NamespaceUnavailable, match="needs root"), EmulatedCluster(2):
        pass


def test_cli_exits_2_where_namespaces_are_not_permitted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "cluster", "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot build the emulated cluster" in err and "needs root" in err


NUMEL = 300_000
CASES = [("int8", "ring"), ("dynamiq", "butterfly"), ("fp32", "ring")]


@needs_netns
@pytest.mark.distributed
def test_gloo_allreduce_between_namespaces_matches_simulator(tmp_path: str) -> None:
    methods = [
        {"kind": "dynamiq", "codec": c, "schedule": s, "label": f"{c}-{s}"} for c, s in CASES
    ]
    spec = {"methods": methods, "numel": NUMEL, "data": "randn", "seed": 3, "progress": False}
    spec["save_outputs"] = str(tmp_path)
    spec["sub_chunk"] = 1 << 16
    with EmulatedCluster(2, rate=RATE) as cl:
        per_rank = run_workers(cl, spec, str(tmp_path))
    assert _left_behind(cl) == set()
    inputs = [rank_buffer("randn", r, 2, NUMEL, 3) for r in range(2)]
    for k, (codec, schedule) in enumerate(CASES):
        sim = simulate_allreduce(inputs, codec, schedule, sub_chunk=1 << 16)
        for r in range(2):
            out = torch.load(os.path.join(tmp_path, f"{codec}-{schedule}-{r}.pt"))
            assert torch.equal(out, sim.outputs[r]), (codec, schedule, r)
            res = per_rank[r]["results"][k]
            (stats,) = res["stats"]
            assert stats["bytes_sent"] == sim.bytes_sent[r]
            # the interface saw at least the payload we sent, plus modest TCP/IP overhead
            # (headers, ACKs of the payload coming the other way, barriers, handshake)
            ours = stats["bytes_sent"] + stats["control_bytes_sent"]
            wire = res["counters"]["tx_bytes"]
            assert ours <= wire <= 1.1 * ours + 64 * 1024, (codec, schedule, r, ours, wire)
            assert res["counters"]["rx_bytes"] >= stats["bytes_received"]
