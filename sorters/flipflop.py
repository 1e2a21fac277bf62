"""FlipFlop (Rajput, Lee, Papailiopoulos; ICLR 2022), per worker: a fresh random permutation on even epochs,
its exact reverse on odd ones.

Every worker flip-flops its own units. Worker j's permutation of epoch e (counted from 0; e even) is drawn
from a generator seeded with (seed, e, j) alone (`worker_generator`), and epoch e + 1 runs it backwards, so:

- no communication: a worker's order depends on its own rank, never on the number of workers, and one
  process hosting every worker holds the orders of the processes of a torchrun launch;
- no state beyond the epoch count: a checkpoint needs no generator, and a resumed run draws the same
  orders.

Never one global list reversed and re-sharded (a DistributedSampler of a reversed list): worker r would get
worker n - 1 - r's units reversed, and data would move between workers every odd epoch.
"""
import numpy as np
import torch

from sorters.base import Sorter
from sorters.checks import check_seed

# the stream of a rule's draws: the same (seed, epoch, rank) gives other draws in another rule
_FLIPFLOP_STREAM = 1
REPLACEMENT_STREAM = 2


def worker_generator(seed: int, epoch: int, rank: int, stream: int) -> torch.Generator:
    """A CPU generator seeded from (seed, epoch, rank, stream) alone: the draws of one worker in one epoch.

    Args:
        seed: the run's seed (any integer `torch.Generator.manual_seed` takes; taken modulo 2**64).
        epoch: the epoch, counted from 0.
        rank: the worker, 0 .. n - 1.
        stream: which rule draws (1: FlipFlop, 2: SWR).

    Returns:
        A `torch.Generator` seeded with 64 bits of NumPy's SeedSequence of the four integers.
    """
    words = np.random.SeedSequence([seed % 2**64, epoch, rank, stream]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(words[0]))


class SeededPerWorkerOrders(Sorter):
    """A gradient-free sorter whose orders are a function of (seed, epoch, worker) alone (FlipFlop, SWR):
    every process, whatever the number of workers it hosts, holds the same ones. Subclasses give
    `_epoch_orders`; an epoch whose sort() saw no step() still counts (as D-RR's)."""

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 nonfinite: str = "raise") -> None:
        self.seed = check_seed(self.name, seed)
        super().__init__(n_workers, m, d, seed, device, nonfinite)
        self.orders = self._epoch_orders(0)  # what the first sort() returns

    def _epoch_orders(self, epoch: int) -> torch.Tensor:
        """(n, m) LongTensor on the sorter's device: every worker's order of epoch `epoch` (from 0)."""
        raise NotImplementedError

    def _next_epoch_orders(self) -> torch.Tensor:
        return self._epoch_orders(self.epoch)  # self.epoch: the epochs started so far, i.e. this one's index


class FlipFlop(SeededPerWorkerOrders):
    """FlipFlop, per worker: on epoch e (from 0), worker j's order is a fresh uniform permutation drawn from
    (seed, e, j) when e is even, and the reverse of epoch e - 1's when e is odd.

    No gradients and no communication (what D-RR costs). The orders are a function of (seed, epoch, worker),
    so every process, whatever the number of workers it hosts, holds the same ones. An epoch whose sort() saw
    no step() still counts (as D-RR's): the next sort() gives the next epoch's order.

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: only checked: no gradient is read.
        seed: the seed of every draw.
        device: where the orders live.
        nonfinite: accepted for the common signature; no gradient is read.
    """

    name = "FlipFlop"

    def _epoch_orders(self, epoch: int) -> torch.Tensor:
        """(n, m) LongTensor on the sorter's device: every worker's order of epoch `epoch` (from 0)."""
        drawn_in = epoch - epoch % 2  # the even epoch whose permutation this epoch uses
        rows = [torch.randperm(self.m, generator=worker_generator(self.seed, drawn_in, rank, _FLIPFLOP_STREAM))
                for rank in range(self.n)]
        orders = torch.stack(rows)
        return (orders.flip(1) if epoch % 2 else orders).to(self.device)
