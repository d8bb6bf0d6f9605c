"""DynamiqState.load_state_dict refuses checkpoints that do not fit (dynamiq/ddp.py)."""

import pytest
import torch

from dynamiq.testing.distributed import run_gloo

pytestmark = pytest.mark.distributed


def _attempt(state, sd: dict) -> str:  # type: ignore[no-untyped-def]
    try:
        state.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _job(rank: int, world: int) -> dict:
    from dynamiq.ddp import DynamiqState

    src = DynamiqState(codec="int8", error_feedback=True)
    src.residuals = {0: torch.randn(100), 1: torch.randn(7)}
    src.iter = 5
    good = src.state_dict()
    assert good["world_size"] == world and good["rank"] == rank
    out = {}
    fresh = DynamiqState(codec="int8", error_feedback=True)
    out["good"] = _attempt(fresh, good)
    out["restored"] = fresh.iter == 5 and all(
        torch.equal(fresh.residuals[k], v) for k, v in good["residuals"].items()
    )
    # another rank's checkpoint (as every rank loads its own file)
    out["rank"] = _attempt(fresh, {**good, "rank": (rank + 1) % world})
    out["world_size"] = _attempt(fresh, {**good, "world_size": world + 2})
    out["codec"] = _attempt(fresh, {**good, "codec": {"id": "int", "bits": 4}})
    for name, bad in {
        "dtype": good["residuals"][0].to(torch.bfloat16),
        "shape": good["residuals"][0].view(10, 10),
        "nan": torch.where(torch.arange(100) == 3, torch.nan, good["residuals"][0]),
        "inf": torch.where(torch.arange(100) == 3, torch.inf, good["residuals"][0]),
    }.items():
        out[name] = _attempt(fresh, {**good, "residuals": {**good["residuals"], 0: bad}})
    out["layout_inside"] = _attempt(fresh, {**good, "buckets": {0: 100, 1: 8}})
    out["layout_keys"] = _attempt(fresh, {**good, "buckets": {0: 100}})
    # a state that has run with another bucket layout (another model or bucket_cap_mb)
    other = DynamiqState(codec="int8", error_feedback=True)
    other.residuals = {0: torch.zeros(64), 1: torch.zeros(43)}
    out["layout_here"] = _attempt(other, good)
    out["untouched"] = other.residuals[0].numel() == 64 and fresh.iter == 5
    out["not_a_checkpoint"] = _attempt(fresh, {"residuals": {}})
    out["iter"] = _attempt(fresh, {**good, "iter": -1})
    for s in (src, fresh, other):
        s.close()
    return out


def test_load_state_dict_checks_every_field() -> None:
    results = run_gloo(_job, 2, timeout=120)
    assert all(s == "ok" for s, _ in results), results
    for rank, (_, out) in enumerate(results):
        assert out["good"] == "accepted" and out["restored"] and out["untouched"]
        assert f"rank {(rank + 1) % 2}, this state has {rank}" in out["rank"]
        assert "world_size 4, this state has 2" in out["world_size"]
        assert "codec" in out["codec"]
        assert "bucket 0 must be a 1-D float32 tensor (got torch.bfloat16 (100,))" in out["dtype"]
        assert "1-D float32 tensor (got torch.float32 (10, 10))" in out["shape"]
        assert "bucket 0 has 1 non-finite values" in out["nan"]
        assert "bucket 0 has 1 non-finite values" in out["inf"]
        assert "bucket 1 has 7 values, its bucket layout says 8" in out["layout_inside"]
        assert "lists buckets [0], its residuals [0, 1]" in out["layout_keys"]
        assert (
            "layout {0: 100, 1: 7} differs from this state's {0: 64, 1: 43}" in out["layout_here"]
        )
        assert "needs 'iter', 'codec' and 'residuals'" in out["not_a_checkpoint"]
        assert "iter must be an int >= 0" in out["iter"]
