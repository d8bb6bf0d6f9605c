"""The dispatcher's switches, read from the environment once (docs/design.md, "Kernels").

``DYNAMIQ_CPU_KERNELS`` (the native CPU kernels in ``backend="auto"``, on unless ``0``,
``false``, ``no`` or ``off``), ``DYNAMIQ_CPU_COMPILE`` (the compiled CPU reference, off unless
``1``, ``true``, ``yes`` or ``on``) and ``TRITON_INTERPRET`` (Triton's interpreter for CPU
tensors in ``backend="auto"``) are read when :mod:`dynamiq.kernels` is imported and again
whenever :func:`~dynamiq.kernels.set_cpu_kernels` or :func:`~dynamiq.kernels.set_cpu_compile`
is called, never per call (reading the environment costs a microsecond, a tenth of a
dispatched call's budget). A program that changes them later calls one of those setters
(``set_cpu_kernels(None)``: follow the environment) for the change to take effect.

Every change bumps :data:`generation`; the dispatcher's cache of resolved kernels
(``dynamiq/kernels/__init__.py``) is valid for one generation.
"""

from __future__ import annotations

import os

#: the switches in force (module attributes, read by the dispatcher)
cpu_kernels = True
cpu_compile = False
interpret = False
#: bumped by every change of the switches or of the registered kernels
generation = 0

#: what the setters asked for (``None``: the environment decides)
_overrides: dict[str, bool | None] = {"cpu_kernels": None, "cpu_compile": None}

_TRUE = ("1", "true", "yes", "on")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower()


def refresh() -> None:
    """Read the environment again and apply the setters' overrides."""
    global cpu_kernels, cpu_compile, interpret
    kernels = _overrides["cpu_kernels"]
    compiled = _overrides["cpu_compile"]
    cpu_kernels = _env("DYNAMIQ_CPU_KERNELS", "1") not in ("0", "false", "no", "off")
    cpu_kernels = cpu_kernels if kernels is None else kernels
    cpu_compile = _env("DYNAMIQ_CPU_COMPILE", "0") in _TRUE if compiled is None else compiled
    # as Triton reads it (no strip)
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in (*_TRUE, "y")
    changed()


def override(name: str, value: bool | None) -> None:
    """Set switch ``name`` (``None``: follow its environment variable) and re-read the rest."""
    _overrides[name] = value
    refresh()


def changed() -> None:
    """Invalidate what the dispatcher resolved (a switch or a kernel registration changed)."""
    global generation
    generation += 1


refresh()
