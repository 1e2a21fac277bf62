"""The orderers a researcher would try instead of CD-GraB (issue #60): FlipFlop, SWR, Greedy, MB-GraB and RPB,
each against an oracle written here from the rule's definition (docs/sorters.md), not from the sorter's code.
The parametrized tests of every sorter (tests/test_sorters.py, tests/test_sampler*.py, tests/test_library_inputs.py)
run them too: permutations, state round trips, resuming at every step boundary, two gloo processes = one."""
import numpy as np
import pytest
import torch

from sorters import CDGraBSampler, build_sorter
from sorters.greedy import greedy_orders


def epoch_of(sorter, units, k):
    """sort(), then step() through the epoch k positions at a time with the fixed per-unit vectors units (n, m, d)."""
    orders = sorter.sort()
    n, m = orders.shape
    for t in range(0, m, k):
        positions = torch.arange(t, min(t + k, m))
        grads = torch.stack([units[j, orders[j, positions]] for j in range(n)]) if sorter.uses_grads else None
        sorter.step(grads, positions)
    return orders


def epochs_of(sorter, units, k, epochs):
    return [epoch_of(sorter, units, k) for _ in range(epochs)]


def vectors(n, m, d, seed=0, offset=0.7):
    """(n, m, d) random vectors, NOT centred (so that a rule that forgets to centre is seen)."""
    return torch.randn(n, m, d, generator=torch.Generator().manual_seed(seed)) + offset


def seeded_generator(seed, epoch, rank, stream):
    """The documented seeding: 64 bits of NumPy's SeedSequence of (seed mod 2**64, epoch, rank, stream)."""
    word = np.random.SeedSequence([seed % 2**64, epoch, rank, stream]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(word))


# ------------------------------------------------------------------------------------------ FlipFlop

def test_flipflop_reverses_each_workers_own_fresh_permutation_on_odd_epochs():
    """Epoch 2i: a fresh permutation of worker j's own units from (seed, 2i, j); epoch 2i + 1: exactly its
    reverse (worker j's own, never worker n - 1 - j's); worker j's orders do not depend on the number of
    workers (per-worker seeds, no communication)."""
    m, seed = 9, -5
    sorter = build_sorter("FlipFlop", 3, m, 1, seed=seed)
    orders = epochs_of(sorter, None, 4, 6)
    wider = epochs_of(build_sorter("FlipFlop", 5, m, 1, seed=seed), None, 2, 6)
    for e, epoch_orders in enumerate(orders):
        for j in range(3):
            fresh = torch.randperm(m, generator=seeded_generator(seed, e - e % 2, j, 1))
            assert torch.equal(epoch_orders[j], fresh if e % 2 == 0 else fresh.flip(0)), (e, j)
        assert torch.equal(wider[e][:3], epoch_orders)
        assert len({tuple(row.tolist()) for row in epoch_orders}) == 3  # the workers' orders differ
    assert not torch.equal(orders[0], orders[2])  # a fresh permutation every even epoch


def test_flipflop_and_swr_resume_from_the_epoch_count_alone():
    """The orders are a function of (seed, epoch, worker): a sorter of another seed loading a state continues
    with the saved run's orders."""
    for name in ("FlipFlop", "SWR"):
        first = build_sorter(name, 2, 7, 1, seed=11)
        expected = epochs_of(first, None, 3, 5)
        resumed = build_sorter(name, 2, 7, 1, seed=11)
        epochs_of(resumed, None, 3, 2)
        other = build_sorter(name, 2, 7, 1, seed=99)
        other.load_state_dict(resumed.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(epochs_of(other, None, 3, 3), expected[2:])), name


# ------------------------------------------------------------------------------------------ SWR

def test_swr_draws_each_workers_units_with_replacement_from_its_own_seed():
    m, seed = 40, 3
    orders = epochs_of(build_sorter("SWR", 3, m, 1, seed=seed), None, 5, 4)
    for e, epoch_orders in enumerate(orders):
        for j in range(3):
            draws = torch.randint(m, (m,), generator=seeded_generator(seed, e, j, 2))
            assert torch.equal(epoch_orders[j], draws), (e, j)
    assert all(len(set(row.tolist())) < m for row in orders[0])  # repeats: 40 draws of 40 (all distinct: 1e-16)
    assert torch.equal(epochs_of(build_sorter("SWR", 1, m, 1, seed=seed), None, 5, 1)[0][0], orders[0][0])


def test_swr_draws_are_uniform():
    """Over 400 epochs of 50 draws, every unit's count is within 5 standard deviations of 400."""
    sorter = build_sorter("SWR", 1, 50, 1, seed=0)
    counts = torch.zeros(50)
    for _ in range(400):
        counts += torch.bincount(sorter.sort()[0], minlength=50)
        sorter.step(None, range(50))
    assert (counts - 400).abs().max() < 5 * (400 * 49 / 50) ** 0.5


# ------------------------------------------------------------------------------------------ Greedy

def brute_force_greedy(units):
    """The greedy herding order by its definition, in float64: centre each worker's vectors, then at each position
    take the remaining unit u minimising ||s + x_u||, computing every candidate's norm (lowest id on a tie)."""
    n, m, _ = units.shape
    x = units.double() - units.double().mean(dim=1, keepdim=True)
    order = []
    for j in range(n):
        s, left, row = torch.zeros(x.shape[2], dtype=torch.float64), list(range(m)), []
        for _ in range(m):
            norms = (s + x[j, left]).norm(dim=1)
            u = left[int(torch.argmin(norms))]
            row.append(u)
            left.remove(u)
            s += x[j, u]
        order.append(row)
    return torch.tensor(order)


@pytest.mark.parametrize("m", [1, 5, 9, 150])  # 150: the kept vectors are compacted twice
def test_greedy_orders_are_the_brute_force_prefix_norm_search(m):
    units = vectors(3, m, 4, seed=m)
    assert torch.equal(greedy_orders(units), brute_force_greedy(units))


def test_greedy_sorter_starts_random_and_then_orders_by_the_previous_epochs_gradients():
    n, m, d = 2, 9, 3
    units = vectors(n, m, d, seed=1)
    orders = epochs_of(build_sorter("Greedy", n, m, d, seed=4), units, 2, 3)
    assert torch.equal(orders[0], build_sorter("D-SO", n, m, d, seed=4).sort())  # the seeded random first order
    assert torch.equal(orders[1], brute_force_greedy(units)) and torch.equal(orders[2], orders[1])
    # a gradient that changes from epoch to epoch: the order follows the stale (previous epoch's) one
    sorter = build_sorter("Greedy", n, m, d, seed=4)
    epoch_of(sorter, units, 2)
    epoch_of(sorter, -units ** 2, 4)
    assert torch.equal(epoch_of(sorter, units, 3), brute_force_greedy(-units ** 2))


def test_greedy_lowers_the_prefix_sums_below_a_random_order():
    units = vectors(1, 64, 8, seed=2)
    x = units[0] - units[0].mean(0)
    greedy = x[greedy_orders(units)[0]].cumsum(0).norm(dim=1).max()
    random = x[torch.randperm(64, generator=torch.Generator().manual_seed(0))].cumsum(0).norm(dim=1).max()
    assert greedy < random / 2


# ------------------------------------------------------------------------------------------ MB-GraB

def pair_balance(vectors_by_id, orders):
    """One epoch of coordinated pair balance: the next (n, M) order from the (n, M) order and per-id vectors."""
    n, count = orders.shape
    nxt = torch.full((n, count), -1)
    s = torch.zeros(vectors_by_id.shape[2], dtype=torch.float64)
    left, right = 0, count - 1
    for p in range(count // 2):
        for j in range(n):
            a, c = int(orders[j, 2 * p]), int(orders[j, 2 * p + 1])
            v = vectors_by_id[j, a] - vectors_by_id[j, c]
            if float(s @ v) <= 0:
                nxt[j, left], nxt[j, right], s = a, c, s + v
            else:
                nxt[j, left], nxt[j, right], s = c, a, s - v
        left, right = left + 1, right - 1
    if count % 2:
        nxt[:, left] = orders[:, count - 1]
    return nxt


@pytest.mark.parametrize("b,k_steps", [(2, 1), (3, 1), (4, 1), (2, 3)])  # m 12: 6, 4 or 3 (odd) micro-batches
def test_mb_grab_is_cd_grab_pair_balance_over_fixed_micro_batch_means(b, k_steps):
    n, m, d = 3, 12, 4
    units = vectors(n, m, d, seed=b)
    sorter = build_sorter("MB-GraB", n, m, d, seed=6, batch_size=b)
    first = build_sorter("D-SO", n, m, d, seed=6).sort()  # the seeded first order the micro-batches are cut from
    members = first.reshape(n, m // b, b)
    means = torch.stack([units.double()[j][members[j]].mean(dim=1) for j in range(n)])  # (n, M, d) by micro-batch id
    orders = epochs_of(sorter, units, b * k_steps, 4)
    block_orders = torch.empty(0)
    for e, epoch_orders in enumerate(orders):
        # every b consecutive positions hold one fixed micro-batch, in its fixed inner order
        ids = [[int(torch.nonzero((members[j] == epoch_orders[j, t * b:t * b + b]).all(1))) for t in range(m // b)]
               for j in range(n)]
        ids = torch.tensor(ids)
        if e:
            assert torch.equal(ids, pair_balance(means, block_orders)), e
        block_orders = ids


def test_mb_grab_takes_micro_batch_gradients_and_the_sampler_the_replicas_batch_gradients():
    """Handing MB-GraB the micro-batch gradients (n, k / b, d) gives the orders of handing it the units' own; so does
    the sampler's step with each replica's batch gradient (R, d) instead of the (R * b, d) per-example ones."""
    n, m, d, b = 2, 12, 3, 3
    units = vectors(n, m, d, seed=3)
    per_unit = epochs_of(build_sorter("MB-GraB", n, m, d, seed=1, batch_size=b), units, b, 3)
    sorter = build_sorter("MB-GraB", n, m, d, seed=1, batch_size=b)
    for expected in per_unit:
        orders = sorter.sort()
        assert torch.equal(orders, expected)
        for t in range(0, m, b):
            sorter.step(torch.stack([units[j, orders[j, t:t + b]].mean(0) for j in range(n)])[:, None], range(t, t + b))
    table = units.reshape(n * m, d)  # replica r's examples r*m .. (r+1)*m - 1 are units[r]
    samplers = [CDGraBSampler(n * m, batch_size=b, d=d, sorter="MB-GraB", num_replicas=n, seed=1) for _ in range(2)]
    for _ in range(3):
        batches = [torch.tensor(list(sampler)).split(n * b) for sampler in samplers]
        for batch_a, batch_b in zip(*batches):
            assert torch.equal(batch_a, batch_b)
            samplers[0].step(table[batch_a])
            samplers[1].step(table[batch_b].view(n, b, d).mean(1))
    assert torch.equal(samplers[0].all_indices(), samplers[1].all_indices())


# ------------------------------------------------------------------------------------------ RPB

def recursive_pair_oracle(units, orders, block):
    """One epoch of RPB by its definition (docs/sorters.md), float64, in plain Python: blocks of `block` positions;
    at tree node t (children 2t+1, 2t+2) pairs (0,1), (2,3), ... of the units it received, visited pair after pair,
    worker after worker, against node t's one sum; the first unit wins when <S_t, first - second> <= 0; winners
    (then an unpaired last unit) go left, losers right; leaf slots read column by column, odd slots backwards."""
    n, m, _ = units.shape
    sums = [torch.zeros(units.shape[2], dtype=torch.float64) for _ in range(block - 1)]
    blocks = (m + block - 1) // block
    slots = [[[None] * block for _ in range(blocks)] for _ in range(n)]

    def route(node, items, low, high, blk):  # items: per worker, the unit ids in arrival order
        if not items[0]:
            return
        if len(items[0]) == 1:
            for j in range(n):
                slots[j][blk][low] = items[j][0]
            return
        pairs = len(items[0]) // 2
        lefts, rights = [[] for _ in range(n)], [[] for _ in range(n)]
        for p in range(pairs):
            for j in range(n):
                a, c = items[j][2 * p], items[j][2 * p + 1]
                v = units[j, a].double() - units[j, c].double()
                wins = float(sums[node] @ v) <= 0
                sums[node] += v if wins else -v
                lefts[j].append(a if wins else c)
                rights[j].append(c if wins else a)
        if len(items[0]) % 2:
            for j in range(n):
                lefts[j].append(items[j][-1])
        middle = (low + high) // 2
        route(2 * node + 1, lefts, low, middle, blk)
        route(2 * node + 2, rights, middle, high, blk)

    for blk in range(blocks):
        route(0, [orders[j, blk * block:(blk + 1) * block].tolist() for j in range(n)], 0, block, blk)
    result = []
    for j in range(n):
        row = []
        for slot in range(block):
            column = [slots[j][blk][slot] for blk in range(blocks)]
            row += [u for u in (column[::-1] if slot % 2 else column) if u is not None]
        result.append(row)
    return torch.tensor(result)


@pytest.mark.parametrize("block,m,k", [(4, 16, 4), (8, 16, 3), (4, 13, 2), (8, 13, 5), (16, 7, 1)])
def test_rpb_is_the_recursive_pair_rule_with_one_sum_per_node_for_all_workers(block, m, k):
    n, d = 2, 3
    units = vectors(n, m, d, seed=m + block)
    sorter = build_sorter("RPB", n, m, d, seed=2)
    sorter = type(sorter)(n, m, d, seed=2, block=block)
    orders = epochs_of(sorter, units, k, 3)
    for before, after in zip(orders, orders[1:]):
        assert torch.equal(after, recursive_pair_oracle(units, before, block))


@pytest.mark.parametrize("n,m,k", [(3, 12, 1), (3, 11, 2), (2, 13, 3)])
def test_rpb_with_blocks_of_two_is_cd_grab(n, m, k):
    units = vectors(n, m, 4, seed=n * m)
    rpb = build_sorter("RPB", n, m, 4, seed=3)
    rpb = type(rpb)(n, m, 4, seed=3, block=2)
    cd_grab = build_sorter("CD-GraB", n, m, 4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(epochs_of(rpb, units, k, 3), epochs_of(cd_grab, units, k, 3)))


def test_the_device_paths_give_the_cpu_orders(monkeypatch):
    """RPB's Gram recursion and MB-GraB's torch bookkeeping (what a GPU runs) give the CPU loops' orders."""
    import sorters.base as base
    import sorters.microbatch as microbatch
    import sorters.recursive as recursive

    units = vectors(2, 12, 5, seed=9)
    cpu = {name: epochs_of(build_sorter(name, 2, 12, 5, seed=1, batch_size=2), units, 2, 3)
           for name in ("RPB", "MB-GraB", "Greedy")}
    for module in (base, microbatch, recursive):
        monkeypatch.setattr(module, "array_views", lambda *tensors: (torch, list(tensors)))
    for name, expected in cpu.items():
        sorter = build_sorter(name, 2, 12, 5, seed=1, batch_size=2, sign_loop="gram" if name == "MB-GraB" else None)
        assert all(torch.equal(a, b) for a, b in zip(epochs_of(sorter, units, 2, 3), expected)), name


# ------------------------------------------------------------------------------------------ refusals

def refusal(call):
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def test_settings_they_cannot_honour_are_refused_in_one_line():
    from sorters import RecursivePairBalance

    assert refusal(lambda: RecursivePairBalance(2, 8, 3, block=6)) == \
        "RPB: block must be a power of two >= 2 (2, 4, 8, 16, ...), got 6"
    assert refusal(lambda: build_sorter("MB-GraB", 2, 10, 3, batch_size=4)) == (
        "MB-GraB: a micro-batch of 4 units must divide the 10 units of each worker, so that every micro-batch is "
        "full (CDGraBSampler: pass drop_last=True)")
    sorter = build_sorter("MB-GraB", 2, 12, 3, batch_size=3)
    sorter.sort()
    assert refusal(lambda: sorter.step(torch.zeros(2, 2, 3), range(0, 2))) == \
        "MB-GraB: a step covers whole micro-batches of 3 units, got positions 0...1"
    assert refusal(lambda: sorter.step(torch.zeros(2, 2, 3), range(0, 3))) == \
        "MB-GraB: grads must have shape (n, k, d) = (2, 3, 3) or (n, k / b, d) = (2, 1, 3) (unit or micro-batch " \
        "gradients), got (2, 2, 3)"
    other = build_sorter("MB-GraB", 2, 12, 3, batch_size=4)
    assert refusal(lambda: other.load_state_dict(sorter.state_dict())) == \
        "MB-GraB: state is for batch_size=3, sorter has 4"
    rpb = RecursivePairBalance(2, 8, 3, block=4)
    assert refusal(lambda: rpb.load_state_dict(build_sorter("RPB", 2, 8, 3).state_dict())) == \
        "RPB: state is for block=16, sorter has 4"
    swr = build_sorter("SWR", 2, 8, 3)
    assert refusal(lambda: swr.load_state_dict({**swr.state_dict(), "orders": torch.full((2, 8), 8)})) == \
        "SWR.load_state_dict: state['orders'] holds values outside 0..7"
