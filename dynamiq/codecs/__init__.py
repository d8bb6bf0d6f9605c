"""Codecs: number formats for gradients, each with a certified error bound.

``get_codec("mxfp8_e4m3")``, ``list_codecs()``, ``register_codec(cls)``; see docs/design.md,
"The codec contract".
"""

from .base import Codec, ErrorBound, HopContext
from .blockfmt import BlockCodec
from .dynamiq_codec import DynamiqCodec
from .formats import ElementFormat, get_format
from .intq import IntCodec
from .mx import MXCodec
from .omnireduce import OmniReduceCodec
from .passthrough import PassThroughCodec
from .registry import (
    ENTRY_POINT_GROUP,
    UnknownCodecError,
    get_codec,
    list_codecs,
    register_codec,
)
from .thc import ThcCodec

__all__ = [
    "ENTRY_POINT_GROUP",
    "BlockCodec",
    "Codec",
    "DynamiqCodec",
    "ElementFormat",
    "ErrorBound",
    "HopContext",
    "IntCodec",
    "MXCodec",
    "OmniReduceCodec",
    "PassThroughCodec",
    "ThcCodec",
    "UnknownCodecError",
    "get_codec",
    "get_format",
    "list_codecs",
    "register_codec",
]
