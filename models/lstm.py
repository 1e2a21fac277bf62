"""Word-level LSTM language model with tied embedding/decoder weights (docs/benchmarks.md).

Embedding(V, ninp) -> nn.LSTM(ninp, nhid, nlayers) -> Linear(nhid, V, bias=False) sharing the
embedding's weight -> log_softmax. With V = 33,278 and 32/32/2: d = 1,064,896 + 2 * 8,448 = 1,081,792
(the tied matrix counted once).
"""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F


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
