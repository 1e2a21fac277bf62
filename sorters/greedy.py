"""Greedy herding from stale gradients (Lu, Meng, De Sa, ICLR 2022; Mohtashami, Stich, Jaggi 2022), per worker.

During epoch e every worker's unit gradients (or their sketches: the sampler's and the engine's sketch_dim
hand the sorter D-dimensional `GradientSketch` images) are kept, one row per unit. At the start of epoch
e + 1 each worker centres its m rows (minus their mean) and builds its order greedily: position t takes the
unit, among those not yet placed, that minimises the norm of the prefix sum, ||s + x_u|| with s the sum of
the centred rows already placed (ties: the lowest unit id). The first epoch, with no gradients yet, is the
seeded random permutation every sorter starts from.

How it is fast. ||s + x_u||^2 = ||s||^2 + 2 <s, x_u> + ||x_u||^2 and ||s||^2 is the same for every candidate,
so each step needs c_u = <s, x_u> for the remaining units; it keeps c and, once unit v is placed, adds
<x_v, x_u> to every c_u: one vector-matrix product over the remaining units per position, batched over the
n workers (one (n, 1, d) x (n, d, R) product) on the sorter's device, with no host synchronisation. The
vectors are compacted into the remaining ones each time half of them have been placed, so the products shrink
with the epoch.

What it costs (n workers, m units each, d = the gradient's or sketch's length, s bytes per element):

- memory: n m d s bytes for the kept gradients, all the time (they are in a checkpoint too), plus a centred
  copy of the same size and a few (n, m) float64 vectors while sort() builds the next order;
- time: about (2/3) n m^2 d multiply-adds per epoch in sort() (sum over the halving blocks of R^2 d / 2),
  and m sequential steps of a handful of kernels each.

So it stays affordable while n m^2 d stays near the epoch's own work, which grows as n m d only: the cost per
unit grows as m d. docs/sorters.md has the formula at the benchmarks' sizes.

The code this follows (EugeneLYC/GraB, StaleGradGreedySort) scales the prefix sum by the position in the
candidates' norm; this rule takes the plain prefix sum, the herding objective the papers state.
"""

import torch

from sorters.base import Sorter

# compact the kept rows to the remaining units once at most this share of them remains, and only above this
# many rows (below it, a smaller product saves less than the copy costs)
_COMPACT_WHEN_REMAINING = 0.5
_COMPACT_MIN_ROWS = 64


def greedy_orders(units: torch.Tensor) -> torch.Tensor:
    """The greedy herding order of every worker's units.

    Args:
        units: (n, m, d) floating tensor, ``units[j, u]`` worker j's vector of unit u (uncentred).

    Returns:
        (n, m) LongTensor on the units' device: row j lists worker j's units in the order that greedily
        minimises ``|| sum of the centred vectors placed so far ||``, ties going to the lowest unit id.
    """
    n, m, d = units.shape
    rows = torch.arange(n, device=units.device)
    mean = units.sum(dim=1, keepdim=True, dtype=torch.float64) / m
    # (n, d, R): the centred vectors of the R units not yet placed, one per column (a row-vector-times-matrix
    # product per step is several times faster than the matrix-times-vector one on the CPU)
    x = (units - mean.to(units.dtype)).transpose(1, 2).contiguous()
    # (n, R) float64: 2 <s, x_u> + ||x_u||^2, the candidates' ||s + x_u||^2 less the common ||s||^2; +inf once placed
    score = x.square().sum(dim=1, dtype=torch.float64)
    ids = torch.arange(m, device=units.device).expand(n, m)  # (n, R) the unit each row holds, ascending
    order = torch.empty(n, m, dtype=torch.long, device=units.device)
    picked = torch.empty(n, m, dtype=torch.long, device=units.device)  # (n, m) the row taken at each position
    products = torch.empty(n, 1, m, dtype=units.dtype, device=units.device)
    first = 0  # the first position whose row is not yet translated into its unit id
    for t in range(m):
        # argmin takes the first of equal scores: the lowest unit id, since the rows stay in id order
        best = torch.argmin(score, dim=1, out=picked[:, t])  # (n,)
        score[rows, best] = torch.inf
        # s grew by x_best: every candidate's <s, x_u> by <x_best, x_u>
        product = torch.bmm(x[rows, :, best][:, None], x, out=products[:, :, :x.shape[2]])  # (n, 1, R)
        score.add_(product[:, 0], alpha=2)
        remaining = m - t - 1
        if remaining == 0 or (x.shape[2] > _COMPACT_MIN_ROWS and remaining <= _COMPACT_WHEN_REMAINING * x.shape[2]):
            order[:, first:t + 1] = ids.gather(1, picked[:, first:t + 1])
            first = t + 1
        if remaining and first == t + 1:
            # the rows still to place, in id order (a stable sort of the finite before +inf; no host synchronisation)
            keep = torch.argsort(torch.isinf(score).to(torch.uint8), dim=1, stable=True)[:, :remaining]
            x = x.gather(2, keep[:, None].expand(n, d, remaining))
            score, ids = score.gather(1, keep), ids.gather(1, keep)
    return order


class GreedyHerding(Sorter):
    """Greedy: each worker orders its units by greedy herding of its own stale, centred gradients.

    Epoch e's order (e >= 2) is `greedy_orders` of the unit gradients seen in epoch e - 1; epoch 1's is the
    seeded random permutation. The order is built in ``sort()``, at the epoch's start. Each worker uses only
    its own gradients (no coordination), but ``step`` takes every worker's, as every balancing sorter does.

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient (or sketch).
        seed: the seed of the first epoch's orders.
        device: where the kept gradients live and the greedy search runs.
        dtype: the dtype of the kept gradients (the gradients' dtype).
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`; a skipped step's units are kept as zero vectors).
    """

    name = "Greedy"
    uses_grads = True

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, nonfinite: str = "raise") -> None:
        super().__init__(n_workers, m, d, seed, device, nonfinite)
        self.dtype = dtype
        # (n, m, d): row u of worker j holds the gradient of unit u, from this epoch once step() has seen it
        self.kept = torch.zeros(self.n, self.m, self.d, dtype=dtype, device=self.device)

    def step(self, grads: torch.Tensor | None, positions: torch.Tensor | list[int] | range) -> None:
        """Keep the gradients of the units at `positions` (`Sorter.step`).

        Args:
            grads: (n, k, d), ``grads[j, i]`` worker j's gradient of the unit at epoch position ``positions[i]``.
            positions: (k,) the step's epoch positions, continuing the epoch.
        """
        start, k, grads_tensor = self._screened_step(grads, positions, self.dtype)
        units = self.orders[:, start:start + k]  # (n, k) the unit ids at these positions
        self.kept[torch.arange(self.n, device=self.device)[:, None], units] = grads_tensor
        self._next_position += k

    def _next_epoch_orders(self) -> torch.Tensor:
        if self._epoch_without_steps():
            return self.orders
        return greedy_orders(self.kept)
