"""``python -m graphplan.compiler.cli ...``: the ``plan`` command."""

import sys

from . import main

sys.exit(main())
