"""Gradient reducers: each worker offers a d-vector, every process gets back the same average.

    reducer = make_reducer("exdyna", comm, d, device, density=0.001)
    avg = reducer.reduce(local)     # local (n_local, d): this process's workers; avg (d,)

`avg` is (1/n) * the sum over all n workers of what each one sent. The dense reducer sends the
whole vector. The sparse ones (topk, exdyna) send a subset of coordinates and keep the rest as a
per-worker residual (error feedback), which is added to the next vector they are given:

    acc = local + residual;  send acc at the selected set I;  residual = acc with I zeroed.

Error feedback conserves mass, per worker: sum of what was sent + residual == sum of the inputs.

The n logical workers are spread over `comm` (engine.comm): one process holds all of them
(LocalCommunicator), or each torchrun rank holds n_local = n / world_size of them. Every decision
(what to select, the threshold, the partitions) depends only on per-worker data and on gathered
global values, so both layouts compute the same selections and (up to the order of floating-point
sums) the same average.

`comm_bytes` counts the payload as if each worker were its own process, summed over the n workers,
so it is the same in both layouts (as engine.comm.GradientExchange does).

ExDyna follows Yoon & Oh, CCGrid 2024 (arXiv 2402.13781) and their reference code.
"""
import math

import torch

from common.errors import UserFacingError

REDUCER_NAMES = ("dense", "topk", "exdyna")


def make_reducer(name: str, comm, d: int, device, density: float | None = None, **options):
    """The reducer `name` for d-vectors. density: the fraction of coordinates to send (topk and
    exdyna; ignored by dense). options: ExDyna's constants (see ExDynaReducer)."""
    if name not in REDUCER_NAMES:
        raise UserFacingError(f"--reducer must be one of {', '.join(REDUCER_NAMES)}, got {name!r}")
    if name == "dense":
        return DenseReducer(comm, d, device)
    if density is None:
        raise UserFacingError(f"--reducer {name} needs --density (the fraction of coordinates sent, in (0, 1])")
    if not 0 < density <= 1:
        raise UserFacingError(f"--density must be in (0, 1], got {density:g}")
    if name == "topk":
        return TopKReducer(comm, d, device, density)
    return ExDynaReducer(comm, d, device, density, **options)


def _smallest_density(n: int, d: int) -> str:
    """The shortest decimal density >= n / d, i.e. one that gives floor(density * d) >= n."""
    for digits in range(2, 18):
        text = f"{n / d:.{digits}g}"
        if math.floor(float(text) * d) >= n:
            return text
    return repr(n / d)


class Reducer:
    """The interface; subclasses implement `reduce`, and state beyond the epoch accumulators.

    name: one of REDUCER_NAMES. comm_bytes: cumulative bytes sent, summed over the n workers
    (dense: n * d * element size per call; topk: n * (k indices + |union| values); exdyna:
    n * (1 count + max_k padded indices + K values); indices int32 when d < 2**31, values at the
    accumulator's element size, 4 for float32 gradients).
    """

    name = "base"

    def __init__(self, comm, d: int, device):
        self.comm, self.d, self.device = comm, d, torch.device(device)
        self.n = comm.n_workers
        self.comm_bytes = 0
        self._density_sum, self._imbalance_sum, self._calls = 0.0, 0.0, 0

    def reduce(self, local: torch.Tensor) -> torch.Tensor:
        """local: (n_local, d), not modified. Returns (d,): the mean over all n workers of what they sent."""
        raise NotImplementedError

    def _record(self, density: float, load_imbalance: float = 0.0):
        self._density_sum += density
        self._imbalance_sum += load_imbalance
        self._calls += 1

    def _threshold(self) -> float:
        return float("nan")

    def epoch_stats(self) -> dict:
        """Means over the reduce() calls since the last epoch_stats (nan when there were none):
        achieved density, load imbalance (n * max_k / K - 1); and the current threshold (nan
        when the reducer has none). Resets the means."""
        calls = self._calls
        stats = {"density": self._density_sum / calls if calls else float("nan"),
                 "threshold": self._threshold(),
                 "load_imbalance": self._imbalance_sum / calls if calls else float("nan")}
        self._density_sum, self._imbalance_sum, self._calls = 0.0, 0.0, 0
        return stats

    # checkpointing: a dict that does not depend on the world size (residuals of all n workers)

    def state_dict(self) -> dict:
        """COLLECTIVE (every rank calls it). The same dict on every rank and for any world size."""
        return {"reducer": self.name, "d": self.d, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        """Restore from state_dict(); ValueError when it belongs to another reducer, d or n."""
        self._check_state(state)

    def _check_state(self, state: dict) -> None:
        mine = (self.name, self.d, self.n)
        theirs = (state.get("reducer"), state.get("d"), state.get("n"))
        if theirs != mine:
            raise ValueError(f"reducer state is for (reducer, d, n) = {theirs}, this reducer is {mine}")


class DenseReducer(Reducer):
    """Every worker sends its whole vector: one all-reduce of d values per worker."""

    name = "dense"

    def reduce(self, local):
        self.comm_bytes += self.n * self.d * local.element_size()
        self._record(1.0)
        return self.comm.all_reduce_sum(local) / self.n


class ErrorFeedbackReducer(Reducer):
    """A sparse reducer with a per-worker residual, (n_local, d) on `device` (float32 until a
    float64 input promotes it)."""

    def __init__(self, comm, d, device, density):
        super().__init__(comm, d, device)
        self.density = density
        self.residual = torch.zeros(len(comm.local_workers), d, device=self.device)

    def _send_at(self, acc: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Every local worker sends its acc at the global set `selected` ((K,) int64, no
        duplicates); the residual becomes acc with `selected` zeroed. Returns the (d,) average."""
        values = acc[:, selected]  # (n_local, K)
        total = self.comm.all_reduce_sum(values)  # (K,)
        acc[:, selected] = 0  # acc is ours (local + residual), so zeroing it in place is safe
        self.residual = acc
        average = torch.zeros(self.d, dtype=acc.dtype, device=acc.device)
        average[selected] = total / self.n
        return average

    def state_dict(self):
        state = super().state_dict()
        # a copy: with one process all_gather returns the live residual itself
        state["residual"] = self.comm.all_gather(self.residual).detach().to("cpu", copy=True)  # (n, d)
        return state

    def _check_state(self, state):
        super()._check_state(state)
        shape = tuple(state["residual"].shape)
        if shape != (self.n, self.d):
            raise ValueError(f"reducer residual has shape {shape}, expected {(self.n, self.d)}")

    def load_state_dict(self, state):
        self._check_state(state)
        self.residual = state["residual"][self.comm.local_workers].to(self.device)


class TopKReducer(ErrorFeedbackReducer):
    """Each worker picks the k = max(1, floor(density * d)) largest |acc|; all workers send their
    values at the union of the picks (so up to n * k coordinates: gradient build-up)."""

    name = "topk"

    def __init__(self, comm, d, device, density):
        super().__init__(comm, d, device, density)
        self.k = max(1, math.floor(density * d))
        self.index_dtype = torch.int32 if d < 2**31 else torch.int64

    def reduce(self, local):
        acc = local + self.residual  # (n_local, d)
        picks = acc.abs().topk(self.k, dim=1, sorted=False).indices.to(self.index_dtype)  # (n_local, k)
        union = torch.unique(self.comm.all_gather(picks)).long()  # (U,) sorted
        # every worker sends its k indices and its values at the union (k is fixed: no count needed)
        index_bytes = torch.empty((), dtype=self.index_dtype).element_size()
        self.comm_bytes += self.n * (self.k * index_bytes + union.numel() * acc.element_size())
        self._record(union.numel() / self.d)
        return self._send_at(acc, union)

    def state_dict(self):
        return {**super().state_dict(), "k": self.k}


class ExDynaReducer(ErrorFeedbackReducer):
    """ExDyna: cyclic exclusive partitions, block-granular load balancing, an adaptive threshold.

    The vector is cut into `n_blocks` blocks of `blk` elements (the d - n_blocks * blk leftover
    belongs to the last partition) and the blocks into n contiguous partitions, given by
    `block_bounds` ((n + 1,) block offsets). At iteration t, worker r (its global id) owns
    partition (t + r) mod n and selects there every index with |acc| >= lambda (or, if none, the
    one index start + t mod length). The selections are disjoint, so the global set I is their
    concatenation: K = sum of the counts, no duplicates.

    Before selecting (t >= 1), from the previous iteration's gathered counts:
      - rebalance: each adjacent pair of partitions may pass one block across their boundary, from
        the one loaded above `tolerance` * mean to the one below mean / `tolerance`, never leaving
        fewer than c_min blocks;
      - rescale lambda by the ratio K_prev / k of achieved to target count (k = floor(density * d)).

    The rescaling looks only at which band K_prev / k falls in, not how far out it is. lambda therefore
    settles where roughly as many steps land above the band as below it: the rule holds the MEDIAN count
    near k, not the mean. When the per-step counts are right-skewed (gradients whose scale varies from
    step to step, e.g. small per-worker batches), the mean density reported in metrics.csv lies above
    the band although the median is inside it (docs/communication.md, tests/test_reducers.py).

    Block layout (our choice for small d, where the reference would get blk = 0): blk is
    floor(d / n_blocks) rounded down to a multiple of `block_alignment`; when that is 0
    (d < n_blocks * block_alignment) we drop the alignment and use min(n_blocks, d) blocks of
    floor(d / blocks) elements. c_min = blocks / (min_blocks_divisor * n), kept as a float as the
    reference does (for n not a power of two, flooring it would let a partition shrink one block
    further), and at least 1 so that no partition is ever emptied.

    The keyword constants default to the reference code's values.
    """

    name = "exdyna"

    def __init__(self, comm, d, device, density, *, n_blocks: int = 1024, block_alignment: int = 32,
                 min_blocks_divisor: int = 4, tolerance: float = 1.05, band_high: float = 1.1,
                 band_low: float = 0.909, lambda_up: float = 1.005, lambda_creep: float = 1.00125,
                 lambda_down: float = 0.995):
        super().__init__(comm, d, device, density)
        n = self.n
        self.k = math.floor(density * d)  # target selected count per iteration, over all workers
        if self.k < n:
            raise UserFacingError(
                f"--reducer exdyna with --density {density:g} selects floor({density:g} * {d}) = {self.k} "
                f"coordinates per step, fewer than one per worker ({n} workers); use --density >= "
                f"{_smallest_density(n, d)}")
        self.tolerance, self.band_high, self.band_low = tolerance, band_high, band_low
        self.lambda_up, self.lambda_creep, self.lambda_down = lambda_up, lambda_creep, lambda_down

        self.blk = (d // n_blocks) // block_alignment * block_alignment
        self.n_blocks = n_blocks
        if self.blk == 0:  # small d: unaligned blocks, as many as fit (d >= k >= n, so at least n)
            self.n_blocks = min(n_blocks, d)
            self.blk = d // self.n_blocks
        if self.n_blocks < n:
            raise UserFacingError(f"--reducer exdyna splits the gradient into {self.n_blocks} blocks, "
                                  f"fewer than the {n} workers (--node_cnt)")
        self.c_min = max(1.0, self.n_blocks / (min_blocks_divisor * n))
        # initial split: floor(n_blocks / n) each, the first (n_blocks mod n) partitions one more
        sizes = [self.n_blocks // n + (j < self.n_blocks % n) for j in range(n)]
        self.block_bounds = [0] + [sum(sizes[:j + 1]) for j in range(n)]  # (n + 1,) block offsets

        self.iteration = 0  # t: reduce() calls so far
        self.threshold = 1 / (2 * math.sqrt(self.k))  # lambda
        self.last_counts = None  # (n,) per-worker selected counts of the previous iteration
        self.last_slices = None  # (n, 2) [start, end) each worker owned in the previous iteration
        self.index_dtype = torch.int32 if d < 2**31 else torch.int64
        self._index_buffer = torch.zeros(0, dtype=self.index_dtype, device=self.device)

    # partitions

    def element_bounds(self) -> list[int]:
        """(n + 1,) element offsets of the partitions; the last one ends at d (it holds the leftover)."""
        return [b * self.blk for b in self.block_bounds[:-1]] + [self.d]

    def _owned_partition(self, worker: int, t: int) -> int:
        return (t + worker) % self.n

    def _rebalance(self, counts: list[int], t: int):
        """Move at most one block across each boundary, from the previous iteration's counts."""
        n = self.n
        load = [0.0] * n  # q_j: the count selected in partition j at iteration t - 1
        for worker, count in enumerate(counts):
            load[self._owned_partition(worker, t - 1)] = float(count)
        total = sum(load)
        mean, per_element = total / n, total / self.d
        shift = self.blk * per_element  # the load one block carries, as estimated
        high, low = self.tolerance, 1 / self.tolerance
        for i in range(n - 1):
            size_left = self.block_bounds[i + 1] - self.block_bounds[i]
            size_right = self.block_bounds[i + 2] - self.block_bounds[i + 1]
            if load[i] / mean > high and load[i + 1] / mean < low and size_left - 1 >= self.c_min:
                self.block_bounds[i + 1] -= 1
                load[i], load[i + 1] = load[i] - shift, load[i + 1] + shift
            elif load[i] / mean < low and load[i + 1] / mean > high and size_right - 1 >= self.c_min:
                self.block_bounds[i + 1] += 1
                load[i], load[i + 1] = load[i] + shift, load[i + 1] - shift

    def _rescale_threshold(self, previous_total: int):
        ratio = previous_total / self.k
        if ratio > self.band_high:
            self.threshold *= self.lambda_up  # too dense
        elif ratio > self.band_low:
            # the reference also has a lowering branch here, guarded by ratio <= 0 and so never
            # taken: inside the band lambda keeps creeping up
            self.threshold *= self.lambda_creep
        else:
            self.threshold *= self.lambda_down  # too sparse

    # the reduction

    def reduce(self, local):
        n, t = self.n, self.iteration
        if t >= 1:
            self._rebalance(self.last_counts, t)
            self._rescale_threshold(sum(self.last_counts))
        acc = local + self.residual  # (n_local, d)
        bounds = self.element_bounds()

        picks = []  # per local worker: (k_r,) indices into [0, d), inside its own partition
        for row, worker in enumerate(self.comm.local_workers):
            part = self._owned_partition(worker, t)
            start, end = bounds[part], bounds[part + 1]
            hits = torch.nonzero(acc[row, start:end].abs() >= self.threshold).view(-1)
            if hits.numel() == 0:  # always send something: one index, cycling through the slice
                hits = torch.tensor([t % (end - start)], device=acc.device)
            picks.append(hits + start)

        # 1. counts
        local_counts = torch.tensor([p.numel() for p in picks], dtype=self.index_dtype, device=acc.device)
        counts_dev = self.comm.all_gather(local_counts)  # (n,)
        counts = counts_dev.tolist()
        max_k, total = max(counts), sum(counts)
        # 2. indices, zero-padded to max_k, from one reused buffer
        n_local = len(picks)
        if self._index_buffer.numel() < n_local * max_k:
            self._index_buffer = torch.zeros(2 * n_local * max_k, dtype=self.index_dtype, device=acc.device)
        padded = self._index_buffer[:n_local * max_k].view(n_local, max_k)
        padded.zero_()
        for row, hits in enumerate(picks):
            padded[row, :hits.numel()] = hits
        gathered = self.comm.all_gather(padded)  # (n, max_k)
        valid = torch.arange(max_k, device=acc.device) < counts_dev.unsqueeze(1)  # (n, max_k)
        selected = gathered[valid].long()  # (K,) worker by worker
        # 3. values: every worker sends its acc at all of I
        index_bytes = self._index_buffer.element_size()
        self.comm_bytes += n * (index_bytes + max_k * index_bytes + total * acc.element_size())
        average = self._send_at(acc, selected)

        self.last_counts = counts
        self.last_slices = [(bounds[self._owned_partition(w, t)], bounds[self._owned_partition(w, t) + 1])
                            for w in range(n)]
        self.iteration = t + 1
        self._record(total / self.d, n * max_k / total - 1)
        return average

    def _threshold(self):
        return self.threshold

    def state_dict(self):
        return {**super().state_dict(), "k": self.k, "blk": self.blk, "n_blocks": self.n_blocks,
                "c_min": self.c_min, "iteration": self.iteration, "threshold": self.threshold,
                "block_bounds": list(self.block_bounds),
                "last_counts": None if self.last_counts is None else list(self.last_counts),
                "last_slices": None if self.last_slices is None else list(self.last_slices),
                "K_prev": None if self.last_counts is None else sum(self.last_counts)}

    def _check_state(self, state):
        super()._check_state(state)
        layout = (state["blk"], state["n_blocks"])
        if layout != (self.blk, self.n_blocks):
            raise ValueError(f"exdyna state has (blk, n_blocks) = {layout}, this reducer "
                             f"{(self.blk, self.n_blocks)}")

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.iteration, self.threshold = state["iteration"], state["threshold"]
        self.block_bounds = list(state["block_bounds"])
        self.last_counts = None if state["last_counts"] is None else list(state["last_counts"])
        self.last_slices = None if state["last_slices"] is None else [tuple(s) for s in state["last_slices"]]
