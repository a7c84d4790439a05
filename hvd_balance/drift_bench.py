"""``python -m hvd_balance.drift_bench``: kept so recorded commands run as written; the code is :mod:`hvd_balance.tools.drift_bench`."""

import sys

from .tools.drift_bench import main

if __name__ == "__main__":
    sys.exit(main())
