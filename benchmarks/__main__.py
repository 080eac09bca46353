"""`python -m benchmarks <command>` runs the lab (benchmarks/cli.py)."""

import sys

from benchmarks.cli import main

sys.exit(main())
