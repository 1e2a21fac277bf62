"""The balancing sorters: CD-GraB (coordinated), and the independent per-worker baselines I-PB and I-B."""
import numpy as np
import torch

from sorters.base import OnlineBalancer, PairBalancer, sign_as_float


class CDGraB(PairBalancer):
    """CD-GraB (spec 1.5-1.7): online pair balance over the concatenated stream of all workers'
    pair differences, with ONE running sum shared by every worker.

    Visiting order: for each pair (outer), for each worker j = 0..n-1 (inner). Worker j's sign thus
    accounts for the pairs of workers 0..j-1 at the same step and for every earlier pair. Every
    process that runs it on the same all-gathered gradients computes identical orders.
    """

    name = "CD-GraB"

    def _reset_running_sums(self):
        self.running_sum = torch.zeros(self.d, dtype=self.dtype, device=self.device)

    def _pair_signs(self, diffs):
        n, n_pairs, _ = diffs.shape
        stream = diffs.transpose(0, 1).reshape(n_pairs * n, self.d)  # pair-major, worker-minor
        return shared_sum_signs(self.running_sum, stream).reshape(n_pairs, n).T


def shared_sum_signs(running_sum: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """Online herding over a stream of vectors, updating `running_sum` (d,) in place.

    stream: (N, d). Returns (N,) bool: True where the vector got sign +1, i.e. <s, v> <= 0
    (ties go to +1), after which s += v; otherwise s -= v. Sequential by definition.
    """
    if running_sum.device.type == "cpu":
        return signs_numpy(running_sum, stream)
    return signs_torch(running_sum, stream)


def signs_numpy(running_sum, stream):
    """CPU path: a NumPy loop has ~10-30x less per-vector overhead than torch ops (bench/balancing_loop.py)."""
    s, vectors = running_sum.numpy(), stream.contiguous().numpy()  # s shares memory with the tensor
    plus = np.empty(len(vectors), dtype=bool)
    for r, v in enumerate(vectors):
        plus[r] = s.dot(v) <= 0
        if plus[r]:
            s += v
        else:
            s -= v
    return torch.from_numpy(plus)


def signs_torch(running_sum, stream):
    """GPU path: tensor-valued signs keep the loop free of host synchronisations."""
    plus = torch.empty(len(stream), dtype=torch.bool, device=running_sum.device)
    for r, v in enumerate(stream):
        plus[r] = torch.dot(running_sum, v) <= 0
        running_sum.add_(v * sign_as_float(plus[r]))
    return plus


class IndependentPairBalance(PairBalancer):
    """I-PB: every worker runs its own pair balance on its own gradients (no coordination)."""

    name = "I-PB"

    def _reset_running_sums(self):
        self.running_sums = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)

    def _pair_signs(self, diffs):
        xp, (sums, diffs) = array_views(self.running_sums, diffs.contiguous())
        first_left = xp.zeros((self.n, diffs.shape[1]), dtype=bool) if xp is np else \
            torch.zeros(self.n, diffs.shape[1], dtype=torch.bool, device=self.device)
        for i in range(diffs.shape[1]):
            plus = (sums * diffs[:, i]).sum(1) <= 0  # every worker's own test at once
            sums += diffs[:, i] * (plus * 2.0 - 1)[:, None]
            first_left[:, i] = plus
        return torch.as_tensor(first_left, device=self.device)


def array_views(*tensors):
    """(numpy, NumPy arrays sharing memory) on the CPU, where per-op overhead is ~10x lower than
    torch's for these small per-position updates; (torch, the tensors) elsewhere. The loops below
    are written once against either."""
    if all(t.device.type == "cpu" for t in tensors):
        return np, [t.detach().numpy() for t in tensors]
    return torch, list(tensors)


class IndependentMeanBalance(OnlineBalancer):
    """I-B: GraB mean balance per worker (spec 1.1). Each unit's gradient is centred with the
    worker's stale mean of the previous epoch (zero in the first epoch), then signed by herding."""

    name = "I-B"

    def __init__(self, n_workers, m, d, seed=0, device="cpu", dtype=torch.float32):
        super().__init__(n_workers, m, d, seed, device, dtype)
        self.stale_mean = torch.zeros(self.n, self.d, dtype=dtype, device=self.device)

    def _reset_epoch_state(self):
        super()._reset_epoch_state()
        self.grad_sum = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)
        self.running_sums = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)
        self.left = torch.zeros(self.n, dtype=torch.long, device=self.device)
        self.right = torch.full((self.n,), self.m - 1, dtype=torch.long, device=self.device)

    def sort(self):
        if self._next_position == self.m:  # a full epoch was seen: its mean centres the next one
            self.stale_mean = self.grad_sum / self.m
        return super().sort()

    def step(self, grads, positions):
        positions = self._check_positions(positions)
        grads = self._check_grads(grads, positions.numel()).to(device=self.device, dtype=self.dtype)
        self._next_position += positions.numel()
        xp, (grads, grad_sum, stale_mean, sums, left, right, next_orders, orders) = array_views(
            grads, self.grad_sum, self.stale_mean, self.running_sums, self.left, self.right,
            self.next_orders, self.orders)
        workers = xp.arange(self.n) if xp is np else torch.arange(self.n, device=self.device)
        for i, position in enumerate(positions.tolist()):
            g = grads[:, i]
            grad_sum += g
            centred = g - stale_mean
            plus = (sums * centred).sum(1) <= 0
            sums += centred * (plus * 2.0 - 1)[:, None]
            next_orders[workers, xp.where(plus, left, right)] = orders[:, position]
            left += plus * 1
            right -= ~plus * 1
