"""Which Keras backend ``hvd_balance.keras`` binds: TensorFlow's (Horovod) or torch's.

Read before anything imports TensorFlow or torch, from what Keras itself reads at import:
``KERAS_BACKEND``, else ``~/.keras/keras.json`` (``$KERAS_HOME``), else TensorFlow. Keras 2
has TensorFlow only, whatever they say.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Optional

SUPPORTED = ("tensorflow", "torch")


def requested_backend() -> Optional[str]:
    """The backend Keras 3 will load: ``KERAS_BACKEND``, else ``keras.json``'s, else None."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        return None


def _keras_major() -> int:
    try:
        return int(importlib.metadata.version("keras").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0  # no keras distribution: tf.keras is TensorFlow's own (Keras 2)


def keras_backend() -> str:
    """``"tensorflow"`` or ``"torch"``: the Keras backend this process runs.

    Raises:
        ImportError: another backend (JAX, NumPy, OpenVINO), or torch's without PyTorch
            installed, naming the backend and what to set instead.
    """
    loaded = sys.modules.get("keras")
    if loaded is not None and hasattr(getattr(loaded, "backend", None), "backend") \
            and _keras_major() >= 3:
        backend = loaded.backend.backend()  # Keras is imported: what it runs, not what is asked
    elif _keras_major() >= 3:
        backend = requested_backend() or "tensorflow"
    else:
        return "tensorflow"
    if backend not in SUPPORTED:
        raise ImportError(
            f"hvd_balance needs Keras's TensorFlow or torch backend, but Keras is set to "
            f"{backend!r} (KERAS_BACKEND={os.environ.get('KERAS_BACKEND', '')!r}, or "
            "~/.keras/keras.json). Set KERAS_BACKEND=tensorflow (Horovod) or KERAS_BACKEND=torch "
            "(torch.distributed, launched by torchrun) before Python starts: the gradients are "
            f"summed by Horovod's TensorFlow ops or by torch.distributed, and {backend!r} tensors "
            "can go through neither")
    if backend == "torch" and importlib.util.find_spec("torch") is None:
        raise ImportError(
            "KERAS_BACKEND='torch' but PyTorch is not installed in this environment: install the "
            "torch stack (HVD_BALANCE_STACK=torch bash scripts/install.sh) or set "
            "KERAS_BACKEND=tensorflow")
    return backend
