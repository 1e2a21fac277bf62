"""Exact CD-GraB on a model sharded with FSDP2 (sorters/fsdp.py, issue #61): each process keeps the running sum
of its own rows of every parameter and takes the products over those rows only, the partials summed over the
processes.

- In one process: the row-restricted products of every layer rule (Linear, Embedding, LayerNorm, biases, a tied
  matrix), summed over 2 and 3 simulated processes, against float64 per-example gradients from ordinary
  backward passes; and the running sum's update.
- Under 2 forked gloo processes: MLP-M4's model fully_shard-ed layer by layer and at the root (uneven rows: a
  process owns none of the output layer), trained with CDGraBSampler(exact=True), against one unsharded
  process hosting both replicas with sorters.CDGraB fed float64 per-example gradients: the same orders bit for
  bit, losses and parameters within float32 rounding, and each process's running sum about d / 2.
"""
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from sorters.balance import CDGraB
from sorters.exact import ExactCDGraB, ExactGradients
from sorters.fsdp import ShardedRows, owned_rows
from tests.helpers import release_check, run_forked
from tests.test_exact_resume import TiedNet, data, each_examples_gradient

# ---------------------------------------------------------------------------------- row-restricted rules


def test_owned_rows_are_torch_chunk_split():
    """R rows over P processes: ceil(R / P) each, the last ones fewer or none (FSDP2's split)."""
    p = torch.zeros(5, 2)
    assert [owned_rows(p, rank=r, world=2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [owned_rows(torch.zeros(1, 3), rank=r, world=2) for r in range(2)] == [(0, 1), (1, 1)]
    assert [owned_rows(torch.zeros(7), rank=r, world=3) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("how", ["stream", "ghost"])
def test_rows_products_summed_over_processes_are_the_whole_products(world, how):
    """TiedNet (an Embedding tied to the output Linear, LayerNorm, biases): each simulated process's products
    over its rows, summed, equal <S, g_u> and <g_u, g_v> of float64 per-example gradients; each process's update
    of its rows, put together, is S + sum_u w_u g_u. world 3 splits the 7-row matrix 3/3/1 and leaves one process
    without any row of the LayerNorm's 4."""
    model = TiedNet()
    ids, y = data()
    ids, y = ids[:6], y[:6]
    exact = ExactGradients(model, how=how)
    units = exact(lambda: F.cross_entropy(model(ids), y, reduction="none"))
    units.step_grads = None  # the products of the records alone (the backward's gradient is tested below)
    grads = each_examples_gradient(model, ids, y)                     # (U, d) float64
    generator = torch.Generator().manual_seed(1)
    S = torch.randn(exact.d, generator=generator)
    w = torch.randn(len(ids), generator=generator).double()
    shares = [ShardedRows(exact, rank, world, reduce=lambda x: x) for rank in range(world)]
    assert sum(share.size for share in shares) == exact.d
    a = sum(units.products(share.part(S), share=share)[0] for share in shares)
    G = sum(units.products(share.part(S), share=share)[1] for share in shares)
    torch.testing.assert_close(a, grads @ S.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(G, grads @ grads.T, rtol=1e-5, atol=1e-6)
    updated = torch.zeros(exact.d, dtype=torch.float64)
    for share in shares:
        part = share.part(S)
        units.add_to(part, w, share=share)
        updated += share.whole(part, exact.d).double()
    torch.testing.assert_close(updated, S.double() + w @ grads, rtol=1e-5, atol=1e-6)


def test_the_backward_gradient_is_cut_to_the_owned_rows():
    """Units that carry their backward's whole gradient (ExactGradients' call: step_grads): the update with a
    weight common to most units adds the gradient's owned rows (ShardedRows.restrict_grad)."""
    model = TiedNet()
    ids, y = data()
    ids, y = ids[:4], y[:4]
    exact = ExactGradients(model)
    units = exact(lambda: F.cross_entropy(model(ids), y, reduction="none"))
    grads = each_examples_gradient(model, ids, y)
    w = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    updated = torch.zeros(exact.d, dtype=torch.float64)
    for rank in range(2):
        share = ShardedRows(exact, rank, 2, reduce=lambda x: x)
        part = torch.zeros(share.size)
        units.add_to(part, w, share=share)
        updated += share.whole(part, exact.d).double()
    torch.testing.assert_close(updated, w @ grads, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- fully_shard, 2 processes

N, M, K, EPOCHS, HORIZON, LR, SEED = 2, 6, 3, 3, 2, 0.05, 3  # steps of 3 positions: a unit waits across steps


class MLPCase:
    """MLP-M4's model, small: Linear(6, 5), Linear(5, 5), Linear(5, 1) (5 rows split 3/2, the output's 1 row
    owned by process 0 alone), each layer fully_shard-ed; windows of 6 values, a rollout of HORIZON steps."""

    @staticmethod
    def model():
        from models.mlp import AutoregressiveMLP
        torch.manual_seed(0)
        return AutoregressiveMLP(in_len=6, hidden=5, n_layers=3)

    @staticmethod
    def blocks(model):
        return [layer for layer in model.net if isinstance(layer, torch.nn.Linear)]

    @staticmethod
    def data():
        generator = torch.Generator().manual_seed(2)
        return torch.randn(N * M, 6, generator=generator), torch.randn(N * M, HORIZON, generator=generator)

    @staticmethod
    def losses(model, x, y):
        """(B,) each window's rollout loss, mean over the horizon of the squared error."""
        return (model(x, HORIZON) - y).square().mean(1)


class GPT2Case:
    """The tiny GPT-2 of models/gpt2.py, smaller: a vocabulary of 11 (the tied wte / lm_head matrix: 11 rows
    split 6/5), width 6, 2 blocks fully_shard-ed one by one; blocks of 5 tokens, each example's loss the mean
    next-token cross-entropy."""

    @staticmethod
    def model():
        from models.gpt2 import build_gpt2
        torch.manual_seed(0)
        return build_gpt2(vocab_size=11, n_embd=6, n_layer=2, n_head=2, n_positions=8)

    @staticmethod
    def blocks(model):
        return list(model.transformer.h)

    @staticmethod
    def data():
        ids = torch.randint(0, 11, (N * M, 5), generator=torch.Generator().manual_seed(2))
        return ids, ids

    @staticmethod
    def losses(model, x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none").mean(1)


CASES = {"mlp": MLPCase, "gpt2": GPT2Case}


def sharded_rank(rank, port, path, case_name, records="owners"):
    """One of 2 forked gloo processes: the sharded model trained with CDGraBSampler(exact=True), its records
    routed by ShardedRows(records=`records`); its orders, losses, final parameters (whole), running sum's length
    and the collectives each step_units made (and the all-to-alls each backward made) saved to path.rankR."""
    from torch.distributed.fsdp import fully_shard

    from sorters import CDGraBSampler
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    ShardedRows.RECORDS = records  # (this forked process only) the route the sampler's share takes
    calls = {"all_reduce": 0, "all_to_all_single": 0}  # the sorter's collectives, counted in step_units

    def counted(name):
        collective = getattr(torch.distributed, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return collective(*args, **kwargs)
        return call
    for name in calls:
        setattr(torch.distributed, name, counted(name))
    norms = []  # per step, the ||S||^2 the near-tie count was given (summed over the processes in the products')
    count_near_ties = ExactCDGraB._count_near_ties

    def kept_norm(sorter, *args):
        norms.append(args[-1])
        return count_near_ties(sorter, *args)
    ExactCDGraB._count_near_ties = kept_norm
    try:
        case = CASES[case_name]
        model = case.model()
        for block in case.blocks(model):
            fully_shard(block)
        fully_shard(model)
        exact = ExactGradients(model)  # after fully_shard: the sharded parameters
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        sampler = CDGraBSampler(N * M, batch_size=K, d=exact.d, seed=SEED, exact=True)
        x, y = case.data()
        orders, losses, products, sums, collectives = [], [], [], [], []
        for _ in range(EPOCHS):
            indices = list(sampler)
            orders.append(sampler.all_indices())
            for t in range(0, len(indices), K):
                batch = indices[t:t + K]
                optimizer.zero_grad()
                with exact.recording() as rec:
                    per_example = case.losses(model, x[batch], y[batch])
                    rec.watch(per_example)
                before = dict(calls)
                per_example.mean().backward()
                in_backward = calls["all_to_all_single"] - before["all_to_all_single"]
                before = dict(calls)
                units = rec.units()
                # the parameters recorded: each has rows to route in these tiny models (an Outer's left, a formed
                # vector, an embedding's gradient formed: smaller than its records)
                routed = sum(bool(units.pieces.get(id(p))) for p in exact.params)
                sampler.step_units(units)
                collectives.append({**{name: calls[name] - before[name] for name in calls},
                                    "all_to_all_single in the backward": in_backward, "routed parameters": routed})
                optimizer.step()
                losses.append(per_example.detach())
                share = sampler.sorter.share
                products.append(sampler.sorter.last_products)
                sums.append(share.reduce(share.whole(sampler.sorter.running_sum, exact.d)))  # the whole S, here only
        torch.save({"orders": orders, "losses": losses, "params": [p.full_tensor() for p in model.parameters()],
                    "products": products, "sums": sums, "collectives": collectives, "norms": norms,
                    "sum_numel": sampler.sorter.running_sum.numel(), "d": exact.d,
                    "unit_sums": sampler.sorter.sum_all,
                    "rows": sampler.sorter.share.rows,
                    "local": [p.to_local().shape[0] for p in exact.params]}, f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


def float64(t):
    """A float tensor in float64 (the oracle's twin model); ids as they are."""
    return t.double() if t.is_floating_point() else t


def one_process(case, n=N, weights=None, round_to=None):
    """The n replicas (default both) in one unsharded process: sorters.CDGraB fed each example's float64 gradient
    (one ordinary backward per example), SGD on the mean loss of the step's n K examples. Returns orders, each
    replica's losses per step, final parameters, and per step the products of the pairs' differences in CD-GraB's
    visiting order (the pending pairs worker by worker, then pair-major, worker-minor), a (r,) with the running
    sum at the step's start and G (r, r), and the running sum after the step.

    weights: None (the gradients at this process's own SGD iterates), or per step the parameters to take them
    at instead (a sharded run's own, when its training is not this one's: mixed precision). round_to: None, or
    a dtype the gradients' parameters and the model's input x are rounded to first (bf16: the float64 gradients of
    the function a bf16 forward computes, at the weights and inputs it sees)."""
    model = case.model()
    twin = case.model().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    d = sum(p.numel() for p in model.parameters())
    sorter = CDGraB(n, M, d, seed=SEED, dtype=torch.float64)
    x, y = case.data()
    x_seen = x.to(round_to) if round_to is not None and x.is_floating_point() else x  # the gradients' input
    orders, losses, products, sums = [], [[] for _ in range(n)], [], []
    for _ in range(EPOCHS):
        indices = sorter.sort() + torch.arange(n)[:, None] * M
        orders.append(indices.clone())
        for t in range(0, M, K):
            positions = range(t, min(t + K, M))
            batch = indices[:, list(positions)].reshape(-1)  # replica 0's examples, then replica 1's ...
            with torch.no_grad():
                at = model.parameters() if weights is None else weights[len(sums)]
                for p64, p in zip(twin.parameters(), at):
                    p64.copy_(p if round_to is None else p.to(round_to))
            grads = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                case.losses(twin, *(float64(t[i:i + 1]) for t in (x_seen, y))).sum(), list(twin.parameters()))])
                for i in batch.tolist()])
            grads = grads.view(n, len(positions), d)
            begin = 0 if sorter.pending is None else 1
            diffs = [] if sorter.pending is None else [sorter.pending[j] - grads[j, 0] for j in range(n)]
            diffs += [grads[j, begin + 2 * i] - grads[j, begin + 2 * i + 1]
                      for i in range((len(positions) - begin) // 2) for j in range(n)]
            diffs = torch.stack(diffs)
            products.append((diffs @ sorter.running_sum, diffs @ diffs.T))
            sorter.step(grads, positions)
            sums.append(sorter.running_sum.clone())
            optimizer.zero_grad()
            per_example = case.losses(model, x[batch], y[batch])
            per_example.mean().backward()
            optimizer.step()
            for j, rows in enumerate(per_example.detach().view(n, -1)):
                losses[j].append(rows)
    return orders, losses, [p.detach() for p in model.parameters()], products, sums


# (case, records route): MLP-M4 by every route; the tiny GPT-2 (about 30 s more on this 2-core CPU) by the
# default route and the overlapped one, release checks (scripts/release_checks.py)
@pytest.fixture(scope="module", params=[("mlp", "owners"), ("mlp", "all"), ("mlp", "owners-overlapped"),
                                        pytest.param(("gpt2", "owners"), marks=release_check),
                                        pytest.param(("gpt2", "owners-overlapped"), marks=release_check)],
                ids=["mlp-owners", "mlp-all", "mlp-owners-overlapped", "gpt2-owners", "gpt2-owners-overlapped"])
def ranks(request, tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    case_name, records = request.param
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    path = tmp_path_factory.mktemp("fsdp") / "run"
    run_forked(sharded_rank, (port, path, case_name, records), 2)
    return case_name, [torch.load(f"{path}.rank{r}") for r in range(2)], records


def test_sharded_model_gives_one_process_orders_bit_for_bit(ranks):
    """Both processes' orders of every epoch equal one unsharded process's with CDGraB on float64 per-example
    gradients, bit for bit; each replica's losses and the final parameters agree within float32 rounding, and so
    do every step's products of the pairs' differences and the whole running sum after it (the ranks' rows put
    together): what a dropped term changes even where no sign flips."""
    case_name, ranks, _ = ranks
    orders, losses, params, products, sums = one_process(CASES[case_name])
    assert not torch.equal(orders[1], orders[2])  # the orders follow the gradients
    for rank, got in enumerate(ranks):
        for epoch, (mine, theirs) in enumerate(zip(got["orders"], orders)):
            assert torch.equal(mine, theirs), f"rank {rank} epoch {epoch}"
        torch.testing.assert_close(torch.cat(got["losses"]), torch.cat(losses[rank]), rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(got["params"], params):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        for step, ((a, G), (a_ref, G_ref)) in enumerate(zip(got["products"], products)):
            # float32 records: each product's error is relative to its vectors' norms (Cauchy-Schwarz), not itself
            v_norm = float(G_ref.diagonal().max().sqrt())
            s_norm = float(sums[step - 1].norm()) if step else 0.0
            assert float((a - a_ref).abs().max()) <= 1e-5 * s_norm * v_norm, f"rank {rank} step {step} <S, v>"
            assert float((G - G_ref).abs().max()) <= 1e-5 * v_norm ** 2, f"rank {rank} step {step} <v, v>"
        for step, (mine, theirs) in enumerate(zip(got["sums"], sums)):
            torch.testing.assert_close(mine.double(), theirs, rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step} S")


def test_each_process_keeps_the_running_sum_of_its_own_rows(ranks):
    """The running sums' lengths add up to d, each near d / 2; the owned rows are FSDP2's local shards (their
    lengths), first rank first: by hand for MLP-M4's (rows 3/2, 3/2, 1/0 of the three layers). No process keeps
    the units' sum of each parameter for the update (ExactCDGraB's sum_all: d / P floats more, as much as S)."""
    case_name, ranks, _ = ranks
    assert not any(got["unit_sums"] for got in ranks)
    sizes = [got["sum_numel"] for got in ranks]
    assert sum(sizes) == ranks[0]["d"] and min(sizes) > 0.3 * ranks[0]["d"]
    for first, second, local0, local1 in zip(ranks[0]["rows"], ranks[1]["rows"], ranks[0]["local"], ranks[1]["local"]):
        assert first[0] == 0 and first[1] == second[0]
        assert (first[1] - first[0], second[1] - second[0]) == (local0, local1)
    if case_name == "mlp":
        assert ranks[0]["rows"] == [(0, 3), (0, 3), (0, 3), (0, 3), (0, 1), (0, 1)]
        assert ranks[1]["rows"] == [(3, 5), (3, 5), (3, 5), (3, 5), (1, 1), (1, 1)]


def test_one_all_reduce_a_step_and_the_records_route(ranks):
    """Each step_units makes one all-reduce: the products' partials, with ||S||^2's parts riding along (docs/fsdp.md
    item 5), which the near-tie count gets whole: the one-process oracle's ||S||^2 at the step's start (0 at an
    epoch's). The records take the route asked for: the row factors' owned rows ("owners": every parameter's in
    ONE all-to-all a step, sorters.gather.Exchange), none ("all"); "owners-overlapped" makes that one packed
    all-to-all in step_units at the first step (the sampler installs the exchange there) and the second (whose
    backward learns which layer records which parameter), then one per parameter a step, each started
    inside the backward but the last recorded call's (sent once the other process's token counts are in: at
    step_units)."""
    case_name, ranks, records = ranks
    sums = one_process(CASES[case_name])[4]
    steps_per_epoch = -(-M // K)
    whole = [0.0 if step % steps_per_epoch == 0 else float(sums[step - 1].square().sum()) for step in range(len(sums))]
    for got in ranks:
        assert got["norms"] == pytest.approx(whole, rel=1e-5)
        assert all(step["all_reduce"] == 1 for step in got["collectives"])
        routed = [step["all_to_all_single"] for step in got["collectives"]]
        in_backward = [step["all_to_all_single in the backward"] for step in got["collectives"]]
        parameters = [step["routed parameters"] for step in got["collectives"]]
        assert min(parameters) > 2
        if records == "owners-overlapped":
            assert routed[:2] == [1, 1] and in_backward[:2] == [0, 0]
            assert all(0 < late < count for late, count in zip(routed[2:], parameters[2:]))
            assert all(late + early == count for late, early, count in zip(routed[2:], in_backward[2:], parameters[2:]))
        else:
            assert all(count == 1 for count in routed) if records == "owners" else not any(routed)
            assert not any(in_backward)


# ---------------------------------------------------------------------------------- the overlapped exchange

class TwoCalls(torch.nn.Module):
    """Linear(4, 3) and a second Linear tied to its weight, which the forward calls only when asked: the tied
    weight then gets two records a step, and the second layer is new to the exchange the first time."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        self.second.weight = self.first.weight

    def forward(self, x, both):
        y = self.first(x)
        return (y + self.second(x) if both else y).square().sum(1)


def contribution_tensors(x):
    """A contribution's tensors, to compare two exchanges' results exactly."""
    return [x.left, x.right] if hasattr(x, "left") else [x.ids, x.values] if hasattr(x, "ids") else [x.values]


def overlapped_rank(rank, port, path):
    """One of 2 forked gloo processes: TwoCalls (not sharded: ShardedRows splits its rows 2/1) recorded over 4
    steps with an OverlappedExchange, the second layer called from the third step on. Per step: which parameters
    the backward started, whether each started one was sent with all its records, and whether all_gather_units'
    result equals the owners' route's on the same records, exchanged after the backward (to the bit)."""
    from sorters.exact import UnitGradients
    from sorters.gather import OverlappedExchange, all_gather_units
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = TwoCalls()
        exact = ExactGradients(model)
        share = ShardedRows(exact, records="owners-overlapped")
        exact.overlapped = OverlappedExchange(share)
        names = {id(p): name for name, p in zip(exact.names, exact.params)}
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        steps = []
        for both in (False, False, True, True):
            with exact.recording() as rec:
                losses = model(x, both)
                rec.watch(losses)
            losses.sum().backward()
            units = rec.units()
            started = exact.overlapped.started
            whole = {key: count == len(records) for key, (records, count, _) in started.items()}
            after = all_gather_units(UnitGradients(units.owner, units.units, units.pieces, units.scale), share)
            got = all_gather_units(units, share)
            same = got.pieces.keys() == after.pieces.keys() and all(
                len(got.pieces[key]) == len(after.pieces[key]) and all(
                    torch.equal(a, b) for (_, x), (_, y) in zip(got.pieces[key], after.pieces[key])
                    for a, b in zip(contribution_tensors(x), contribution_tensors(y)))
                for key in got.pieces)
            steps.append({"started": sorted(names[key] for key in whole), "whole": all(whole.values()), "same": same})
        torch.save(steps, f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_the_overlapped_exchange_starts_what_it_has_learned_and_sends_the_owners_records(tmp_path):
    """The exchange starts nothing in the backward it learns in, nor in one that calls a layer first met there;
    then every parameter, the tied weight only with both its records; and what all_gather_units returns is the
    owners' route's exchange of the same records after the backward, to the bit."""
    pytest.importorskip("torch.distributed")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_forked(overlapped_rank, (port, tmp_path / "run"), 2)
    everything = ["first.bias", "first.weight", "second.bias"]
    for rank in range(2):
        steps = torch.load(tmp_path / f"run.rank{rank}")
        assert [step["started"] for step in steps] == [[], ["first.bias", "first.weight"], [], everything]
        assert all(step["whole"] and step["same"] for step in steps), steps
