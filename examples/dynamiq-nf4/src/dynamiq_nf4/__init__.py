"""dynamiq-nf4: the NF4 (4-bit NormalFloat) number format as a dynamiq codec plugin.

Installing this package is all it takes: its ``pyproject.toml`` declares the entry point
``nf4 = "dynamiq_nf4:NF4Codec"`` in the group ``dynamiq.codecs``, and
``dynamiq.codecs.get_codec("nf4")`` loads it on first use. Nothing registers at import time.
"""

from .codec import NF4_LEVELS, NF4_OFFSET, NF4Codec, nf4_levels

__all__ = ["NF4_LEVELS", "NF4_OFFSET", "NF4Codec", "nf4_levels"]
