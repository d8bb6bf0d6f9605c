"""Message integrity (``verify=True``) and the end-of-collective status exchange
(dynamiq/collectives/integrity.py), in process: corrupted, reordered or misrouted messages
become the same ``IntegrityError`` on every rank; without ``verify`` they are silent."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

from dynamiq.codecs import get_codec
from dynamiq.collectives import allreduce, get_schedule, simulate_allreduce
from dynamiq.collectives.engine import chunk_layout, plan_schedule
from dynamiq.collectives.integrity import (
    KINDS,
    STATUS_WORDS,
    IntegrityError,
    Status,
    checksum,
    identity,
    message_extra,
    open_length,
    open_message,
    seal_length,
    seal_message,
)
from dynamiq.collectives.transport import LocalCluster
from dynamiq.testing.faults import FaultyTransport

CODECS: dict[str, Any] = {
    "int8": "int8",
    "mxfp8_e4m3": "mxfp8_e4m3",
    "dynamiq": {"id": "dynamiq", "span": 4096},
    "thc": {"id": "thc", "block_size": 1024},
    "omnireduce": {"id": "omnireduce", "density": 0.5, "block_size": 64},
}


def test_every_single_bit_flip_of_a_length_header_fails_its_seal() -> None:
    ident = identity(7, 2, 3, 1, 0, 1)
    for size in (0, 1, 3720, (1 << 40) - 1):
        word = seal_length(ident, size)
        assert word >= 0 and open_length(ident, word) == size
        for bit in range(64):
            assert open_length(ident, word ^ (1 << bit)) is None, (size, bit)
        for i in range(6):  # another collective, round, chunk, sub-chunk, sender, receiver
            fields = [7, 2, 3, 1, 0, 1]
            fields[i] += 1
            assert open_length(identity(*fields), word) is None
    with pytest.raises(ValueError, match="cannot be sent"):
        seal_length(ident, 1 << 40)


def test_every_single_bit_flip_of_a_prologue_message_fails_its_check() -> None:
    ident = identity(7, -1, -1, 2, 1, 0)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.float32, torch.int64):
        for numel in (0, 5):
            t = (torch.arange(numel) * 37 - 50).to(dtype)
            wire = seal_message(ident, t)
            # the check rides in the message's own dtype (the fault injector tells them apart)
            assert wire.dtype == dtype and wire.numel() == numel + message_extra(t)
            opened = open_message(ident, wire)
            assert opened is not None and torch.equal(opened, t)
            raw = wire.view(torch.uint8)
            for bit in range(8 * raw.numel()):
                bad = raw.clone()
                bad[bit // 8] ^= 1 << (bit % 8)
                assert open_message(ident, bad.view(dtype)) is None, (dtype, numel, bit)
            for i in range(6):  # another collective, round, chunk, step, sender, receiver
                fields = [7, -1, -1, 2, 1, 0]
                fields[i] += 1
                assert open_message(identity(*fields), wire) is None
            assert open_message(ident, wire[:-1]) is None  # a short one too


@pytest.mark.parametrize("name", ["dynamiq", "thc"])
def test_a_corrupted_prologue_message_is_an_integrity_error(name: str) -> None:
    # DynamiQ's ring all-reduce: its step n - 1 (the all-gather half: only the ranks after
    # the victim would see the flipped value, so their budgets, hence their payload sizes,
    # would differ; on gloo that was a SIGABRT); THC's all-gather of scales: its first
    n = 3
    at = n - 1 if name == "dynamiq" else 0
    out, _ = _faulty_run(n, CODECS[name], "ring", "prologue", verify=True, at=at, flip=30)
    assert len(set(out)) == 1, out  # the status exchange after the prologue: everywhere
    assert out[0].startswith("IntegrityError") and "prologue from rank 1 failed" in out[0], out
    # verify off: the receiver raises at once (the messages are always sealed), the others
    # stop waiting for it
    out, _ = _faulty_run(n, CODECS[name], "ring", "prologue", verify=False, at=at, flip=30)
    (bad,) = [t for t in out if not t.startswith("PeerTimeoutError")]
    assert bad.startswith("IntegrityError") and "prologue from peer 1 failed" in bad, out


def test_the_checksum_covers_every_bit_and_every_field_of_the_identity() -> None:
    payload = torch.arange(64, dtype=torch.uint8)
    bound = torch.tensor([0.5, 2.0], dtype=torch.float64)
    base = checksum(identity(1, 2, 3, 4, 5, 6), payload, bound)
    for i in range(6):
        fields = [1, 2, 3, 4, 5, 6]
        fields[i] += 1
        assert checksum(identity(*fields), payload, bound) != base, i
    for bit in range(64 * 8):
        p = payload.clone()
        p[bit // 8] ^= 1 << (bit % 8)
        assert checksum(identity(1, 2, 3, 4, 5, 6), p, bound) != base, bit
    flipped = bound.clone()
    flipped.view(torch.uint8)[6] ^= 16  # an exponent bit: twice the bound
    assert checksum(identity(1, 2, 3, 4, 5, 6), payload, flipped) != base


def test_status_merges_to_the_first_failure_whatever_the_order() -> None:
    records = [
        (3, "checksum", {"round_": 2, "peer": 2, "chunk": 1, "sub": 0}),
        (1, "bad_input", {"round_": 5, "detail": 4}),
        (2, "checksum", {"round_": 2, "peer": 1, "chunk": 0, "sub": 1}),
        (0, "nonfinite", {}),
    ]
    texts = set()
    for perm in itertools.permutations(records):
        merged = Status(rank=9)
        for rank, kind, fields in perm:
            s = Status(rank)
            s.record(kind, **fields)
            merged._merge([s.flags, *s.first])
        assert merged.has("checksum") and merged.has("bad_input") and merged.has("nonfinite")
        assert not merged.has("overflow")
        texts.add(merged.describe())
        with pytest.raises(IntegrityError) as info:
            merged.raise_for_error()
        assert "rank 2: a message from rank 1 failed its checksum" in str(info.value)
    assert texts == {
        "rank 2: a message from rank 1 failed its checksum (round 2, chunk 0, sub-chunk 1)"
    }
    quiet = Status(0)
    quiet.record("nonfinite")
    quiet.record("overflow", detail=3)
    assert not quiet.failed
    quiet.raise_for_error()  # non-fatal kinds never raise
    assert len([quiet.flags, *quiet.first]) == STATUS_WORDS
    assert {k.bit for k in KINDS.values()} == set(range(len(KINDS)))


def _run_ranks(n: int, fn: Any) -> list[str]:
    """``fn(rank, cluster)`` on n threads; each rank's outcome (``"ok"`` or the error)."""
    cluster = LocalCluster(n)
    out = [""] * n

    def body(r: int) -> None:
        try:
            fn(r, cluster)
            out[r] = "ok"
        except Exception as exc:
            out[r] = f"{type(exc).__name__}: {exc}"
            if "raised on every rank" not in str(exc):  # (the status's error is everywhere)
                cluster.aborted.set()  # the others stop waiting for this rank

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _faulty_run(
    n: int,
    codec: Any,
    sched: str,
    fault: str,
    verify: bool,
    at: int | None = None,
    flip: int = 0,
    must_apply: bool = True,
) -> tuple[list[str], Any]:
    """Rank 1 injects ``fault``; each rank's outcome and result (no outcomes when the fault
    found nothing to strike and ``must_apply`` is false)."""
    xs = [torch.randn(n * 2 * 4096, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    results: list[Any] = [None] * n
    applied = []
    opts = {"ranks_per_node": 2} if sched == "hierarchical" else {}

    def fn(r: int, cluster: LocalCluster) -> None:
        tr: Any = cluster.transport(r)
        if r == 1:
            where = at if at is not None else 0 if fault == "reorder" else 1
            tr = FaultyTransport(tr, fault, at=where, verify=verify, flip=flip)
            applied.append(tr)
        x = xs[r].clone()
        st: Any = allreduce(
            x,
            codec,
            sched,
            transport=tr,
            threshold=0,
            sub_chunk=4096,
            timeout=10,
            verify=verify,
            return_bound=fault == "bound",
            schedule_options=opts,
        )
        results[r] = (x, st.bound)

    out = _run_ranks(n, fn)
    struck = all(t.applied for t in applied)
    assert struck or not must_apply, (codec, sched, fault)
    return (out if struck else []), results


@pytest.mark.parametrize(
    ("sched", "faults"),
    [
        ("ring", ["payload"]),
        *(
            pytest.param(s, ["payload", "reorder", "bound"], marks=pytest.mark.slow)
            for s in ("ring", "butterfly", "tree", "hierarchical")
        ),
    ],
)
def test_corrupted_or_reordered_messages_raise_the_same_error_on_every_rank(
    sched: str, faults: list[str]
) -> None:
    for (name, codec), fault in itertools.product(CODECS.items(), faults):
        # DynamiQ's pooled sub-chunks may differ in size: no reorder then (gloo would abort)
        out, _ = _faulty_run(4, codec, sched, fault, verify=True, must_apply=name != "dynamiq")
        if not out:
            continue
        assert len(set(out)) == 1, (name, fault, out)  # the same text on every rank
        assert out[0].startswith("IntegrityError") and "from rank 1 failed its" in out[0], out
        if name == "omnireduce" and fault == "reorder":  # its sealed headers fail first
            assert "the length header of a message from rank 1" in out[0], out


def test_a_header_failing_its_seal_is_the_same_error_on_every_rank() -> None:
    # the receiver drains the payload it cannot size and goes on with a stand-in, so the
    # status exchange tells every rank; without verify it raises at once, the others wait
    omni = CODECS["omnireduce"]
    for sched in ("ring", "butterfly"):
        out, _ = _faulty_run(3, omni, sched, "header", verify=True, flip=7)
        assert len(set(out)) == 1, out
        assert (
            out[0].startswith("IntegrityError")
            and "length header of a message from rank 1" in out[0]
        )
    out, _ = _faulty_run(3, omni, "ring", "header", verify=False, flip=7)
    (bad,) = [t for t in out if not t.startswith("PeerTimeoutError")]
    assert bad.startswith("IntegrityError") and "length header from peer 1" in bad, out


def test_without_verify_a_flipped_bit_is_a_silent_wrong_result() -> None:
    # what verify=False does not detect (docs/reliability.md): the sums are just wrong
    n = 4
    out, results = _faulty_run(n, "int8", "ring", "payload", verify=False)
    assert out == ["ok"] * n
    xs = [torch.randn(n * 2 * 4096, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    clean = simulate_allreduce(xs, "int8", "ring", sub_chunk=4096).outputs[0]
    assert not torch.equal(results[0][0], clean)


def test_verify_changes_no_result_and_costs_a_checksum_per_message() -> None:
    xs = [torch.randn(20000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    sched = get_schedule("ring", 4)
    for name, codec in CODECS.items():
        plain = simulate_allreduce(xs, codec, "ring", engine="threads", sub_chunk=4096)
        checked = simulate_allreduce(
            xs, codec, "ring", engine="threads", sub_chunk=4096, verify=True
        )
        for a, b in zip(plain.outputs, checked.outputs, strict=False):
            assert torch.equal(a, b)
        c = get_codec(codec)
        _, pieces = chunk_layout(20000, sched, c, 4096)
        for r, (a, b) in enumerate(zip(plain.stats, checked.stats, strict=False)):
            sends = [
                sum(len(pieces[op.chunk]) for op in rnd.sends) for rnd in plan_schedule(sched, c)[r]
            ]
            # 4 bytes of checksum per payload message; 2 rounds of 64 bytes of status, at
            # the end and (a prologue that communicates: DynamiQ's, THC's) after the prologue
            assert b.round_bytes == [x + 4 * m for x, m in zip(a.round_bytes, sends, strict=False)]
            exchanges = 2 if name in ("dynamiq", "thc") else 1
            assert b.control_bytes_sent - a.control_bytes_sent == exchanges * 2 * 8 * STATUS_WORDS
