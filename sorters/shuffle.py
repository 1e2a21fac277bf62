"""Sorters that ignore gradients: D-RR (random reshuffling) and D-SO (shuffle once)."""
import torch

from sorters.base import Sorter


class DistributedRandomReshuffle(Sorter):
    """D-RR: an independent fresh uniform permutation per worker per epoch.

    All n rows come from one seeded generator, so workers get different permutations (bug 2 in docs/differences.md:
    the original seeded every rank alike and all ranks drew the same one), and every process that
    builds this sorter with the same seed holds the same (n, m) orders.

    The constructor takes `Sorter`'s arguments (``d`` is only checked: no gradient is read).
    """

    name = "D-RR"

    def _next_epoch_orders(self) -> torch.Tensor:
        return self.orders if self.epoch == 0 else self._random_orders()


class DistributedShuffleOnce(Sorter):
    """D-SO: one random permutation per worker, drawn once, reused every epoch.

    The constructor takes `Sorter`'s arguments (``d`` is only checked: no gradient is read).
    """

    name = "D-SO"
