"""Sketches from layer records (issue 20, item 2): GradientSketch's TensorSketch blocks are the map their
docstring states, with unbiased inner products of the variance derived in docs/sketching.md; the records
path (FlatModel.outer_unit_sketches, Task.unit_sketches) gives the same sketches and update as the
materialise-then-sketch path for Linear stacks and a tiny tied GPT-2; exact CD-GraB and models without a
large weight keep their path and map."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from engine.comm import GradientExchange, LocalCommunicator
from engine import functional
from engine.functional import FlatModel, unit_gradients
from engine.sketching import STRUCTURED_MIN_NUMEL, make_sketch
from engine.task import Task
from engine.steps import data_parallel_step
from sorters import GradientSketch
from tests.helpers import (DATA_DIR, check_ok, check_run_files, check_torchrun_agrees, needs_data, read_metrics,
                           run_script)

# ------------------------------------------------------------------------------------------- the map


def test_blocks_are_tensorsketches_and_the_rest_is_unchanged():
    """Inside a block, column (i, j) of P has its +-1 at h1(i) + h2(j) mod D with sign s1(i) s2(j); outside,
    P is the plain CountSketch of the same seed; P of a rank-one block u v^T is the circular convolution of
    the rows' and the columns' CountSketches."""
    d, dim, (offset, rows, cols) = 120, 11, (30, 7, 9)
    plain, blocked = GradientSketch(d, dim, seed=5), GradientSketch(d, dim, seed=5, blocks=[(offset, rows, cols)])
    P, Q = plain.matrix(), blocked.matrix()
    end = offset + rows * cols
    assert torch.equal(P[:, :offset], Q[:, :offset]) and torch.equal(P[:, end:], Q[:, end:])
    assert torch.equal(Q.abs().sum(0), torch.ones(d, dtype=torch.float64))
    block = blocked.block_at(offset)
    assert blocked.block_at(offset + 1) is None and blocked.family != plain.family
    for i in range(rows):
        for j in range(cols):
            column = Q[:, offset + i * cols + j]
            assert column.abs().argmax().item() == (block.h1[i] + block.h2[j]) % dim
            assert column.sum().item() == block.s1[i].item() * block.s2[j].item()
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(rows, dtype=torch.float64, generator=g), torch.randn(cols, dtype=torch.float64, generator=g)
    x = torch.zeros(d, dtype=torch.float64)
    x[offset:end] = torch.outer(u, v).reshape(-1)
    c1 = torch.zeros(dim, dtype=torch.float64).index_add_(0, block.h1, u * block.s1)
    c2 = torch.zeros(dim, dtype=torch.float64).index_add_(0, block.h2, v * block.s2)
    convolution = torch.stack([sum(c1[a] * c2[(c - a) % dim] for a in range(dim)) for c in range(dim)])
    assert torch.allclose(blocked(x), convolution, atol=1e-12)
    with pytest.raises(ValueError, match="overlaps"):
        GradientSketch(d, dim, blocks=[(0, 5, 5), (20, 2, 2)])


def tensorsketch_variance(x, y, blocks, dim):
    """The oracle (derivation in docs/sketching.md). <Px, Py> - <x, y> = sum_{p != q} s_p s_q x_p y_q [h_p = h_q];
    in its square a product of two terms has a non-zero mean only when their signs cancel. The plain
    CountSketch part: the terms (p, q), (q, p), with [h_p = h_q] of mean 1/D. Inside a block, with p = (a, b),
    q = (c, e), the signs also cancel for (p', q') = ((a', b), (a', e)) or ((a', e), (a', b)) when a = c (same
    row; [h2(b) = h2(e)], mean 1/D), likewise for same-column pairs, and for the rectangle (a, e), (c, b) when
    a != c and b != e, where both collisions hold with probability g / D^2 (g = 2 for even D, else 1)."""
    x, y = x.double(), y.double()
    cross = torch.outer(x, y)
    off = ~torch.eye(len(x), dtype=torch.bool)
    total = (cross.square() + cross * cross.T)[off].sum() / dim  # every coordinate a CountSketch coordinate
    g = 2 if dim % 2 == 0 else 1
    for offset, rows, cols in blocks:
        X = x[offset:offset + rows * cols].view(rows, cols)
        Y = y[offset:offset + rows * cols].view(rows, cols)
        for a in range(rows):
            for c in range(rows):
                for b in range(cols):
                    for e in range(cols):
                        if a == c and b != e:  # same row: the pairs of other rows a' != a
                            other = [r for r in range(rows) if r != a]
                            total += X[a, b] * Y[a, e] * sum(X[r, b] * Y[r, e] + X[r, e] * Y[r, b] for r in other) / dim
                        elif b == e and a != c:  # same column
                            other = [k for k in range(cols) if k != b]
                            total += X[a, b] * Y[c, b] * sum(X[a, k] * Y[c, k] + X[c, k] * Y[a, k] for k in other) / dim
                        elif a != c and b != e:  # the rectangles
                            total += X[a, b] * Y[c, e] * (X[a, e] * Y[c, b] + X[c, b] * Y[a, e]) * g / dim ** 2
    return float(total)


@pytest.mark.parametrize("dim", [8, 7])
def test_tensorsketch_inner_products_are_unbiased_with_the_derived_variance(dim):
    """Over 6000 maps (seeds), <Px, Py> has mean <x, y> within 4 standard errors and variance within 10 % of the
    oracle; the vectors are low rank inside the block, so the oracle is far (> 20 %) from the plain
    CountSketch's formula, and without the rectangle term it is off by more than the tolerance too."""
    rows, cols, offset, d = 6, 5, 4, 40
    blocks = [(offset, rows, cols)]
    gen = torch.Generator().manual_seed(2)
    u, v, w = (torch.randn(n, generator=gen, dtype=torch.float64) + 0.4 for n in (rows, cols, cols))
    x, y = torch.randn(d, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)
    x[offset:offset + 30] = (3 * torch.outer(u, v) + 0.3 * torch.randn(rows, cols, generator=gen)).reshape(-1)
    y[offset:offset + 30] = (2 * torch.outer(u, w) - torch.outer(u.flip(0), v)).reshape(-1)
    estimates = []
    for seed in range(6000):
        sketch = GradientSketch(d, dim, seed=seed, blocks=blocks)
        both = sketch(torch.stack([x, y]))
        estimates.append(float(both[0] @ both[1]))
    estimates = torch.tensor(estimates, dtype=torch.float64)
    variance = tensorsketch_variance(x, y, blocks, dim)
    assert abs(float(estimates.mean() - x @ y)) < 4 * math.sqrt(variance / len(estimates))
    assert estimates.var().item() == pytest.approx(variance, rel=0.10)
    countsketch = float(((x @ x) * (y @ y) + (x @ y) ** 2 - 2 * (x.square() @ y.square())) / dim)
    assert abs(countsketch / variance - 1) > 0.2


# ------------------------------------------------------------------------------------------- both paths


def mlp_like():
    """An MLP-like stack (Linear layers, one used twice like the MLP's rollout) and LR-like head, float64."""
    torch.manual_seed(0)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer, self.head = torch.nn.Linear(5, 6), torch.nn.Linear(6, 5), torch.nn.Linear(5, 1)

        def forward(self, x):
            for _ in range(2):
                x = x + self.outer(torch.tanh(self.inner(x)))
            return self.head(x)

    model = FlatModel(Stack().double())
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 1, dtype=torch.float64)

    def unit_losses(flat, batch):
        inputs, targets = batch
        return (model(flat, inputs) - targets).square().sum(1)

    return model, (x, y), unit_losses


def tiny_gpt2():
    """A tiny tied GPT-2 (vocabulary 50, width 8, 1 layer), float64: wte is both an Embedding and the decoder."""
    from models.gpt2 import build_gpt2, causal_mask

    torch.manual_seed(0)
    model = FlatModel(build_gpt2(vocab_size=50, n_embd=8, n_layer=1, n_head=2, n_positions=6).double())
    ids = torch.randint(0, 50, (5, 6), generator=torch.Generator().manual_seed(1))
    mask = causal_mask(6, torch.float64, "cpu")  # (1, 1, 6, 6), as the GPT-2 task passes it

    def unit_losses(flat, ids):
        T = ids.shape[1]
        positions = torch.arange(T)[None].expand(ids.shape[0], -1)
        logits = model(flat, input_ids=ids, position_ids=positions, attention_mask=mask[:, :, :T, :T],
                       use_cache=False).logits
        per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        return per_token.view(len(ids), -1).mean(1)

    return model, ids, unit_losses


def both_paths(model, batch, unit_losses, sketch):
    """(oracle, records path): the oracle is the map applied to the per-unit gradients of torch.func.vmap
    (engine.functional.unit_gradients, which shares no code with the layer rules), with their sum and the
    losses; the records path's sketches, the summed gradient it adds to the model's buffer, and its losses."""
    grads, losses = unit_gradients(lambda flat, units: (unit_losses(flat, units).mean(), None), model.flat, batch)
    model.grad.fill_(0.5)  # the summed gradient is added to what the buffer holds
    sketches, losses2 = model.outer_unit_sketches(unit_losses, batch, sketch)
    return (sketch(grads), grads.sum(0), losses), (sketches, model.grad - 0.5, losses2)


# how outer_unit_sketches handles the blocks: "records" every block from its layer's records (TensorBlock.add_outer,
# add_rows); "formed" every block formed per unit and scattered with its buckets (the tiny models' blocks are all
# below formed_block_numel); "mixed" blocks of more than 200 entries from the records, smaller ones formed
MODES = {"records": {"FORMED_BLOCK_PER_BUCKET": 0}, "formed": {}, "mixed": {"FORMED_BLOCK_MAX_NUMEL": 200}}


@pytest.mark.parametrize("which,mode", [("mlp-all-blocks", "records"), ("mlp-all-blocks", "formed"),
                                        ("gpt2-all-blocks", "records"), ("gpt2-all-blocks", "formed"),
                                        ("gpt2-all-blocks", "mixed"), ("gpt2-tied-only", "records"),
                                        ("gpt2-tied-only", "formed"), ("gpt2-no-blocks", "formed")])
def test_records_and_materialise_paths_give_the_same_sketch(which, mode, monkeypatch):
    """float64, so that the summation orders agree to about 1e-15 relative; the tolerance is 1e-12 of the
    largest entry. The tied wte gets its Embedding lookups and its decoder products in one block, from the
    records or formed."""
    for name, value in MODES[mode].items():
        monkeypatch.setattr(functional, name, value)
    model, batch, unit_losses = (mlp_like if which.startswith("mlp") else tiny_gpt2)()
    blocks = model.sketch_blocks(0)
    if which == "gpt2-tied-only":
        wte = model.module.transformer.wte.weight
        blocks = [b for b in blocks if b[0] == model.offsets[id(wte)]]
        assert blocks == [(model.offsets[id(wte)], 50, 8)] and model.module.lm_head.weight is wte
    elif which == "gpt2-no-blocks":
        blocks = []
    sketch = GradientSketch(model.d, 16, seed=3, blocks=blocks)
    assert len(sketch.blocks) == len(blocks) and (which == "gpt2-no-blocks" or sketch.blocks)
    (want, want_sum, want_losses), (got, got_sum, got_losses) = both_paths(model, batch, unit_losses, sketch)
    assert got.shape == want.shape == (len(want_losses), 16)
    scale = want.abs().max().item()
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * scale), (got - want).abs().max()
    assert torch.allclose(got_sum, want_sum, rtol=0, atol=1e-12 * want_sum.abs().max().item())
    assert torch.allclose(got_losses, want_losses, rtol=1e-14, atol=0)
    # the blocks sketched from the records are those above the limit, every other coordinate is formed per unit
    layout = model._sketch_layout(sketch)
    large = {(b.offset, b.rows, b.cols) for b in sketch.blocks if b.rows * b.cols > functional.formed_block_numel(b)}
    assert {(b.offset, b.rows, b.cols) for b in layout["records"].values()} == large
    assert layout["numel"] == model.d - sum(rows * cols for _, rows, cols in large)
    assert not sketch.blocks or (mode == "records") == (layout["numel"] == len(sketch.outside))
    assert mode != "mixed" or 0 < len(large) < len(sketch.blocks)


def test_records_path_refuses_a_block_that_is_part_of_a_parameter():
    """A block that covers part of a parameter (not one of sketch_blocks' whole weights) cannot be formed."""
    model, batch, unit_losses = mlp_like()
    offset = model.offsets[id(model.module.inner.weight)]
    sketch = GradientSketch(model.d, 16, seed=3, blocks=[(offset, 2, 5)])  # 2 of the 6 rows
    with pytest.raises(ValueError, match="covers part of the parameter"):
        model.outer_unit_sketches(unit_losses, batch, sketch)


# ------------------------------------------------------------------------------------------- the engine


class TinyGPT2Task(Task):
    """Tiny GPT-2 blocks, 2 workers x 4 blocks, 2 per step; grad_chunk 3 splits a step's 4 blocks unevenly."""
    name, n_workers, n_units, units_per_step, global_batch, grad_chunk = "tiny", 2, 4, 2, 4, 3

    def __init__(self):
        self.model, ids, self._unit_losses = tiny_gpt2()
        self.unit_tables = (torch.cat([ids, ids.flip(0)[:3]]).view(2, 4, 6),)

    def units(self, workers, unit_ids):
        return super().units(workers, unit_ids)[0]

    def unit_losses(self, flat, ids):
        return self._unit_losses(flat, ids)

    def loss(self, flat, ids):
        return self.unit_losses(flat, ids).mean(), None


class Recorder:
    uses_grads = True

    def __init__(self):
        self.seen = []

    def step(self, every, positions):
        self.seen.append(every.clone())

    lap = end_step = staticmethod(lambda *a: None)


def one_step(task, sketch, records=True):
    task.sketch_records = records
    sorter, optimizer = Recorder(), Recorder()
    optimizer.step = lambda update: optimizer.seen.append(update.clone())
    exchange = GradientExchange(LocalCommunicator(2), gather_unit_grads=True, sketch=sketch)
    calls = []
    unit_grads, unit_sketches = task.unit_grads, task.unit_sketches
    task.unit_grads = lambda *a: calls.append("unit_grads") or unit_grads(*a)
    task.unit_sketches = lambda *a: calls.append("unit_sketches") or unit_sketches(*a)
    try:
        loss = data_parallel_step(task, sorter, exchange, optimizer, torch.tensor([[0, 3], [2, 1]]), range(0, 2),
                                  Recorder())
    finally:
        del task.unit_grads, task.unit_sketches
    return sorter.seen[0], optimizer.seen[0], loss, calls, exchange.comm_bytes


def test_the_step_uses_the_records_path_only_with_blocks():
    """With blocks, data_parallel_step gathers the records path's sketches and updates with the mean gradient
    (equal to the materialise path's, float64); without a sketch, or with a block-free map, it takes the
    materialise path as before: exact CD-GraB gathers task.unit_grads' own tensor, bit for bit."""
    task = TinyGPT2Task()
    sketch = GradientSketch(task.model.d, 16, seed=0, blocks=task.model.sketch_blocks(0))
    task.model.grad.fill_(7.0)  # what a previous step left in the gradient buffer must not reach the update
    every, update, loss, calls, sent = one_step(task, sketch)
    assert calls == ["unit_sketches"] and every.shape == (2, 2, 16)
    every_m, update_m, loss_m, calls_m, sent_m = one_step(task, sketch, records=False)
    assert calls_m == ["unit_grads"] and sent == sent_m == 8 * (2 * 2 * 16 + 2 * task.model.d)  # float64
    assert torch.allclose(every, every_m, rtol=0, atol=1e-12 * every_m.abs().max().item())
    assert torch.allclose(update, update_m, rtol=0, atol=1e-12 * update_m.abs().max().item())
    assert float(loss.mean()) == pytest.approx(float(loss_m.mean()), rel=1e-14)
    # exact CD-GraB: the per-unit gradients themselves, gathered as computed
    every_x, update_x, _, calls_x, _ = one_step(task, None)
    grads, _ = task.unit_grads(task.model.flat, task.units([0, 1], torch.tensor([[0, 3], [2, 1]])), 2, 2)
    assert calls_x == ["unit_grads"] and torch.equal(every_x, grads) and torch.equal(update_x, grads.mean(dim=(0, 1)))
    # a map without blocks (every model below STRUCTURED_MIN_NUMEL): the materialise path
    assert one_step(task, GradientSketch(task.model.d, 16, seed=0))[3] == ["unit_grads"]


def test_make_sketch_blocks_only_large_weights():
    """MLP/LR-sized models keep the plain CountSketch of the same seed (their sketched runs are unchanged);
    a weight of STRUCTURED_MIN_NUMEL entries or more becomes a block; D = 0 and D >= d apply nothing."""
    class Args:
        sketch_dim, seed = 64, 3

    small, _, _ = mlp_like()
    sketch = make_sketch(Args, small.d, small)
    assert not sketch.blocks and torch.equal(sketch.matrix(), GradientSketch(small.d, 64, seed=3).matrix())
    big = FlatModel(torch.nn.Sequential(torch.nn.Embedding(STRUCTURED_MIN_NUMEL // 4, 4), torch.nn.Linear(4, 3)))
    sketch = make_sketch(Args, big.d, big)
    assert [(b.offset, b.rows, b.cols) for b in sketch.blocks] == [(0, STRUCTURED_MIN_NUMEL // 4, 4)]
    Args.sketch_dim = big.d
    assert make_sketch(Args, big.d, big) is None
    Args.sketch_dim = 0
    assert make_sketch(Args, big.d, big) is None


# ------------------------------------------------------------------------------------------- GPT-2 end to end

GPT2 = "main-GPT2-Wiki103.py"
GPT2_QUICK = ["--max-seq-length", "32", "--max-train-examples", "8", "--max-eval-examples", "4", "--node_cnt", "2",
              "--B", "2", "--epochs", "2", "--lr", "3e-3", "--record-orders", "--train-file", DATA_DIR / "wikitext-2" / "train.txt"]
GPT2_D = 6_846_080 - 128 * 128 + 32 * 128  # d with 32 positions


@pytest.mark.slow
@needs_data("gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt", "wikitext-2/train.txt",
            "wikitext-103/wiki.valid.raw|wikitext-103/wiki.valid.tokens",
            "wikitext-103/wiki.test.raw|wikitext-103/wiki.test.tokens")
def test_gpt2_sketched_from_records_trains_and_one_process_equals_torchrun(tmp_path):
    """--sketch-dim 64 on GPT-2: the tied wte/lm_head is a TensorSketch block (config.json says so), orders are
    permutations, comm_bytes = steps * 4 * (n k D + n d), and 2 torchrun processes give the same orders and
    metrics (rel 1e-5)."""
    single = tmp_path / "one"
    check_ok(run_script(GPT2, "--out", single, "--sketch-dim", "64", "--cache-dir", tmp_path / "cache", *GPT2_QUICK))
    check_run_files(single, epochs=2, m=4)
    sketch = json.loads((single / "config.json").read_text())["sorter"]["sketch"]
    assert sketch["applied"] and "TensorSketch" in sketch["family"]
    for row in read_metrics(single):
        assert row["comm_bytes"] == 4 * 4 * (2 * 1 * 64 + 2 * GPT2_D)
    check_torchrun_agrees(GPT2, single, tmp_path / "two", "--sketch-dim", "64", "--cache-dir", tmp_path / "cache",
                          *GPT2_QUICK, columns=("train_loss", "test_loss", "valid_loss"))
