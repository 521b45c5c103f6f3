"""``python -m graphplan.server ...``: the same as ``graphplan-serve ...`` (``cli.main``)."""

import sys

from .cli import main

sys.exit(main())
