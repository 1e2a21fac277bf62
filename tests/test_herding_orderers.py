"""The herding simulation (scripts/herding_simulation.py) with issue #60's orderers, and its tables and figures
keeping the simulation's scales apart: each against an oracle written here (pair balance of the micro-batches,
the documented seeding, a float64 prefix sum, means by hand)."""
import importlib.util
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

from analysis import aggregate_herding, load_herding, plots  # noqa: E402
from sorters import build_sorter  # noqa: E402
from tests.test_orderers import pair_balance  # noqa: E402  (the coordinated pair balance oracle, in torch)

REPO = Path(__file__).resolve().parents[1]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


simulation = load_script("herding_simulation")


def prefix_bound(z, orders):
    """max over prefixes of || sum_{t<=k} sum_j z[j, orders[j, t]] ||_inf in float64, any unit ids (repeats too)."""
    z, orders = np.asarray(z, dtype=np.float64), np.asarray(orders)
    visited = np.stack([z[j, orders[j]] for j in range(z.shape[0])])  # (n, m, d)
    return float(np.abs(np.cumsum(visited.sum(axis=0), axis=0)).max())


@pytest.mark.parametrize("method, b", [("MB-GraB", simulation.DEFAULT_BATCH_SIZE), ("MB-GraB+batch2", 2)])
def test_mb_grab_balances_its_micro_batches_and_is_scored_per_unit(method, b):
    """MB-GraB in the simulation: micro-batches of b units cut from the seeded first order, pair-balanced by
    their means, each round's bound that of the unit order; steps of 7 positions are rounded to whole
    micro-batches."""
    n, m, d, seed = 3, 48, 5, 1
    z = simulation.make_vectors(n * m, n, d, trial=seed)
    got = [bound for _, bound, _ in simulation.simulate(z, method, rounds=3, seed=seed, chunk=7)]

    count = m // b
    members = build_sorter("D-SO", n, m, d, seed=seed).sort().numpy().reshape(n, count, b)  # the seeded first order
    means = np.stack([z[j][members[j]].mean(axis=1) for j in range(n)])  # (n, M, d) by micro-batch
    blocks = build_sorter("D-SO", n, count, d, seed=seed).sort().numpy()  # the micro-batches' own first order
    expected = []
    for _ in range(4):
        expected.append(prefix_bound(z, np.stack([members[j][blocks[j]].reshape(m) for j in range(n)])))
        blocks = pair_balance(torch.from_numpy(means), torch.from_numpy(blocks)).numpy()
    assert got == pytest.approx(expected, rel=1e-9)
    assert expected[3] < expected[0]  # balancing lowers it


def test_mb_grab_runs_are_named_by_their_micro_batch_and_refuse_one_that_does_not_divide_m(tmp_path, capsys):
    assert simulation.parse_methods("MB-GraB CD-GraB D-RR") == ["MB-GraB", "CD-GraB", "D-RR"]
    assert simulation.parse_methods("MB-GraB CD-GraB", 4, 16) == ["MB-GraB+sketch4+batch16", "CD-GraB+sketch4"]
    with pytest.raises(SystemExit) as exit_info:
        simulation.main(["--scale", "0.0001", "--workers", "5", "--methods", "MB-GraB", "--batch-size", "3",
                         "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --scale 0.0001 leaves m = 20 vectors per worker for n = 5, not a multiple of MB-GraB's micro-batch "
        "--batch-size 3; choose a --batch-size that divides m, or another --scale"]
    assert not list(tmp_path.glob("*.csv"))


def test_flipflops_odd_rounds_score_as_the_round_before():
    """A worker's vectors sum to zero, so the reversed order's prefix sums are the original's of the other end,
    negated: the same bound. Even rounds draw fresh permutations."""
    z = simulation.make_vectors(600, 3, 4, trial=0)
    bounds = [bound for _, bound, _ in simulation.simulate(z, "FlipFlop", rounds=5, seed=2)]
    assert bounds[1::2] == pytest.approx(bounds[0::2], rel=1e-12)
    assert len(set(np.round(bounds[0::2], 9))) == 3


def test_swr_is_scored_on_the_units_it_draws_repeats_included():
    """SWR's bound: the prefix sums of the draws of the documented seeding (SeedSequence of (seed, round,
    worker, 2)), which repeat units and do not sum to zero."""
    n, m, d, seed = 3, 50, 4, 5
    z = simulation.make_vectors(n * m, n, d, trial=0)
    got = [bound for _, bound, _ in simulation.simulate(z, "SWR", rounds=2, seed=seed)]
    expected = []
    for epoch in range(3):
        draws = []
        for rank in range(n):
            word = np.random.SeedSequence([seed, epoch, rank, 2]).generate_state(1, np.uint64)[0]
            draws.append(torch.randint(m, (m,), generator=torch.Generator().manual_seed(int(word))).numpy())
        draws = np.stack(draws)
        assert any(len(set(row)) < m for row in draws)  # repeats
        expected.append(prefix_bound(z, draws))
    assert got == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------------ scales kept apart

def write_herding_csv(folder, n, m, method, bounds, trial=0):
    """One CSV of the simulation's schema: round r's bound bounds[r]."""
    rows = [f"{n},{m},16,{trial},{method},{r},{bound},0.1" for r, bound in enumerate(bounds)]
    (folder / f"n{n}-m{m}-trial{trial}-{method}.csv").write_text(
        "n_workers,m,d,trial,method,round,bound,seconds\n" + "\n".join(rows) + "\n")


@pytest.fixture
def two_scales(tmp_path):
    """CD-GraB, D-RR and FlipFlop at the paper's 10^6 vectors (n = 5, 10); Greedy and CD-GraB at 10^5 (n = 5)."""
    for n in (5, 10):
        write_herding_csv(tmp_path, n, 10**6 // n, "CD-GraB", [300.0, 2.5])
        write_herding_csv(tmp_path, n, 10**6 // n, "D-RR", [300.0, 320.0 + n])
        write_herding_csv(tmp_path, n, 10**6 // n, "FlipFlop", [290.0, 290.0])
    write_herding_csv(tmp_path, 5, 20000, "CD-GraB", [90.0, 2.0])
    write_herding_csv(tmp_path, 5, 20000, "Greedy", [90.0, 1.5])
    return tmp_path


def test_the_herding_table_gives_each_scale_its_own_table(two_scales):
    hdf = load_herding(two_scales, warn=False)
    assert len(hdf) == 2 * 3 * 2 + 2 * 2  # n = 5's CD-GraB at both scales kept
    tables = load_script("reproduction_tables").herding_table(hdf)
    assert tables == [
        "| method (round 1) | paper | n=5 | n=10 |",
        "|---|---|---|---|",
        "| CD-GraB (1 trials) | 2.3-2.7 for every n | 2.50 | 2.50 |",
        "| D-RR (1 trials) | - | 325.00 | 330.00 |",
        "| FlipFlop (1 trials) | - | 290.00 | 290.00 |",
        "",
        "| method (round 1; 100,000 vectors a trial, m = 100,000 / n) | n=5 |",
        "|---|---|",
        "| CD-GraB (1 trials) | 2.00 |",
        "| Greedy (1 trials) | 1.50 |",
        ""]


def test_the_herding_figures_draw_a_row_per_scale_and_issue_60s_orderers_apart(two_scales):
    figures = plots.plot_herding_figures(aggregate_herding(load_herding(two_scales, warn=False)))

    def panels(fig):
        """{title or None for a hidden panel: sorted line labels}, row by row."""
        return [{ax.get_title(): sorted(line.get_label() for line in ax.get_lines())} if ax.get_visible() else None
                for ax in fig.axes]  # row after row

    paper, orderers = figures["herding-bound"], figures["herding-bound-orderers"]
    assert panels(paper) == [{"n=5 workers, m=200000 units each": ["CD-GraB", "D-RR"]},
                             {"n=10 workers, m=100000 units each": ["CD-GraB", "D-RR"]},
                             {"n=5 workers, m=20000 units each": ["CD-GraB"]}, None]
    assert panels(orderers) == [{"n=5 workers, m=200000 units each": ["CD-GraB", "D-RR", "FlipFlop"]},
                                {"n=10 workers, m=100000 units each": ["CD-GraB", "D-RR", "FlipFlop"]},
                                {"n=5 workers, m=20000 units each": ["CD-GraB", "Greedy"]}, None]
    assert orderers.axes[2].get_ylabel() == "parallel herding bound\n(100,000 vectors a trial)"
    assert paper.texts[0].get_text() == "Parallel herding bound of random unit vectors (1 trial)"
    for fig in figures.values():
        matplotlib.pyplot.close(fig)
    write_herding_csv(two_scales, 5, 20000, "Greedy", [90.0, 1.7], trial=1)  # a method with more trials than others
    figures = plots.plot_herding_figures(aggregate_herding(load_herding(two_scales, warn=False)))
    orderers = figures["herding-bound-orderers"]
    assert sorted(line.get_label() for line in orderers.axes[2].get_lines()) == ["CD-GraB (1 trial)",
                                                                                 "Greedy (2 trials)"]
    assert orderers.texts[0].get_text() == "Parallel herding bound of random unit vectors: issue #60's orderers"
    assert [ax.get_ylabel() for ax in orderers.axes[::2]] == [  # a row whose curves have as many trials says so
        "parallel herding bound\n(1,000,000 vectors a trial, 1 trial)", "parallel herding bound\n(100,000 vectors a trial)"]
    for fig in figures.values():
        matplotlib.pyplot.close(fig)
    hdf = load_herding(two_scales, warn=False)
    assert plots.plot_herding_figures(aggregate_herding(hdf[hdf["method"] != "FlipFlop"].iloc[:0]))["herding-bound"] \
        is None
    without = plots.plot_herding_figures(aggregate_herding(hdf[~hdf["method"].isin(["FlipFlop", "Greedy"])]))
    assert without["herding-bound-orderers"] is None  # no orderer: no second figure of the references alone
    matplotlib.pyplot.close(without["herding-bound"])
