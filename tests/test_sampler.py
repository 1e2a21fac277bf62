"""CDGraBSampler and PerExampleGrads: the sorters in an ordinary (DDP) training loop."""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sorters import SORTER_NAMES, CDGraBSampler, PerExampleGrads, build_sorter, per_example_grads
from tests.helpers import DATA_DIR, REPO, needs_data, run_python

EXAMPLE = "examples/ddp_lr_hmda.py"


def example_grads(n_examples, d, seed=0):
    """A fixed (N, d) table: the 'gradient' of dataset example i is row i."""
    return torch.randn(n_examples, d, generator=torch.Generator().manual_seed(seed))


def run_sampler_epoch(sampler, table):
    """One epoch of a sampler hosting every replica, fed the table's rows of the examples it yields,
    one step per loader batch. Returns the (num_replicas, m) dataset indices of the epoch."""
    indices = torch.tensor(list(sampler))
    for batch in indices.split(sampler.loader_batch_size):
        sampler.step(table[batch] if sampler.uses_grads else None)
    return sampler.all_indices()


def run_engine_epoch(sorter, table, k):
    """One epoch of a bare sorter stepped the way the engine (engine/steps.py) steps it: worker j takes its units
    orders[j, t:t+k] (dataset indices j*m + unit) and the sorter gets all workers' (n, k, d) gradients."""
    orders = sorter.sort()
    n, m = orders.shape
    first_index = torch.arange(n)[:, None] * m
    for t in range(0, m, k):
        positions = range(t, min(t + k, m))
        grads = table[orders[:, t:t + k] + first_index] if sorter.uses_grads else None
        sorter.step(grads, positions)
    return orders + first_index


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message
    return message


# ------------------------------------------------------------------------------------------- orders


@pytest.mark.parametrize("sorter", SORTER_NAMES)
@pytest.mark.parametrize("n_examples,replicas,k,drop_last", [(24, 2, 3, False), (30, 3, 4, False), (29, 2, 4, True)])
def test_each_replica_gets_a_permutation_of_its_own_block_every_epoch(sorter, n_examples, replicas, k, drop_last):
    """Also: a step is replica 0's k examples, then replica 1's, ... (the last step shorter when m % k)."""
    table = example_grads(n_examples, 5)
    if sorter == "MB-GraB" and not drop_last and n_examples // replicas % k:  # its unit is a whole batch
        with pytest.raises(ValueError, match=f"micro-batch of {k} units must divide the {n_examples // replicas} "
                                             "units of each worker.*pass drop_last=True"):
            CDGraBSampler(n_examples, batch_size=k, d=5, sorter=sorter, num_replicas=replicas, seed=3)
        return
    sampler = CDGraBSampler(n_examples, batch_size=k, d=5, sorter=sorter, num_replicas=replicas, seed=3,
                            drop_last=drop_last, epochs=3)
    m = sampler.m
    assert m == (n_examples // (replicas * k) * k if drop_last else n_examples // replicas)
    assert len(sampler) == replicas * m and sampler.loader_batch_size == replicas * k
    for _ in range(3):
        yielded = torch.tensor(list(sampler))
        assert len(yielded) == len(sampler)
        per_replica = torch.cat([chunk.view(replicas, -1) for chunk in yielded.split(replicas * k)], dim=1)
        for r in range(replicas):
            if sorter == "SWR":  # m draws with replacement from the replica's own block
                assert per_replica[r].min() >= r * m and per_replica[r].max() < (r + 1) * m
                continue
            assert torch.equal(per_replica[r].sort().values, torch.arange(r * m, (r + 1) * m))
        assert torch.equal(per_replica, sampler.all_indices())
        for batch in yielded.split(replicas * k):
            sampler.step(table[batch])


@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR", "I-B", "I-PB", "Fold"])
@pytest.mark.parametrize("m,k", [(12, 2), (11, 3)])
def test_orders_equal_the_engine_sorter_fed_the_same_gradients(sorter, m, k):
    n, d = 3, 7
    table = example_grads(n * m, d, seed=1)
    sampler = CDGraBSampler(n * m, batch_size=k, d=d, sorter=sorter, num_replicas=n, seed=5)
    engine_sorter = build_sorter(sorter, n, m, d, seed=5)
    changed = False
    for epoch in range(4):
        expected = run_engine_epoch(engine_sorter, table, k)
        assert torch.equal(run_sampler_epoch(sampler, table), expected), epoch
        changed |= epoch > 0 and not torch.equal(expected, previous)
        previous = expected
    assert changed  # the comparison saw orders that move


def test_gradients_as_replicas_x_batch_give_the_same_orders_as_flat_rows():
    n, m, k, d = 2, 10, 2, 4
    table = example_grads(n * m, d)
    flat, stacked = (CDGraBSampler(n * m, batch_size=k, d=d, num_replicas=n) for _ in range(2))
    for _ in range(3):
        run_sampler_epoch(flat, table)
        for batch in torch.tensor(list(stacked)).split(n * k):
            stacked.step(table[batch].view(n, k, d))
        assert torch.equal(flat.all_indices(), stacked.all_indices())


@pytest.mark.parametrize("sorter", ["D-RR", "D-SO", "Fold"])
def test_a_single_rank_without_process_group_yields_its_row(sorter):
    """For the sorters that ignore gradients a rank needs no communication (like DistributedSampler)."""
    n, m, k = 4, 6, 2
    engine_sorter = build_sorter(sorter, n, m, 1, seed=2)
    ranks = [CDGraBSampler(n * m, batch_size=k, sorter=sorter, num_replicas=n, rank=r, seed=2) for r in range(n)]
    for _ in range(3):
        expected = run_engine_epoch(engine_sorter, None, k)
        for r, sampler in enumerate(ranks):
            assert torch.equal(torch.tensor(list(sampler)), expected[r])
            for _ in range(m // k):
                sampler.step(None)


def test_an_iteration_without_step_does_not_count():
    """Peeking at a batch (next(iter(loader))) leaves the orders alone; set_epoch checks the count."""
    n, m, k, d = 2, 8, 2, 3
    table = example_grads(n * m, d)
    dataset = TensorDataset(torch.arange(n * m))
    plain, peeked = (CDGraBSampler(dataset, batch_size=k, d=d, num_replicas=n) for _ in range(2))
    for epoch in range(3):
        loader = DataLoader(dataset, batch_size=peeked.loader_batch_size, sampler=peeked)
        next(iter(loader))
        peeked.set_epoch(epoch)
        for (indices,) in loader:
            peeked.step(table[indices])
        assert torch.equal(run_sampler_epoch(plain, table), peeked.all_indices())
    one_line_error(peeked.set_epoch, 5)


# resume: tests/test_sampler_resume.py (every sorter, every step boundary, one and two processes)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input_gets_one_line_errors():
    message = one_line_error(CDGraBSampler, 25, batch_size=2, d=3, num_replicas=4)
    assert "25 examples does not split over 4 replicas" in message and "drop_last=True" in message
    message = one_line_error(CDGraBSampler, 24, batch_size=2, d=3, sorter="GraB", num_replicas=4)
    assert "'GraB'" in message and all(name in message for name in SORTER_NAMES)
    assert "pass d" in one_line_error(CDGraBSampler, 24, batch_size=2, num_replicas=4)
    assert "torch.distributed" in one_line_error(CDGraBSampler, 24, batch_size=2, d=3, num_replicas=4, rank=1)
    assert "too few" in one_line_error(CDGraBSampler, 7, batch_size=2, d=3, num_replicas=4, drop_last=True)

    sampler = CDGraBSampler(24, batch_size=2, d=3, num_replicas=4)
    assert "before the epoch started" in one_line_error(sampler.step, torch.zeros(8, 3))
    iter(sampler)
    message = one_line_error(sampler.step, torch.zeros(2, 3))  # one replica's rows instead of all four
    assert "(8, 3) or (4, 2, 3)" in message and "got (2, 3)" in message
    assert "got (8, 5)" in one_line_error(sampler.step, torch.zeros(8, 5))
    assert "got None" in one_line_error(sampler.step, None)
    sampler.step(torch.zeros(8, 3))
    assert "ended after step() saw 2 of 6" in one_line_error(iter, sampler)  # an epoch left part-way

    other = CDGraBSampler(24, batch_size=3, d=3, num_replicas=4)
    assert "batch_size 2 (this sampler: 3)" in one_line_error(other.load_state_dict, sampler.state_dict())

    short = CDGraBSampler(10, batch_size=4, d=3, num_replicas=2)  # m = 5: batches of 4, then 1
    iter(short)
    short.step(torch.zeros(8, 3))
    assert "(2, 3) or (2, 1, 3)" in one_line_error(short.step, torch.zeros(8, 3))
    short.step(torch.zeros(2, 3))
    assert "after the epoch's last batch" in one_line_error(short.step, torch.zeros(2, 3))


def refusal(call, *args, **kwargs) -> str:
    """The one-line message of the ValueError or TypeError that call(*args, **kwargs) raises."""
    with pytest.raises((ValueError, TypeError)) as info:
        call(*args, **kwargs)
    return str(info.value)


def started(sampler, steps=0, grads=None):
    """The sampler after iter() and `steps` step() calls with `grads` (zeros of the right shape by default)."""
    iter(sampler)
    for _ in range(steps):
        sampler.step(grads if grads is not None or not sampler.uses_grads else
                     torch.zeros(sampler.loader_batch_size, sampler.d))
    return sampler


def test_every_refusal_says_what_to_do_word_for_word():
    """The whole message of each refusal: users act on them, so every word is part of the interface."""
    S = CDGraBSampler
    cases = [
        (lambda: S(24, batch_size=2, d=3, sorter="GraB", num_replicas=4),
         "unknown sorter 'GraB'; choose one of CD-GraB, D-RR, D-SO, I-B, I-PB, Fold, KH-SGD, SBW, FlipFlop, SWR, "
         "Greedy, MB-GraB, RPB"),
        (lambda: S(24, batch_size=2, sorter="D-RR", sketch_dim=4, num_replicas=4),
         "sketch_dim must be 0, or > 0 with a sorter that balances gradients (CD-GraB, I-B, I-PB, KH-SGD, SBW, Greedy, "
         "MB-GraB, RPB); got 4 with D-RR"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=0), "need num_replicas >= 1 and batch_size >= 1, got 0 and 2"),
        (lambda: S(24, batch_size=0, d=3, num_replicas=2), "need num_replicas >= 1 and batch_size >= 1, got 2 and 0"),
        (lambda: S(24, batch_size=2, sorter="D-RR", num_replicas=4, rank=4), "rank 4 is not in 0..3"),
        (lambda: S(25, batch_size=2, d=3, num_replicas=4),
         "a dataset of 25 examples does not split over 4 replicas (1 left over); pass drop_last=True or trim the "
         "dataset"),
        (lambda: S(24, batch_size=5, d=3, num_replicas=2, view="global"),
         "view='global' needs every batch full, but 12 examples per replica leave a last batch of 2: pass "
         "drop_last=True (or a batch_size that divides 12)"),
        (lambda: S(24, batch_size=2, d=0, num_replicas=4),
         "CD-GraB balances gradients: pass d, the length of one example's gradient (e.g. PerExampleGrads(model, "
         "loss_fn).d)"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=4, rank=1),
         "CD-GraB needs every replica's gradients: initialise torch.distributed (the sampler all-gathers them), or "
         "leave rank=None to host all replicas here"),
        (lambda: S(24, batch_size=2, d=3, sorter="KH-SGD", num_replicas=4, epochs=0),
         "KH-SGD's threshold depends on the run's length: pass epochs, the total number of epochs (an integer >= 1), "
         "got 0"),
        (lambda: S(7, batch_size=2, d=3, num_replicas=4, drop_last=True),
         "7 examples are too few for 4 replicas x batch_size 2"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=4).set_epoch("1"),
         "set_epoch takes the epoch as an int (counting from 0), got '1'"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=4).set_epoch(2),
         "set_epoch(2): this sampler's next epoch is 0 (counting from 0; an epoch counts once step() has seen it); "
         "its orders depend on every earlier epoch, so to resume, load the state_dict saved with the checkpoint"),
        (lambda: started(S(24, batch_size=2, d=3, num_replicas=4), 1).set_epoch(2),
         "set_epoch(2): this sampler's next epoch is 0 (counting from 0; part-way, an epoch counts once step() has "
         "seen it); its orders depend on every earlier epoch, so to resume, load the state_dict saved with the "
         "checkpoint"),
        (lambda: started(S(24, batch_size=2, d=3, num_replicas=2)).set_epoch(1),
         "set_epoch(1): epoch 0 ended without step() calls, but CD-GraB orders by gradients: call "
         "sampler.step(per-example grads) after every batch"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=4).step(torch.zeros(8, 3)),
         "step() before the epoch started: iterate over the sampler (the DataLoader) first"),
        (lambda: iter(started(S(24, batch_size=2, d=3, num_replicas=4), 1)),
         "the previous epoch ended after step() saw 2 of 6 examples per replica; call step() for every batch (a "
         "DataLoader with drop_last=True skips the last, short batch: pass drop_last=True to the sampler instead)"),
        (lambda: started(S(24, batch_size=2, d=3, num_replicas=4), 1).step(torch.zeros(2, 3)),
         "CD-GraB sampler: grads must have shape (8, 3) or (4, 2, 3) at step 1 of 3, got (2, 3)"),
        (lambda: started(S(24, batch_size=3, d=3, num_replicas=1)).step(torch.zeros(1, 3)),
         "CD-GraB sampler: grads must have shape (3, 3) at step 0 of 8, got (1, 3)"),  # one replica: 2-D only
        (lambda: started(S(10, batch_size=4, sorter="D-RR", num_replicas=2), 1).step(torch.zeros(2)),
         "D-RR sampler: grads must have shape (2, 'd') or (2, 1, 'd') at step 1 of 2, got (2,)"),
        (lambda: started(S(10, batch_size=4, sorter="D-RR", num_replicas=2), 2).step(None),
         "step() called after the epoch's last batch (5 examples per replica seen); iterate over the sampler again "
         "to start the next epoch"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=4).load_state_dict({}, replay_from_epoch_start=1),
         "replay_from_epoch_start must be True or False, got 1"),
        (lambda: S(24, batch_size=2, d=3, num_replicas=4).load_state_dict(
            S(24, batch_size=2, d=3, sorter="KH-SGD", num_replicas=4, epochs=3).state_dict()),
         "sampler state is for other settings: epochs 3 (this sampler: None), sorter KH-SGD (this sampler: CD-GraB)"),
    ]
    for call, message in cases:
        assert refusal(call) == message


def test_the_smallest_settings_are_accepted():
    """One replica, batch_size 1, d = 1, epochs = 1: every bound is inclusive."""
    sampler = CDGraBSampler(3, batch_size=1, d=1, num_replicas=1)
    assert sampler.m == 3 and sampler.loader_batch_size == 1
    for _ in range(2):
        for index in list(sampler):
            sampler.step(torch.tensor([[float(index)]]))
    kh = CDGraBSampler(4, batch_size=1, d=1, sorter="KH-SGD", num_replicas=2, epochs=1)
    assert kh.state_dict()["config"]["epochs"] == 1
    assert len(CDGraBSampler(4, batch_size=2, sorter="D-RR", num_replicas=2, rank=1)) == 2  # the last rank
    alone = CDGraBSampler(6, batch_size=2, d=1)  # no process group: one replica, hosted here
    assert alone.num_replicas == 1 and alone.m == 6 and len(alone) == 6
    assert CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, device="meta").sorter.device.type == "meta"


def test_the_default_seed_is_zero():
    table = example_grads(12, 3)
    expected = run_engine_epoch(build_sorter("CD-GraB", 2, 6, 3, seed=0), table, 2)
    assert torch.equal(run_sampler_epoch(CDGraBSampler(12, batch_size=2, d=3, num_replicas=2), table), expected)


@pytest.mark.parametrize("sorter", ["D-RR", "Fold"])
def test_sorters_that_ignore_gradients_take_rows_of_any_width(sorter):
    """Without d, step() takes (R * b, w) or (R, b, w) rows of any width w, or None; the orders are those
    of the bare sorter."""
    n, m, k = 2, 6, 2
    engine_sorter = build_sorter(sorter, n, m, 1, seed=4)
    sampler = CDGraBSampler(n * m, batch_size=k, sorter=sorter, num_replicas=n, seed=4)
    for epoch, feed in enumerate([torch.zeros(n * k, 7), torch.zeros(n, k, 5), None]):
        expected = run_engine_epoch(engine_sorter, None, k)
        iter(sampler)
        for _ in range(m // k):
            sampler.step(feed)
        assert torch.equal(sampler.all_indices(), expected), epoch


def test_a_sketched_sampler_takes_replicas_x_batch_gradients_of_full_width():
    """(R, b, d) rows are sketched as the (R * b, d) ones are (here b = 3 differs from d = 5)."""
    n, m, k, d = 2, 6, 3, 5
    table = example_grads(n * m, d)
    flat, stacked = (CDGraBSampler(n * m, batch_size=k, d=d, num_replicas=n, sketch_dim=2) for _ in range(2))
    for _ in range(3):
        run_sampler_epoch(flat, table)
        for batch in torch.tensor(list(stacked)).split(n * k):
            stacked.step(table[batch].view(n, k, d))
        assert torch.equal(flat.all_indices(), stacked.all_indices())


def test_a_sampler_handed_sketches_never_builds_its_own_map():
    """A trainer that sketches itself (CDGraBTrainer(structured=True)) hands step() (B, D) rows: the sampler's
    own map over d coordinates (5 bytes each: 622 MB for GPT-2 small) is never built; (B, d) rows build it,
    and then are sketched with it (as the same map applied here)."""
    n, m, k, d, D = 2, 6, 3, 10**8, 4
    sampler = CDGraBSampler(n * m, batch_size=k, d=d, num_replicas=n, sketch_dim=D)
    for _ in range(2):
        iter(sampler)
        for _ in range(m // k):
            sampler.step(torch.randn(n * k, D))
    assert sampler._sketch is None
    small = CDGraBSampler(n * m, batch_size=k, d=7, num_replicas=n, sketch_dim=D, seed=3)
    table = example_grads(n * m, 7)
    run_sampler_epoch(small, table)
    assert small._sketch is not None and small.sketch.seed == 3 and small.sketch.dim == D
    sketched = CDGraBSampler(n * m, batch_size=k, d=7, num_replicas=n, sketch_dim=D, seed=3)
    run_sampler_epoch(sketched, small.sketch(table))  # the sketches, handed over: the same orders
    assert torch.equal(small.all_indices(), sketched.all_indices())
    for epoch in range(2):
        run_sampler_epoch(small, table)
        run_sampler_epoch(sketched, small.sketch(table))
        assert torch.equal(small.all_indices(), sketched.all_indices()), epoch


@pytest.mark.parametrize("sorter,sketch_dim", [("CD-GraB", 0), ("CD-GraB", 2), ("D-RR", 0)])
def test_under_a_process_group_each_rank_yields_its_replica_and_gathers_every_step(monkeypatch, sorter, sketch_dim):
    """Ranks of a 3-process group, simulated in one process: torch.distributed answers as rank r does, and the
    all-gather returns every rank's rows of the step (its sketches, with sketch_dim) after checking that rank r
    gave its own. Each rank, built with the defaults, yields its own replica's examples, and every rank's orders
    equal those of one sampler hosting all three replicas (m = 7: batches of 2, 2, 2, 1)."""
    import sorters.gather as gather_module
    from sorters import GradientSketch

    n, m, k, d = 3, 7, 2, 4
    table = example_grads(n * m, d, seed=2)
    sketch = GradientSketch(d, sketch_dim, seed=6) if sketch_dim else (lambda rows: rows)
    world = {"rank": 0, "step_rows": None}
    gathers = []

    def all_gather(out, local):
        rank, rows = world["rank"], world["step_rows"]
        b = rows.shape[1]
        assert out.shape == (n * b, sketch_dim or d) and out.dtype == local.dtype
        assert torch.allclose(local, sketch(rows[rank]))
        out.copy_(sketch(rows.reshape(n * b, d)))
        gathers.append(rank)

    # built before torch.distributed answers as a process group does: it hosts all three replicas
    one_process = CDGraBSampler(n * m, batch_size=k, d=d, sorter=sorter, num_replicas=n, seed=6, sketch_dim=sketch_dim)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: n)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: world["rank"])
    monkeypatch.setattr(gather_module, "_all_gather_single", all_gather)
    ranks = []
    for r in range(n):
        world["rank"] = r
        ranks.append(CDGraBSampler(n * m, batch_size=k, d=d, sorter=sorter, seed=6, sketch_dim=sketch_dim))
    if sorter == "CD-GraB":
        world["rank"] = 1
        assert refusal(CDGraBSampler, n * m, batch_size=k, d=d, num_replicas=n + 1, drop_last=True) == (
            "CD-GraB all-gathers gradients over the process group, so num_replicas and rank must be its world size "
            "3 and rank 1, got 4 and 1")
    for epoch in range(3):
        expected = run_sampler_epoch(one_process, table)
        yielded = [torch.tensor(list(sampler)) for sampler in ranks]
        for r in range(n):
            assert torch.equal(yielded[r], expected[r]), (epoch, r)
        for t in range(0, m, k):
            world["step_rows"] = torch.stack([table[yielded[r][t:t + k]] for r in range(n)])  # (n, b, d)
            for r, sampler in enumerate(ranks):
                world["rank"] = r
                sampler.step(world["step_rows"][r] if sampler.uses_grads else None)
        for sampler in ranks:
            assert torch.equal(sampler.all_indices(), expected)
    steps = 3 * -(-m // k)
    assert gathers == ([0, 1, 2] * steps if sorter == "CD-GraB" else [])  # D-RR communicates nothing


def test_the_gather_buffer_is_made_where_the_gradients_are(monkeypatch):
    """Under a process group step() all-gathers into a buffer on the gradients' device and in their dtype (NCCL
    gathers GPU tensors): float64 meta tensors stand in, and the simulated gather stops the step there."""
    import sorters.gather as gather_module

    class Gathered(Exception):
        pass

    def all_gather(out, local):
        raise Gathered(out.device.type, out.dtype, out.shape, local.device.type, local.dtype)

    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(gather_module, "_all_gather_single", all_gather)
    sampler = CDGraBSampler(8, batch_size=2, d=3)
    iter(sampler)
    with pytest.raises(Gathered) as info:
        sampler.step(torch.zeros(2, 3, dtype=torch.float64, device="meta"))
    assert info.value.args == ("meta", torch.float64, (4, 3), "meta", torch.float64)


# ------------------------------------------------------------------------------------------- state_dict


def test_the_state_dict_holds_the_documented_config():
    """The keys a checkpoint carries (they must read back in later versions); epochs only where it changes
    the orders (KH-SGD, SBW)."""
    plain = CDGraBSampler(24, batch_size=2, d=3, num_replicas=4, epochs=3)
    assert plain.state_dict()["config"] == {"sorter": "CD-GraB", "num_replicas": 4, "m": 6, "batch_size": 2, "d": 3,
                                            "seed": 0, "sketch_dim": 0}
    assert plain.state_dict()["position"] == 0 and plain.state_dict()["started"] is False
    no_grads = CDGraBSampler(24, batch_size=2, sorter="D-RR", num_replicas=4).state_dict()
    assert (no_grads["sorter"]["n"], no_grads["sorter"]["m"], no_grads["sorter"]["d"]) == (4, 6, 1)  # d: 1 unused
    kh = CDGraBSampler(24, batch_size=2, d=3, sorter="KH-SGD", num_replicas=4, epochs=3, seed=2)
    assert kh.state_dict()["config"] == {"sorter": "KH-SGD", "num_replicas": 4, "m": 6, "batch_size": 2, "d": 3,
                                         "seed": 2, "sketch_dim": 0, "epochs": 3}


def test_a_state_saved_before_sketch_dim_existed_loads():
    table = example_grads(12, 3)
    saved = CDGraBSampler(12, batch_size=2, d=3, num_replicas=2)
    run_sampler_epoch(saved, table)
    state = saved.state_dict()
    del state["config"]["sketch_dim"]
    resumed = CDGraBSampler(12, batch_size=2, d=3, num_replicas=2)
    resumed.load_state_dict(state)
    assert torch.equal(run_sampler_epoch(resumed, table), run_sampler_epoch(saved, table))


def test_resume_after_the_first_example_and_after_a_whole_epoch():
    """batch_size 1: a state saved after one step resumes with the rest of the epoch; a state saved at an
    epoch's end gives the whole next epoch (its length too), in either resume style."""
    n, m, d = 2, 5, 3
    table = example_grads(n * m, d, seed=3)
    straight = CDGraBSampler(n * m, batch_size=1, d=d, num_replicas=n)
    expected = [run_sampler_epoch(straight, table) for _ in range(2)]

    first = CDGraBSampler(n * m, batch_size=1, d=d, num_replicas=n)
    yielded = list(first)
    first.step(table[yielded[:n]])
    resumed = CDGraBSampler(n * m, batch_size=1, d=d, num_replicas=n)
    resumed.load_state_dict(first.state_dict())
    assert len(resumed) == n * (m - 1)
    rest = list(resumed)
    assert rest == yielded[n:]
    for t in range(0, len(rest), n):
        resumed.step(table[rest[t:t + n]])
    assert torch.equal(resumed.all_indices(), expected[0])
    for replay in (False, True):
        between = CDGraBSampler(n * m, batch_size=1, d=d, num_replicas=n)
        between.load_state_dict(resumed.state_dict(), replay_from_epoch_start=replay)
        assert len(between) == n * m
        assert torch.equal(run_sampler_epoch(between, table), expected[1])


def test_set_epoch_takes_the_previous_epoch_until_the_first_step_only():
    """A lagging caller's set_epoch(e - 1) is fine after iter() with no step yet; after one step (even of a
    single example) it is an error."""
    sampler = CDGraBSampler(4, batch_size=1, d=2, num_replicas=2)
    run_sampler_epoch(sampler, example_grads(4, 2))
    iter(sampler)
    sampler.set_epoch(0)
    sampler.step(torch.zeros(2, 2))
    assert "part-way" in refusal(sampler.set_epoch, 0)
    assert "ended after step() saw 1 of 2" in refusal(iter, sampler)


def test_fold_without_steps_folds_every_epoch():
    """set_epoch(e + 1) completes an epoch without step() calls: Fold then folds as if it had been stepped."""
    n, m, k = 2, 6, 2
    engine_sorter = build_sorter("Fold", n, m, 1, seed=1)
    sampler = CDGraBSampler(n * m, batch_size=k, sorter="Fold", num_replicas=n, seed=1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert torch.equal(torch.tensor(list(sampler)).view(-1, n, k).transpose(0, 1).reshape(n, m),
                           run_engine_epoch(engine_sorter, None, k)), epoch


# ------------------------------------------------------------------------------------------- per-example gradients


class TwoInputNet(torch.nn.Module):
    """A small net with two inputs, a buffer and a frozen parameter, to exercise the helper."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8 + 2, 3)
        self.frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, extra):
        hidden = torch.tanh(self.body(x) * self.scale + self.frozen)
        return self.head(torch.cat([hidden, extra], dim=1))


def loop_of_backward_passes(model, loss_fn, x, extra, y):
    """(B, d): one ordinary backward per example, every trainable parameter in named_parameters order."""
    rows = []
    trainable = [p for p in model.parameters() if p.requires_grad]
    for i in range(len(y)):
        model.zero_grad()
        loss_fn(model(x[i:i + 1], extra[i:i + 1]), y[i:i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in trainable]))
    return torch.stack(rows)


def test_per_example_grads_equal_a_loop_of_backward_passes_and_subsets_their_slices():
    torch.manual_seed(0)
    model = TwoInputNet()
    x, extra, y = torch.randn(6, 5), torch.randn(6, 2), torch.randint(0, 3, (6,))
    expected = loop_of_backward_passes(model, F.cross_entropy, x, extra, y)

    grads_of = PerExampleGrads(model, F.cross_entropy)
    assert grads_of.names == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias", "head.weight",
                              "head.bias"]
    assert grads_of.d == expected.shape[1] == 5 * 8 + 8 + 8 * 8 + 8 + 10 * 3 + 3
    torch.testing.assert_close(grads_of((x, extra), y), expected, rtol=1e-5, atol=1e-6)
    chunked = PerExampleGrads(model, F.cross_entropy, chunk_size=4)
    torch.testing.assert_close(chunked((x, extra), y), expected, rtol=1e-5, atol=1e-6)
    buffer = torch.empty(6, grads_of.d)
    assert grads_of((x, extra), y, out=buffer) is buffer
    torch.testing.assert_close(buffer, expected, rtol=1e-5, atol=1e-6)

    head = PerExampleGrads(model, F.cross_entropy, params=r"^head\.")
    head_columns = slice(grads_of.d - 33, grads_of.d)
    assert head.names == ["head.weight", "head.bias"] and head.d == 33
    torch.testing.assert_close(head((x, extra), y), expected[:, head_columns], rtol=1e-5, atol=1e-6)
    biases = per_example_grads(model, F.cross_entropy, (x, extra), y, params=["body.0.bias", "head.bias"])
    bias_columns = torch.cat([torch.arange(40, 48), torch.arange(grads_of.d - 3, grads_of.d)])
    torch.testing.assert_close(biases, expected[:, bias_columns], rtol=1e-5, atol=1e-6)
    assert "no trainable parameter name matches 'tail'" in one_line_error(PerExampleGrads, model, F.cross_entropy,
                                                                          params="tail")


class FunctionalDropout(torch.nn.Module):
    """Dropout the module check cannot see: F.dropout called in forward."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        return F.dropout(self.linear(x), 0.5, self.training)


def test_per_example_grads_refuse_dropout_in_one_line_that_says_what_to_do():
    x, y = torch.randn(5, 3), torch.randn(5)

    def loss_fn(out, target):
        return F.mse_loss(out.squeeze(-1), target)

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"module '1' is Dropout\(p=0.5\) in training mode.*model.eval\(\)"):
        PerExampleGrads(model, loss_fn)(x, y)
    with pytest.raises(ValueError, match=r"random numbers in its forward.*dropout p = 0, or model.eval\(\)"):
        PerExampleGrads(FunctionalDropout(), loss_fn)(x, y)
    # what the errors advise works: eval mode, or p = 0, gives the gradients
    assert PerExampleGrads(model.eval(), loss_fn)(x, y).shape == (5, 21)
    model.train()[1].p = 0.0
    assert PerExampleGrads(model, loss_fn)(x, y).shape == (5, 21)
    assert PerExampleGrads(FunctionalDropout().eval(), loss_fn)(x, y).shape == (5, 4)


def test_per_example_grads_follow_the_optimizer():
    """Parameters are read at each call, so the gradients after an update are the new ones."""
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    grads_of = PerExampleGrads(model, F.mse_loss)
    before = grads_of(x, y)
    with torch.no_grad():
        model.weight.add_(1.0)
    after = grads_of(x, y)
    torch.testing.assert_close(after, loop_of_linear(model, x, y))
    assert not torch.allclose(before, after)


def loop_of_linear(model, x, y):
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        F.mse_loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        rows.append(torch.cat([model.weight.grad.reshape(-1), model.bias.grad]))
    return torch.stack(rows)


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo's process group runs (its workers, its socket loop)."""
    names = [(Path("/proc/self/task") / task / "comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    return [name for name in names if "gloo" in name]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not torch.distributed.is_available(),
                    reason="lists threads through /proc (Linux); needs torch.distributed")
def test_the_examples_teardown_joins_gloos_threads(tmp_path):
    """The examples' end (release the DDP wrapper, destroy_process_group) frees the gloo group, so none of
    its threads runs on into interpreter exit, where one that frees a finished collective's tensors aborts
    the process (SIGABRT). It holds because `sorters` is imported before the group exists (sorters/sampler.py);
    this process imported it at collection."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 1)
        ddp_model = torch.nn.parallel.DistributedDataParallel(model)
        sampler = CDGraBSampler(8, batch_size=2, d=4, seed=0)  # all-gathers over the group
        for batch in torch.tensor(list(sampler)).split(2):
            x = torch.randn(2, 3)
            ddp_model(x).sum().backward()
            sampler.step(torch.cat([x, torch.ones(2, 1)], 1))
        assert "pt_gloo_runloop" in gloo_threads()
        dist.barrier()
        del ddp_model
    finally:
        dist.destroy_process_group()
    assert gloo_threads() == []


# ------------------------------------------------------------------------------------------- the example, end to end


def run_example(*args, nproc=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc else [sys.executable]
    result = run_python([*launcher, EXAMPLE, "--data-dir", DATA_DIR, *args],
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@needs_data("hmda/raw/hmda_train_preprocessed.zip")
def test_example_one_process_equals_torchrun(tmp_path):
    """The DDP example with 2 logical replicas in one process and with 2 gloo processes: the same orders,
    exactly, and the same losses to rounding (DDP averages per-process means; one process, one mean)."""
    common = ["--epochs", "2", "--max-train-examples", "400", "--sorter", "CD-GraB"]
    single = run_example(*common, "--replicas", "2", "--save-orders", tmp_path / "single.pt")
    run_example(*common, "--save-orders", tmp_path / "torchrun.pt", nproc=2)
    a, b = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "torchrun.pt")
    assert len(a["orders"]) == len(b["orders"]) == 2
    assert all(torch.equal(x, y) for x, y in zip(a["orders"], b["orders"]))
    assert a["orders"][0].shape == (2, 200) and not torch.equal(a["orders"][0], a["orders"][1])
    for column in ("train_loss", "test_loss"):
        assert b[column] == pytest.approx(a[column], rel=1e-5)
    assert a["train_loss"][1] < a["train_loss"][0]
    assert "epoch 2/2 | train loss" in single.stdout


@pytest.mark.parametrize("example", [EXAMPLE, "examples/accelerate_loop.py"])
@pytest.mark.parametrize("args,message", [
    (["--data-dir", "no-such-folder"], "no HMDA data in no-such-folder/hmda"),  # the data set: load_hmda
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),  # argparse
    pytest.param(["--data-dir", DATA_DIR, "--max-train-examples", "3"], "3 examples are too few",  # the sampler
                 marks=needs_data("hmda/raw/hmda_train_preprocessed.zip")),
])
def test_example_bad_input_gets_one_line_and_exit_2(tmp_path, example, args, message):
    """The own-loop DDP example and the Accelerate one alike."""
    result = run_python([sys.executable, REPO / example, *args], cwd=tmp_path,
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line, line
