"""LSTM-Wiki2's evaluation on small real slices of WikiText-2: the batched evaluation (a process's column
blocks side by side, NLL summed on the device) gives the numbers of the per-block evaluation it replaced,
whatever the number of processes; it keeps its forwards within EVAL_TOKENS; and it reads the host once
per evaluation, not once per forward."""
import argparse
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from engine.comm import LocalCommunicator
from engine.task import shard, sum_over_processes
from tests.helpers import DATA_DIR, REPO, needs_data
from tests.test_host_sync import HostReads

pytestmark = needs_data("wikitext-2/train.txt", "wikitext-2/valid.txt", "wikitext-2/test.txt")
SPLITS = ("train", "valid", "test")

# (B, node_cnt, bptt, max-eval-examples, max-train-examples, EVAL_TOKENS): what each exercises
CASES = {
    # one group of 4 columns, 3 chunks per forward: 7 eval chunks = 3 + 3 + 1
    "remainder": (4, 2, 5, 7, 6, 60),
    # one chunk of all 8 columns exceeds EVAL_TOKENS: 2 groups of 2 blocks, 1 chunk per forward
    "two-groups": (8, 4, 5, 9, 6, 24),
    # 3 blocks of 2 columns side by side, 2 chunks per forward: 5 = 2 + 2 + 1
    "three-workers": (6, 3, 7, 5, 4, 100),
    # groups of 3 blocks and of 1 block (9 and 3 columns): 1 and 3 chunks per forward
    "uneven-groups": (12, 4, 4, 11, 6, 40),
    "one-worker": (4, 1, 5, 4, 4, None),
    # the paper's B, n and bptt at the script's EVAL_TOKENS: 16 columns, 1 chunk per forward
    "paper": (16, 4, 35, 3, 3, None),
}


@pytest.fixture(scope="module")
def script():
    """main-LSTM-Wiki2.py as a module, its WikiText-2 read once for every task built here."""
    spec = importlib.util.spec_from_file_location("main_lstm_wiki2_eval", REPO / "main-LSTM-Wiki2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus = module.load_wikitext2(DATA_DIR)
    module.load_wikitext2 = lambda data_dir: corpus
    return module


def build(script, monkeypatch, case):
    """The case's task (float32, on the CPU) at random parameters large enough that the carried hidden
    state moves the loss well beyond the tolerance (at the initial ones every token costs about ln V)."""
    B, n, bptt, max_eval, max_train, eval_tokens = CASES[case]
    if eval_tokens is not None:
        monkeypatch.setattr(script, "EVAL_TOKENS", eval_tokens)
    args = argparse.Namespace(data_dir=str(DATA_DIR), B=B, node_cnt=n, bptt=bptt, max_train_examples=max_train,
                              max_eval_examples=max_eval, clip=None, carry_hidden=False, order_unit="chunk",
                              cudnn="on")
    torch.manual_seed(0)
    task = script.LSTMWiki2(args, torch.device("cpu"))
    with torch.no_grad():
        task.model.flat.copy_(torch.randn_like(task.model.flat) * 0.5)
    return task


def per_block_mean_nll(task, flat, matrix, chunks, comm, eval_tokens):
    """The oracle: the evaluation before batching (main-LSTM-Wiki2.py's _mean_nll up to commit 1af56b7).
    The n blocks of B/n columns one after the other, each in forwards of eval_tokens // (bptt * B/n)
    chunks, the state carried through them; each forward's float32 NLL sum read on the host as a float64."""
    per_forward = max(1, eval_tokens // (task.bptt * task.mb))  # chunks per forward
    total = 0.0
    for block in shard(task.n_workers, comm):  # a fixed blocking, whatever the world size
        columns = matrix[:, block * task.mb:(block + 1) * task.mb]
        state = task.model.module.init_hidden(task.mb)
        state = tuple(s.to(device=flat.device, dtype=flat.dtype) for s in state)
        for start in range(0, chunks, per_forward):
            stop = min(start + per_forward, chunks)
            rows = columns[start * task.bptt: stop * task.bptt + 1]
            log_probs, state = task.model(flat, rows[:-1], state)
            total += F.nll_loss(log_probs, rows[1:].reshape(-1), reduction="sum").double().item()
    (total,) = sum_over_processes([total], comm)
    return total / (chunks * task.bptt * task.B)


class SimulatedRank:
    """Rank `rank` of `world_size` processes, all in this one: its all-reduce returns its own share only,
    so the shares of all ranks add up to what the real all-reduce would return."""

    def __init__(self, n_workers, world_size, rank):
        self.n_workers, self.world_size, self.rank, self.device = n_workers, world_size, rank, torch.device("cpu")

    def all_reduce_sum(self, local):
        return local.sum(dim=0)


class ForwardRecorder:
    """Stands in for task.model: records each forward's (T, b) input shape (and appends "forward" to
    `marks` when given), and hands everything to the real FlatModel."""

    def __init__(self, model, marks=None):
        self.model, self.shapes, self.marks = model, [], marks

    def __call__(self, flat, x, state):
        self.shapes.append(tuple(x.shape))
        if self.marks is not None:
            self.marks.append("forward")
        return self.model(flat, x, state)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("case", CASES)
def test_batched_evaluation_equals_the_per_block_one(script, monkeypatch, case):
    task = build(script, monkeypatch, case)
    flat, n = task.model.flat, task.n_workers
    with torch.no_grad():
        batched = task.evaluate(flat, LocalCommunicator(n))
        for split in SPLITS:
            oracle = per_block_mean_nll(task, flat, *task.eval_matrices[split], LocalCommunicator(n),
                                        script.EVAL_TOKENS)
            assert batched[f"{split}_loss"] == pytest.approx(oracle, rel=1e-6, abs=0), (case, split)
            assert batched[f"{split}_ppl"] == pytest.approx(torch.tensor(oracle).exp().item(), rel=1e-5)
        # the same numbers whatever the number of processes (each evaluates its blocks; shares add up)
        for world_size in (w for w in (2, n) if 1 < w <= n and n % w == 0):
            shares = [task.evaluate(flat, SimulatedRank(n, world_size, rank)) for rank in range(world_size)]
            for split in SPLITS:
                total = sum(share[f"{split}_loss"] for share in shares)
                assert total == pytest.approx(batched[f"{split}_loss"], rel=1e-6, abs=0), (case, world_size, split)


@pytest.mark.parametrize("case", ["remainder", "two-groups", "uneven-groups", "paper"])
def test_forwards_stay_within_eval_tokens_and_cover_every_token_once(script, monkeypatch, case):
    task = build(script, monkeypatch, case)
    recorder = ForwardRecorder(task.model)
    monkeypatch.setattr(task, "model", recorder)
    with torch.no_grad():
        task.evaluate(task.model.flat, LocalCommunicator(task.n_workers))
    bound = max(script.EVAL_TOKENS, task.bptt * task.mb)  # one chunk of one block when that is more
    assert all(T * b <= bound and T % task.bptt == 0 for T, b in recorder.shapes), recorder.shapes
    expected = sum(chunks * task.bptt * task.B for _, chunks in task.eval_matrices.values())
    assert sum(T * b for T, b in recorder.shapes) == expected
    # columns side by side: fewer forwards than one block at a time would take
    assert len({b for _, b in recorder.shapes} - {task.mb}) > 0


def test_one_host_read_per_evaluation_not_per_forward(script, monkeypatch):
    task = build(script, monkeypatch, "remainder")
    flat, comm = task.model.flat, LocalCommunicator(task.n_workers)
    with torch.no_grad(), HostReads() as mode:
        monkeypatch.setattr(task, "model", ForwardRecorder(task.model, marks=mode.reads))
        task.evaluate(flat, comm)
    forwards = mode.reads.count("forward")
    assert forwards == 2 + 3 + 3  # train 6 chunks, valid and test 7, at 3 chunks per forward
    # every forward first, then the reduction's read of the three sums (.cpu() and .tolist())
    assert mode.reads == ["forward"] * forwards + ["cpu", "tolist"], mode.reads

    # the detector sees the per-forward reads of the per-block evaluation
    with torch.no_grad(), HostReads() as mode:
        per_block_mean_nll(task, flat, *task.eval_matrices["valid"], comm, script.EVAL_TOKENS)
    assert mode.reads.count("item") == task.n_workers * 2  # 2 blocks x forwards of 6 and 1 chunks
