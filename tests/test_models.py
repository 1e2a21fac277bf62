"""LSTM, autoregressive MLP and tiny GPT-2: sizes, shapes, tying, rollout, per-example gradients."""
import pytest
import torch
from torch.func import functional_call, grad, vmap

from models.gpt2 import build_gpt2, lm_loss
from models.lstm import LSTMModel
from models.mlp import AutoregressiveMLP


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
