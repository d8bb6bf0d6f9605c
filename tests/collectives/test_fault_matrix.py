"""The fault matrix over real gloo ranks (dynamiq/testing/faultmatrix.py): a fast subset in
the default run, the whole matrix marked slow (``pytest -m slow
tests/collectives/test_fault_matrix.py``, or ``python -m dynamiq.testing.faultmatrix``)."""

from __future__ import annotations

import re

import pytest

from dynamiq.testing.faultmatrix import Outcome, run_matrix, summarize

pytestmark = pytest.mark.distributed

#: what each fault must end in, verify on (kill: the survivors)
_EXPECTED = {
    "clean": {"correct"},
    "kill": {"named error everywhere", "same error everywhere"},
    "stall": {"named error everywhere"},
    "drop": {"named error everywhere"},
    # a data-dependent codec's reordered header fails its seal first: the receiver drains
    # the payload and goes on; n/a: payloads of different sizes (DynamiQ's pooled ones), or
    # no second payload to the same peer before a wait
    "reorder": {"same error everywhere", "n/a"},
    "payload": {"same error everywhere"},
    "header": {"same error everywhere", "n/a"},  # n/a: a fixed-size codec has no header
    "bound": {"same error everywhere"},
    "config": {"same error everywhere"},
    # the status exchange right after the prologue; n/a: a codec whose prologue sends nothing
    "prologue": {"same error everywhere", "n/a"},
}


def _names_peer_1(text: str) -> bool:
    return re.search(r"\bpeer 1\b", text.split(" (")[0]) is not None


def _check(outs: list[Outcome]) -> None:
    report = summarize(outs)
    assert sum(o.deaths for o in outs) == 0, report  # no SIGABRT, SIGBUS, SIGSEGV
    assert sum(o.slow for o in outs) == 0, report  # none past the timeout (+ stall) + 2 s
    for o in outs:
        if o.cell.verify:
            assert o.verdict in _EXPECTED[o.cell.fault], (o, report)
        else:  # verify off: never a death or hang; a wrong result is possible (documented)
            assert o.verdict != "other error", (o, report)
        if o.cell.fault == "payload" and o.cell.verify:
            assert "failed its checksum" in o.ranks[0] and "from rank 1" in o.ranks[0]
        if o.cell.fault in ("stall", "drop"):  # every survivor names the victim: its own
            for i, t in enumerate(o.ranks):  # wait on it, or the first failure's (a kill's
                # survivors too, unless rank 0, the store's host, exited first: see the docs)
                ok = i == 1 or _names_peer_1(t) or "rank 1 failed first" in t
                assert ok, (o, i, t)
        if o.cell.fault == "prologue" and o.verdict != "n/a":  # sealed: caught, verify or not
            assert any("prologue from" in t for t in o.ranks), o


def test_fault_matrix_fast_subset() -> None:
    # 2 ranks, one fixed-size and one data-dependent codec, every fault, verify on
    outs = run_matrix(
        worlds=(2,),
        schedules=("ring",),
        codecs=("int8", "omnireduce"),
        faults=("clean", "kill", "stall", "drop", "reorder", "payload", "header", "config"),
        verify=(True,),
    )
    outs += run_matrix(
        worlds=(3,),
        schedules=("butterfly",),
        codecs=("mxfp8_e4m3",),
        faults=("clean", "payload", "reorder", "bound", "drop"),
        verify=(True, False),
    )
    # DynamiQ's prologue (a ring all-reduce of demands): a flipped bit in its all-gather half
    # (verify off: tests/collectives/test_integrity.py in process, the whole matrix on gloo)
    outs += run_matrix(
        worlds=(2,), schedules=("ring",), codecs=("dynamiq",), faults=("prologue",), verify=(True,)
    )
    _check(outs)
    # verify off: a flipped payload bit is a silent wrong result (what verify is for)
    off = [o for o in outs if not o.cell.verify and o.cell.fault == "payload"]
    assert off and all(o.verdict in ("WRONG", "DIVERGENT") for o in off), off


@pytest.mark.slow
def test_the_whole_fault_matrix() -> None:
    _check(run_matrix())
