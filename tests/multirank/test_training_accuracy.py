"""Balanced training with unequal local batches learns as well as one process on the global batch."""
import json
import subprocess
import sys

import pytest

from support import REPO, run_ranks, rank_env

EXAMPLE = "examples/train_digits.py"
# Three epochs: one process reaches 0.99 after the first; more would only cost CI minutes.
ARGS = ["--epochs", "3", "--global-batch", "128", "--seed", "0"]


@pytest.mark.slow  # accuracy after 3 epochs; the exactness tests prove the update itself
@pytest.mark.timeout(600)
def test_digits_two_unequal_ranks_match_single_process_accuracy(tmp_path):
    single = subprocess.run([sys.executable, EXAMPLE, *ARGS, "--json", str(tmp_path / "one.json")],
                            cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=280)
    assert single.returncode == 0, single.stderr[-3000:]
    run = run_ranks(EXAMPLE, np=2, timeout=280,
                    args=[*ARGS, "--batches", "96,32", "--json", str(tmp_path / "two.json")])
    assert run.returncode == 0, run.stdout[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["plan"]["batch_sizes"] == [96, 32]
    acc_one, acc_two = one["history"]["val_accuracy"][-1], two["history"]["val_accuracy"][-1]
    assert acc_one > 0.9, one["history"]
    assert abs(acc_two - acc_one) <= 0.02, (acc_one, acc_two)
