"""`python -m flows.cli`: what the `agentrft` console script runs."""

import sys

from flows.cli import main

sys.exit(main())
