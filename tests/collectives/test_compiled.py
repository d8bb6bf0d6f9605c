"""A collective inside ``torch.compile``: the engine is host-driven (byte buffers, ``.item()``,
clocks, threads), so the public collectives are a graph break: dynamo compiles the code around
them and runs them eagerly, with dynamo off inside (``dynamiq.collectives.api._eager``); the
result is the eager one, bit for bit (docs/design.md, "Kernels")."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

import dynamiq.kernels  # noqa: F401 (registers the ops)
from dynamiq.collectives import simulate_allreduce

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
