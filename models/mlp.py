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
