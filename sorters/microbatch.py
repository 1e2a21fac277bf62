"""MB-GraB: CD-GraB's coordinated pair balance over fixed micro-batches, from the micro-batch gradients that
data-parallel training computes anyway (no per-example gradient).

The unit is a micro-batch: b units (examples) of one worker that stay together for the whole run, b the
step's units per worker (the sampler's batch_size, the engine's units per step). Worker j's m units are cut
once, at construction, into m / b micro-batches: its first random order (the seeded one every sorter starts
from), b consecutive positions at a time. Each step is one micro-batch per worker, and its gradient is the
worker's mean gradient of the step: what every data-parallel step already has before it averages the workers.
The n workers' micro-batch gradients are all-gathered (n d floats per step, instead of the n b d of
CD-GraB's per-example gradients) and balanced exactly as CD-GraB balances units (sorters/balance.py): pairs of
consecutive micro-batches, one running sum over all workers, visited (pair, then worker). The next order
moves whole micro-batches; the units inside one keep their order.

What the original's LSTM and M4 code (CD_GraB_SingleGrad) meant to run, with the cached gradient copied
(docs/differences.md, bug 1). With b = 1 it is CD-GraB.
"""
from typing import Any

import numpy as np
import torch

from sorters.balance import CDGraB
from sorters.base import Sorter, array_views
from sorters.checks import NonFiniteGradientError, check_int


class MicroBatchGraB(Sorter):
    """MB-GraB: CD-GraB over fixed micro-batches of ``batch_size`` units per worker.

    ``sort()`` returns (n, m) unit orders, as every sorter: positions t b .. t b + b - 1 hold the b units of
    the micro-batch placed at t. ``step`` takes whole micro-batches and either their gradients, (n, k / b, d),
    or the units' own, (n, k, d), which it averages per micro-batch (the same, for a loss that is a mean).

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch; a multiple of ``batch_size``.
        d: the length of one (micro-batch) gradient (or sketch).
        seed: the seed of the first order, which also fixes the micro-batches' contents.
        device: where the orders and the running sum live.
        dtype: the dtype of the micro-batch gradients (the gradients' dtype).
        batch_size: b, the units of one micro-batch: one step's units per worker. None: 1 (CD-GraB's units).
        sign_loop: CD-GraB's sign loop (`CDGraB`).
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`; a skipped step's micro-batches are balanced as zeros).

    Raises:
        ValueError: a ``batch_size`` below 1 or one that does not divide m (one line), and `CDGraB`'s refusals.
    """

    name = "MB-GraB"
    uses_grads = True
    uses_batch_size = True  # build_sorter passes batch_size, the step's units per worker
    SIGN_LOOPS = CDGraB.SIGN_LOOPS
    # the micro-batches' balancer saves itself, under "micro_batches"
    NOT_IN_STATE = Sorter.NOT_IN_STATE + ("micro_batches",)

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int | None = None, sign_loop: str | None = None,
                 nonfinite: str = "raise") -> None:
        super().__init__(n_workers, m, d, seed, device, nonfinite)
        b = 1 if batch_size is None else check_int(self.name, "batch_size", batch_size, 1)
        if self.m % b:
            raise ValueError(f"{self.name}: a micro-batch of {b} units must divide the {self.m} units of each worker, "
                             "so that every micro-batch is full (CDGraBSampler: pass drop_last=True)")
        self.batch_size, self.dtype = b, dtype
        # (n, m / b, b): worker j's micro-batch i is its units members[j, i], cut from the first random order
        self.members = self.orders.reshape(self.n, self.m // b, b).clone()
        self.micro_batches = CDGraB(self.n, self.m // b, self.d, seed, self.device, dtype, sign_loop)
        self.orders = self._unit_orders(self.micro_batches.orders)

    def _unit_orders(self, micro_batch_orders: torch.Tensor) -> torch.Tensor:
        """(n, m / b) orders of the micro-batches -> (n, m) orders of their units."""
        rows = torch.arange(self.n, device=self.device)[:, None]
        return self.members[rows, micro_batch_orders.to(self.device)].reshape(self.n, self.m)

    def _next_epoch_orders(self) -> torch.Tensor:
        return self._unit_orders(self.micro_batches.sort())

    def step(self, grads: torch.Tensor | None, positions: torch.Tensor | list[int] | range) -> None:
        """Balance the micro-batches at `positions` (`Sorter.step`).

        Args:
            grads: (n, k / b, d) the workers' micro-batch gradients, or (n, k, d) their units' gradients (averaged
                per micro-batch here).
            positions: (k,) the step's epoch positions, whole micro-batches continuing the epoch.

        Raises:
            ValueError: positions that are not whole micro-batches, or gradients of neither shape (one line).
            NonFiniteGradientError: NaN / inf gradients with ``nonfinite="raise"``.
        """
        start, k = self._check_positions(positions)
        b = self.batch_size
        if start % b or k % b:
            raise ValueError(f"{self.name}: a step covers whole micro-batches of {b} units, got positions {start}..."
                             f"{start + k - 1}")
        count = k // b
        shapes = f"(n, k, d) = {(self.n, k, self.d)} or (n, k / b, d) = {(self.n, count, self.d)}"
        if grads is not None and not torch.is_tensor(grads):
            raise TypeError(f"{self.name}: grads must be a tensor of shape {shapes}, got a {type(grads).__name__}")
        if grads is None or tuple(grads.shape) not in ((self.n, k, self.d), (self.n, count, self.d)):
            raise ValueError(f"{self.name}: grads must have shape {shapes} (unit or micro-batch gradients), got "
                             f"{None if grads is None else tuple(grads.shape)}")
        grads = grads.detach().to(device=self.device, dtype=self.dtype)
        if grads.shape[1] != count:  # the units' gradients (screened as every sorter does): their mean per micro-batch
            xp, (grads_xp,) = array_views(grads)
            screened = self._screen_nonfinite(xp, grads_xp, start)
            grads = torch.from_numpy(screened) if xp is np and screened is not grads_xp else \
                grads if screened is grads_xp else screened
            grads = grads.reshape(self.n, count, b, self.d).mean(dim=2)
        else:
            grads = self._screen(grads, start)
        self.micro_batches.step(grads, range(start // b, start // b + count))
        self._next_position += k

    def _screen(self, grads: torch.Tensor, start: int) -> torch.Tensor:
        """`Sorter._screen_nonfinite` for (n, c, d) micro-batch gradients of the step at unit position `start`,
        its line naming unit positions."""
        xp, (grads_xp,) = array_views(grads)
        if xp is not np:  # the device path records the step's first position, the same in units
            return self._screen_nonfinite(xp, grads_xp, start)
        if np.isfinite(grads_xp.sum()) or np.isfinite(grads_xp).all():
            return grads
        if self.nonfinite == "skip":
            self.nonfinite_record[1] += 1
            return torch.zeros_like(grads)
        worker, micro_batch = np.argwhere(~np.isfinite(grads_xp).all(axis=2))[0]
        first = start + micro_batch * self.batch_size
        where = (f"step at positions {start}..{start + grads.shape[1] * self.batch_size - 1} of {self.m} (worker "
                 f"{worker}, the micro-batch at positions {first}..{first + self.batch_size - 1}); lower the learning "
                 "rate or fix the input, or pass nonfinite='skip' to skip such steps")
        what = f"{self.name}: non-finite gradient (nan or inf)"
        raise NonFiniteGradientError(f"{what} in epoch {self.epoch}, {where}", self.epoch, start, f"{what}, {where}")

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """`Sorter.state_dict`, the micro-batches' balancer under ``"micro_batches"``.

        Returns:
            A dict of tensors (copies), numbers and the balancer's state dict.
        """
        state = super().state_dict()
        state["micro_batches"] = self.micro_batches.state_dict()
        return state

    def _check_state(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and state.get("batch_size", self.batch_size) != self.batch_size:
            raise ValueError(f"{self.name}: state is for batch_size={state['batch_size']}, sorter has "
                             f"{self.batch_size}")
        super()._check_state(state)
        owner = f"{self.name}.load_state_dict"
        if not isinstance(state.get("micro_batches"), dict):
            raise ValueError(f"{owner}: not a state saved by {self.name}'s state_dict(): missing micro_batches")
        self.micro_batches._check_state(state["micro_batches"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`Sorter.load_state_dict`, and the micro-batches' balancer's.

        Args:
            state: what ``state_dict()`` returned.
        """
        super().load_state_dict(state)  # checks the whole state, the balancer's included, before changing anything
        self.micro_batches.load_state_dict(state["micro_batches"])
