"""Codecs: number formats for gradients, each with a certified error bound.

``get_codec("mxfp8_e4m3")``, ``list_codecs()``, ``register_codec(cls)``; see docs/design.md,
"The codec contract".
"""

from .base import Codec, ErrorBound, HopContext
from .blockfmt import BlockCodec
from .dynamiq_codec import DynamiqCodec
from .formats import ELEMENT_FORMATS, ElementFormat, get_format
from .intq import IntCodec
from .mx import MXFP4, MXFP6E2M3, MXFP6E3M2, MXFP8E4M3, MXFP8E5M2, MXINT8, MXCodec
from .omnireduce import OmniReduceCodec
from .passthrough import BF16Codec, FP16Codec, FP32Codec, PassThroughCodec
from .registry import (
    ENTRY_POINT_GROUP,
    UnknownCodecError,
    get_codec,
    list_codecs,
    register_codec,
)
from .thc import ThcCodec

__all__ = [
    "ELEMENT_FORMATS",
    "ENTRY_POINT_GROUP",
    "MXFP4",
    "MXFP6E2M3",
    "MXFP6E3M2",
    "MXFP8E4M3",
    "MXFP8E5M2",
    "MXINT8",
    "BF16Codec",
    "BlockCodec",
    "Codec",
    "DynamiqCodec",
    "ElementFormat",
    "ErrorBound",
    "FP16Codec",
    "FP32Codec",
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
