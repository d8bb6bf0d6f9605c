"""``dynamiq plan``: the α-β model against hand-computed cases, its bytes against the engine's,
the command line's JSON and its argument errors."""

from __future__ import annotations

import json

import pytest
import torch

from dynamiq.bench.cli import main
from dynamiq.codecs import get_codec
from dynamiq.collectives import simulate_allreduce
from dynamiq.plan.costs import CodecCost, Cost, Host, Link, load_kernel_table
from dynamiq.plan.model import Cluster, prologue_exchange, simulate, wire_bytes

ZERO = CodecCost(Cost(), Cost(), Cost())
LOCKSTEP = Host(lookahead=False)


def test_two_rank_ring_is_two_alpha_beta_steps() -> None:
    # 2 ranks, fp32, one piece per chunk: round 0 sends half the buffer, round 1 (all-gather)
    # the other half once round 0 has arrived: 2 (alpha + B / beta)
    numel, rate, alpha = 1 << 16, 1e9, 1e-4
    link = Link(rate, alpha)
    b = 4 * numel / 2
    p = simulate("fp32", "ring", Cluster(2, link), numel, ZERO, LOCKSTEP, sub_chunk=numel)
    assert p.seconds == pytest.approx(2 * (alpha + 8 * b / rate), rel=1e-12)
    assert p.bits_per_value == pytest.approx(32.0)


def test_two_rank_ring_kernel_times_add_where_the_engine_waits_for_them() -> None:
    # encode e, send, fused reduce r on arrival, forward; the reduced chunk's decode d runs
    # while round 1's data is in flight (hidden when d < alpha + B/beta), the received
    # chunk's decode after the last round: e + r + 2 (alpha + B/beta) + d
    numel, rate, alpha = 1 << 16, 1e9, 1e-4
    e, r, d = 3e-4, 5e-4, 2e-4
    costs = CodecCost(Cost(e), Cost(r), Cost(d))
    step = alpha + 8 * 4 * numel / 2 / rate
    assert d < step
    p = simulate(
        "fp32", "ring", Cluster(2, Link(rate, alpha)), numel, costs, LOCKSTEP, sub_chunk=numel
    )
    assert p.seconds == pytest.approx(e + r + 2 * step + d, rel=1e-12)
    assert p.phases["encode"] == pytest.approx(e)
    assert p.phases["reduce"] == pytest.approx(r)
    assert p.phases["decode"] == pytest.approx(2 * d)


def test_four_rank_butterfly_is_halving_then_doubling() -> None:
    # recursive halving: 2 chunks then 1 chunk to the partner, doubling: 1 then 2; each round
    # alpha + its bytes / beta (the chunk messages of a round go back to back on one link)
    numel, rate, alpha = 1 << 16, 1e8, 2e-4
    chunk = 4 * numel / 4
    p = simulate(
        "fp32", "butterfly", Cluster(4, Link(rate, alpha)), numel, ZERO, LOCKSTEP, sub_chunk=numel
    )
    assert p.seconds == pytest.approx(4 * alpha + 6 * 8 * chunk / rate, rel=1e-12)
    assert [r["bytes_sent"] for r in p.rounds] == [2 * chunk, chunk, chunk, 2 * chunk]


def test_efficiency_and_shared_links_scale_the_wire_time() -> None:
    numel, rate = 1 << 16, 1e9
    full = simulate("fp32", "ring", Cluster(2, Link(rate)), numel, ZERO, LOCKSTEP)
    half = simulate("fp32", "ring", Cluster(2, Link(rate, 0.0, 0.5)), numel, ZERO, LOCKSTEP)
    assert half.seconds == pytest.approx(2 * full.seconds, rel=1e-12)
    # overlapped rounds: the pipelined ring approaches 2 (n-1)/n of the buffer over the link
    n, numel = 4, 1 << 22
    p = simulate("fp32", "ring", Cluster(n, Link(rate, 1e-6)), numel, ZERO, Host())
    bound = 2 * (n - 1) / n * 4 * numel * 8 / rate
    assert bound <= p.seconds < 1.01 * bound


def test_exchange_efficiency_applies_to_pairwise_rounds_only() -> None:
    # butterfly's rounds send to the peer they receive from: their wire time scales by the
    # exchange efficiency; a ring of 4 never exchanges, so it is unchanged
    numel, rate, alpha = 1 << 16, 1e8, 2e-4
    chunk = 4 * numel / 4
    ex = Cluster(4, Link(rate, alpha, exchange_efficiency=0.8))
    p = simulate("fp32", "butterfly", ex, numel, ZERO, LOCKSTEP, sub_chunk=numel)
    assert p.seconds == pytest.approx(4 * alpha + 6 * 8 * chunk / (0.8 * rate), rel=1e-12)
    plain = Cluster(4, Link(rate, alpha))
    ring = simulate("fp32", "ring", plain, numel, ZERO, LOCKSTEP, sub_chunk=numel)
    assert simulate("fp32", "ring", ex, numel, ZERO, LOCKSTEP, sub_chunk=numel).seconds == (
        ring.seconds
    )


def test_the_exchange_curve_goes_by_the_rounds_bytes() -> None:
    # log-linear between the measured rounds, flat beyond them; it replaces the single
    # exchange efficiency, for exchange rounds only
    curve = ((1e6, 0.8), (4e6, 0.9))
    link = Link(1e8, exchange_efficiency=0.5, exchange_curve=curve)
    assert link.exchange_at(1e5) == 0.8 and link.exchange_at(1e7) == 0.9
    assert link.exchange_at(2e6) == pytest.approx(0.85, rel=1e-12)
    assert link.exchange_at(None) == 0.5
    assert link.seconds(1e6, exchange=True, round_bytes=2e6) == pytest.approx(8e6 / (1e8 * 0.85))
    assert link.seconds(1e6) == pytest.approx(8e6 / 1e8)
    shared = Link(1e8, shared_efficiency=0.7, exchange_curve=curve)
    assert shared.seconds(1e6, True, True, 4e6) == pytest.approx(8e6 / (1e8 * 0.7))
    for bad in (((4e6, 0.8), (1e6, 0.9)), ((1e6, 0.8), (1e6, 0.9)), ((0.0, 0.8),), ((1e6, 1.5),)):
        with pytest.raises(ValueError, match="exchange curve|efficiency"):
            Link(1e8, exchange_curve=bad)


def test_butterfly_rounds_take_the_curve_at_their_bytes() -> None:
    # 4 ranks: half the buffer to each partner in turn (the middle two rounds, to one peer,
    # go on as one); a curve point at exactly that many bytes sets their wire time, the
    # ring does not move
    numel, rate, alpha = 1 << 16, 1e8, 2e-4
    half = 4 * numel // 2
    curve = ((half / 4, 0.9), (float(half), 0.6), (half * 4.0, 0.95))
    ex = Cluster(4, Link(rate, alpha, exchange_curve=curve))
    p = simulate("fp32", "butterfly", ex, numel, ZERO, LOCKSTEP, sub_chunk=numel)
    assert [r["bytes_sent"] for r in p.rounds] == [half, half // 2, half // 2, half]
    plain = Cluster(4, Link(rate, alpha))
    base = simulate("fp32", "butterfly", plain, numel, ZERO, LOCKSTEP, sub_chunk=numel)
    wire = 3 * 8 * half / rate
    assert p.seconds - base.seconds == pytest.approx(wire / 0.6 - wire, rel=1e-9)
    ring = simulate("fp32", "ring", ex, numel, ZERO, LOCKSTEP, sub_chunk=numel)
    ring0 = simulate("fp32", "ring", plain, numel, ZERO, LOCKSTEP, sub_chunk=numel)
    assert ring.seconds == ring0.seconds
    # two ranks exchange with one partner all along (no switch): the link's own efficiency
    pair = Cluster(2, Link(rate, alpha, exchange_efficiency=0.8, exchange_curve=curve))
    one = Cluster(2, Link(rate, alpha, exchange_efficiency=0.8))
    for sched in ("ring", "butterfly"):
        got = simulate("fp32", sched, pair, numel, ZERO, LOCKSTEP, sub_chunk=numel)
        assert (
            got.seconds
            == simulate("fp32", sched, one, numel, ZERO, LOCKSTEP, sub_chunk=numel).seconds
        )


def test_a_late_notice_waits_behind_the_receivers_own_data() -> None:
    # a payload of data-dependent size is posted after its length header, so its "ready"
    # notice goes after the send was issued: in OmniReduce's butterfly the notice travels
    # behind the receiver's own data to the sender, for at most the link's notice queue
    # time; a ring (the notice's direction carries no data to the sender) and a fixed-size
    # codec (posted ahead, no late notice) do not move
    numel, rate, alpha, queue = 1 << 18, 1e8, 2e-4, 0.004
    base = Cluster(4, Link(rate, alpha))
    slow = Cluster(4, Link(rate, alpha, notice_queue_s=queue))
    piece = 8 * 4 * (1 << 14) / rate  # a piece's wire time: more than the queue time
    assert piece > queue
    moved = []
    for codec, schedule in [
        ("omnireduce", "butterfly"),
        ("omnireduce", "ring"),
        ("fp32", "butterfly"),
    ]:
        a = simulate(codec, schedule, base, numel, ZERO, LOCKSTEP, sub_chunk=1 << 14)
        b = simulate(codec, schedule, slow, numel, ZERO, LOCKSTEP, sub_chunk=1 << 14)
        assert b.seconds >= a.seconds
        moved.append(b.seconds - a.seconds)
    pieces = 2 * numel // 4 // (1 << 14) * 3  # received by a rank: 8 + 4 + 4 + 8 ... at most
    assert queue <= moved[0] <= pieces * queue
    assert moved[1:] == [0.0, 0.0]
    with pytest.raises(ValueError, match="notice queue"):
        Link(rate, alpha, notice_queue_s=-1.0)


def test_link_patterns_have_a_lockstep_exchange() -> None:
    from dynamiq.plan.calibrate import link_patterns

    pat = link_patterns(4, 1 << 20, 1 << 18)
    switch, lockstep = pat["exchange_switch_partner"], pat["exchange_lockstep"]
    assert [[t[:4] for t in rnd] for rank in lockstep for rnd in rank] == [
        rnd for rank in switch for rnd in rank
    ]
    assert all(t[4] == 1 for rank in lockstep for rnd in rank for t in rnd)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_the_butterfly_pattern_has_the_engines_rounds(n: int) -> None:
    # the engine's plan on a power of two, its rounds to one peer in a row merged (the
    # engine sends them on without a pause: the last halving and the first doubling)
    from dynamiq.collectives import get_schedule
    from dynamiq.collectives.planning import plan_schedule
    from dynamiq.plan.calibrate import butterfly_pattern_name, butterfly_rounds, link_patterns

    size, numel = 1 << 22, 1 << 20  # fp32: the same bytes
    plan = plan_schedule(get_schedule("butterfly", n), get_codec("fp32"))
    chunk = size // get_schedule("butterfly", n).num_chunks
    for r in range(1 << (n.bit_length() - 1)):
        engine: list[tuple[int, int]] = []
        for rnd in plan[r]:
            if engine and engine[-1][0] == rnd.send_to:
                engine[-1] = (rnd.send_to, engine[-1][1] + chunk * len(rnd.sends))
            elif rnd.sends:
                engine.append((rnd.send_to, chunk * len(rnd.sends)))
        assert [(r ^ m, b) for m, b in butterfly_rounds(n, size)] == engine
    pat = link_patterns(n, 1 << 20, 1 << 18, [size])[butterfly_pattern_name(size)]
    assert [t[2] for t in pat[0][0]] == [butterfly_rounds(n, size)[0][1]]
    assert numel * 4 == size


def test_exchange_efficiency_is_derived_from_the_exchange_patterns_bytes() -> None:
    # 4 ranks exchange S/2, S/4, S/4, S/2 back to back: 1.5 S bytes each way
    from dynamiq.plan.calibrate import exchange_efficiency, exchange_sizes

    size, bps = 1 << 20, 1e8
    assert exchange_sizes(4, size) == [size // 2, size // 4, size // 4, size // 2]
    assert exchange_sizes(6, size) == exchange_sizes(4, size)  # the power of two below
    seconds = 8 * 1.5 * size / bps / 0.85
    assert exchange_efficiency(4, size, seconds, bps) == pytest.approx(0.85, rel=1e-12)


@pytest.mark.parametrize(("n", "steps"), [(2, 2), (3, 4), (4, 4), (5, 8), (8, 6)])
def test_the_prologue_exchange_is_its_steps_and_bytes(n: int, steps: int) -> None:
    """DynamiQ's prologue: one exact all-reduce of a byte a span and two flags, halving and
    doubling on 2, 4, 8 ranks, a ring on 3 and 5; its phase is the CPU plus a latency a step
    and its bytes at the link's goodput (THC's all-gather: one step)."""
    numel, rate, alpha = 1 << 16, 1e8, 1e-3
    nbytes, got = prologue_exchange("dynamiq", n, numel)
    assert got == steps
    stats = numel // 256 + 2  # int8 statistics, the ring's even chunks
    assert abs(nbytes - 2 * (n - 1) / n * stats) <= 2 * n
    pro = Cost(per_value=1e-9)
    costs = CodecCost(Cost(), Cost(), Cost(), pro)
    p = simulate("dynamiq", "ring", Cluster(n, Link(rate, alpha)), numel, costs, LOCKSTEP)
    want = pro(numel) + max(2, steps) * alpha + 8 * nbytes / rate
    assert p.phases["prologue"] == pytest.approx(want, rel=1e-9)
    assert prologue_exchange("thc", n, numel)[1] == 1
    assert prologue_exchange("int8", n, numel) == (0, 0)


@pytest.mark.parametrize("schedule", ["ring", "butterfly"])
@pytest.mark.parametrize("codec", ["bf16", "int8", "mxfp4", "dynamiq", "thc"])
def test_bits_per_value_equal_the_engines_bytes(codec: str, schedule: str) -> None:
    n, numel, sub = 4, 3 * 65536 + 4096, 1 << 15  # uneven chunks, several sub-chunks
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    res = simulate_allreduce(xs, codec, schedule, sub_chunk=sub, return_bound=False)
    sent, exact = wire_bytes(codec, schedule, n, numel, sub)
    p = simulate(codec, schedule, Cluster(n, Link(1e9)), numel, ZERO, Host(), sub_chunk=sub)
    if codec == "dynamiq":
        # pooled over the bucket: each chunk's bytes follow the data, within `balance` of the
        # uniform budget the model predicts; in all, no more than predicted
        assert not exact
        assert sum(res.bytes_sent) <= sum(sent) <= 1.01 * sum(res.bytes_sent)
        balance = get_codec(codec).balance
        assert all(m <= balance * s for s, m in zip(sent, res.bytes_sent, strict=True))
        assert p.bits_per_value == pytest.approx(res.bits_per_value(), rel=1e-2)
        return
    assert exact
    assert sent == res.bytes_sent
    assert p.bits_per_value == pytest.approx(res.bits_per_value(), rel=1e-12)


def test_data_dependent_bytes_are_an_upper_bound() -> None:
    n, numel = 4, 1 << 16
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    res = simulate_allreduce(xs, "omnireduce", "ring", return_bound=False)
    sent, exact = wire_bytes("omnireduce", "ring", n, numel)
    assert not exact
    assert all(s >= m for s, m in zip(sent, res.bytes_sent, strict=True))
    assert sum(sent) <= 1.01 * sum(res.bytes_sent)  # dense data: every block is sent


def test_kernel_tables_load_from_each_format() -> None:
    bench_rows = [
        {
            "codec": "int8",
            "fused s": 0.01,
            "bytes moved": 2 * 17 * 2**20 + 4 * 2**24,
            "copy bandwidth GB/s": 10.0,
        }
    ]
    t = load_kernel_table(bench_rows, "rows")
    assert t.get("int8").reduce(1 << 24) == pytest.approx(0.01, rel=1e-3)
    gpu = {
        "run_1": {
            "timing": {
                "numel": 1000,
                "copy_bandwidth_gbs": 1.0,
                "codecs": {"bf16": {"fused_seconds": 3e-4, "fused_device_seconds": 1e-4}},
            }
        }
    }
    g = load_kernel_table(gpu, "gpu")
    assert g.get("bf16").reduce.overhead == pytest.approx(2e-4)
    assert g.get("bf16").reduce(1000) == pytest.approx(3e-4)
    assert g.get("mxfp4").reduce(1000) > 0  # not in the table: the roofline of 1 GB/s
    with pytest.raises(ValueError, match="not a kernel table"):
        load_kernel_table({"x": 1}, "junk")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_has_seconds_per_codec_and_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _plan(
        capsys,
        "--ranks",
        "4",
        "--rate",
        "100mbit",
        "--size-mib",
        "64",
        "--codecs",
        "dynamiq,mxfp8_e4m3",
        "--schedules",
        "ring",
        "--json",
    )
    assert rc == 0
    data = json.loads(out)
    got = {(r["codec"], r["schedule"]): r for r in data["results"]}
    assert set(got) == {("dynamiq", "ring"), ("mxfp8_e4m3", "ring")}
    for r in got.values():
        assert r["seconds"] > 0
        assert {"encode", "reduce", "decode", "wait"} <= set(r["phases"])
        assert len(r["rounds"]) == 6
    # never under the link's own time for the bytes a rank sends
    link = data["parameters"]["link"]
    for r in got.values():
        floor = 8 * r["bytes_sent_per_rank"] / (link["rate_bps"] * link["efficiency"])
        assert r["seconds"] >= floor
    assert got[("mxfp8_e4m3", "ring")]["bits_per_value"] == pytest.approx(8.25, rel=1e-3)
    assert data["parameters"]["link"]["rate_bps"] == 1e8


def test_cli_text_and_break_even(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _plan(
        capsys,
        "--profile",
        "ib400",
        "--ranks",
        "2",
        "--size-mib",
        "1",
        "--codecs",
        "mxfp4",
        "--schedules",
        "ring",
        "--sub-chunk",
        "1048576",
        "--break-even",
        "--json",
    )
    assert rc == 0
    rows = json.loads(out)["break_even"]
    assert {(r["device"], r["link"]) for r in rows} == {
        (d, lk) for d in ("h100", "h200") for lk in ("ib100", "ib400", "nvlink4")
    }
    for r in rows:
        assert r["speedup_vs_bf16"] > 0
        assert r["beats_bf16_from_mib"] is None or r["beats_bf16_from_mib"] >= 1
    # the same codec on a slower link gains more from its fewer bytes
    by = {(r["device"], r["link"]): r["speedup_vs_bf16"] for r in rows}
    assert by[("h200", "ib100")] > by[("h200", "ib400")] > by[("h200", "nvlink4")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "1"], "--ranks must be >= 2"),
        (["--rate", "fast"], "--rate"),
        (["--codecs", "nope"], "nope"),
        (["--schedules", "spiral"], "spiral"),
        (["--efficiency", "1.5"], "--efficiency"),
        (["--size-mib", "0"], "size must be positive"),
        (["--ranks-per-node", "8"], "ranks per node"),
        (["--kernel-table", "/nonexistent.json"], "no such file"),
        (["--mem-bw", "-1"], "memory bandwidth"),
    ],
)
def test_cli_rejects_bad_arguments(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc, out, err = _plan(capsys, *args)
    assert rc == 2
    assert message in err
    assert out == ""


def test_calibrate_needs_something_to_measure(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _plan(capsys, "calibrate")
    assert rc == 2 and "--kernels, --network and/or --host" in err


def test_hierarchical_nodes_are_the_clusters(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _plan(
        capsys,
        "--profile",
        "ib100",
        "--ranks",
        "8",
        "--ranks-per-node",
        "4",
        "--size-mib",
        "1",
        "--codecs",
        "bf16",
        "--schedules",
        "ring,hierarchical",
        "--json",
    )
    assert rc == 0
    data = json.loads(out)
    assert [r["schedule"] for r in data["results"]] == ["ring", "hierarchical(g=4)"]
    assert data["parameters"]["intra_link"]["rate_bps"] == 3600e9


@pytest.mark.distributed
def test_the_link_worker_runs_the_butterfly_with_receives_posted_ahead() -> None:
    # four local ranks on loopback run the engine's butterfly pattern both ways (receives
    # posted a round ahead, and not); the summary's curve holds each buffer's point
    import statistics
    import tempfile

    from dynamiq.plan.calibrate import (
        _free_port,
        _Loopback,
        _run_ranks,
        butterfly_efficiency,
        butterfly_pattern_name,
        link_patterns,
    )

    sizes = [1 << 16, 1 << 18]
    pats = link_patterns(4, 1 << 16, 1 << 14, sizes)
    names = [butterfly_pattern_name(b) for b in sizes]
    spec = {
        "pingpong_iters": 2,
        "pingpong_bytes": 8,
        "repeats": 2,
        "patterns": {n: pats[n] for n in names} | {"plain": pats[names[0]]},
        "ahead": names,
        "repeats_of": {names[1]: 3},
        "timeout": 120,
    }
    with _Loopback(4) as cl, tempfile.TemporaryDirectory() as tmp:
        per_rank = _run_ranks(cl, spec, tmp, port=_free_port())
    for name, reps in [(names[0], 2), (names[1], 3), ("plain", 2)]:
        assert all(len(pr["patterns"][name]["seconds"]) == reps for pr in per_rank)

    def slowest(name: str) -> float:
        reps = len(per_rank[0]["patterns"][name]["seconds"])
        return statistics.median(
            max(pr["patterns"][name]["seconds"][i] for pr in per_rank) for i in range(reps)
        )

    curve = butterfly_efficiency(per_rank, spec, 1e12, slowest)
    # 4 ranks: three rounds of half the buffer each way
    assert [b for b, _ in curve] == [s / 2 for s in sizes]
    assert all(0 < e <= 1 for _, e in curve)


def test_the_text_report_shows_the_emulated_links_exchange_curve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the shipped emulated table has the butterfly curve: the report says what it uses
    args = ["--ranks", "4", "--rate", "1gbit", "--size-mib", "4", "--codecs", "int8"]
    rc, out, _ = _plan(capsys, *args, "--schedules", "butterfly")
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("exchange rounds' efficiency"))
    assert line.count("MiB") == 4
    rc, out, _ = _plan(capsys, *args, "--schedules", "butterfly", "--json")
    curve = json.loads(out)["parameters"]["link"]["exchange_curve"]
    assert [round(b) for b, _ in curve] == [2**20, 2**22, 2**24, 2**25]
