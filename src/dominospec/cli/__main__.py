"""`python -m dominospec.cli ...` (what torchrun starts)."""

import sys

from . import main

sys.exit(main())
