"""Kernels a codec declares (docs/design.md, "Kernels"): a codec class names its kernel
family in its class attribute ``kernel_family`` (``Codec.kernel_family``, ``None`` by
default), resolved at the first dispatch, never at import: ``"intq"`` means the Triton module
:mod:`dynamiq.kernels.intq` and the native ``dq_int_run``, and so on for :data:`FAMILIES`.

Kernels belong to a class, not to its subclasses (a subclass may change what the reference
computes): only a declaration in the class's own body counts (``vars(cls)``). A base class
that knows its subclasses keep its computation may declare for them:
:class:`~dynamiq.codecs.blockfmt.BlockCodec` does, for subclasses that do not override the
reference. An instance may decline its family for a configuration the family does not
implement (``fits_kernels()`` false: the reference runs)."""

from __future__ import annotations

from typing import Any

__all__ = ["FAMILIES", "declared_family", "own_family"]

#: the families the dispatcher knows: the Triton module ``dynamiq.kernels.<family>``; those
#: with a native CPU entry point are listed in :mod:`dynamiq.kernels.cpu_native`
FAMILIES = ("passthrough", "intq", "mx", "dynamiq", "thc", "omnireduce", "block")


def own_family(cls: type) -> str | None:
    """The kernel family ``cls`` declares in its own body (a known one), or ``None``."""
    family = vars(cls).get("kernel_family")
    return family if family in FAMILIES else None


def declared_family(codec: Any) -> str | None:
    """The kernel family ``codec``'s class declares and its configuration fits, or ``None``."""
    family = own_family(type(codec))
    if family is None:
        return None
    fits = getattr(codec, "fits_kernels", None)
    return family if fits is None or fits() else None
