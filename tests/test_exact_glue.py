"""Exact CD-GraB from layer records in your own loop: CDGraBSampler(exact=True) and step_units (issue #47),
in one process and in two gloo processes (the records all-gathered)."""
import pytest
import torch
import torch.nn.functional as F

from sorters import CDGraBSampler, CDGraBSettings
from sorters.exact import ExactCDGraB, ExactGradients
from tests.helpers import run_forked

REPLICAS, K, M, VOCAB, TOKENS, EPOCHS = 2, 3, 12, 11, 3, 3  # k odd: pairs span steps; 4 steps an epoch


class TiedNet(torch.nn.Module):
    """ids (B, T) -> logits (B, VOCAB): embedding (padding_idx 0) summed over the tokens but the pads (the
    tied output layer trains the pad row too), LayerNorm, and an output layer tied to the embedding. Pad
    tokens change nothing, so a batch may come padded to any length."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 5, padding_idx=0)
        self.norm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(5, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm((self.emb(ids) * ids.ne(0)[..., None]).sum(1)))


def data():
    """(REPLICAS * M, TOKENS) ids in 1..VOCAB-1 and (REPLICAS * M,) targets."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (REPLICAS * M, TOKENS), generator=generator)
    return ids, torch.randint(0, VOCAB, (REPLICAS * M,), generator=generator)


def each_examples_gradient(model, ids, y) -> torch.Tensor:
    """The oracle: (B, d) gradients by an ordinary backward per example, in named_parameters() order."""
    params = list(model.parameters())
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(model(ids[i:i + 1]), y[i:i + 1]),
                                                                    params)]) for i in range(len(ids))]
    return torch.stack(rows)


def train(how, pad=0, divide=False, device="cpu"):
    """Train TiedNet for EPOCHS epochs with a CDGraBSampler; returns (orders per epoch, losses, sampler).
    how: "recording" (one forward and backward a step, the documented loop), "call" (ExactGradients' own
    backward, then the loop's), or "formed" (the oracle: CD-GraB fed each example's gradient). Under a
    process group each process trains its replica, its gradient averaged as DDP does; pad: extra pad
    tokens on this process's batches; divide: the sampler's divide_products (each process its parameters');
    device: the model's and the batches' (the sampler stays on its default, the CPU)."""
    ids, targets = (x.to(device) for x in data())
    model = TiedNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5)
    distributed = torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    if how == "formed":
        sampler = CDGraBSampler(len(ids), batch_size=K, d=sum(p.numel() for p in model.parameters()), seed=1,
                                num_replicas=None if distributed else REPLICAS)
    else:
        exact = ExactGradients(model)
        sampler = CDGraBSettings(seed=1, num_replicas=None if distributed else REPLICAS,
                                 exact_low_memory=True).sampler(len(ids), batch_size=K, d=exact.d,
                                                                divide_products=divide)
    orders, losses = [], []
    for epoch in range(EPOCHS):
        indices = list(sampler)
        orders.append(sampler.all_indices())
        for t in range(0, len(indices), sampler.loader_batch_size):
            batch = indices[t:t + sampler.loader_batch_size]
            x, y = F.pad(ids[batch], (0, pad)), targets[batch]
            optimizer.zero_grad(set_to_none=True)  # .grad None at watch(): units(from_grad=True) may use it
            if how == "formed":
                sampler.step(each_examples_gradient(model, x, y))
            elif how == "call":
                sampler.step_units(exact(lambda: F.cross_entropy(model(x), y, reduction="none")))
            with exact.recording() if how == "recording" else torch.enable_grad() as rec:
                per_example = F.cross_entropy(model(x), y, reduction="none")  # (B,)
                if how == "recording":
                    rec.watch(per_example)
            loss = per_example.mean()
            loss.backward()
            if how == "recording":
                sampler.step_units(rec.units(from_grad=True))  # before anything changes .grad
            if distributed:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
                torch.distributed.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
            optimizer.step()
    return orders, losses, sampler


@pytest.fixture(scope="module")
def formed():
    return train("formed")


@pytest.mark.parametrize("how", ["recording", "call"])
def test_own_loop_gives_cdgrabs_orders_and_losses_for_the_formed_gradients(formed, how):
    """The two documented loops (docs/sampler.md) against the same loop balancing each example's gradient
    formed by an ordinary backward (CD-GraB, float64 running sum): the same orders every epoch, the same losses."""
    orders, losses, sampler = train(how)
    assert isinstance(sampler.sorter, ExactCDGraB) and sampler.sorter.near_ties == 0
    assert [o.tolist() for o in orders] == [o.tolist() for o in formed[0]]
    assert not torch.equal(formed[0][1], formed[0][2])  # the orders depend on the gradients
    assert losses == pytest.approx(formed[1], rel=1e-5)


def run_rank(rank, store, pads, out, divide):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=REPLICAS)
    try:
        orders, losses, sampler = train("recording", pad=pads[rank], divide=divide)
        shared = sampler.sorter.share
        owned = None if shared is None else shared.owned
        torch.save({"orders": orders, "losses": losses, "state": sampler.state_dict(), "owned": owned},
                   f"{out}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def recorded():
    return train("recording")


@pytest.mark.parametrize("pad, divide", [(2, False), (4, False), (2, True)])
def test_two_gloo_processes_equal_one_process(formed, recorded, tmp_path, pad, divide):
    """Each of 2 gloo processes hands its own units to step_units, which all-gathers them; rank 1's batches
    come with `pad` more pad tokens, so the embedding's records have 3 and 3 + pad tokens: with 5 they are
    padded and gathered as records, with 7 the tied matrix's gradient formed per unit is the smaller and is
    gathered instead (test below). The orders of one process hosting both replicas (and of the formed
    gradients), the same losses, and both ranks end with the same sampler state. divide_products: each rank
    takes its own parameters' products and update (ParameterShare); state_dict() sums the shares into one
    process's running sum."""
    run_forked(run_rank, (tmp_path / "store", (0, pad), tmp_path / "run", divide), REPLICAS)
    runs = [torch.load(tmp_path / f"run.rank{r}") for r in range(REPLICAS)]
    for run in runs:
        assert [o.tolist() for o in run["orders"]] == [o.tolist() for o in formed[0]]
        assert run["losses"] == pytest.approx(formed[1], rel=1e-5)
    a, b = (run["state"]["sorter"] for run in runs)
    assert a.keys() == b.keys() and torch.equal(a["running_sum"], b["running_sum"])
    torch.testing.assert_close(a["running_sum"], recorded[2].state_dict()["sorter"]["running_sum"], rtol=1e-5,
                               atol=1e-6)
    if divide:  # each of the 2 ranks owns a part of the parameters
        owned = [run["owned"] for run in runs]
        assert all(x != y for x, y in zip(*owned)) and any(owned[0]) and any(owned[1])
    else:
        assert runs[0]["owned"] is None


def test_the_exact_sampler_takes_records_only_and_says_so_in_one_line():
    model = TiedNet()
    exact = ExactGradients(model)
    ids, y = data()
    sampler = CDGraBSampler(len(ids), batch_size=K, d=exact.d, num_replicas=REPLICAS, exact=True)
    plain = CDGraBSampler(len(ids), batch_size=K, d=exact.d, num_replicas=REPLICAS)
    for s in (sampler, plain):
        iter(s)
    units = exact(lambda: F.cross_entropy(model(ids[:REPLICAS * K]), y[:REPLICAS * K], reduction="none"))

    def refusal(error, call, *args, **kwargs):
        with pytest.raises(error) as refused:
            call(*args, **kwargs)
        assert "\n" not in str(refused.value)
        return str(refused.value)
    assert "step_units(exact(...))" in refusal(ValueError, sampler.step, torch.zeros(REPLICAS * K, exact.d))
    assert "built with exact=True" in refusal(ValueError, plain.step_units, units)
    assert "got Tensor" in refusal(TypeError, sampler.step_units, torch.zeros(REPLICAS * K, exact.d))
    short = exact(lambda: F.cross_entropy(model(ids[:K]), y[:K], reduction="none"))
    assert "got 3 units for a step of 2 replicas x 3 examples" in refusal(ValueError, sampler.step_units, short)
    assert "sorter='CD-GraB', sketch_dim=0" in refusal(ValueError, CDGraBSampler, 24, batch_size=K, d=exact.d,
                                                       sorter="I-B", exact=True)
    assert "exact must be True or False" in refusal(TypeError, CDGraBSampler, 24, batch_size=K, d=3, exact=1)
    assert sampler.position == 0
    sampler.step_units(units)
    assert sampler.position == K


def test_each_parameter_is_exchanged_as_the_smaller_of_its_records_and_its_formed_gradient():
    """exchange_bytes against the byte counts by hand, TiedNet's tied (11, 5) matrix (an Outer of the output
    layer, 1 token, and the embedding's Rows of T tokens) and the (11,) bias (one Formed)."""
    from sorters.gather import exchange_bytes

    model = TiedNet()
    exact = ExactGradients(model)
    ids, y = data()
    units = exact(lambda: F.cross_entropy(model(ids[:2]), y[:2], reduction="none"))
    tied = [x for _, x in units.pieces[id(model.emb.weight)]]
    assert sorted(type(x).__name__ for x in tied) == ["Outer", "Rows"]
    for T, chosen in ((5, "records"), (7, "formed")):
        tokens = [1 if type(x).__name__ == "Outer" else T for x in tied]
        records = 1 * (11 + 5) * 4 + T * 8 + T * 5 * 4
        assert exchange_bytes(model.emb.weight, tied, tokens) == (records, 11 * 5 * 4)
        assert ("formed" if 11 * 5 * 4 < records else "records") == chosen
    bias = [x for _, x in units.pieces[id(model.head.bias)]]
    assert exchange_bytes(model.head.bias, bias, [1]) == (11 * 4, 11 * 4)
    # ShardedRows' "owners" route, 6 of the 11 rows received: the output layer's row factor and the formed
    # gradient count 6 rows, the embedding's records stay whole; at T = 3 the choice differs from the whole one's
    tokens = [1 if type(x).__name__ == "Outer" else 3 for x in tied]
    owners = 1 * (6 + 5) * 4 + 3 * 8 + 3 * 5 * 4
    assert exchange_bytes(model.emb.weight, tied, tokens, rows=6) == (owners, 6 * 5 * 4)
    assert 6 * 5 * 4 < owners and 11 * 5 * 4 > min(exchange_bytes(model.emb.weight, tied, tokens))
    assert exchange_bytes(model.head.bias, bias, [1], rows=6) == (6 * 4, 6 * 4)
