"""Kernels a codec declares (docs/design.md, "Kernels"): a codec class names its kernel
family in ``kernel_family`` (``"block"``: :mod:`dynamiq.kernels.block` and the native
``dq_blk_run``), resolved at the first dispatch, never at import. A subclass inherits the
declaration unless it overrides the reference (:class:`~dynamiq.codecs.blockfmt.BlockCodec`
clears it then); an instance may decline it for a configuration the family does not
implement (``fits_kernels()`` false: the reference runs)."""

from __future__ import annotations

from typing import Any

__all__ = ["declared_family"]

#: the families the dispatcher knows (a Triton module of this package, a native entry point)
FAMILIES = ("block",)


def declared_family(codec: Any) -> str | None:
    """The kernel family ``codec`` declares and fits, or ``None``."""
    family = getattr(type(codec), "kernel_family", None)
    if family not in FAMILIES:
        return None
    fits = getattr(codec, "fits_kernels", None)
    return family if fits is None or fits() else None
