"""``python -m kvtier.cli``: the ``kvtier`` command (how the fleet starts its router in a child process)."""

import sys

from kvtier.cli import main

sys.exit(main())
