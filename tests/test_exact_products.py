"""Exact CD-GraB from layer records (sorters/exact_products.py, sorters/exact.py), against an oracle: each
example's gradient formed by an ordinary backward of its loss alone (float64), the products and updates
computed from those, and the library's CDGraB fed those gradients."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sorters.exact_products as products
from sorters.balance import CDGraB
from sorters.exact import ExactCDGraB, ExactGradients, _squared_norm
from sorters.hf import _causal_lm_losses

V, E, T, B = 13, 6, 5, 6


class TiedNet(nn.Module):
    """Every rule at once: an Embedding with padding_idx used twice, a position Embedding, LayerNorm, a
    Linear with and one without bias, and an output Linear whose weight IS the token embedding's."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(V, E, padding_idx=0)
        self.positions = nn.Embedding(T, E)
        self.norm = nn.LayerNorm(E)
        self.hidden = nn.Linear(E, E)
        self.skip = nn.Linear(E, E, bias=False)
        self.head = nn.Linear(E, V, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids, positions):
        x = self.norm(self.tokens(ids) + self.positions(positions))
        h = torch.tanh(self.hidden(x)) + self.skip(self.tokens(ids))
        return self.head(h)


def tied_net():
    torch.manual_seed(0)
    model = TiedNet().double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    ids[0, 1] = ids[2, 3] = 0  # padding tokens: their rows of the embedding get nothing
    positions = torch.arange(T).expand(B, T)
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))

    def losses(rows=slice(None)):
        logits = model(ids[rows], positions[rows])
        return F.cross_entropy(logits.transpose(1, 2), targets[rows], reduction="none").mean(1)

    return model, losses


def double_gpt2():
    """A one-layer GPT-2 in float64 (vocabulary 40, width 8, T positions; wte tied to lm_head), dropout off,
    eager attention, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=T, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).double()
    model.set_attn_implementation("eager")
    return model


def tiny_gpt2():
    model = double_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(T).expand(B, T)

    def losses(rows=slice(None)):
        return _causal_lm_losses(model(input_ids=ids[rows], position_ids=positions[rows]).logits, ids[rows])[0]

    return model, losses


def formed(exact, losses_of, n):
    """The oracle: (n, d) gradients, example i's by a backward of its own loss."""
    rows = []
    for i in range(n):
        grads = torch.autograd.grad(losses_of(slice(i, i + 1)).sum(), exact.params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                               for p, g in zip(exact.params, grads)]))
    return torch.stack(rows)


@pytest.fixture(scope="module", params=["tied_net", "tiny_gpt2"])
def case(request):
    pytest.importorskip("transformers")
    model, losses = {"tied_net": tied_net, "tiny_gpt2": tiny_gpt2}[request.param]()
    exact = ExactGradients(model)
    return exact, losses, formed(exact, losses, B)


@pytest.mark.parametrize("how", ["stream", "ghost"])
def test_each_parameters_products_are_those_of_the_formed_gradients(case, how, monkeypatch):
    """(a) <S, g_u> and (b) <g_u, g_v> of every parameter alone (each layer rule, the tied matrix with its
    cross terms, the padding row, biases, LayerNorm) equal the oracle's; streaming in blocks of a few rows."""
    monkeypatch.setattr(products, "STREAM_BLOCK_BYTES", 3 * B * 8 * 8)  # 3 rows of width 8 per block
    exact, losses, oracle = case
    units = exact(losses)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for name, p in zip(exact.names, exact.params):
        a, G, chosen, _ = products.parameter_products(units.pieces[id(p)], exact.view(S, p), B, how)
        assert chosen == how or all(isinstance(x, products.Formed) for _, x in units.pieces[id(p)])
        assert_products_of_oracle(a, G, oracle, S, exact.offsets[id(p)], p.numel(), name)


def assert_products_of_oracle(a, G, oracle, S, start: int, numel: int, name: str) -> None:
    """One parameter's (a (U,), G (U, U)) against the oracle's formed gradients (U, d), its columns
    start..start + numel: <S, g_u> and <g_u, g_v> in float64."""
    g = oracle[:, start:start + numel]
    torch.testing.assert_close(a, g @ S[start:start + numel], rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(G, g @ g.T, rtol=1e-10, atol=1e-12, msg=name)


def test_the_products_reach_the_host_in_one_copy(case, monkeypatch):
    """products() sums every parameter's (a, G) on the running sum's device and copies the (U, 1 + U) result
    to the host once: on a GPU each copy waits for the device, so not one per parameter."""
    exact, losses, _ = case
    units = exact(lambda: losses())
    copies, cpu = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *args, **kwargs: copies.append(tuple(self.shape))
                        or cpu(self, *args, **kwargs))
    units.products(torch.zeros(exact.d, dtype=exact.params[0].dtype))
    assert len(exact.last_how) > 1 and copies == [(B, B + 1)]


def test_the_choice_between_ghost_and_stream_counts_what_the_call_asks_for():
    """The flop counts of docs/exact-cdgrab.md, by hand, for one Conv1D row block of GPT-2 small sharded over 2
    processes (U = 4 units of T = 64 tokens, R x C = 384 x 3072; r = 2 pairs): streaming forms the blocks
    (2 U T R C) and takes the differences' products and the norms from them ((2 r^2 + 3 r + 2 U) R C) besides
    zeroing and reading them (2 U R C); ghost takes (a) (2 U T R C) and (b) (2 (U T)^2 (R + C)), and, when the
    call wants the units' sum (ExactCDGraB's sum_all), one more product of 2 U T R C, which streaming has from
    its blocks. With the sum ghost costs more than twice streaming, so streaming is taken."""
    U, T, R, C, r = 4, 64, 384, 3072, 2
    pieces = [(0, products.Outer(torch.zeros(U, T, R), torch.zeros(U, T, C)))]
    form, gram = 2 * U * T * R * C, 2 * (U * T) ** 2 * (R + C)
    assert products.stream_cost(pieces, U, R, C, pairs=r) == form + (2 * r * r + 3 * r + 2 * U) * R * C + 2 * U * R * C
    assert products.stream_cost(pieces, U, R, C) == form + (2 * U + 4) * U * R * C  # every unit's (a) and (b)
    assert products.ghost_cost(pieces, R, C) == form + gram
    assert products.ghost_cost(pieces, R, C, grad_units=U) == 2 * form + gram
    assert products.ghost_pays(pieces, U, R, C, pairs=r)
    assert not products.ghost_pays(pieces, U, R, C, grad_units=U, pairs=r)


@pytest.mark.parametrize("from_grad", [False, True])
def test_the_running_sums_update_is_the_weighted_sum_of_the_formed_gradients(case, from_grad):
    """(c) S += sum_u w_u g_u from the records, and with the backward's own gradient (half the records)."""
    exact, losses, oracle = case
    units = exact(losses)
    if not from_grad:
        units.step_grads = None
    w = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = S + w @ oracle
    units.add_to(S, w)
    torch.testing.assert_close(S, expected, rtol=1e-10, atol=1e-12)


def weighted_units(exact, losses):
    """The units of a loop's backward of sum_u c_u loss_u with unequal weights c: the records hold c_u g_u."""
    c = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5], dtype=torch.float64)
    with exact.recording() as rec:
        per_example = losses()
        rec.watch(per_example)
    torch.autograd.grad((per_example * c).sum(), exact.params, allow_unused=True)
    return rec.units()


def test_the_units_loss_weights_are_divided_out_and_a_selected_unit_keeps_its_own_gradient(case):
    """A loop's backward of sum_u c_u loss_u: the records hold c_u g_u; products and units are g_u's."""
    exact, losses, oracle = case
    units = weighted_units(exact, losses)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    a, G = units.products(S)
    torch.testing.assert_close(a, oracle @ S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, oracle @ oracle.T, rtol=1e-10, atol=1e-12)
    kept = units.join(units.select([5])).select([4, 6, 1])  # across contributions, out of order
    torch.testing.assert_close(exact.flat(kept), oracle[[4, 5, 1]], rtol=1e-10, atol=1e-12)
    both = units.join(kept)
    a2, G2 = both.products(S)
    torch.testing.assert_close(a2, oracle[[0, 1, 2, 3, 4, 5, 4, 5, 1]] @ S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G2, oracle[[0, 1, 2, 3, 4, 5, 4, 5, 1]] @ oracle[[0, 1, 2, 3, 4, 5, 4, 5, 1]].T, rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("how", ["stream", "ghost", None])
def test_the_pairs_differences_products_are_those_of_the_formed_gradients(case, how, monkeypatch):
    """With Pairs, products() gives (a, G) of the pairs' differences g_first - g_second (the Gram of r
    differences, not of the U units) and the units' squared norms, the loss weights divided out, also for
    units joined with selected ones (a pending unit) and a unit in no pair; sum_all keeps every unit's summed
    records, and the running sum's update from them is the oracle's."""
    monkeypatch.setattr(products, "STREAM_BLOCK_BYTES", 3 * B * 8 * 8)
    exact, losses, oracle = case
    units = weighted_units(exact, losses)
    units = units.join(units.select([4, 5]))  # 8 units: the last two are copies of 4 and 5 (as pending ones)
    g = oracle[[0, 1, 2, 3, 4, 5, 4, 5]]
    firsts, seconds = [6, 0, 5, 3], [1, 2, 7, 4]  # 5 against its own copy 7: a zero difference
    pairs = products.Pairs(firsts, seconds, 1.0 / units.scale)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    units.sum_all = True
    a, G, norms = units.products(S, how, pairs)
    diff = g[firsts] - g[seconds]
    torch.testing.assert_close(a, diff @ S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, diff @ diff.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, g.square().sum(1), rtol=1e-10, atol=1e-12)
    assert units.step_units == 8 and len(units.step_grads) == len([p for p in exact.params if units.pieces.get(id(p))])
    w = torch.zeros(8, dtype=torch.float64)
    w[firsts], w[seconds] = torch.tensor([1.0, -1.0, 1.0, 1.0]).double(), torch.tensor([-1.0, 1.0, -1.0, -1.0]).double()
    expected = S + w @ g
    units.add_to(S, w)
    torch.testing.assert_close(S, expected, rtol=1e-10, atol=1e-12)


def flat_grads(exact) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in exact.params])


@pytest.mark.parametrize("how", ["stream", "ghost"])
def test_write_grads_puts_the_backwards_gradient_into_grad_from_the_records(case, how):
    """recording(write_grads=True): the backward computes no gradient of the selected parameters; products()
    (from its streamed blocks, or the factors) adds sum_u c_u g_u of the step's units to .grad (a joined
    pending unit left out), or write_grads() does when there were no products; the products and the update
    stay the oracle's."""
    exact, losses, oracle = case
    c = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5], dtype=torch.float64)
    before = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    w = torch.tensor([1.0, -1.0, 0.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    try:
        for with_products in (True, False):
            for p in exact.params:  # an accumulated gradient: added to, not replaced
                p.grad = exact.view(before, p).reshape(p.shape).clone() if with_products else None
            with exact.recording(write_grads=True) as rec:
                per_example = losses()
                rec.watch(per_example)
                assert not any(p.requires_grad for p in exact.params)
            assert all(p.requires_grad for p in exact.params)
            (per_example * c).sum().backward()
            torch.testing.assert_close(flat_grads(exact), before if with_products else torch.zeros_like(before),
                                       rtol=0, atol=0)  # autograd wrote nothing
            units = rec.units()
            both = units.join(units.select([5]))
            if with_products:
                a, G = both.products(S, how)
                rows = oracle[[0, 1, 2, 3, 4, 5, 5]]
                torch.testing.assert_close(a, rows @ S, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(G, rows @ rows.T, rtol=1e-10, atol=1e-12)
                units.write_grads()  # after products(): adds nothing more
            else:
                units.write_grads()
            torch.testing.assert_close(flat_grads(exact), (before if with_products else 0) + c @ oracle,
                                       rtol=1e-10, atol=1e-12)
            updated = S.clone()
            both.add_to(updated, w)  # half of it from the step's gradient
            torch.testing.assert_close(updated, S + w @ oracle[[0, 1, 2, 3, 4, 5, 5]], rtol=1e-10, atol=1e-12)
    finally:
        for p in exact.params:
            p.grad = None


def mlp_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 3)).double()
    X = torch.randn(40, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    Y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(2))
    return model, lambda idx: (lambda: F.cross_entropy(model(X[idx]), Y[idx], reduction="none"))


def gpt2_case():
    model = double_gpt2()
    ids = torch.randint(0, 40, (40, T), generator=torch.Generator().manual_seed(1))

    def losses_of(idx):
        rows = ids[idx]
        positions = torch.arange(T).expand(len(rows), T)
        return lambda: _causal_lm_losses(model(input_ids=rows, position_ids=positions).logits, rows)[0]

    return model, losses_of


@pytest.mark.parametrize("model_case, n, k, m, how", [
    ("mlp", 2, 3, 9, None),       # odd k: pairs across steps (the pending unit), odd m: the middle slot
    ("mlp", 3, 4, 8, "ghost"),
    ("gpt2", 2, 3, 5, None),      # the tied GPT-2, every unit's records, pending ones included
])
def test_orders_equal_cdgrab_fed_the_formed_gradients(model_case, n, k, m, how):
    """Two epochs, the model moving between them: the orders (and the running sum) of ExactCDGraB equal
    those of the library's CDGraB fed the (n, k, d) gradients formed by the oracle."""
    if model_case == "gpt2":
        pytest.importorskip("transformers")
    model, losses_of = (mlp_case if model_case == "mlp" else gpt2_case)()
    exact = ExactGradients(model, how=how)
    # the compiled loop decides its signs independently of gram_signs (which ExactCDGraB uses)
    reference = CDGraB(n, m, exact.d, seed=3, dtype=torch.float64, sign_loop="compiled" if model_case == "mlp" else "gram")
    reference.DEFERRED_DIFFERENCES = 0  # each step's pairs decided in that step: its running sum read every step
    ours = ExactCDGraB(n, m, exact.d, seed=3, dtype=torch.float64)
    for _ in range(2):
        orders = reference.sort()
        assert torch.equal(ours.sort(), orders)
        for t in range(0, m, k):
            positions = torch.arange(t, min(t + k, m))
            idx = (orders[:, positions] + torch.arange(n)[:, None] * m).reshape(-1)
            units = exact(losses_of(idx))
            reference.step(formed(exact, lambda rows: losses_of(idx[rows])(), len(idx)).view(n, len(positions), -1),
                           positions)
            ours.step(units, positions)
            torch.testing.assert_close(ours.running_sum, reference.running_sum, rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
    assert torch.equal(ours.sort(), reference.sort())
    assert ours.near_ties == 0


@pytest.mark.parametrize("k", [4, 2])
def test_a_near_tie_is_counted(k):
    """<S_i, v_i> within NEAR_TIE of 0 relative to ||S_i|| (||g_first|| + ||g_second||) is counted; an
    exactly zero S (the epoch's first pair) is a true tie, not counted. k=2: the second pair in a step of
    its own, so ||S_i|| is the step-start sum's norm."""
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0, 0.0]]))
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    exact = ExactGradients(model)
    sorter = ExactCDGraB(1, 4, exact.d, dtype=torch.float64)
    sorter.sort()
    for t in range(0, 4, k):  # g_u = x_u: the differences (1, 0), (0, 1)
        units = exact(lambda: model(x[t:t + k]).squeeze(1) + x[t:t + k].sum(1))
        sorter.step(units, torch.arange(t, t + k))
    assert sorter.near_ties == 1  # the second difference is orthogonal to S = (1, 0)


def test_near_ties_are_counted_for_every_pair_as_the_sign_loop_meets_them():
    """The count, taken for all pairs at once, against the definition pair by pair: S_i = S + sum_{j<i} s_j v_j
    formed explicitly in float64, differences built so that some <S_i, v_i> are exactly 0 (orthogonal to
    S_i), others tiny, others not."""
    generator = torch.Generator().manual_seed(9)
    d, r = 6, 7
    S = torch.randn(d, dtype=torch.float64, generator=generator)
    v = torch.randn(r, d, dtype=torch.float64, generator=generator)
    firsts, seconds = list(range(0, 2 * r, 2)), list(range(1, 2 * r, 2))
    g = torch.zeros(2 * r, d, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    S_i = S.clone()
    expected = 0
    for i in range(r):  # make pairs 2 and 5 orthogonal to S_i, pair 4 nearly so
        if i in (2, 4, 5):
            v[i] -= (v[i] @ S_i) / (S_i @ S_i) * S_i * (1 - (1e-9 if i == 4 else 0.0))
        g[firsts[i]], g[seconds[i]] = 2 * v[i], v[i]  # g_first - g_second = v_i
        scale = S_i.norm() * (g[firsts[i]].norm() + g[seconds[i]].norm())
        expected += bool(abs(S_i @ v[i]) <= 1e-5 * scale)
        S_i = S_i + signs[i] * v[i]
    sorter = ExactCDGraB(1, 2, d, dtype=torch.float64)
    sorter.running_sum = S.clone()
    counted = sorter._count_near_ties(v @ S, v @ v.T, signs, g.square().sum(1), firsts, seconds, float(S @ S))
    assert expected == 3 and counted == expected


def test_the_running_sums_squared_norm_is_taken_a_chunk_at_a_time_in_float64():
    """_squared_norm (the near-tie scale's ||S||^2) against a float64 sum, over chunks that do not divide d."""
    x = torch.tensor([3e4, 1.0, -2.5, 1e-3, 7.0, -3e4, 0.5], dtype=torch.float32)
    expected = sum(float(v) ** 2 for v in x.double())
    assert _squared_norm(x, chunk=3) == pytest.approx(expected, rel=1e-15)


def test_the_trainer_with_one_example_a_step_writes_grad_on_the_steps_without_pairs(tmp_path):
    """CDGraBTrainer(exact_low_memory) with k = 1: every other step's unit waits for its pair, so the step has
    no products and .grad comes from write_grads(); the losses and orders are the exact Trainer's (per-example
    gradients formed whole, .grad from autograd)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tests.hf_trainer_tiny as hf
    from sorters import CDGraBSettings
    runs = []
    for exact_low_memory in (False, True):
        trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(
            tmp_path / str(exact_low_memory), per_device_train_batch_size=1, gradient_accumulation_steps=1,
            num_train_epochs=2), train_dataset=hf.examples(hf.token_rows(6)), rows=hf.token_rows(6),
            cdgrab=CDGraBSettings(exact_low_memory=exact_low_memory))
        trainer.train()
        runs.append(trainer)
    assert isinstance(runs[1].cdgrab_sampler.sorter, ExactCDGraB)
    assert runs[1].batches == runs[0].batches
    assert runs[1].losses == pytest.approx(runs[0].losses, rel=1e-5)


def test_selecting_every_unit_in_order_keeps_the_records_without_copying(case):
    """k = 1 keeps every unit of a step pending: select() then hands over the records themselves (no copy of
    the step's records, and their loss weights kept), and a selection out of order still gives its gradients."""
    exact, losses, oracle = case
    units = exact(losses)
    every = units.select(list(range(B)))
    assert all(x is y for key in units.pieces for (_, x), (_, y) in zip(units.pieces[key], every.pieces[key]))
    torch.testing.assert_close(exact.flat(every), oracle, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(exact.flat(units.select([3, 1, 2])), oracle[[3, 1, 2]], rtol=1e-10, atol=1e-12)


def test_a_streamed_block_is_written_by_the_first_outer_of_its_units_only(case, monkeypatch):
    """Streaming writes a block's rows with the first Outer over them (bmm into the block) and adds every
    later contribution: with each parameter's contributions in reverse order (the tied matrix's embedding
    rows before its output layer's outer products), split in two ranges of units, the products are unchanged."""
    monkeypatch.setattr(products, "STREAM_BLOCK_BYTES", 3 * B * 8 * 8)
    exact, losses, oracle = case
    units = exact(losses)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    for name, p in zip(exact.names, exact.params):
        pieces = [(first + lo, x.units_slice(lo, hi)) for first, x in units.pieces[id(p)][::-1]
                  for lo, hi in ((0, 2), (2, B))]
        a, G, _, _ = products.parameter_products(pieces, exact.view(S, p), B, "stream")
        assert_products_of_oracle(a, G, oracle, S, exact.offsets[id(p)], p.numel(), name)


class WithoutRules(nn.Module):
    """A Conv1d over the tokens (no layer rule), a bare scale parameter, then a Linear and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.conv, self.gain = nn.Conv1d(3, 4, kernel_size=2), nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.out, self.norm = nn.Linear(4, 5), nn.LayerNorm(4)

    def forward(self, x, y):  # x (B, 3, L), y (B,) -> (B,) per-example losses
        h = self.norm(torch.tanh(self.conv(x)).mean(2) * self.gain)
        return F.cross_entropy(self.out(h), y, reduction="none")


@pytest.mark.parametrize("write_grads", [False, True])
def test_parameters_without_a_rule_are_formed_per_example_beside_the_records(write_grads):
    """ExactGradients of a model with a Conv1d and a bare parameter (no rule: formed per example by a batched
    vector-Jacobian product at watch(), with a warning naming them) beside recorded layers: every unit's
    gradient, the products and the loop's weighted loss against float64 autograd, and with write_grads .grad
    is the batch gradient (autograd's for the formed parameters, the records' for the others)."""
    torch.manual_seed(0)
    model = WithoutRules().double()
    with pytest.warns(UserWarning, match="formed per example: gain, conv.weight, conv.bias"):
        exact = ExactGradients(model)
    x, y = torch.randn(B, 3, 6, dtype=torch.float64), torch.randint(0, 5, (B,))
    c = torch.linspace(0.5, 2.0, B, dtype=torch.float64)  # the loop's loss weights
    with exact.recording(write_grads=write_grads) as rec:
        losses = model(x, y)
        rec.watch(losses)
    (losses * c).sum().backward()
    units = rec.units()
    units.write_grads()
    oracle = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[i:i + 1], y[i:i + 1]).sum(),
                                                                                exact.params)]) for i in range(B)])
    torch.testing.assert_close(exact.flat(units), oracle, rtol=1e-10, atol=1e-12)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    a, G = units.products(S)
    torch.testing.assert_close(a, oracle @ S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, oracle @ oracle.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(flat_grads(exact), c @ oracle, rtol=1e-10, atol=1e-12)


def test_a_batch_norm_in_training_mode_is_refused_and_in_eval_mode_formed_per_example():
    """A BatchNorm in training mode mixes the batch (one example's loss depends on the others), so no
    recording can give the examples' own gradients: refused in one line; in eval mode it is per example, its
    parameters (no layer rule) formed per example, every unit's gradient the oracle's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()
    with pytest.warns(UserWarning, match="formed per example"):
        exact = ExactGradients(model)
    x, y = torch.randn(B, 3, dtype=torch.float64), torch.randint(0, 2, (B,))
    with pytest.raises(ValueError, match="BatchNorm in training mode") as refused:
        with exact.recording():
            pass
    assert "\n" not in str(refused.value)
    model.eval()
    units = exact(lambda: F.cross_entropy(model(x), y, reduction="none"))
    oracle = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), exact.params)]) for i in range(B)])
    torch.testing.assert_close(exact.flat(units), oracle, rtol=1e-10, atol=1e-12)
