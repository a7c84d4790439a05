"""``python -m hvd_balance.emulate``: kept so recorded commands run as written; the code is :mod:`hvd_balance.tools.emulate`."""

import sys

from .tools.emulate import main

if __name__ == "__main__":
    sys.exit(main())
