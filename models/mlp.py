"""Autoregressive MLP forecaster for M4 (docs/benchmarks.md; the original's `Auto_MLP` with num_steps=1 and RevIN off).

Linear(in_len, hidden), ReLU, (n_layers - 2) x [Linear(hidden, hidden), ReLU], Linear(hidden, 1).
Default 20/64/3: d = 1,344 + 4,160 + 65 = 5,569.
"""
import torch
import torch.nn as nn


class AutoregressiveMLP(nn.Module):
    def __init__(self, in_len: int = 20, hidden: int = 64, n_layers: int = 3):
        super().__init__()
        if n_layers < 2:
            raise ValueError(f"n_layers counts the input and output Linear layers, so it must be >= 2, got {n_layers}")
        self.in_len = in_len
        layers = [nn.Linear(in_len, hidden), nn.ReLU()]
        for _ in range(n_layers - 2):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, horizon: int) -> torch.Tensor:
        """x (b, in_len) -> predictions (b, horizon).

        Each step predicts the next value from the last in_len values and appends it, so later
        steps see the model's own earlier predictions, never the ground truth.
        """
        window, outs = x, []
        for _ in range(horizon):
            nxt = self.net(window)                           # (b, 1)
            outs.append(nxt)
            window = torch.cat([window[:, 1:], nxt], dim=1)  # slide: drop the oldest, append the prediction
        return torch.cat(outs, dim=1)


@torch.no_grad()
def window_gradients(mlp: AutoregressiveMLP, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Every window's gradient of its own rollout loss, mean over h of (prediction_h - y_h)^2, by hand.

    x (U, in_len), y (U, horizon); out (U, d) receives window u's gradient in row u, the parameters side by
    side in `mlp.parameters()` order (each Linear's weight, then its bias). Returns the losses (U,).

    The per-unit path of CD-GraB at small d, where autograd's bookkeeping and a module call per layer and
    rollout step cost more than the arithmetic: one forward without a graph that keeps each layer's
    input, then the backward of the rollout written out (each prediction's gradient is its own error's
    plus what later windows, which read it as an input, send back), then per layer one batched product
    of output gradients and inputs over the rollout steps, as FlatModel.outer_unit_gradients forms it.
    """
    linears = [m for m in mlp.net if isinstance(m, nn.Linear)]
    horizon = y.shape[1]
    window, inputs, preds = x, [], []  # inputs[t][i]: layer i's input at rollout step t
    for _ in range(horizon):
        h, seen = window, []
        for i, layer in enumerate(linears):
            seen.append(h)
            h = torch.nn.functional.linear(h, layer.weight, layer.bias)
            if i + 1 < len(linears):
                h = torch.relu(h)
        inputs.append(seen)
        preds.append(h)                                # (U, 1)
        window = torch.cat([window[:, 1:], h], dim=1)
    err = torch.cat(preds, dim=1) - y                  # (U, horizon)
    losses = err.square().mean(dim=1)
    direct = err * (2.0 / horizon)                     # d loss_u / d prediction_t
    out_grads = [[None] * horizon for _ in linears]    # out_grads[i][t]: d loss / d layer i's output at t
    later = None                                       # d loss / d window t+1 (None: no later window)
    for t in reversed(range(horizon)):
        g = direct[:, t:t + 1]
        if later is not None:                          # window t+1's last entry is prediction t
            g = g + later[:, -1:]
        for i in reversed(range(len(linears))):
            out_grads[i][t] = g
            if i == 0 and t == 0:
                break                                  # the data window needs no gradient
            g = g @ linears[i].weight                  # d loss / d layer i's input
            if i > 0:
                g = g * (inputs[t][i] > 0)             # through the ReLU (its output is layer i's input)
        if t > 0:
            if later is not None:                      # window t+1's entry j is window t's entry j + 1
                g[:, 1:] += later[:, :-1]
            later = g
    pieces = []
    for i, layer in enumerate(linears):
        a = torch.stack([inputs[t][i] for t in range(horizon)], dim=1)    # (U, horizon, in)
        g = torch.stack(out_grads[i], dim=1)                              # (U, horizon, out)
        pieces.append(torch.bmm(g.transpose(1, 2), a).flatten(1))        # sum_t g_t a_t^T
        pieces.append(g.sum(1))
    torch.cat(pieces, dim=1, out=out)
    return losses
