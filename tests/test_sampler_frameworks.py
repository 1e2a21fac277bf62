"""CDGraBSampler under the frameworks: accelerate's prepare (view="global"), their set_epoch calls,
mid-epoch resume in both styles, and examples/accelerate_loop.py under 2 gloo processes.

The oracles are the bare sorter stepped the way the engine steps it (run_engine_epoch) and the per-rank
sampler's own example (examples/ddp_lr_hmda.py), never the global view against itself. Two ranks are
simulated in one process with accelerate's own prepare_data_loader(num_processes=2, process_index=r)."""
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from sorters import CDGraBSampler, build_sorter
from tests.helpers import DATA_DIR, assert_same, checkpoint_roundtrip, needs_data, run_python
from tests.test_sampler import example_grads, one_line_error, run_engine_epoch, run_sampler_epoch

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
prepare_data_loader = accelerate_data_loader.prepare_data_loader
skip_first_batches = accelerate_data_loader.skip_first_batches

W, M, K, D = 2, 12, 3, 4  # ranks, examples per rank, batch per rank, gradient length


def make_global(sorter, seed=5, view="global"):
    d = D if sorter == "CD-GraB" else None
    return CDGraBSampler(W * M, batch_size=K, d=d, sorter=sorter, num_replicas=W, seed=seed, view=view)


def prepared(sampler):
    """Each simulated rank's loader, as accelerate's prepare builds it (BatchSamplerShard, even_batches)."""
    dataset = TensorDataset(torch.arange(W * M))
    loader = DataLoader(dataset, batch_size=sampler.loader_batch_size, sampler=sampler)
    return [prepare_data_loader(loader, num_processes=W, process_index=r, put_on_device=False) for r in range(W)]


def run_prepared_epoch(sampler, loaders, table, epoch, skip=0):
    """One epoch on every simulated rank: set_epoch as the HF Trainer calls it, each rank's batches (the
    first `skip` dropped by accelerate's skip_first_batches), then one step() per step with every rank's
    rows of `table`, rank 0's first (what the all-gather delivers). Returns per rank its index batches."""
    for loader in loaders:
        loader.set_epoch(epoch)
    if skip:
        loaders = [skip_first_batches(loader, skip) for loader in loaders]
    batches = [[indices for (indices,) in loader] for loader in loaders]  # the order is fixed at __iter__
    for step_batches in zip(*batches):
        every = torch.cat(step_batches)
        sampler.step(table[every] if sampler.uses_grads else None)
    return batches


@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR"])
def test_global_view_through_accelerate_prepare_gives_each_rank_its_engine_order(sorter):
    """Each rank's concatenated batches = its row of the engine sorter's orders fed the same gradients:
    every example of its block exactly once per epoch, none of another rank's."""
    table = example_grads(W * M, D, seed=2)
    engine_sorter = build_sorter(sorter, W, M, D, seed=5)
    sampler = make_global(sorter)
    loaders = prepared(sampler)
    for epoch in range(3):
        expected = run_engine_epoch(engine_sorter, table, K)
        batches = run_prepared_epoch(sampler, loaders, table, epoch)
        for r in range(W):
            seen = torch.cat(batches[r])
            assert torch.equal(seen.sort().values, torch.arange(r * M, (r + 1) * M)), (epoch, r)
            assert torch.equal(seen, expected[r]), (epoch, r)


def test_global_view_in_each_rank_process_deals_each_rank_its_engine_order():
    """As under a process group: every rank builds its own sampler with its rank (D-RR: no gradients,
    so no group is needed here); each yields all ranks' batches and prepare deals them out."""
    engine_sorter = build_sorter("D-RR", W, M, 1, seed=5)
    samplers = [CDGraBSampler(W * M, batch_size=K, sorter="D-RR", num_replicas=W, rank=r, seed=5, view="global")
                for r in range(W)]
    loaders = [prepared(sampler)[r] for r, sampler in enumerate(samplers)]
    for epoch in range(3):
        expected = run_engine_epoch(engine_sorter, None, K)
        for r, (sampler, loader) in enumerate(zip(samplers, loaders)):
            loader.set_epoch(epoch)  # no step(): set_epoch completes the epoch for D-RR
            assert torch.equal(torch.cat([indices for (indices,) in loader]), expected[r]), (epoch, r)


def test_the_per_rank_view_through_accelerate_prepare_loses_examples():
    """The failure mode view="global" exists for: accelerate re-shards a rank's own batches, so each
    rank sees only every other batch of its block (the rest are lost, silently)."""
    for r in range(W):
        sampler = CDGraBSampler(W * M, batch_size=K, sorter="D-RR", num_replicas=W, rank=r, seed=5)
        loader = DataLoader(TensorDataset(torch.arange(W * M)), batch_size=sampler.loader_batch_size, sampler=sampler)
        shard = prepare_data_loader(loader, num_processes=W, process_index=r, put_on_device=False)
        seen = torch.cat([indices for (indices,) in shard])
        assert len(seen) == M // W and len(set(seen.tolist())) < M  # half of the block is never used


def test_set_epoch_tolerates_repeated_and_lagging_calls_and_refuses_skips():
    table = example_grads(W * M, D)
    # one process hosting both replicas (view="rank": a batch is one step), as run_sampler_epoch steps
    plain, called, fresh = (make_global("CD-GraB", view="rank") for _ in range(3))
    assert "next epoch is 0" in one_line_error(fresh.set_epoch, 1)  # a resume without load_state_dict
    assert "epochs count from 0" in one_line_error(fresh.set_epoch, -1)
    with pytest.raises(TypeError):
        fresh.set_epoch("1")
    fresh.set_epoch(torch.tensor(0))  # integer types other than int are fine (Lightning's counters, numpy)
    for epoch in range(3):
        # the HF Trainer's set_epoch, then accelerate's (same value, or the previous epoch in versions
        # whose loader counter lags), then the same again: none may change the orders
        for value in ([epoch, epoch] if epoch == 0 else [epoch, epoch - 1, epoch]):
            called.set_epoch(value)
        assert torch.equal(run_sampler_epoch(called, table), run_sampler_epoch(plain, table))
    iter(called)
    called.step(table[called.all_indices()[:, :K].reshape(-1)])
    assert "part-way" in one_line_error(called.set_epoch, 2)  # going back after a batch was used
    called.set_epoch(3)  # the current epoch, part-way: fine
    assert "next epoch is 3" in one_line_error(called.set_epoch, 5)  # a real skip


def test_set_epoch_completes_an_epoch_without_steps_only_for_sorters_that_ignore_gradients():
    engine_sorter = build_sorter("D-RR", W, M, 1, seed=5)
    no_steps = make_global("D-RR")
    for epoch in range(3):
        no_steps.set_epoch(epoch)
        no_steps.set_epoch(max(epoch - 1, 0))  # a lagging second caller
        assert torch.equal(torch.tensor(list(no_steps)).view(-1, W, K).transpose(0, 1).reshape(W, M),
                           run_engine_epoch(engine_sorter, None, K)), epoch
    grads_sampler = make_global("CD-GraB")
    iter(grads_sampler)
    assert "call sampler.step" in one_line_error(grads_sampler.set_epoch, 1)


def test_state_is_the_same_on_every_rank_and_in_either_view():
    """Lightning saves rank 0's checkpoint only; every rank must be able to load it."""
    ranks = [CDGraBSampler(W * M, batch_size=K, sorter="D-RR", num_replicas=W, rank=r, seed=5) for r in range(W)]
    both = make_global("D-RR")
    for sampler in ranks + [both]:
        iter(sampler)
        for _ in range(2):
            sampler.step(None)
    states = [sampler.state_dict() for sampler in ranks + [both]]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        for key in state:
            assert str(state[key]) == str(states[0][key]), key


@pytest.mark.parametrize("style", ["rest", "replay"])
def test_mid_epoch_resume_gives_the_orders_of_an_uninterrupted_run(style):
    """rest: the restored sampler yields the epoch's remaining steps (a loader that continues);
    replay: load_state_dict(..., replay_from_epoch_start=True) and the loader drops the first k batches
    itself, as the HF Trainer does with accelerate's skip_first_batches (no step() for them)."""
    table = example_grads(W * M, D, seed=7)
    straight = make_global("CD-GraB")
    loaders = prepared(straight)
    expected = [run_prepared_epoch(straight, loaders, table, epoch) for epoch in range(3)]

    first = make_global("CD-GraB")
    loaders = prepared(first)
    run_prepared_epoch(first, loaders, table, 0)
    k = 2  # steps of epoch 1 done before the interruption
    for loader in loaders:
        loader.set_epoch(1)
    iterators = [iter(loader) for loader in loaders]
    for _ in range(k):
        first.step(table[torch.cat([next(it)[0] for it in iterators])])
    state = checkpoint_roundtrip(first.state_dict())

    resumed = make_global("CD-GraB")
    resumed.load_state_dict(state, replay_from_epoch_start=style == "replay")
    loaders = prepared(resumed)
    # the loader's length (what the frameworks count steps by) is what the next iteration yields
    assert [len(loader) for loader in loaders] == [M // K - k if style == "rest" else M // K] * W
    rest = run_prepared_epoch(resumed, loaders, table, 1, skip=k if style == "replay" else 0)
    for r in range(W):
        assert [b.tolist() for b in rest[r]] == [b.tolist() for b in expected[1][r][k:]], r
    assert [[b.tolist() for b in bs] for bs in run_prepared_epoch(resumed, loaders, table, 2)] == \
        [[b.tolist() for b in bs] for bs in expected[2]]


def test_a_part_way_epoch_without_a_resume_is_still_an_error():
    sampler = make_global("CD-GraB")
    iter(sampler)
    sampler.step(torch.zeros(W * K, D))
    assert "ended after step() saw" in one_line_error(iter, sampler)
    assert "view must be 'rank'" in one_line_error(CDGraBSampler, 24, batch_size=3, d=2, num_replicas=2, view="all")
    message = one_line_error(CDGraBSampler, 22, batch_size=3, d=2, num_replicas=2, view="global")
    assert "drop_last=True" in message
    with pytest.raises(TypeError):
        sampler.load_state_dict(sampler.state_dict(), replay_from_epoch_start="yes")


# ------------------------------------------------------------------------------------------- the example, end to end

ACCELERATE_EXAMPLE = "examples/accelerate_loop.py"
COMMON = ["--data-dir", DATA_DIR, "--epochs", "2", "--max-train-examples", "400", "--sorter", "CD-GraB"]


def run_launch(script, *args, nproc=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc else [sys.executable]
    result = run_python([*launcher, script, *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@needs_data("hmda/raw/hmda_train_preprocessed.zip")
def test_accelerate_example_under_two_gloo_processes_equals_the_ddp_example_and_resumes(tmp_path):
    """2 processes through accelerator.prepare, epoch 1, accelerator.save_state; then 2 new processes,
    load_state, epoch 2. In each epoch each process trains on exactly its replica's order, which equals
    the per-rank sampler's (the DDP example hosting both replicas in one process, 2 epochs straight), and
    every process holds the same sampler state."""
    checkpoint = tmp_path / "checkpoint"
    run_launch(ACCELERATE_EXAMPLE, *COMMON, "--epochs", "1", "--checkpoint", checkpoint,
               "--save-orders", tmp_path / "first.pt", nproc=2)  # the last --epochs wins
    resumed = run_launch(ACCELERATE_EXAMPLE, *COMMON, "--resume", checkpoint, "--save-orders", tmp_path / "second.pt",
                         nproc=2)
    assert "epoch 1/2" not in resumed.stdout and "epoch 2/2" in resumed.stdout
    run_launch("examples/ddp_lr_hmda.py", *COMMON, "--replicas", "2", "--save-orders", tmp_path / "ddp.pt")
    ddp = torch.load(tmp_path / "ddp.pt")
    assert not torch.equal(ddp["orders"][0], ddp["orders"][1])
    for epoch, name in enumerate(["first.pt", "second.pt"]):
        (orders,), (batches,), (states,), (loss,) = torch.load(tmp_path / name).values()
        assert torch.equal(orders, ddp["orders"][epoch]), epoch
        for r, used in enumerate(batches):
            assert torch.equal(used, orders[r]), (epoch, r)
            assert torch.equal(used.sort().values, torch.arange(r * 200, (r + 1) * 200)), (epoch, r)
        assert_same(states[0], states[1], f"epoch {epoch}")
        assert loss == pytest.approx(ddp["train_loss"][epoch], rel=1e-5)
