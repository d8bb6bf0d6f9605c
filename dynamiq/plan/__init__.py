"""``dynamiq plan``: predict an all-reduce's time, phases and bits/value on any cluster.

See ``docs/plan.md``. :func:`predict` is the entry point; :mod:`dynamiq.plan.model` the
simulation, :mod:`dynamiq.plan.costs` its parameters, :mod:`dynamiq.plan.profiles` the named
links and devices, :mod:`dynamiq.plan.calibrate` the microbenchmarks that measure them.
"""

from .api import break_even, predict, resolve

__all__ = ["break_even", "predict", "resolve"]
