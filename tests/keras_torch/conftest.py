"""Keras 3 on the torch backend (marked ``torch``, run on the torch stack): jobs of 2 and 3
ranks under torchrun through ``support.torchrun.run_torchrun`` (hard timeout, every rank
killed after it). ``rank_scripts/`` holds the programs those jobs run (not collected)."""

import importlib.util

import pytest

collect_ignore = ["rank_scripts"]

# Not an import of keras: without KERAS_BACKEND it would load TensorFlow's backend.
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("keras") is None:
    pytest.skip("the torch stack (HVD_BALANCE_STACK=torch)", allow_module_level=True)
