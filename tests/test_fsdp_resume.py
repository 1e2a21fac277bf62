"""Exact CD-GraB on a model sharded with fully_shard, without d numbers on any process, and its resume
(sorters.fsdp.sharded_state_dict / load_sharded_state_dict, issue #61; docs/fsdp.md).

MLP-M4's small model (tests/test_fsdp.py's MLPCase: d = 71) under forked gloo processes, 2 replicas, steps of 3
examples each (a unit waits for its pair across steps):

- an uninterrupted 2-process run saves a mid-epoch checkpoint with torch.distributed.checkpoint (the model's
  DTensors and the sampler's rows), with a unit pending, and goes on;
- the checkpoint is restored onto 2 processes (the sampler), and onto 3 and 1 (the sorter: its 2 workers'
  examples split over the processes, the rows re-split by the chunk rule), and the run goes on: the orders of
  every later epoch equal the uninterrupted run's bit for bit, the running sum after every later step within
  float32 rounding, and bit for bit from the next epoch on where the arithmetic is the same (2 processes);
- a torch dispatch mode around the sampler's and the sorter's every call (construction, steps, saving,
  restoring) sees no tensor with a dimension of d;
- a checkpoint of another model is refused in one line.
"""
import os
import socket

import pytest
import torch

from sorters.exact import ExactCDGraB, ExactGradients
from tests.helpers import release_check, run_forked
from tests.test_fsdp import CASES, LR, SEED, K, M, N

EPOCHS = 4
CHECKPOINT = (1, K)  # (epoch, position): after the first step of epoch 1, with a unit of each worker pending


class DSized:
    """A torch dispatch mode that notes every op whose output has a dimension of d (not on the meta device)."""

    def __new__(cls, d):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and not t.is_meta and d in tuple(t.shape):
                        self.seen.append((str(func), tuple(t.shape)))
                return out

        return Mode()


def other_model(case_name):
    """Another model than the case's, of another d: MLP-M4's of hidden width 4, GPT-2's of a vocabulary of 12."""
    torch.manual_seed(0)
    if case_name == "mlp":
        from models.mlp import AutoregressiveMLP
        return AutoregressiveMLP(in_len=6, hidden=4, n_layers=3)
    from models.gpt2 import build_gpt2
    return build_gpt2(vocab_size=12, n_embd=6, n_layer=2, n_head=2, n_positions=8)


def sharded(case, model):
    from torch.distributed.fsdp import fully_shard
    for block in case.blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def rows_of(sorter, exact):
    """This process's rows of the running sum, {name: (r1 - r0, C) copy}."""
    return {name: sorter.share.view(sorter.running_sum, p).clone() for name, p in zip(exact.names, exact.params)}


def resume_rank(rank, world, port, path, phase, case_name):
    """One of `world` forked gloo processes, on CASES[case_name]'s model. phase "save": the uninterrupted run, a
    checkpoint at CHECKPOINT (and there the whole state_dict beside each process's part);
    "sampler": restored into a CDGraBSampler (2 processes); "sorter": into an ExactCDGraB of 2 workers, their
    examples split over the processes. Saves its orders, rows of the running sum per step and what the dispatch
    mode saw to path.phase.worldW.rankR."""
    import torch.distributed.checkpoint as dcp

    from sorters import CDGraBSampler
    from sorters.fsdp import load_sharded_state_dict, sharded_state_dict
    from sorters.gather import all_gather_units
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        case = CASES[case_name]
        model = sharded(case, case.model())
        exact = ExactGradients(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        watch = DSized(exact.d)
        with watch:  # the mode sees a (d,) tensor: it is not blind
            torch.zeros(exact.d)
        out = {"sees": len(watch.seen), "orders": {}, "sums": {}, "refused": {}}
        watch.seen.clear()
        checkpoint = f"{path}.checkpoint"
        if phase != "save":
            state = model.state_dict()
            dcp.load({"model": state}, checkpoint_id=checkpoint)
            model.load_state_dict(state)
            other = ExactGradients(sharded(case, other_model(case_name)))
            for what, exact_of, seed, where, key in (("another model", other, SEED, checkpoint, "sampler"),
                                                     ("another key", exact, SEED, checkpoint, "model"),
                                                     ("no checkpoint", exact, SEED, f"{path}.none", "sampler"),
                                                     ("another seed", exact, SEED + 1, checkpoint, "sampler")):
                fresh = CDGraBSampler(N * M, batch_size=K, d=exact_of.d, seed=seed, exact=True)
                try:
                    load_sharded_state_dict(fresh, exact_of, where, key=key)
                except ValueError as error:
                    out["refused"][what] = str(error)
        x, y = case.data()

        def train(batch, step):
            """The forward and backward of this process's examples, `step(units)`, the optimizer's step."""
            optimizer.zero_grad()
            with exact.recording() as rec:
                per_example = case.losses(model, x[batch], y[batch])
                rec.watch(per_example)
            per_example.mean().backward()
            units = rec.units()
            with watch:
                step(units)
            optimizer.step()

        if phase in ("save", "sampler"):
            with watch:
                sampler = CDGraBSampler(N * M, batch_size=K, d=exact.d, seed=SEED, exact=True)
                if phase == "sampler":
                    load_sharded_state_dict(sampler, exact, checkpoint)
            for epoch in range(sampler.epoch, EPOCHS):
                indices = list(sampler)  # after the restore: the rest of the epoch
                out["orders"][epoch] = sampler.all_indices()
                for t in range(0, len(indices), K):
                    train(indices[t:t + K], sampler.step_units)
                    out["sums"][(epoch, sampler.position)] = rows_of(sampler.sorter, exact)
                    if phase == "save" and (epoch, sampler.position) == CHECKPOINT:
                        with watch:
                            saved = sharded_state_dict(sampler, exact)
                            dcp.save({"model": model.state_dict(), "sampler": saved}, checkpoint_id=checkpoint)
                        # the whole state (d numbers: outside the mode) holds every process's part, bit for bit
                        whole, share = sampler.sorter.state_dict(), sampler.sorter.share
                        part = sampler.sorter.state_dict(sharded=True)
                        out["whole_vs_part"] = {key: (whole[key], share.part(whole[key]), part[key])
                                                for key in ("running_sum", "pending")}
        else:  # the sorter of 2 workers on `world` processes: each step's 2 K examples split over them
            with watch:
                sorter = ExactCDGraB(N, M, exact.d, seed=SEED)
                load_sharded_state_dict(sorter, exact, checkpoint)
            while True:
                if sorter._next_position == M:
                    if sorter.epoch == EPOCHS:
                        break
                    sorter.sort()
                epoch, t = sorter.epoch - 1, sorter._next_position
                indices = sorter.orders + torch.arange(N)[:, None] * M
                out["orders"][epoch] = indices
                batch = indices[:, t:t + K].reshape(-1).tensor_split(world)[rank].tolist()  # replica-major

                def step(units, t=t):
                    if world > 1:
                        units = all_gather_units(units, sorter.share)  # rank-major: replica-major again
                    sorter.step(units, range(t, t + K))
                train(batch, step)
                out["sums"][(epoch, t + K)] = rows_of(sorter, exact)
        out["seen"], out["case"] = watch.seen, case_name
        torch.save(out, f"{path}.{phase}.world{world}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the tiny GPT-2 (an embedding's rows, LayerNorm and bias vectors, the tied wte / lm_head): a release check
@pytest.fixture(scope="module", params=["mlp", pytest.param("gpt2", marks=release_check)])
def runs(request, tmp_path_factory):
    """{(phase, world): [each rank's output]}: the uninterrupted run, then each restore from its checkpoint."""
    pytest.importorskip("torch.distributed.checkpoint")
    path = tmp_path_factory.mktemp("fsdp_resume") / "run"
    got = {}
    for phase, world in (("save", 2), ("sampler", 2), ("sorter", 3), ("sorter", 1)):
        run_forked(resume_rank, (world, free_port(), path, phase, request.param), world)
        got[phase, world] = [torch.load(f"{path}.{phase}.world{world}.rank{r}") for r in range(world)]
    return got


def whole(ranks, key):
    """The running sum's rows of every process put together, {name: (R, C)}, rank after rank."""
    return {name: torch.cat([got["sums"][key][name] for got in ranks]) for name in ranks[0]["sums"][key]}


@pytest.mark.parametrize("restored", [("sampler", 2), ("sorter", 3), ("sorter", 1)],
                         ids=["2-processes", "3-processes", "1-process"])
def test_a_restored_run_goes_on_as_the_uninterrupted_one(runs, restored):
    """From the mid-epoch checkpoint (a unit pending) on: every epoch's orders bit for bit, the running sum after
    every step within float32 rounding, and, on as many processes, bit for bit from the next epoch on."""
    uninterrupted, after = runs["save", 2], runs[restored]
    assert not torch.equal(uninterrupted[0]["orders"][2], uninterrupted[0]["orders"][3])  # they follow gradients
    assert sorted(after[0]["orders"]) == list(range(CHECKPOINT[0], EPOCHS))
    for got in after:
        for epoch, orders in got["orders"].items():
            assert torch.equal(orders, uninterrupted[0]["orders"][epoch]), f"epoch {epoch}"
    keys = sorted(after[0]["sums"])
    assert keys[0] == (CHECKPOINT[0], M) and keys[-1] == (EPOCHS - 1, M)
    for key in keys:
        mine, theirs = whole(after, key), whole(uninterrupted, key)
        for name in theirs:
            if restored[1] == 2 and key[0] > CHECKPOINT[0]:
                assert torch.equal(mine[name], theirs[name]), f"{key} {name}"
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
        assert any(bool(t.ne(0).any()) for t in theirs.values())


def test_no_process_allocates_a_tensor_of_d(runs):
    """Around every call of the sampler and the sorter (construction, steps, saving, restoring), in every process
    of the runs on 2 and 3 processes (on 1, its rows are all d): no tensor with a dimension of d = 71; the mode
    itself sees torch.zeros(d)."""
    for (phase, world), ranks in runs.items():
        for rank, got in enumerate(ranks):
            assert got["sees"] == 1
            if world == 1:
                continue
            assert got["seen"] == [], f"{phase} on {world}, rank {rank}: {got['seen'][:3]}"


def test_a_checkpoint_it_cannot_continue_from_is_refused_in_one_line(runs):
    """Another model's parameters (hidden width 4), no state under the key, no checkpoint, another seed; on 3
    processes, a sampler of 3 replicas: the pending units of another number of workers."""
    expected = {"another model": "the checkpoint is of another model: net.0.weight's running sum is (5, 6) there, "
                                 "(4, 6) here",
                "another key": "holds no state of sharded_state_dict under key 'model'",
                "no checkpoint": "cannot read checkpoint",
                "another seed": f"sampler state is for other settings: seed {SEED} (this sampler: {SEED + 1})"}
    for phase in (("sampler", 2), ("sorter", 3)):
        for got in runs[phase]:
            if got["case"] == "gpt2":  # its vocabulary of 12: the tied matrix's rows
                expected["another model"] = "the checkpoint is of another model: transformer.wte.weight's"
            if phase[1] == 3:
                expected["another seed"] = "the checkpoint's pending units of"
            assert got["refused"].keys() == expected.keys()
            for what, message in got["refused"].items():
                assert "\n" not in message and expected[what] in message, message


def test_the_whole_state_dict_holds_each_process_part(runs):
    """At the checkpoint, sampler.state_dict()'s whole running sum and pending gradients (the processes' parts
    put together) are the same in every process and hold each process's part of state_dict(sharded=True), bit
    for bit; a unit is pending."""
    ranks = runs["save", 2]
    for rank, got in enumerate(ranks):
        for key, (whole, from_whole, part) in got["whole_vs_part"].items():
            assert part is not None and part.ne(0).any(), f"rank {rank} {key}"
            assert torch.equal(whole, ranks[0]["whole_vs_part"][key][0]), f"rank {rank} {key}"
            assert torch.equal(from_whole, part), f"rank {rank} {key}"


def test_the_running_sum_is_allocated_by_the_first_step_where_the_records_are():
    """One process, no share: a new ExactCDGraB holds its running sum on the meta device (no memory); its
    state_dict has the zero (d,) sum CDGraB's has, and a sorter loaded from it takes it; the first step allocates
    it, and adds the step's signed gradients (against each example's gradient from its own backward)."""
    model = CASES["mlp"].model()
    exact = ExactGradients(model)
    sorter = ExactCDGraB(1, 4, exact.d)
    assert sorter.running_sum.is_meta and sorter.running_sum.shape == (exact.d,)
    state = sorter.state_dict()
    assert torch.equal(state["running_sum"], torch.zeros(exact.d))
    loaded = ExactCDGraB(1, 4, exact.d)
    loaded.load_state_dict(state)
    assert not loaded.running_sum.is_meta
    with pytest.raises(ValueError, match="has no share"):
        sorter.state_dict(sharded=True)
    x, y = CASES["mlp"].data()
    sorter.sort()
    units = exact(lambda: CASES["mlp"].losses(model, x[:2], y[:2]))
    sorter.step(units, range(2))
    grads = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(CASES["mlp"].losses(model, x[i:i + 1], y[i:i + 1])
                                                                   .sum(), exact.params)]) for i in range(2)]
    sign = 1.0 if sorter.next_orders[0, 0] == sorter.orders[0, 0] else -1.0  # the first unit placed left: +1
    torch.testing.assert_close(sorter.running_sum, sign * (grads[0] - grads[1]), rtol=1e-5, atol=1e-6)
