"""``python -m safeview``: the same as the ``safeview`` command."""

import sys

from safeview.cli import main

sys.exit(main())
