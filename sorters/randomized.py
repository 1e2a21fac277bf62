"""KH-SGD and SBW: CD-GraB's coordinated pair balance with a randomised add/subtract rule.

Both come from "Low-Rank Thinning" (Carrell, Gong, Shetty, Dwivedi, Mackey; ICML 2025), whose code
runs them with one worker only. Here they are coordinated exactly like CD-GraB (sorters/balance.py):
the same pairs, the same (pair, worker) visiting order, ONE float64 running sum S over all workers,
reset at every epoch start, the same placement (add: the pair's first unit to the next free left slot,
its second to the next free right slot, S += v; subtract: swapped, S -= v), the same handling of odd m
(the unpaired last unit takes the middle slot) and odd k (pairs across steps). With one worker each is
the published algorithm. Only the rule differs; for a pair difference v, dot = <S, v>, b2 = ||v||^2:

- CD-GraB: add iff dot <= 0.
- KH-SGD (kernel halving): add iff dot <= U_i t_i, U_i uniform in [-1, 1], t_i from a running
  sub-Gaussian constant v (see KernelHalving).
- SBW (self-balancing walk, Alweiss, Liu & Sawhney 2021): add iff dot <= c (1 - 2u), u uniform in
  [0, 1), i.e. P(add) = 1/2 - dot / (2c) clipped to [0, 1] (see SelfBalancingWalk for c).

Sign convention: the code differences are first - second and S the sum of signed ones; the paper's are
second - first with the opposite sum, which gives the same dot, b2 and decisions.

Randomness: the draws of epoch e (one per pair difference, P = n * floor(m / 2) per epoch) come from
numpy's PCG64 seeded with (seed, e, rule): identical in every process that builds the sorter with the
same seed, whatever the process count, and regenerated after a resume, so checkpoints need only the
pair index and the rule state (`rule_state`).

docs/reorderers.md describes both rules, the choice of c, and how to run them.
"""
import math
from types import ModuleType
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from sorters.balance import add_signed, gram_products
from sorters.base import HostOrDeviceArray, PairBalancer, pair_views
from sorters.checks import check_seed

DELTA = 0.5  # failure probability, as in the published code
_SBW_C_MULTIPLIER = 30.0  # c = b_max * 30 log(...), as in the published code


_LOOPS: list[ModuleType] = []  # the module of compiled loops (sorters/threshold_loops.py), once imported


def _loops() -> ModuleType:
    """The compiled loops (importing numba on first use; a list lookup afterwards, per step)."""
    if not _LOOPS:
        from sorters import threshold_loops
        _LOOPS.append(threshold_loops)
    return _LOOPS[0]


class _ThresholdPairBalance(PairBalancer):
    """Shared machinery of KH-SGD and SBW; subclasses set `rule`, `_draw` and `_epoch_constants`.

    epochs: the run's total number of epochs E (both rules' constants depend on it).
    rule_state: (5,) float64 CPU tensor, the slots of sorters/threshold_loops.py (pair index, KH's v,
    SBW's b_max, the epoch's constants).
    """

    uses_total_epochs = True
    rule = 0
    # regenerated from (seed, epoch) after a resume; views
    NOT_IN_STATE = PairBalancer.NOT_IN_STATE + ("_draws", "_draws_epoch", "_views")

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, epochs: int | None = None, nonfinite: str = "raise") -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"{self.name}: needs the run's total number of epochs (an integer >= 1; its "
                             f"threshold depends on it), got {epochs!r}")
        self.total_epochs, self.seed = epochs, check_seed(self.name, seed)
        self.rule_state = torch.zeros(5, dtype=torch.float64)  # on the CPU whatever the device: host scalars
        self._draws: NDArray[np.float64] | None = None
        self._draws_epoch: int | None = None
        self._views: tuple[NDArray[np.float64], NDArray[np.float64]] | None = None
        super().__init__(n_workers, m, d, seed, device, dtype, nonfinite)
        self.pairs_per_epoch = self.n * (self.m // 2)
        if self.device.type == "cpu":  # compile (or load) the loop now, not inside the first epoch
            units, state = np.zeros((1, 2, 1), np.float32), np.zeros(5)
            _loops().rule_signs(self.rule, np.zeros(1), units, 0, units, 1, np.empty((1, 1), np.bool_),
                                np.zeros(1), state)

    def _reset_running_sums(self) -> None:
        loops = _loops()
        self.running_sum = torch.zeros(self.d, dtype=torch.float64, device=self.device)
        self.rule_state[loops.INDEX] = 0
        self.rule_state[loops.KH_V] = 0  # KH's v restarts every epoch; SBW's b_max lives for the run
        self._views = None

    def _numpy_views(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(running sum, rule state) as NumPy arrays sharing memory (the CPU path), kept between steps:
        at LR-HMDA's size a step's whole sign loop costs about as much as a few tensor-to-NumPy calls."""
        if self._views is None:
            self._views = self.running_sum.numpy(), self.rule_state.numpy()
        return self._views

    # ------------------------------------------------------------------ randomness

    def epoch_draws(self, epoch: int) -> NDArray[np.float64]:
        """(P,) float64: the draws of epoch `epoch` (1-based), one per pair difference in visiting order."""
        entropy = [self.seed % 2**64, epoch, self.rule]
        return self._draw(np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy))),
                          self.pairs_per_epoch)

    def _draw(self, generator: np.random.Generator, count: int) -> NDArray[np.float64]:
        raise NotImplementedError

    def _epoch_constants(self, epoch: int) -> None:
        """Set the rule's constants for epoch `epoch` in rule_state."""
        raise NotImplementedError

    def _current_draws(self) -> NDArray[np.float64]:
        draws = self._draws
        if draws is None or self._draws_epoch != self.epoch:  # once per epoch, and after a resume
            draws = self._draws = self.epoch_draws(self.epoch)
            self._epoch_constants(max(self.epoch, 1))  # (epoch 0: steps before the first sort)
            self._draws_epoch = self.epoch
        return draws

    # ------------------------------------------------------------------ the signs

    def _pair_signs(self, xp: ModuleType, first_units: HostOrDeviceArray, first_index: int,
                    second_units: HostOrDeviceArray, second_index: int, n_pairs: int) -> HostOrDeviceArray:
        loops = _LOOPS[0]
        draws = self._draws if self._draws_epoch == self.epoch else self._current_draws()
        if xp is np:
            running_sum, state = self._numpy_views()
            plus = np.empty((n_pairs, self.n), dtype=np.bool_)  # (P, n): the visiting order
            loops.rule_signs(self.rule, running_sum, first_units, first_index, second_units, second_index,
                             plus, draws, state)
            return plus.T
        state = self.rule_state.numpy()
        # the device path: the block's inner products on the device, then the scalar, sequential
        # decisions on the host (one round trip per step instead of a dozen tiny kernels per difference)
        firsts, seconds = pair_views(first_units, first_index, second_units, second_index, n_pairs)
        diffs = (firsts - seconds).transpose(0, 1).reshape(-1, self.d)  # (P * n, d) pair-major, worker-minor
        a, gram, widened = gram_products(self.running_sum, diffs)
        signs = np.empty(diffs.shape[0])
        loops.rule_signs_from_gram(self.rule, a.cpu().numpy(), gram.cpu().numpy(), signs, draws, state)
        signs_tensor = torch.from_numpy(signs).to(diffs.device)
        add_signed(self.running_sum, diffs, signs_tensor, widened)
        return (signs_tensor > 0).reshape(-1, self.n).T

    # ------------------------------------------------------------------ checkpoints

    def _check_state(self, state: dict[str, Any]) -> None:
        super()._check_state(state)
        if state["total_epochs"] != self.total_epochs:
            raise ValueError(f"{self.name}: state is for epochs={state['total_epochs']}, sorter has "
                             f"{self.total_epochs} (the threshold depends on the run's epochs)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rule_state = self.rule_state.cpu()
        self._draws_epoch, self._views = None, None


class KernelHalving(_ThresholdPairBalance):
    """KH-SGD (Carrell et al. 2025): pair balance with the kernel-halving threshold.

    For the i-th pair difference of epoch e (i = 0 .. P-1 over the visiting order, P = n * floor(m/2)),
    with v reset to 0 at every epoch start, U_i uniform in [-1, 1] drawn afresh each epoch, and
    ratio = v L_i / b2 (v before this pair's update)::

        L_i = log( (4 / delta) (log E + 1) (log P + 1) (i + 1) e ),   delta = 0.5, E = the run's epochs,
        ratio <= 1:  t = b2,                v <- 2 b2
        else:        t = sqrt(ratio) b2,    v <- v + 2 b2 max(0, L_i + 1/2 - sqrt(ratio)) / L_i

    and the pair is added iff <S, v> <= U_i t. A zero difference (b2 = 0) is added iff U_i >= 0 and
    leaves v unchanged (what the published code does: its threshold is NaN there). With one worker,
    P = m / 2 as in the published code.

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient.
        seed: the seed of the orders and of the threshold's draws.
        device: where the orders and the running sum live.
        dtype: the dtype of a kept unpaired gradient.
        epochs: E, the run's total number of epochs (the constants depend on it).
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`).
    """

    name = "KH-SGD"
    rule = 1  # threshold_loops.KH

    def _draw(self, generator: np.random.Generator, count: int) -> NDArray[np.float64]:
        return generator.uniform(-1.0, 1.0, count)

    def _epoch_constants(self, epoch: int) -> None:
        factor = (4 / DELTA) * (math.log(self.total_epochs) + 1) * (math.log(max(self.pairs_per_epoch, 1)) + 1) * epoch
        self.rule_state[_loops().KH_PENALTY_FACTOR] = factor

    @property
    def v(self) -> float:
        """Twice the squared sub-Gaussian constant (reset every epoch)."""
        return float(self.rule_state[_loops().KH_V])


class SelfBalancingWalk(_ThresholdPairBalance):
    """SBW (Alweiss, Liu & Sawhney 2021) as run by Carrell et al. 2025: add iff <S, v> <= c (1 - 2u),
    one u uniform in [0, 1) per pair difference.

    The constant, c = b_max * 30 * log(P E d / delta), delta = 0.5:

    - P E is the number of pair differences the walk visits in the run (P = n * floor(m/2) per epoch,
      E = the run's epochs), d the gradient length: the walk's length and dimension in the
      self-balancing walk's bound. With one worker P E d / delta = m E d / delta / 2, the published
      constant's argument.
    - b_max bounds the pair-difference norm. The published code hard-coded it for its HMDA features;
      here it needs no knowledge of the data in advance: b_max is the largest ||v|| seen so far in the
      run, the current difference included (so ``|<S, v>| / c`` is measured in units of a norm the walk has
      actually met; c grows when a larger difference arrives and never shrinks). It is kept across
      epochs and in checkpoints (`b_max`). Until a non-zero difference arrives c = 0 and the rule is
      CD-GraB's (add iff <S, v> <= 0).

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient.
        seed: the seed of the orders and of the threshold's draws.
        device: where the orders and the running sum live.
        dtype: the dtype of a kept unpaired gradient.
        epochs: E, the run's total number of epochs (the constants depend on it).
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`).
    """

    name = "SBW"
    rule = 2  # threshold_loops.SBW

    def _draw(self, generator: np.random.Generator, count: int) -> NDArray[np.float64]:
        return generator.random(count)

    def _epoch_constants(self, epoch: int) -> None:
        walk = max(self.pairs_per_epoch, 1) * self.total_epochs * self.d / DELTA
        self.rule_state[_loops().SBW_C_OVER_B_MAX] = _SBW_C_MULTIPLIER * math.log(walk)

    @property
    def b_max(self) -> float:
        """The largest pair-difference norm seen so far in the run."""
        return float(self.rule_state[_loops().SBW_B_MAX])
