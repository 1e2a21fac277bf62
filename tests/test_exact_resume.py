"""Exact CD-GraB resumed from a checkpoint saved while units wait for their pair (k odd: a pair spans two
steps, the state holds the pending units' (n, d) gradients formed): the resumed run gives the orders of the
uninterrupted one and of a float64 CD-GraB written out in this file, through ExactCDGraB itself (also from a
state that sorters.CDGraB saved) and through CDGraBSampler(exact=True)."""
import pytest
import torch
import torch.nn.functional as F

from sorters import CDGraB, CDGraBSampler
from sorters.exact import ExactCDGraB, ExactGradients
from tests.helpers import checkpoint_roundtrip

N, K, M, VOCAB, TOKENS, EPOCHS = 2, 3, 10, 7, 3, 3  # steps of 3, 3, 3, 1 positions: units wait after 1st and 3rd
CUTS = [(0, 1), (1, 3)]  # (epoch, steps done): positions 3 and 9 done, the units at 2 and 8 waiting


class TiedNet(torch.nn.Module):
    """ids (B, TOKENS) -> logits (B, VOCAB): an embedding summed over the tokens, LayerNorm, and an output layer
    tied to the embedding (the tied matrix's records: an Outer and Rows; the biases: Formed)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids).sum(1)))


def data():
    """(N * M, TOKENS) ids and (N * M,) targets; worker j's local unit u is example j * M + u."""
    generator = torch.Generator().manual_seed(4)
    return (torch.randint(0, VOCAB, (N * M, TOKENS), generator=generator),
            torch.randint(0, VOCAB, (N * M,), generator=generator))


def each_examples_gradient(model, ids, y) -> torch.Tensor:
    """(B, d) float64: one ordinary backward per example, in named_parameters() order."""
    params = list(model.parameters())
    return torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        F.cross_entropy(model(ids[i:i + 1]), y[i:i + 1]), params)]) for i in range(len(ids))]).double()


def oracle(orders: torch.Tensor, grads: torch.Tensor):
    """CD-GraB's epoch in float64, written out: orders (n, m), grads (n, m, d) by local unit. Pairs of
    positions (0, 1), (2, 3), ... visited pair-major, worker-minor; sign +1 (first to the left) when
    <S, first - second> <= 0; an odd m's last unit in the middle. Returns (next orders, S at the end)."""
    n, m = orders.shape
    S = torch.zeros(grads.shape[2], dtype=torch.float64)
    nxt = torch.full((n, m), -1, dtype=torch.long)
    for p in range(m // 2):
        for j in range(n):
            first, second = orders[j, 2 * p], orders[j, 2 * p + 1]
            v = grads[j, first] - grads[j, second]
            plus = float(S @ v) <= 0
            S += v if plus else -v
            nxt[j, p], nxt[j, m - 1 - p] = (first, second) if plus else (second, first)
    if m % 2:
        nxt[:, m // 2] = orders[:, m - 1]
    return nxt, S


def perturb(model, epoch: int) -> None:
    """Move the model between epochs (seeded), so that each epoch's gradients differ."""
    generator = torch.Generator().manual_seed(100 + epoch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator))


def run_sorter(cut=None, first="exact"):
    """EPOCHS epochs of the sorter alone (the model fixed within an epoch, moved between epochs). At
    cut = (epoch, steps) the state goes through a checkpoint file into a fresh ExactCDGraB (other seed)
    that goes on; first: the sorter before the cut, "exact" (ExactCDGraB) or "formed" (sorters.CDGraB fed
    the gradients formed, float32). Returns (orders of every sort(), running sum at each epoch's end, the
    epochs' (n, m, d) gradients, near-ties)."""
    model = TiedNet()
    exact = ExactGradients(model)
    ids, y = data()
    sorter = ExactCDGraB(N, M, exact.d, seed=5) if first == "exact" else CDGraB(N, M, exact.d, seed=5)
    orders_seen, sums, grads = [], [], []
    for epoch in range(EPOCHS):
        orders = sorter.sort()
        orders_seen.append(orders)
        grads.append(each_examples_gradient(model, ids, y).view(N, M, -1))
        for step, t in enumerate(range(0, M, K)):
            if (epoch, step) == cut:
                state = checkpoint_roundtrip(sorter.state_dict())
                assert state["pending"].shape == (N, exact.d) and state["pending_position"] == t - 1
                sorter = ExactCDGraB(N, M, exact.d, seed=6)
                sorter.load_state_dict(state)
            positions = range(t, min(t + K, M))
            idx = (orders[:, list(positions)] + torch.arange(N)[:, None] * M).reshape(-1)
            if isinstance(sorter, ExactCDGraB):
                sorter.step(exact(lambda: F.cross_entropy(model(ids[idx]), y[idx], reduction="none")), positions)
            else:
                sorter.step(grads[-1].view(N * M, -1)[idx].float().view(N, len(positions), -1), positions)
        sums.append(sorter.running_sum.double().clone())
        perturb(model, epoch)
    orders_seen.append(sorter.sort())
    return orders_seen, sums, grads, sorter.near_ties


@pytest.fixture(scope="module")
def uninterrupted():
    return run_sorter()


def test_the_uninterrupted_run_is_the_float64_oracles(uninterrupted):
    """The reference the resumed runs are held to: every epoch's next orders and final sum are the oracle's."""
    orders, sums, grads, near_ties = uninterrupted
    assert near_ties == 0
    for epoch in range(EPOCHS):
        expected, S = oracle(orders[epoch], grads[epoch])
        assert torch.equal(orders[epoch + 1], expected), f"epoch {epoch}"
        torch.testing.assert_close(sums[epoch], S, rtol=1e-5, atol=1e-6)
    assert not torch.equal(orders[1], orders[2])  # the orders depend on the gradients


@pytest.mark.parametrize("first", ["exact", "formed"])
@pytest.mark.parametrize("cut", CUTS)
def test_resumed_with_a_pending_unit_gives_the_uninterrupted_orders(uninterrupted, cut, first):
    """Saved after an odd number of an epoch's positions (units waiting for their pair), by ExactCDGraB or by
    CD-GraB fed the formed gradients (its state has the same keys), loaded into a fresh ExactCDGraB: the
    orders of every later epoch and the running sums of the uninterrupted run (to the float32 rounding of
    the saved pending gradients), hence the oracle's."""
    orders, sums, _, near_ties = run_sorter(cut, first)
    assert [o.tolist() for o in orders] == [o.tolist() for o in uninterrupted[0]]
    for epoch in range(cut[0], EPOCHS):
        torch.testing.assert_close(sums[epoch], uninterrupted[1][epoch], rtol=1e-5, atol=1e-6)
    assert near_ties == 0


def test_a_loaded_pending_unit_is_saved_again_as_it_was_loaded():
    """Loaded, then saved before any step (a retried save): the same (n, d) pending gradients."""
    model = TiedNet()
    exact = ExactGradients(model)
    ids, y = data()
    sorter = ExactCDGraB(N, M, exact.d, seed=5)
    orders = sorter.sort()
    idx = (orders[:, :K] + torch.arange(N)[:, None] * M).reshape(-1)
    sorter.step(exact(lambda: F.cross_entropy(model(ids[idx]), y[idx], reduction="none")), range(K))
    state = checkpoint_roundtrip(sorter.state_dict())
    last = idx.view(N, K)[:, K - 1]
    torch.testing.assert_close(state["pending"].double(), each_examples_gradient(model, ids[last], y[last]),
                               rtol=1e-5, atol=1e-7)  # worker j's waiting unit is row j
    resumed = ExactCDGraB(N, M, exact.d)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.state_dict()["pending"], state["pending"])


# ---------------------------------------------------------------------------------- through CDGraBSampler

def train_with_sampler(exact_records=True, stop=None, state=None, replay=False):
    """EPOCHS epochs of SGD on TiedNet with CDGraBSampler(exact=True) (exact_records) or the formed path
    (CDGraB fed each example's gradient). stop: return after that many steps with the checkpoint
    (sampler state and model weights, through a file); state: resume from such a checkpoint (replay: the
    loader replays the epoch and drops the batches done itself). Returns (orders of each epoch's
    iteration, losses, checkpoint or None)."""
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    ids, targets = data()
    exact = ExactGradients(model)
    sampler = CDGraBSampler(N * M, batch_size=K, d=exact.d, num_replicas=N, seed=1, exact=exact_records)
    skip = 0
    if state is not None:
        model.load_state_dict(state["model"])
        sampler.load_state_dict(state["sampler"], replay_from_epoch_start=replay)
        skip = state["sampler"]["position"] // K if replay else 0
    orders, losses, steps = [], [], 0
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        orders.append(sampler.all_indices())
        for t in range(skip * sampler.loader_batch_size, len(indices), sampler.loader_batch_size):
            batch = indices[t:t + sampler.loader_batch_size]
            x, y = ids[batch], targets[batch]
            optimizer.zero_grad(set_to_none=True)
            if not exact_records:
                sampler.step(each_examples_gradient(model, x, y).float())
            with exact.recording() if exact_records else torch.enable_grad() as rec:
                per_example = F.cross_entropy(model(x), y, reduction="none")
                if exact_records:
                    rec.watch(per_example)
            loss = per_example.mean()
            loss.backward()
            if exact_records:
                sampler.step_units(rec.units(from_grad=True))
            optimizer.step()
            losses.append(loss.item())
            steps += 1
            if steps == stop:
                return orders, losses, checkpoint_roundtrip({"sampler": sampler.state_dict(),
                                                             "model": model.state_dict()})
        skip = 0
    return orders, losses, None


@pytest.fixture(scope="module")
def sampler_runs():
    """(exact, formed): the uninterrupted runs through the sampler."""
    return train_with_sampler(), train_with_sampler(exact_records=False)


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("stop", [5, 7])  # 4 steps an epoch: epoch 1 after 1 step (position 3), after 3 (9)
def test_the_exact_sampler_resumes_mid_pair(sampler_runs, stop, replay):
    """CDGraBSampler(exact=True) saved mid-epoch with units waiting for their pair, loaded into a fresh
    sampler and model: the rest of the run iterates the uninterrupted run's orders, with its losses, and
    those of the sampler fed the formed gradients."""
    (orders, losses, _), (formed_orders, formed_losses, _) = sampler_runs
    assert [o.tolist() for o in orders] == [o.tolist() for o in formed_orders]
    assert losses == pytest.approx(formed_losses, rel=1e-5)
    done_orders, done_losses, checkpoint = train_with_sampler(stop=stop)
    assert checkpoint["sampler"]["sorter"]["pending"] is not None
    rest_orders, rest_losses, _ = train_with_sampler(state=checkpoint, replay=replay)
    assert [o.tolist() for o in done_orders[:-1] + rest_orders] == [o.tolist() for o in orders]
    assert done_losses + rest_losses == pytest.approx(losses, rel=1e-5)


def test_a_state_it_cannot_continue_is_refused_in_one_line_before_anything_changes():
    """I-PB's state (per-worker sums, no running_sum) and a pending of another width: one line each, and the
    sorter keeps its own state."""
    from sorters import IndependentPairBalance
    other = IndependentPairBalance(N, M, 5)
    other.sort()
    other.step(torch.randn(N, K, 5), range(K))
    sorter = ExactCDGraB(N, M, 5)
    wrong_width = {**sorter.state_dict(), "pending": torch.zeros(N, 4), "_next_position": K, "pending_position": K - 1}
    for state, says in ((other.state_dict(), "missing running_sum"), (wrong_width, r"shape \(2, 5\), got .* \(2, 4\)")):
        with pytest.raises(ValueError, match=says) as refused:
            sorter.load_state_dict(checkpoint_roundtrip(state))
        assert "\n" not in str(refused.value) and sorter.pending is None and sorter._next_position == 0
