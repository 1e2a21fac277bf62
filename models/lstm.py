"""Word-level LSTM language model with tied embedding/decoder weights (docs/benchmarks.md).

Embedding(V, ninp) -> nn.LSTM(ninp, nhid, nlayers) -> Linear(nhid, V, bias=False) sharing the
embedding's weight -> log_softmax. With V = 33,278 and 32/32/2: d = 1,064,896 + 2 * 8,448 = 1,081,792
(the tied matrix counted once).
"""
import functools
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import _VF

from sorters.layer_rules import FormedSink, apply_rule


class LSTMModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int = 32, nhid: int = 32, nlayers: int = 2):
        super().__init__()
        if ninp != nhid:  # the decoder reuses the (ntoken, ninp) embedding as its (ntoken, nhid) weight
            raise ValueError(f"tied weights need ninp == nhid, got ninp={ninp}, nhid={nhid}")
        self.ntoken, self.nhid, self.nlayers = ntoken, nhid, nlayers
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=0.0)
        self.decoder = nn.Linear(nhid, ntoken, bias=False)
        self.decoder.weight = self.encoder.weight  # tied: one parameter, registered under both names
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)  # the LSTM keeps PyTorch's default init

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        """input (T, b) long, hidden = (h, c) each (nlayers, b, nhid)
        -> log-probabilities (T*b, V), time-major like get_chunk's targets, and the new (h, c)."""
        emb = self.encoder(input)                  # (T, b, ninp)
        output, hidden = self.rnn(emb, hidden)     # (T, b, nhid)
        logits = self.decoder(output)              # (T, b, V)
        return F.log_softmax(logits, dim=-1).view(-1, self.ntoken), hidden

    def init_hidden(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero (h, c), each (nlayers, b, nhid), on the model's device and dtype."""
        w = self.encoder.weight
        return (w.new_zeros(self.nlayers, b, self.nhid), w.new_zeros(self.nlayers, b, self.nhid))


@contextmanager
def without_cudnn():
    """Inside the block, CUDA LSTMs run PyTorch's own kernels instead of cuDNN's.

    cuDNN's LSTM reads its weights through raw data pointers, which the wrapper tensors of torch.func
    (grad, vmap) do not have: on CUDA, torch 2.11 fails with "Cannot access data pointer of Tensor
    that doesn't have storage". Gradients through torch.func therefore run here; plain forward passes
    (evaluation) keep cuDNN. Only the `enabled` flag changes; the others stay as they were.
    """
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = enabled


@functools.lru_cache(maxsize=8)
def _identity(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (n, n) identity, made once per size, dtype and device (unit_gradients' block-diagonal weights)."""
    return torch.eye(n, dtype=dtype, device=device)


@torch.no_grad()
def unit_gradients(model: LSTMModel, inputs, targets, h0, c0, out: torch.Tensor):
    """Every unit's gradient of its own mean token NLL from ONE forward and ONE backward for all units.

    inputs, targets (U, T, w) token ids (unit u: w columns of T tokens); h0, c0 (U, layers, w, nhid);
    out (U, d) receives unit u's gradient in row u, the parameters in `model.named_parameters()` order
    (the tied embedding / decoder weight once, then each layer's weight_ih, weight_hh, bias_ih, bias_hh).
    Returns (losses (U,), final (h, c) each (U, layers, w, nhid)).

    The units run side by side as ONE LSTM whose hidden state is the units' states concatenated (U * nhid
    features) and whose weights are block-diagonal, unit u's block the model's weights: unit u's outputs
    depend on its own block only, so the gradient of the summed losses on block u is unit u's gradient of
    the LSTM weights. The decoder and the embedding, whose weight is shared, get theirs from the library's
    per-layer rules (sorters/layer_rules.py, as FlatModel.outer_unit_gradients does): the token logits'
    gradients times the LSTM outputs, one batched product over the units, plus each token's input gradient
    added to the embedding row it read. (The LSTM's own weights are not such a rule: a unit's gradient of
    them needs the recurrence's backward through time for that unit alone, which the records of an
    ordinary batched forward do not hold; the block-diagonal LSTM above gives it in the same one pass.)
    """
    U, T, w = inputs.shape
    H, V, layers = model.nhid, model.ntoken, model.nlayers
    E = model.encoder.weight
    lstm = [[getattr(model.rnn, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            for layer in range(layers)]
    # the block-diagonal LSTM's weights, all made at once: (2 * layers, 4, U, H, U, H), rows gate-major (gate,
    # unit, hidden), columns unit-major; block (u, u) the model's weight (ninp == nhid: every matrix (4H, H)),
    # the rest exact zeros; its biases (2 * layers, 4, U, H), the model's repeated for every unit
    matrices = torch.stack([weight.view(4, 1, H, 1, H) for layer in lstm for weight in layer[:2]])
    blocks = _identity(U, E.dtype, E.device).view(1, 1, U, 1, U, 1) * matrices
    biases = torch.stack([bias.view(4, 1, H).expand(4, U, H) for layer in lstm for bias in layer[2:]])
    weights = []  # _VF.lstm's order: each layer's weight_ih, weight_hh, bias_ih, bias_hh
    for layer in range(layers):
        weights += [blocks[2 * layer + i].view(4 * U * H, U * H).requires_grad_() for i in range(2)]
        weights += [biases[2 * layer + i].view(-1).requires_grad_() for i in range(2)]
    x = F.embedding(inputs.permute(1, 2, 0), E).view(T, w, U * H).requires_grad_()  # (T, w, U * H)
    state = tuple(s.permute(1, 2, 0, 3).reshape(layers, w, U * H).contiguous() for s in (h0, c0))
    with torch.enable_grad():
        output, h, c = _VF.lstm(x, state, weights, True, layers, 0.0, True, False, False)
        hidden = output.view(T, w, U, H).permute(2, 0, 1, 3).reshape(U, T * w, H)  # unit-major tokens
        logits = hidden @ E.T                                                     # (U, T * w, V)
        token_nll = F.cross_entropy(logits.view(-1, V), targets.reshape(-1), reduction="none")
        losses = token_nll.view(U, T * w).mean(1)
        grads = torch.autograd.grad(losses.sum(), [logits, hidden, x, *weights])
    g_logits, g_hidden, g_x, g_weights = grads[0], grads[1], grads[2], grads[3:]
    # the tied weight by the library's rules: the decoder's product first, then the embedding's rows onto it
    sink = FormedSink()
    apply_rule(model.decoder, "Linear", hidden.detach(), g_logits, sink)        # (U, V, H)
    g_emb = g_x.view(T, w, U, H).permute(2, 0, 1, 3).reshape(U, T * w, H)
    apply_rule(model.encoder, "Embedding", inputs.reshape(U, T * w), g_emb, sink)  # tokens (t, column), as g_emb
    out[:, :E.numel()].view(U, V, H).copy_(sink.grads[id(E)])
    # each layer's LSTM gradients in one copy for its two matrices and one for its two biases, straight into
    # out's columns: unit u's gradient of a block-diagonal weight is its block (u, u)
    per_layer = out[:, E.numel():].view(U, layers, -1)
    matrix_grads = per_layer[..., :8 * H * H].view(U, layers, 2, 4, H, H).permute(1, 2, 3, 4, 5, 0)
    bias_grads = per_layer[..., 8 * H * H:].view(U, layers, 2, 4, H).permute(1, 2, 3, 0, 4)
    for layer in range(layers):
        g_ih, g_hh, g_bias_ih, g_bias_hh = g_weights[4 * layer:4 * layer + 4]
        torch.stack([torch.diagonal(g.view(4, U, H, U, H), dim1=1, dim2=3) for g in (g_ih, g_hh)],
                    out=matrix_grads[layer])                                          # (2, 4, H, H, U)
        torch.stack([g.view(4, U, H) for g in (g_bias_ih, g_bias_hh)], out=bias_grads[layer])  # (2, 4, U, H)
    del g_hidden
    final = tuple(s.view(layers, w, U, H).permute(2, 0, 1, 3) for s in (h, c))
    return losses.detach(), final
