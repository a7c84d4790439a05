"""The benchmark's realistic models and their synthetic, learnable data.

- ``resnet``: a small ResNet (a 3x3 stem, three stages of one residual block each, 16, 32 and
  64 channels, stride 2 between stages, batch normalization after every convolution, global
  average pooling: He et al.'s CIFAR ResNet with n = 1, ResNet-8) on CIFAR-shaped 32x32x3
  images of 10 classes. Each class is a smooth random colour pattern; an image is its class's
  pattern, shifted (wrapping around) by up to ``MAX_SHIFT`` pixels each way, scaled by a
  random contrast, plus Gaussian noise (``IMAGE_NOISE`` times the patterns' standard
  deviation). The shifts make it a task for convolutions (a nearest-class-mean classifier
  does far worse): learnable in a few epochs, not at once.
- ``text``: a small text CNN (Kim, 2014): an ``Embedding`` (whose gradient is a
  ``tf.IndexedSlices``: sparse) of ``VOCAB`` tokens, a width-5 ``Conv1D`` of 128 filters over a
  sequence of ``SEQ_LEN`` tokens, max-pooled over the sequence, then two dense layers, on token
  sequences of 10 classes (without the convolution the step is all allreduce and update, and
  there is nothing to balance). Each class has its own ``TOPIC_TOKENS`` topic tokens (topics
  overlap); a sequence draws each token from its class's topic with probability
  ``TOPIC_SHARE``, else uniformly from the whole vocabulary.

Batch normalization is one switch (``batch_norm``): ``"local"`` is Keras's
``BatchNormalization`` (each rank normalizes over its own local batch and keeps its own moving
statistics), ``"sync"`` is ``hvd_balance.SyncBatchNormalization`` (statistics over the global
batch). TensorFlow is imported inside the functions, so the driver imports this module without it.
"""

from __future__ import annotations

import importlib.util

import numpy as np

CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
MAX_SHIFT = 8          # pixels, each way
IMAGE_NOISE = 1.5      # Gaussian noise std, in units of the class patterns' std
VOCAB = 2000
SEQ_LEN = 32
TOPIC_TOKENS = 40
TOPIC_SHARE = 0.15     # the share of a sequence's tokens drawn from its class's topic
BATCH_NORMS = ("sync", "local")


def sync_batch_norm_available() -> bool:
    """Whether ``hvd_balance.SyncBatchNormalization`` exists (without importing TensorFlow)."""
    return importlib.util.find_spec("hvd_balance.keras.sync_batch_norm") is not None


def batch_norm_class(batch_norm: str):
    """The batch-normalization layer class for ``"sync"`` or ``"local"``."""
    import tensorflow as tf

    if batch_norm == "local":
        return tf.keras.layers.BatchNormalization
    if batch_norm == "sync":
        if not sync_batch_norm_available():
            raise ValueError("batch_norm='sync' needs hvd_balance.SyncBatchNormalization "
                             "(hvd_balance/keras/sync_batch_norm.py), which this checkout lacks; "
                             "use batch_norm='local'")
        import hvd_balance

        return hvd_balance.SyncBatchNormalization
    raise ValueError(f"unknown batch_norm {batch_norm!r}; choose one of {BATCH_NORMS}")


def resnet_layers(batch_norm: str = "local"):
    """The small ResNet's layers, for a ``Sequential`` model on ``IMAGE_SHAPE`` inputs."""
    import tensorflow as tf

    L = tf.keras.layers
    Norm = batch_norm_class(batch_norm)

    class ResidualBlock(L.Layer):
        """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; the shortcut is a strided 1x1
        convolution and batch normalization when the shape changes, else ``x``."""

        def __init__(self, filters: int, stride: int = 1, **kwargs):
            super().__init__(**kwargs)
            self.filters, self.stride = filters, stride
            self.conv1 = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)
            self.bn1 = Norm()
            self.conv2 = L.Conv2D(filters, 3, padding="same", use_bias=False)
            self.bn2 = Norm()
            self.project = None
            if stride != 1:
                self.project = L.Conv2D(filters, 1, strides=stride, use_bias=False)
                self.bn_project = Norm()

        def build(self, input_shape):
            # A stage's first block also projects when only the channel count changes.
            if self.project is None and input_shape[-1] != self.filters:
                self.project = L.Conv2D(self.filters, 1, use_bias=False)
                self.bn_project = Norm()
            super().build(input_shape)

        def call(self, inputs, training=None):
            h = tf.nn.relu(self.bn1(self.conv1(inputs), training=training))
            h = self.bn2(self.conv2(h), training=training)
            shortcut = inputs
            if self.project is not None:
                shortcut = self.bn_project(self.project(inputs), training=training)
            return tf.nn.relu(h + shortcut)

    return [L.Conv2D(16, 3, padding="same", use_bias=False), Norm(), L.ReLU(),
            ResidualBlock(16), ResidualBlock(32, stride=2), ResidualBlock(64, stride=2),
            L.GlobalAveragePooling2D(), L.Dense(CLASSES)]


def text_layers():
    """The text model's layers, for a ``Sequential`` model on ``(SEQ_LEN,)`` int32 tokens."""
    import tensorflow as tf

    L = tf.keras.layers
    return [L.Embedding(VOCAB, 64), L.Conv1D(128, 5, activation="relu"), L.GlobalMaxPooling1D(),
            L.Dense(64, activation="relu"), L.Dense(CLASSES)]


def make_images(samples: int, heldout: int, seed: int):
    """``(x, y, x_heldout, y_heldout)``: float32 images of ``IMAGE_SHAPE``, int32 labels.

    The class patterns come from ``seed``; the training and held-out images are drawn from
    the same distribution, the held-out ones after the training ones (so the training set does
    not depend on ``heldout``).
    """
    rng = np.random.default_rng(seed)
    # Smooth patterns: an 8x8 grid of random colours, upsampled 4x, blurred by a 3-pixel box.
    side = IMAGE_SHAPE[0]
    coarse = rng.standard_normal((CLASSES, 8, 8, 3)).astype(np.float32)
    patterns = np.kron(coarse, np.ones((1, side // 8, side // 8, 1), np.float32))
    for axis in (1, 2):
        patterns = (patterns + np.roll(patterns, 1, axis) + np.roll(patterns, -1, axis)) / 3
    patterns /= patterns.std()
    pixels = np.arange(side)

    def draw(n: int):
        y = rng.integers(0, CLASSES, size=n).astype(np.int32)
        shift = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=(n, 2))
        contrast = rng.uniform(0.7, 1.3, size=(n, 1, 1, 1)).astype(np.float32)
        # Each image its class's pattern rolled (wrapping around) by its own shift.
        rows = (pixels[None, :] - shift[:, :1]) % side
        cols = (pixels[None, :] - shift[:, 1:]) % side
        x = patterns[y[:, None, None], rows[:, :, None], cols[:, None, :]]
        x *= contrast
        x += IMAGE_NOISE * rng.standard_normal(x.shape, dtype=np.float32)
        return x, y

    x, y = draw(samples)
    x_test, y_test = draw(heldout)
    return x, y, x_test, y_test


def make_tokens(samples: int, heldout: int, seed: int):
    """``(x, y, x_heldout, y_heldout)``: int32 token sequences ``(n, SEQ_LEN)``, int32 labels;
    the topics come from ``seed``, the held-out sequences are drawn after the training ones."""
    rng = np.random.default_rng(seed)
    topics = np.stack([rng.choice(VOCAB, TOPIC_TOKENS, replace=False) for _ in range(CLASSES)])

    def draw(n: int):
        y = rng.integers(0, CLASSES, size=n).astype(np.int32)
        background = rng.integers(0, VOCAB, size=(n, SEQ_LEN))
        topical = topics[y[:, None], rng.integers(0, TOPIC_TOKENS, size=(n, SEQ_LEN))]
        from_topic = rng.random((n, SEQ_LEN)) < TOPIC_SHARE
        return np.where(from_topic, topical, background).astype(np.int32), y

    x, y = draw(samples)
    x_test, y_test = draw(heldout)
    return x, y, x_test, y_test
