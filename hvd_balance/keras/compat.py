"""Every access to a private Horovod or Keras attribute, in one place.

A new Horovod or Keras release that renames one of these breaks this module alone. Each
function says which attribute it touches and why no public API does the same.
"""

from __future__ import annotations

from typing import Callable, List, Sequence


def hook_horovod_allreduce(distributed, make_reduce: Callable[[Callable], Callable]) -> None:
    """Route every gradient allreduce of Horovod's Keras ``DistributedOptimizer`` through
    ``make_reduce(original)``, a function ``(grads, variables) -> reduced grads``.

    Horovod calls ``self._allreduce_grads(grads, vars)`` for each allreduce it makes, and its
    gradient-aggregation helper (``backward_passes_per_step > 1``) keeps its own reference
    (``_agg_helper.allreduce_grads``); Horovod has no public hook before the reduction, and
    the weights must be applied there because its pre/postscale factors must be equal on
    every rank.
    """
    reduce = make_reduce(distributed._allreduce_grads)
    distributed._allreduce_grads = reduce
    helper = getattr(distributed, "_agg_helper", None)
    if helper is not None:
        helper.allreduce_grads = reduce


def build_optimizer(optimizer, variables: Sequence) -> None:
    """Create an optimizer's slot variables for ``variables`` now (a no-op when built).

    Keras 2's legacy optimizers make their slots on first use (``_create_all_weights``, no
    public equivalent); the new ones have ``build`` and a private ``_built`` flag.
    """
    variables = list(variables)
    if hasattr(optimizer, "_create_all_weights"):  # legacy optimizers
        optimizer._create_all_weights(variables)
    elif hasattr(optimizer, "build") and not getattr(optimizer, "_built", False):
        optimizer.build(variables)


def steps_per_execution(model) -> int:
    """The compiled model's ``steps_per_execution`` (1 when not compiled with it).

    Keras 2 keeps it in the private variable ``_steps_per_execution``; Keras 3 has the
    public attribute ``steps_per_execution``.
    """
    value = getattr(model, "_steps_per_execution", None)
    if value is None:
        value = getattr(model, "steps_per_execution", None)
    if value is None:
        return 1
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)


__all__: List[str] = ["hook_horovod_allreduce", "build_optimizer", "steps_per_execution"]
