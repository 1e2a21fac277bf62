"""MLP-M4 on a small slice of the real M4 Weekly data: every sorter trains, modes agree, the worker split
and the metrics are what the script says."""
import argparse
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.comm import LocalCommunicator
from common.errors import UserFacingError
from sorters import SORTER_NAMES
from tests.helpers import (DATA_DIR, REPO, check_run_files, check_torchrun_agrees, check_trained_two_epochs,
                           metrics_header, needs_data, run_every_sorter)

pytestmark = needs_data("m4/Weekly-train.csv", "m4/Weekly-test.csv")
SCRIPT = "main-MLP-M4.py"
# 2 workers x 2 windows per step, 64 windows per worker (32 steps per epoch); lr 5e-4 keeps epoch 2
# in the fast initial descent for every sorter and seed tried
QUICK = ["--B", "4", "--node_cnt", "2", "--lr", "5e-4", "--max-train-examples", "128",
         "--max-eval-examples", "128", "--epochs", "2", "--record-orders"]
RESULT_COLUMNS = ("train_loss", "test_loss", "valid_loss", "test_smape")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-epoch run per sorter in one process, shared by the tests below."""
    return run_every_sorter(SCRIPT, tmp_path_factory.mktemp("m4"), *QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("sorter", SORTER_NAMES)
def test_every_sorter_trains_and_writes_the_run_directory(runs, sorter):
    out = runs[sorter]
    assert metrics_header(out) == ["epoch", "train_loss", "test_loss", "valid_loss", "test_smape", "epoch_seconds",
                                   "sorter_seconds", "comm_seconds", "compute_seconds", "comm_bytes",
          "syncs", "mean_H", "density", "threshold", "load_imbalance"]
    rows, config = check_trained_two_epochs(out, RESULT_COLUMNS)
    for r in rows:
        assert 0 < r["test_smape"] < 200
    assert config["sizes"] == {"n_workers": 2, "world_size": 1, "workers_per_process": 2, "units_per_worker": 64,
                               "units_per_step": 2, "steps_per_epoch": 32, "d": 5_569, "global_batch": 4}
    assert config["data"]["train_windows_used"] == 128 and config["data"]["test_horizon"] == 13
    check_run_files(out, epochs=2, m=64)


@pytest.mark.slow
@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR"])
def test_one_process_and_torchrun_give_the_same_orders_and_losses(runs, tmp_path, sorter):
    check_torchrun_agrees(SCRIPT, runs[sorter], tmp_path / "nproc2", "--sorter", sorter, *QUICK,
                          columns=RESULT_COLUMNS)


# ---------------------------------------------------------------- the task in-process (no training run)

def task_args(**changes):
    args = dict(data_dir=str(DATA_DIR), freq="Weekly", in_len=20, hidden=64, layers=3, B=6, node_cnt=2,
                seed=0, max_train_examples=1000, max_eval_examples=None, partition="random")
    return argparse.Namespace(**{**args, **changes})


def test_worker_split_units_and_metrics():
    spec = importlib.util.spec_from_file_location("main_mlp_m4", REPO / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = module.load_m4(DATA_DIR)
    module.load_m4 = lambda *args, **kwargs: data  # read once for the several tasks built below
    torch.manual_seed(0)
    task = module.MLPM4(task_args(), torch.device("cpu"))
    # k = B/n = 3 windows per worker per step; m = 1000 // 2 = 500 rounded down to a multiple of 6
    assert (task.n_workers, task.n_units, task.units_per_step, task.model.d) == (2, 498, 3, 5_569)
    # the split: a seeded shuffle of the first 1000 windows, 2 x 498 of them, no window twice
    used = task.worker_x.reshape(-1, 20)
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:996]
    assert torch.equal(used, data.train_x[ids]) and torch.equal(task.worker_y.reshape(-1, 6), data.train_y[ids])
    other = module.MLPM4(task_args(seed=1), torch.device("cpu"))
    assert not torch.equal(other.worker_x, task.worker_x)
    # the sweep's settings on all 107,384 windows: the paper's figure (4 workers, B 16; m = 26,846 rounded
    # down to a multiple of B/n = 4) and the original README (32 workers, B 32)
    for node_cnt, B, m in ((4, 16, 26_844), (32, 32, 3_354)):
        full = module.MLPM4(task_args(node_cnt=node_cnt, B=B, max_train_examples=None), torch.device("cpu"))
        assert (full.n_workers, full.n_units, full.units_per_step) == (node_cnt, m, B // node_cnt)

    # units: worker-major, k windows each
    x, y = task.units([0, 1], torch.tensor([[4, 0, 7], [1, 2, 3]]))
    assert torch.equal(x, torch.stack([task.worker_x[0, 4], task.worker_x[0, 0], task.worker_x[0, 7],
                                       task.worker_x[1, 1], task.worker_x[1, 2], task.worker_x[1, 3]]))
    assert y.shape == (6, 6)
    grads, losses = task.unit_grads(task.model.flat, (x, y), 2, 3)
    assert grads.shape == (2, 3, 5_569) and losses.shape == (2, 3)
    # the hand-written rollout backward (models.mlp.window_gradients) agrees with the general vmap path
    task.unit_grad_path = "vmap"
    vmap_grads, vmap_losses = task.unit_grads(task.model.flat, (x, y), 2, 3)
    task.unit_grad_path = "auto"
    torch.testing.assert_close(grads, vmap_grads, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(losses, vmap_losses)

    # metrics: every window weighs the same; the test rollout covers the 13-week horizon; sMAPE as stated
    flat = task.model.flat
    with torch.no_grad():
        metrics = task.evaluate(flat, LocalCommunicator(2))
        pred_train = task.model(flat, used, 6)
        pred_test = task.model(flat, data.test_x, 13)
        valid = F.mse_loss(task.model(flat, data.valid_x, 6), data.valid_y).item()
    assert metrics["train_loss"] == pytest.approx(F.mse_loss(pred_train, data.train_y[ids]).item(), rel=1e-5)
    assert metrics["valid_loss"] == pytest.approx(valid, rel=1e-5)
    assert metrics["test_loss"] == pytest.approx(F.mse_loss(pred_test, data.test_y).item(), rel=1e-5)
    p = pred_test.double() * data.test_std[:, None].double() + data.test_mean[:, None].double()
    t = data.test_y.double() * data.test_std[:, None].double() + data.test_mean[:, None].double()
    assert metrics["test_smape"] == pytest.approx((200 * (p - t).abs() / (p.abs() + t.abs())).mean().item(), rel=1e-4)

    with pytest.raises(UserFacingError, match="too few"):
        module.MLPM4(task_args(max_train_examples=5), torch.device("cpu"))
