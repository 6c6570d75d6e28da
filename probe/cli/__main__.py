"""``python -m probe.cli`` runs the command line (same as ``probe`` and ``python -m probe``)."""

import sys

from probe.cli import main

sys.exit(main())
