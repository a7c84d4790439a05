"""hvd_balance.torch.membership and .state_sync in one process (the multi-rank cases are in
test_long_jobs.py and test_leave_out.py)."""

import pytest
import torch

from hvd_balance.torch import membership, state_sync


def test_lost_s_comes_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(membership.LOST_ENV, raising=False)
    assert membership.lost_seconds() == 20.0
    assert membership.lost_seconds(4) == 4.0
    monkeypatch.setenv(membership.LOST_ENV, "7.5")
    assert membership.lost_seconds() == 7.5 and membership.lost_seconds(3) == 3.0


@pytest.mark.parametrize("given, env, named", [
    (0, None, "lost_s must be a number of seconds > 0; got 0"),
    (True, None, "lost_s must be a number of seconds > 0; got True"),
    ("soon", None, "lost_s must be a number of seconds > 0; got 'soon'"),
    (None, "-1", "$HVD_BALANCE_LOST_S must be a number of seconds > 0; got '-1'"),
    (None, "inf", "$HVD_BALANCE_LOST_S must be a number of seconds > 0; got 'inf'")])
def test_a_bad_lost_s_is_refused_naming_it_and_where_it_came_from(monkeypatch, given, env, named):
    monkeypatch.delenv(membership.LOST_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(membership.LOST_ENV, env)
    with pytest.raises(ValueError, match=named.replace("$", r"\$")):
        membership.lost_seconds(given)


def adam_after_steps(steps=2):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    return opt


def test_a_state_dict_splits_into_tensors_and_a_small_skeleton_and_joins_back():
    state = adam_after_steps().state_dict()
    tensors = []
    skeleton = state_sync._split(state, tensors)
    assert len(tensors) == 6  # step, exp_avg, exp_avg_sq for weight and bias
    assert "tensor(" not in repr(skeleton)  # only the structure is left to pickle
    places = state_sync._placeholders(skeleton)
    assert [p[1] for p in places] == list(range(6))
    assert [p[2] for p in places] == [tuple(t.shape) for t in tensors]
    joined = state_sync._join(skeleton, [t.clone() for t in tensors])
    assert joined["param_groups"] == state["param_groups"]
    for key in state["state"]:
        for name, value in state["state"][key].items():
            assert torch.equal(joined["state"][key][name], value)


def test_a_per_batch_scheduler_or_a_scaler_not_shared_is_named():
    opt = adam_after_steps()
    per_batch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(5):
        per_batch.step()
    assert state_sync.unshared_per_step_state(opt, [], epoch_ends=1) == ["LambdaLR"]
    assert state_sync.unshared_per_step_state(opt, [per_batch], epoch_ends=1) == []
    assert state_sync.unshared_per_step_state(opt, [], epoch_ends=6) == []  # once an epoch
    other = adam_after_steps()
    assert state_sync.unshared_per_step_state(other, [], epoch_ends=1) == []  # not this optimizer
