"""The public surface: one options object for every collective, per-round bytes counted
independently from the plan, transports with a lifecycle, the engine's overlap changes no
bytes, and what ``dynamiq.collectives`` exports."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import dynamiq.collectives as coll
from dynamiq.codecs import get_codec
from dynamiq.collectives import (
    CollectiveOptions,
    ConfigMismatchError,
    allreduce,
    get_schedule,
    reduce_scatter,
    simulate_allreduce,
)
from dynamiq.collectives.api import AllReduceHandle, AllReduceStats, Shard
from dynamiq.collectives.engine import run_schedule
from dynamiq.collectives.planning import chunk_layout, plan_schedule
from dynamiq.collectives.transport import LocalCluster, TransportClosedError, run_threads


def _xs(n: int, numel: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * (1 + r) for r in range(n)]


# -- the options object ------------------------------------------------------------------------


def test_options_and_keywords_give_the_same_run() -> None:
    xs = _xs(5, 3000)
    sr4 = {"id": "int", "bits": 4, "rounding": "stochastic"}  # the seed matters
    opts = CollectiveOptions(
        codec=sr4, schedule="butterfly", seed=3, step=2, sub_chunk=96, op="avg"
    )
    a = simulate_allreduce(xs, options=opts)
    b = simulate_allreduce(xs, sr4, "butterfly", 3, step=2, sub_chunk=96, op="avg")
    assert torch.equal(a.outputs[0], b.outputs[0]) and a.bytes_sent == b.bytes_sent
    assert a.bound is not None and torch.equal(a.bound, b.bound)
    # a keyword replaces the option's field
    c = simulate_allreduce(xs, options=opts, seed=4)
    d = simulate_allreduce(xs, options=opts.replace(seed=4))
    assert torch.equal(c.outputs[0], d.outputs[0])
    assert not torch.equal(c.outputs[0], a.outputs[0])


def test_option_defaults_are_the_functions() -> None:
    xs = _xs(3, 100)
    # simulate_allreduce: threshold 0 (a 100-value buffer is compressed), bound computed
    sim = simulate_allreduce(xs, options=CollectiveOptions(codec="int8"))
    assert "IntCodec" in sim.stats[0].codec and sim.bound is not None
    # allreduce: DEFAULT_THRESHOLD (uncompressed), no bound unless asked
    cl = LocalCluster(3)
    stats = run_threads(
        3,
        lambda r: allreduce(
            xs[r].clone(), options=CollectiveOptions(codec="int8"), transport=cl.transport(r)
        ),
    )
    assert "FP32Codec" in stats[0].codec and stats[0].bound is None


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"op": "max"}, ValueError, "op must be"),
        ({"sub_chunk": 0}, ValueError, "sub_chunk must be at least 1"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": True}, TypeError, "seed must be an int"),
        ({"threshold": -1}, ValueError, "threshold must be at least 0"),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"timeout": "5"}, TypeError, "timeout must be a number"),
        ({"schedule": "star"}, ValueError, "unknown schedule 'star'"),
        ({"schedule": 3}, TypeError, "schedule must be a name"),
        ({"codec": "nope"}, ValueError, "unknown codec 'nope'"),
        ({"return_bound": 1}, TypeError, "return_bound must be"),
        ({"schedule_options": [1]}, TypeError, "schedule_options must be a mapping"),
    ],
)
def test_bad_options_are_named(changes: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        CollectiveOptions(**changes)
    # the same check through a function's keywords
    with pytest.raises(error, match=match):
        kw = dict(changes)
        simulate_allreduce(_xs(2, 10), kw.pop("codec", "fp32"), kw.pop("schedule", "ring"), **kw)


def test_options_are_frozen_and_normalised() -> None:
    import torch.distributed as dist

    opts = CollectiveOptions(op=dist.ReduceOp.AVG, seed=torch.tensor(3).item())
    assert opts.op == "avg" and opts.seed == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument.*sede"):
        simulate_allreduce(_xs(2, 10), "fp32", sede=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="options must be a CollectiveOptions"):
        simulate_allreduce(_xs(2, 10), options={"codec": "int8"})  # type: ignore[arg-type]


def test_async_and_sync_calls_return_one_type_each() -> None:
    xs = _xs(3, 2000)
    cl = LocalCluster(3)
    sync = run_threads(
        3, lambda r: allreduce(xs[r].clone(), "int8", "ring", transport=cl.transport(r))
    )
    assert all(type(s) is AllReduceStats for s in sync)
    cl2 = LocalCluster(3)
    handles = run_threads(
        3,
        lambda r: allreduce(
            xs[r].clone(), "int8", "ring", transport=cl2.transport(r), async_op=True
        ),
    )
    assert all(isinstance(h, AllReduceHandle) for h in handles)
    stats = [h.wait(60) for h in handles]
    assert [s.bytes_sent for s in stats] == [s.bytes_sent for s in sync]
    cl3 = LocalCluster(3)
    shards = run_threads(
        3, lambda r: reduce_scatter(xs[r], "int8", "ring", transport=cl3.transport(r))
    )
    assert all(type(s) is Shard for s in shards)


def test_reduce_scatter_bound_holds_on_its_shard() -> None:
    xs = _xs(4, 3000, seed=5)
    exact = torch.stack([x.double() for x in xs]).sum(0) / 4
    cl = LocalCluster(4)
    shards = run_threads(
        4,
        lambda r: reduce_scatter(
            xs[r], "mxfp4", "ring", transport=cl.transport(r), return_bound=True, op="avg"
        ),
    )
    for s in shards:
        assert s.stats is not None and s.stats.bound is not None
        want = torch.cat([exact[a:b] for a, b in s.ranges])
        assert s.stats.bound.shape == s.values.shape
        err = (s.values.double() - want).abs()
        assert bool((err <= s.stats.bound).all())
        assert float(err.max()) > 0  # mxfp4 is lossy: the check is not vacuous


# -- bytes per round ---------------------------------------------------------------------------


def _planned_round_bytes(
    codec_name: str, schedule_name: str, n: int, numel: int, sub: int, **opts: object
) -> list[list[int]]:
    """Bytes each rank sends in each round, from the plan and ``encoded_nbytes`` alone."""
    codec = get_codec(codec_name)
    sched = get_schedule(schedule_name, n, **opts)
    plan = plan_schedule(sched, codec)
    _, pieces = chunk_layout(numel, sched, codec, sub)
    out = []
    for r in range(n):
        per_round = []
        for rnd in plan[r]:
            total = 0
            for op in rnd.sends:
                for a, b in pieces[op.chunk]:
                    size = op.codec.encoded_nbytes(b - a, op.ctx)
                    assert size is not None
                    total += size
            per_round.append(total)
        out.append(per_round)
    return out


@pytest.mark.parametrize(
    ("codec", "schedule", "n", "opts"),
    [
        ("int8", "ring", 4, {}),
        ("mxfp8_e4m3", "butterfly", 6, {}),  # fold rounds: ranks that send nothing
        ("mxfp4", "tree", 5, {}),
        ("mxfp6_e2m3", "hierarchical", 6, {"ranks_per_node": 3, "intra_codec": "fp32"}),
    ],
)
def test_round_bytes_match_the_plan(codec: str, schedule: str, n: int, opts: dict) -> None:
    numel, sub = 5000, 256
    expected = _planned_round_bytes(codec, schedule, n, numel, sub, **opts)
    res = simulate_allreduce(
        _xs(n, numel), codec, schedule, sub_chunk=sub, schedule_options=opts or None
    )
    for r, st in enumerate(res.stats):
        assert st.round_bytes == expected[r]
        assert sum(st.round_bytes) == st.bytes_sent
        assert st.max_round_bytes == max(expected[r])
        assert st.mean_round_bytes == pytest.approx(sum(expected[r]) / len(expected[r]))
    cells = [b for per_rank in expected for b in per_rank]
    assert res.max_round_bytes == max(cells)
    assert res.mean_round_bytes == pytest.approx(sum(cells) / len(cells))


def test_round_bytes_count_length_headers_but_not_the_prologue() -> None:
    # omnireduce: data-dependent sizes (an 8-byte length before each payload), no exchange
    xs = _xs(4, 4096, seed=2)
    for x in xs:
        x[1000:3000] = 0.0
    res = simulate_allreduce(xs, "omnireduce", "ring", sub_chunk=512)
    plain = simulate_allreduce(xs, "fp32", "ring", sub_chunk=512)
    # every rank's zero blocks are the same, so a piece's payload is as long as the codec's
    # encoding of rank 0's values there, whatever partial sum it carries
    codec = get_codec("omnireduce")
    sched = get_schedule("ring", 4)
    plan = plan_schedule(sched, codec)
    _, pieces = chunk_layout(4096, sched, codec, 512)
    for r, st in enumerate(res.stats):
        expected = [
            sum(
                8 + codec.encode(xs[0][a:b], dataclasses.replace(op.ctx, offset=a)).numel()
                for op in rnd.sends
                for a, b in pieces[op.chunk]
            )
            for rnd in plan[r]
        ]
        assert st.round_bytes == expected and sum(expected) == st.bytes_sent
    assert res.mean_round_bytes < 0.7 * plain.mean_round_bytes  # zero blocks are skipped
    # thc: fixed sizes, and a prologue that all-gathers its scales (not in any round)
    thc = simulate_allreduce(xs, "thc", "ring")
    expected = _planned_round_bytes("thc", "ring", 4, 4096, 1 << 18)
    for r, st in enumerate(thc.stats):
        assert st.round_bytes == expected[r]
        assert st.bytes_sent - sum(st.round_bytes) > 0


# -- the engine: overlap changes nothing on the wire --------------------------------------------


class _Recorder:
    """A transport that records what it sends (peer, dtype, bytes) in order."""

    def __init__(self, inner: object, log: list) -> None:
        self.inner, self.log = inner, log
        self.rank, self.world_size = inner.rank, inner.world_size  # type: ignore[attr-defined]

    def isend(self, t: torch.Tensor, dst: int) -> object:
        self.log.append((dst, str(t.dtype), bytes(t.reshape(-1).view(torch.uint8).numpy())))
        return self.inner.isend(t, dst)  # type: ignore[attr-defined]

    def irecv(self, t: torch.Tensor, src: int) -> object:
        return self.inner.irecv(t, src)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("codec", ["int8", "omnireduce"])
@pytest.mark.parametrize("schedule", ["ring", "butterfly"])
def test_overlapped_and_lockstep_rounds_send_the_same_bytes(codec: str, schedule: str) -> None:
    n, numel = 5, 3000
    xs = _xs(n, numel, seed=9)
    sched = get_schedule(schedule, n)
    c = get_codec(codec)
    runs = {}
    for overlap in (True, False):
        cl = LocalCluster(n)
        logs: list[list] = [[] for _ in range(n)]
        residuals = [torch.zeros(numel) for _ in range(n)]
        results = run_threads(
            n,
            lambda r, cl=cl, logs=logs, residuals=residuals, overlap=overlap: run_schedule(
                _Recorder(cl.transport(r), logs[r]),  # type: ignore[arg-type]
                xs[r],
                c,
                sched,
                sub_chunk=256,
                return_bound=True,
                residual=residuals[r],
                overlap=overlap,
            ),
        )
        runs[overlap] = (logs, results, residuals)
    (la, ra, ea), (lb, rb, eb) = runs[True], runs[False]
    assert la == lb
    for x, y in zip(ra, rb, strict=True):
        assert torch.equal(x.output, y.output) and torch.equal(x.bound, y.bound)
        assert x.round_bytes == y.round_bytes
    assert all(torch.equal(x, y) for x, y in zip(ea, eb, strict=True))


def test_run_schedule_takes_a_config_or_keywords_not_both() -> None:
    from dynamiq.collectives.engine import RunConfig

    cl = LocalCluster(1)
    with pytest.raises(TypeError, match="config or keywords"):
        run_schedule(
            cl.transport(0), torch.ones(4), get_codec("fp32"), get_schedule("ring", 1),
            RunConfig(), seed=1,
        )  # fmt: skip
    with pytest.raises(TypeError, match="unexpected keyword"):
        run_schedule(
            cl.transport(0), torch.ones(4), get_codec("fp32"), get_schedule("ring", 1), sed=1
        )


# -- transports: close, the agreement cache ----------------------------------------------------


def test_a_closed_transport_refuses_transfers() -> None:
    cl = LocalCluster(2)
    t0, t1 = cl.transport(0), cl.transport(1)
    t0.close()
    t0.close()  # idempotent
    with pytest.raises(TransportClosedError, match="rank 0: isend on a closed transport"):
        t0.isend(torch.ones(3), 1)
    with pytest.raises(TransportClosedError, match="irecv"):
        t0.irecv(torch.ones(3), 1)
    with pytest.raises(TransportClosedError):
        allreduce(torch.ones(5000), "int8", transport=t0)
    t1.isend(torch.ones(1), 0)  # the other rank's transport is still open


class _Plain:
    """A custom transport: no ``tag``, no sequencer (its collectives run one at a time)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size  # type: ignore[attr-defined]

    def isend(self, t: torch.Tensor, dst: int) -> object:
        return self.inner.isend(t, dst)  # type: ignore[attr-defined]

    def irecv(self, t: torch.Tensor, src: int) -> object:
        return self.inner.irecv(t, src)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


def test_a_persistent_transport_checks_the_configuration_at_every_call() -> None:
    cl = LocalCluster(3)
    trs = [_Plain(cl.transport(r)) for r in range(3)]
    xs = _xs(3, 3000)

    def calls(r: int) -> list[object]:
        out: list[object] = []
        for codec in ("int8", "int8", "mxfp4" if r == 1 else "int8", "int8"):
            try:
                st = allreduce(xs[r].clone(), codec, transport=trs[r], timeout=10)  # type: ignore[arg-type]
                out.append(st.control_bytes_sent)
            except ConfigMismatchError as exc:
                out.append(str(exc))
        return out

    for sent in run_threads(3, calls):
        assert sent[0] == sent[1] == sent[3] == 64 * 2  # ceil(log2 3) rounds of 64 bytes
        assert isinstance(sent[2], str) and "codec" in sent[2] and "rank 1" in sent[2]


# -- what the package exports ------------------------------------------------------------------


def test_public_names() -> None:
    assert len(coll.__all__) <= 15
    for name in coll.__all__:
        assert getattr(coll, name) is not None
    moved = {
        "dynamiq.collectives.engine": ["run_schedule", "ScheduleRun", "WIRE_VERSION"],
        "dynamiq.collectives.planning": ["plan_schedule", "chunk_layout"],
        "dynamiq.collectives.schedules": [
            "Step", "ScheduleError", "ring", "butterfly", "tree", "hierarchical"
        ],
        "dynamiq.collectives.transport": [
            "LocalCluster", "LocalTransport", "TorchDistTransport", "Transport"
        ],
        "dynamiq.collectives.handshake": ["PrologueComm", "run_prologue", "Communicator"],
        "dynamiq.collectives.bounds": ["encoding_bound", "addition_bound", "fp32_add_slack"],
    }  # fmt: skip
    for module, names in moved.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), (module, name)
