"""The one table of per-layer rules (sorters/layer_rules.py) against an independent oracle: per-unit gradients
by torch.func.vmap over grad of each unit's loss alone (float64), which shares no code with the rules. Each
rule, a layer used twice (calls_as_tokens), the TensorSketch route (BlockSink), which layers take a rule
(layer_kind) and which weights a structured sketch makes blocks (Layout.blocks)."""
import pytest
import torch
from torch.func import functional_call, grad, vmap

from sorters.layer_rules import BlockSink, Layout, Sink, apply_rule, calls_as_tokens, layer_kind, tokens
from sorters.sketch import GradientSketch

U, T = 3, 5


class Formed(Sink):
    """The simplest sink: every unit's gradient of each parameter, formed, (U, *p.shape); add_outer and
    add_rows are the base class's (form, then add)."""

    def __init__(self):
        self.grads = {}

    def add(self, p, value):
        assert value.shape == (U, *p.shape), (value.shape, p.shape)
        self.grads[id(p)] = self.grads.get(id(p), 0) + value


def oracle(layer, inputs, coefficients):
    """{name: (U, *p.shape)}: unit u's gradient of its loss <coefficients[u], layer(inputs[u])> alone."""
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def unit_loss(params, x, c):
        return (functional_call(layer, params, (x[None],))[0] * c).sum()

    return vmap(grad(unit_loss), in_dims=(None, 0, 0))(params, inputs, coefficients)


def by_rule(layer, inputs, coefficients, calls: int = 1):
    """{name: (U, *p.shape)} from the table: the layer's output gradient (the coefficients) and its input,
    through the rule, as `calls` calls of the layer (the inputs split along dim 1)."""
    kind = layer_kind(layer)
    pieces = list(zip(inputs.chunk(calls, dim=1), coefficients.chunk(calls, dim=1)))
    a, g = calls_as_tokens(layer, kind, [x for x, _ in pieces], [c for _, c in pieces]) if calls > 1 \
        else tokens(layer, kind, inputs, coefficients)
    sink = Formed()
    apply_rule(layer, kind, a, g, sink)
    return {name: sink.grads.get(id(p), torch.zeros(U, *p.shape, dtype=p.dtype)) for name, p in layer.named_parameters()}


def conv1d(n_in, n_out):
    from transformers.pytorch_utils import Conv1D

    return Conv1D(n_out, n_in)  # transformers' argument order: (nf = out, nx = in)


def layers():
    """(id, layer float64, inputs (U, T, ...), output shape per unit)."""
    torch.manual_seed(0)
    x = torch.randn(U, T, 4, dtype=torch.float64)
    ids = torch.tensor([[1, 0, 3, 1, 6], [0, 0, 2, 5, 5], [4, 1, 0, 6, 2]])  # 0: padding in the padded one
    yield "linear", torch.nn.Linear(4, 3), x, (T, 3)
    yield "linear-square-no-bias", torch.nn.Linear(4, 4, bias=False), x, (T, 4)
    yield "conv1d-square", conv1d(4, 4), x, (T, 4)  # W (in, out): a transposed product has the same shape
    yield "conv1d", conv1d(4, 6), x, (T, 6)
    yield "embedding", torch.nn.Embedding(7, 3), ids, (T, 3)
    yield "embedding-padding", torch.nn.Embedding(7, 3, padding_idx=0), ids, (T, 3)
    yield "layer-norm", torch.nn.LayerNorm(4, eps=0.3), x * 3 + 1, (T, 4)
    yield "layer-norm-2d-no-bias", torch.nn.LayerNorm((2, 2), bias=False), x.view(U, T, 2, 2), (T, 2, 2)


CASES = list(layers())


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize("calls", [1, 5])
def test_each_rule_gives_each_units_own_gradient(case, calls):
    """Every parameter's per-unit gradient from the rule equals the oracle's, for one call of the layer and
    for the same tokens as 5 calls (a layer used several times: the calls' tokens side by side)."""
    _, layer, inputs, out_shape = case
    layer = layer.double()
    coefficients = torch.randn(U, *out_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want, got = oracle(layer, inputs, coefficients), by_rule(layer, inputs, coefficients, calls)
    assert set(got) == set(want)
    for name in want:
        assert want[name].abs().max() > 0.1, name  # the oracle is not trivially zero
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


def test_the_tensorsketch_blocks_get_the_sketch_of_the_gradients_they_never_form():
    """BlockSink: a Linear and an Embedding weight that are TensorSketch blocks of a map add their sketches
    to out (TensorBlock.add_outer / add_rows); the bias goes to the formed sink. Together: the map applied to
    the oracle's per-unit gradients."""
    linear, embedding = torch.nn.Linear(4, 3).double(), torch.nn.Embedding(7, 3, padding_idx=0).double()
    torch.manual_seed(1)
    x, ids = torch.randn(U, T, 4, dtype=torch.float64), torch.tensor([[1, 0, 3, 1, 6]] * U)
    c1, c2 = torch.randn(U, T, 3, dtype=torch.float64), torch.randn(U, T, 3, dtype=torch.float64)
    # the flat vector: linear.weight, linear.bias, embedding.weight (12 + 3 + 21 coordinates)
    sketch = GradientSketch(36, 8, seed=4, blocks=[(0, 3, 4), (15, 7, 3)])
    out, formed = torch.zeros(U, 8, dtype=torch.float64), Formed()
    sink = BlockSink(formed, {id(linear.weight): sketch.block_at(0), id(embedding.weight): sketch.block_at(15)}, out)
    apply_rule(linear, "Linear", x, c1, sink)
    apply_rule(embedding, "Embedding", ids, c2, sink)
    assert set(formed.grads) == {id(linear.bias)}
    rest = torch.zeros(U, 36, dtype=torch.float64)
    rest[:, 12:15] = formed.grads[id(linear.bias)]
    want_linear, want_embedding = oracle(linear, x, c1), oracle(embedding, ids, c2)
    want = torch.cat([want_linear["weight"].reshape(U, -1), want_linear["bias"], want_embedding["weight"].reshape(U, -1)], 1)
    torch.testing.assert_close(out + sketch(rest), sketch(want), rtol=1e-12, atol=1e-12)


def test_layer_kind_matches_by_class_and_refuses_what_has_no_rule():
    class Head(torch.nn.Linear):  # a subclass takes its base's rule (isinstance)
        pass

    class Conv1D(torch.nn.Module):  # a layer merely named Conv1D is not transformers'
        pass

    assert layer_kind(Head(2, 2)) == "Linear" and layer_kind(conv1d(2, 3)) == "Conv1D"
    assert layer_kind(torch.nn.Embedding(3, 2)) == "Embedding" and layer_kind(torch.nn.LayerNorm(2)) == "LayerNorm"
    # scale_grad_by_freq: a unit's gradient depends on the other units' ids
    assert layer_kind(torch.nn.Embedding(3, 2, scale_grad_by_freq=True)) is None
    assert layer_kind(Conv1D()) is None and layer_kind(torch.nn.LSTM(2, 2)) is None


def test_the_layout_makes_blocks_of_large_recorded_2d_weights_only():
    """Blocks: 2-D weights of Linear / Conv1D / Embedding with at least min_numel entries, a tied one once;
    never LayerNorm's, never a weight that a layer without a rule also holds."""
    embedding, decoder = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    norm = torch.nn.LayerNorm((6, 4))  # a 2-D weight of 24 entries, but a LayerNorm's
    decoder.weight = embedding.weight
    other, lstm = torch.nn.Linear(4, 6), torch.nn.LSTM(6, 6)
    shared = torch.nn.Linear(6, 6)
    lstm.weight_ih_l0 = shared.weight  # shared.weight is also an LSTM's: not from the rules
    model = torch.nn.ModuleList([embedding, decoder, norm, other, lstm, shared])
    chosen = list(model.named_parameters())
    layout = Layout(model, chosen)
    offsets = {name: layout.offsets[id(p)] for name, p in chosen}
    assert layout.d == sum(p.numel() for _, p in chosen)
    assert layout.blocks(24) == [(offsets["0.weight"], 10, 4), (offsets["3.weight"], 6, 4)]
    assert layout.blocks(25) == [(offsets["0.weight"], 10, 4)]
    assert layout.blocks(1) == layout.blocks(24)  # the LayerNorm's weight and the LSTM-held weight: never
    assert {name for name, _ in layout.formed} == {name for name, _ in chosen if name.startswith(("4.", "5.weight"))}
    assert set(layout.layers.values()) == {"Embedding", "Linear", "LayerNorm"} and lstm not in layout.layers
