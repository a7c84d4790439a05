"""``python -m hvd_balance.simulate``: kept so recorded commands run as written; the code is :mod:`hvd_balance.tools.simulate`."""

import sys

from .tools.simulate import main

if __name__ == "__main__":
    sys.exit(main())
