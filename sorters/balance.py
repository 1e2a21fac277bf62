"""The balancing sorters: CD-GraB (coordinated), and the independent per-worker baselines I-PB and I-B."""
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from sorters.base import HostOrDeviceArray, OnlineBalancer, PairBalancer, array_views, pair_views


class CDGraB(PairBalancer):
    """CD-GraB (the paper's Algorithm 2): online pair balance over the concatenated stream of all
    workers' pair differences, with ONE running sum shared by every worker.

    Visiting order: for each pair (outer), for each worker j = 0..n-1 (inner). Worker j's sign thus
    accounts for the pairs of workers 0..j-1 at the same step and for every earlier pair. Every
    process that runs it on the same all-gathered gradients computes identical orders.

    Exactness rule. The running sum S is kept in float64. Each pair difference v (formed in the
    gradients' float32) gets the sign +1 (first unit to the left) when <S, v> <= 0, else -1, and
    S += sign * v. Both implementations below give the signs of a float64 sequential reference of
    exactly this rule, except where ``|<S, v>| <= 1e-5 ||S|| ||v||`` (a near-tie, where rounding may
    decide), and the same orders from run to run and on every rank (fixed reduction orders):

    - on the CPU, a compiled sequential loop (`_pair_signs_cpu`): float64 sum, float64 dot;
    - elsewhere (GPUs), `signs_by_gram`: per step the r = n * pairs differences D (r, d), then
      a = D S and G = D D^T in float64, the r signs by the recursion
      <S_i, v_i> = a_i + sum_{j<i} sign_j G_ij, and S += D^T signs: a few matrix products and
      a handful of small kernels per block of up to 16 differences instead of two passes over d per
      difference.

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient (or sketch).
        seed: the seed of every random draw (the first epoch's orders).
        device: where the orders and the running sums live.
        dtype: the dtype of a kept unpaired gradient (the gradients' dtype).
        sign_loop: ``"compiled"`` (the numba loop; CPU only), ``"gram"`` (``signs_by_gram``, on any device), or
            None: ``"compiled"`` on the CPU, ``"gram"`` elsewhere. ``sign_loop_for`` says which one pays for a
            model.
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`).

    Raises:
        ValueError: an unknown sign loop, or ``"compiled"`` off the CPU (and `Sorter`'s checks).
    """

    name = "CD-GraB"
    SIGN_LOOPS = ("compiled", "gram")

    # how the signs are computed, not what they are (a state holds no deferred pairs: `state_dict` decides them)
    NOT_IN_STATE = PairBalancer.NOT_IN_STATE + ("sign_loop", "_gram_step", "_gram_decide", "_deferred",
                                                "_deferred_count", "_deferred_position", "DEFERRED_DIFFERENCES",
                                                "DEFERRED_BYTES")
    # the Gram path keeps the pairs' differences of several steps and decides them at once, up to this many,
    # their float64 copies at most DEFERRED_BYTES: the same signs, a few kernels per block of differences and
    # one placement instead of a sign step and a placement every step (bench/dispatch_count.py); 0: decide
    # every step's pairs in that step. (The LSTM's 4 x 1.08 M differences a pair of steps: 7 pairs kept.)
    DEFERRED_DIFFERENCES = 256
    DEFERRED_BYTES = 256 * 2**20

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, sign_loop: str | None = None, nonfinite: str = "raise") -> None:
        super().__init__(n_workers, m, d, seed, device, dtype, nonfinite)
        if sign_loop is None:
            sign_loop = "compiled" if self.device.type == "cpu" else "gram"
        if sign_loop not in self.SIGN_LOOPS or (sign_loop == "compiled" and self.device.type != "cpu"):
            raise ValueError(f"{self.name}: sign_loop must be 'gram', or 'compiled' on the CPU, got {sign_loop!r} "
                             f"on {self.device}")
        self.sign_loop = sign_loop  # not in checkpoints: a resumed run may take the other loop (same signs)
        # the Gram path's step (sign_loop "gram"); compile_sign_step puts torch.compile's version here
        self._gram_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = _gram_pair_signs
        self._gram_decide: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = signs_by_gram  # deferred pairs'
        self._deferred: torch.Tensor | None = None  # (capacity, d) float64: deferred differences, visiting order
        if sign_loop == "compiled":  # compile (or load) the sign loop now, not inside the first epoch
            units = np.zeros((1, 2, 1), np.float32)
            _pair_signs_cpu()(np.zeros(1, np.float64), units, 0, units, 1, np.empty((1, 1), np.bool_),
                              _MINUS_PLUS_ONE)

    def _reset_running_sums(self) -> None:
        self.running_sum = torch.zeros(self.d, dtype=torch.float64, device=self.device)
        self._deferred_count, self._deferred_position = 0, 0  # deferred differences; their first pair's position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (`Sorter.load_state_dict`); a float32 running sum of an older
        checkpoint is widened to float64.

        Args:
            state: what ``state_dict()`` returned.
        """
        super().load_state_dict(state)
        # checkpoints written before the sum was float64 hold a float32 one
        self.running_sum = self.running_sum.to(torch.float64)
        self._deferred_count = 0  # pairs deferred before the state was loaded are not the state's

    def _deferral_capacity(self) -> int:
        """How many differences the Gram path keeps to decide at once (0: the compiled loop decides each step's)."""
        if self.sign_loop != "gram":
            return 0
        return min(self.DEFERRED_DIFFERENCES, self.DEFERRED_BYTES // (8 * self.d))

    def _balance_pairs(self, xp: ModuleType, first_units: HostOrDeviceArray, first_index: int,
                       second_units: HostOrDeviceArray, second_index: int, n_pairs: int, first_position: int) -> None:
        """The Gram path: the pairs' differences, formed in float64 (each the units' difference widened), join
        the deferred ones; they are decided together when no more fit, at the epoch's last step, or before a
        state is saved (`_place_deferred_pairs`). Pairs follow each other in visiting order (epoch positions,
        then workers), so deciding them together is the sequential rule over the same differences."""
        r, capacity = self.n * n_pairs, self._deferral_capacity()
        follows = first_position == self._deferred_position + 2 * (self._deferred_count // self.n)
        if self._deferred_count and (self._deferred_count + r > capacity or not follows):
            self._place_deferred_pairs()
        if r > capacity:  # the compiled loop, or more differences than are kept: decided now
            super()._balance_pairs(xp, first_units, first_index, second_units, second_index, n_pairs, first_position)
            return
        if self._deferred is None or self._deferred.shape[0] != capacity:
            self._deferred = torch.empty(capacity, self.d, dtype=torch.float64, device=self.device)
        if xp is np:  # tensors sharing the arrays' memory
            first_units, second_units = torch.from_numpy(first_units), torch.from_numpy(second_units)
        firsts, seconds = pair_views(first_units, first_index, second_units, second_index, n_pairs)
        if not self._deferred_count:
            self._deferred_position = first_position
        rows = self._deferred[self._deferred_count:self._deferred_count + r].view(n_pairs, self.n, self.d)
        torch.sub(firsts.transpose(0, 1), seconds.transpose(0, 1), out=rows)  # pair-major, worker-minor
        self._deferred_count += r

    def _place_deferred_pairs(self) -> None:
        """Decide the deferred differences' signs (`signs_by_gram`, which updates the running sum) and place
        their pairs."""
        if not self._deferred_count:
            return
        assert self._deferred is not None
        first_left = self._gram_decide(self.running_sum, self._deferred[:self._deferred_count])
        first_left = first_left.view(-1, self.n).T  # (n, P)
        self._deferred_count = 0
        if self.device.type == "cpu":
            self._place_pairs(np, first_left.numpy(), self._deferred_position)
        else:
            self._place_pairs(torch, first_left, self._deferred_position)

    def _pair_signs(self, xp: ModuleType, first_units: HostOrDeviceArray, first_index: int,
                    second_units: HostOrDeviceArray, second_index: int, n_pairs: int) -> HostOrDeviceArray:
        if xp is np and self.sign_loop == "compiled":
            plus = np.empty((n_pairs, self.n), dtype=np.bool_)  # (P, n): the visiting order
            s = self.running_sum.numpy()  # shares memory: the loop updates the sum in place
            _pair_signs_cpu()(s, first_units, first_index, second_units, second_index, plus, _MINUS_PLUS_ONE)
            return plus.T
        if xp is np:  # the Gram path on the CPU: tensors sharing the arrays' memory
            first_units, second_units = torch.from_numpy(first_units), torch.from_numpy(second_units)
        firsts, seconds = pair_views(first_units, first_index, second_units, second_index, n_pairs)
        first_left = self._gram_step(self.running_sum, firsts, seconds)
        return first_left.numpy() if xp is np else first_left

    def compile_sign_step(self, backend: str = "inductor") -> None:
        """Take the Gram sign step (sign_loop "gram": the pairs' differences, a and G, the signs, the running
        sum's update) through torch.compile with `backend`, one graph a step shape: inductor fuses its dozen
        small operators into a few kernels (on a GPU, launches: bench/dispatch_count.py); "aot_eager" runs the
        traced operators as they are. The same rule and signs; not part of the state.

        Raises:
            ValueError: the sorter's sign loop is not "gram" (one line).
        """
        if self.sign_loop != "gram":
            raise ValueError(f"{self.name}: compile_sign_step compiles the Gram sign step; this sorter takes "
                             f"sign_loop={self.sign_loop!r} (build it with sign_loop='gram')")
        self._gram_step = torch.compile(_gram_pair_signs, backend=backend, dynamic=False)
        self._gram_decide = torch.compile(signs_by_gram, backend=backend, dynamic=False)



# sign_loop_for: models of at least this many parameters whose gradients are balanced as sketches take the
# Gram path on the CPU too (bench/balancing_loop.py gives both loops' cost per vector)
_GRAM_ON_CPU_MIN_PARAMS = 2**20


def sign_loop_for(device: str | torch.device, model_d: int, sorted_d: int) -> str:
    """CD-GraB's sign loop for a model of model_d parameters whose sorter balances sorted_d-dimensional
    vectors (sorted_d < model_d: sketches) on `device`: "gram" off the CPU; on the CPU "compiled" (numba),
    except for sketches of a model of _GRAM_ON_CPU_MIN_PARAMS parameters or more: there the Gram path's
    per-vector overhead on short vectors vanishes beside a step that forms per-unit gradients of a large
    model, while importing numba and LLVM is a fixed cost in resident memory (docs/sketching.md measures
    both). For exact gradients that long the compiled loop is much faster, so it stays."""
    if torch.device(device).type != "cpu":
        return "gram"
    return "gram" if sorted_d < model_d and model_d >= _GRAM_ON_CPU_MIN_PARAMS else "compiled"


_MINUS_PLUS_ONE = np.array([-1.0, 1.0])


@functools.cache
def _pair_signs_cpu() -> Callable[..., None]:
    """CD-GraB's sign loop on the CPU, compiled by numba on first use (about a second; cached on disk).

    signs(s (d,) float64, first_units (n, k1, d), first_index, second_units (n, k2, d), second_index,
    plus (P, n), minus_plus_one (2,) float64) visits the pair differences v = first_units[j, first_index
    + 2p] - second_units[j, second_index + 2p] pair-major (p), worker-minor (j), and for each sets
    plus[p, j] = <s, v> <= 0 (ties go to +1) and s += v if plus else s -= v, in place. The unit arrays
    must be C-contiguous (strided views lose the SIMD loop).

    One pass per vector: while adding difference r it accumulates the inner product of the updated
    sum with difference r + 1, and differences are formed on the fly, so the sum is read and written
    once per vector and no difference is stored. Differences are formed in the units' dtype, then
    widened; the dot accumulates in float64 and may be reordered (SIMD), as a BLAS dot is.
    """
    from numba import njit

    @njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
    def signs(s: NDArray[np.float64], first_units: NDArray[np.floating], first_index: int,
              second_units: NDArray[np.floating], second_index: int, plus: NDArray[np.bool_],
              minus_plus_one: NDArray[np.float64]) -> None:
        n_pairs, n = plus.shape
        d = s.shape[0]
        dot = 0.0
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
                    dot = 0.0
                    for i in range(d):
                        s[i] += sign * (f[i] - g[i])
                        dot += s[i] * (fn[i] - gn[i])
                else:
                    for i in range(d):
                        s[i] += sign * (f[i] - g[i])

    return signs


GRAM_CHUNK_BYTES = 64 * 2**20  # float64 copies of the differences are made this many bytes at a time, or
GRAM_CHUNK_SHARE = 0.5         # this share of the differences' own bytes when that is more: at most 2 / share
                               # chunks, each a few kernels a step (bench/dispatch_count.py), the copy's memory
                               # bounded by the differences' own; CD-GraB's step forms no float32 copy of them,
                               # so its chunks take twice the share (at most 2), and differences that fit one
                               # chunk are made in float64 at once (the LSTM's 4 x 1.08 M: one chunk, not two)


def _gram_pair_signs(running_sum: torch.Tensor, firsts: torch.Tensor, seconds: torch.Tensor) -> torch.Tensor:
    """CD-GraB's signs for n workers' P pairs (firsts, seconds: (n, P, d) views), visited pair-major, worker-
    minor, by the Gram path (`signs_by_gram`'s products, running_sum (d,) float64 updated in place). Returns
    (n, P) bool, True = the pair's first unit goes left.

    The differences are written in float64 by the subtraction itself (torch.sub computes in the units' dtype
    and casts to out's: each is the same difference widened), pair-major: at once when they fit one chunk
    (_gram_columns), else a chunk of columns at a time, straight from the units, and again for the running
    sum's update (the last chunk kept); no float32 copy of them is made, so a chunk may take the bytes that
    copy would have (twice GRAM_CHUNK_SHARE of the units' bytes)."""
    n, P, d = firsts.shape
    if torch.compiler.is_compiling():  # (a compiled graph lays the difference out itself; out= does not trace)
        return signs_by_gram(running_sum, (firsts.transpose(0, 1) - seconds.transpose(0, 1)).reshape(-1, d)
                             ).reshape(-1, n).T
    r = n * P
    columns = _gram_columns(r, d, firsts.element_size(), share=2 * GRAM_CHUNK_SHARE)
    buffer = torch.empty(r * (columns[0].stop - columns[0].start), dtype=torch.float64, device=firsts.device)

    def widened(cols: slice) -> torch.Tensor:  # (r, cols) float64 differences, pair-major, worker-minor
        wide = buffer[:r * (cols.stop - cols.start)].view(P, n, cols.stop - cols.start)
        torch.sub(firsts[..., cols].transpose(0, 1), seconds[..., cols].transpose(0, 1), out=wide)
        return wide.view(r, -1)

    a, gram, last = _products_by_chunk(running_sum, columns, widened)
    signs = gram_signs(a, gram)
    _add_signed_by_chunk(running_sum, columns, widened, last, signs)
    return (signs > 0).reshape(-1, n).T


def signs_by_gram(running_sum: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    """The signs of CD-GraB's sequential rule for a block of r differences, without a pass over d per
    difference and without a host synchronisation (the device path; the CPU uses the compiled loop).

    running_sum: (d,) float64 S, updated in place to S + D^T signs; diffs: (r, d) D, in visiting order.
    Returns (r,) bool, True = sign +1 (<S_i, v_i> <= 0). With a = D S and G = D D^T in float64,
    <S_i, v_i> = a_i + sum_{j<i} sign_j G_ij (S_i = S + sum_{j<i} sign_j v_j). Columns are widened to
    float64 a chunk at a time (gram_products), so the extra memory stays bounded by D's own.
    """
    a, gram, widened = gram_products(running_sum, diffs)
    signs = gram_signs(a, gram)
    add_signed(running_sum, diffs, signs, widened)
    return signs > 0


# blocks of at most this many differences get their signs from every sign vector at once (2^r of them): a
# block of 16 is one product over 65,536 rows, a small kernel on a GPU and a few ms on the CPU (where the Gram
# path serves sketches of large models only), and each block is a handful of kernels (bench/dispatch_count.py)
ENUMERATED_SIGNS_MAX = 16


def gram_signs(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """The sequential rule's signs from products alone: a (r,) = <S, v_i>, gram (r, r) = <v_i, v_j>, both
    float64, for r differences in visiting order. Returns (r,) float64 of +-1: sign_i = +1 when
    <S_i, v_i> = a_i + sum_{j<i} sign_j G_ij <= 0. (Exact CD-GraB, sorters/exact.py, gets a and G without
    the differences.)

    Blocks of up to ENUMERATED_SIGNS_MAX differences in turn, each a fixed handful of kernels
    (_enumerated_gram_signs) after one product that adds the earlier blocks' signed terms to its a:
    <S_i, v_i> = (a_i + sum_{j < block} sign_j G_ij) + sum_{block <= j < i} sign_j G_ij. Only G_ij with
    j < i ever enters, within a block and from the earlier ones: G's strictly lower triangle, made once."""
    r = a.shape[0]
    below = torch.tril(gram, diagonal=-1)
    if r <= ENUMERATED_SIGNS_MAX:
        return _enumerated_gram_signs(a, below)
    signs = torch.empty(r, dtype=torch.float64, device=a.device)
    for i0 in range(0, r, ENUMERATED_SIGNS_MAX):
        i1 = min(r, i0 + ENUMERATED_SIGNS_MAX)
        block_a = a[i0:i1] if i0 == 0 else torch.addmv(a[i0:i1], below[i0:i1, :i0], signs[:i0])
        _enumerated_gram_signs(block_a, below[i0:i1, i0:i1], out=signs[i0:i1])
    return signs


def _enumerated_gram_signs(a: torch.Tensor, below: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gram_signs for a small block (a (r,); below (r, r) float64, the block's G_ij where j < i and zeros on
    and above the diagonal) without a kernel per difference: the inner
    products <S_i, v_i> = a_i + sum_{j<i} s_j G_ij under every one of the 2^r sign vectors s at once, then the
    vector whose every sign is the rule's own (<S_i, v_i> <= 0 exactly where s_i = +1). The sequential signs
    are such a vector, and the only one: by induction on i, a prefix that agrees fixes the next sign. The
    products of all sign vectors are one matrix product with a added (a few kernels whatever r); rows with the
    same prefix hold the same terms, the rest exact zeros, and should rounding ever make them disagree at a
    near-tie, the vector that agrees on the longest prefix is taken (scores weigh the agreement at i by
    2^(r-1-i)). Returns (r,) float64 of +-1, written into `out` (r,) when given (no copy). The scores are sums of
    distinct powers of two, exact in any order."""
    # (a compiled sign step makes the table in its graph: dynamo traces the cache's function itself)
    table = _sign_vectors.__wrapped__ if torch.compiler.is_compiling() else _sign_vectors
    vectors, base_scores, signed_weights, one = table(a.shape[0], a.device)
    R, r = vectors.shape
    # a vector's score: the weights 2^(r-1-i) of the signs it shares with the rule's, its base score (the weights of
    # its minus signs) plus, where the rule says +1 (<S_i, v_i> <= 0), its weight signed by its own sign
    if torch.compiler.is_compiling():  # a reduction, which fuses with the table and the scores (a BLAS call does not)
        dots = a + (vectors[:, None, :] * below).sum(-1)
        scores = base_scores + torch.where(dots <= 0, signed_weights, 0.0).sum(1)
    else:
        # -<S_i, v_i> under each sign vector (2^r, r), negated exactly by the product's own factors, so that one
        # heaviside says where the rule's sign is +1 (1 where the product is <= 0, ties included), and one
        # batched product with the base scores added gives the scores
        minus_dots = torch.addmm(a, vectors, below.T, beta=-1, alpha=-1)
        rule_plus = torch.heaviside(minus_dots, one)
        scores = torch.baddbmm(base_scores.view(R, 1, 1), rule_plus.view(R, 1, r), signed_weights.view(R, r, 1))
        scores = scores.view(R)
    # a 1-element index: a 0-d one is read on the host (a synchronisation)
    if out is None or torch.compiler.is_compiling():  # (out= does not trace)
        best = vectors[scores.argmax()[None]][0]
        return best if out is None else out.copy_(best)
    return torch.index_select(vectors, 0, scores.argmax()[None], out=out[None])[0]


@functools.cache
def _sign_vectors(r: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(every sign vector (2^r, r) float64 of +-1; _enumerated_gram_signs' base scores (2^r,), each vector's
    weights 2^(r-1-i) summed over its -1 signs; its weights signed by its signs (2^r, r); a float64 1), made once
    per r and device."""
    bits = torch.arange(r - 1, -1, -1, device=device)
    plus = (torch.arange(2 ** r, device=device)[:, None] >> bits & 1) == 0
    weights = (2.0 ** bits).to(torch.float64)
    vectors = plus.to(torch.float64) * 2 - 1
    return vectors, torch.where(plus, 0.0, weights).sum(1), vectors * weights, torch.ones((), dtype=torch.float64,
                                                                                          device=device)


def _gram_columns(r: int, d: int, element_size: int, share: float | None = None) -> list[slice]:
    """The chunks of columns gram_products widens to float64 one at a time, for r differences of length d and
    element_size bytes: GRAM_CHUNK_BYTES widened, or `share` (default GRAM_CHUNK_SHARE) of the differences'
    own bytes when that is more."""
    share = GRAM_CHUNK_SHARE if share is None else share
    chunk_bytes = max(GRAM_CHUNK_BYTES, int(share * r * d * element_size))
    width = max(1, chunk_bytes // (8 * r))
    return [slice(c, min(c + width, d)) for c in range(0, d, width)]


def gram_products(running_sum: torch.Tensor,
                  diffs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[list[slice], torch.Tensor]]:
    """(a, G, widened) for the device path: a = D S (r,) and G = D D^T (r, r) in float64, from the (r, d)
    differences D widened to float64 a chunk of columns at a time (_gram_columns; float64 differences are
    one chunk, used as they are); `widened` is (columns, the last chunk widened), which add_signed reuses."""
    r, d = diffs.shape
    columns = [slice(0, d)] if diffs.dtype == torch.float64 else _gram_columns(r, d, diffs.element_size())
    a, gram, last = _products_by_chunk(running_sum, columns, lambda cols: diffs[:, cols].to(torch.float64))
    return a, gram, (columns, last)


def add_signed(running_sum: torch.Tensor, diffs: torch.Tensor, signs: torch.Tensor,
               widened: tuple[list[slice], torch.Tensor]) -> None:
    """running_sum (d,) float64 += D^T signs, for diffs (r, d), signs (r,) float64 of +-1 and gram_products'
    `widened`."""
    columns, last = widened
    _add_signed_by_chunk(running_sum, columns, lambda cols: diffs[:, cols].to(torch.float64), last, signs)


def _products_by_chunk(running_sum: torch.Tensor, columns: list[slice],
                       widened: Callable[[slice], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a = D S (r,), G = D D^T (r, r), the last chunk) in float64, with widened(cols) giving D's columns cols
    as (r, cols) float64, one chunk of `columns` at a time; the first chunk makes a and G."""
    wide = widened(columns[0])
    a, gram = torch.mv(wide, running_sum[columns[0]]), torch.mm(wide, wide.T)
    for cols in columns[1:]:
        wide = widened(cols)
        a.addmv_(wide, running_sum[cols])
        gram.addmm_(wide, wide.T)
    return a, gram, wide


def _add_signed_by_chunk(running_sum: torch.Tensor, columns: list[slice], widened: Callable[[slice], torch.Tensor],
                         last: torch.Tensor, signs: torch.Tensor) -> None:
    """running_sum (d,) += D^T signs a chunk of columns at a time (as _products_by_chunk), the last chunk first:
    `last` is it, still widened; each column's update is its own, so the order changes nothing."""
    for cols in columns[::-1]:
        part = last if cols is columns[-1] else widened(cols)
        running_sum[cols].addmv_(part.T, signs)


class IndependentPairBalance(PairBalancer):
    """I-PB: every worker runs its own pair balance on its own gradients (no coordination).

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient (or sketch).
        seed: the seed of every random draw (the first epoch's orders).
        device: where the orders and the running sums live.
        dtype: the dtype of the running sums and of a kept unpaired gradient (the gradients' dtype).
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`).
    """

    name = "I-PB"

    def _reset_running_sums(self) -> None:
        self.running_sums = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)

    def _pair_signs(self, xp: ModuleType, first_units: HostOrDeviceArray, first_index: int,
                    second_units: HostOrDeviceArray, second_index: int, n_pairs: int) -> HostOrDeviceArray:
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
    """I-B: GraB mean balance per worker (GraB: Lu et al., NeurIPS 2022). Each unit's gradient is centred with the
    worker's stale mean of the previous epoch (zero in the first epoch), then signed by herding.

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient (or sketch).
        seed: the seed of every random draw (the first epoch's orders).
        device: where the orders, the means and the running sums live.
        dtype: the dtype of the means and the running sums (the gradients' dtype).
        nonfinite: ``"raise"`` or ``"skip"`` (`Sorter`).
    """

    name = "I-B"

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, nonfinite: str = "raise") -> None:
        super().__init__(n_workers, m, d, seed, device, dtype, nonfinite)
        self.stale_mean = torch.zeros(self.n, self.d, dtype=dtype, device=self.device)

    def _reset_epoch_state(self) -> None:
        super()._reset_epoch_state()
        self.grad_sum = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)
        self.running_sums = torch.zeros(self.n, self.d, dtype=self.dtype, device=self.device)
        self.left = torch.zeros(self.n, dtype=torch.long, device=self.device)
        self.right = torch.full((self.n,), self.m - 1, dtype=torch.long, device=self.device)

    def sort(self) -> torch.Tensor:
        if self._next_position == self.m:  # a full epoch was seen: its mean centres the next one
            self.stale_mean = self.grad_sum / self.m
        return super().sort()

    def step(self, grads: torch.Tensor | None, positions: torch.Tensor | list[int] | range) -> None:
        start, k = self._check_positions(positions)
        grads_tensor = self._check_grads(grads, k).detach().to(device=self.device, dtype=self.dtype)
        xp, (grads_xp,) = array_views(grads_tensor)
        grads_xp = self._screen_nonfinite(xp, grads_xp, start)
        self._next_position += k
        xp, (grads_xp, grad_sum, stale_mean, sums, left, right, next_orders, orders) = array_views(
            grads_xp, self.grad_sum, self.stale_mean, self.running_sums, self.left, self.right,
            self.next_orders, self.orders)
        workers = xp.arange(self.n) if xp is np else torch.arange(self.n, device=self.device)
        for i, position in enumerate(range(start, start + k)):
            g = grads_xp[:, i]
            grad_sum += g
            centred = g - stale_mean
            plus = (sums * centred).sum(1) <= 0
            sums += centred * (plus * 2.0 - 1)[:, None]
            next_orders[workers, xp.where(plus, left, right)] = orders[:, position]
            left += plus * 1
            right -= ~plus * 1
