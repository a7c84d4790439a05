"""Elastic Horovod with hvd_balance: re-plan on every reset, resume exactly at the last commit.

Under ``hvd.elastic.run``, workers may leave (a host is removed from discovery, or fails)
or join; every rank then goes back to the last commit and calls the training function again
in the new world. hvd_balance needs three things at that point, and :func:`fit` does them:

1. **The new world.** ``data.set_world(hvd.rank(), hvd.size())`` (and the validation data),
   a check that every rank agrees on the job (like :class:`LoadBalancer`'s), and a new plan
   for the new world size (the benchmark again, or the uniform split), applied to the data
   and to the optimizer's gradient weight ``b_i / B``.
2. **Commits at segment boundaries.** The data can change its plan only every
   ``data.segment_steps`` steps, and a commit records ``(epoch, step)`` with the model: so
   :func:`fit` commits every ``segment_steps`` steps and at every epoch end, and nowhere
   else. (Use it instead of Horovod's ``CommitStateCallback`` / ``UpdateBatchStateCallback``
   / ``UpdateEpochStateCallback``.)
3. **Resume at the commit.** The committed model and optimizer come back (Horovod's
   ``KerasState``), and the partly done epoch continues with ``data.from_step(step)``, the
   rest of the epoch from the committed step, before the later epochs run on ``data``.

Because the samples of the first ``c`` steps of an epoch are always the permutation's first
``c * B`` entries whatever the plans and world sizes (see :class:`BalancedData`), the
committed samples are exactly those of the committed steps: after a reset nothing committed
is trained twice and nothing is skipped; the steps run after the last commit are undone with
the model and run again in the new world.

The module is also ``hvd.elastic`` of ``import hvd_balance.keras as hvd``: Horovod's
``run``, ``CommitStateCallback``, ``UpdateBatchStateCallback`` and ``UpdateEpochStateCallback``,
and a :class:`KerasState` that works on Keras 2 and Keras 3 (Horovod's reads
``optimizer.variables()``, a list on Keras 3, and broadcasts Keras 3 variables it cannot assign).

Example:
    ```python
    import hvd_balance.keras as hvd
    import hvd_balance
    from hvd_balance import elastic

    hvd.init()
    data = hvd_balance.BalancedData(x, y, global_batch_size=256, segment_steps=20)
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
                  loss="sparse_categorical_crossentropy")
    state = elastic.ElasticState(model, data)

    @hvd.elastic.run
    def train(state):
        elastic.fit(state, epochs=10)

    train(state)
    ```

Run it with ``horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script discover.sh
python train.py`` (on one machine, add ``--network-interface lo``).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence, Union

import tensorflow as tf
import horovod.tensorflow as hvd_tf
from horovod.common.elastic import ObjectState
from horovod.tensorflow.elastic import run  # noqa: F401 - hvd.elastic.run
from horovod.tensorflow.keras.elastic import (  # noqa: F401 - Horovod's, framework-agnostic
    CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback)

from . import collective, compat, plan_sync
from .data import BalancedData
from .step_timer import BENCHMARK_REPEATS
from ..core.plan import Plan


def _build_optimizer(model: tf.keras.Model) -> None:
    """Create the optimizer's slot variables now, so that every worker (a new one too) has
    the same list of optimizer variables to save, restore and broadcast."""
    opt = model.optimizer
    if opt is None:
        raise ValueError("the model must be compiled before elastic training")
    compat.build_optimizer(opt, model.trainable_variables)


class KerasState(ObjectState):
    """A Keras model and its optimizer as elastic state (Horovod's ``KerasState``, any Keras).

    ``commit()`` keeps a copy of every model and optimizer variable, ``restore()`` puts it
    back, and ``sync()`` gives every rank rank 0's variables and attributes.

    Args:
        model: the built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        **kwargs: more values to commit and sync, as attributes of the state.
    """

    def __init__(self, model, optimizer=None, **kwargs):
        if not model.built:
            raise ValueError("the model must be built first: run model.build(input_shape)")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        # Slots now, so a worker that joins later holds the same list of variables.
        compat.build_optimizer(self.optimizer, model.trainable_variables)
        self._save_model()
        super().__init__(bcast_object=hvd_tf.broadcast_object, get_rank=hvd_tf.rank, **kwargs)

    def _variables(self) -> list:
        return compat.model_state(self.model) + compat.optimizer_variables(self.optimizer)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        variables = self._variables()
        if len(variables) != len(self._saved):
            raise ValueError(f"cannot restore the committed state: {len(self._saved)} variables were "
                             f"committed, the model and optimizer now have {len(variables)}")
        for variable, saved in zip(variables, self._saved):
            variable.assign(saved)
        super().restore()

    def sync(self):
        if hvd_tf.size() > 1:
            hvd_tf.broadcast_variables(compat.tf_variables(self._variables()), root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved = [tf.identity(v) for v in compat.tf_variables(self._variables())]


class ElasticState(KerasState):
    """:class:`KerasState` plus the committed position, for :func:`fit`.

    Besides the model and optimizer weights, it commits ``epoch`` (the epoch in progress)
    and ``step`` (the steps of it done, a multiple of ``data.segment_steps``), and any
    ``**kwargs`` as Horovod's state does. The data itself is not synced: it is the same on
    every rank (same arrays, seed and global batch; :func:`fit` checks it).

    Args:
        model: the compiled, built Keras model (its optimizer should be
            :func:`hvd_balance.DistributedOptimizer`).
        data: the :class:`BalancedData` to train on.
        validation_data: optional :class:`BalancedData` for validation.
        **kwargs: more values to commit and sync (Horovod ``ObjectState`` attributes).

    Attributes:
        epoch, step: the committed position (after a commit or a reset) or the position
            of the last commit during training.
        plan: the :class:`Plan` in force (set by :func:`fit`; not synced).
        commits: how many commits this worker made (not synced).
    """

    def __init__(self, model: tf.keras.Model, data: BalancedData,
                 validation_data: Optional[BalancedData] = None, **kwargs):
        if not isinstance(data, BalancedData):
            raise TypeError(f"ElasticState needs a hvd_balance.BalancedData; got {type(data).__name__}")
        _build_optimizer(model)
        self.data = data
        self.validation_data = validation_data
        self.plan: Optional[Plan] = None
        self.commits = 0
        super().__init__(model, epoch=0, step=0, **kwargs)

    def commit(self):
        self.commits += 1
        super().commit()


class _SegmentCommit(tf.keras.callbacks.Callback):
    """Commits ``state`` at every segment boundary inside an epoch and at every epoch end.

    ``first_step`` is the step of the epoch the first epoch of this ``fit`` starts at (the
    committed step when resuming with ``data.from_step``); later epochs start at 0.
    """

    def __init__(self, state: ElasticState, first_step: int = 0):
        super().__init__()
        self.state = state
        self.first_step = first_step

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        data = self.state.data
        done = self.first_step + batch + 1
        if done % data.segment_steps == 0 and done < data.steps:
            self.state.epoch, self.state.step = self.epoch, done
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.first_step = 0
        self.state.data.set_epoch(epoch + 1)
        if self.state.validation_data is not None:
            self.state.validation_data.set_epoch(epoch + 1)
        self.state.epoch, self.state.step = epoch + 1, 0
        self.state.commit()


def plan_world(state: ElasticState, plan: Union[str, Plan] = "benchmark", method: str = "minmax",
               max_batch_size=None, benchmark_batches: Optional[Sequence[int]] = None,
               min_batch_size=None,
               repeats: int = BENCHMARK_REPEATS, verbose: int = 1) -> Plan:
    """Move ``state``'s data to the current world and apply a plan made for it (collective).

    Called by :func:`fit` at every (re)start; call it yourself only to write your own loop.

    Args:
        state: the :class:`ElasticState`.
        plan: ``"benchmark"`` (time every rank again, the default), ``"uniform"`` (equal
            shares), or a :class:`Plan` (used while it fits the world size; the uniform split
            otherwise).
        method, max_batch_size, benchmark_batches, repeats: as for :class:`LoadBalancer`.
        min_batch_size: as for :class:`LoadBalancer` (one int fits every world size); a
            given or uniform plan must meet it.
        verbose: 1 prints the plan table on rank 0.

    Returns:
        The plan in force, identical on every rank (also ``state.plan``).

    Raises:
        ValueError: on every rank, if the ranks disagree about the job (data, global batch,
            seed, segment, model size or committed position).
    """
    data, model = state.data, state.model
    rank, size = collective.rank(), collective.size()
    for d in (data, state.validation_data):
        if d is not None:
            d.set_epoch(state.epoch)
            d.set_world(rank, size)  # the uniform plan until the new one is applied
    plan_sync.check_consistent(
        "hvd_balance.elastic.check_job", world_size=size, global_batch_size=data.global_batch_size,
        seed=data.seed, num_samples=data.num_samples, steps=data.steps,
        segment_steps=data.segment_steps, epoch=state.epoch, step=state.step,
        parameters=plan_sync.trainable_parameters(model), min_batch_size=min_batch_size)
    if isinstance(plan, Plan) and plan.world_size == size:
        chosen = plan_sync.resolve_given_plan(plan, data)
    elif plan == "benchmark":
        chosen = plan_sync.benchmark_and_plan(model, data, method=method,
                                              max_batch_size=max_batch_size,
                                              batch_sizes=benchmark_batches, repeats=repeats,
                                              min_batch_size=min_batch_size)
    elif plan == "uniform" or isinstance(plan, Plan):
        chosen = Plan.uniform(data.global_batch_size, size)
    else:
        raise ValueError(f"plan must be 'benchmark', 'uniform' or a Plan; got {plan!r}")
    if min_batch_size is not None and plan != "benchmark":  # a given or the uniform plan
        chosen = collective.all_ok(lambda: chosen.with_floors(min_batch_size),
                                   name="hvd_balance.elastic.min_batch_size")
    collective.all_ok(lambda: plan_sync.apply_plan(chosen, data, model.optimizer,
                                                   state.validation_data),
                      name="hvd_balance.elastic.apply_plan")
    state.plan = chosen
    if verbose and rank == 0:
        print(f"hvd_balance: {size} ranks, resuming at epoch {state.epoch} step {state.step}\n"
              f"{chosen.table()}", file=sys.stdout, flush=True)
    return chosen


def fit(state: ElasticState, epochs: int, *, plan: Union[str, Plan] = "benchmark",
        method: str = "minmax", max_batch_size=None, min_batch_size=None,
        benchmark_batches: Optional[Sequence[int]] = None, repeats: int = BENCHMARK_REPEATS,
        callbacks: Sequence[tf.keras.callbacks.Callback] = (), verbose: int = 0,
        plan_verbose: int = 1, **fit_kwargs):
    """Train ``state.model`` on ``state.data`` up to ``epochs``, from the committed position.

    Call it inside the function decorated with ``hvd.elastic.run``: on every (re)start it
    plans for the current world (:func:`plan_world`), finishes the committed epoch from the
    committed step (``data.from_step``), then runs the remaining epochs, committing at every
    segment boundary and epoch end.

    Args:
        state: the :class:`ElasticState` passed to the decorated function.
        epochs: the total number of epochs (as ``model.fit``'s ``epochs``).
        plan, method, max_batch_size, min_batch_size, benchmark_batches, repeats: how to plan
            each world, see :func:`plan_world`.
        callbacks: Keras callbacks for every ``fit`` call (they see the absolute epoch
            numbers; do not add Horovod's commit or state-update callbacks).
        verbose: ``model.fit``'s verbosity.
        plan_verbose: 1 prints the plan table on rank 0 at every (re)start.
        **fit_kwargs: passed to ``model.fit`` (``validation_data`` is taken from the
            state).

    Returns:
        The ``History`` of the last ``model.fit`` call (``None`` if nothing was left to do).
    """
    for key in ("x", "y", "epochs", "initial_epoch", "batch_size", "steps_per_epoch",
                "validation_data"):
        if key in fit_kwargs:
            raise TypeError(f"elastic.fit sets {key!r} itself; got {key}={fit_kwargs[key]!r}")
    plan_world(state, plan, method=method, max_batch_size=max_batch_size,
               benchmark_batches=benchmark_batches, repeats=repeats, verbose=plan_verbose,
               min_batch_size=min_batch_size)
    model, data = state.model, state.data
    validation = state.validation_data
    history = None
    if state.step and state.epoch < epochs:
        epoch = state.epoch
        history = model.fit(data.from_step(state.step), epochs=epoch + 1, initial_epoch=epoch,
                            validation_data=validation, verbose=verbose,
                            callbacks=[*callbacks, _SegmentCommit(state, state.step)],
                            **fit_kwargs)
    if state.epoch < epochs:
        history = model.fit(data, epochs=epochs, initial_epoch=state.epoch,
                            validation_data=validation, verbose=verbose,
                            callbacks=[*callbacks, _SegmentCommit(state)], **fit_kwargs)
    return history


__all__ = ["ElasticState", "KerasState", "fit", "plan_world", "run", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]
