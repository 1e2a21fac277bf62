"""Fold: an ablation that replays the order the original's degenerate CD-GraB produced (bug 1 in docs/differences.md).

The authors' `CD_GraB_SingleGrad` (LSTM-Wiki2 and MLP-M4) cached a *reference* to the all-gather
buffer that the next step overwrote, so every pair difference it balanced was `buffer - buffer = 0`.
Every test was then <s, 0> = 0 <= 0 -> +1 and s stayed 0: the first unit of pair i went to the
left slot i, the second to the right slot m-1-i. The next order was therefore a fixed map of the
current one, applied every epoch, that used no gradient at all:

    [o0, o1, ..., o(m-1)]  ->  [o0, o2, o4, ..., o(m-2), o(m-1), ..., o5, o3, o1]    (m even)

Position 0 is a fixed point (each worker's first unit of epoch 1 comes first in every epoch). The
map's period depends on m; at the full-size settings it is 420 epochs (LSTM-Wiki2, m = 3,728) and
792 epochs (MLP-M4, m = 3,354), so no order repeats within a 50-epoch run there.

`Fold` applies exactly this map, so a run with `--sorter Fold` reproduces what the paper's LSTM and
M4 "CD-GraB" curves may have measured; comparing it with our (really balancing) CD-GraB and with
D-RR tells whether those curves came from balancing or from this fixed fold.
"""
import torch

from sorters.base import Sorter


def fold_map(m: int) -> torch.Tensor:
    """(m,) LongTensor of epoch positions: the even ones ascending, then the odd ones descending.
    The next order is `orders[:, fold_map(m)]`.

    m = 6: [0, 2, 4, 5, 3, 1];  m = 7: [0, 2, 4, 6, 5, 3, 1].
    With m odd the last unit (position m-1, even) ends the ascending run, i.e. it lands in the middle
    slot (m-1)/2: exactly where our PairBalancer puts the unpaired last unit. So this is what our
    CD-GraB returns whenever every pair difference is zero, for any m (the original required m even).
    """
    return torch.cat([torch.arange(0, m, 2), torch.arange(1, m, 2).flip(0)])


class Fold(Sorter):
    """Fold (ablation of the original's bug 1): each worker's next order is `fold_map(m)` applied to its
    current order, every epoch; no gradients, no communication (costs what D-RR costs).

    Starts, like every sorter, from the seeded random permutation per worker (`_random_orders`, the
    same first order as CD-GraB with the same seed; the original's `CD_GraB_SingleGrad` also started
    from randperm). Like CD-GraB, the first sort() returns that order, and an epoch without any step
    keeps the order; every later sort() after a full epoch applies the map. With these rules Fold's
    orders equal our CD-GraB's, epoch by epoch, when every pair difference CD-GraB sees is zero.

    The constructor takes `Sorter`'s arguments (``d`` is only checked: no gradient is read).
    """

    name = "Fold"

    def _next_epoch_orders(self) -> torch.Tensor:
        if self._next_position == 0:  # no step this epoch (e.g. the very first sort): keep the order
            return self.orders
        return self.orders[:, fold_map(self.m).to(self.orders.device)]
