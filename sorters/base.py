"""The sorter interface and the bookkeeping every balancing sorter shares.

Notation (the authors' code, not the paper): `n` workers, each owning `m` local ordering units
(examples, bptt chunks, windows, token blocks), `d` model parameters. An epoch visits positions
0..m-1; at position t worker j uses its local unit `orders[j, t]`.
"""
import warnings
from types import ModuleType
from typing import Any, TypeAlias

import numpy as np
import torch

from sorters._state_format import FORMAT_KEY, SORTER_STATE_FORMAT, saved_format
from sorters.checks import (
    NONFINITE_MODES,
    NonFiniteGradientError,
    check_choice,
    check_device,
    check_int,
    check_seed,
    check_state_keys,
)

# An array of a step's bookkeeping: a NumPy array sharing a CPU tensor's memory (array_views), a tensor elsewhere.
# The code that handles it is written once against both, calling the module `xp` (numpy or torch) that came with
# it; no static type follows that switch, so to the type checker such an array is Any.
HostOrDeviceArray: TypeAlias = Any


class Sorter:
    """Produces each worker's order of its m local units, one epoch at a time.

    Usage per epoch::

        orders = sorter.sort()                # (n, m) LongTensor, row j a permutation of range(m)
        for positions in consecutive chunks:  # LongTensor (k,), e.g. tensor([t, t+1, ..., t+k-1])
            sorter.step(grads, positions)     # grads: (n, k, d), worker j's gradient of the unit at
                                              # epoch position positions[i] is grads[j, i]

    `step` must see every position 0..m-1 exactly once per epoch, in increasing order (the last
    chunk may be shorter). Sorters whose `uses_grads` is False ignore `grads` (pass None).

    Args:
        n_workers: n, the number of workers (replicas) whose orders the sorter makes.
        m: the units (examples) each worker visits per epoch.
        d: the length of one unit's gradient (or of its sketch).
        seed: the seed of every random draw; the same seed gives the same orders in every process.
        device: where the orders and the sorter's sums live (the gradients' device).
        nonfinite: what ``step`` does with NaN / inf gradients: ``"raise"`` (`NonFiniteGradientError`) or
            ``"skip"`` (the step's units are balanced as zero vectors and counted in ``skipped_steps``).

    Raises:
        ValueError: a size below 1, an unknown ``nonfinite`` or device (one line).
        TypeError: a size or seed that is not an integer.
    """

    name = "base"
    uses_grads = False
    uses_total_epochs = False  # True: the constructor takes epochs=, the run's total (KH-SGD, SBW)
    # Set True by a caller that keeps the grads of every step() call unchanged until its next step()
    # call has returned (the training engine rotates its gradient buffers so that they stay); pair
    # balancers then keep a reference to a step's unpaired last unit instead of copying it.
    grads_stay_valid = False

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 nonfinite: str = "raise") -> None:
        self.n, self.m, self.d = (check_int(self.name, name, value)
                                  for name, value in (("n_workers", n_workers), ("m", m), ("d", d)))
        if self.n < 1 or self.m < 1 or self.d < 1:
            raise ValueError(f"{self.name}: need n_workers, m, d >= 1, got {n_workers}, {m}, {d}")
        self.device = check_device(self.name, device)
        self.generator = torch.Generator().manual_seed(check_seed(self.name, seed))
        # what step() does with NaN / inf gradients: "raise" (NonFiniteGradientError) or "skip" (balance the
        # step's units as zero vectors and count it); see _screen_nonfinite
        self.nonfinite = check_choice(self.name, "nonfinite", nonfinite, NONFINITE_MODES)
        # (2,) int64 on the sorter's device: [first epoch position of a non-finite step seen on the device path
        # this epoch, or -1; steps skipped in the run]. On the device it is updated without a host read.
        self.nonfinite_record = torch.tensor([-1, 0], dtype=torch.long, device=self.device)
        self.orders = self._random_orders()
        self.epoch = 0
        self._next_position = 0

    def _random_orders(self) -> torch.Tensor:
        """(n, m) independent uniform permutations, one per worker, from the sorter's generator."""
        rows = [torch.randperm(self.m, generator=self.generator) for _ in range(self.n)]
        return torch.stack(rows).to(self.device)

    def sort(self) -> torch.Tensor:
        """Start an epoch.

        Returns:
            The (n, m) LongTensor of this epoch's orders (a copy): row j, a permutation of range(m), is worker
            j's order of its units.

        Raises:
            ValueError: the previous epoch ended before ``step`` saw all m positions.
            NonFiniteGradientError: off the CPU, a step of the previous epoch held NaN / inf gradients.
        """
        self._raise_deferred_nonfinite()
        if self._next_position not in (0, self.m):
            raise ValueError(f"{self.name}: the epoch ended after {self._next_position} of {self.m} "
                             "positions; step() must see every position once per epoch")
        self.orders = self._next_epoch_orders()
        self.epoch += 1
        self._next_position = 0
        return self.orders.clone()

    def _next_epoch_orders(self) -> torch.Tensor:
        return self.orders

    def step(self, grads: torch.Tensor | None, positions: torch.Tensor | list[int] | range) -> None:
        """Record the gradients of the units just used.

        Args:
            grads: (n, k, d), ``grads[j, i]`` worker j's gradient of the unit at epoch position
                ``positions[i]``; None for the sorters that do not use gradients (``uses_grads`` False).
            positions: (k,) the epoch positions of the step, consecutive and continuing the epoch (a LongTensor,
                a list or a range).

        Raises:
            ValueError: positions that do not continue the epoch, or grads of another shape.
            NonFiniteGradientError: NaN / inf gradients with ``nonfinite="raise"`` (on the CPU here, elsewhere
                at the next ``sort``).
        """
        self._next_position += self._check_positions(positions)[1]

    def _check_positions(self, positions: torch.Tensor | list[int] | range) -> tuple[int, int]:
        """Check that `positions` (a LongTensor / list (k,), or a range) continue the epoch; return
        (first position, k). The caller advances `_next_position` once the whole step is valid."""
        index = None  # the positions as a (k,) CPU LongTensor, unless a range of step 1 spared making it
        if isinstance(positions, range) and positions.step == 1:  # the engine's form: no tensor work
            start, k, consecutive = positions.start, len(positions), True
        else:
            index = torch.as_tensor(positions, dtype=torch.long).cpu().reshape(-1)
            k = index.numel()
            start = int(index[0]) if k else self._next_position
            consecutive = torch.equal(index, torch.arange(start, start + k))
        if k == 0 or not consecutive or start != self._next_position or start + k > self.m:
            shown = list(positions)[:8] if index is None else index.tolist()[:8]
            raise ValueError(f"{self.name}: expected positions {self._next_position}..."
                             f"{min(self._next_position + max(k, 1), self.m) - 1} of {self.m}, got {shown}")
        return start, k

    def _epoch_without_steps(self) -> bool:
        """True when this epoch got no step(), so the next epoch keeps its order (the very first sort()); warns
        when an epoch was started and got no gradient at all (a loop that forgot step(): a fixed order)."""
        if self._next_position != 0:
            return False
        if self.epoch > 0:
            warnings.warn(f"{self.name}: sort() after an epoch without any step(), so the next epoch repeats "
                          f"this one's order (a fixed order, not {self.name}): call step(grads, positions) for "
                          "every batch of an epoch", UserWarning, stacklevel=4)
        return True

    def _screened_step(self, grads: object, positions: torch.Tensor | list[int] | range,
                       dtype: torch.dtype) -> tuple[int, int, torch.Tensor]:
        """A step's checks for sorters that keep its gradients as one tensor: (first position, k, the (n, k, d)
        gradients detached on the sorter's device in `dtype`), a non-finite step screened (`_screen_nonfinite`:
        zeros in its place for nonfinite="skip"). The caller advances `_next_position`."""
        start, k = self._check_positions(positions)
        grads_tensor = self._check_grads(grads, k).detach().to(device=self.device, dtype=dtype)
        xp, (grads_xp,) = array_views(grads_tensor)
        screened = self._screen_nonfinite(xp, grads_xp, start)
        if screened is not grads_xp:
            grads_tensor = torch.from_numpy(screened) if xp is np else screened
        return start, k, grads_tensor

    def _check_grads(self, grads: object, k: int) -> torch.Tensor:
        """`grads` as the (n, k, d) tensor of a step of k units, else one line (TypeError, ValueError)."""
        if grads is not None and not torch.is_tensor(grads):
            raise TypeError(f"{self.name}: grads must be a tensor of shape (n, k, d) = {(self.n, k, self.d)}, "
                            f"got a {type(grads).__name__}")
        if grads is None or tuple(grads.shape) != (self.n, k, self.d):
            shape = None if grads is None else tuple(grads.shape)
            raise ValueError(f"{self.name}: grads must have shape (n, k, d) = {(self.n, k, self.d)}, got {shape}")
        return grads

    # ------------------------------------------------------------------ non-finite gradients

    def _screen_nonfinite(self, xp: ModuleType, grads: HostOrDeviceArray, start: int) -> HostOrDeviceArray:
        """grads (n, k, d) of the step at epoch positions start.. (a NumPy array when xp is numpy, else a
        tensor), or, for nonfinite="skip" and a step holding NaN / inf, zeros in their place (its units are
        balanced as zero vectors). With NumPy (the CPU) the check is eager: nonfinite="raise" raises here,
        naming the step. On the device path it adds no host read: it records the step on the device and
        sort() raises at the epoch's end (or, "skip", replaces the step by zeros with torch.where)."""
        if xp is np:
            # one summing pass (no temporary): NaN and inf propagate into the sum; a finite sum that overflows
            # (entries near float32's max) is told apart by the exact, slower test
            if np.isfinite(grads.sum()) or np.isfinite(grads).all():
                return grads
            if self.nonfinite == "raise":
                worker, unit = np.argwhere(~np.isfinite(grads).all(axis=2))[0]
                where = (f"step at positions {start}..{start + grads.shape[1] - 1} of {self.m} (worker {worker}, "
                         f"position {start + unit}); lower the learning rate or fix the input, or pass "
                         "nonfinite='skip' to skip such steps")
                what = f"{self.name}: non-finite gradient (nan or inf)"
                raise NonFiniteGradientError(f"{what} in epoch {self.epoch}, {where}", self.epoch, start,
                                             f"{what}, {where}")
            self.nonfinite_record[1] += 1
            return np.zeros_like(grads)
        bad = ~torch.isfinite(grads).all()
        record = self.nonfinite_record
        if self.nonfinite == "raise":
            record[:1] = torch.where(bad & (record[:1] < 0), start, record[:1])
            return grads
        record[1:] += bad
        return torch.where(bad, grads.new_zeros(()), grads)

    def _raise_deferred_nonfinite(self) -> None:
        """Raise for a non-finite step that the device path recorded this epoch (one host read per epoch)."""
        if self.nonfinite_record.device.type == "meta":  # shapes only, no values to read
            return
        at = int(self.nonfinite_record[0])
        if at >= 0:
            where = (f"step at position {at} of {self.m} (on {self.device} the check runs at the epoch's end); lower "
                     "the learning rate or fix the input, or pass nonfinite='skip' to skip such steps")
            what = f"{self.name}: non-finite gradient (nan or inf)"
            raise NonFiniteGradientError(f"{what} in epoch {self.epoch}, {where}", self.epoch, at, f"{what}, {where}")

    @property
    def skipped_steps(self) -> int:
        """Steps whose NaN / inf gradients were balanced as zeros (``nonfinite="skip"``), over the whole run
        (kept in ``state_dict``). On a GPU, reading it waits for the device."""
        return int(self.nonfinite_record[1])

    # ------------------------------------------------------------------ checkpoints

    NOT_IN_STATE: tuple[str, ...] = ("generator", "device", "_pending_storage", "grads_stay_valid", "nonfinite")
    # keys that states saved by earlier versions lack: load_state_dict keeps the fresh sorter's value
    OPTIONAL_STATE: tuple[str, ...] = ("nonfinite_record",)

    def _state_items(self) -> dict[str, Any]:
        """The attributes a checkpoint holds (every one but NOT_IN_STATE), by name."""
        return {k: v for k, v in vars(self).items() if k not in self.NOT_IN_STATE}

    def state_dict(self) -> dict[str, Any]:
        """The sorter's whole state, for a checkpoint.

        Returns:
            A dict of tensors (copies) and numbers, with its format version; ``load_state_dict`` of a sorter of
            the same kind and size continues from it with the same orders.
        """
        state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self._state_items().items()}
        state["generator"] = self.generator.get_state()
        state[FORMAT_KEY] = SORTER_STATE_FORMAT  # sorters/_state_format.py
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` of a sorter of the same kind and size.

        Args:
            state: what ``state_dict()`` returned (tensors on any device).

        Raises:
            ValueError: a state that is not one (missing keys, a tensor of another shape, a position outside the
                epoch, orders that are not permutations, another format), refused with one line before anything
                changes.
        """
        self._check_state(state)
        known = self._state_items().keys() | {"generator"}
        for key, value in state.items():
            if key not in known:
                continue  # a key of another version: nothing here reads it
            if key == "generator":
                self.generator.set_state(value)
            else:  # copies: the steps update these in place, and must not write into the caller's state
                setattr(self, key, value.to(self.device, copy=True) if torch.is_tensor(value) else value)

    # (minimum, maximum) of the integers of a state; the others only need to be integers
    def _int_bounds(self) -> dict[str, tuple[int | None, int | None]]:
        return {"epoch": (0, None), "_next_position": (0, self.m), "left": (0, self.m),
                "right": (-1, self.m - 1), "pending_position": (-1, self.m - 1)}

    def _check_state(self, state: dict[str, Any]) -> None:
        """One clear line for a state this sorter cannot continue from."""
        owner = f"{self.name}.load_state_dict"
        now = self._state_items()
        # format 0 (no format key, saved before the formats were recorded) holds format 1's keys: it loads as is
        saved_format(owner, state, SORTER_STATE_FORMAT)
        check_state_keys(owner, state, [k for k in [*now, "generator"] if k not in self.OPTIONAL_STATE],
                         f"{self.name}'s state_dict()")
        for key in ("n", "m", "d"):
            if check_int(owner, f"state[{key!r}]", state[key]) != getattr(self, key):
                raise ValueError(f"{self.name}: state is for {key}={state[key]}, sorter has {getattr(self, key)}")
        bounds = self._int_bounds()
        for key, ref in now.items():
            if key not in state:
                continue
            value, where = state[key], f"state[{key!r}]"
            if isinstance(ref, int) and not isinstance(ref, bool):
                check_int(owner, where, value, *bounds.get(key, (None, None)))
            elif torch.is_tensor(ref) or key == "pending":
                if key == "pending" and value is None:  # no unpaired unit waiting
                    continue
                shape = (self.n, self.d) if key == "pending" else tuple(ref.shape)
                kind = True if key == "pending" else ref.is_floating_point()
                if not torch.is_tensor(value) or tuple(value.shape) != shape or value.is_floating_point() != kind:
                    got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if torch.is_tensor(value)
                           else repr(value)[:40])
                    raise ValueError(f"{owner}: {where} must be a {'float' if kind else 'integer'} tensor of shape "
                                     f"{shape}, got {got}")
        if not torch.is_tensor(state["generator"]) or state["generator"].dtype != torch.uint8:
            raise ValueError(f"{owner}: state['generator'] must be a torch.Generator state (a uint8 tensor)")
        orders = state["orders"].cpu()
        if not torch.equal(orders.sort(dim=1).values, torch.arange(self.m).expand(self.n, self.m)):
            raise ValueError(f"{owner}: state['orders'] rows must be permutations of 0..{self.m - 1}")
        if "next_orders" in state and not bool(((state["next_orders"] >= -1) & (state["next_orders"] < self.m)).all()):
            raise ValueError(f"{owner}: state['next_orders'] holds values outside -1..{self.m - 1}")


class OnlineBalancer(Sorter):
    """Shared state of the GraB-family sorters: the next epoch's order is built during this epoch.

    A unit whose sign is +1 is written at the left end of `next_orders` (pointer L moving right),
    one with sign -1 at the right end (pointer R moving left), so negatives appear reversed.
    Units are stored as local unit ids (`orders[j, t]`), so orders compose across epochs.
    """

    uses_grads = True

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, nonfinite: str = "raise") -> None:
        super().__init__(n_workers, m, d, seed, device, nonfinite)
        self.dtype = dtype
        self._reset_epoch_state()

    def _reset_epoch_state(self) -> None:
        self.next_orders = torch.full((self.n, self.m), -1, dtype=torch.long, device=self.device)

    def _next_epoch_orders(self) -> torch.Tensor:
        if self._epoch_without_steps():
            return self.orders
        assert bool((self.next_orders >= 0).all()), "balancer left a slot of next_orders empty"
        return self.next_orders

    def sort(self) -> torch.Tensor:
        orders = super().sort()
        self._reset_epoch_state()
        return orders


class PairBalancer(OnlineBalancer):
    """Pair balance: units at positions (0,1), (2,3), ... form pairs; the sign of the pair
    difference (first - second) decides which of the two goes left and which goes right.

    Pairs are formed inside a step when k is even, and across consecutive steps otherwise
    (the first unit's gradient is cached as a copy). With m odd, the last unit has no partner and
    takes the one slot left in the middle. Subclasses decide the signs (`_pair_signs`).
    """

    def _reset_epoch_state(self) -> None:
        super()._reset_epoch_state()
        self.left, self.right = 0, self.m - 1
        self.pending: torch.Tensor | None = None  # (n, d) copy of an unpaired first unit's gradients
        self.pending_position = -1
        self._reset_running_sums()

    def _reset_running_sums(self) -> None:
        raise NotImplementedError

    def _pair_signs(self, xp: ModuleType, first_units: HostOrDeviceArray, first_index: int,
                    second_units: HostOrDeviceArray, second_index: int, n_pairs: int) -> HostOrDeviceArray:
        """Signs of n_pairs consecutive pairs: pair p of worker j is (first_units[j, first_index + 2p],
        second_units[j, second_index + 2p]); the unit arrays are (n, k', d), C-contiguous NumPy arrays
        when xp is numpy, else tensors. Return (n, P) bool of the same kind, True = first goes left."""
        raise NotImplementedError

    def step(self, grads: torch.Tensor | None, positions: torch.Tensor | list[int] | range) -> None:
        start, k = self._check_positions(positions)
        grads_tensor = self._check_grads(grads, k).detach()  # the sorter never differentiates
        if grads_tensor.device != self.device or grads_tensor.dtype != self.dtype:
            grads_tensor = grads_tensor.to(device=self.device, dtype=self.dtype)
        # the step's grads as xp's array: NumPy on the CPU (a tenth of torch's per-op overhead here), else the tensor
        xp, (grads_xp,) = array_views(grads_tensor)
        screened = self._screen_nonfinite(xp, grads_xp, start)
        if xp is np and (screened is not grads_xp or not grads_xp.flags.c_contiguous):
            grads_xp = np.ascontiguousarray(screened)  # compiled loops assume rows of contiguous units
            grads_tensor = torch.from_numpy(grads_xp)
        elif screened is not grads_xp:  # the device path's "skip": zeros where the step was not finite
            grads_xp = grads_tensor = screened
        self._next_position += k
        paired_from = 0
        if self.pending is not None:  # the pair that began in the previous step
            pending = array_views(self.pending)[1][0]
            if xp is np and not pending.flags.c_contiguous:  # a kept (n, d) row slice of an (n, k, d) step
                pending = np.ascontiguousarray(pending)
            self._balance_pairs(xp, pending[:, None], 0, grads_xp, 0, 1, self.pending_position)
            self.pending, paired_from = None, 1
        n_pairs = (k - paired_from) // 2
        if n_pairs:
            self._balance_pairs(xp, grads_xp, paired_from, grads_xp, paired_from + 1, n_pairs, start + paired_from)
        if (k - paired_from) % 2:  # an unpaired last unit: its partner comes with the next step
            # a copy, unless the caller promised to keep this step's grads (grads_stay_valid); never a
            # view of a buffer that the next step overwrites (the original's bug: it cached a reference
            # to a gather buffer that the next step refilled, so every pair difference was 0)
            if self.grads_stay_valid:
                self.pending = grads_tensor[:, k - 1]
            else:
                self.pending = self._pending_buffer(grads_xp.shape[0], grads_xp.shape[2])
                if xp is np:
                    np.copyto(self.pending.numpy(), grads_xp[:, k - 1])
                else:
                    self.pending.copy_(grads_xp[:, k - 1])
            self.pending_position = start + k - 1
        if self._next_position == self.m:
            self._place_deferred_pairs()
        if self._next_position == self.m and self.pending is not None:
            assert self.left == self.right
            self.next_orders[:, self.left] = self.orders[:, self.pending_position]
            self.pending, self.left, self.right = None, self.left + 1, self.right - 1

    def _balance_pairs(self, xp: ModuleType, first_units: HostOrDeviceArray, first_index: int,
                       second_units: HostOrDeviceArray, second_index: int, n_pairs: int, first_position: int) -> None:
        """Decide the signs of n_pairs pairs (as `_pair_signs`) whose first pair starts at epoch position
        first_position, and place them. A subclass may defer both (`_place_deferred_pairs`)."""
        self._place_pairs(xp, self._pair_signs(xp, first_units, first_index, second_units, second_index, n_pairs),
                          first_position)

    def _place_deferred_pairs(self) -> None:
        """Decide and place the pairs a subclass deferred (at the epoch's last step, before a state is saved)."""

    def state_dict(self) -> dict[str, Any]:
        self._place_deferred_pairs()  # a state holds no deferred pairs: they are decided now
        return super().state_dict()

    def _pending_buffer(self, n: int, d: int) -> torch.Tensor:
        """One (n, d) tensor reused for every cached first unit: a fresh one per pair costs page faults
        (and for GPT-2 a 1.75 GB allocation) every other step."""
        buffer = getattr(self, "_pending_storage", None)
        if buffer is None or buffer.shape != (n, d):
            buffer = self._pending_storage = torch.empty(n, d, dtype=self.dtype, device=self.device)
        return buffer

    def _place_pairs(self, xp: ModuleType, first_left: HostOrDeviceArray, first: int) -> None:
        """first_left: (n, P) bool (a NumPy array when xp is numpy, else a tensor) for the pairs at
        epoch positions (first, first + 1), (first + 2, first + 3), ... Pair i takes slot left + i on
        the left and right - i on the right."""
        n_pairs = first_left.shape[1]
        orders, next_orders = (self.orders.numpy(), self.next_orders.numpy()) if xp is np else \
            (self.orders, self.next_orders)
        firsts = orders[:, first:first + 2 * n_pairs:2]
        seconds = orders[:, first + 1:first + 2 * n_pairs:2]
        left, right = self.left, self.right
        next_orders[:, left:left + n_pairs] = xp.where(first_left, firsts, seconds)
        to_right = xp.where(first_left, seconds, firsts)
        next_orders[:, right - n_pairs + 1:right + 1] = to_right[:, ::-1] if xp is np else to_right.flip(1)
        self.left, self.right = left + n_pairs, right - n_pairs


def pair_views(first_units: HostOrDeviceArray, first_index: int, second_units: HostOrDeviceArray, second_index: int,
               n_pairs: int) -> tuple[HostOrDeviceArray, HostOrDeviceArray]:
    """(firsts, seconds), each (n, n_pairs, d): the pairs that _pair_signs describes, as views."""
    return (first_units[:, first_index:first_index + 2 * n_pairs:2],
            second_units[:, second_index:second_index + 2 * n_pairs:2])


def array_views(*tensors: torch.Tensor | np.ndarray) -> tuple[ModuleType, list[HostOrDeviceArray]]:
    """(numpy, NumPy arrays sharing memory) on the CPU, where per-op overhead is ~10x lower than
    torch's for these small per-step updates; (torch, the tensors) elsewhere. The bookkeeping is
    written once against either. NumPy arrays pass through."""
    if all(isinstance(t, np.ndarray) or t.device.type == "cpu" for t in tensors):
        return np, [t if isinstance(t, np.ndarray) else (t.detach() if t.requires_grad else t).numpy()
                    for t in tensors]
    return torch, list(tensors)

