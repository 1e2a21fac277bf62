"""LSTM-Wiki2 on a small slice of the real WikiText-2: every sorter trains, modes agree, the task's pieces
(units, per-chunk gradients, carried hidden state, evaluation blocking) do what the script says."""
import argparse
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.comm import LocalCommunicator
from common.errors import UserFacingError
import engine.functional
from engine.functional import batch_gradient
from sorters import SORTER_NAMES
from tests.helpers import (DATA_DIR, ENGINE_PATH_TWINS, REPO, check_run_files, check_torchrun_agrees,
                           check_trained_two_epochs, metrics_header, needs_data, run_every_sorter)

pytestmark = needs_data("wikitext-2/train.txt", "wikitext-2/valid.txt", "wikitext-2/test.txt")
SCRIPT = "main-LSTM-Wiki2.py"
# 2 workers x 2 columns, 10-token chunks, 12 chunks (= steps per epoch); lr 2 falls fast from ln(33278)
QUICK = ["--B", "4", "--node_cnt", "2", "--bptt", "10", "--lr", "2", "--max-train-examples", "12",
         "--max-eval-examples", "2", "--epochs", "2", "--record-orders"]
RESULT_COLUMNS = ("train_loss", "test_loss", "valid_loss", "train_ppl", "valid_ppl", "test_ppl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-epoch run per sorter in one process, shared by the tests below."""
    return run_every_sorter(SCRIPT, tmp_path_factory.mktemp("lstm"), *QUICK, skip=ENGINE_PATH_TWINS)


@pytest.mark.slow
@pytest.mark.parametrize("sorter", [name for name in SORTER_NAMES if name not in ENGINE_PATH_TWINS])
def test_every_sorter_trains_and_writes_the_run_directory(runs, sorter):
    out = runs[sorter]
    assert metrics_header(out) == ["epoch", "train_loss", "test_loss", "valid_loss", "train_ppl", "valid_ppl",
                                   "test_ppl", "epoch_seconds", "sorter_seconds", "comm_seconds",
                                   "compute_seconds", "comm_bytes",
          "syncs", "mean_H", "density", "threshold", "load_imbalance"]
    rows, config = check_trained_two_epochs(out, RESULT_COLUMNS)
    for r in rows:
        for split in ("train", "valid", "test"):
            assert r[f"{split}_ppl"] == pytest.approx(torch.tensor(r[f"{split}_loss"]).exp().item(), rel=1e-6)
    assert config["sizes"] == {"n_workers": 2, "world_size": 1, "workers_per_process": 2, "units_per_worker": 12,
                               "units_per_step": 1, "steps_per_epoch": 12, "d": 1_081_792, "global_batch": 4}
    assert config["data"]["train_chunks_used"] == 12 and config["data"]["vocab_size"] == 33_278
    check_run_files(out, epochs=2, m=12)


@pytest.mark.slow
@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR"])
def test_one_process_and_torchrun_give_the_same_orders_and_losses(runs, tmp_path, sorter):
    check_torchrun_agrees(SCRIPT, runs[sorter], tmp_path / "nproc2", "--sorter", sorter, *QUICK,
                          columns=RESULT_COLUMNS)


# ---------------------------------------------------------------- the task in-process (no training run)

def load_script():
    spec = importlib.util.spec_from_file_location("main_lstm_wiki2", REPO / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus = module.load_wikitext2(DATA_DIR)  # read once for the several tasks built below
    module.load_wikitext2 = lambda data_dir: corpus
    return module


def task_args(**changes):
    args = dict(data_dir=str(DATA_DIR), B=4, node_cnt=2, bptt=5, max_train_examples=6, max_eval_examples=3,
                clip=None, carry_hidden=False, order_unit="chunk", cudnn="on")
    return argparse.Namespace(**{**args, **changes})


def test_units_gradients_hidden_state_and_evaluation():
    module = load_script()
    torch.manual_seed(0)
    task = module.LSTMWiki2(task_args(), torch.device("cpu"))
    flat, train, T = task.model.flat, task.train_matrix, 5
    assert (task.n_units, task.units_per_step, task.n_chunks) == (6, 1, 6)

    # chunk unit: worker r's chunk i is rows [5i, 5i+5) of columns [2r, 2r+2), targets one row down
    inputs, targets, h0, c0 = task.units([0, 1], torch.tensor([[3], [1]]))
    assert torch.equal(inputs[0], train[15:20, 0:2]) and torch.equal(targets[0], train[16:21, 0:2])
    assert torch.equal(inputs[1], train[5:10, 2:4]) and torch.equal(targets[1], train[6:11, 2:4])
    assert not h0.any() and h0.shape == (2, 2, 2, 32)

    # per-chunk gradients equal one backward of that worker's chunk loss
    grads, losses = task.unit_grads(flat, (inputs, targets, h0, c0), 2, 1)
    assert grads.shape == (2, 1, task.model.d)
    for r in range(2):
        p = flat.clone().requires_grad_(True)
        log_probs, _ = task.model(p, inputs[r], (h0[r], c0[r]))
        loss = F.nll_loss(log_probs, targets[r].reshape(-1))
        torch.testing.assert_close(grads[r, 0], torch.autograd.grad(loss, p)[0])
        torch.testing.assert_close(losses[r, 0], loss.detach())
    # the same in passes of one unit, and from the loop of one backward per unit (units_per_pass 0)
    batched, batched_losses = grads.clone(), losses.clone()  # the next call reuses the buffer
    for per_pass in (1, 0):
        task.units_per_pass = per_pass
        other, other_losses = task.unit_grads(flat, (inputs, targets, h0, c0), 2, 1)
        torch.testing.assert_close(other, batched, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(other_losses, batched_losses)
    task.units_per_pass = module.UNITS_PER_PASS
    grads, losses = task.unit_grads(flat, (inputs, targets, h0, c0), 2, 1)
    # ... and their mean is the batch gradient the non-balancing sorters use
    mean_grad, _, _ = batch_gradient(task.loss, flat, (inputs, targets, h0, c0))
    torch.testing.assert_close(mean_grad, grads.mean((0, 1)), rtol=1e-4, atol=1e-7)

    # evaluation (blocks of B/n columns side by side) = plain B-column evaluation, hidden carried chunk to chunk
    valid, chunks = task.eval_matrices["valid"]
    with torch.no_grad():
        blocked = task.evaluate(flat, LocalCommunicator(2))["valid_loss"]
        state, total = task.model.module.init_hidden(4), 0.0
        for i in range(chunks):
            log_probs, state = task.model(flat, valid[T * i:T * i + T], state)
            total += F.nll_loss(log_probs, valid[T * i + 1:T * i + T + 1].reshape(-1), reduction="sum").item()
    assert blocked == pytest.approx(total / (chunks * T * 4), rel=1e-5)

    # example unit: worker r's unit u is column r*mb + u % mb of chunk u // mb
    example = module.LSTMWiki2(task_args(order_unit="example"), torch.device("cpu"))
    assert (example.n_units, example.units_per_step) == (12, 2)
    inputs, targets, _, _ = example.units([0, 1], torch.tensor([[5, 0], [2, 11]]))
    assert inputs.shape == (4, T, 1)
    for i, (chunk, column) in enumerate([(2, 1), (0, 0), (1, 2), (5, 3)]):
        assert torch.equal(inputs[i, :, 0], train[T * chunk:T * chunk + T, column])
        assert torch.equal(targets[i, :, 0], train[T * chunk + 1:T * chunk + T + 1, column])

    # carried hidden state: both gradient paths hand the chunk's final state to the next step
    carry = module.LSTMWiki2(task_args(carry_hidden=True), torch.device("cpu"))
    carry.start_epoch(1)
    batch = carry.units([0, 1], torch.tensor([[3], [1]]))
    carry.unit_grads(flat, batch, 2, 1)
    carry.end_step(None)
    via_unit_grads = tuple(s.clone() for s in carry.hidden)
    carry.start_epoch(1)
    _, _, aux = batch_gradient(carry.loss, flat, carry.units([0, 1], torch.tensor([[3], [1]])))
    carry.end_step(aux)
    for r in range(2):
        _, (h, c) = carry.model(flat, batch[0][r], (torch.zeros(2, 2, 32), torch.zeros(2, 2, 32)))
        torch.testing.assert_close(via_unit_grads[0][r], h)
        torch.testing.assert_close(via_unit_grads[1][r], c)
        torch.testing.assert_close(carry.hidden[0][r], h, rtol=1e-5, atol=1e-6)
    inputs, _, h0, c0 = carry.units([0, 1], torch.tensor([[0], [5]]))
    assert torch.equal(h0, carry.hidden[0]) and h0.abs().sum() > 0
    carry.start_epoch(2)
    assert not carry.hidden[0].any()

    with pytest.raises(UserFacingError, match="--carry-hidden needs --order-unit chunk"):
        module.LSTMWiki2(task_args(carry_hidden=True, order_unit="example"), torch.device("cpu"))
    with pytest.raises(UserFacingError, match="need at least 2"):
        module.LSTMWiki2(task_args(max_train_examples=1), torch.device("cpu"))
    assert module.LSTMWiki2(task_args(clip=0.25), torch.device("cpu")).clip_grad_norm == 0.25


def test_time_major_units_and_carried_states_copy_nothing_and_equal_unit_major_copies_bit_for_bit(monkeypatch):
    """The units are views of time-major tokens, the carried (h, c) stay in the layout their step made them:
    a D-RR step (loss) copies no tokens or states, a CD-GraB step (unit_grads) no states; both give what they
    give on contiguous unit-major copies of the same batch (the layout before), bit for bit."""
    from bench.dispatch_count import OpCounter
    module = load_script()
    torch.manual_seed(0)
    task = module.LSTMWiki2(task_args(carry_hidden=True), torch.device("cpu"))
    flat = task.model.flat
    task.start_epoch(1)
    task.hidden = tuple(torch.randn_like(s) for s in task.hidden)  # layer-major, as start_epoch lays it out
    batch = task.units([0, 1], torch.tensor([[3], [1]]))
    inputs, targets, h0, _ = batch
    assert inputs.permute(1, 0, 2).is_contiguous() and targets.permute(1, 0, 2).is_contiguous()
    unit_major = tuple(t.contiguous() for t in batch)
    assert not unit_major[0].permute(1, 0, 2).is_contiguous() and h0.data_ptr() == task.hidden[0].data_ptr()

    grad, loss, aux = (t.clone() if isinstance(t, torch.Tensor) else t for t in task.batch_grad(flat, batch))
    other_grad, other_loss, other_aux = task.batch_grad(flat, unit_major)
    assert torch.equal(grad, other_grad) and torch.equal(loss, other_loss)
    assert all(torch.equal(s, t) for s, t in zip(aux, other_aux))
    with OpCounter() as counter:  # the D-RR step on the carried states: nothing copied
        _, _, aux = task.batch_grad(flat, task.units([0, 1], torch.tensor([[0], [5]])))
        task.end_step(aux)
    assert counter.calls["aten.clone"] + counter.calls["aten.copy_"] + counter.calls["aten.cat"] == 0, counter.calls

    task.hidden = tuple(torch.randn_like(s) for s in task.hidden)
    batch = task.units([0, 1], torch.tensor([[3], [1]]))
    unit_major = tuple(t.contiguous() for t in batch)
    grads, losses = (t.clone() for t in task.unit_grads(flat, batch, 2, 1))
    states = task._pending_hidden
    other_grads, other_losses = task.unit_grads(flat, unit_major, 2, 1)
    assert torch.equal(grads, other_grads) and torch.equal(losses, other_losses)
    assert all(torch.equal(s, t) for s, t in zip(states, task._pending_hidden))
    task.end_step(None)
    with OpCounter() as counter:  # the CD-GraB step on the states the last one made: the states not copied
        task.unit_grads(flat, task.units([0, 1], torch.tensor([[0], [5]])), 2, 1)
        task.end_step(None)
    # the copies left: the model's weights onto the block-diagonal LSTM's (matrices, biases), the targets to the
    # tokens' order, the decoder's product into its columns (the CPU's way)
    assert counter.calls["aten.clone"] + counter.calls["aten.copy_"] + counter.calls["aten.cat"] <= 4, counter.calls
    # a run whose steps form per-unit gradients lays its tokens out in their order (time, column, unit): the
    # same tokens, the same gradients, states and losses bit for bit, and no copy of the targets
    task.hidden = tuple(torch.randn_like(s) for s in task.hidden)
    batch = task.units([0, 1], torch.tensor([[2], [4]]))
    cpu_way = [t.clone() for t in task.unit_grads(flat, batch, 2, 1)] + [s.clone() for s in task._pending_hidden]
    task.per_unit_steps = True
    columns_first = task.units([0, 1], torch.tensor([[2], [4]]))
    assert all(torch.equal(a, b) for a, b in zip(batch, columns_first))
    assert columns_first[1].permute(1, 2, 0).is_contiguous()
    again = [t.clone() for t in task.unit_grads(flat, columns_first, 2, 1)] + list(task._pending_hidden)
    assert all(torch.equal(a, b) for a, b in zip(cpu_way, again))
    # the GPU's way writes the product into its columns: the step's kernel ops, the gradients bit for bit
    monkeypatch.setattr(engine.functional, "PRODUCTS_INTO_SLOTS", True)
    with OpCounter() as counter:
        gpu_way = task.unit_grads(flat, columns_first, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(cpu_way, gpu_way))
    # the block weights 2, embedding 1, the LSTM 4 (2 stacks), decoder and log-softmax 2, NLL and the units' means
    # 2, their backward 3 (with the decoder's input gradient), the LSTM's 2, the tied weight's product and rows 2,
    # the LSTM's gradients 4 (2 stacks a layer)
    assert counter.kernel_ops == 22, counter.kernel_calls()
