"""The torch edge's tests (marked ``torch``): one-process tests, and jobs of several ranks
under torchrun through ``support.torchrun.run_torchrun`` (hard timeout, every rank killed
after it). ``rank_scripts/`` holds the programs those jobs run (not collected)."""

import pytest

collect_ignore = ["rank_scripts"]

torch = pytest.importorskip("torch.distributed", reason="the torch stack (HVD_BALANCE_STACK=torch)")
