"""Compiled (numba) loops of KH-SGD and SBW, the randomised-threshold pair balancers (sorters/randomized.py).

Imported on first use (numba takes a moment to import). Everything lives at module level: numba
caches a compiled function on disk only when the functions it calls are module globals, not closures.

`decide` is the one place where a rule is written; `rule_signs` (the CPU path, one fused pass over d
per difference, like CD-GraB's loop in sorters/balance.py) and `rule_signs_from_gram` (the device
path's sequential recursion over a block's inner products) both call it.

Rule state: one float64 array `state`, updated in place, with the slots below.
"""
import math

import numpy as np
from numba import njit
from numpy.typing import NDArray

KH, SBW = 1, 2  # rule codes
# slots of `state`: the index i of the next pair difference in the epoch's visiting order; KH's v (twice
# the squared sub-Gaussian constant, reset every epoch); SBW's b_max (the largest pair-difference norm
# seen so far in the run); and two constants of the epoch: KH's penalty factor F (L_i = log(F (i + 1)))
# and SBW's c / b_max
INDEX, KH_V, SBW_B_MAX, KH_PENALTY_FACTOR, SBW_C_OVER_B_MAX = range(5)
_STATE_SLOTS = 5


@njit(cache=True, nogil=True)
def decide(rule: int, dot: float, b2: float, draws: NDArray[np.float64], state: NDArray[np.float64]) -> bool:
    """Add (True: the pair's first unit goes left, S += v) or subtract, for the next pair difference v
    with dot = <S, v> and b2 = ||v||^2 (both float64), and advance the pair index."""
    i = np.int64(state[INDEX])
    state[INDEX] = i + 1
    if rule == KH:
        u = draws[i]  # U_i, uniform in [-1, 1]
        if b2 == 0.0:
            # a zero difference (dot is exactly 0): the published code's threshold is NaN here, so it adds
            # iff U_i >= 0 and leaves v alone
            return u >= 0.0
        penalty = math.log(state[KH_PENALTY_FACTOR] * (i + 1))
        v = state[KH_V]
        ratio = v * penalty / b2
        if ratio <= 1.0:
            threshold = b2
            state[KH_V] = 2.0 * b2
        else:
            root = math.sqrt(ratio)
            threshold = root * b2
            state[KH_V] = v + 2.0 * b2 * max(0.0, penalty + 0.5 - root) / penalty
        return dot <= u * threshold
    # SBW: c = b_max * 30 log(...), b_max including this difference; u uniform in [0, 1)
    b = math.sqrt(b2)
    if b > state[SBW_B_MAX]:
        state[SBW_B_MAX] = b
    return dot <= state[SBW_B_MAX] * state[SBW_C_OVER_B_MAX] * (1.0 - 2.0 * draws[i])


@njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def rule_signs(rule: int, s: NDArray[np.float64], first_units: NDArray[np.floating], first_index: int,
               second_units: NDArray[np.floating], second_index: int, plus: NDArray[np.bool_],
               draws: NDArray[np.float64], state: NDArray[np.float64]) -> None:
    """The CPU path: CD-GraB's one-pass loop with the rule's decision.

    s (d,) float64 running sum, updated in place; first_units (n, k1, d), second_units (n, k2, d),
    C-contiguous, in the units' dtype; plus (P, n) bool, filled in the visiting order (pair p major,
    worker j minor) with the decision for v = first_units[j, first_index + 2p] - second_units[j,
    second_index + 2p]. While adding difference r it accumulates <S, v> and ||v||^2 of difference r + 1,
    so the sum is read and written once per vector. Differences are formed in the units' dtype, then
    widened; the sums accumulate in float64 and may be reordered (SIMD).
    """
    n_pairs, n = plus.shape
    d = s.shape[0]
    dot, b2 = 0.0, 0.0
    f, g = first_units[0, first_index], second_units[0, second_index]
    for i in range(d):
        x = np.float64(f[i] - g[i])
        dot += s[i] * x
        b2 += x * x
    for p in range(n_pairs):
        for j in range(n):
            add = decide(rule, dot, b2, draws, state)
            plus[p, j] = add
            sign = 1.0 if add else -1.0
            f, g = first_units[j, first_index + 2 * p], second_units[j, second_index + 2 * p]
            if j + 1 < n or p + 1 < n_pairs:
                jn, pn = (j + 1, p) if j + 1 < n else (0, p + 1)
                fn, gn = first_units[jn, first_index + 2 * pn], second_units[jn, second_index + 2 * pn]
                dot, b2 = 0.0, 0.0
                for i in range(d):
                    s[i] += sign * (f[i] - g[i])
                    x = np.float64(fn[i] - gn[i])
                    dot += s[i] * x
                    b2 += x * x
            else:
                for i in range(d):
                    s[i] += sign * (f[i] - g[i])


@njit(cache=True, nogil=True)
def rule_signs_from_gram(rule: int, a: NDArray[np.float64], gram: NDArray[np.float64], signs: NDArray[np.float64],
                         draws: NDArray[np.float64], state: NDArray[np.float64]) -> None:
    """The device path's recursion, on the host: a (r,) = D S and gram (r, r) = D D^T (float64) of a
    block of r differences in visiting order; fills signs (r,) float64 with +1 (add) or -1, using
    <S_i, v_i> = a_i + sum_{j<i} sign_j G_ij and ||v_i||^2 = G_ii."""
    for i in range(a.shape[0]):
        dot = a[i]
        for j in range(i):
            dot += signs[j] * gram[i, j]
        signs[i] = 1.0 if decide(rule, dot, gram[i, i], draws, state) else -1.0
