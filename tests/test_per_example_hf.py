"""PerExampleLossGrads: per-example gradients of a transformers model's own loss (labels, a dict batch,
padding masks), checked against a loop of batch-of-one backward passes on a tiny GPT-2 in float64."""
import pytest
import torch

from sorters import GradientSketch, PerExampleLossGrads

transformers = pytest.importorskip("transformers")

LENGTHS = (8, 5, 3, 6, 2)  # real tokens per example, of T = 8


def tiny_gpt2(attn_implementation="eager", dropout=0.0):
    """GPT-2 with 2 layers of width 32, vocabulary 64, in float64; built from a config (no download)."""
    transformers.logging.set_verbosity_error()  # the tiny vocabulary makes it warn about the special tokens
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation(attn_implementation)
    return model.double().eval()


def padded_batch(left=(3,)):
    """{"input_ids", "attention_mask", "labels"}: (5, 8), example i with LENGTHS[i] real tokens, padded on
    the right, or on the left for the examples in `left` (there the mask changes what the tokens see, so
    dropping it changes the gradients); labels = -100 at the pads."""
    ids = torch.randint(0, 64, (len(LENGTHS), 8), generator=torch.Generator().manual_seed(1))
    real = torch.arange(8)[None, :] < torch.tensor(LENGTHS)[:, None]
    for i in left:
        real[i] = real[i].flip(0)
    mask = real.long()
    return {"input_ids": ids.masked_fill(~real, 0), "attention_mask": mask, "labels": ids.masked_fill(~real, -100)}


def loop_of_backward_passes(model, batch, names):
    """The oracle: for each example, `model(**its row).loss.backward()`; returns the (B, d) gradients of
    `names` (flattened, concatenated) and the (B,) losses."""
    named = dict(model.named_parameters())
    rows, losses = [], []
    for i in range(len(LENGTHS)):
        model.zero_grad()
        loss = model(**{key: value[i:i + 1] for key, value in batch.items()}).loss
        loss.backward()
        rows.append(torch.cat([named[name].grad.reshape(-1) for name in names]))
        losses.append(loss.detach())
    return torch.stack(rows), torch.stack(losses)


def test_equal_a_loop_of_batch_of_one_backward_passes():
    model, batch = tiny_gpt2(), padded_batch()
    grads_of = PerExampleLossGrads(model)
    expected, expected_losses = loop_of_backward_passes(model, batch, grads_of.names)
    assert grads_of.d == expected.shape[1] == sum(p.numel() for p in model.parameters())
    grads, losses = grads_of(batch, return_losses=True)
    assert grads.shape == (5, grads_of.d) and grads.dtype == torch.float64 and losses.shape == (5,)
    torch.testing.assert_close(grads, expected, rtol=1e-10, atol=1e-12)
    # transformers computes the loss in float32 (logits.float()), the batched and the batch-of-one one
    # rounding differently (by 5e-7 here); the gradients flow back in float64 (1e-14 apart here)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, expected_losses, rtol=2e-6, atol=0.0)
    buffer = torch.empty(5, grads_of.d, dtype=torch.float64)
    assert grads_of(batch, out=buffer) is buffer
    torch.testing.assert_close(buffer, expected, rtol=1e-10, atol=1e-12)

    # params selects by name, as PerExampleGrads does (lm_head.weight is tied to wte: named once)
    subset = PerExampleLossGrads(model, params=[r"^transformer\.h\.1\.", r"ln_f"])
    assert subset.names[0] == "transformer.h.1.ln_1.weight" and subset.names[-1] == "transformer.ln_f.bias"
    expected_subset, _ = loop_of_backward_passes(model, batch, subset.names)
    torch.testing.assert_close(subset(batch), expected_subset, rtol=1e-10, atol=1e-12)


def test_chunks_give_the_unchunked_result():
    model, batch = tiny_gpt2(), padded_batch()
    whole, whole_losses = PerExampleLossGrads(model)(batch, return_losses=True)
    for chunk_size in (1, 2, 5, 7):  # 2: a last chunk of one
        chunks, losses = PerExampleLossGrads(model, chunk_size=chunk_size)(batch, return_losses=True)
        torch.testing.assert_close(chunks, whole, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(losses, whole_losses, rtol=2e-6, atol=0.0)  # float32: see above
    sketched = PerExampleLossGrads(model, chunk_size=2, sketch_dim=40, sketch_seed=3)(batch)
    torch.testing.assert_close(sketched, GradientSketch(whole.shape[1], 40, 3)(whole), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        PerExampleLossGrads(model, chunk_size=0)


def count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_untraceable_models_refused_up_front_in_one_line_that_says_what_to_change():
    batch = padded_batch()
    sdpa = tiny_gpt2("sdpa")
    calls = count_forwards(sdpa)
    with pytest.raises(ValueError, match=r'^PerExampleLossGrads: sdpa attention with an attention_mask .*'
                                         r'attn_implementation="eager" or call model.set_attn_implementation'):
        PerExampleLossGrads(sdpa)(batch)
    assert not calls  # refused before any forward
    # sdpa without a mask is traced fine (right padding only: there the mask changes nothing)
    right = {key: value for key, value in padded_batch(left=()).items() if key != "attention_mask"}
    eager = tiny_gpt2()
    torch.testing.assert_close(PerExampleLossGrads(sdpa)(right), PerExampleLossGrads(eager)(right))

    eager.activation_checkpointing_enable()  # transformers 5's name of gradient_checkpointing_enable
    calls = count_forwards(eager)
    with pytest.raises(ValueError, match=r"^PerExampleLossGrads: the model has gradient checkpointing on.*"
                                         r"model.activation_checkpointing_disable\(\)"):
        PerExampleLossGrads(eager)(batch)
    assert not calls
    dropout = tiny_gpt2(dropout=0.1).train()
    calls = count_forwards(dropout)
    with pytest.raises(ValueError, match=r"^PerExampleLossGrads: module 'transformer.drop' is Dropout\(p=0.1\) "
                                         r"in training mode.*model.eval\(\)"):
        PerExampleLossGrads(dropout)(batch)
    assert not calls
    assert PerExampleLossGrads(dropout.eval())(batch).shape == (5, PerExampleLossGrads(dropout).d)


class ScalarLossModel(torch.nn.Module):
    """A model computing its own loss from keyword tensors, with switches for what torch.func cannot trace
    and the attribute checks cannot see: a branch on tensor values, requires_grad_ in forward."""

    def __init__(self, branch=False, requires_grad=False, return_tuple=False):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.branch, self.requires_grad, self.return_tuple = branch, requires_grad, return_tuple

    def forward(self, x, attention_mask=None, labels=None, scale=1.0):
        hidden = x.clone().requires_grad_() if self.requires_grad else x
        if self.branch and attention_mask is not None and bool(attention_mask.all()):
            hidden = hidden * 1.0
        prediction = self.linear(hidden).squeeze(-1) * scale
        loss = None if labels is None else ((prediction - labels) ** 2).mean()
        return (loss, prediction) if self.return_tuple else {"loss": loss, "prediction": prediction}


def test_dict_batch_labels_tuple_outputs_and_what_torch_func_refuses_as_one_line():
    x, y, mask = torch.randn(4, 3), torch.randn(4), torch.ones(4, dtype=torch.long)
    model = ScalarLossModel()
    residual = (4 * (model(x, scale=2.0)["prediction"] - y))[:, None].detach()
    expected = torch.cat([x * residual, residual], dim=1)  # d/dw, d/db of (2(w.x + b) - y)^2
    batch = {"x": x, "labels": y, "scale": 2.0}  # a non-tensor value goes to every example unchanged
    torch.testing.assert_close(PerExampleLossGrads(model)(batch), expected)
    model.return_tuple = True
    torch.testing.assert_close(PerExampleLossGrads(model)(batch), expected)
    model.return_tuple = False
    with pytest.raises(ValueError, match="must return its scalar loss.*pass the labels"):
        PerExampleLossGrads(model)({"x": x})
    with pytest.raises(ValueError, match=r"one common dim 0.*'x': 4, 'labels': 3"):
        PerExampleLossGrads(model)({"x": x, "labels": y[:3]})
    with pytest.raises(ValueError, match=r"^PerExampleLossGrads: the model's forward branches on tensor values.*"
                                         r'attn_implementation="eager"'):
        PerExampleLossGrads(ScalarLossModel(branch=True))({"x": x, "attention_mask": mask, "labels": y})
    with pytest.raises(ValueError, match=r"^PerExampleLossGrads: the model calls requires_grad_ in its forward.*"
                                         r"gradient_checkpointing_disable\(\)"):
        PerExampleLossGrads(ScalarLossModel(requires_grad=True))({"x": x, "labels": y})
