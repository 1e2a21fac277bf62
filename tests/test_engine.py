"""Engine pieces in isolation: per-example gradients, optimizer state, schedule, exchange, files."""
import pytest
import torch
import torch.nn.functional as F

import random
from pathlib import Path

import numpy as np

from engine import runlog
from engine.comm import GradientExchange, LocalCommunicator
from common.errors import UserFacingError
from engine.functional import FlatModel, batch_gradient, unit_gradients
from engine.optim import Optimizer, LRSchedule
from engine.flags import FLAGS, RESUMABLE_FLAGS
from engine.checkpoint import restore
from engine.steps import clip_to_norm
from sorters import build_sorter
from tests.helpers import entry_point

ENTRY_SCRIPTS = ("main-LR-HMDA.py", "main-MLP-M4.py", "main-LSTM-Wiki2.py", "main-GPT2-Wiki103.py")


def small_model():
    torch.manual_seed(0)
    return FlatModel(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))


def mse_loss(model):
    def loss(flat, batch):
        x, y = batch
        return F.mse_loss(model(flat, x).squeeze(-1), y), None
    return loss


def test_unit_gradients_equal_one_backward_per_example():
    model = small_model()
    x, y = torch.randn(6, 5), torch.randn(6)
    grads, losses = unit_gradients(mse_loss(model), model.flat, (x, y))
    assert grads.shape == (6, model.d) and losses.shape == (6,)
    for i in range(6):
        flat = model.flat.clone().requires_grad_(True)
        loss = F.mse_loss(model(flat, x[i:i + 1]).squeeze(-1), y[i:i + 1])
        (expected,) = torch.autograd.grad(loss, flat)
        torch.testing.assert_close(grads[i], expected)
        torch.testing.assert_close(losses[i], loss.detach())
    mean_grad, mean_loss, _ = batch_gradient(mse_loss(model), model.flat, (x, y))
    torch.testing.assert_close(mean_grad, grads.mean(0))
    torch.testing.assert_close(mean_loss, losses.mean())


def test_flat_model_parameters_are_views_and_backward_fills_the_flat_gradient():
    model = small_model()
    x, y = torch.randn(6, 5), torch.randn(6)
    grad, loss, _ = model.batch_gradient(mse_loss(model), (x, y))
    reference, _, _ = batch_gradient(mse_loss(model), model.flat.clone(), (x, y))  # torch.func, re-parametrised
    torch.testing.assert_close(grad, reference)
    model.flat.add_(1.0)  # the optimizer's in-place update is what the module computes with
    assert all(torch.equal(p, v) for p, v in zip(model.module.parameters(), model.params(model.flat).values()))
    again, _, _ = model.batch_gradient(mse_loss(model), (x, y))
    assert not torch.equal(again, reference)  # zeroed and recomputed at the new point, not accumulated


class TiedWithUnused(torch.nn.Module):
    """Embedding tied to the output layer (one parameter used twice), two hidden layers, and a layer never
    called."""

    def __init__(self):
        super().__init__()
        self.embed, self.out, self.unused = torch.nn.Embedding(7, 3), torch.nn.Linear(3, 7), torch.nn.Linear(3, 2)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.hidden(self.embed(ids))))


def test_batch_gradient_equals_the_textbook_backward_and_dispatches_one_write():
    """FlatModel.batch_gradient (autograd.grad, then one multi-tensor copy/add into the flat buffer) equals,
    bit for bit, loss.backward() on a plain copy of the module whose .grad start as None (the textbook
    loop), for a tied weight and an unused layer, scaled, and accumulated over two batches; and it
    dispatches at most one kernel op more than that backward (the write into the buffer), not one per
    parameter, besides the zeros of the unused layer's weight and bias."""
    import copy

    from bench.dispatch_count import OpCounter

    torch.manual_seed(0)
    model = FlatModel(TiedWithUnused())
    plain = copy.deepcopy(model.module)
    for p in plain.parameters():
        p.grad = None
    ids = [torch.randint(0, 7, (5,)), torch.randint(0, 7, (4,))]
    model.grad.fill_(3.0)  # stale values: a non-accumulating call must overwrite every coordinate

    def loss(flat, batch):
        return F.cross_entropy(model(flat, batch), batch), None

    for i, (scale, accumulate) in enumerate([(0.5, False), (0.25, True)]):
        with OpCounter() as engine_count:
            grad, value, _ = model.batch_gradient(loss, ids[i], scale=scale, accumulate=accumulate)
        with OpCounter() as textbook_count:
            textbook_loss = F.cross_entropy(plain(ids[i]), ids[i])
            (textbook_loss * scale).backward()
        assert engine_count.kernel_ops <= textbook_count.kernel_ops + 1 + 2
        assert torch.equal(value, textbook_loss.detach())
    expected = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in plain.parameters()])
    assert torch.equal(grad, expected)
    unused = model.offsets[id(model.module.unused.weight)]
    assert model.grad[unused:unused + 8].abs().sum() == 0  # the unused layer: zero, not the stale 3.0


def outer_cases():
    """(FlatModel, batch, mean loss, per-unit losses) for the model kinds of the benchmarks."""
    from models.gpt2 import build_gpt2, causal_mask
    from models.mlp import AutoregressiveMLP

    torch.manual_seed(1)
    lr = FlatModel(torch.nn.Linear(7, 1))
    x, y = torch.randn(9, 7), (torch.rand(9) > 0.5).float()
    yield ("LR", lr, (x, y), lambda f, b: F.binary_cross_entropy_with_logits(lr(f, b[0]).squeeze(-1), b[1]),
           lambda f, b: F.binary_cross_entropy_with_logits(lr(f, b[0]).squeeze(-1), b[1], reduction="none"))
    mlp = FlatModel(AutoregressiveMLP(in_len=5, hidden=8, n_layers=4))
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    yield ("MLP", mlp, (x, y), lambda f, b: F.mse_loss(mlp(f, b[0], 3), b[1]),
           lambda f, b: (mlp(f, b[0], 3) - b[1]).square().mean(1))
    gpt2 = FlatModel(build_gpt2(vocab_size=97, n_embd=16, n_layer=2, n_head=2, n_positions=12))
    ids = torch.randint(0, 97, (5, 12))
    positions = torch.arange(12).expand(5, 12)
    mask = causal_mask(12, gpt2.flat.dtype, "cpu")  # (1, 1, 12, 12), as the GPT-2 task passes it

    def gpt2_logits(f, b):
        return gpt2(f, input_ids=b, position_ids=positions[:len(b)], attention_mask=mask, use_cache=False).logits

    yield ("GPT-2", gpt2, ids,
           lambda f, b: F.cross_entropy(gpt2_logits(f, b)[:, :-1].flatten(0, 1), b[:, 1:].flatten()),
           lambda f, b: F.cross_entropy(gpt2_logits(f, b)[:, :-1].transpose(1, 2), b[:, 1:], reduction="none").mean(1))


@pytest.mark.parametrize("into_slots", [False, True], ids=["copied", "into-slots"])
@pytest.mark.parametrize("case", list(outer_cases()), ids=lambda case: case[0])
def test_outer_product_unit_gradients_equal_vmap(case, into_slots, monkeypatch):
    """The fast per-unit path (one backward + outer products, tied GPT-2 embedding included) against
    the general torch.func path, to float32 rounding (the reductions run in another order); its products
    and token sums formed and copied in (the CPU's way) or written into their columns (the GPU's)."""
    import engine.functional

    monkeypatch.setattr(engine.functional, "PRODUCTS_INTO_SLOTS", into_slots)
    _, model, batch, mean_loss, unit_losses = case
    assert model.supports_outer
    expected, expected_losses = unit_gradients(lambda f, b: (mean_loss(f, b), None), model.flat, batch)
    buffer = torch.full_like(expected, float("nan"))  # whatever the reused buffer held is overwritten
    grads, losses = model.outer_unit_gradients(unit_losses, batch, out=buffer)
    assert grads.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(grads, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", list(outer_cases()), ids=lambda case: case[0])
def test_products_written_into_their_slots_equal_the_copied_ones_with_a_copy_less_a_parameter(case, monkeypatch):
    """PRODUCTS_INTO_SLOTS (the GPU's way): the same per-unit gradients as forming each product or token sum
    and copying it in, bit for bit here (so the same orders and losses), with no copy: one kernel op less for
    every parameter a product or token sum writes first."""
    import engine.functional
    from bench.dispatch_count import OpCounter

    _, model, batch, _, unit_losses = case
    results, copies = {}, {}
    for into_slots in (False, True):
        monkeypatch.setattr(engine.functional, "PRODUCTS_INTO_SLOTS", into_slots)
        with OpCounter() as counter:
            results[into_slots] = model.outer_unit_gradients(unit_losses, batch)[0]
        copies[into_slots] = counter.calls["aten.copy_"]
    assert torch.equal(results[True], results[False])
    # every parameter but an embedding's rows (scattered onto zeros, or onto the tied product) is written first
    # by a product or a token sum
    firsts = sum(1 for module, kind in model.layers.items() if kind != "Embedding"
                 for p in module.parameters(recurse=False) if id(p) in model.offsets)
    assert firsts > 0 and copies[False] - copies[True] == firsts, (copies, firsts)


def test_outer_products_refuse_models_they_cannot_differentiate():
    lstm = FlatModel(torch.nn.LSTM(3, 4))
    assert not lstm.supports_outer
    with pytest.raises(ValueError, match="vmap"):
        lstm.outer_unit_gradients(lambda f, b: b, torch.zeros(2))


def test_tied_weights_appear_once_in_the_flat_vector():
    embedding = torch.nn.Embedding(7, 3)
    decoder = torch.nn.Linear(3, 7, bias=False)
    decoder.weight = embedding.weight
    model = FlatModel(torch.nn.ModuleDict({"embedding": embedding, "decoder": decoder}))
    assert model.d == 21


def test_adam_state_persists_across_epochs_and_matches_torch_adamw():
    """Bug 3 (docs/differences.md): the original restarted Adam's bias-correction count every epoch."""
    flat = torch.zeros(3)
    reference = torch.zeros(3, requires_grad=True)
    optimizer = Optimizer("adamw", flat, LRSchedule(1e-2, steps_per_epoch=5), weight_decay=0.1)
    theirs = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    for step in range(3 * 5):  # three "epochs"
        g = torch.tensor([1.0, -2.0, 0.5]) * (step + 1)
        reference.grad = g.clone()
        optimizer.step(g)
        theirs.step()
    assert optimizer.state_dict()["count"] == 15
    torch.testing.assert_close(flat, reference.detach(), rtol=1e-6, atol=1e-7)


def test_sgd_momentum_matches_torch_sgd_and_state_round_trips():
    flat = torch.zeros(4)
    reference = torch.zeros(4, requires_grad=True)
    ours = Optimizer("sgd", flat, LRSchedule(0.1, steps_per_epoch=2, every_epochs=1, gamma=0.5), momentum=0.9,
                     weight_decay=0.01)
    theirs = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(theirs, step_size=2, gamma=0.5)
    for step in range(6):
        g = torch.full((4,), float(step + 1))
        reference.grad = g.clone()
        ours.step(g)
        torch.testing.assert_close(g, torch.full((4,), float(step + 1)))  # the gradient is not modified
        theirs.step()
        scheduler.step()
    torch.testing.assert_close(flat, reference.detach(), rtol=0, atol=0)
    copy = Optimizer("sgd", flat.clone(), LRSchedule(0.1, 2, 1, 0.5), momentum=0.9, weight_decay=0.01)
    copy.load_state_dict(ours.state_dict())
    ours.step(torch.ones(4))
    copy.step(torch.ones(4))
    torch.testing.assert_close(copy.flat, flat, rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not match"):
        Optimizer("adamw", flat.clone(), LRSchedule(0.1, 2)).load_state_dict(ours.state_dict())


def test_every_flag_of_every_entry_script_is_in_the_flag_table():
    """engine/flags.py says for each flag whether it may change on resume and what older runs ran with;
    a flag added to a parser without an entry there (or an entry left behind) fails here."""
    dests = set()
    for script in ENTRY_SCRIPTS:
        _, parser, _ = entry_point(script)
        dests |= {action.dest for action in parser._actions if action.dest != "help"}
    assert sorted(dests - set(FLAGS)) == [] and sorted(set(FLAGS) - dests) == []
    assert {"overlap", "unit_grad_gather", "cache_dir", "data_dir", "epochs", "device"} <= RESUMABLE_FLAGS
    assert not {"lr", "tf32", "partition", "sync", "reducer", "unit_grads", "max_train_examples"} & RESUMABLE_FLAGS


def test_hyphenated_spellings_set_the_same_setting_as_the_papers_underscores():
    from engine.cli import check_args, common_parser

    parser = common_parser("toy", "toy", dict(sorter="CD-GraB", lr=0.1, B=8, node_cnt=2, epochs=3))
    defaults = vars(parser.parse_args([]))
    for underscore, hyphen, value in (("--node_cnt", "--node-cnt", "4"), ("--weight_decay", "--weight-decay", "0.5")):
        one, other = parser.parse_args([underscore, value]), parser.parse_args([hyphen, value])
        check_args(one, "toy", defaults)
        check_args(other, "toy", defaults)
        assert vars(one) == vars(other) and one.out != "results/toy/CD-GraB-node2-B8-lr0.1-seed0"
        assert getattr(one, underscore[2:]) == float(value)
    help_text = " ".join(parser.format_help().split())
    assert "--node_cnt N, --node-cnt N" in help_text and "--weight_decay WD, --weight-decay WD" in help_text


def save_checkpoint(path, args, flat, optimizer, sorter, rows):
    runlog.atomic_torch_save({"epoch": 1, "args": args, "flat": flat.clone(), "optimizer": optimizer.state_dict(),
                              "sorter": sorter.state_dict(), "rows": rows, "orders": [],
                              "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                      "python": random.getstate()}}, path)


def test_restore_accepts_only_changes_that_keep_the_results(tmp_path):
    """Where the data and the token cache live, how long the run goes and how it overlaps or gathers may
    change on resume; the learning rate may not, nor a setting the checkpoint predates unless it keeps
    the value that checkpoint ran with."""
    flat = torch.arange(3.0)
    optimizer, sorter = Optimizer("sgd", flat, LRSchedule(0.1, 2), momentum=0.9), build_sorter("D-RR", 2, 4, 3)
    args = {"lr": 0.1, "cache_dir": "/old/cache", "data_dir": "/old/data", "epochs": 2, "overlap": "off",
            "unit_grad_gather": "round"}
    rows = [{"epoch": 1, "train_loss": 1.0}]
    save_checkpoint(tmp_path / "checkpoint.pt", args, flat, optimizer, sorter, rows)
    moved = {**args, "cache_dir": "/new/cache", "data_dir": "/new/data", "epochs": 3, "overlap": "on",
             "unit_grad_gather": "step"}
    assert restore(tmp_path / "checkpoint.pt", moved, flat, optimizer, sorter, torch.device("cpu")) == (rows, [], 2)
    old_format = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    old_format["optimizer"] = [torch.zeros(3), torch.tensor(4)]  # torchopt's leaves, as older versions saved
    runlog.atomic_torch_save(old_format, tmp_path / "old.pt")
    with pytest.raises(UserFacingError, match="another version of the suite"):
        restore(tmp_path / "old.pt", moved, flat, optimizer, sorter, torch.device("cpu"))
    with pytest.raises(UserFacingError, match=r"--lr 0.1 \(now 0.2\)"):
        restore(tmp_path / "checkpoint.pt", {**moved, "lr": 0.2}, flat, optimizer, sorter, torch.device("cpu"))
    # --tf32 changes the arithmetic: a checkpoint from before the flag ran without it (float32)
    restore(tmp_path / "checkpoint.pt", {**moved, "tf32": False}, flat, optimizer, sorter, torch.device("cpu"))
    with pytest.raises(UserFacingError, match=r"--tf32 False \(now True\)"):
        restore(tmp_path / "checkpoint.pt", {**moved, "tf32": True}, flat, optimizer, sorter, torch.device("cpu"))
    # a cosine schedule is stretched over the run's epochs: then --epochs may not change
    cosine = {**args, "lr_schedule": "cosine"}
    save_checkpoint(tmp_path / "cosine.pt", cosine, flat, optimizer, sorter, rows)
    with pytest.raises(UserFacingError, match=r"--epochs 2 \(now 3\)"):
        restore(tmp_path / "cosine.pt", {**cosine, "epochs": 3}, flat, optimizer, sorter, torch.device("cpu"))
    # --partition's value before the flag existed depends on the benchmark (each one's original split)
    for benchmark, original, other in (("LR-HMDA", "contiguous", "random"), ("MLP-M4", "random", "contiguous")):
        restore(tmp_path / "checkpoint.pt", {**moved, "partition": original}, flat, optimizer, sorter,
                torch.device("cpu"), benchmark=benchmark)
        with pytest.raises(UserFacingError, match=rf"--partition {original} \(now {other}\)"):
            restore(tmp_path / "checkpoint.pt", {**moved, "partition": other}, flat, optimizer, sorter,
                    torch.device("cpu"), benchmark=benchmark)


def test_restore_refuses_a_checkpoint_it_cannot_read_in_one_line(tmp_path):
    """A readable file that is not this version's checkpoint (a key missing at the top or inside a state,
    other parameters, not a dict at all) is a UserFacingError naming what is wrong, not a KeyError."""
    flat = torch.arange(3.0)
    optimizer, sorter = Optimizer("sgd", flat, LRSchedule(0.1, 2), momentum=0.9), build_sorter("CD-GraB", 2, 4, 3)
    args = {"lr": 0.1}
    save_checkpoint(tmp_path / "checkpoint.pt", args, flat, optimizer, sorter, [])
    good = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    cases = {
        "no-sorter": ({k: v for k, v in good.items() if k != "sorter"}, "lacks sorter"),
        "no-rng-args": ({k: v for k, v in good.items() if k not in ("rng", "args")}, "lacks args, rng"),
        "a-list": ([good["flat"]], "lacks epoch, args, flat, optimizer, sorter, rows, rng"),
        "sorter-without-n": ({**good, "sorter": {k: v for k, v in good["sorter"].items() if k != "n"}},
                             "missing n; the checkpoint was written by another version"),
        "rng-without-numpy": ({**good, "rng": {"torch": good["rng"]["torch"]}}, "its state lacks 'numpy'"),
        "other-model": ({**good, "flat": torch.zeros(5)}, r"its parameters are not the model's \(3,\)"),
    }
    for name, (state, message) in cases.items():
        torch.save(state, tmp_path / f"{name}.pt")
        with pytest.raises(UserFacingError, match=message):
            restore(tmp_path / f"{name}.pt", args, flat, optimizer, sorter, torch.device("cpu"))
    assert restore(tmp_path / "checkpoint.pt", args, flat, optimizer, sorter, torch.device("cpu"))[2] == 2


@pytest.mark.parametrize("even_steps", [True, False])
def test_units_per_worker_is_the_largest_whole_even_share(even_steps):
    """Against a search: the largest m <= available // n that is even and whole steps of k, with
    even_steps also an even number of steps; too few units: one line saying how many are needed."""
    from engine.task import units_per_worker

    for available in range(0, 130, 7):
        for n in (1, 2, 3):
            for k in (1, 2, 3, 4):
                fits = [m for m in range(1, available // n + 1)
                        if m % 2 == 0 and m % k == 0 and (not even_steps or (m // k) % 2 == 0)]
                if fits:
                    assert units_per_worker(available, n, k, "units", even_steps) == max(fits)
                else:
                    with pytest.raises(UserFacingError, match=rf"{available} units are too few for --node_cnt {n} "
                                                              rf"and --B {n * k}: need at least"):
                        units_per_worker(available, n, k, "units", even_steps)


def test_eval_batches_tile_the_items_on_one_grid_whatever_the_processes():
    from engine.task import eval_batches

    class Comm:
        def __init__(self, rank, world_size):
            self.rank, self.world_size = rank, world_size

    for n_items, batch in ((0, 4), (10, 4), (12, 4), (3, 8), (1000, 96)):
        grid = [slice(start, min(start + batch, n_items)) for start in range(0, n_items, batch)]
        for world_size in (1, 2, 3, 5):
            per_rank = [eval_batches(n_items, batch, Comm(rank, world_size)) for rank in range(world_size)]
            assert [piece for pieces in per_rank for piece in pieces] == grid


def test_a_benchmark_says_what_its_units_are_in_the_help_of_the_common_flags():
    from engine.cli import common_parser

    defaults = dict(sorter="CD-GraB", lr=0.1, B=8, node_cnt=2, epochs=3)
    parser = common_parser("toy", "Toy benchmark.\n\nDetails.", defaults,
                           help_texts={"max_train_examples": "use only the first N toy windows"})
    help_text = " ".join(parser.format_help().split())
    assert "use only the first N toy windows" in help_text and "Toy benchmark." in help_text
    assert "cap the validation/test sets at N units" in help_text and "Details." not in help_text
    with pytest.raises(ValueError, match="help_texts may replace"):
        common_parser("toy", "toy", defaults, help_texts={"lr": "the learning rate"})


def test_step_decay_per_epoch():
    schedule = LRSchedule(5.0, steps_per_epoch=3, every_epochs=10, gamma=0.1)
    assert [schedule.at_epoch(e) for e in (1, 10, 11, 21)] == pytest.approx([5.0, 5.0, 0.5, 0.05])
    assert schedule(29) == pytest.approx(5.0) and schedule(30) == pytest.approx(0.5)
    assert LRSchedule(1e-3, 7)(10_000) == 1e-3


def test_exchange_gives_the_global_mean_both_ways():
    comm = LocalCommunicator(3)
    unit_grads = torch.randn(3, 2, 5)
    update, every = GradientExchange(comm, gather_unit_grads=True).exchange(unit_grads, None)
    torch.testing.assert_close(update, unit_grads.mean(dim=(0, 1)))
    assert every is unit_grads  # one process: no copy of the (n, k, d) tensor
    reduce = GradientExchange(comm, gather_unit_grads=False)
    update, every = reduce.exchange(None, unit_grads.mean(dim=(0, 1)))
    torch.testing.assert_close(update, unit_grads.mean(dim=(0, 1)))
    assert every is None and reduce.comm_bytes == 3 * 5 * 4


def test_clip_to_norm():
    g = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(clip_to_norm(g, 1.0), g / 5, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clip_to_norm(g, 10.0), g)


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    rows = [{"epoch": 1, "train_loss": 0.5, "test_loss": 0.25, "epoch_seconds": 1.0, "sorter_seconds": 0.1,
             "comm_seconds": 0.0, "compute_seconds": 0.9, "comm_bytes": 10}]
    runlog.write_metrics(path, rows, ())
    before = path.read_text()
    assert before.splitlines()[1].startswith("1,0.5,0.25,")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(runlog.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        runlog.write_metrics(path, rows + rows, ())
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]


@pytest.mark.parametrize("count", [2, 3])
def test_rotated_unit_gradients_never_hand_out_a_buffer_in_use(count):
    """With --overlap the sorter reads step t's buffer while step t + 1 computes, and a sorter that keeps
    a reference reads it during step t + 1's sorter step: the last count - 1 buffers handed out, the
    first steps' included, must never be handed out again (a shared one made --overlap on flaky)."""
    from engine.functional import FlatModel
    from engine.task import Task

    task = Task()
    task.model = FlatModel(torch.nn.Linear(3, 1))
    task.grad_buffers = count
    handed = [task._unit_grad_buffer(4).data_ptr() for _ in range(7)]
    assert all(len(set(handed[i:i + count])) == count for i in range(len(handed) - count + 1))
    assert len(set(handed)) == count
    single = Task()
    single.model = task.model
    assert len({single._unit_grad_buffer(4).data_ptr() for _ in range(3)}) == 1


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_torchrun_error_is_printed_at_once_by_rank_0_only(monkeypatch, capsys, rank):
    """Rank 0 prints at once; another rank waits for torchrun to stop it, and prints only if it is still
    running after the wait (an error rank 0 did not see). Both exit 2."""
    from common import errors

    waits = []
    monkeypatch.setattr(errors.time, "sleep", waits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_info:
        errors.exit_with_error("--B 15 is not divisible by --node_cnt 4")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --B 15 is not divisible by --node_cnt 4\n"
    assert waits == ([] if rank == "0" else [errors.PEER_REPORT_DELAY_SECONDS])


def test_the_launcher_summary_shows_our_line_as_the_root_cause(monkeypatch, tmp_path):
    """exit_with_error writes $TORCHELASTIC_ERROR_FILE as torch's @record does, so that torchrun's
    ChildFailedError summary (read here with torch's own classes) shows our line instead of a link;
    without the variable (a plain python start, or torchrun's empty one) nothing is written."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from common import errors

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit):
        errors.exit_with_error("--B 15 is not divisible by --node_cnt 4")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("main-LR-HMDA.py", {0: failure}).format_msg().strip().splitlines()
    assert summary[-2] == "  traceback : error: --B 15 is not divisible by --node_cnt 4", summary
    error_file.unlink()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "")
    with pytest.raises(SystemExit):
        errors.exit_with_error("--B 15 is not divisible by --node_cnt 4")
    assert not error_file.exists() and list(tmp_path.iterdir()) == []


def test_resume_with_the_default_out_refuses_only_when_it_would_start_over_beside_other_runs(tmp_path, monkeypatch):
    """--resume whose default --out does not exist: a first start when results/<benchmark>/ holds no run
    with a checkpoint; else one line naming the nearest run (fewest differing settings) and how it
    differs. An --out of one's own (the sweeps, scripts/gpu_session.py), an --out that exists, or no
    --resume: never refused here."""
    from engine.cli import check_args, check_resume

    monkeypatch.chdir(tmp_path)
    benchmark, parser, _ = entry_point("main-LR-HMDA.py")

    def checked(*argv):
        args = parser.parse_args(list(argv))
        out_given = args.out is not None
        check_args(args, benchmark, defaults=vars(parser.parse_args([])))
        return args, out_given

    def resume(*argv):  # as run_entry_point checks a command line
        args, out_given = checked(*argv)
        check_resume(args, benchmark, out_given)

    def started(*argv):  # a run of these settings with a checkpoint, in its default --out
        args, _ = checked(*argv)
        Path(args.out).mkdir(parents=True)
        (Path(args.out) / "checkpoint.pt").write_bytes(b"")
        runlog.write_config(Path(args.out) / "config.json", {"args": vars(args)})
        return args.out

    resume("--resume", "--lr", "0.01")  # nothing at all: a first start
    started("--lr", "0.1", "--seed", "3")
    nearest = started("--lr", "0.1")
    with pytest.raises(UserFacingError) as refused:
        resume("--resume", "--lr", "0.01")
    assert str(refused.value) == (
        "--resume: no run to resume in results/LR-HMDA/CD-GraB-node4-B16-lr0.01-seed0 (no such folder); looked "
        "there and at the 2 runs with a checkpoint in results/LR-HMDA/: the nearest, "
        f"{nearest}, differs in --lr 0.1 (now 0.01); to continue it, pass its settings (or give it "
        "as --out), or drop --resume to start a new run")
    for argv in (["--lr", "0.01"], ["--resume", "--lr", "0.01", "--out", "results/LR-HMDA/mine"],
                 ["--resume", "--lr", "0.1", "--epochs", "60"]):  # the last: nearest itself (epochs may change)
        resume(*argv)
    Path("results/LR-HMDA/CD-GraB-node4-B16-lr0.01-seed0").mkdir()  # a run killed before its first epoch
    resume("--resume", "--lr", "0.01")
    # the same settings under another name (an --out of its own): say so
    (Path("results/LR-HMDA/CD-GraB-node4-B16-lr0.01-seed0")).rmdir()
    Path(nearest).rename("results/LR-HMDA/renamed")
    with pytest.raises(UserFacingError, match=r"results/LR-HMDA/renamed has these settings .* continue it "
                                              r"with --out results/LR-HMDA/renamed"):
        resume("--resume", "--lr", "0.1")
