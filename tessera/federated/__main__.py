"""`python -m tessera.federated server|client ...` (see `tessera.federated.cli`)."""

import sys

from tessera.federated.cli import main

sys.exit(main())
