"""WeightedMetricAverage: epoch metrics averaged over ranks, weighted by samples seen."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from . import collective
from ..core.metric_average import weighted_average
from .data import BalancedData
from .optimizer import gradient_weight_of
from .stop_agreement import StopAgreementMixin


def _sum_over_ranks(vector: np.ndarray) -> np.ndarray:
    if collective.size() == 1:
        return vector
    import horovod.tensorflow as hvd
    return hvd.allreduce(tf.constant(vector), op=hvd.Sum, name="hvd_balance.metric_average").numpy()


class WeightedMetricAverage(StopAgreementMixin, tf.keras.callbacks.Callback):
    """Average epoch metrics across ranks, weighting each rank by the samples it saw.

    Horovod's ``MetricAverageCallback`` gives every rank the same weight; with unequal
    local batches that over-counts the slow ranks. This callback replaces every metric in the
    epoch logs by ``sum_i n_i m_i / sum_i n_i`` (``n_i``: rank i's samples in the epoch), so a
    mean metric becomes the mean over all samples of the global epoch. Place it before
    callbacks that read the logs (``CSVLogger``, ``ModelCheckpoint``, ``EarlyStopping``).

    Args:
        data: the training :class:`BalancedData` (its samples per epoch give ``n_i``);
            default: the weight ``b_i / B`` of the model's hvd_balance optimizer, which is
            proportional to ``n_i`` since every rank runs the same number of steps.
        validation_data: the validation :class:`BalancedData`; default: the same weights as
            training (right when the validation data is sharded by the same plan, and
            harmless when every rank evaluates the same data).

    Example:
        ```python
        model.fit(data, validation_data=val, epochs=5, callbacks=[
            hvd_balance.LoadBalancer(data, validation_data=val),
            hvd_balance.WeightedMetricAverage(data, val),
            tf.keras.callbacks.CSVLogger("log.csv")])
        ```
    """

    def __init__(self, data: Optional[BalancedData] = None,
                 validation_data: Optional[BalancedData] = None):
        super().__init__()
        self.data = data
        self.validation_data = validation_data

    def on_epoch_begin(self, epoch, logs=None):
        self._stop_epoch_begin(epoch)
        # Counted now: at epoch end the load balancer may already have applied the next
        # epoch's plan. The training count follows any plan change inside the epoch.
        self._epoch = self.data.epoch if self.data is not None else None
        weight = gradient_weight_of(getattr(self.model, "optimizer", None))
        self._weight = weight.get() if weight is not None else 1.0
        self._val = (float(self.validation_data.local_samples)
                     if self.validation_data is not None else None)

    def on_epoch_end(self, epoch, logs=None):
        self._stop_epoch_settle(epoch, logs)  # before the allreduce: a rank may have stopped
        if logs is not None:
            self._average(logs)
        self._stop_epoch_end(epoch)

    def _average(self, logs) -> None:
        if self.data is not None:
            train = float(sum(len(step) for step in self.data.indices(self._epoch)))
        else:
            train = self._weight
        val = self._val if self._val is not None else train
        logs.update(weighted_average(logs, train, val, _sum_over_ranks))
