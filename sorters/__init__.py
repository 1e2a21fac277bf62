"""Example-order sorters for distributed training, independent of any training loop.

    from sorters import build_sorter, SORTER_NAMES
    s = build_sorter("CD-GraB", n_workers=4, m=1000, d=10, seed=0)   # KH-SGD, SBW: also epochs=E
    orders = s.sort()          # (n_workers, m) LongTensor, row j worker j's order this epoch
    s.step(grads, positions)   # grads (n_workers, k, d) of the units at epoch positions (k,)

| name    | what                                                        | uses gradients |
|---------|-------------------------------------------------------------|----------------|
| CD-GraB | coordinated pair balance, one running sum over all workers   | all workers'   |
| KH-SGD  | CD-GraB's coordinated pair balance with kernel halving's     | all workers'   |
|         | randomised threshold (Carrell et al. 2025)                   |                |
| SBW     | ... with the self-balancing walk's (Alweiss et al. 2021)     | all workers'   |
| D-RR    | fresh independent random permutation per worker per epoch    | no             |
| D-SO    | random permutation per worker drawn once                     | no             |
| I-B     | GraB mean balance per worker (stale mean)                    | own only       |
| I-PB    | pair balance per worker                                      | own only       |
| Fold    | ablation: fixed fold (evens, then odds reversed) per epoch,  | no             |
|         | the original's buggy CD-GraB order (docs/differences.md)     |                |

For ordinary PyTorch / DDP loops: `CDGraBSampler` (sampler.py), a torch.utils.data.Sampler driving
any of these sorters, and `PerExampleGrads` (per_example.py), per-example gradients by torch.func.
`GradientSketch` (sketch.py): a random linear map R^d -> R^D; the balancing sorters run unchanged on
the D-dimensional sketches of the gradients (`sketch_dim=` of both; docs/sketching.md).
`LayerSketch` (layer_sketch.py): those sketches layer by layer from one batched backward, without forming
the per-example gradients of the large weights (`PerExampleGrads(..., structured=True)`).
"""
from sorters.balance import CDGraB, IndependentMeanBalance, IndependentPairBalance
from sorters.base import Sorter
from sorters.checks import NonFiniteGradientError
from sorters.fold import Fold
from sorters.herding import parallel_herding_bound
from sorters.randomized import KernelHalving, SelfBalancingWalk
from sorters.shuffle import DistributedRandomReshuffle, DistributedShuffleOnce
from sorters.sketch import GradientSketch

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


# imported after build_sorter, which the sampler uses
from sorters.layer_sketch import LayerSketch  # noqa: E402
from sorters.per_example import PerExampleGrads, PerExampleLossGrads, per_example_grads  # noqa: E402
from sorters.sampler import CDGraBSampler  # noqa: E402

__all__ = ["SORTER_NAMES", "SORTERS", "Sorter", "NonFiniteGradientError", "build_sorter", "parallel_herding_bound", "CDGraBSampler",
           "GradientSketch", "LayerSketch", "PerExampleGrads", "PerExampleLossGrads", "per_example_grads"]
