"""Testing tools for codec authors: Hypothesis strategies, the conformance kit and the
checks inside the engine (docs/testing.md documents every name).

Needs the ``test`` extra (``pip install dynamiq-allreduce[test]``): Hypothesis. Importing it
loads no Hypothesis profile: the caller's settings stay in force
(:mod:`dynamiq.testing.profiles`).

>>> from dynamiq.testing import run_conformance
>>> run_conformance("int4")  # doctest: +SKIP
"""

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dynamiq.testing needs Hypothesis: pip install 'dynamiq-allreduce[test]'"
    ) from exc

from .allreduce import check_allreduce_bound, check_block_locality, exact_sum
from .conformance import (
    check_bad_input,
    check_bound_edges,
    check_bound_sound,
    check_bound_tight,
    check_config,
    check_encoded_nbytes,
    check_nonfinite,
    check_reduce,
    check_roundtrip,
    check_unbiased,
    run_conformance,
)
from .golden import check_golden, write_golden
from .profiles import load_profile
from .strategies import (
    codec_configs,
    codec_inputs,
    edge_battery,
    edge_tensors,
    finite_tensors,
    hop_contexts,
    schedules,
    tensor_lists,
)

__all__ = [
    "check_allreduce_bound",
    "check_bad_input",
    "check_block_locality",
    "check_bound_edges",
    "check_bound_sound",
    "check_bound_tight",
    "check_config",
    "check_encoded_nbytes",
    "check_golden",
    "check_nonfinite",
    "check_reduce",
    "check_roundtrip",
    "check_unbiased",
    "codec_configs",
    "codec_inputs",
    "edge_battery",
    "edge_tensors",
    "exact_sum",
    "finite_tensors",
    "hop_contexts",
    "load_profile",
    "run_conformance",
    "schedules",
    "tensor_lists",
    "write_golden",
]
