"""hvd_balance.torch.probe_max_batch on one process: the search, what it swallows, and that
the model is left as it was."""

import pytest
import torch

import hvd_balance.torch as hb
from hvd_balance.torch.memory_probe import is_out_of_memory


def oom_above(limit):
    tried = []

    def step(batch):
        tried.append(batch)
        if batch > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch} MiB")
    return step, tried


def test_the_probe_finds_the_largest_batch_that_ran_times_the_safety():
    step, tried = oom_above(37)
    assert hb.probe_max_batch(None, None, limit=256, step=step) == 33  # floor(37 * 0.9)
    assert tried[:4] == [8, 16, 32, 64] and max(tried) == 64
    step, _ = oom_above(1000)
    assert hb.probe_max_batch(None, None, limit=256, step=step, safety=1.0) == 256


def test_an_error_other_than_out_of_memory_is_raised():
    def step(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        hb.probe_max_batch(None, None, limit=64, step=step)
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(ValueError("bad value"))


def test_not_one_sample_fitting_is_an_error():
    step, _ = oom_above(0)
    with pytest.raises(ValueError, match="a batch of 1 sample does not fit"):
        hb.probe_max_batch(None, None, limit=64, step=step)


def test_the_probe_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    net = hb.convert_sync_batchnorm(torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert hb.probe_max_batch(net, (torch.randn(3, 4),)[0], limit=32) == 28  # floor(32 * 0.9)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())


def test_a_model_error_in_the_probe_becomes_every_ranks_error():
    """distributed.all_ok (which the LoadBalancer runs the probe in) takes any exception, as
    the TensorFlow edge's does: one that escaped on the GPU ranks alone left the CPU ranks in
    the gather. In one process the gather is this rank's own."""
    from hvd_balance.torch import distributed

    class Broken(torch.nn.Module):
        def forward(self, x):
            return {"no tensor": None}["missing"]

    with pytest.raises(RuntimeError, match=r"rank 0: KeyError: 'missing' \(hvd_balance.torch.probe\)"):
        distributed.all_ok(lambda: hb.probe_max_batch(Broken(), torch.zeros(1, 4), limit=8),
                           "hvd_balance.torch.probe")
