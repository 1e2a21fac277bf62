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

from sorters.layer_rules import ColumnSink, apply_rule


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
def _block_weights(U: int, H: int, layers: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """unit_gradients' block-diagonal LSTM weights for U units, made once per size, dtype and device: the
    matrices (layers, 2, 4, U, H, U, H) (each layer's weight_ih then weight_hh; rows gate-major (gate, unit,
    hidden), columns unit-major), zeros off the diagonal blocks, which no call writes; and the biases
    (layers, 2, 4, U, H). Each call copies the model's weights onto the blocks, so nothing carries over."""
    return (torch.zeros(layers, 2, 4, U, H, U, H, dtype=dtype, device=device),
            torch.zeros(layers, 2, 4, U, H, dtype=dtype, device=device))


@functools.lru_cache(maxsize=8)
def _token_weights(tokens: int, per_unit: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(tokens,) of 1 / per_unit, as the backward of a mean over per_unit tokens computes it (a division):
    each token's weight in its unit's mean NLL."""
    return torch.ones(tokens, dtype=dtype, device=device) / per_unit


def _lstm_parameters(model: LSTMModel) -> torch.Tensor:
    """The LSTM's parameters as (layers, 8 H^2 + 8 H), each row a layer's weight_ih, weight_hh, bias_ih,
    bias_hh flattened: a view when they lie back to back in one storage in that order (a FlatModel's flat
    vector), else a copy."""
    rnn = model.rnn
    params = [getattr(rnn, f"{name}_l{layer}") for layer in range(model.nlayers)
              for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    first, offset = params[0], params[0].storage_offset()
    for p in params:
        if (p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.storage_offset() != offset
                or not p.is_contiguous()):
            return torch.cat([q.detach().reshape(-1) for q in params]).view(model.nlayers, -1)
        offset += p.numel()
    per_layer = (offset - first.storage_offset()) // model.nlayers
    return first.detach().as_strided((model.nlayers, per_layer), (per_layer, 1), first.storage_offset())


@torch.no_grad()
def unit_gradients(model: LSTMModel, inputs, targets, h0, c0, out: torch.Tensor, into_slots: bool = False):
    """Every unit's gradient of its own mean token NLL from ONE forward and ONE backward for all units.

    inputs, targets (U, T, w) token ids (unit u: w columns of T tokens); h0, c0 (U, layers, w, nhid);
    out (U, d) receives unit u's gradient in row u, the parameters in `model.named_parameters()` order
    (the tied embedding / decoder weight once, then each layer's weight_ih, weight_hh, bias_ih, bias_hh).
    into_slots: the decoder's per-unit product is written straight into its columns of out (one kernel;
    the GPU's way) rather than formed and copied in (sorters.layer_rules.ColumnSink).
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

    Tokens stay in the LSTM's order (time, column, unit) throughout, so nothing is permuted into copies (the
    targets are, unless they come laid out in that order, as the task's units of a per-unit run do); the loss's
    backward, whose gradient is known, is written out (the NLL's and the log-softmax's backward operators)
    rather than recorded, and autograd runs the LSTM's backward only.
    """
    U, T, w = inputs.shape
    H, V, layers = model.nhid, model.ntoken, model.nlayers
    E = model.encoder.weight
    # the block-diagonal LSTM's weights: the model's matrices copied onto every diagonal block, its biases repeated
    # for every unit (ninp == nhid: every matrix (4H, H)); one copy each for all layers
    matrices, biases = _block_weights(U, H, layers, E.dtype, E.device)
    section = _lstm_parameters(model)
    torch.diagonal(matrices, dim1=3, dim2=5).copy_(section[:, :8 * H * H].view(layers, 2, 4, H, H, 1))
    biases.copy_(section[:, 8 * H * H:].view(layers, 2, 4, 1, H))
    weights = []  # _VF.lstm's order: each layer's weight_ih, weight_hh, bias_ih, bias_hh
    for layer in range(layers):
        weights += [matrices[layer, i].view(4 * U * H, U * H).detach().requires_grad_() for i in range(2)]
        weights += [biases[layer, i].view(-1).detach().requires_grad_() for i in range(2)]
    x = F.embedding(inputs.permute(1, 2, 0), E).view(T, w, U * H).requires_grad_()  # (T, w, U * H)
    state = tuple(s.permute(1, 2, 0, 3).reshape(layers, w, U * H).contiguous() for s in (h0, c0))
    with torch.enable_grad():
        output, h, c = _VF.lstm(x, state, weights, True, layers, 0.0, True, False, False)
    tokens = output.detach().view(T * w * U, H)  # the decoder's inputs, token (t, column, unit) by token
    log_probs = F.log_softmax(tokens @ E.T, dim=1)                          # (T * w * U, V)
    target = targets.permute(1, 2, 0).reshape(-1)                            # the tokens' order
    token_nll, total_weight = torch.ops.aten.nll_loss_forward(log_probs, target, None, 0, -100)  # 0: no reduction
    losses = token_nll.view(T * w, U).mean(0)
    # the gradient of sum_u losses[u] at the log-probabilities, then at the logits: a unit's tokens weigh 1 / (T w)
    g_log_probs = torch.ops.aten.nll_loss_backward(_token_weights(T * w * U, T * w, E.dtype, E.device), log_probs,
                                                   target, None, 0, -100, total_weight)
    g_logits = torch.ops.aten._log_softmax_backward_data(g_log_probs, log_probs, 1, log_probs.dtype)
    g_output = (g_logits @ E).view(T, w, U * H)
    grads = torch.autograd.grad(output, [x, *weights], g_output)
    g_x, g_weights = grads[0], grads[1:]
    # the tied weight by the library's rules, straight into out's columns: the decoder's product first, then
    # the embedding's rows onto it; tokens as they lie, (U, T * w, .) and (U, T, w, .) views
    sink = ColumnSink(out, {id(E): 0}, into_slots)
    apply_rule(model.decoder, "Linear", tokens.view(T * w, U, H).transpose(0, 1),
               g_logits.view(T * w, U, V).transpose(0, 1), sink)                     # (U, V, H)
    apply_rule(model.encoder, "Embedding", inputs, g_x.view(T, w, U, H).permute(2, 0, 1, 3), sink)
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
    final = tuple(s.view(layers, w, U, H).permute(2, 0, 1, 3) for s in (h, c))
    return losses, final
