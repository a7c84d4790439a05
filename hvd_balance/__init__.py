"""hvd_balance: load balancing for synchronous Horovod Keras training on mixed devices.

Each rank gets a local batch sized to its measured speed (the global batch stays fixed),
gradients are weighted by ``b_i / B`` so the update equals the single-device update on the
global batch, and the data is sharded so every rank runs the same number of steps.

The layers show in the folders:

- :mod:`hvd_balance.core`: numpy and yaml only (plans, the planner, re-planning, device
  specs, memory caps, the simulator);
- :mod:`hvd_balance.keras`: everything that imports TensorFlow or Horovod (data, optimizer,
  telemetry, callbacks, collectives, watchdog, elastic);
- :mod:`hvd_balance.tools`: the command line, the emulation launcher, the benchmarks.

The public names below import from ``core`` at once and from ``keras`` (so TensorFlow) when
first used.
"""

from ._version import __version__
from .core.devices import DeviceAssignment
from .core.memory_caps import resolve_max_batch_sizes
from .core.plan import Plan, PlanMismatchError
from .core.planner import TimeCurve, plan_batches

# name -> module under hvd_balance.keras that defines it (imported on first use).
_LAZY = {
    "BalancedData": "data",
    "DistributedOptimizer": "optimizer",
    "load_model": "optimizer",
    "LoadBalancer": "load_balancer",
    "WeightedMetricAverage": "metric_average",
    "StepTelemetry": "telemetry",
    "pin_devices": "pinning",
    "probe_max_batch": "memory_probe",
    "SyncBatchNormalization": "sync_batch_norm",
    "convert_sync_batchnorm": "sync_batch_norm",
}
# Modules of the public API, under the names the README uses (``from hvd_balance import watchdog``).
_LAZY_MODULES = {"watchdog": "keras.watchdog", "elastic": "keras.elastic"}

__all__ = ["__version__", "Plan", "PlanMismatchError", "TimeCurve", "plan_batches",
           "DeviceAssignment", "resolve_max_batch_sizes", *_LAZY, *_LAZY_MODULES]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        keras_edge = importlib.import_module(".keras", __name__)  # refuses an unsupported backend
        if keras_edge.keras_backend() == "torch":
            if name not in keras_edge.__all__:  # Keras on torch: its own names only
                raise AttributeError(f"hvd_balance.{name} is on Keras's TensorFlow backend only")
            return getattr(keras_edge, name)
        return getattr(importlib.import_module(f".keras.{_LAZY[name]}", __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{_LAZY_MODULES[name]}", __name__)
    raise AttributeError(f"module 'hvd_balance' has no attribute {name!r}")
