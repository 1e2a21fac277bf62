"""SWR: sampling with replacement, the textbook SGD baseline, per worker.

Each epoch every worker visits m of its units drawn independently and uniformly with replacement from its
own m units (some twice or more, about m / e never). Worker j's draws of epoch e (from 0) come from a
generator seeded with (seed, e, j) alone (sorters.flipflop.worker_generator), so no communication, and one
process hosting every worker holds the orders of a torchrun launch; a checkpoint needs only the epoch count.
"""
from typing import Any

import torch

from sorters.flipflop import REPLACEMENT_STREAM, SeededPerWorkerOrders, worker_generator


class SampleWithReplacement(SeededPerWorkerOrders):
    """SWR: each epoch, worker j's m positions hold m i.i.d. uniform draws from its units 0..m-1.

    The one sorter whose rows are not permutations: ``sort()`` returns an (n, m) LongTensor of unit ids in
    0..m-1 with repeats. No gradients, no communication. An epoch whose sort() saw no step() still counts
    (as D-RR's).

    Args:
        n_workers: n, the number of workers.
        m: the units each worker owns and the draws it takes per epoch.
        d: only checked: no gradient is read.
        seed: the seed of every draw.
        device: where the orders live.
        nonfinite: accepted for the common signature; no gradient is read.
    """

    name = "SWR"
    permutes = False  # the rows of its orders repeat units (every other sorter's rows are permutations)

    def _epoch_orders(self, epoch: int) -> torch.Tensor:
        """(n, m) LongTensor on the sorter's device: every worker's draws of epoch `epoch` (from 0)."""
        rows = [torch.randint(self.m, (self.m,),
                              generator=worker_generator(self.seed, epoch, rank, REPLACEMENT_STREAM))
                for rank in range(self.n)]
        return torch.stack(rows).to(self.device)

    def _check_state(self, state: dict[str, Any]) -> None:
        """`Sorter._check_state`, with orders that hold unit ids in 0..m-1 (repeats allowed) instead of
        permutations."""
        orders = state.get("orders") if isinstance(state, dict) else None
        if not (torch.is_tensor(orders) and tuple(orders.shape) == (self.n, self.m) and not orders.is_floating_point()
                and orders.dtype != torch.bool):
            super()._check_state(state)  # its line for a missing or malformed state (orders of another shape too)
            return
        if orders.numel() and not bool(((orders >= 0) & (orders < self.m)).all()):
            raise ValueError(f"{self.name}.load_state_dict: state['orders'] holds values outside 0..{self.m - 1}")
        identity = torch.arange(self.m).expand(self.n, self.m)
        super()._check_state({**state, "orders": identity})  # the rest, with a permutation in the orders' place
