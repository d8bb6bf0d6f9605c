"""Testing tools for codec authors: Hypothesis strategies and the conformance kit.

Needs the ``test`` extra (``pip install dynamiq-allreduce[test]``): Hypothesis.

>>> from dynamiq.testing import run_conformance
>>> run_conformance("int4")  # doctest: +SKIP
"""

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dynamiq.testing needs Hypothesis: pip install 'dynamiq-allreduce[test]'"
    ) from exc

from .conformance import (
    check_bad_input,
    check_bound_sound,
    check_bound_tight,
    check_config,
    check_nonfinite,
    check_reduce,
    check_roundtrip,
    check_unbiased,
    run_conformance,
)
from .golden import check_golden, write_golden
from .strategies import codec_inputs, edge_tensors, finite_tensors, hop_contexts

__all__ = [
    "check_bad_input",
    "check_bound_sound",
    "check_bound_tight",
    "check_config",
    "check_golden",
    "check_nonfinite",
    "check_reduce",
    "check_roundtrip",
    "check_unbiased",
    "codec_inputs",
    "edge_tensors",
    "finite_tensors",
    "hop_contexts",
    "run_conformance",
    "write_golden",
]
