"""``python -m dynamiq``: the ``dynamiq`` command line."""

import sys

from dynamiq.bench.cli import main

sys.exit(main())
