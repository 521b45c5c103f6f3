"""``python -m graphplan.server ...``: the same as ``graphplan-serve ...`` (``cli.main``)."""

import sys

from .cli import main

if __name__ == "__main__":  # the engine process (spawned) imports this module as __mp_main__
    sys.exit(main())
