"""How the training units are split over the n workers (`--partition`), shared by LR-HMDA and MLP-M4.

Every partition gives each worker exactly m distinct units (the engine needs equal m), and no unit
goes to two workers. The label partitions work on a POOL of n*m units (LR-HMDA: the first n*m
training rows in data order, the same rows whatever the partition) and return (n, m) indices into it:

  contiguous    worker r owns pool rows r*m .. (r+1)*m - 1 (data order; the original's split).
  random        a permutation of the pool drawn with torch.Generator().manual_seed(seed), cut into n
                blocks of m: every worker sees about the pool's label mix.
  label-sorted  the pool stably sorted by label, cut into n blocks of m: maximal label skew (with two
                classes every worker is single-class except the one that holds the class boundary).
  dirichlet:A   label skew of tunable strength (small A: strong skew; large A: close to random):
                1. rng = numpy.random.default_rng(seed); worker j's wanted class proportions
                   p_j ~ Dirichlet(A, ..., A) over the C classes of the pool (rng.dirichlet, one row per worker).
                2. The wanted counts m * p_j (plus 1e-9, so no class is wanted nowhere) are fitted to the
                   pool's class counts by iterative proportional fitting (Sinkhorn: scale columns to the
                   class counts, rows to m, until both hold to 1e-9 or 10,000 rounds). This keeps each
                   worker's proportions as far as the class counts allow: a class that is scarce in the
                   pool is scaled down by the same factor for every worker.
                3. Integer counts: per class, round the cumulative sum over workers (so every class total
                   is exact), then, while some worker has more than m units and another fewer, move one
                   unit of the class the first holds most above its fitted count to the second.
                4. Each class's pool rows are shuffled with rng.permutation and dealt out in worker order:
                   worker j takes its count of every class, classes in ascending order.

MLP-M4's windows have no label, so only `random` (windows shuffled over all workers, the default) and
`contiguous` (whole series per worker: `whole_groups`) apply there.
"""
import argparse

import numpy as np
import torch

NAMES = ("contiguous", "random", "label-sorted", "dirichlet:ALPHA")
SINKHORN_TOL, SINKHORN_ROUNDS = 1e-9, 10_000


def partition_type(allowed=NAMES, why: str = ""):
    """An argparse `type=` function accepting the partition names in `allowed` (dirichlet:ALPHA with
    ALPHA > 0); returns the canonical spelling, e.g. "dirichlet:1.0" -> "dirichlet:1"."""
    def parse(text: str) -> str:
        name, _, alpha = text.partition(":")
        if text in allowed:
            return text
        if name == "dirichlet" and "dirichlet:ALPHA" in allowed:
            try:
                value = float(alpha)
            except ValueError:
                value = float("nan")
            if not value > 0 or value == float("inf"):  # NaN fails the comparison
                raise argparse.ArgumentTypeError(f"dirichlet:ALPHA needs a number ALPHA > 0 (e.g. dirichlet:0.1), "
                                                 f"got {text!r}")
            return f"dirichlet:{value:g}"
        raise argparse.ArgumentTypeError(f"unknown partition {text!r}; choose one of {', '.join(allowed)}{why}")
    return parse


def dirichlet_alpha(partition: str) -> float | None:
    """ALPHA of "dirichlet:ALPHA", else None."""
    name, _, alpha = partition.partition(":")
    return float(alpha) if name == "dirichlet" else None


def split_by_labels(labels: torch.Tensor, n: int, partition: str, seed: int) -> torch.Tensor:
    """labels (n*m,) of the pool -> (n, m) LongTensor of pool indices, row j worker j's units
    (see the module docstring for each partition)."""
    pool = len(labels)
    if pool % n:
        raise ValueError(f"a pool of {pool} units does not split into {n} equal workers")
    m = pool // n
    if partition == "contiguous":
        return torch.arange(pool).reshape(n, m)
    if partition == "random":
        return torch.randperm(pool, generator=torch.Generator().manual_seed(seed)).reshape(n, m)
    if partition == "label-sorted":
        return torch.sort(labels, stable=True).indices.reshape(n, m)
    alpha = dirichlet_alpha(partition)
    if alpha is None:
        raise ValueError(f"unknown partition {partition!r}")
    return _dirichlet(labels.cpu().numpy(), n, m, alpha, seed)


def _dirichlet(labels: np.ndarray, n: int, m: int, alpha: float, seed: int) -> torch.Tensor:
    classes, class_of = np.unique(labels, return_inverse=True)
    counts = np.bincount(class_of, minlength=len(classes)).astype(float)  # (C,)
    rng = np.random.default_rng(seed)
    wanted = m * rng.dirichlet(np.full(len(classes), alpha), size=n) + 1e-9  # (n, C)
    fitted = _fit_margins(wanted, m, counts)
    per_worker = _round_margins(fitted, m, counts.astype(int))  # (n, C) ints, rows sum to m
    rows = [[] for _ in range(n)]
    for c in range(len(classes)):
        members = rng.permutation(np.flatnonzero(class_of == c))
        bounds = np.concatenate([[0], np.cumsum(per_worker[:, c])])
        for j in range(n):
            rows[j].extend(members[bounds[j]:bounds[j + 1]])
    return torch.tensor(np.array(rows, dtype=np.int64))


def _fit_margins(x: np.ndarray, row_sum: float, col_sums: np.ndarray) -> np.ndarray:
    """Sinkhorn: x (n, C) > 0 scaled so that every row sums to row_sum and column c to col_sums[c]."""
    x = x.copy()
    for _ in range(SINKHORN_ROUNDS):
        x *= col_sums / x.sum(axis=0)
        x *= row_sum / x.sum(axis=1, keepdims=True)
        if np.abs(x.sum(axis=0) - col_sums).max() <= SINKHORN_TOL * row_sum:
            break
    return x


def _round_margins(x: np.ndarray, row_sum: int, col_sums: np.ndarray) -> np.ndarray:
    """Integer (n, C) counts near x with exact column sums col_sums and row sums row_sum."""
    cumulative = np.floor(np.cumsum(x, axis=0) + 0.5).astype(np.int64)
    cumulative[-1] = col_sums
    counts = np.diff(cumulative, axis=0, prepend=0)
    while True:
        excess = counts.sum(axis=1) - row_sum
        if not excess.any():
            return counts
        over, under = int(excess.argmax()), int(excess.argmin())
        above = (counts[over] - x[over]) - (counts[under] - x[under])
        c = int(np.where(counts[over] > 0, above, -np.inf).argmax())
        counts[over, c] -= 1
        counts[under, c] += 1


def whole_groups(groups: torch.Tensor, n: int, multiple: int, m_max: int) -> torch.Tensor:
    """Units that share a group (M4: a series) go to one worker only. groups (N,) ints -> (n, m)
    LongTensor of unit indices, m the largest multiple of `multiple` <= m_max that fits.

    Groups are taken in ascending id order, each group's units in their order in `groups`; worker 0
    takes whole groups until it holds at least m units, its last group cut to make exactly m (the
    cut-off units are used by nobody), then worker 1 continues with the next group, and so on.
    Returns an empty (n, 0) tensor when not even m = multiple fits.
    """
    order = torch.sort(groups, stable=True).indices
    sizes = torch.unique_consecutive(groups[order], return_counts=True)[1].tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)])

    def first_groups(m):  # index of each worker's first group, or None when the groups run out
        firsts, g = [], 0
        for _ in range(n):
            firsts.append(g)
            held = 0
            while held < m:
                if g == len(sizes):
                    return None
                held += sizes[g]
                g += 1
        return firsts

    low, high = 0, m_max // multiple  # fits(low * multiple) always; monotone: fewer units never need more groups
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if first_groups(mid * multiple) is not None else (low, mid - 1)
    m = low * multiple
    if m == 0:
        return torch.empty(n, 0, dtype=torch.long)
    # a worker's groups are consecutive, so its units are the m units of `order` from its first group on
    return torch.stack([order[starts[g]:starts[g] + m] for g in first_groups(m)])
