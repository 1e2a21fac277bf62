"""RPB: recursive pair balance (G. Wei, "GraB-sampler", arXiv 2309.16809: its `recursive-pair` sorter),
coordinated across workers as CD-GraB coordinates pair balance.

The rule, for blocks of B units (B a power of two): an epoch's positions are cut into blocks of B consecutive
positions. Inside a block, pair balance runs down a binary tree of B - 1 nodes (heap order: node t's
children are 2t + 1 and 2t + 2), each node with its own running sum: the root pairs the block's units
(positions 0,1), (2,3), ..., signs each pair difference (first - second) against its sum, and sends the
pair's winner (the first when <S_t, first - second> <= 0, else the second) to its left child and the loser to
its right child; each child pair-balances the units it received, in the order they came, against its own sum,
and so on down to B leaves of one unit each (leaf slot i = leaf node B - 1 + i). The next order reads the
slots column by column: slot 0 of every block in block order, then slot 1 of every block in reverse block
order, slot 2 forward, slot 3 backwards, ... With B = 2 this is pair balance's placement (winners forward,
losers reversed at the back).

Coordination: as in CD-GraB (sorters/balance.py), node t has ONE running sum for all workers, and its pair
differences are visited pair after pair, worker after worker within a pair. So with B = 2 RPB is exactly
CD-GraB, and with one worker it is GraB-sampler's rule, except for two choices of this suite:

- a node signs its pair differences one after the other, each against the sum the earlier ones updated (the
  online rule of GraB), where GraB-sampler's vectorised code signs a node's pairs of one batch against one
  snapshot of its sum;
- ties go to the first unit (<S, v> <= 0, CD-GraB's rule; GraB-sampler's test is strict), and the sums are
  float64.

The block is the sorter's own (default 16), not the training step: GraB-sampler's block is its loader's
batch, which must divide the data set; here any m works, the last block holding the m % B units left: at a
node with an odd count the unpaired last unit goes to the left child after the winners (so with B = 2 it
takes the middle slot, as in CD-GraB), and the leaves without a unit are skipped when the order is read.
The sums are reset at every epoch's start. Memory: (B - 1) d float64 sums and one block of gradients.
"""
import math
from types import ModuleType
from typing import Any

import numpy as np
import torch

from sorters.balance import _MINUS_PLUS_ONE, _pair_signs_cpu, signs_by_gram
from sorters.base import HostOrDeviceArray, Sorter, array_views
from sorters.checks import check_int


class RecursivePairBalance(Sorter):
    """RPB: recursive pair balance in blocks of ``block`` units, one running sum per tree node for all workers.

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch (any m: the last block may be partial).
        d: the length of one unit's gradient (or sketch).
        seed: the seed of the first epoch's orders.
        device: where the orders, the node sums and the kept block live (the CPU signs with CD-GraB's
            compiled loop, other devices with its Gram recursion).
        dtype: the dtype of the kept block's gradients (the gradients' dtype).
        block: B, the units of a block: a power of two >= 2.
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`).

    Raises:
        ValueError: a block that is not a power of two >= 2 (one line), and `Sorter`'s refusals.
    """

    name = "RPB"
    uses_grads = True
    DEFAULT_BLOCK = 16

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, block: int = DEFAULT_BLOCK, nonfinite: str = "raise") -> None:
        super().__init__(n_workers, m, d, seed, device, nonfinite)
        block = check_int(self.name, "block", block)
        if block < 2 or block & (block - 1):
            raise ValueError(f"{self.name}: block must be a power of two >= 2 (2, 4, 8, 16, ...), got {block}")
        self.block, self.dtype = block, dtype
        self.blocks = math.ceil(self.m / block)
        # (n, B, d): the gradients of the block in progress, its first units' while a step ends inside it
        self.block_grads = torch.zeros(self.n, block, self.d, dtype=dtype, device=self.device)
        self._reset_epoch_state()

    def _reset_epoch_state(self) -> None:
        self.node_sums = torch.zeros(self.block - 1, self.d, dtype=torch.float64, device=self.device)
        # (n, blocks, B): the unit that reached each leaf slot of each block this epoch; -1: none (yet)
        self.slots = torch.full((self.n, self.blocks, self.block), -1, dtype=torch.long, device=self.device)

    def step(self, grads: torch.Tensor | None, positions: torch.Tensor | list[int] | range) -> None:
        """Balance every block the step completes (`Sorter.step`); a block's first units wait for the rest.

        Args:
            grads: (n, k, d), ``grads[j, i]`` worker j's gradient of the unit at epoch position ``positions[i]``.
            positions: (k,) the step's epoch positions, continuing the epoch.
        """
        start, k, grads_tensor = self._screened_step(grads, positions, self.dtype)
        done = 0
        while done < k:
            position = start + done
            block, offset = divmod(position, self.block)
            size = min(self.block, self.m - block * self.block)  # the last block may be partial
            take = min(k - done, size - offset)
            part = grads_tensor[:, done:done + take]
            if offset == 0 and take == size:  # a whole block in this step: no copy into the kept one
                self._balance_block(block, part)
            else:
                self.block_grads[:, offset:offset + take] = part
                if offset + take == size:
                    self._balance_block(block, self.block_grads[:, :size])
            done += take
        self._next_position += k

    def _balance_block(self, block: int, units: torch.Tensor) -> None:
        """Route the (n, size, d) gradients of block `block`'s units down the tree into its leaf slots."""
        first = block * self.block
        ids = self.orders[:, first:first + units.shape[1]]  # (n, size) the units at the block's positions
        xp, (units_xp, ids_xp, slots) = array_views(units, ids, self.slots)
        if xp is np:
            units_xp = np.ascontiguousarray(units_xp)  # the compiled loop reads contiguous rows
        self._route(xp, units_xp, ids_xp, slots[:, block], 0, 0, self.block)

    def _route(self, xp: ModuleType, units: HostOrDeviceArray, ids: HostOrDeviceArray, slots: HostOrDeviceArray,
               node: int, low: int, high: int) -> None:
        """Pair-balance the (n, s, d) `units` (ids (n, s)) at tree node `node`, whose leaf slots are low..high-1
        of `slots` (n, B), and recurse into its children; s <= high - low."""
        count = units.shape[1]
        if count == 0:
            return
        if count == 1:  # a leaf's unit, or an unpaired one: it goes left all the way down
            slots[:, low] = ids[:, 0]
            return
        pairs = count // 2
        firsts, seconds = units[:, 0:2 * pairs:2], units[:, 1:2 * pairs:2]
        first_left = self._pair_signs(xp, units, node, pairs)  # (n, pairs) bool, True: the first unit wins
        left_units = xp.where(first_left[:, :, None], firsts, seconds)
        right_units = xp.where(first_left[:, :, None], seconds, firsts)
        left_ids = xp.where(first_left, ids[:, 0:2 * pairs:2], ids[:, 1:2 * pairs:2])
        right_ids = xp.where(first_left, ids[:, 1:2 * pairs:2], ids[:, 0:2 * pairs:2])
        if count % 2:  # the unpaired last unit follows the winners
            join = np.concatenate if xp is np else torch.cat
            left_units, left_ids = join((left_units, units[:, -1:]), 1), join((left_ids, ids[:, -1:]), 1)
        middle = (low + high) // 2
        self._route(xp, left_units, left_ids, slots, 2 * node + 1, low, middle)
        self._route(xp, right_units, right_ids, slots, 2 * node + 2, middle, high)

    def _pair_signs(self, xp: ModuleType, units: HostOrDeviceArray, node: int, pairs: int) -> HostOrDeviceArray:
        """(n, pairs) bool: the signs of the pairs (0,1), (2,3), ... of `units` (n, s, d), visited pair after pair,
        worker after worker, against node `node`'s running sum, which they update."""
        if xp is np:
            plus = np.empty((pairs, self.n), dtype=np.bool_)
            running_sum = self.node_sums.numpy()[node]  # shares memory: the loop updates it in place
            _pair_signs_cpu()(running_sum, units, 0, units, 1, plus, _MINUS_PLUS_ONE)
            return plus.T
        diffs = (units[:, 0:2 * pairs:2] - units[:, 1:2 * pairs:2]).transpose(0, 1).reshape(-1, self.d)
        return signs_by_gram(self.node_sums[node], diffs).reshape(pairs, self.n).T

    def _next_epoch_orders(self) -> torch.Tensor:
        if self._epoch_without_steps():
            return self.orders
        return _read_slots(self.slots)

    def sort(self) -> torch.Tensor:
        orders = super().sort()
        self._reset_epoch_state()
        return orders

    # ------------------------------------------------------------------ checkpoints

    def _check_state(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and state.get("block", self.block) != self.block:
            raise ValueError(f"{self.name}: state is for block={state['block']}, sorter has {self.block}")
        super()._check_state(state)
        slots = state["slots"]
        if not bool(((slots >= -1) & (slots < self.m)).all()):
            raise ValueError(f"{self.name}.load_state_dict: state['slots'] holds values outside -1..{self.m - 1}")


def _read_slots(slots: torch.Tensor) -> torch.Tensor:
    """The next order from the leaf slots: slot 0 of every block in block order, slot 1 in reverse block order,
    slot 2 forward, ...; empty slots (-1, in a partial last block) skipped.

    Args:
        slots: (n, blocks, B) LongTensor, the unit at each leaf slot of each block (-1: none), the same empty
            slots for every worker.

    Returns:
        (n, m) LongTensor, m the filled slots per worker.
    """
    n, blocks, width = slots.shape
    columns = slots.transpose(1, 2)  # (n, B, blocks)
    alternating = torch.where(torch.arange(width, device=slots.device)[:, None] % 2 == 1, columns.flip(2), columns)
    flat = alternating.reshape(n, width * blocks)
    return flat[:, flat[0] >= 0]

