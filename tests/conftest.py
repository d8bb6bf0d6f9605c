"""Shared pytest set-up: the Hypothesis profile from HYPOTHESIS_PROFILE (default ``dev``)."""

from dynamiq.testing.strategies import load_profile

load_profile()
