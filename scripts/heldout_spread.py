"""Usage: python scripts/heldout_spread.py 0,1,2,3,4   (shuffle seeds)

Held-out accuracy of the bench's ResNet-8 after 3 epochs of 20 steps, one process, B = 512,
for several shuffle seeds (the same weights at the start): how much the sample order alone moves it."""
import sys
import numpy as np
import tensorflow as tf
import hvd_balance
from hvd_balance.tools.bench import models
x, y, xh, yh = models.make_images(10240, 2048, 0)
for seed in [int(s) for s in sys.argv[1].split(",")]:
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input(models.IMAGE_SHAPE), *models.resnet_layers("local")])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = hvd_balance.BalancedData(x, y, global_batch_size=512, seed=seed, rank=0, world_size=1)
    class Epochs(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            data.set_epoch(epoch + 1)
    h = model.fit(data, epochs=3, verbose=0, callbacks=[Epochs()])
    acc = float(np.mean(np.argmax(model.predict(xh, batch_size=256, verbose=0), -1) == yh))
    print(f"seed {seed}: loss {[round(l, 3) for l in h.history['loss']]} held-out accuracy {acc:.3f}", flush=True)
