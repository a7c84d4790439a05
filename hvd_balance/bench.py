"""``python -m hvd_balance.bench``: kept so recorded commands run as written; the code is :mod:`hvd_balance.tools.bench`."""

import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
