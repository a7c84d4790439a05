"""A Horovod Keras script in the shape of Horovod's ``tensorflow2_keras_mnist.py`` example,
written against ``import hvd_balance.keras as hvd`` (the one line a user changes), on
scikit-learn's digits padded to MNIST's 28x28 (nothing can be downloaded here).

Usage: horovodrun -np 2 python horovod_keras_example.py {plain,balanced}
  plain:    Horovod's example as it is: a repeated, shuffled tf.data pipeline, Adam scaled by
            size, warm-up, metric averaging, a checkpoint on rank 0 (as a .keras file: Keras 3
            writes no whole model to .h5 with ModelCheckpoint).
  balanced: the same made balanced with BalancedData and LoadBalancer.
Emits per rank: {"rank", "weights_sha256", "first_loss", "last_loss", "last_accuracy",
"lr_logged", "checkpoints"}.
"""
import glob
import hashlib
import os
import sys

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvd_balance
import hvd_balance.keras as hvd
from _result import emit

mode = sys.argv[1]
hvd.init()

digits = load_digits()
images = np.kron(digits.images / 16.0, np.ones((3, 3)))           # 24 x 24
images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None].astype("float32")  # 28 x 28 x 1
labels = digits.target.astype("int64")

model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(16, 3, activation="relu"),
    tf.keras.layers.MaxPooling2D(),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation="relu"),
    tf.keras.layers.Dense(10, activation="softmax"),
])
scaled_lr = 0.001 * hvd.size()
opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                               average_aggregated_gradients=True)
model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"])
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
]
workdir = os.environ["HVD_BALANCE_TEST_RESULTS"]
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(workdir, "checkpoint-{epoch}.keras")))
if mode == "plain":
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().shuffle(2000,
                                                                                   seed=hvd.rank())
    history = model.fit(dataset.batch(64), steps_per_epoch=60 // hvd.size(), epochs=4,
                        callbacks=callbacks, verbose=0)
else:
    data = hvd_balance.BalancedData(images, labels, global_batch_size=128, seed=0)
    callbacks.insert(1, hvd_balance.LoadBalancer(data, verbose=0))
    history = model.fit(data, epochs=4, callbacks=callbacks, verbose=0)

weights = b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
emit({"rank": hvd.rank(), "weights_sha256": hashlib.sha256(weights).hexdigest(),
      "first_loss": history.history["loss"][0], "last_loss": history.history["loss"][-1],
      "last_accuracy": history.history["accuracy"][-1], "lr_logged": history.history["lr"],
      "checkpoints": sorted(os.path.basename(p) for p in glob.glob(os.path.join(workdir, "*.keras")))})
