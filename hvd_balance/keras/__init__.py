"""``import hvd_balance.keras as hvd``: Horovod's Keras API, weighted, on Keras 2 and Keras 3.

On Keras 3 with ``KERAS_BACKEND=torch`` the same names come from :mod:`.torch_backend`
(torch.distributed, launched by ``torchrun``, no TensorFlow); on TensorFlow (the default)
from :mod:`.horovod_api`. Any other backend is refused at import, naming it.

A drop-in for ``import horovod.tensorflow.keras as hvd`` with the names Horovod's Keras
examples use and the same signatures: the process functions and collectives are Horovod's
TensorFlow ones; :func:`DistributedOptimizer` averages the ranks' gradients weighted by their
local batches (equal weights until a plan is applied: then it is Horovod's average), and the
callbacks, :func:`load_model` and :mod:`elastic` are hvd_balance's, which work on Keras 3,
where Horovod's own Keras layer does not (its optimizer hooks are never called, horovod issue
#4290, and its callbacks use ``keras.backend.get_value``).

This folder is also the package's TensorFlow edge: every module here may import TensorFlow
and Horovod; the math it applies is in :mod:`hvd_balance.core`, and every difference between
Keras 2 and Keras 3, and every private Horovod or Keras attribute, is in :mod:`.compat`.

Example::

    import hvd_balance.keras as hvd                      # was: horovod.tensorflow.keras

    hvd.init()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(dataset, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                  hvd.callbacks.MetricAverageCallback()])
"""

from .backend_choice import keras_backend

if keras_backend() == "torch":
    from .torch_backend import *  # noqa: F401,F403 - the torch backend's names
    from .torch_backend import __all__  # noqa: F401
else:
    from .horovod_api import *  # noqa: F401,F403 - Horovod's names on TensorFlow
    from .horovod_api import __all__  # noqa: F401
