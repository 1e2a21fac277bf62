"""The balancing sorters: CD-GraB (coordinated), and the independent per-worker baselines I-PB and I-B."""
import functools

import numpy as np
import torch

from sorters.base import OnlineBalancer, PairBalancer, array_views, pair_views, sign_as_float


class CDGraB(PairBalancer):
    """CD-GraB (spec 1.5-1.7): online pair balance over the concatenated stream of all workers'
    pair differences, with ONE running sum shared by every worker.

    Visiting order: for each pair (outer), for each worker j = 0..n-1 (inner). Worker j's sign thus
    accounts for the pairs of workers 0..j-1 at the same step and for every earlier pair. Every
    process that runs it on the same all-gathered gradients computes identical orders.
    """

    name = "CD-GraB"

    def __init__(self, n_workers, m, d, seed=0, device="cpu", dtype=torch.float32):
        super().__init__(n_workers, m, d, seed, device, dtype)
        if self.device.type == "cpu":  # compile (or load) the sign loop now, not inside the first epoch
            units = np.zeros((1, 2, 1), np.float32)
            _pair_signs_cpu()(np.zeros(1, np.float32), units, 0, units, 1, np.empty((1, 1), np.bool_),
                              _MINUS_PLUS_ONE[np.float32])

    def _reset_running_sums(self):
        self.running_sum = torch.zeros(self.d, dtype=self.dtype, device=self.device)

    def _pair_signs(self, xp, first_units, first_index, second_units, second_index, n_pairs):
        if xp is np:
            plus = np.empty((n_pairs, self.n), dtype=np.bool_)  # (P, n): the visiting order
            s = self.running_sum.numpy()  # shares memory: the loop updates the sum in place
            _pair_signs_cpu()(s, first_units, first_index, second_units, second_index, plus,
                              _MINUS_PLUS_ONE[s.dtype.type])
            return plus.T
        firsts, seconds = pair_views(first_units, first_index, second_units, second_index, n_pairs)
        stream = (firsts - seconds).transpose(0, 1).reshape(-1, self.d)  # pair-major, worker-minor
        return signs_torch(self.running_sum, stream).reshape(-1, self.n).T


_MINUS_PLUS_ONE = {t: np.array([-1, 1], dtype=t) for t in (np.float16, np.float32, np.float64)}


@functools.cache
def _pair_signs_cpu():
    """CD-GraB's sign loop on the CPU, compiled by numba on first use (about a second; cached on disk).

    signs(s (d,), first_units (n, k1, d), first_index, second_units (n, k2, d), second_index, plus (P, n),
    minus_plus_one (2,)) visits the pair differences v = first_units[j, first_index + 2p] -
    second_units[j, second_index + 2p] pair-major (p), worker-minor (j), and for each sets
    plus[p, j] = <s, v> <= 0 (ties go to +1) and s += v if plus else s -= v, in place. The unit arrays
    must be C-contiguous (strided views lose the SIMD loop: 4-5x slower at d = 5,569).

    One pass per vector: while adding difference r it accumulates the inner product of the updated
    sum with difference r + 1, and differences are formed on the fly, so the sum is read and written
    once per vector and no difference is stored. The reduction may be reordered (SIMD), as a BLAS dot
    is; nothing else is.
    """
    from numba import njit

    @njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
    def signs(s, first_units, first_index, second_units, second_index, plus, minus_plus_one):
        n_pairs, n = plus.shape
        d = s.shape[0]
        zero = s[0] - s[0]  # in the sum's dtype
        dot = zero
        f, g = first_units[0, first_index], second_units[0, second_index]
        for i in range(d):
            dot += s[i] * (f[i] - g[i])
        for p in range(n_pairs):
            for j in range(n):
                plus[p, j] = dot <= 0
                sign = minus_plus_one[1] if plus[p, j] else minus_plus_one[0]
                f, g = first_units[j, first_index + 2 * p], second_units[j, second_index + 2 * p]
                if j + 1 < n or p + 1 < n_pairs:
                    jn, pn = (j + 1, p) if j + 1 < n else (0, p + 1)
                    fn, gn = first_units[jn, first_index + 2 * pn], second_units[jn, second_index + 2 * pn]
                    dot = zero
                    for i in range(d):
                        s[i] += sign * (f[i] - g[i])
                        dot += s[i] * (fn[i] - gn[i])
                else:
                    for i in range(d):
                        s[i] += sign * (f[i] - g[i])

    return signs


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

    def _pair_signs(self, xp, first_units, first_index, second_units, second_index, n_pairs):
        sums = array_views(self.running_sums)[1][0] if xp is np else self.running_sums
        firsts, seconds = pair_views(first_units, first_index, second_units, second_index, n_pairs)
        diffs = firsts - seconds
        first_left = xp.zeros((self.n, diffs.shape[1]), dtype=bool) if xp is np else \
            torch.zeros(self.n, diffs.shape[1], dtype=torch.bool, device=self.device)
        for i in range(diffs.shape[1]):
            plus = (sums * diffs[:, i]).sum(1) <= 0  # every worker's own test at once
            sums += diffs[:, i] * (plus * 2.0 - 1)[:, None]
            first_left[:, i] = plus
        return first_left


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
        start, k = self._check_positions(positions)
        grads = self._check_grads(grads, k).to(device=self.device, dtype=self.dtype)
        self._next_position += k
        xp, (grads, grad_sum, stale_mean, sums, left, right, next_orders, orders) = array_views(
            grads, self.grad_sum, self.stale_mean, self.running_sums, self.left, self.right,
            self.next_orders, self.orders)
        workers = xp.arange(self.n) if xp is np else torch.arange(self.n, device=self.device)
        for i, position in enumerate(range(start, start + k)):
            g = grads[:, i]
            grad_sum += g
            centred = g - stale_mean
            plus = (sums * centred).sum(1) <= 0
            sums += centred * (plus * 2.0 - 1)[:, None]
            next_orders[workers, xp.where(plus, left, right)] = orders[:, position]
            left += plus * 1
            right -= ~plus * 1
