"""examples/torch_fsdp.py, a plain FSDP2 script made balanced, runs as it stands on 2 ranks."""

import re

from support.torchrun import run_torchrun


def test_torch_fsdp_example_trains_three_epochs_with_plans_summing_to_the_global_batch():
    run = run_torchrun("examples/torch_fsdp.py", nproc=2, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:]
    epochs = re.findall(r"epoch (\d): loss ([0-9.]+), local batches \[(\d+), (\d+)\]", run.stdout)
    assert [int(e[0]) for e in epochs] == [0, 1, 2], run.stdout[-3000:]
    assert all(int(a) + int(b) == 64 for _, _, a, b in epochs)
    assert float(epochs[-1][1]) < 0.5 * float(epochs[0][1]), epochs
