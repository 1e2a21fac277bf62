"""Exact CD-GraB with the products' work divided over processes (ExactCDGraB(share=ParameterShare)): every
process holds every unit, takes the products and the running sum's update of its own parameters only, and
the per-parameter products are summed over the processes. Held to one process without a share, bit for bit:
the products of every step, the orders, the running sum a checkpoint holds, and a run resumed from it."""
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sorters.exact import ExactCDGraB, ExactGradients
from sorters.gather import ParameterShare, all_gather_units
from tests.helpers import assert_same, checkpoint_roundtrip, run_forked
from tests.test_exact_resume import EPOCHS, K, M, N, TiedNet, data, perturb

CUT = (1, 1)  # epoch 1 after its first step of 3 positions: the units at position 2 wait for their pair


def fake_exact(sizes):
    """What ParameterShare reads of an ExactGradients: params and their offsets in the flat vector."""
    params = [torch.zeros(n) for n in sizes]
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    return SimpleNamespace(params=params, offsets={id(p): s for p, s in zip(params, starts)})


def test_each_parameter_goes_largest_first_to_the_process_with_the_least_work():
    """sizes 3, 10, 5, 7, 3 over 2 processes, by hand: 10 -> 0; 7 -> 1; 5 -> 1 (7 < 10); 3 (the first) -> 0
    (12 > 10); 3 (the last) -> 1 (12 < 13)."""
    exact = fake_exact([3, 10, 5, 7, 3])
    shares = [ParameterShare(exact, rank, 2, reduce=lambda x: x) for rank in range(2)]
    assert shares[0].owned == [True, True, False, False, False]
    assert shares[1].owned == [False, False, True, True, True]
    assert shares[0].work == shares[1].work == [13, 15]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_parameter_has_exactly_one_owner(world):
    generator = torch.Generator().manual_seed(world)
    exact = fake_exact(torch.randint(1, 50, (11,), generator=generator).tolist())
    owned = [ParameterShare(exact, rank, world, reduce=lambda x: x).owned for rank in range(world)]
    assert [sum(column) for column in zip(*owned)] == [1] * 11


def test_a_process_part_of_a_flat_vector_is_its_parameters_entries():
    exact = fake_exact([2, 3, 1])  # process 0 owns the 3 (the largest) only; process 1 the 2 and the 1
    flat = torch.arange(1.0, 7.0)
    shares = [ParameterShare(exact, rank, 2, reduce=lambda x: x) for rank in range(2)]
    assert [share.size for share in shares] == [3, 3]
    assert shares[0].part(flat).tolist() == [3, 4, 5] and shares[1].part(flat).tolist() == [1, 2, 6]
    assert shares[1].view(shares[1].part(flat), exact.params[2]).reshape(-1).tolist() == [6]
    assert shares[0].whole(torch.tensor([7.0, 8, 9]), 6).tolist() == [0, 0, 7, 8, 9, 0]
    assert shares[1].whole(torch.tensor([7.0, 8, 9]), 6).tolist() == [7, 8, 0, 0, 0, 9]


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not one of world size 2"):
        ParameterShare(fake_exact([1]), 2, 2, reduce=lambda x: x)


def run(share_of=None, cut=None, late=False, gather=False):
    """EPOCHS epochs of ExactCDGraB(sum_all=True) on TiedNet (the model fixed within an epoch, moved between
    them), each step's units recorded whole by this process (as all_gather_units hands every process all of
    them: no backward gradient). share_of(exact): None or a ParameterShare. At `cut` the state goes through a
    file into a fresh sorter (late: given the share after loading, with use_share, as CDGraBSampler does at its
    first step). gather (under 2 gloo processes, one worker each): this process records its worker's units only
    and all_gather_units hands them over, with the share: each parameter's records to its owner only.
    Returns every step's (a, G), parameters taken and parameters held, every sort(), the state at the cut and
    at each epoch's end, and the near-ties."""
    model = TiedNet()
    exact = ExactGradients(model)
    ids, y = data()

    def fresh(seed):
        return ExactCDGraB(N, M, exact.d, seed=seed, sum_all=True, share=share_of and share_of(exact))

    sorter, out = fresh(5), {"products": [], "taken": [], "held": [], "orders": [], "states": [], "cut": None}
    rank = torch.distributed.get_rank() if gather else None
    for epoch in range(EPOCHS):
        orders = sorter.sort()
        out["orders"].append(orders)
        for step, t in enumerate(range(0, M, K)):
            if (epoch, step) == cut:
                out["cut"] = checkpoint_roundtrip(sorter.state_dict())
                sorter = fresh(6) if not late else ExactCDGraB(N, M, exact.d, seed=6, sum_all=True)
                sorter.load_state_dict(out["cut"])
                if late and share_of:
                    sorter.use_share(share_of(exact))
            positions = range(t, min(t + K, M))
            idx = (orders[:, list(positions)] + torch.arange(N)[:, None] * M)
            idx = (idx if rank is None else idx[rank]).reshape(-1)
            with exact.recording() as rec:
                losses = F.cross_entropy(model(ids[idx]), y[idx], reduction="none")
                rec.watch(losses)
            losses.sum().backward()  # the loop's own backward: .grad, which the units do not carry
            units = rec.units() if rank is None else all_gather_units(rec.units(), sorter.share)
            out["held"].append(sorted(exact.names[i] for i, p in enumerate(exact.params) if units.pieces.get(id(p))))
            sorter.step(units, positions)
            out["products"].append(sorter.last_products)
            out["taken"].append(sorted(exact.names[i] for i, p in enumerate(exact.params) if id(p) in exact.last_how))
        out["states"].append(sorter.state_dict())
        perturb(model, epoch)
    out["orders"].append(sorter.sort())
    out["near_ties"], out["sum_numel"], out["d"] = sorter.near_ties, sorter.running_sum.numel(), exact.d
    return out


def shared_rank(rank, port, path):
    """One of 2 forked gloo processes: the run with a share, uninterrupted and cut, saved to path.rankR."""
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save({"whole": run(ParameterShare), "cut": run(ParameterShare, CUT),
                    "late": run(ParameterShare, CUT, late=True), "gathered": run(None, CUT, gather=True),
                    "gathered to owners": run(ParameterShare, CUT, gather=True)}, f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    path = tmp_path_factory.mktemp("share") / "run"
    run_forked(shared_rank, (port, path), 2)
    return [torch.load(f"{path}.rank{r}") for r in range(2)]


@pytest.mark.parametrize("variant", ["whole", "cut", "late"])
def test_two_processes_dividing_the_products_are_one_process_bit_for_bit(ranks, variant):
    """Each rank's products of every step, orders, states (the running sum summed over the ranks at the
    cut and at each epoch's end; the resumed sorter zeroes what it does not own, whether it had the share
    before loading or got it after) and near-ties equal those of
    one process without a share, bit for bit."""
    one = run(None, None if variant == "whole" else CUT)
    for rank, got in enumerate(ranks):
        got = got[variant]
        for key in ("products", "orders", "states", "cut", "near_ties"):
            assert_same(got[key], one[key], f"rank {rank} {key}")
    assert not torch.equal(one["orders"][1], one["orders"][2])  # the orders depend on the gradients


def test_each_process_takes_the_products_of_its_own_parameters_only(ranks):
    """At every step the ranks' parameters are disjoint and together every parameter one process takes; each
    rank's running sum holds its parameters only (the parts' lengths add up to d)."""
    one = run()
    sizes = [r["whole"]["sum_numel"] for r in ranks]
    assert 0 < min(sizes) and sum(sizes) == one["sum_numel"] == one["d"]
    for step, taken in enumerate(one["taken"]):
        mine = [set(r["whole"]["taken"][step]) for r in ranks]
        assert mine[0] and mine[1] and not mine[0] & mine[1], step
        assert sorted(mine[0] | mine[1]) == taken, step


def test_records_gathered_to_their_owners_only_give_the_all_gathered_run_bit_for_bit(ranks):
    """Each rank records its own worker's units; all_gather_units with the share sends each parameter's records
    to its owner only: the products, orders and states (a unit pending at the cut included) of the run that
    all-gathers everything without a share, on both ranks, and each rank holds only its own parameters."""
    for rank, got in enumerate(ranks):
        whole, divided = got["gathered"], got["gathered to owners"]
        for key in ("products", "orders", "states", "cut", "near_ties"):
            assert_same(divided[key], whole[key], f"rank {rank} {key}")
        assert all(held == taken for held, taken in zip(divided["held"], divided["taken"])), rank
        assert all(len(held) > len(mine) for held, mine in zip(whole["held"], divided["held"])), rank
    assert ranks[0]["gathered"]["cut"]["pending"].ne(0).any(dim=1).all()  # both workers' units were waiting


def train_writing_grads(distributed: bool):
    """EPOCHS epochs of SGD on TiedNet, one example per replica and step (pairs span steps: every other step
    has no pair), CDGraBSampler(exact=True) with the backward skipping the weights' gradients
    (recording(write_grads=True)): in one process hosting both replicas the records write .grad; under 2 gloo
    processes (divide_products) each parameter's owner writes it and broadcasts the mean, no all-reduce in the
    loop. Returns (orders, losses, parameters)."""
    from sorters import CDGraBSampler
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    exact = ExactGradients(model)
    ids, targets = data()
    sampler = CDGraBSampler(N * M, batch_size=1, d=exact.d, num_replicas=None if distributed else N, seed=1,
                            exact=True, divide_products=distributed)
    orders, losses = [], []
    for epoch in range(EPOCHS):
        indices = list(sampler)
        orders.append(sampler.all_indices())
        for t in range(0, len(indices), sampler.loader_batch_size):
            batch = indices[t:t + sampler.loader_batch_size]
            optimizer.zero_grad(set_to_none=True)
            with exact.recording(write_grads=True) as rec:
                per_example = F.cross_entropy(model(ids[batch]), targets[batch], reduction="none")
                rec.watch(per_example)
            loss = per_example.mean()
            loss.backward()
            units = rec.units()
            sampler.step_units(units)
            units.write_grads()  # one process: what the products did not reach; under torchrun a no-op
            optimizer.step()
            losses.append(loss.item())
    return orders, losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def writing_rank(rank, port, path):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save(train_writing_grads(True), f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_owners_write_the_processes_mean_gradient_as_one_process_writes_its_own(tmp_path):
    """The weights' gradients from the records under 2 processes (each parameter's owner broadcasting its
    step gradient over 2, also on the steps without a pair) train as one process hosting both replicas: the
    same orders, losses averaging to its own, and the same parameters on both ranks."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_forked(writing_rank, (port, tmp_path / "run"), 2)
    ranks = [torch.load(tmp_path / f"run.rank{r}") for r in range(2)]
    orders, losses, params = train_writing_grads(False)
    for rank_orders, rank_losses, rank_params in ranks:
        assert [o.tolist() for o in rank_orders] == [o.tolist() for o in orders]
        assert set(rank_params) == set(params)
        for name, p in rank_params.items():
            torch.testing.assert_close(p, params[name], rtol=1e-5, atol=1e-6)
    assert [(a + b) / 2 for a, b in zip(ranks[0][1], ranks[1][1])] == pytest.approx(losses, rel=1e-5)
    assert all(torch.equal(ranks[0][2][name], ranks[1][2][name]) for name in params)
    assert not torch.equal(orders[1], orders[2])
