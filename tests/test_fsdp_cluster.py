"""``dynamiq bench cluster --collective reduce_scatter``: the rows FSDP2's reduce-scatter
gives, between network namespaces, equal to the in-process engine's bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from dynamiq.bench._cluster_worker import rank_buffer
from dynamiq.bench.cluster import ClusterBenchConfig, run_workers
from dynamiq.bench.netns import EmulatedCluster, NamespaceUnavailable, check_available
from dynamiq.collectives import reduce_scatter
from dynamiq.collectives.transport import LocalCluster, run_threads

try:
    check_available()
    _REASON = ""
except NamespaceUnavailable as exc:
    _REASON = f"network namespaces are not available here: {exc}"

NUMEL = 2 * 30_001  # S = 30001: not a multiple of any block size


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"schedules": ("tree",)}, "schedule 'tree'"),
        ({"numel": 1001}, "not a multiple of ranks"),
        ({"collective": "allgather"}, "collective must be"),
    ],
)
def test_bad_reduce_scatter_configs_are_named(kw: dict, match: str) -> None:
    args = {"ranks": 2, "numel": 1000, "collective": "reduce_scatter", **kw}
    with pytest.raises(ValueError, match=match):
        ClusterBenchConfig(**args)  # type: ignore[arg-type]


@pytest.mark.skipif(bool(_REASON), reason=_REASON or "available")
@pytest.mark.distributed
def test_reduce_scatter_rows_between_namespaces_match_the_engine(tmp_path: str) -> None:
    methods = [
        {"kind": "dynamiq", "codec": "int8", "schedule": "ring", "label": "int8-ring"},
        {"kind": "torch", "dtype": "fp32", "label": "torch-fp32"},
    ]
    spec = {"methods": methods, "numel": NUMEL, "data": "randn", "seed": 4, "progress": False}
    spec.update(save_outputs=str(tmp_path), sub_chunk=1 << 14, collective="reduce_scatter")
    with EmulatedCluster(2, rate="400mbit") as cl:
        per_rank = run_workers(cl, spec, str(tmp_path))
    inputs = [rank_buffer("randn", r, 2, NUMEL, 4) for r in range(2)]
    s = NUMEL // 2
    local = LocalCluster(2)
    want = run_threads(
        2,
        lambda r: reduce_scatter(
            inputs[r],
            "int8",
            "ring",
            transport=local.transport(r),
            sub_chunk=1 << 14,
            chunk_bounds=[(0, s), (s, NUMEL)],
        ),
    )
    exact = (inputs[0].double() + inputs[1].double()).float()  # one rounding: what gloo gives
    for r in range(2):
        ours = torch.load(os.path.join(tmp_path, f"int8-ring-{r}.pt"))
        assert torch.equal(ours, want[r].values)
        theirs = torch.load(os.path.join(tmp_path, f"torch-fp32-{r}.pt"))
        assert torch.equal(theirs, exact[r * s : (r + 1) * s])
        (stats,) = per_rank[r]["results"][0]["stats"]
        assert stats["bytes_sent"] == want[r].stats.bytes_sent
