"""Sorter behaviour: valid permutations, exactness against naive reference implementations, herding."""
import io

import pytest
import torch

from sorters import SORTER_NAMES, SORTERS, build_sorter, parallel_herding_bound
from sorters.fold import fold_map


def run_epoch(sorter, grads_of, k):
    """Step `sorter` through one epoch; grads_of(orders, positions) -> (n, len(positions), d)."""
    orders = sorter.sort()
    step_epoch(sorter, orders, grads_of, k)
    return orders


def step_epoch(sorter, orders, grads_of, k):
    """The step() calls of one epoch that uses `orders` (n, m), k positions at a time."""
    m = orders.shape[1]
    for t in range(0, m, k):
        positions = torch.arange(t, min(t + k, m))
        sorter.step(grads_of(orders, positions) if sorter.uses_grads else None, positions)


def unit_vectors(n, m, d, seed=0):
    """(n, m, d) random unit vectors, centred per worker (the paper's herding simulation)."""
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(seed))
    z = z / z.norm(dim=2, keepdim=True)
    return z - z.mean(dim=1, keepdim=True)


def gather_units(z):
    """grads_of for fixed per-unit vectors z (n, m, d): the vectors of the units at those positions."""
    return lambda orders, positions: torch.stack([z[j, orders[j, positions]] for j in range(len(z))])


def is_permutation(row, m):
    return torch.equal(torch.sort(row).values, torch.arange(m))


@pytest.mark.parametrize("name", SORTER_NAMES)
@pytest.mark.parametrize("m,k", [(12, 1), (12, 2), (12, 4), (12, 5), (11, 1), (11, 2), (11, 3), (9, 4)])
def test_orders_are_permutations_every_epoch(name, m, k):
    n, d = 3, 5
    z = unit_vectors(n, m, d)
    sorter = build_sorter(name, n_workers=n, m=m, d=d, seed=1, epochs=4)  # epochs: KH-SGD, SBW
    # SWR's rows draw with replacement: unit ids in 0..m-1, repeats allowed
    valid = is_permutation if getattr(SORTERS[name], "permutes", True) else \
        (lambda row, m: bool(((row >= 0) & (row < m)).all()))
    for _ in range(4):
        orders = run_epoch(sorter, gather_units(z), k)
        assert orders.shape == (n, m) and orders.dtype == torch.long
        assert all(valid(row, m) for row in orders), orders
    assert all(valid(row, m) for row in sorter.sort())


@pytest.mark.parametrize("name", SORTER_NAMES)
def test_same_seed_same_orders_and_state_round_trip(name):
    n, m, d = 2, 10, 4
    z = unit_vectors(n, m, d)
    a, b = (build_sorter(name, n, m, d, seed=7, epochs=3) for _ in range(2))
    for _ in range(3):
        assert torch.equal(run_epoch(a, gather_units(z), 2), run_epoch(b, gather_units(z), 2))
    restored = build_sorter(name, n, m, d, seed=123, epochs=3)
    restored.load_state_dict(a.state_dict())
    for _ in range(3):
        assert torch.equal(run_epoch(a, gather_units(z), 2), run_epoch(restored, gather_units(z), 2))


def test_d_rr_is_fresh_and_independent_per_worker_and_d_so_is_fixed():
    rr = build_sorter("D-RR", n_workers=4, m=50, d=1, seed=0)
    first = run_epoch(rr, None, 5)
    second = run_epoch(rr, None, 5)
    assert not torch.equal(first, second)
    assert len({tuple(row.tolist()) for row in first}) == 4  # the original drew one permutation for all ranks
    assert not torch.equal(first, build_sorter("D-RR", 4, 50, 1, seed=1).sort())
    so = build_sorter("D-SO", n_workers=4, m=50, d=1, seed=0)
    assert torch.equal(run_epoch(so, None, 5), run_epoch(so, None, 5))


@pytest.mark.parametrize("m,by_hand", [
    (6, [[0, 2, 4, 5, 3, 1], [0, 4, 3, 1, 5, 2], [0, 3, 5, 2, 1, 4]]),
    (7, [[0, 2, 4, 6, 5, 3, 1], [0, 4, 5, 1, 3, 6, 2], [0, 5, 3, 2, 6, 1, 4]]),
    (1, [[0], [0], [0]]), (2, [[0, 1], [0, 1], [0, 1]]), (3, [[0, 2, 1], [0, 1, 2], [0, 2, 1]]),
])
def test_fold_map_by_hand(m, by_hand):
    """Epoch e+1 uses the first order read at the positions by_hand[e] (the map, then the map twice, ...):
    evens ascending, then odds descending; for m odd the last unit sits in the middle slot."""
    assert fold_map(m).tolist() == by_hand[0]
    n = 2
    sorter = build_sorter("Fold", n_workers=n, m=m, d=3, seed=0)
    assert not sorter.uses_grads
    first = run_epoch(sorter, None, 1)
    for positions in by_hand:
        assert torch.equal(run_epoch(sorter, None, 1), first[:, positions])


@pytest.mark.parametrize("n,m", [(1, 1), (1, 2), (3, 5), (4, 12), (2, 13), (5, 64)])
def test_fold_orders_are_permutations_and_start_from_the_cd_grab_order(n, m):
    fold, cd, rr = (build_sorter(name, n, m, d=2, seed=9) for name in ("Fold", "CD-GraB", "D-RR"))
    first = fold.sort()
    assert torch.equal(first, cd.sort()) and torch.equal(first, rr.sort())  # Sorter._random_orders, same seed
    fold.step(None, torch.arange(m))
    previous = first
    for _ in range(6):
        orders = run_epoch(fold, None, 3)
        assert all(is_permutation(row, m) for row in orders)
        assert torch.equal(orders, previous[:, fold_map(m)])
        previous = orders
    assert torch.equal(fold.sort(), previous[:, fold_map(m)])
    assert torch.equal(fold.sort(), previous[:, fold_map(m)])  # an epoch without steps keeps the order, as CD-GraB


def zero_pair_differences(n, m, d, seed):
    """grads_of whose two units of every pair (positions 2i, 2i+1) get the same, fresh random vector per
    worker and call: every pair difference is exactly 0, whether a pair lies within a step or across two."""
    generator = torch.Generator().manual_seed(seed)
    per_pair = []

    def grads_of(orders, positions):
        if int(positions[0]) == 0:
            per_pair.append(torch.randn(n, (m + 1) // 2, d, generator=generator))  # new vectors every epoch
        return per_pair[-1][:, positions // 2]
    return grads_of


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n,m", [(1, 8), (3, 12), (2, 13), (4, 7), (5, 20)])
def test_cd_grab_with_zero_pair_differences_gives_the_fold_orders(n, m, k):
    d = 4  # k = 1: every pair spans two steps; k even: pairs within a step; k = 3: both, and short last steps
    cd, fold = build_sorter("CD-GraB", n, m, d, seed=k), build_sorter("Fold", n, m, d, seed=k)
    grads_of = zero_pair_differences(n, m, d, seed=m)
    for _ in range(5):
        assert torch.equal(run_epoch(cd, grads_of, k), run_epoch(fold, None, k))
        assert not cd.running_sum.any()  # every sign was a tie, +1, and the shared sum stayed 0
    assert torch.equal(cd.sort(), fold.sort())


def test_cd_grab_on_real_differences_is_not_the_fold():
    n, m, d = 3, 16, 6
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(3))
    cd, fold = build_sorter("CD-GraB", n, m, d, seed=5), build_sorter("Fold", n, m, d, seed=5)
    got = [(run_epoch(cd, gather_units(z), 1), run_epoch(fold, None, 1)) for _ in range(4)]
    assert torch.equal(*got[0]) and not all(torch.equal(a, b) for a, b in got[1:])


def test_fold_state_round_trip_mid_run():
    n, m, d, k = 3, 10, 2, 2
    a = build_sorter("Fold", n, m, d, seed=4)
    for _ in range(2):
        run_epoch(a, None, k)
    orders = a.sort()
    for t in range(0, 4, k):  # stop in the middle of epoch 3, as a crash would
        a.step(None, torch.arange(t, t + k))
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)  # through a checkpoint file, as engine/checkpoint.py does
    buffer.seek(0)
    restored = build_sorter("Fold", n, m, d, seed=99)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    assert restored.epoch == 3 and torch.equal(restored.orders, orders)
    for sorter in (a, restored):
        for t in range(4, m, k):
            sorter.step(None, torch.arange(t, t + k))
    for _ in range(3):
        assert torch.equal(run_epoch(a, None, k), run_epoch(restored, None, k))
    with pytest.raises(ValueError, match="state is for m=10"):
        build_sorter("Fold", n, 12, d).load_state_dict(a.state_dict())


# --- naive reference implementations, written from the algorithms' definitions --------------

def reference_cd_grab(z, initial_orders, epochs):
    """CD-GraB as the original runs it (per example, per step, simulated): pairs (2i, 2i+1) of epoch
    positions; for each pair, for each worker j in turn, one shared running sum s: first goes left iff <s, first - second> <= 0. Returns orders per epoch."""
    n, m, d = z.shape
    orders, history = initial_orders.clone(), []
    for _ in range(epochs):
        history.append(orders.clone())
        nxt = torch.full((n, m), -1, dtype=torch.long)
        s = torch.zeros(d)
        left, right = 0, m - 1
        for i in range(m // 2):
            for j in range(n):
                a, b = orders[j, 2 * i], orders[j, 2 * i + 1]
                diff = z[j, a] - z[j, b]
                if torch.dot(s, diff) <= 0:
                    nxt[j, left], nxt[j, right], s = a, b, s + diff
                else:
                    nxt[j, left], nxt[j, right], s = b, a, s - diff
            left, right = left + 1, right - 1
        orders = nxt
    return history


def reference_mean_balance(z, initial_orders, epochs):
    """GraB's mean balance per worker: centre with the previous epoch's mean, herd, + to the front,
    - to the back."""
    n, m, d = z.shape
    orders, history = initial_orders.clone(), []
    stale = torch.zeros(n, d)
    for _ in range(epochs):
        history.append(orders.clone())
        nxt = torch.full((n, m), -1, dtype=torch.long)
        for j in range(n):
            s, left, right, total = torch.zeros(d), 0, m - 1, torch.zeros(d)
            for t in range(m):
                g = z[j, orders[j, t]]
                total += g
                c = g - stale[j]
                if torch.dot(s, c) <= 0:
                    nxt[j, left], left, s = orders[j, t], left + 1, s + c
                else:
                    nxt[j, right], right, s = orders[j, t], right - 1, s - c
            stale[j] = total / m
        orders = nxt
    return history


def reference_buggy_single_grad(z, initial_orders, epochs):
    """The original's single-gradient CD-GraB as it ran (bug 1): one unit per worker per step, the even
    step's gradients cached as a *reference* to a gather buffer that the odd step overwrites in place. m even."""
    n, m, d = z.shape
    orders, history = initial_orders.clone(), []
    for _ in range(epochs):
        history.append(orders.clone())
        nxt = torch.zeros(n, m, dtype=torch.long)
        s, left, right = torch.zeros(d), 0, m - 1
        buffer = torch.empty(n, d)  # allocated once per epoch
        for t in range(m):
            buffer.copy_(torch.stack([z[j, orders[j, t]] for j in range(n)]))  # all_gather_into_tensor
            if t % 2 == 0:
                cached = buffer  # the bug: no copy
                continue
            diffs = cached - buffer
            for j in range(n):
                if torch.dot(s, diffs[j]) <= 0:
                    nxt[j, left], nxt[j, right], s = orders[j, t - 1], orders[j, t], s + diffs[j]
                else:
                    nxt[j, left], nxt[j, right], s = orders[j, t], orders[j, t - 1], s - diffs[j]
            left, right = left + 1, right - 1
        orders = nxt
    return history


def test_fold_is_what_the_original_buggy_cd_grab_did():
    n, m, d = 3, 14, 5
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(12))
    fold = build_sorter("Fold", n, m, d, seed=6)
    expected = reference_buggy_single_grad(z, fold.orders, epochs=5)
    assert all(torch.equal(e, run_epoch(fold, None, 1)) for e in expected)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_cd_grab_matches_the_spec_stream_order(k):
    n, m, d = 3, 16, 6
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(3))
    sorter = build_sorter("CD-GraB", n, m, d, seed=5)
    expected = reference_cd_grab(z, sorter.orders, epochs=5)
    got = [run_epoch(sorter, gather_units(z), k) for _ in range(5)]
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert not torch.equal(got[0], got[-1])  # it really reorders


@pytest.mark.parametrize("k", [1, 2, 4])
def test_cd_grab_with_one_worker_is_plain_pair_balance(k):
    m, d = 20, 4
    z = torch.randn(1, m, d, generator=torch.Generator().manual_seed(4))
    cd, ipb = build_sorter("CD-GraB", 1, m, d, seed=2), build_sorter("I-PB", 1, m, d, seed=2)
    expected = reference_cd_grab(z, cd.orders, epochs=4)  # with n = 1 this is single-stream PairBalance
    for e in expected:
        assert torch.equal(run_epoch(cd, gather_units(z), k), e)
        assert torch.equal(run_epoch(ipb, gather_units(z), k), e)


def test_independent_pair_balance_is_cd_grab_per_worker():
    n, m, d = 3, 12, 5
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(6))
    sorter = build_sorter("I-PB", n, m, d, seed=1)
    start = sorter.orders.clone()
    got = [run_epoch(sorter, gather_units(z), 2) for _ in range(4)]
    for j in range(n):
        expected = reference_cd_grab(z[j:j + 1], start[j:j + 1], epochs=4)
        assert all(torch.equal(e[0], g[j]) for e, g in zip(expected, got))


def test_mean_balance_matches_the_spec():
    n, m, d = 2, 15, 4
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(8)) + 0.3  # not centred: the mean matters
    sorter = build_sorter("I-B", n, m, d, seed=3)
    expected = reference_mean_balance(z, sorter.orders, epochs=4)
    assert all(torch.equal(e, run_epoch(sorter, gather_units(z), 3)) for e in expected)


def test_pairing_across_steps_copies_the_cached_gradient():
    """Bug 1 (docs/differences.md): a caller that reuses one buffer for every step must not turn every
    diff into 0."""
    n, m, d = 2, 10, 3
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(9))
    fresh, reused = build_sorter("CD-GraB", n, m, d, seed=0), build_sorter("CD-GraB", n, m, d, seed=0)
    buffer = torch.empty(n, 1, d)

    def into_buffer(orders, positions):
        buffer.copy_(gather_units(z)(orders, positions))
        return buffer

    for _ in range(4):
        assert torch.equal(run_epoch(fresh, gather_units(z), 1), run_epoch(reused, into_buffer, 1))
    assert reused.running_sum.abs().sum() > 0


def test_balancing_lowers_the_parallel_herding_bound():
    n, m, d = 8, 256, 16
    z = unit_vectors(n, m, d, seed=1)
    bounds = {}
    for name in ("CD-GraB", "D-RR", "I-PB", "I-B"):
        sorter = build_sorter(name, n, m, d, seed=0)
        for _ in range(10):
            run_epoch(sorter, gather_units(z), 16)
        bounds[name] = parallel_herding_bound(z, sorter.sort())
    random_level = parallel_herding_bound(z, build_sorter("D-RR", n, m, d, seed=0).sort())
    assert bounds["CD-GraB"] < 0.25 * bounds["D-RR"], bounds
    assert bounds["CD-GraB"] < bounds["I-PB"], bounds
    assert bounds["CD-GraB"] < 0.25 * random_level, (bounds, random_level)


def test_parallel_herding_bound_by_hand():
    z = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]], [[0.0, 2.0], [0.0, -2.0]]])  # (n=2, m=2, d=2), centred
    assert parallel_herding_bound(z, torch.tensor([[0, 1], [0, 1]])) == 2.0
    assert parallel_herding_bound(z, torch.tensor([[1, 0], [1, 0]])) == 2.0
    z2 = torch.tensor([[[1.0], [-1.0]], [[1.0], [-1.0]]])
    assert parallel_herding_bound(z2, torch.tensor([[0, 1], [1, 0]])) == 0.0  # workers cancel each other
    assert parallel_herding_bound(z2, torch.tensor([[0, 1], [0, 1]])) == 2.0


def test_misuse_gets_clear_errors():
    with pytest.raises(ValueError, match="unknown sorter 'GraB'.*CD-GraB"):
        build_sorter("GraB", 2, 4, 3)
    sorter = build_sorter("CD-GraB", 2, 6, 3)
    sorter.sort()
    with pytest.raises(ValueError, match="expected positions 0"):
        sorter.step(torch.zeros(2, 2, 3), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"shape \(n, k, d\)"):
        sorter.step(torch.zeros(2, 2, 4), torch.tensor([0, 1]))
    sorter.step(torch.zeros(2, 2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ended after 2 of 6"):
        sorter.sort()
    with pytest.raises(ValueError, match="expected positions"):
        sorter.step(torch.zeros(2, 6, 3), torch.arange(2, 8))  # past the end of the epoch


def test_torch_code_path_used_on_gpus_gives_the_same_orders(monkeypatch):
    """The CPU runs the balancing loops on NumPy views; other devices run the same loops on torch."""
    import sorters.balance as balance
    import sorters.base as base

    n, m, d = 3, 14, 5
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(11))
    cpu_orders = {}
    for name in ("CD-GraB", "I-PB", "I-B"):
        sorter = build_sorter(name, n, m, d, seed=4)
        cpu_orders[name] = [run_epoch(sorter, gather_units(z), 3) for _ in range(4)]
    monkeypatch.setattr(base, "array_views", lambda *tensors: (torch, list(tensors)))
    for name, expected in cpu_orders.items():
        sorter = build_sorter(name, n, m, d, seed=4)
        assert all(torch.equal(e, run_epoch(sorter, gather_units(z), 3)) for e in expected), name


# ---------------------------------------------------------------- CD-GraB's exactness rule
NEAR_TIE = 1e-5  # the rule in CDGraB's docstring: signs may differ from float64 only where |<S, v>| <= this ||S|| ||v||


def check_against_float64_sequential(z, before, after):
    """Oracle for one epoch of CD-GraB: replay its pairs in the visiting order (pair-major, worker-minor)
    with a float64 running sum, and check that every sign the sorter chose (read off the next order:
    the first unit of pair p went left iff it sits in slot p) is the float64 rule's sign, except at
    near-ties, where the replay follows the sorter's sign. Returns the number of near-ties."""
    n, m, _ = z.shape
    z64, s, near_ties = z.double(), torch.zeros(z.shape[2], dtype=torch.float64), 0
    for p in range(m // 2):
        for j in range(n):
            first, second = before[j, 2 * p], before[j, 2 * p + 1]
            went_left = bool(after[j, p] == first)
            assert went_left or after[j, p] == second
            v = z64[j, first] - z64[j, second]
            dot = float(s @ v)
            if not s.any():  # the epoch's first difference (or a sum that cancelled exactly): a tie, +1
                assert went_left, (p, j)
            elif abs(dot) > NEAR_TIE * float(s.norm() * v.norm()):
                assert went_left == (dot <= 0), (p, j, dot)
            else:
                near_ties += 1
            s += v if went_left else -v
    return near_ties


@pytest.fixture(params=["cpu-loop", "gram", "gram-on-numpy"])
def sign_path(request, monkeypatch):
    """Both implementations of CD-GraB's signs: the CPU's compiled loop; the device path (signs_by_gram)
    forced on the CPU with torch tensors throughout; and sign_loop="gram" on the CPU (the NumPy
    bookkeeping with signs_by_gram). Returns the sign_loop to build the sorter with."""
    import sorters.base as base

    if request.param == "gram":
        monkeypatch.setattr(base, "array_views", lambda *tensors: (torch, list(tensors)))
    return "gram" if request.param == "gram-on-numpy" else "compiled"


@pytest.mark.parametrize("n,m,d,k", [(4, 64, 5, 4), (3, 40, 300, 1), (2, 30, 7, 3), (8, 16, 2000, 2)])
def test_cd_grab_signs_follow_a_float64_sequential_reference(sign_path, n, m, d, k):
    z = unit_vectors(n, m, d, seed=n + d) * torch.logspace(-3, 3, d)  # coordinates of very different scales
    sorter = build_sorter("CD-GraB", n, m, d, seed=1, sign_loop=sign_path)
    orders = sorter.sort()
    for _ in range(4):
        step_epoch(sorter, orders, gather_units(z), k)
        next_orders = sorter.sort()
        assert check_against_float64_sequential(z, orders, next_orders) == 0  # random data: every sign checked
        orders = next_orders


def test_cd_grab_near_ties_and_exact_ties(sign_path):
    """Pairs of equal units give zero differences (exact ties) and pairs that differ by 1e-6 in one
    coordinate that no other difference has give differences nearly orthogonal to the sum (near-ties):
    the signs of all other pairs still match the float64 rule."""
    n, m, d = 3, 48, 64
    sorter = build_sorter("CD-GraB", n, m, d, seed=2, sign_loop=sign_path)
    orders = sorter.sort()
    z = unit_vectors(n, m, d, seed=5)
    z[:, :, 0] = 0
    for j in range(n):
        for p in range(0, m // 2, 3):  # pair p equal, pair p + 1 equal but for coordinate 0
            z[j, orders[j, 2 * p + 1]] = z[j, orders[j, 2 * p]]
            z[j, orders[j, 2 * p + 3]] = z[j, orders[j, 2 * p + 2]]
            z[j, orders[j, 2 * p + 3], 0] = 1e-6
    step_epoch(sorter, orders, gather_units(z), 2)
    assert check_against_float64_sequential(z, orders, sorter.sort()) >= n * m // 6


def test_signs_by_gram_over_column_chunks_equals_one_chunk(monkeypatch):
    """The device path widens columns chunk by chunk for any d: several chunks give the signs of the
    float64 sequential rule and the same running sum as one chunk."""
    import sorters.balance as balance

    r, d = 12, 1000
    gen = torch.Generator().manual_seed(3)
    diffs = torch.randn(r, d, generator=gen)
    start = torch.randn(d, generator=gen, dtype=torch.float64) * 3
    expected_sum, expected = start.clone(), []
    for v in diffs.double():  # the sequential rule in float64
        expected.append(bool(expected_sum @ v <= 0))
        expected_sum += v if expected[-1] else -v
    one_chunk = start.clone()
    assert balance.signs_by_gram(one_chunk, diffs).tolist() == expected
    monkeypatch.setattr(balance, "GRAM_CHUNK_BYTES", 8 * r * 64)  # 64 columns per chunk: 16 chunks
    monkeypatch.setattr(balance, "GRAM_CHUNK_SHARE", 0.0)  # (not the differences' share: 2 chunks)
    chunked = start.clone()
    assert balance.signs_by_gram(chunked, diffs).tolist() == expected
    torch.testing.assert_close(chunked, expected_sum, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(one_chunk, expected_sum, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [1, 3])
def test_kept_references_give_the_copying_orders(k):
    """grads_stay_valid (the engine keeps each step's gradients until the next step): the sorter keeps a
    reference to an unpaired unit instead of copying it, with the same orders."""
    n, m, d = 3, 18, 6
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(13))
    copying, keeping = build_sorter("CD-GraB", n, m, d, seed=0), build_sorter("CD-GraB", n, m, d, seed=0)
    keeping.grads_stay_valid = True
    for _ in range(3):
        assert torch.equal(run_epoch(copying, gather_units(z), k), run_epoch(keeping, gather_units(z), k))
    assert "grads_stay_valid" not in keeping.state_dict()


# ------------------------------------------------------------------------------------------- state, device, dtype


def tensors_of(sorter) -> dict:
    return {key: value for key, value in vars(sorter).items() if torch.is_tensor(value)}


@pytest.mark.parametrize("name", ["CD-GraB", "I-PB", "I-B"])
def test_balancers_keep_their_state_on_their_device_in_their_dtype(name):
    """device="meta" (shapes and devices, no values) stands in for a GPU, dtype=float64 for the precision
    choice: every tensor a balancer keeps is there, in that dtype when it is floating point (CD-GraB's
    running sum is float64 in any case), and a state_dict from the CPU is moved there by load_state_dict."""
    cls = SORTERS[name]
    sorter = cls(2, 6, 3, seed=0, device="meta", dtype=torch.float64)
    shapes = {"orders": (2, 6), "next_orders": (2, 6), "running_sum": (3,), "running_sums": (2, 3),
              "stale_mean": (2, 3), "grad_sum": (2, 3), "left": (2,), "right": (2,),  # per worker: n = 2
              "nonfinite_record": (2,)}
    for key, value in tensors_of(sorter).items():
        assert value.device.type == "meta", key
        assert not value.is_floating_point() or value.dtype == torch.float64, key
        assert value.shape == shapes[key], key
    cpu = build_sorter(name, 2, 6, 3, seed=0)
    run_epoch(cpu, gather_units(unit_vectors(2, 6, 3)), 2)
    sorter.load_state_dict(cpu.state_dict())
    assert sorter.device.type == "meta"
    assert tensors_of(sorter) and all(value.device.type == "meta" for value in tensors_of(sorter).values())


@pytest.mark.parametrize("name", SORTER_NAMES)
def test_a_state_dict_is_a_snapshot_without_scratch_buffers(name):
    """What state_dict returns does not change as the sorter goes on (its tensors are copies), holds no
    device (a GPU run's checkpoint resumes on the CPU) and no scratch buffer (the pair balancers' cached
    unit: 1.75 GB for GPT-2), and reads back with weights_only=True."""
    n, m, d = 2, 7, 3
    z = unit_vectors(n, m, d, seed=2)
    sorter = build_sorter(name, n, m, d, seed=1, epochs=3)
    orders = sorter.sort()
    grads = gather_units(z)
    sorter.step(grads(orders, torch.arange(0, 3)) if sorter.uses_grads else None, torch.arange(0, 3))  # a pair open
    state = sorter.state_dict()
    assert not {"device", "_pending_storage", "grads_stay_valid"} & state.keys()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    kept = torch.load(buffer, weights_only=True)
    step_epoch_from(sorter, orders, grads, 3, 2)
    run_epoch(sorter, grads, 2)
    for key, value in kept.items():
        if torch.is_tensor(value):
            assert torch.equal(state[key], value), key


def step_epoch_from(sorter, orders, grads_of, start, k):
    """The rest of an epoch's step() calls, from position `start`, k positions at a time."""
    m = orders.shape[1]
    for t in range(start, m, k):
        positions = torch.arange(t, min(t + k, m))
        sorter.step(grads_of(orders, positions) if sorter.uses_grads else None, positions)


def test_a_cd_grab_state_with_a_float32_sum_loads_as_float64():
    """Checkpoints written before the running sum was float64 hold a float32 one."""
    n, m, d = 2, 8, 3
    z = unit_vectors(n, m, d, seed=5)
    saved = build_sorter("CD-GraB", n, m, d, seed=2)
    orders = saved.sort()
    step_epoch_from(saved, orders, gather_units(z), 0, 2)
    state = saved.state_dict()
    state["running_sum"] = state["running_sum"].float()
    loaded = build_sorter("CD-GraB", n, m, d, seed=2)
    loaded.load_state_dict(state)
    assert loaded.running_sum.dtype == torch.float64
    assert torch.equal(loaded.running_sum, saved.running_sum.float().double())


@pytest.mark.parametrize("name,units,placed", [
    ("I-B", [[1.0, 0.0], [1e-50, 0.0], [0.0, 1.0]], [0, 1, 2]),
    ("I-PB", [[1.0, 0.0], [0.0, 0.0], [1e-50, 0.0], [0.0, 0.0]], [0, 2, 3, 1]),
    ("CD-GraB", [[1.0, 0.0], [0.0, 0.0], [1e-50, 0.0], [0.0, 0.0]], [0, 2, 3, 1]),
])
def test_float64_gradients_are_balanced_in_the_sorters_float32(name, units, placed):
    """A float32 balancer rounds float64 gradients first: 1e-50 is 0 in float32, so the second unit (I-B) or
    pair (I-PB, CD-GraB) meets <sum, v> = 0 and goes left, as the first did: the next order is `placed` (the
    positions, in order; a pair's second unit fills the order from the right). Exact float64 would see
    1e-50 > 0 and send it right."""
    z = torch.tensor([units], dtype=torch.float64)  # one worker: (1, m, 2)
    sorter = build_sorter(name, 1, z.shape[1], 2, seed=0)
    first = sorter.sort()
    step_epoch_from(sorter, first, lambda orders, positions: z[:, positions], 0, z.shape[1])
    assert torch.equal(sorter.sort(), first[:, placed])


def test_every_refusal_of_a_sorter_word_for_word():
    """The whole message of each refusal (the engine and the sampler pass them on)."""
    def message(call, *args):
        with pytest.raises(ValueError) as info:
            call(*args)
        return str(info.value)

    assert message(build_sorter, "CD-GraB", 0, 4, 3) == "CD-GraB: need n_workers, m, d >= 1, got 0, 4, 3"
    assert message(build_sorter, "D-RR", 2, 0, 3) == "D-RR: need n_workers, m, d >= 1, got 2, 0, 3"
    assert message(build_sorter, "I-B", 2, 4, 0) == "I-B: need n_workers, m, d >= 1, got 2, 4, 0"
    sorter = build_sorter("CD-GraB", 2, 6, 3)
    sorter.sort()
    expected_first = "CD-GraB: expected positions 0...1 of 6, got "
    assert message(sorter.step, torch.zeros(2, 2, 3), torch.tensor([2, 3])) == expected_first + "[2, 3]"
    assert message(sorter.step, torch.zeros(2, 2, 3), range(1, 3)) == expected_first + "[1, 2]"
    assert message(sorter.step, torch.zeros(2, 2, 3), [0, 2]) == expected_first + "[0, 2]"
    assert message(sorter.step, torch.zeros(2, 0, 3), range(0, 0)) == "CD-GraB: expected positions 0...0 of 6, got []"
    assert message(sorter.step, torch.zeros(2, 0, 3), []) == "CD-GraB: expected positions 0...0 of 6, got []"
    assert message(sorter.step, torch.zeros(2, 2, 3), range(0, 4, 2)) == expected_first + "[0, 2]"
    assert message(sorter.step, torch.zeros(2, 2, 3), torch.tensor([2.0, 3.0])) == expected_first + "[2, 3]"
    assert message(sorter.step, torch.zeros(2, 2, 4), torch.tensor([0, 1])) == \
        "CD-GraB: grads must have shape (n, k, d) = (2, 2, 3), got (2, 2, 4)"
    assert message(sorter.step, None, range(0, 2)) == "CD-GraB: grads must have shape (n, k, d) = (2, 2, 3), got None"
    sorter.step(torch.zeros(2, 2, 3), range(0, 2))
    assert message(sorter.sort) == \
        "CD-GraB: the epoch ended after 2 of 6 positions; step() must see every position once per epoch"
    assert message(sorter.step, torch.zeros(2, 6, 3), torch.arange(2, 8)) == \
        "CD-GraB: expected positions 2...5 of 6, got [2, 3, 4, 5, 6, 7]"
    assert message(sorter.step, torch.zeros(2, 10, 3), torch.arange(2, 12)) == \
        "CD-GraB: expected positions 2...5 of 6, got [2, 3, 4, 5, 6, 7, 8, 9]"  # the first 8
    assert message(sorter.step, torch.zeros(2, 9, 3), range(2, 11)) == \
        "CD-GraB: expected positions 2...5 of 6, got [2, 3, 4, 5, 6, 7, 8, 9]"  # the first 8
    assert message(sorter.step, torch.zeros(2, 9, 3), range(2, 20, 2)) == \
        "CD-GraB: expected positions 2...5 of 6, got [2, 4, 6, 8, 10, 12, 14, 16]"
    assert message(build_sorter("CD-GraB", 2, 6, 4).load_state_dict, sorter.state_dict()) == \
        "CD-GraB: state is for d=3, sorter has 4"
    assert message(build_sorter("CD-GraB", 3, 6, 3).load_state_dict, sorter.state_dict()) == \
        "CD-GraB: state is for n=2, sorter has 3"


@pytest.mark.parametrize("name", SORTER_NAMES)
def test_the_classes_defaults_are_seed_zero_on_the_cpu(name):
    epochs = {"epochs": 3} if SORTERS[name].uses_total_epochs else {}
    plain, built = SORTERS[name](2, 6, 3, **epochs), build_sorter(name, 2, 6, 3, seed=0, device="cpu", epochs=3)
    assert plain.device == torch.device("cpu") and torch.equal(plain.orders, built.orders)
    assert not plain.uses_grads or plain.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["CD-GraB", "I-PB", "I-B"])
def test_a_step_on_another_device_keeps_everything_there(name, dtype):
    """The device path (torch ops, as on a GPU) on meta tensors: a step of CPU float32 gradients (moved to the
    sorter, in its dtype or not), including a pair left open for the next step, makes and keeps every tensor
    on the sorter's device, the floating ones in its dtype (CD-GraB's running sum and the differences it defers
    are float64 in any case)."""
    sorter = SORTERS[name](2, 6, 3, device="meta", dtype=dtype)
    sorter.sort()
    sorter.step(torch.zeros(2, 3, 3), range(0, 3))
    kept = tensors_of(sorter)
    if getattr(sorter, "pending", None) is not None:
        kept["pending"] = sorter.pending
    assert kept and all(value.device.type == "meta" for value in kept.values()), kept.keys()
    for key, value in kept.items():
        if value.is_floating_point():
            assert value.dtype == (torch.float64 if key in ("running_sum", "_deferred") else dtype), key


def sequential_gram_signs(a: list[float], gram: list[list[float]]) -> list[float]:
    """The sign rule from products, one difference after the other in Python floats (float64):
    sign_i = +1 when a_i + sum_{j<i} sign_j G_ij <= 0, else -1."""
    signs: list[float] = []
    for i, a_i in enumerate(a):
        dot = a_i + sum(sign * gram[i][j] for j, sign in enumerate(signs))
        signs.append(1.0 if dot <= 0 else -1.0)
    return signs


def test_gram_signs_equal_the_sequential_rule_for_every_block_size():
    """gram_signs, enumerated in blocks of up to ENUMERATED_SIGNS_MAX differences, gives the sequential
    rule's signs on random blocks of every size (a = D S, G = D D^T), on blocks of zero differences and a zero
    sum (exact ties: +1), and on blocks that repeat one difference (v, v, -v, ...: every later sign decided by
    the earlier ones)."""
    import sorters.balance as balance

    generator = torch.Generator().manual_seed(4)
    for r in [*range(1, balance.ENUMERATED_SIGNS_MAX + 2), 20, 24, 37]:
        for trial in range(12):
            diffs = torch.randn(r, 6, generator=generator, dtype=torch.float64) * 10.0 ** (trial % 4 - 2)
            start = torch.randn(6, generator=generator, dtype=torch.float64) * (trial % 3)  # 0: a zero sum
            if trial == 5:
                diffs[::2] = 0  # zero differences: exact ties
            if trial == 7:
                diffs[:] = diffs[0] * torch.tensor([1.0, -1.0] * r)[:r, None]
            a, gram = diffs @ start, diffs @ diffs.T
            expected = sequential_gram_signs(a.tolist(), gram.tolist())
            assert balance.gram_signs(a, gram).tolist() == expected, (r, trial)


def test_the_device_path_widens_at_most_a_share_of_the_differences_bytes_at_once(monkeypatch):
    """A chunk of columns is GRAM_CHUNK_BYTES widened, or GRAM_CHUNK_SHARE of the differences' own bytes when
    that is more: by hand, 4 float32 differences of 1,000 entries (16,000 bytes) with 320-byte chunks (10
    float64 columns) asked, and half their bytes allowed: 8,000 bytes, 250 columns, 4 chunks, not 100."""
    import sorters.balance as balance

    monkeypatch.setattr(balance, "GRAM_CHUNK_BYTES", 8 * 4 * 10)
    diffs, start = torch.randn(4, 1000), torch.zeros(1000, dtype=torch.float64)
    _, _, (columns, _) = balance.gram_products(start, diffs)
    assert columns == [slice(c, c + 250) for c in range(0, 1000, 250)]
    monkeypatch.setattr(balance, "GRAM_CHUNK_SHARE", 0.0)
    assert len(balance.gram_products(start, diffs)[2][0]) == 100


def test_differences_that_fit_one_chunk_are_made_in_float64_with_the_widened_float32_ones_results(monkeypatch):
    """The Gram step forms differences that fit one chunk directly in float64: each the float32 difference
    widened (not the exact float64 one); the orders and running sums are those of the same differences formed
    a chunk of columns at a time (7 chunks, each formed again for the sum's update but the last), bit for bit
    (tests/test_dispatch_count.py: no widening copy)."""
    import sorters.balance as balance
    from sorters.balance import CDGraB

    n, m, d, k = 3, 12, 700, 2
    # entries of very different sizes: a float32 difference rounds where the float64 one would not
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(21)) * torch.logspace(-6, 6, d)
    gathered = gather_units(z)
    firsts, seconds = z[:, 0:1], z[:, 1:2]
    assert not torch.equal((firsts - seconds).double(), firsts.double() - seconds.double())
    at_once = CDGraB(n, m, d, seed=1, sign_loop="gram")
    run_epoch(at_once, gathered, k)
    orders = run_epoch(at_once, gathered, k)
    monkeypatch.setattr(balance, "GRAM_CHUNK_BYTES", 8 * n * 100)  # 7 chunks of float32 differences
    monkeypatch.setattr(balance, "GRAM_CHUNK_SHARE", 0.0)
    chunked = CDGraB(n, m, d, seed=1, sign_loop="gram")
    run_epoch(chunked, gathered, k)
    assert torch.equal(run_epoch(chunked, gathered, k), orders)
    assert torch.equal(chunked.running_sum, at_once.running_sum)


@pytest.mark.parametrize("m,k", [(12, 2), (13, 1), (13, 3), (12, 4)])
@pytest.mark.parametrize("capacity,bound_by", [(256, "count"), (7, "count"), (7, "bytes")])
def test_deferred_pairs_give_each_steps_own_decisions(m, k, capacity, bound_by):
    """The Gram path defers the pairs' differences (DEFERRED_DIFFERENCES, and no more than DEFERRED_BYTES of
    float64 hold) and decides them together: when
    full (capacity 7: mid-epoch, a step's pairs split across decisions), at the epoch's last step, before a
    state is saved. Over 3 epochs (pairs across steps, a middle unit) the orders are those of every step's pairs
    decided in their step, the running sums equal to float64 rounding; a state saved mid-epoch holds no deferred
    pairs, and a sorter loaded from it continues with the same orders and sums as the one that saved it."""
    from sorters.balance import CDGraB

    n, d = 3, 10
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(m * k))
    grads_of = gather_units(z)
    deferred, each_step = CDGraB(n, m, d, seed=2, sign_loop="gram"), CDGraB(n, m, d, seed=2, sign_loop="gram")
    each_step.DEFERRED_DIFFERENCES = 0
    if bound_by == "count":
        deferred.DEFERRED_DIFFERENCES = capacity
    else:
        deferred.DEFERRED_BYTES = 8 * d * capacity + 8 * d - 1  # capacity float64 differences, not one more
    for _ in range(3):
        assert torch.equal(run_epoch(deferred, grads_of, k), run_epoch(each_step, grads_of, k))
        torch.testing.assert_close(deferred.running_sum, each_step.running_sum, rtol=1e-12, atol=1e-12)
    assert deferred._deferred is not None and deferred._deferred.shape == (capacity, d)
    orders = deferred.sort()
    assert torch.equal(orders, each_step.sort())
    half = (m // 2) // k * k
    for t in range(0, half, k):
        deferred.step(grads_of(orders, torch.arange(t, t + k)), torch.arange(t, t + k))
    assert deferred._deferred_count > 0 or capacity < n
    state = deferred.state_dict()
    assert deferred._deferred_count == 0 and not any(key.startswith("_deferred") for key in state)
    resumed = CDGraB(n, m, d, seed=2, sign_loop="gram")
    resumed.DEFERRED_DIFFERENCES, resumed.DEFERRED_BYTES = deferred.DEFERRED_DIFFERENCES, deferred.DEFERRED_BYTES
    resumed.sort()
    resumed.step(grads_of(orders, torch.arange(0, k)) * 3, torch.arange(0, k))  # deferred pairs the state drops
    resumed.load_state_dict(state)
    for sorter in (deferred, resumed):
        for t in range(half, m, k):
            positions = torch.arange(t, min(t + k, m))
            sorter.step(grads_of(orders, positions), positions)
    assert torch.equal(deferred.sort(), resumed.sort()) and torch.equal(deferred.running_sum, resumed.running_sum)


@pytest.mark.parametrize("n,k", [(3, 2), (3, 3), (18, 2)])
def test_a_compiled_gram_sign_step_gives_the_eager_orders_and_sums(n, k):
    """CDGraB.compile_sign_step (aot_eager: the traced operators themselves) over 3 epochs, k = 3 with a pending
    unit, 18 workers in two blocks of signs: the same orders and running sums as the eager Gram path, bit for
    bit; a compiled loop refuses it."""
    from sorters.balance import CDGraB

    m, d = 12, 10
    eager, compiled = CDGraB(n, m, d, seed=1, sign_loop="gram"), CDGraB(n, m, d, seed=1, sign_loop="gram")
    compiled.compile_sign_step("aot_eager")
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(5))
    for _ in range(3):
        assert torch.equal(run_epoch(eager, gather_units(z), k), run_epoch(compiled, gather_units(z), k))
        assert torch.equal(eager.running_sum, compiled.running_sum)
    with pytest.raises(ValueError, match="sign_loop='gram'"):
        CDGraB(n, m, d, sign_loop="compiled").compile_sign_step("aot_eager")


@pytest.mark.parametrize("chunks", [1, 2, 3, 6])
def test_the_device_path_forms_products_and_sums_chunk_by_chunk(monkeypatch, chunks):
    """signs_by_gram (the sign rule off the CPU) with the differences widened `d / chunks` columns at a time
    (GRAM_CHUNK_BYTES): the chunks gram_products reports, a = D S and G = D D^T, the float64 sequential rule's
    signs, the sum updated to S + D^T signs, and no warning (no output resized on the way)."""
    import warnings

    import sorters.balance as balance

    r, d = 5, 6
    width = d // chunks
    monkeypatch.setattr(balance, "GRAM_CHUNK_BYTES", 8 * r * width)
    generator = torch.Generator().manual_seed(chunks)
    diffs, start = torch.randn(r, d, generator=generator), torch.randn(d, dtype=torch.float64, generator=generator)
    wide = diffs.double()
    a, gram, (columns, last) = balance.gram_products(start, diffs)
    assert columns == [slice(c, c + width) for c in range(0, d, width)]
    assert torch.equal(last, wide[:, d - width:])
    assert torch.allclose(a, wide @ start, rtol=0, atol=1e-12)
    assert torch.allclose(gram, wide @ wide.T, rtol=0, atol=1e-12)
    expected, s = [], start.clone()
    for v in wide:
        plus = bool(s @ v <= 0)
        s += v if plus else -v
        expected.append(plus)
    running_sum = start.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        signs = balance.signs_by_gram(running_sum, diffs)
    assert signs.tolist() == expected
    assert torch.allclose(running_sum, s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,units", [
    ("I-B", [[1.0, 1.0], [2.0 ** -30, 0.0], [-1.0, 1.0], [0.0, 0.0]]),
    ("I-PB", [[1.0, 1.0], [0.0, 0.0], [1.0, 2.0 ** -30], [0.0, 1.0]]),
    ("CD-GraB", [[1.0, 1.0], [0.0, 0.0], [1.0, 2.0 ** -30], [0.0, 1.0]]),
])
def test_a_float64_balancer_keeps_what_float32_rounds_away(name, units):
    """dtype=torch.float64, fed float32 gradients: differences and sums are formed in float64. Here float32
    rounds 1 - 2^-30 to 1, so <sum, v> is 0 there (the unit or pair goes left: the next order's positions
    0, 2, 3, 1) but 2^-30 > 0 in float64 (it goes right: 0, 3, 2, 1)."""
    z = torch.tensor([units], dtype=torch.float32)  # one worker: (1, 4, 2), every value exact in float32
    placed = {torch.float32: [0, 2, 3, 1], torch.float64: [0, 3, 2, 1]}
    for dtype, expected in placed.items():
        sorter = SORTERS[name](1, 4, 2, seed=0, dtype=dtype)
        first = sorter.sort()
        step_epoch_from(sorter, first, lambda orders, positions: z[:, positions], 0, 4)
        assert torch.equal(sorter.sort(), first[:, expected]), dtype


def test_positions_of_any_integer_type_and_form():
    """A range, a list, an int64 or int32 tensor, a NumPy int32 array: the same step."""
    import numpy as np

    n, m, d = 2, 8, 3
    z = unit_vectors(n, m, d, seed=6)
    expected = build_sorter("CD-GraB", n, m, d, seed=3)
    expected_orders = [run_epoch(expected, gather_units(z), 2) for _ in range(2)]
    forms = [lambda t: range(t, t + 2), lambda t: [t, t + 1], lambda t: torch.arange(t, t + 2),
             lambda t: torch.arange(t, t + 2, dtype=torch.int32), lambda t: np.arange(t, t + 2, dtype=np.int32)]
    for form in forms:
        sorter = build_sorter("CD-GraB", n, m, d, seed=3)
        for epoch in range(2):
            orders = sorter.sort()
            assert torch.equal(orders, expected_orders[epoch])
            for t in range(0, m, 2):
                sorter.step(gather_units(z)(orders, torch.arange(t, t + 2)), form(t))


@pytest.mark.parametrize("name", SORTER_NAMES)
def test_orders_are_long_tensors_every_epoch(name):
    sorter = build_sorter(name, 2, 7, 3, seed=0, epochs=3)
    for _ in range(3):
        orders = run_epoch(sorter, gather_units(unit_vectors(2, 7, 3)), 3)
        assert orders.dtype == torch.long


def test_a_balancer_that_leaves_a_slot_empty_is_caught_at_the_next_sort():
    """next_orders starts as -1 in every slot; sort() refuses to hand out an order with a slot left so."""
    from sorters.balance import IndependentPairBalance

    class Lazy(IndependentPairBalance):
        def _place_pairs(self, xp, first_left, first):  # forgets to place the pairs
            pass

    sorter = Lazy(1, 4, 2)
    sorter.sort()
    sorter.step(torch.zeros(1, 4, 2), range(0, 4))
    with pytest.raises(AssertionError) as info:
        sorter.sort()
    assert str(info.value) == "balancer left a slot of next_orders empty"


@pytest.mark.parametrize("keep", [False, True])
def test_strided_gradients_reach_the_compiled_loop_contiguous(keep):
    """Gradients that are a strided view (here the (k, n, d) buffer of a caller, transposed) give the orders of
    contiguous ones, and the compiled loop only ever sees C-contiguous arrays (strided views lose its SIMD
    loop), also for a unit kept by reference across steps (grads_stay_valid, k odd)."""
    from sorters.balance import _pair_signs_cpu

    n, m, d, k = 3, 12, 4, 3
    z = unit_vectors(n, m, d, seed=4)
    plain, strided = build_sorter("CD-GraB", n, m, d, seed=1), build_sorter("CD-GraB", n, m, d, seed=1)
    strided.grads_stay_valid = keep
    kept = []  # a caller that keeps its buffers for the sorter holds them until the next step

    def transposed(orders, positions):
        buffer = gather_units(z)(orders, positions).transpose(0, 1).contiguous()  # (k, n, d)
        kept.append(buffer)
        return buffer.transpose(0, 1)  # (n, k, d), not contiguous

    for _ in range(3):
        assert torch.equal(run_epoch(plain, gather_units(z), k), run_epoch(strided, transposed, k))
    for signature in _pair_signs_cpu().signatures:
        assert all(getattr(t, "layout", "C") == "C" for t in signature), signature


def test_the_cached_units_buffer_is_allocated_once():
    """The copy of a step's unpaired last unit goes into one (n, d) buffer, reused at every odd step (a fresh
    one per pair would cost page faults, for GPT-2 a 1.75 GB allocation, every other step)."""
    n, m, d = 2, 12, 3
    z = unit_vectors(n, m, d, seed=5)
    sorter = build_sorter("CD-GraB", n, m, d, seed=0)
    pointers = set()
    for _ in range(2):
        orders = sorter.sort()
        for t in range(0, m, 3):
            sorter.step(gather_units(z)(orders, torch.arange(t, t + 3)), torch.arange(t, t + 3))
            if sorter.pending is not None:
                pointers.add(sorter.pending.data_ptr())
    assert len(pointers) == 1


def test_on_the_cpu_cd_grab_signs_with_the_compiled_loop(monkeypatch):
    """CPU tensors take the NumPy views and the compiled loop; signs_by_gram is for other devices."""
    import sorters.balance as balance

    def not_on_the_cpu(*args):
        raise AssertionError("signs_by_gram called for CPU tensors")

    monkeypatch.setattr(balance, "signs_by_gram", not_on_the_cpu)
    sorter = build_sorter("CD-GraB", 2, 8, 3, seed=0)
    for _ in range(2):
        run_epoch(sorter, gather_units(unit_vectors(2, 8, 3)), 2)


def test_the_gram_loop_on_the_cpu_gives_the_compiled_loops_orders_and_checkpoints_leave_the_choice():
    """sign_loop="gram" on the CPU equals the compiled loop, epoch by epoch, with pairs across steps (k odd);
    a state saved by one loads into the other, which keeps its own loop."""
    n, m, d = 3, 22, 40
    z = unit_vectors(n, m, d, seed=8)
    compiled = build_sorter("CD-GraB", n, m, d, seed=3, sign_loop="compiled")
    gram = build_sorter("CD-GraB", n, m, d, seed=3, sign_loop="gram")
    for _ in range(3):
        assert torch.equal(run_epoch(compiled, gather_units(z), 3), run_epoch(gram, gather_units(z), 3))
    assert compiled.sign_loop == "compiled" and gram.sign_loop == "gram"
    resumed = build_sorter("CD-GraB", n, m, d, seed=9, sign_loop="gram")
    resumed.load_state_dict(compiled.state_dict())
    assert "sign_loop" not in compiled.state_dict() and resumed.sign_loop == "gram"
    assert torch.equal(run_epoch(compiled, gather_units(z), 1), run_epoch(resumed, gather_units(z), 1))


def test_sign_loop_refusals_and_defaults():
    with pytest.raises(ValueError) as info:
        build_sorter("CD-GraB", 2, 6, 3, sign_loop="fast")
    assert str(info.value) == "CD-GraB: sign_loop must be 'gram', or 'compiled' on the CPU, got 'fast' on cpu"
    with pytest.raises(ValueError, match="got 'compiled' on meta"):
        build_sorter("CD-GraB", 2, 6, 3, device="meta", sign_loop="compiled")
    assert build_sorter("CD-GraB", 2, 6, 3).sign_loop == "compiled"
    assert build_sorter("CD-GraB", 2, 6, 3, device="meta").sign_loop == "gram"
    assert not hasattr(build_sorter("I-PB", 2, 6, 3, sign_loop="gram"), "sign_loop")  # ignored by the others


@pytest.mark.parametrize("device,model_d,sorted_d,expected", [
    ("cpu", 2**20, 1024, "gram"),            # sketches of a large model
    ("cpu", 2**20 - 1, 1024, "compiled"),    # of a smaller one
    ("cpu", 2**23, 2**23, "compiled"),       # exact gradients: the compiled loop is far faster
    ("cpu", 26, 26, "compiled"),
    ("meta", 26, 26, "gram"), ("meta", 2**23, 64, "gram"),
])
def test_sign_loop_for_a_model(device, model_d, sorted_d, expected):
    from sorters.balance import sign_loop_for
    assert sign_loop_for(device, model_d, sorted_d) == expected


def test_the_gram_loop_and_a_large_models_sketched_sampler_never_load_numba():
    """What the Gram path saves is numba and LLVM: a CPU process that balances with it (directly, and
    through CDGraBSampler with sketches of a 2^20-parameter model) never imports numba; the compiled loop does."""
    import subprocess
    import sys
    from pathlib import Path
    script = """
import sys, torch
from sorters import CDGraBSampler, build_sorter
sorter = build_sorter("CD-GraB", 2, 10, 5, sign_loop=sys.argv[1])
for _ in range(2):
    sorter.sort()
    for t in range(0, 9, 3):
        sorter.step(torch.randn(2, 3, 5), range(t, t + 3))
    sorter.step(torch.randn(2, 1, 5), range(9, 10))
sampler = CDGraBSampler(8, batch_size=2, d=2**20, sketch_dim=16, num_replicas=2)
print(sorter.sign_loop, sampler.sorter.sign_loop, "numba" in sys.modules)
"""
    repo = Path(__file__).resolve().parents[1]
    for loop, loaded in (("gram", "False"), ("compiled", "True")):
        out = subprocess.run([sys.executable, "-c", script, loop], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.split()
        assert out == [loop, "gram", loaded]


def test_the_gram_loop_never_touches_the_compiled_one(monkeypatch):
    """sign_loop="gram" on the CPU neither warms up nor calls numba's loop (in-process twin of the subprocess
    check above, which a mutation run cannot see)."""
    import sorters.balance as balance

    def compiled_loop():
        raise AssertionError("the compiled sign loop was loaded for a Gram-loop sorter")

    monkeypatch.setattr(balance, "_pair_signs_cpu", compiled_loop)
    sorter = build_sorter("CD-GraB", 2, 8, 3, seed=0, sign_loop="gram")
    for _ in range(2):
        run_epoch(sorter, gather_units(unit_vectors(2, 8, 3)), 3)


def test_array_views_contract():
    """CPU tensors: NumPy views sharing their memory (detached when they require grad); NumPy arrays pass
    through; anything off the CPU: torch and the tensors themselves."""
    import numpy as np

    from sorters.base import array_views

    plain, with_grad, array = torch.zeros(3), torch.zeros(2, requires_grad=True), np.ones(4)
    xp, (a, b, c) = array_views(plain, with_grad, array)
    assert xp is np and c is array
    a[0] = 5.0
    b[1] = 7.0
    assert plain[0] == 5.0 and with_grad[1] == 7.0
    meta = torch.zeros(3, device="meta")
    xp, views = array_views(meta, torch.zeros(1))
    assert xp is torch and views[0] is meta
