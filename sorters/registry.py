"""The sorters by name: SORTERS, SORTER_NAMES and build_sorter, in a module of their own so that the
package's other modules (sampler.py, settings.py) can import them without the package's __init__."""
from sorters.balance import CDGraB, IndependentMeanBalance, IndependentPairBalance
from sorters.base import Sorter
from sorters.fold import Fold
from sorters.randomized import KernelHalving, SelfBalancingWalk
from sorters.shuffle import DistributedRandomReshuffle, DistributedShuffleOnce

SORTERS = {cls.name: cls for cls in (CDGraB, DistributedRandomReshuffle, DistributedShuffleOnce,
                                     IndependentMeanBalance, IndependentPairBalance, Fold, KernelHalving,
                                     SelfBalancingWalk)}
SORTER_NAMES = tuple(SORTERS)


def build_sorter(name: str, n_workers: int, m: int, d: int, seed: int = 0, device="cpu",
                 epochs: int | None = None, sign_loop: str | None = None, nonfinite: str = "raise") -> Sorter:
    """A fresh sorter `name` (one of SORTER_NAMES) for n_workers workers with m units each and
    d-dimensional gradients. Everything it does is determined by `seed` (and `epochs`).

    epochs: the run's total number of epochs; required by the sorters whose rule depends on it
    (`uses_total_epochs`: KH-SGD, SBW), ignored by the others.
    sign_loop: CD-GraB's sign loop ("compiled" or "gram"; None: by the device, see CDGraB), ignored by
    the others.
    nonfinite: what step() does with NaN / inf gradients: "raise" (NonFiniteGradientError, a ValueError
    naming the step) or "skip" (the step's units are balanced as zero vectors; counted in
    `skipped_steps`). Ignored by the sorters that ignore gradients."""
    if not isinstance(name, str) or name not in SORTERS:
        raise ValueError(f"unknown sorter {name!r}; choose one of {', '.join(SORTER_NAMES)}")
    cls = SORTERS[name]
    extra = {"epochs": epochs} if cls.uses_total_epochs else {}
    if hasattr(cls, "SIGN_LOOPS"):
        extra["sign_loop"] = sign_loop
    return cls(n_workers, m, d, seed=seed, device=device, nonfinite=nonfinite, **extra)
