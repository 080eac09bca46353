"""`python -m conveyor ...` runs the `conveyor` command (serve, generate, bench)."""

import sys

from conveyor.cli import main

sys.exit(main())
