"""``python -m kvtier.docs``: see :mod:`kvtier.docs`."""

import sys

from kvtier.docs import main

sys.exit(main())
