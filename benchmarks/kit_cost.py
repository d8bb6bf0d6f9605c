"""What one ``run_conformance`` call costs: ``python benchmarks/kit_cost.py PROFILE NAME...``.

``PROFILE`` is ``dev`` (20 examples) or ``ci`` (200): a Hypothesis profile with that many
examples and no example database is loaded, then each codec's ``run_conformance`` is timed
(seconds, import excluded). Run it with ``PYTHONPATH`` at two trees, back to back, to compare
two versions of the kit (docs/benchmarks.md, "The test kit's own cost").
"""

from __future__ import annotations

import sys
import time

from hypothesis import settings

from dynamiq.testing import run_conformance

EXAMPLES = {"dev": 20, "ci": 200}


def main(argv: list[str]) -> None:
    profile, names = argv[0], argv[1:]
    settings.register_profile(
        "kit-cost", max_examples=EXAMPLES[profile], deadline=None, database=None
    )
    settings.load_profile("kit-cost")
    for name in names:
        t0 = time.perf_counter()
        run_conformance(name)
        print(name, f"{time.perf_counter() - t0:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
