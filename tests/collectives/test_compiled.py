"""Collectives inside ``torch.compile``.

:func:`allreduce` is one op of the graph (``dynamiq::allreduce_``, :mod:`dynamiq.collectives.
traced`), so a step that calls it compiles whole (``fullgraph=True``) and gives the eager
result, bit for bit, on every rank; so are :func:`reduce_scatter` and :func:`all_gather` for a
size that is static while dynamo traces. :func:`simulate_allreduce` is host-driven (byte
buffers, ``.item()``, clocks, threads) and returns what a graph cannot (per-rank results), so
it is a graph break: dynamo compiles the code around it and runs it eagerly, with dynamo off
inside (``dynamiq.collectives.api._eager``); the result is the eager one, bit for bit
(docs/design.md, "Kernels")."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

import dynamiq.kernels  # noqa: F401 (registers the ops)
from dynamiq.collectives import allreduce, simulate_allreduce
from dynamiq.testing.distributed import run_gloo

OPS = {
    torch.ops.dynamiq.encode.default,
    torch.ops.dynamiq.decode.default,
    torch.ops.dynamiq.reduce.default,
}


@pytest.mark.parametrize("codec", ["int8", "dynamiq"])
def test_a_compiled_function_running_the_collective_gives_the_eager_sum(codec: str) -> None:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4096 + 96, generator=g) * (1 + r) for r in range(3)]

    def step(*xs: torch.Tensor) -> list[torch.Tensor]:
        scaled = [x * 2.0 for x in xs]  # compiled
        res = simulate_allreduce(scaled, codec=codec, schedule="ring")  # eager
        return [o + 1.0 for o in res.outputs]  # compiled

    want = step(*xs)
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        seen.append({node.target for node in gm.graph.nodes})
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(step, backend=backend)(*xs)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    assert seen and operator.mul in seen[0]  # the code before the collective: compiled
    assert not OPS & set().union(*seen)  # the collective's own codec calls ran eagerly
    with pytest.raises(Exception, match="host-driven"):  # no whole graph: a graph break
        torch._dynamo.reset()
        torch.compile(step, backend=backend, fullgraph=True)(*xs)


# -- allreduce: one op of the graph -------------------------------------------------------------

ALLREDUCE = torch.ops.dynamiq.allreduce_.default


def _step(x: torch.Tensor, residual: torch.Tensor, codec: str, schedule: str) -> torch.Tensor:
    y = x * 2.0  # compiled
    allreduce(y, codec, schedule, seed=5, step=3, residual=residual, threshold=0)
    return y + 1.0  # compiled


def _compiled_job(rank: int, world: int, backend: str) -> list[Any]:
    from torch._dynamo.backends.registry import lookup_backend

    out = []
    for codec, schedule in (("int8", "ring"), ("dynamiq", "butterfly"), ("mxfp8_e4m3", "ring")):
        g = torch.Generator().manual_seed(100 * rank + len(out))
        x = torch.randn(5000, generator=g) * (1 + rank)
        r_eager, r_compiled = torch.full((5000,), 0.25), torch.full((5000,), 0.25)
        want = _step(x, r_eager, codec, schedule)
        targets: set[Any] = set()

        def record(gm: torch.fx.GraphModule, inputs: Any, targets: set[Any] = targets) -> Any:
            targets.update(node.target for node in gm.graph.nodes)
            return lookup_backend(backend)(gm, inputs)

        torch._dynamo.reset()
        fn = torch.compile(_step, backend=record, fullgraph=True)
        got = fn(x, r_compiled, codec, schedule)
        out.append(
            {
                "codec": codec,
                "same_sum": torch.equal(want, got),
                "same_residual": torch.equal(r_eager, r_compiled),
                "residual_moved": not torch.equal(r_eager, torch.full((5000,), 0.25)),
                "op_in_graph": ALLREDUCE in targets,
                "sum": got,
            }
        )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_allreduce_compiles_into_the_graph_and_sums_as_eager(backend: str) -> None:
    """Two gloo ranks; the graph holds the op (``fullgraph=True`` compiles), the sum and the
    error-feedback residual are the eager ones bit for bit, the ranks agree (inductor: the
    functionalized op in C++ code, ~5 s with a cold cache)."""
    results = run_gloo(_compiled_job, 2, backend, timeout=900)
    assert all(s == "ok" for s, _ in results), results
    for _, rows in results:
        for row in rows:
            assert row["op_in_graph"], row["codec"]
            assert row["same_sum"] and row["same_residual"], row["codec"]
            assert row["residual_moved"], row["codec"]  # error feedback ran
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a["sum"], b["sum"]), a["codec"]


def _sizes_job(rank: int, world: int) -> tuple[list[bool], int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(_step, backend="aot_eager", fullgraph=True)
    same = []
    for n in (5000, 3000, 7000, 3000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank + n))
        r_eager, r_compiled = torch.zeros(n), torch.zeros(n)
        got = fn(x, r_compiled, "int8", "ring")
        same.append(torch.equal(got, _step(x, r_eager, "int8", "ring")))
        same.append(torch.equal(r_eager, r_compiled))
    return same, int(counters["stats"]["unique_graphs"])


@pytest.mark.distributed
def test_allreduce_compiled_with_dynamic_shapes() -> None:
    """A second size recompiles with a symbolic size (dynamo's automatic dynamic shapes):
    the call key holds no size, so that graph serves every later size, with eager bytes."""
    results = run_gloo(_sizes_job, 2, timeout=600)
    assert all(s == "ok" for s, _ in results), results
    for _, (same, graphs) in results:
        assert all(same), same
        assert graphs == 2  # the static first graph, then one dynamic graph for the rest


def test_a_bad_traced_allreduce_raises_while_compiling() -> None:
    """What cannot run raises when dynamo traces the call, naming the problem: an async call,
    and a call with no process group (the same message as an eager call's)."""

    def async_call(x: torch.Tensor) -> torch.Tensor:
        allreduce(x, "int8", async_op=True)
        return x

    def no_group(x: torch.Tensor) -> torch.Tensor:
        allreduce(x, "int8")
        return x

    for fn, match in (
        (async_call, r"async_op=True\) cannot run inside torch.compile"),
        (no_group, "torch.distributed is not initialized"),
    ):
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match=match):
            torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(8))


def test_a_graph_from_elsewhere_names_its_unknown_call() -> None:
    with pytest.raises(RuntimeError, match="never traced"):
        ALLREDUCE(torch.ones(4), None, "allreduce#-1")


# -- reduce_scatter and all_gather: ops of the graph for a static size ---------------------------

HALVES = {torch.ops.dynamiq.reduce_scatter_.default, torch.ops.dynamiq.all_gather_.default}


def _halves_step(
    x: torch.Tensor, residual: torch.Tensor, codec: str, schedule: str
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    from dynamiq.collectives import all_gather, reduce_scatter

    y = x * 2.0  # compiled
    shard = reduce_scatter(y, codec, schedule, seed=5, residual=residual, threshold=0)
    full, _ = all_gather(shard, codec, schedule, seed=5, threshold=0)
    return shard.values + 1.0, full * 0.5, shard.ranges  # compiled


def _halves_job(rank: int, world: int, dynamic: bool, backend: str) -> list[Any]:
    from torch._dynamo.backends.registry import lookup_backend

    out = []
    fn = None
    for codec, schedule, n in (("int8", "ring", 5000), ("dynamiq", "butterfly", 6000)):
        for size in (n, n + 512) if dynamic else (n,):
            g = torch.Generator().manual_seed(10 * rank + size)
            x = torch.randn(size, generator=g) * (1 + rank)
            r_eager, r_compiled = torch.zeros(size), torch.zeros(size)
            want = _halves_step(x, r_eager, codec, schedule)
            targets: set[Any] = set()

            def record(gm: torch.fx.GraphModule, inputs: Any, targets: set[Any] = targets) -> Any:
                targets.update(node.target for node in gm.graph.nodes)
                return lookup_backend(backend)(gm, inputs)

            if fn is None or not dynamic:
                torch._dynamo.reset()
                # a static size: one graph, the halves in it; automatic dynamic shapes: the
                # second size is symbolic and the halves break the graph (still eager bytes)
                fn = torch.compile(
                    _halves_step, backend=record, fullgraph=not dynamic, dynamic=None
                )
            got = fn(x, r_compiled, codec, schedule)
            out.append(
                {
                    "codec": codec,
                    "size": size,
                    "same": all(torch.equal(a, b) for a, b in zip(want[:2], got[:2], strict=True)),
                    "same_ranges": list(map(tuple, got[2])) == list(map(tuple, want[2])),
                    "same_residual": torch.equal(r_eager, r_compiled),
                    "residual_moved": bool(r_eager.abs().sum() > 0),
                    "ops_in_graph": targets >= HALVES,
                    "full": got[1],
                }
            )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("dynamic", "backend"), [(False, "eager"), (False, "inductor"), (True, "aot_eager")]
)
def test_reduce_scatter_and_all_gather_compile_into_the_graph(dynamic: bool, backend: str) -> None:
    """Two gloo ranks: ``reduce_scatter`` then ``all_gather`` in one ``fullgraph`` graph,
    their shards, ranges, gathered sums and residuals the eager ones bit for bit; with a
    second, symbolic size the same results through graph breaks."""
    results = run_gloo(_halves_job, 2, dynamic, backend, timeout=900)
    assert all(s == "ok" for s, _ in results), results
    for _, rows in results:
        for row in rows:
            assert row["same"] and row["same_ranges"] and row["same_residual"], row
            assert row["residual_moved"], row["codec"]
            if not dynamic:
                assert row["ops_in_graph"], row["codec"]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a["full"], b["full"]), a["codec"]


def test_a_bad_traced_half_raises_while_compiling() -> None:
    """The halves' configuration is checked while dynamo traces them: an async call, a
    shard whose ranges are not this rank's, a call with no process group; and a graph from
    another process names its unknown call."""
    from dynamiq.collectives import Shard, all_gather, reduce_scatter
    from dynamiq.collectives.transport import LocalCluster

    tr = LocalCluster(2).transport(0)

    def async_call(x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(x, "int8", transport=tr, async_op=True).values  # type: ignore[union-attr]

    def wrong_ranges(x: torch.Tensor) -> torch.Tensor:
        return all_gather(Shard(x[:10], [(0, 10)], 4096), "int8", transport=tr)[0]  # type: ignore[index]

    def no_group(x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(x, "int8").values  # type: ignore[union-attr]

    for fn, match in (
        (async_call, r"reduce_scatter\(async_op=True\) cannot run inside torch.compile"),
        (wrong_ranges, r"shard ranges \[\(0, 10\)\] are not the ranges rank 0 owns"),
        (no_group, "torch.distributed is not initialized"),
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=match):
            torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(4096))
    with pytest.raises(RuntimeError, match="never traced"):
        torch.ops.dynamiq.all_gather_.default(torch.ones(4), torch.ones(8), "all_gather#-1")
