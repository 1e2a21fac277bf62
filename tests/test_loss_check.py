"""engine.progress.LossCheck: the training loss of the steps between its host reads, from a step's mean loss
or from the losses whose mean it is (per-unit sorters hand over their units' losses, one kernel a step)."""
from types import SimpleNamespace

import pytest
import torch

from common.errors import UserFacingError
from engine import progress
from engine.comm import LocalCommunicator


def loss_check(steps):
    run = SimpleNamespace(device=torch.device("cpu"), args=SimpleNamespace(progress="off", epochs=1), writer=True,
                          task=SimpleNamespace(name="task", n_workers=2), sorter=SimpleNamespace(name="CD-GraB"),
                          steps_per_epoch=steps, comm=LocalCommunicator(2))
    return progress.LossCheck(run, epoch=1, epochs_saved=False)


@pytest.mark.parametrize("shape", [(), (2, 3), (2,)])
def test_the_checked_loss_is_the_mean_of_the_steps_means_whatever_each_step_hands_over(monkeypatch, shape):
    monkeypatch.setattr(progress, "LOSS_CHECK_EVERY", 4)
    losses = torch.rand(10, *shape, generator=torch.Generator().manual_seed(0))
    check = loss_check(10)
    for step in range(10):
        check.add(losses[step], step)
        if step == 3:  # the first window: steps 0-3
            assert check.epoch_loss == pytest.approx(losses[:4].double().reshape(4, -1).mean(1).sum().item(), rel=1e-12)
    means = losses.double().reshape(10, -1).mean(1)
    assert check.epoch_loss / check.checked_step == pytest.approx(means.mean().item(), rel=1e-12)
    assert check.checked_step == 10


def test_a_scalar_then_the_units_losses_keep_what_was_summed_and_a_nan_unit_stops_the_run(monkeypatch):
    monkeypatch.setattr(progress, "LOSS_CHECK_EVERY", 50)
    check = loss_check(4)
    check.add(torch.tensor(1.0), 0)
    check.add(torch.tensor([[2.0, 4.0]]), 1)  # a mean of 3
    check.add(torch.tensor([[1.0, 3.0]]), 2)
    check.add(torch.tensor([[0.0, 2.0]]), 3)
    assert check.epoch_loss == pytest.approx(1 + 3 + 2 + 1)
    check = loss_check(2)
    check.add(torch.tensor([[1.0, float("nan")]]), 0)
    with pytest.raises(UserFacingError, match="training loss became nan"):
        check.add(torch.tensor([[1.0, 2.0]]), 1)
