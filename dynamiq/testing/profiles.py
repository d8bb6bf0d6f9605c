"""dynamiq's Hypothesis profiles, which never replace the caller's (docs/testing.md,
"Profiles").

Three profiles are registered on import, under names of their own so that they cannot
overwrite a profile of the caller (nor Hypothesis' ``ci``): ``dynamiq-dev`` (20 examples),
``dynamiq-ci`` (200, what ``make test`` uses) and ``dynamiq-thorough`` (2000). Importing
:mod:`dynamiq.testing` loads none of them: the kit's checks run under whatever settings are
current, the caller's. :func:`load_profile` loads one on request.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

__all__ = ["PROFILES", "load_profile"]

#: short name -> examples per property; registered as ``dynamiq-<short name>``
PROFILES = {"dev": 20, "ci": 200, "thorough": 2000}
_ENV = "HYPOTHESIS_PROFILE"

for _short, _examples in PROFILES.items():
    settings.register_profile(
        f"dynamiq-{_short}",
        max_examples=_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def load_profile(name: str | None = None, *, default: str | None = None) -> str:
    """Load the Hypothesis profile ``name`` (default: the ``HYPOTHESIS_PROFILE`` environment
    variable); return the name of the profile in force afterwards.

    ``dev``, ``ci`` and ``thorough`` mean dynamiq's (``dynamiq-dev``, ...); any other name is
    a profile registered with Hypothesis. An unset or empty name means ``default``, and with
    ``default=None`` nothing is loaded (the current profile, the caller's, stays). An unknown
    name raises ``ValueError`` naming the known ones.

    >>> load_profile("", default=None) == settings.get_current_profile_name()
    True
    """
    if name is None:
        name = os.environ.get(_ENV, "")
    name = name.strip() or (default or "")
    if not name:
        return settings.get_current_profile_name()
    full = f"dynamiq-{name}" if name in PROFILES else name
    try:
        settings.load_profile(full)
    except InvalidArgument:
        known = ", ".join([*PROFILES, *(f"dynamiq-{s}" for s in PROFILES)])
        raise ValueError(
            f"unknown Hypothesis profile {name!r} (from {_ENV} or load_profile): dynamiq's "
            f"are {known}; others must be registered with hypothesis.settings.register_profile "
            "first"
        ) from None
    return full
