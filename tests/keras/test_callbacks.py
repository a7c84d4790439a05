"""hvd_balance.keras.callbacks in one process: the learning-rate schedule and warm-up set the
rates Horovod's set, on Keras 2 and Keras 3 (where Horovod's cannot read the rate at all)."""

import numpy as np
import pytest
import tensorflow as tf

import hvd_balance.keras as hvd

pytestmark = [pytest.mark.timeout(120), pytest.mark.stacks]


class RateAtEpochStart(tf.keras.callbacks.Callback):
    """The learning rate each epoch's first batch trains with."""

    def on_train_begin(self, logs=None):
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.rates.append(float(np.asarray(self.model.optimizer.learning_rate)))


def fit(callbacks, epochs=5, optimizer=None):
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer or tf.keras.optimizers.SGD(0.1)), loss="mse")
    probe = RateAtEpochStart()
    history = model.fit(np.ones((32, 2), "float32"), np.ones((32, 1), "float32"), batch_size=8,
                        epochs=epochs, verbose=0, callbacks=[*callbacks, probe])
    return probe.rates, history.history


def test_schedule_multiplies_the_initial_rate_inside_its_epochs_only():
    rates, history = fit([hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.1, multiplier=0.5, start_epoch=1, end_epoch=3)])
    # epoch 0 untouched; epochs 1 and 2 get 0.1 * 0.5 ** (epoch - 1); later epochs keep the last
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05])
    assert history["lr"] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05])


def test_a_callable_multiplier_without_staircase_changes_the_rate_every_batch():
    rates, _ = fit([hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=1.0, multiplier=lambda epoch: 1.0 / (1.0 + epoch), staircase=False)], epochs=3)
    assert rates == pytest.approx([1.0, 0.5, 1.0 / 3.0])  # each epoch's batch 0


def test_warmup_in_one_process_keeps_the_initial_rate():
    rates, history = fit([hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2)],
                         epochs=3)
    # with one rank the warm-up goes from 0.2 / 1 to 0.2: nothing to ramp
    assert rates == pytest.approx([0.2, 0.2, 0.2]) and history["lr"][-1] == pytest.approx(0.2)


def test_a_learning_rate_schedule_object_is_refused_naming_it():
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    with pytest.raises(ValueError, match="learning rate is a schedule \\(ExponentialDecay\\)"):
        fit([hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5)],
            optimizer=tf.keras.optimizers.SGD(schedule))
