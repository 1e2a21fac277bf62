"""LSTM, autoregressive MLP and tiny GPT-2: sizes, shapes, tying, rollout, per-example gradients, the causal mask."""
import pytest
import torch
from torch.func import functional_call, grad, vmap

from models.gpt2 import build_gpt2, causal_mask, lm_loss
from models.lstm import LSTMModel, unit_gradients
from models.mlp import AutoregressiveMLP, window_gradients


def n_params(model) -> int:
    """d: parameters() yields a tied tensor once, so this is the de-duplicated count."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- LSTM

def test_lstm_size_and_tying():
    torch.manual_seed(0)
    m = LSTMModel(33_278)
    assert n_params(m) == 1_081_792
    assert m.decoder.weight is m.encoder.weight and m.decoder.bias is None
    assert m.encoder.weight.abs().max() <= 0.1
    with pytest.raises(ValueError, match="ninp == nhid"):
        LSTMModel(100, ninp=16, nhid=32)


def test_lstm_forward_shapes_and_hidden_carry():
    torch.manual_seed(0)
    m = LSTMModel(50, ninp=8, nhid=8, nlayers=2)
    h = m.init_hidden(3)
    assert [t.shape for t in h] == [(2, 3, 8), (2, 3, 8)] and all((t == 0).all() for t in h)
    x = torch.randint(0, 50, (5, 3))
    logp, h2 = m(x, h)
    assert logp.shape == (15, 50)
    torch.testing.assert_close(logp.exp().sum(1), torch.ones(15))
    # rows are time-major: row t*b + j is position (t, j), matching get_chunk's flattened targets
    logp_col, _ = m(x[:, 1:2], m.init_hidden(1))
    torch.testing.assert_close(logp.view(5, 3, 50)[:, 1], logp_col)
    # a carried hidden state changes the next output
    again, _ = m(x, h2)
    assert not torch.allclose(again, logp)


def test_lstm_unit_gradients_in_one_pass_match_a_float64_oracle():
    """models.lstm.unit_gradients (the units side by side as one block-diagonal LSTM, one backward) = each
    unit's own float64 backward of its mean token NLL, for the tied weight, every LSTM weight and bias,
    with nonzero initial states and repeated tokens; its losses and final states too."""
    torch.manual_seed(0)
    V, U, T, w = 40, 3, 6, 2
    m = LSTMModel(V, 32, 32, 2)
    inputs, targets = torch.randint(0, V, (U, T, w)), torch.randint(0, V, (U, T, w))
    inputs[0, :3, 0] = 7  # one row read several times by one unit, and by another
    inputs[1, 0, 1] = 7
    h0, c0 = torch.randn(U, 2, w, 32), torch.randn(U, 2, w, 32)
    d = n_params(m)
    out = torch.full((U, d), float("nan"))
    losses, (h, c) = unit_gradients(m, inputs, targets, h0, c0, out)

    m64 = LSTMModel(V, 32, 32, 2).double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    for u in range(U):
        m64.zero_grad()
        log_probs, (hu, cu) = m64(inputs[u], (h0[u].double(), c0[u].double()))
        loss = torch.nn.functional.nll_loss(log_probs, targets[u].reshape(-1))
        loss.backward()
        expected = torch.cat([p.grad.reshape(-1) for p in m64.parameters()])
        assert expected.numel() == d
        torch.testing.assert_close(out[u].double(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())
        torch.testing.assert_close(losses[u].double(), loss.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(h[u].double(), hu.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(c[u].double(), cu.detach(), rtol=0, atol=1e-6)


def test_lstm_unit_gradients_the_same_bits_from_a_flat_vector_into_their_columns_and_after_another_model():
    """unit_gradients reads the LSTM's parameters as one view where they lie back to back (a FlatModel's flat
    vector) and copies them otherwise; writes the decoder's product into its columns (into_slots) or copies it
    in; reuses its block-diagonal weights from call to call. None of it changes a bit: a model whose weights
    were written there by an earlier call of another model of the same size gives what it gives first."""
    from engine.functional import FlatModel
    from models import lstm

    torch.manual_seed(0)
    V, U, T, w = 50, 3, 5, 2
    plain, other = LSTMModel(V, 32, 32, 2), LSTMModel(V, 32, 32, 2)
    flat_bound = LSTMModel(V, 32, 32, 2)
    flat_bound.load_state_dict(plain.state_dict())
    FlatModel(flat_bound)  # its parameters now views of one flat vector, in named_parameters order
    def shares_memory(model):
        return lstm._lstm_parameters(model).untyped_storage().data_ptr() == \
            model.rnn.weight_ih_l0.untyped_storage().data_ptr()
    assert shares_memory(flat_bound) and not shares_memory(plain)
    inputs, targets = torch.randint(0, V, (U, T, w)), torch.randint(0, V, (U, T, w))
    h0, c0 = torch.randn(U, 2, w, 32), torch.randn(U, 2, w, 32)
    d = n_params(plain)

    def run(model, into_slots=False):
        out = torch.full((U, d), float("nan"))
        losses, (h, c) = unit_gradients(model, inputs, targets, h0, c0, out, into_slots=into_slots)
        return out, losses, h, c

    lstm._block_weights.cache_clear()
    other_first = run(other)
    lstm._block_weights.cache_clear()
    first = run(plain)
    assert not first[0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(other_first, run(other)))  # on the blocks plain's call left
    for again in (run(plain), run(flat_bound), run(plain, into_slots=True), run(flat_bound, into_slots=True)):
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------- MLP

def test_mlp_size():
    assert n_params(AutoregressiveMLP()) == 1_344 + 4_160 + 65 == 5_569
    assert n_params(AutoregressiveMLP(n_layers=4)) == 5_569 + 4_160
    assert n_params(AutoregressiveMLP(in_len=30, hidden=128)) == 31 * 128 + 129 * 128 + 129


def test_mlp_rollout_feeds_back_its_own_predictions():
    torch.manual_seed(0)
    m = AutoregressiveMLP()
    x = torch.randn(4, 20)
    out = m(x, 13)
    assert out.shape == (4, 13)
    # step k sees the last 20 of (inputs, predictions 0..k-1)
    seq = torch.cat([x, out], dim=1)
    for k in range(13):
        torch.testing.assert_close(m.net(seq[:, k : k + 20]).squeeze(1), out[:, k])
    # x[:, 0] leaves the window after step 0, so step 1 depends on it only through prediction 0
    x0 = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(m(x0, 2)[:, 1].sum(), x0)
    assert (g[:, 0] != 0).all()
    # a shorter horizon is a prefix of a longer one
    torch.testing.assert_close(m(x, 6), out[:, :6])


@pytest.mark.parametrize("layers", [2, 3, 4])
def test_mlp_window_gradients_match_a_float64_autograd_oracle(layers):
    """The hand-written rollout backward = per-window autograd gradients of the rollout MSE in float64
    (vmap over windows), to float32 rounding, in mlp.parameters() order; and its losses."""
    torch.manual_seed(layers)
    m = AutoregressiveMLP(in_len=8, hidden=16, n_layers=layers)
    x, y = torch.randn(5, 8), torch.randn(5, 6)
    # large weights, so that some ReLUs are off and later predictions depend strongly on earlier ones
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3)
    d = n_params(m)
    out = torch.full((5, d), float("nan"))
    losses = window_gradients(m, x, y, out)

    m64 = AutoregressiveMLP(in_len=8, hidden=16, n_layers=layers).double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    params = dict(m64.named_parameters())

    def loss(p, xi, yi):
        pred = functional_call(m64, p, (xi[None], yi.shape[0]))[0]
        return (pred - yi).square().mean()

    per_window = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y.double())
    expected = torch.cat([per_window[name].reshape(5, -1) for name, _ in m64.named_parameters()], dim=1)
    scale = expected.abs().max().item()
    assert scale > 1 and (expected != 0).float().mean() > 0.3  # not a degenerate case
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * scale)
    oracle = torch.stack([loss(params, xi, yi) for xi, yi in zip(x.double(), y.double())])
    torch.testing.assert_close(losses.double(), oracle, rtol=1e-5, atol=0)


# ---------------------------------------------------------------- GPT-2

@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return build_gpt2()


def test_gpt2_config_and_size(gpt2):
    assert n_params(gpt2) == 6_846_080
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert not gpt2.training
    c = gpt2.config
    assert (c.n_embd, c.n_layer, c.n_head, c.n_positions, c.vocab_size) == (128, 2, 2, 128, 50_257)
    assert c.attn_pdrop == c.resid_pdrop == c.embd_pdrop == c.summary_first_dropout == 0
    assert c._attn_implementation == "eager"
    # GPT-2 init: residual projections N(0, 0.02 / sqrt(2 * n_layer)) = N(0, 0.01)
    assert abs(gpt2.transformer.h[0].attn.c_proj.weight.std().item() - 0.01) < 1e-3


def test_lm_loss_matches_shifted_cross_entropy(gpt2):
    ids = torch.randint(0, 50_257, (2, 16))
    with torch.no_grad():
        logits = gpt2(input_ids=ids).logits
        loss = lm_loss(gpt2, ids)
        by_hand = -logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None]).mean()
        torch.testing.assert_close(loss, by_hand)
        torch.testing.assert_close(lm_loss(logits, ids), loss)
        torch.testing.assert_close(gpt2(input_ids=ids, labels=ids).loss, loss)
    assert loss.dim() == 0


def test_gpt2_per_example_grads_with_vmap(gpt2):
    """vmap(grad) over single examples equals one backward per example, tied wte included."""
    params = {k: v.detach() for k, v in gpt2.named_parameters()}  # lm_head is tied, not listed

    def loss_one(p, ids):  # ids (T,): one example
        return lm_loss(functional_call(gpt2, p, (), {"input_ids": ids[None]}).logits, ids[None])

    ids = torch.randint(0, 50_257, (2, 12))
    per_example = vmap(grad(loss_one), in_dims=(None, 0))(params, ids)
    assert per_example["transformer.wte.weight"].shape == (2, 50_257, 128)
    for i in range(2):
        gpt2.zero_grad()
        lm_loss(gpt2, ids[i : i + 1]).backward()
        for name, p in gpt2.named_parameters():
            torch.testing.assert_close(per_example[name][i], p.grad, rtol=1e-4, atol=1e-6)
    gpt2.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- GPT-2's precomputed causal mask

def tiny_gpt2_float64(T: int, n_layer: int):
    """A tiny tied GPT-2 (vocabulary 50, width 8, n_layer layers of 2 heads, T positions) in float64, and ids (3, T)."""
    torch.manual_seed(0)
    model = build_gpt2(vocab_size=50, n_embd=8, n_layer=n_layer, n_head=2, n_positions=T).double()
    return model, torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(1))


def test_causal_mask_values():
    mask = causal_mask(5, torch.float64, "cpu")
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.float64 and mask.device.type == "cpu"
    below = torch.ones(5, 5, dtype=torch.bool).tril()  # key j <= query i
    assert (mask[0, 0][below] == 0).all() and (mask[0, 0][~below] == torch.finfo(torch.float64).min).all()
    assert torch.equal(causal_mask(3, torch.float64, "cpu"), mask[:, :, :3, :3])  # the corner serves shorter blocks
    assert causal_mask(4, torch.float32, "cpu").dtype == torch.float32


def test_gpt2_with_the_causal_mask_equals_unmasked_attention_over_each_prefix():
    """Independent oracle: in a one-layer causal model position t sees tokens 0..t only, so its logits equal
    the last position's of a run on the prefix ids[:, :t+1] with NO masking at all (an all-zero 4-D mask,
    which transformers adds as it is; with one layer the keys and values are functions of single tokens,
    so the last query sees exactly the prefix). Logits and the loss's gradient, float64. Fails if the mask
    lets a query see a later key, hides its own or an earlier one, or is not applied."""
    T = 7
    model, ids = tiny_gpt2_float64(T, n_layer=1)
    params = list(model.parameters())
    logits = model(input_ids=ids, attention_mask=causal_mask(T, torch.float64, "cpu"), use_cache=False).logits
    loss = lm_loss(logits, ids)
    expected_grads = torch.autograd.grad(loss, params)
    prefix_logits = []
    for t in range(T):
        unmasked = torch.zeros(1, 1, t + 1, t + 1, dtype=torch.float64)
        prefix_logits.append(model(input_ids=ids[:, :t + 1], attention_mask=unmasked, use_cache=False).logits[:, -1])
    oracle = torch.stack(prefix_logits, 1)  # (3, T, V)
    torch.testing.assert_close(logits, oracle, rtol=1e-10, atol=1e-12)
    oracle_loss = lm_loss(oracle, ids)
    torch.testing.assert_close(loss, oracle_loss, rtol=1e-12, atol=0)
    for got, want in zip(expected_grads, torch.autograd.grad(oracle_loss, params)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gpt2_causal_mask_equals_transformers_own_mask_and_runs_under_vmap():
    """The precomputed mask gives the logits and gradients of transformers' own causal mask (what a forward
    without a mask, or with an all-ones (b, T) mask, builds), also per example through torch.func.vmap."""
    T = 6
    model, ids = tiny_gpt2_float64(T, n_layer=2)
    mask = causal_mask(T, torch.float64, "cpu")
    positions = torch.arange(T).expand(len(ids), -1)
    all_ones = torch.ones_like(ids, dtype=torch.bool)  # (3, T): no padding
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
        for theirs in (model(input_ids=ids, use_cache=False).logits,
                       model(input_ids=ids, attention_mask=all_ones, use_cache=False).logits):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, one_ids):  # one_ids (T,): one example; the mask (1, 1, T, T) is not batched
        return lm_loss(functional_call(model, p, (), {"input_ids": one_ids[None], "attention_mask": mask,
                                                      "use_cache": False}).logits, one_ids[None])

    per_example = vmap(grad(loss_one), in_dims=(None, 0))(params, ids)
    for i in range(len(ids)):
        model.zero_grad()
        lm_loss(model(input_ids=ids[i:i + 1], use_cache=False).logits, ids[i:i + 1]).backward()  # transformers' mask
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_example[name][i], p.grad, rtol=1e-10, atol=1e-12)
    model.zero_grad(set_to_none=True)
