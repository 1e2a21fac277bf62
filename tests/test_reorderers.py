"""KH-SGD and SBW (sorters/randomized.py) against step-by-step models of the published rules.

The models below are written from the rules in words (docs/reorderers.md; Carrell et al. 2025),
in plain Python float64, with the published code's conventions: pair difference = second - first,
"add" puts the first unit at the next free left slot and the second at the next free right slot and
adds the difference to the running sum. They take the sorter's draws (`epoch_draws`) as input, so
the comparison is of the rules, exactly: the test data are small dyadic numbers, for which every
difference, inner product and squared norm is exact in float32 and float64 alike.
"""
import io
import json
import math
import sys

import numpy as np
import pytest
import torch

from sorters import CDGraBSampler, build_sorter
from sorters.randomized import KernelHalving, SelfBalancingWalk
from tests.helpers import (REPO, assert_runs_agree, check_ok, error_lines, needs_data, read_metrics, run_python,
                           run_script)

DELTA = 0.5
RULES = ("KH-SGD", "SBW")


# ------------------------------------------------------------------------------------------- the models


def kh_decision(inner, b2, v, U, L):
    """The published kernel-halving step, branch for branch (with IEEE arithmetic where b2 = 0).
    Returns (add, new v, branch name)."""
    ratio = v * L / b2 if b2 else (math.nan if v * L == 0 else math.inf)
    if ratio <= 1:
        threshold, v, branch = b2, 2 * b2, "small ratio"
    else:
        root = math.sqrt(ratio)
        threshold = root * b2
        update = L + 0.5 - root
        branch = "v grows" if update > 0 else "v kept"
        if update > 0:
            v = v + 2 * b2 * update / L
    if inner <= 0:
        add = True if U >= 0 else inner <= U * threshold
    else:
        add = False if U <= 0 else inner <= U * threshold
    return add, v, ("zero difference" if b2 == 0 else branch)


def model(rule, z, initial_orders, epochs, total_epochs, draws_of):
    """The rule run on z (n, m, d) for `epochs` epochs, coordinated as CD-GraB: for each pair p, for
    each worker j, one running sum over all workers, reset every epoch. With n = 1 and m even this is
    the published single-worker algorithm, constants included.

    Returns (orders per epoch, the final epoch's running sum, KH's v or SBW's b_max, branch counts)."""
    n, m, dim = z.shape
    zl, orders = z.double().tolist(), initial_orders.tolist()
    P = n * (m // 2)  # pair differences per epoch; the published code (n = 1): m / 2
    history, b_max, branches = [], 0.0, {}
    for e in range(1, epochs + 1):
        history.append(torch.tensor(orders))
        draws = draws_of(e).tolist()
        nxt = [[None] * m for _ in range(n)]
        S, v, i = [0.0] * dim, 0.0, 0
        for p in range(m // 2):
            for j in range(n):
                first, second = orders[j][2 * p], orders[j][2 * p + 1]
                diff = [zl[j][second][c] - zl[j][first][c] for c in range(dim)]
                inner = sum(s * x for s, x in zip(S, diff))
                b2 = sum(x * x for x in diff)
                if rule == "KH-SGD":
                    if n == 1:  # the published penalty, built from m / 2 and epoch e
                        L = math.log((4 / DELTA) * (math.log(total_epochs) + 1) * (math.log(m / 2) + 1) * (i + 1) * e)
                    else:
                        L = math.log((4 / DELTA) * (math.log(total_epochs) + 1) * (math.log(P) + 1) * (i + 1) * e)
                    add, v, branch = kh_decision(inner, b2, v, draws[i], L)
                else:
                    b_max = max(b_max, math.sqrt(b2))  # the largest norm so far, this one included
                    if n == 1:  # the published constant, with b_max from the data
                        c = b_max * 30 * math.log(m * total_epochs * dim / DELTA / 2)
                    else:
                        c = b_max * 30 * math.log(P * total_epochs * dim / DELTA)
                    add = inner <= c * (1 - 2 * draws[i])
                    branch = "add" if add else "subtract"
                branches[branch] = branches.get(branch, 0) + 1
                sign = 1 if add else -1
                nxt[j][p], nxt[j][m - 1 - p] = (first, second) if add else (second, first)
                S = [s + sign * x for s, x in zip(S, diff)]
                i += 1
        if m % 2:  # the unpaired last unit takes the middle slot
            for j in range(n):
                nxt[j][m // 2] = orders[j][m - 1]
        orders = nxt
    return history, S, (v if rule == "KH-SGD" else b_max), branches


# ------------------------------------------------------------------------------------------- helpers


def dyadic_units(n, m, d, seed):
    """(n, m, d) float32 vectors of multiples of 1/4 times a per-unit power of two (1/4 .. 8): exact
    sums and products, norms that vary (so every branch of the KH rule is taken)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-6, 7, (n, m, d), generator=gen).float() / 4
    return values * 2.0 ** torch.randint(-2, 4, (n, m, 1), generator=gen).float()


def gather_units(z):
    return lambda orders, positions: torch.stack([z[j, orders[j, positions]] for j in range(len(z))])


def run_epoch(sorter, z, k):
    orders = sorter.sort()
    for t in range(0, sorter.m, k):
        positions = torch.arange(t, min(t + k, sorter.m))
        sorter.step(gather_units(z)(orders, positions), positions)
    return orders


def state_value(sorter):
    return sorter.v if sorter.name == "KH-SGD" else sorter.b_max


@pytest.fixture(params=["cpu-loop", "gram"])
def sign_path(request, monkeypatch):
    """Both implementations: the CPU's compiled loop, and the device path (inner products by one Gram
    matrix per step, then the decisions on the host) forced on the CPU."""
    import sorters.base as base

    if request.param == "gram":
        monkeypatch.setattr(base, "array_views", lambda *tensors: (torch, list(tensors)))
    return request.param


# ------------------------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("k", [1, 2, 4, 16])
def test_one_worker_is_the_published_algorithm(sign_path, rule, k):
    m, d, epochs, E = 16, 5, 4, 7
    z = dyadic_units(1, m, d, seed=k)
    sorter = build_sorter(rule, 1, m, d, seed=3, epochs=E)
    start = sorter.orders.clone()
    for p in range(0, m // 2, 3):  # zero differences in epoch 1 (pairs of equal units)
        z[0, start[0, 2 * p + 1]] = z[0, start[0, 2 * p]]
    expected, last_sum, last_state, branches = model(rule, z, start, epochs, E, sorter.epoch_draws)
    for e, orders in enumerate(expected):
        assert torch.equal(run_epoch(sorter, z, k), orders), e
    # the last epoch's running sum (ours is minus the published one: first - second) and rule state
    assert sorter.running_sum.tolist() == [-s for s in last_sum]
    assert state_value(sorter) == pytest.approx(last_state, rel=1e-12)
    assert sorter.pairs_per_epoch == m // 2
    if rule == "KH-SGD":  # the test saw every branch of the rule
        assert set(branches) == {"small ratio", "v grows", "v kept", "zero difference"}, branches
    else:
        assert set(branches) == {"add", "subtract"}
    assert not torch.equal(expected[0], expected[-1])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("n,m,k", [(3, 16, 2), (3, 15, 3), (4, 14, 1), (2, 13, 4)])
def test_workers_are_coordinated_like_cd_grab(sign_path, rule, n, m, k):
    """n > 1: one running sum over the (pair, worker) visiting order, P = n * floor(m / 2) pair
    differences per epoch, the pair index i counted over that order; odd m and odd k as CD-GraB."""
    d, epochs, E = 4, 4, 5
    z = dyadic_units(n, m, d, seed=n * m + k)
    sorter = build_sorter(rule, n, m, d, seed=1, epochs=E)
    expected, last_sum, last_state, _ = model(rule, z, sorter.orders.clone(), epochs, E, sorter.epoch_draws)
    for e, orders in enumerate(expected):
        got = run_epoch(sorter, z, k)
        assert torch.equal(got, orders), e
        assert all(torch.equal(row.sort().values, torch.arange(m)) for row in got)
    assert sorter.running_sum.tolist() == [-s for s in last_sum]
    assert state_value(sorter) == pytest.approx(last_state, rel=1e-12)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("n,m,k", [(1, 9, 2), (1, 10, 3), (2, 7, 1), (5, 12, 5), (3, 1, 1), (2, 2, 2)])
def test_orders_are_permutations_every_epoch(rule, n, m, k):
    z = torch.randn(n, m, 6, generator=torch.Generator().manual_seed(m))
    sorter = build_sorter(rule, n, m, 6, seed=0, epochs=3)
    for _ in range(5):  # past the declared epochs too
        orders = run_epoch(sorter, z, k)
        assert all(torch.equal(row.sort().values, torch.arange(m)) for row in orders)
    assert all(torch.equal(row.sort().values, torch.arange(m)) for row in sorter.sort())


def test_draws_come_from_the_seed_and_the_epoch():
    """Per epoch P draws, a function of (seed, epoch) only: the same in every sorter (every process)
    built with the seed, fresh each epoch; U in [-1, 1] for KH-SGD, u in [0, 1) for SBW."""
    n, m, d = 3, 20, 4
    kh, kh_again = (build_sorter("KH-SGD", n, m, d, seed=5, epochs=4) for _ in range(2))
    for epoch in (1, 2, 3):
        draws = kh.epoch_draws(epoch)
        assert draws.shape == (n * (m // 2),) and np.array_equal(draws, kh_again.epoch_draws(epoch))
        assert draws.min() >= -1 and draws.max() <= 1 and draws.min() < -0.5 < 0.5 < draws.max()
    assert not np.array_equal(kh.epoch_draws(1), kh.epoch_draws(2))
    assert not np.array_equal(kh.epoch_draws(1), build_sorter("KH-SGD", n, m, d, seed=6, epochs=4).epoch_draws(1))
    u = build_sorter("SBW", n, m, d, seed=5, epochs=4).epoch_draws(1)
    assert u.min() >= 0 and u.max() < 1


def test_the_rules_constants():
    """KH's penalty factor and SBW's c / b_max, from the run's sizes (P, E, d), as the published
    expressions give them with one worker."""
    from sorters import threshold_loops

    m, d, E = 48816, 26, 50
    kh = build_sorter("KH-SGD", 1, m, d, epochs=E)
    kh.sort()
    kh._current_draws()
    factor = float(kh.rule_state[threshold_loops.KH_PENALTY_FACTOR])
    assert factor == pytest.approx((4 / DELTA) * (math.log(E) + 1) * (math.log(m / 2) + 1))
    sbw = build_sorter("SBW", 4, m, d, epochs=E)
    sbw.sort()
    sbw._current_draws()
    assert float(sbw.rule_state[threshold_loops.SBW_C_OVER_B_MAX]) == pytest.approx(30 * math.log(4 * (m // 2) * E * d / DELTA))
    assert (KernelHalving.rule, SelfBalancingWalk.rule) == (threshold_loops.KH, threshold_loops.SBW)


def test_kh_v_restarts_every_epoch_and_sbw_b_max_lives_for_the_run():
    n, m, d = 2, 8, 3
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(1))
    kh, sbw = build_sorter("KH-SGD", n, m, d, epochs=2), build_sorter("SBW", n, m, d, epochs=2)
    for sorter in (kh, sbw):
        run_epoch(sorter, z, 2)
    assert kh.v > 0 and sbw.b_max > 0
    b_max = sbw.b_max
    kh.sort(), sbw.sort()
    assert kh.v == 0 and sbw.b_max == b_max and not kh.running_sum.any() and not sbw.running_sum.any()


def test_a_missing_epoch_count_is_refused_in_one_line():
    for call in (lambda: build_sorter("KH-SGD", 2, 4, 3), lambda: build_sorter("SBW", 2, 4, 3, epochs=0),
                 lambda: CDGraBSampler(8, batch_size=2, d=3, sorter="SBW", num_replicas=2)):
        with pytest.raises(ValueError, match="epochs") as info:
            call()
        assert "\n" not in str(info.value)
    build_sorter("CD-GraB", 2, 4, 3, epochs=None)  # the others do not need it


# ------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("rule", RULES)
def test_state_dict_mid_epoch_resumes_the_same_orders(rule):
    """Saved in the middle of epoch 3 (through torch.save / torch.load(weights_only=True)) and loaded into a
    sorter built with another seed: the same orders as the uninterrupted sorter from there on."""
    n, m, d, k = 3, 14, 5, 3
    z = torch.randn(n, m, d, generator=torch.Generator().manual_seed(2))
    a = build_sorter(rule, n, m, d, seed=4, epochs=6)
    for _ in range(2):
        run_epoch(a, z, k)
    orders = a.sort()
    for t in range(0, 6, k):
        a.step(gather_units(z)(orders, torch.arange(t, t + k)), torch.arange(t, t + k))
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    restored = build_sorter(rule, n, m, d, seed=99, epochs=6)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for sorter in (a, restored):
        for t in range(6, m, k):
            positions = torch.arange(t, min(t + k, m))
            sorter.step(gather_units(z)(orders, positions), positions)
    assert state_value(a) == state_value(restored)
    for _ in range(3):
        assert torch.equal(run_epoch(a, z, k), run_epoch(restored, z, k))
    with pytest.raises(ValueError, match="epochs=6"):
        build_sorter(rule, n, m, d, epochs=7).load_state_dict(a.state_dict())


@pytest.mark.parametrize("rule", RULES)
def test_the_sampler_runs_them_like_the_engine_and_resumes(rule):
    n, m, k, d, epochs = 3, 12, 3, 4, 5
    table = torch.randn(n * m, d, generator=torch.Generator().manual_seed(7))
    sampler = CDGraBSampler(n * m, batch_size=k, d=d, sorter=rule, num_replicas=n, seed=5, epochs=epochs)
    sorter = build_sorter(rule, n, m, d, seed=5, epochs=epochs)
    first_index = torch.arange(n)[:, None] * m

    def sampler_epoch(s):
        indices = torch.tensor(list(s))
        for batch in indices.split(s.loader_batch_size):
            s.step(table[batch])
        return s.all_indices()

    expected = []
    for _ in range(epochs):
        orders = sorter.sort()
        for t in range(0, m, k):
            sorter.step(table[orders[:, t:t + k] + first_index], range(t, t + k))
        expected.append(orders + first_index)
    assert torch.equal(sampler_epoch(sampler), expected[0])
    assert torch.equal(sampler_epoch(sampler), expected[1])
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    resumed = CDGraBSampler(n * m, batch_size=k, d=d, sorter=rule, num_replicas=n, seed=5, epochs=epochs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for epoch in range(2, epochs):
        assert torch.equal(sampler_epoch(resumed), expected[epoch]), epoch
    other = CDGraBSampler(n * m, batch_size=k, d=d, sorter=rule, num_replicas=n, seed=5, epochs=epochs + 1)
    with pytest.raises(ValueError, match="epochs"):
        other.load_state_dict(sampler.state_dict())


# ------------------------------------------------------------------------------------------- end to end

SCRIPT = "main-LR-HMDA.py"
TINY = ["--max-train-examples", "800", "--max-eval-examples", "500", "--record-orders"]
COLUMNS = ("train_loss", "test_loss", "train_acc", "test_acc")


@pytest.mark.slow
@needs_data("hmda/raw/hmda_train_preprocessed.zip")
@pytest.mark.parametrize("rule", RULES)
def test_one_process_equals_torchrun(tmp_path, rule):
    single, multi = tmp_path / "single", tmp_path / "torchrun"
    check_ok(run_script(SCRIPT, "--sorter", rule, "--epochs", "2", "--out", single, *TINY))
    check_ok(run_script(SCRIPT, "--sorter", rule, "--epochs", "2", "--out", multi, *TINY, nproc=2))
    assert_runs_agree(single, multi, COLUMNS)
    assert json.loads((multi / "config.json").read_text())["sizes"]["world_size"] == 2
    orders = torch.load(single / "orders.pt")
    assert not torch.equal(orders[0], orders[1])


@pytest.mark.slow
@needs_data("hmda/raw/hmda_train_preprocessed.zip")
def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    args = ["--sorter", "KH-SGD", "--epochs", "3", *TINY]
    check_ok(run_script(SCRIPT, *args, "--out", straight))
    # dies abruptly in the middle of epoch 2 (50 steps per epoch)
    assert run_script(SCRIPT, *args, "--out", crashed, env={"CDGRAB_FAULT": "exit:0:75"}).returncode != 0
    assert [r["epoch"] for r in read_metrics(crashed)] == [1]
    check_ok(run_script(SCRIPT, *args, "--out", crashed, "--resume"))
    assert_runs_agree(straight, crashed, COLUMNS, exact=True)
    # the threshold depends on --epochs: a resume may not change it
    changed = run_script(SCRIPT, "--sorter", "KH-SGD", "--epochs", "4", *TINY, "--out", crashed, "--resume")
    assert changed.returncode == 2 and "--epochs 3 (now 4)" in error_lines(changed)[0]


def test_herding_simulation_runs_them(tmp_path):
    out = tmp_path / "herding"
    run_python([sys.executable, REPO / "scripts" / "herding_simulation.py", "--scale", "0.0004",
                "--trials", "1", "--workers", "4", "--rounds", "3", "--methods", "CD-GraB KH-SGD SBW",
                "--out", out], check=True, timeout=120)
    import pandas as pd
    df = pd.concat([pd.read_csv(p) for p in sorted(out.glob("*.csv"))])
    assert set(df["method"]) == {"CD-GraB", "KH-SGD", "SBW"} and len(df) == 3 * 4
    assert df[df["round"] == 0]["bound"].nunique() == 1  # the same initial order
    bound = df.set_index(["method", "round"])["bound"]
    assert bound["KH-SGD", 3] < bound["KH-SGD", 0]  # kernel halving balances
