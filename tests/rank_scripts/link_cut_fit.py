"""A balanced training run during which one host's network link is cut, for
tests/cluster/test_cluster_faults.py (on the namespace cluster, rank 1 on another host).

Usage: horovodrun -np 2 -H hostA:1,hostB:1 python link_cut_fit.py RUN_ID HOST
In the middle of epoch 2 (index 1, step 5) rank 0 cuts HOST's link at the cluster's switch
(``ip link set ... down``; it runs as root on the same machine) and prints "FAULT <unix
time>"; the job then has to end by itself. With hvd_balance.watchdog installed.
"""
import sys
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from hvd_balance import watchdog
from hvd_balance.tools import netns_cluster

hvd.init()
watchdog.install()
run_id, host = sys.argv[1], sys.argv[2]
rank = hvd.rank()
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 10)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
data = hvd_balance.BalancedData(x, y, global_batch_size=64, seed=0)
model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class CutLink(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if rank == 0 and self.epoch == 1 and batch == 5:
            netns_cluster.attach(run_id).set_link_up(host, False)
            print(f"FAULT {time.time():.3f}", flush=True)


model.fit(data, epochs=4, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([40, 24]), verbose=0),
    CutLink()])
print("FINISHED (the cut did not stop the job)", flush=True)
