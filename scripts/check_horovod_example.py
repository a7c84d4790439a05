"""Run Horovod's own Keras example on hvd_balance.keras, with its import line changed.

    python scripts/check_horovod_example.py path/to/horovod/examples/tensorflow2/tensorflow2_keras_mnist.py

Makes a copy of the example with the edits a Keras 3 user makes (the import line; Keras 3's
own demands: no ``experimental_run_tf_function`` and checkpoints as ``.keras``), runs it on 2
ranks under horovodrun, and checks that every rank ends with the same weights. The example is
not shipped here (it is Horovod's); MNIST cannot be downloaded on a machine without network,
so ``load_data`` returns scikit-learn's digits at 28x28 and ``fit`` is cut to ``--epochs``.
Exit status 0 when both ranks trained to the same weights.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

EDITS = [  # (what the user changes, pattern, replacement)
    ("the import line", r"^import horovod\.tensorflow\.keras as hvd$", "import hvd_balance.keras as hvd"),
    ("Keras 3: no experimental_run_tf_function", r",\s*experimental_run_tf_function=False\)", ")"),
    ("Keras 3: whole models as .keras", r"checkpoint-\{epoch\}\.h5", "checkpoint-{epoch}.keras"),
]

HARNESS = textwrap.dedent('''
    import hashlib, json, os
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    def load_data(path="mnist.npz"):
        d = load_digits()
        img = np.pad(np.kron(d.images, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2))) * (255 / 16)
        x, y = np.tile(img.astype("uint8"), (4, 1, 1))[:6000], np.tile(d.target.astype("uint8"), 4)[:6000]
        return (x, y), (x[:1000], y[:1000])

    tf.keras.datasets.mnist.load_data = load_data
    _fit = tf.keras.Model.fit

    def fit(self, *args, **kwargs):
        import horovod.tensorflow as h
        kwargs["epochs"] = min(kwargs.get("epochs", 1), int(os.environ["CHECK_EPOCHS"]))
        history = _fit(self, *args, **kwargs)
        weights = b"".join(np.ascontiguousarray(w).tobytes() for w in self.get_weights())
        with open(os.path.join(os.environ["CHECK_OUT"], f"rank{h.rank()}.json"), "w") as f:
            json.dump({"sha256": hashlib.sha256(weights).hexdigest(), "history": history.history}, f)
        return history

    tf.keras.Model.fit = fit
''')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("example", help="Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    text = open(args.example).read()
    for what, pattern, replacement in EDITS:
        text, n = re.subn(pattern, replacement, text, flags=re.M)
        print(f"edit: {what} ({n} place{'s' * (n != 1)})")
        if n == 0:
            raise SystemExit(f"{args.example}: nothing matches {pattern!r}; not Horovod's example?")
    work = tempfile.mkdtemp(prefix="hvd-example-")
    with open(os.path.join(work, "example.py"), "w") as f:
        f.write(text)
    with open(os.path.join(work, "sitecustomize.py"), "w") as f:
        f.write(HARNESS)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([work, repo]), CHECK_OUT=work,
               CHECK_EPOCHS=str(args.epochs), TF_CPP_MIN_LOG_LEVEL="2")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    done = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", sys.executable, "example.py"],
                          cwd=work, env=env, timeout=args.timeout)
    ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in (0, 1)
             if os.path.exists(os.path.join(work, f"rank{r}.json"))]
    for r, result in enumerate(ranks):
        print(f"rank {r}: weights sha256 {result['sha256'][:16]}..., "
              + ", ".join(f"{k} {[round(v, 4) for v in vs]}" for k, vs in result["history"].items()))
    same = len(ranks) == 2 and ranks[0]["sha256"] == ranks[1]["sha256"]
    print(f"exit status {done.returncode}; every rank ends with the same weights: {same}; files in {work}")
    return 0 if done.returncode == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
