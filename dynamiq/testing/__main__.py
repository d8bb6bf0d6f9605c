"""``python -m dynamiq.testing --write DIR``: regenerate the golden fixtures."""

import sys

from .golden import main

sys.exit(main())
