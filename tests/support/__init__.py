"""What the tests share: launching ranks with a hard timeout (:mod:`support.launch`)."""

from .launch import *  # noqa: F401,F403
from .launch import __all__  # noqa: F401
