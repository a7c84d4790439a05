"""hvd_balance: load balancing for synchronous Horovod Keras training on mixed devices.

Each rank gets a local batch sized to its measured speed (the global batch stays fixed),
gradients are weighted by ``b_i / B`` so the update equals the single-device update on the
global batch, and the data is sharded so every rank runs the same number of steps.

The planner (:func:`plan_batches`, :class:`Plan`) needs only numpy; the Keras pieces
(:class:`BalancedData`, :func:`DistributedOptimizer`, :func:`load_model`, :class:`LoadBalancer`,
:class:`WeightedMetricAverage`) import TensorFlow when first used.
"""

from .plan import Plan, PlanMismatchError
from .planner import TimeCurve, plan_batches

__version__ = "0.1.0"

from .devices import DeviceAssignment, pin_devices
from .memory import probe_max_batch, resolve_max_batch_sizes

_LAZY = {
    "BalancedData": "data",
    "DistributedOptimizer": "optimizer",
    "load_model": "optimizer",
    "LoadBalancer": "load_balancer",
    "WeightedMetricAverage": "metric_average",
    "StepTelemetry": "telemetry",
}

__all__ = ["Plan", "PlanMismatchError", "TimeCurve", "plan_batches", "pin_devices",
           "DeviceAssignment", "probe_max_batch", "resolve_max_batch_sizes", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'hvd_balance' has no attribute {name!r}")
