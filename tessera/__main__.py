"""`python -m tessera` runs the `tessera` command (what `tessera run -m tessera ...` starts)."""

import sys

from tessera.cli import main

sys.exit(main())
