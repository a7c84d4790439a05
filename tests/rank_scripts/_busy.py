"""Work a rank script can dial in: Python busy-waits holding the GIL (a sleep would let the
waits of two threads overlap, so decoding could hide behind the step)."""

import time

import tensorflow as tf


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class PerSampleBusy(tf.keras.layers.Layer):
    """In training, ``seconds_per_sample`` of busy-waiting per sample of the batch; the input
    passes through unchanged (not a layer to save: the delay is not in its config)."""

    def __init__(self, seconds_per_sample: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds_per_sample = float(seconds_per_sample)

    def call(self, inputs, training=None):
        if not training or self.seconds_per_sample <= 0:
            return inputs

        def wait(batch_size):
            busy(self.seconds_per_sample * int(batch_size))
            return batch_size

        done = tf.numpy_function(wait, [tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([done]):
            return tf.identity(inputs)
