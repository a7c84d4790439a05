"""The Keras, TensorFlow and Horovod edge: data, optimizer, telemetry, callbacks, collectives.

Everything that imports TensorFlow or Horovod lives here; the math it applies is in
:mod:`hvd_balance.core`. Every access to a private Horovod or Keras attribute is in
:mod:`hvd_balance.keras.compat`.
"""
