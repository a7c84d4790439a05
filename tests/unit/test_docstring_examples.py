"""The examples in the pure modules' docstrings (``>>>``) run as written."""
import doctest
import importlib
import inspect
import pkgutil

import pytest

import hvd_balance.core

MODULES = sorted(m.name for m in pkgutil.iter_modules(hvd_balance.core.__path__,
                                                      "hvd_balance.core."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    assert (result.attempted > 0) == (">>> " in inspect.getsource(module)), name
