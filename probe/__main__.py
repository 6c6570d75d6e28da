"""``python -m probe`` runs the command line (same as the ``probe`` command)."""

import sys

from probe.cli import main

sys.exit(main())
