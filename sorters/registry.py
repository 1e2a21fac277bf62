"""The sorters by name: SORTERS, SORTER_NAMES and build_sorter, in a module of their own so that the
package's other modules (sampler.py, settings.py) can import them without the package's __init__."""
import torch

from sorters.balance import CDGraB, IndependentMeanBalance, IndependentPairBalance
from sorters.base import Sorter
from sorters.flipflop import FlipFlop
from sorters.fold import Fold
from sorters.greedy import GreedyHerding
from sorters.microbatch import MicroBatchGraB
from sorters.randomized import KernelHalving, SelfBalancingWalk
from sorters.recursive import RecursivePairBalance
from sorters.replacement import SampleWithReplacement
from sorters.shuffle import DistributedRandomReshuffle, DistributedShuffleOnce

SORTERS: dict[str, type[Sorter]] = {
    cls.name: cls for cls in (CDGraB, DistributedRandomReshuffle, DistributedShuffleOnce, IndependentMeanBalance,
                              IndependentPairBalance, Fold, KernelHalving, SelfBalancingWalk, FlipFlop,
                              SampleWithReplacement, GreedyHerding, MicroBatchGraB, RecursivePairBalance)}
SORTER_NAMES: tuple[str, ...] = tuple(SORTERS)


def build_sorter(name: str, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 epochs: int | None = None, sign_loop: str | None = None, nonfinite: str = "raise",
                 batch_size: int | None = None) -> Sorter:
    """A fresh sorter by name. Everything it does is determined by `seed` (and `epochs`).

    Args:
        name: one of SORTER_NAMES.
        n_workers: the number of workers, each ordering its own m units.
        m: units (examples or micro-batches) per worker.
        d: the length of a unit's gradient; the sorter's step() takes gradients of shape (n_workers, k, d).
        seed: seeds the sorter's random draws.
        device: where the sorter keeps its state and runs its loops.
        epochs: the run's total number of epochs; required by the sorters whose rule depends on it
            (`uses_total_epochs`: KH-SGD, SBW), ignored by the others.
        sign_loop: CD-GraB's sign loop ("compiled" or "gram"; None: by the device, see CDGraB), also MB-GraB's;
            ignored by the others.
        nonfinite: what step() does with NaN / inf gradients: "raise" (NonFiniteGradientError, a ValueError
            naming the step) or "skip" (the step's units are balanced as zero vectors; counted in
            `skipped_steps`). Ignored by the sorters that ignore gradients.
        batch_size: the units each worker uses per step (the sampler's batch_size, the engine's units per
            step); required by the sorters whose unit depends on it (`uses_batch_size`: MB-GraB, whose
            micro-batch it is; None there means 1), ignored by the others.

    Returns:
        The sorter, an instance of SORTERS[name], at the start of its first epoch.

    Raises:
        ValueError: `name` is not one of SORTER_NAMES, or the sorter's class refuses an argument (one line).
        TypeError: an argument of the wrong type (one line, from the sorter's class).

    Example:
        >>> sorter = build_sorter("CD-GraB", n_workers=2, m=4, d=3)
        >>> tuple(sorter.sort().shape)
        (2, 4)
    """
    if not isinstance(name, str) or name not in SORTERS:
        raise ValueError(f"unknown sorter {name!r}; choose one of {', '.join(SORTER_NAMES)}")
    cls = SORTERS[name]
    # the keywords only some classes take (the others' constructors have no such parameter)
    extra: dict[str, int | str | None] = {"epochs": epochs} if cls.uses_total_epochs else {}
    if hasattr(cls, "SIGN_LOOPS"):
        extra["sign_loop"] = sign_loop
    if getattr(cls, "uses_batch_size", False):
        extra["batch_size"] = batch_size
    return cls(n_workers, m, d, seed=seed, device=device, nonfinite=nonfinite, **extra)
