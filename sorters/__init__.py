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
| FlipFlop| per worker: fresh permutation on even epochs, its reverse on | no             |
|         | odd ones (Rajput et al. 2022)                                |                |
| SWR     | sampling with replacement: m i.i.d. draws per worker         | no             |
| Greedy  | greedy herding of each worker's stale centred gradients      | own only       |
| MB-GraB | CD-GraB over fixed micro-batches (batch_size units each)     | all workers'   |
|         | from the micro-batch gradients (no per-example gradient)     | micro-batch    |
| RPB     | recursive pair balance in blocks of 16 (GraB-sampler),       | all workers'   |
|         | one running sum per tree node for all workers                |                |

For ordinary PyTorch / DDP loops: `CDGraBSampler` (sampler.py), a torch.utils.data.Sampler driving
any of these sorters, and `PerExampleGrads` (per_example.py), per-example gradients by torch.func.
`GradientSketch` (sketch.py): a random linear map R^d -> R^D; the balancing sorters run unchanged on
the D-dimensional sketches of the gradients (`sketch_dim=` of both; docs/sketching.md).
`LayerSketch` (layer_sketch.py): those sketches layer by layer from one batched backward, without forming
the per-example gradients of the large weights (`PerExampleGrads(..., structured=True)`).
"""
__version__ = "1.0.0"  # the one place the version is written: pyproject.toml reads it, CHANGELOG.md names it

from sorters.balance import CDGraB, IndependentMeanBalance, IndependentPairBalance
from sorters.base import Sorter
from sorters.checks import NonFiniteGradientError
from sorters.flipflop import FlipFlop
from sorters.fold import Fold
from sorters.greedy import GreedyHerding
from sorters.herding import parallel_herding_bound
from sorters.layer_sketch import LayerSketch
from sorters.microbatch import MicroBatchGraB
from sorters.per_example import PerExampleGrads, PerExampleLossGrads, per_example_grads
from sorters.randomized import KernelHalving, SelfBalancingWalk
from sorters.recursive import RecursivePairBalance
from sorters.registry import SORTER_NAMES, SORTERS, build_sorter
from sorters.replacement import SampleWithReplacement
from sorters.sampler import CDGraBSampler
from sorters.settings import CDGraBSettings
from sorters.shuffle import DistributedRandomReshuffle, DistributedShuffleOnce
from sorters.sketch import GradientSketch

__all__ = ["__version__", "SORTER_NAMES", "SORTERS", "Sorter", "NonFiniteGradientError", "build_sorter",
           "parallel_herding_bound", "CDGraBSampler", "CDGraBSettings", "GradientSketch", "LayerSketch",
           "PerExampleGrads", "PerExampleLossGrads", "per_example_grads", "CDGraB", "IndependentMeanBalance",
           "IndependentPairBalance", "Fold", "KernelHalving", "SelfBalancingWalk", "DistributedRandomReshuffle",
           "DistributedShuffleOnce", "FlipFlop", "SampleWithReplacement", "GreedyHerding", "MicroBatchGraB",
           "RecursivePairBalance"]
