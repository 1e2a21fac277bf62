"""LayerSketch (sorters/layer_sketch.py, issue #31 item 1): the layerwise sketches of per-example gradients
equal the map applied to the explicitly formed per-example gradients (an oracle of batch-of-one backward
passes, float64) for Linear, Conv1D, Embedding, LayerNorm, a layer used twice, a tied tiny GPT-2 and a
layer without a rule; the update it adds is the batch mean's gradient; and a memory probe sees no
per-example tensor of a large layer allocated."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sorters.layer_sketch import LayerSketch, layer_blocks

ALL_BLOCKS, NO_BLOCKS = 1, 10**9  # min_numel: every weight a TensorSketch block / every weight formed


def oracle(model, losses_of, B, names):
    """(B, d) per-example gradients of the named parameters, one backward per example alone."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(B):
        loss = losses_of(slice(i, i + 1))
        assert loss.shape == (1,)
        grads = torch.autograd.grad(loss.sum(), [params[n] for n in names], allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(params[n]) if g is None else g).reshape(-1)
                               for n, g in zip(names, grads)]))
    return torch.stack(rows)


def check_against_oracle(model, losses_of, B, dim=13, min_numel=ALL_BLOCKS, **kwargs):
    """The layerwise sketch equals sketch(oracle) to float64 rounding; returns the sketcher."""
    sketcher = LayerSketch(model, dim, seed=3, min_numel=min_numel, **kwargs)
    sketches, losses = sketcher(lambda: losses_of(slice(None)))
    expected = sketcher.sketch(oracle(model, losses_of, B, sketcher.names))
    assert sketches.shape == (B, sketcher.dim) and losses.shape == (B,)
    assert torch.allclose(sketches, expected, rtol=0, atol=1e-12 * expected.abs().max()), \
        (sketches - expected).abs().max()
    return sketcher


class Stack(torch.nn.Module):
    """Embedding -> Linear -> LayerNorm -> the same Linear again -> Linear head (a layer used twice)."""

    def __init__(self, vocab=11, width=6, classes=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, padding_idx=0)
        self.mix = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, classes, bias=False)

    def forward(self, ids):
        h = self.mix(self.embed(ids))
        h = self.mix(torch.tanh(self.norm(h)))
        return self.head(h).mean(1)  # (B, classes)


@pytest.mark.parametrize("min_numel", [ALL_BLOCKS, NO_BLOCKS])
def test_linear_embedding_layernorm_and_a_layer_used_twice(min_numel):
    torch.manual_seed(0)
    model = Stack().double()
    with torch.no_grad():  # LayerNorm's affine parameters away from (1, 0), so a dropped term shows
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    B = 5
    ids = torch.randint(0, 11, (B, 4))
    ids[0, 1] = 0  # a padding token: its row gets no gradient
    y = torch.randint(0, 5, (B,))
    sketcher = check_against_oracle(model, lambda rows: F.cross_entropy(model(ids[rows]), y[rows], reduction="none"),
                                    B, min_numel=min_numel)
    assert len(sketcher.sketch.blocks) == (3 if min_numel == ALL_BLOCKS else 0)


def test_transformers_conv1d():
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(1)
    model = torch.nn.Sequential(Conv1D(7, 4), torch.nn.Tanh(), Conv1D(3, 7)).double()
    B, x = 4, torch.randn(4, 3, 4, dtype=torch.float64)
    for min_numel in (ALL_BLOCKS, NO_BLOCKS):
        check_against_oracle(model, lambda rows: model(x[rows]).square().sum((1, 2)), B, min_numel=min_numel)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    return GPT2LMHeadModel(config).double().eval()


def gpt2_losses(model, ids):
    """Per-example next-token cross-entropy, each the mean over its own tokens. position_ids (B, T): the
    positions' Embedding must see the examples on dim 0 (GPT-2 broadcasts a (1, T) default)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    def losses_of(rows):
        logits = model(input_ids=ids[rows], position_ids=positions[rows]).logits[:, :-1]
        targets = ids[rows][:, 1:]
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
    return losses_of


@pytest.mark.parametrize("min_numel", [ALL_BLOCKS, 1024, NO_BLOCKS])
def test_tiny_gpt2_with_tied_embeddings(min_numel):
    """wte is both an Embedding and the lm_head's Linear weight: both uses add into one block."""
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    B, ids = 3, torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    sketcher = check_against_oracle(model, gpt2_losses(model, ids), B, dim=29, min_numel=min_numel)
    assert not sketcher.formed
    offsets = {block.offset for block in sketcher.sketch.blocks}
    assert (0 in offsets) == (min_numel <= 1024)  # wte is the first parameter, 64 x 16
    if min_numel == 1024:  # wte (1024 entries) and the MLP's c_fc (16 x 64): blocks; c_attn and c_proj: formed
        assert len(offsets) == 3


def test_layer_without_a_rule_is_formed_per_example_and_said_once():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(2, 3, 3)
            self.scale = torch.nn.Parameter(torch.tensor(1.3))
            self.out = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.conv(x)).mean(2) * self.scale)

    torch.manual_seed(4)
    model = Odd().double()
    x, y = torch.randn(4, 2, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sketcher = check_against_oracle(model, lambda rows: (model(x[rows]) - y[rows]).square().sum(1), 4, dim=7)
    assert sorted(sketcher.formed) == ["conv.bias", "conv.weight", "scale"]
    assert len([w for w in caught if "formed per example" in str(w.message)]) == 1


def test_identity_map_gives_the_per_example_gradients():
    torch.manual_seed(5)
    model = Stack().double()
    ids, y = torch.randint(0, 11, (3, 4)), torch.randint(0, 5, (3,))
    losses_of = lambda rows: F.cross_entropy(model(ids[rows]), y[rows], reduction="none")  # noqa: E731
    sketcher = LayerSketch(model, 10**6)
    exact, _ = sketcher(lambda: losses_of(slice(None)))
    assert sketcher.sketch.is_identity
    assert torch.allclose(exact, oracle(model, losses_of, 3, sketcher.names), rtol=0, atol=1e-13)


def test_update_scale_adds_the_mean_gradient_and_nothing_otherwise():
    torch.manual_seed(6)
    model = Stack().double()
    ids, y = torch.randint(0, 11, (4, 4)), torch.randint(0, 5, (4,))
    sketcher = LayerSketch(model, 8)
    sketcher(lambda: F.cross_entropy(model(ids), y, reduction="none"))
    assert all(p.grad is None for p in model.parameters())
    for _ in range(2):  # the first call creates .grad, the second adds to it
        sketcher(lambda: F.cross_entropy(model(ids), y, reduction="none"), update_scale=1 / 4)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    (2 * F.cross_entropy(model(ids), y)).backward()
    for p, g in zip(model.parameters(), got):
        assert torch.allclose(g, p.grad, rtol=0, atol=1e-14)


def test_a_layer_used_outside_its_forward_is_refused():
    attention = torch.nn.MultiheadAttention(4, 2, batch_first=True).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    sketcher = LayerSketch(attention, 8, params=r"out_proj")
    with pytest.raises(ValueError, match="not called"):
        sketcher(lambda: attention(x, x, x)[0].square().sum((1, 2)))


def test_blocks_are_the_large_recorded_weights():
    model = tiny_gpt2()
    assert layer_blocks(model, min_numel=10**9) == []
    blocks = layer_blocks(model, min_numel=1024)
    assert blocks[0] == (0, 64, 16) and all(rows * cols >= 1024 for _, rows, cols in blocks)


# ------------------------------------------------------------------------------------- the memory probe


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (bytes) that any op's output allocates (outputs sharing an input's
    storage, views and in-place results, are not allocations). Sees the backward's ops too."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.nbytes() > self.largest:
                self.largest, self.op = storage.nbytes(), str(func)
        return out


def _tensors(tree):
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def test_memory_probe_no_per_example_tensor_of_a_large_layer():
    """Linear 512 -> 512 (262,144 weights, a block), B = 16: no allocation reaches 2 x the weight (the
    summed gradient is 1 x), against B x for its per-example gradients; the same call with the weight
    formed per example (min_numel above it) is seen by the probe allocating them."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))
    B, x, y = 16, torch.randn(16, 2, 512), torch.randint(0, 4, (16,))
    weight_bytes = model[0].weight.numel() * 4
    largest = {}
    for min_numel in (2**16, 10**9):
        sketcher = LayerSketch(model, 256, min_numel=min_numel)
        with LargestAllocation() as probe:
            sketcher(lambda: F.cross_entropy(model(x).mean(1), y, reduction="none"))
        largest[min_numel] = probe.largest
        with LargestAllocation() as probe:  # the same through recording() and the loop's own backward
            with sketcher.recording() as rec:
                losses = F.cross_entropy(model(x).mean(1), y, reduction="none")
                rec.watch(losses)
            losses.mean().backward()
            rec.sketches()
        largest[min_numel, "recording"] = probe.largest
    assert largest[2**16] < 2 * weight_bytes and largest[2**16, "recording"] < 2 * weight_bytes, largest
    # the probe sees a per-example tensor when there is one
    assert largest[10**9] >= B * weight_bytes and largest[10**9, "recording"] >= B * weight_bytes, largest


# ------------------------------------------------------------------------- the own-loop sampler's path


def test_per_example_grads_structured_and_the_samplers_orders():
    """PerExampleGrads(structured=True) returns the map of its formed gradients (the map with blocks), and
    a CDGraBSampler fed them orders as one fed the sketches of the formed gradients."""
    from sorters import CDGraBSampler, PerExampleGrads
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    n, m, k, dim = 2, 12, 3, 6
    x, y = torch.randn(n * m, 8, dtype=torch.float64), torch.randint(0, 3, (n * m,))
    structured = PerExampleGrads(model, F.cross_entropy, sketch_dim=dim, sketch_seed=5, structured=True, min_numel=1)
    formed = PerExampleGrads(model, F.cross_entropy)
    assert len(structured.sketch.blocks) == 2 and structured.names == formed.names
    expected = structured.sketch(formed(x, y))
    assert torch.allclose(structured(x, y), expected, rtol=0, atol=1e-12 * expected.abs().max())
    with pytest.raises(ValueError, match="structured=True needs sketch_dim"):
        PerExampleGrads(model, F.cross_entropy, structured=True)

    def orders(grads_of):
        sampler = CDGraBSampler(n * m, batch_size=k, num_replicas=n, seed=5, d=structured.d, sketch_dim=dim)
        seen = []
        for _ in range(3):
            for batch in torch.tensor(list(sampler)).split(sampler.loader_batch_size):
                sampler.step(grads_of(x[batch], y[batch]).float())
            seen.append(sampler.all_indices())
        return torch.stack(seen)

    from_layers = orders(structured)
    assert torch.equal(from_layers, orders(lambda xs, ys: structured.sketch(formed(xs, ys))))
    assert not torch.equal(from_layers[1:], orders(formed)[1:])  # the sampler's own (plain) map differs


# --------------------------------------------------------------- recording(): the loop runs the backward


def recorded(model, losses_of, B, loss_of_losses, dim=13, min_numel=ALL_BLOCKS):
    """Sketches by recording() with the loop's own backward of loss_of_losses(losses); returns (sketcher,
    sketches, the .grad left on the parameters)."""
    sketcher = LayerSketch(model, dim, seed=3, min_numel=min_numel)
    model.zero_grad(set_to_none=True)
    with sketcher.recording() as rec:
        losses = losses_of(slice(None))
        rec.watch(losses)
    loss_of_losses(losses).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return sketcher, rec.sketches(), grads


@pytest.mark.parametrize("min_numel", [ALL_BLOCKS, 1024, NO_BLOCKS])
def test_recording_with_a_weighted_and_scaled_loss_equals_the_map_of_the_per_example_gradients(min_numel):
    """The backward of 512 * sum_i w_i loss_i (per-example weights, as a token-count weighted mean, times a
    loss scale): the sketches are still the per-example gradients' (oracle), and .grad is that loss's own."""
    model = tiny_gpt2()
    B, ids = 3, torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    losses_of = gpt2_losses(model, ids)
    weights = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    sketcher, sketches, grads = recorded(model, losses_of, B, lambda losses: 512 * (losses * weights).sum(),
                                         dim=29, min_numel=min_numel)
    expected = sketcher.sketch(oracle(model, losses_of, B, sketcher.names))
    assert torch.allclose(sketches, expected, rtol=0, atol=1e-12 * expected.abs().max())
    model.zero_grad(set_to_none=True)
    (512 * (losses_of(slice(None)) * weights).sum()).backward()
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(g, p.grad, rtol=0, atol=1e-12 * p.grad.abs().max())


def test_recording_forms_the_parameters_without_a_rule_and_refuses_what_it_cannot_recover():
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(12, 2)).double()
    x, y = torch.randn(4, 2, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    losses_of = lambda rows: (model(x[rows]) - y[rows]).square().sum(1)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sketcher, sketches, _ = recorded(model, losses_of, 4, lambda losses: losses.mean(), dim=7)
    assert sorted(sketcher.formed) == ["0.bias", "0.weight"]
    expected = sketcher.sketch(oracle(model, losses_of, 4, sketcher.names))
    assert torch.allclose(sketches, expected, rtol=0, atol=1e-12 * expected.abs().max())
    with pytest.raises(ValueError, match=r"example\(s\) \[2\]"):  # example 2 left out of the loss
        recorded(model, losses_of, 4, lambda losses: losses[[0, 1, 3]].sum(), dim=7)
    sketcher = LayerSketch(model, 7)
    with sketcher.recording() as rec:
        rec.watch(losses_of(slice(None)))
    with pytest.raises(ValueError, match="no gradient reached the watched losses"):
        rec.sketches()
    with pytest.raises(ValueError, match=r"\(B,\) per-example losses"):
        with sketcher.recording() as rec:
            rec.watch(losses_of(slice(None)).sum())


def test_recording_under_bfloat16_autocast_is_close_to_the_float32_sketches():
    """Under CPU autocast the layers compute (and pass gradients) in bfloat16; the records are widened to
    the parameters' float32, and the sketches agree with the float32 oracle to bfloat16's precision."""
    torch.manual_seed(10)
    model = Stack(width=32).float()
    ids, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 5, (6,))
    losses_of = lambda rows: F.cross_entropy(model(ids[rows]).float(), y[rows], reduction="none")  # noqa: E731
    sketcher = LayerSketch(model, 64, seed=3, min_numel=ALL_BLOCKS)
    with sketcher.recording() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = losses_of(slice(None))
        rec.watch(losses)
    losses.mean().backward()
    sketches = rec.sketches()
    assert sketches.dtype == torch.float32
    expected = sketcher.sketch(oracle(model, losses_of, 6, sketcher.names))
    error = (sketches - expected).norm() / expected.norm()
    assert error < 0.05, error


# ------------------------------------------------------------------------- the four benchmarks' models


def test_the_four_benchmarks_models():
    """LR-HMDA's Linear, MLP-M4's autoregressive MLP (its layers used once per predicted step), LSTM-Wiki2's
    time-major LSTM (batch_dim=1; the tied encoder/decoder weight a block, the LSTM's own weights formed per
    example, said once) and GPT2-Wiki103's GPT-2 (tied wte/lm_head): each against the batch-of-one oracle."""
    from models.gpt2 import build_gpt2
    from models.lstm import LSTMModel
    from models.mlp import AutoregressiveMLP

    torch.manual_seed(11)
    lr = torch.nn.Linear(7, 1).double()
    x, y = torch.randn(5, 7, dtype=torch.float64), torch.rand(5, dtype=torch.float64).round()
    check_against_oracle(lr, lambda rows: F.binary_cross_entropy_with_logits(lr(x[rows]).squeeze(1), y[rows],
                                                                          reduction="none"), 5, dim=3)
    mlp = AutoregressiveMLP(in_len=5, hidden=8, n_layers=3).double()
    windows, future = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    check_against_oracle(mlp, lambda rows: (mlp(windows[rows], 3) - future[rows]).square().mean(1), 4, dim=11)

    lstm = LSTMModel(30, 6, 6, 2).double()
    ids, targets = torch.randint(0, 30, (7, 4)), torch.randint(0, 30, (7, 4))  # (T, B): time-major

    def lstm_losses(rows):
        columns = ids[:, rows]
        log_probs, _ = lstm(columns, lstm.init_hidden(columns.shape[1]))
        nll = F.nll_loss(log_probs, targets[:, rows].reshape(-1), reduction="none")
        return nll.view(columns.shape[0], -1).mean(0)  # (B,)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sketcher = check_against_oracle(lstm, lstm_losses, 4, dim=17, batch_dim=1)
    assert sketcher.formed and all(name.startswith("rnn.") for name in sketcher.formed)
    assert len([w for w in caught if "formed per example" in str(w.message)]) == 1
    assert [block.offset for block in sketcher.sketch.blocks] == [0]  # the tied 30 x 6 weight

    gpt2 = build_gpt2(vocab_size=40, n_embd=8, n_layer=1, n_head=2, n_positions=6).double()
    tokens = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(3))
    sketcher = check_against_oracle(gpt2, gpt2_losses(gpt2, tokens), 3, dim=23)
    assert not sketcher.formed and 0 in {block.offset for block in sketcher.sketch.blocks}
    with pytest.raises(ValueError, match="batch_dim must be 0 or 1"):
        LayerSketch(lr, 3, batch_dim=2)
