"""dynamiq: partial-sum-aware compressed gradient all-reduce for PyTorch.

>>> import dynamiq
>>> dynamiq.get_codec("mxfp4").bits_per_value()
4.25
"""

from .codecs import (
    Codec,
    ErrorBound,
    HopContext,
    UnknownCodecError,
    get_codec,
    list_codecs,
    register_codec,
)

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "ErrorBound",
    "HopContext",
    "UnknownCodecError",
    "__version__",
    "get_codec",
    "list_codecs",
    "register_codec",
]
