"""``DynamiqState`` without torch.distributed gives dynamiq's error, not torch's."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dynamiq.ddp import DynamiqState


def test_state_without_a_process_group_says_what_to_do() -> None:
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError, match=r"DynamiqState needs an initialised.*init_process_group"
    ):
        DynamiqState(codec="int8")
