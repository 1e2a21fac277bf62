"""The leaderboard of every orderer (issue #60): which runs it takes, its numbers recomputed here from the
metrics.csv files with the csv module and statistics (an implementation of its own, not the analysis'),
what each orderer needs (from docs/sorters.md's table, written out here), and its figure. Small run folders
written here; the paper's settings are a shipped LR-HMDA run's config.json."""
import csv
import importlib.util
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, before pyplot is imported
import pytest  # noqa: E402

from tests.helpers import REPO  # noqa: E402

SHIPPED_CONFIG = json.loads((REPO / "reproduction" / "LR-HMDA" / "CD-GraB-node4-B16-lr0.005-seed0" / "config.json")
                            .read_text())
EPOCHS = SHIPPED_CONFIG["args"]["epochs"]
# docs/sorters.md's "needs gradients" column, in the leaderboard's words
NEEDS = {"CD-GraB": "per-example gradients", "D-RR": "nothing", "D-SO": "nothing", "I-B": "per-example gradients",
         "I-PB": "per-example gradients", "Fold": "nothing", "KH-SGD": "per-example gradients",
         "SBW": "per-example gradients", "FlipFlop": "nothing", "SWR": "nothing", "Greedy": "per-example gradients",
         "MB-GraB": "per-worker gradients", "RPB": "per-example gradients"}


def tables_module():
    spec = importlib.util.spec_from_file_location("reproduction_tables", REPO / "scripts" / "reproduction_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(root: Path, sorter: str, seed: int, losses, study: str = "", epochs: int = EPOCHS, **changed) -> Path:
    """An LR-HMDA run folder under root[/study]: the shipped config with this sorter, seed and changed args,
    and a metrics.csv of these per-epoch train losses (test accuracy 0.9 + loss / 10; seconds by seed and epoch)."""
    config = json.loads(json.dumps(SHIPPED_CONFIG))
    config["args"].update(sorter=sorter, seed=seed, epochs=epochs, **changed)
    folder = root / study / "LR-HMDA" / f"{sorter}-{len(changed)}-seed{seed}"
    folder.mkdir(parents=True)
    config["args"]["out"] = str(folder)
    (folder / "config.json").write_text(json.dumps(config))
    seconds = [1 + seed + e % 3 + loss * (sorter == "CD-GraB") for e, loss in enumerate(losses, 1)]
    rows = "".join(f"{e},{loss!r},{loss!r},0.9,{0.9 + loss / 10!r},{s!r}\n"
                   for e, (loss, s) in enumerate(zip(losses, seconds), 1))
    (folder / "metrics.csv").write_text("epoch,train_loss,test_loss,train_acc,test_acc,epoch_seconds\n" + rows)
    return folder


def curve(start: float, end: float, wiggle: float = 0.0):
    """EPOCHS train losses falling from start to end, epoch e off by wiggle * (-1)^e."""
    return [start + (end - start) * (e / EPOCHS) ** 0.5 + wiggle * (-1) ** e for e in range(1, EPOCHS + 1)]


@pytest.fixture(scope="module")
def fabricated(tmp_path_factory):
    """Runs the leaderboard must take (counted) and ones it must leave out (each says why)."""
    root = tmp_path_factory.mktemp("leaderboard")
    taken = [write_run(root, "D-RR", 0, curve(0.30, 0.280, 0.001)), write_run(root, "D-RR", 1, curve(0.30, 0.282)),
             write_run(root, "FlipFlop", 0, curve(0.30, 0.279)), write_run(root, "FlipFlop", 1, curve(0.31, 0.2805)),
             write_run(root, "CD-GraB", 0, curve(0.29, 0.276)),
             write_run(root, "KH-SGD", 3, curve(0.30, 0.277), study="reorderers"),
             write_run(root, "Greedy", 0, curve(0.30, 0.2785), sketch_dim=64)]  # its own row, "Greedy (sketch 64)"
    write_run(root, "Greedy", 1, curve(0.30, 0.20), sketch_dim=64, lr=0.05)  # sketched, and another lr
    write_run(root, "FlipFlop", 2, curve(0.30, 0.20)[:30])                 # unfinished
    write_run(root, "FlipFlop", 3, curve(0.30, 0.20), lr=0.05)             # not the paper's settings
    write_run(root, "D-RR", 4, curve(0.30, 0.20), study="heterogeneity")  # another study
    return root, taken


def oracle(runs):
    """(D-RR's final mean loss, {sorter: (seeds, final losses, final accuracies, first epoch whose mean loss
    <= D-RR's final mean, median seconds per epoch over D-RR's)}) from the metrics.csv files."""
    losses, seconds = {}, {}
    for run in runs:
        args = json.loads((run / "config.json").read_text())["args"]
        sorter = args["sorter"] + (f" (sketch {args['sketch_dim']})" if args.get("sketch_dim") else "")
        with open(run / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        losses.setdefault(sorter, []).append(([float(r["train_loss"]) for r in rows], float(rows[-1]["test_acc"])))
        seconds.setdefault(sorter, []).extend(float(r["epoch_seconds"]) for r in rows)
    target = statistics.mean(loss[-1] for loss, _ in losses["D-RR"])
    found = {}
    for sorter, runs_of in losses.items():
        means = [statistics.mean(values) for values in zip(*(loss for loss, _ in runs_of))]
        reaches = next((e for e, mean in enumerate(means, 1) if mean <= target), None)
        found[sorter] = (len(runs_of), [loss[-1] for loss, _ in runs_of], [acc for _, acc in runs_of], reaches,
                         statistics.median(seconds[sorter]) / statistics.median(seconds["D-RR"]))
    return target, found


def plus_minus(values):
    return f"{statistics.mean(values):.5f} ± {statistics.pstdev(values):.5f}" if len(values) > 1 \
        else f"{values[0]:.5f}"


def test_the_leaderboard_table_is_the_runs_final_values_and_epochs_to_d_rr(fabricated):
    from analysis import load_runs

    root, taken = fabricated
    no_bench = root / "no-bench.json"  # no side-by-side bench: the runs' own seconds, no memory
    text = "\n".join(tables_module().leaderboard_markdown(load_runs(root, include_incomplete=True, warn=False),
                                                          no_bench))
    target, found = oracle(taken)
    assert f"| LR-HMDA, epoch {EPOCHS} | needs | seeds | final train loss | final test_acc | epoch reaching D-RR's " \
           f"final train loss ({target:.5f}) | s / epoch vs D-RR (runs' logs) | peak memory vs D-RR (bench) |" \
           in text, text
    assert f"LR-HMDA's seconds: its runs' own logs (metrics.csv), not a side-by-side bench ({no_bench} has no run " \
           '"LR-HMDA" with D-RR); peak memory: not measured.' in text, text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "epoch reaching" not in line]
    order = sorted(found, key=lambda sorter: statistics.mean(found[sorter][1]))
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == order, text  # best final loss first
    seeds = {"D-RR": "0-1", "FlipFlop": "0-1", "CD-GraB": "0", "KH-SGD": "3", "Greedy (sketch 64)": "0"}
    for row, sorter in zip(rows, order):
        count, losses, accuracies, reaches, seconds = found[sorter]
        assert row == (f"| {sorter} | {NEEDS[sorter.removesuffix(' (sketch 64)')]} | {seeds[sorter]} | {plus_minus(losses)} | "
                       f"{plus_minus(accuracies)} | {reaches or 'never'} | {seconds:.2f} | - |"), row
    assert found["D-RR"][3] is not None and found["CD-GraB"][3] < found["D-RR"][3]  # the runs test what they should


# A bench/epoch_time.py --record file, written by hand: the LR-HMDA run lists CD-GraB first (its
# ratio_to_first is to CD-GraB, not D-RR), keys Greedy by a spec with --sketch-dim (the sketched runs' row), has
# no plain KH-SGD (whose runs get "-"), has SWR (no runs here) and lacks FlipFlop; another label with absurd seconds must
# not be taken.
BENCH = {"runs": {
    "LR-HMDA": {"script": "main-LR-HMDA.py", "entry_args": [], "epochs": 2, "epoch_reported": 2, "rounds": 3,
                "seconds": {"CD-GraB": {"epoch_seconds": 3.0}, "D-RR": {"epoch_seconds": 2.5},
                            "Greedy:--sketch-dim=64": {"epoch_seconds": 5.5}, "SWR": {"epoch_seconds": 2.6}},
                "ratio_to_first": {"CD-GraB": 1.0, "D-RR": 0.833, "Greedy:--sketch-dim=64": 1.833, "SWR": 0.867},
                "sorter_args": {"CD-GraB": [], "D-RR": [], "Greedy:--sketch-dim=64": ["--sketch-dim=64"], "SWR": []},
                "peak_rss_mib": {"CD-GraB": 520.0, "D-RR": 400.0, "Greedy:--sketch-dim=64": 600.0, "SWR": 404.0},
                "peak_rss_ratio_to_first": {"CD-GraB": 1.0, "D-RR": 0.769, "Greedy:--sketch-dim=64": 1.154,
                                            "SWR": 0.777},
                "git_commit": "0123456789abcdef", "date": "2026-12-01"},
    "LR-HMDA --max-train-examples 64000": {"epochs": 2, "epoch_reported": 2, "rounds": 1,
                                           "seconds": {"D-RR": {"epoch_seconds": 1.0},
                                                       "CD-GraB": {"epoch_seconds": 100.0}}}}}
# by hand: seconds over D-RR's 2.5 s, peak memory over D-RR's 400 MiB; FlipFlop is not in the bench
BENCH_RATIOS = {"CD-GraB": ("1.20", "1.30"), "D-RR": ("1.00", "1.00"), "Greedy (sketch 64)": ("2.20", "1.50"),
                "KH-SGD": ("-", "-"), "FlipFlop": ("-", "-")}


def test_the_leaderboard_takes_seconds_and_memory_from_the_benchmarks_bench_run(fabricated, tmp_path):
    from analysis import load_runs

    root, taken = fabricated
    df = load_runs(root, include_incomplete=True, warn=False)
    bench_file = tmp_path / "leaderboard-cpu.json"
    bench_file.write_text(json.dumps(BENCH))
    text = "\n".join(tables_module().leaderboard_markdown(df, bench_file))
    assert "| s / epoch vs D-RR (bench) | peak memory vs D-RR (bench) |" in text, text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "epoch reaching" not in line]
    assert {row[0].removeprefix("| "): (row[-2], row[-1].removesuffix(" |")) for row in rows} == BENCH_RATIOS, text
    assert (f'LR-HMDA\'s seconds and peak memory: {bench_file}, run "LR-HMDA" (bench/epoch_time.py: epoch 2 of '
            "2-epoch runs, median of 3 rounds, one process each, side by side; commit 0123456, 2026-12-01; D-RR "
            "2.50 s per epoch, peak 400 MiB); Greedy with --sketch-dim=64.") in text, text
    # a bench run without D-RR cannot give ratios to it, nor a run recorded before memory was measured memory
    # ratios: the runs' logs, and no memory
    without_drr = {"runs": {"LR-HMDA": {**BENCH["runs"]["LR-HMDA"], "seconds": {"CD-GraB": {"epoch_seconds": 3.0}}}}}
    bench_file.write_text(json.dumps(without_drr))
    assert "| s / epoch vs D-RR (runs' logs) |" in "\n".join(tables_module().leaderboard_markdown(df, bench_file))
    older = {key: value for key, value in BENCH["runs"]["LR-HMDA"].items() if not key.startswith("peak_rss")}
    bench_file.write_text(json.dumps({"runs": {"LR-HMDA": older}}))
    text = "\n".join(tables_module().leaderboard_markdown(df, bench_file))
    assert "| CD-GraB | " in text and all(line.endswith("| 1.20 | - |") for line in text.splitlines()
                                          if line.startswith("| CD-GraB | ")), text


def test_every_orderer_needs_what_docs_sorters_says():
    from analysis.aggregate import gradients_needed
    from sorters.registry import SORTER_NAMES

    assert {name: gradients_needed(name) for name in SORTER_NAMES} == NEEDS
    assert gradients_needed("no-such-sorter") == "?"
    assert gradients_needed("Greedy (sketch 64)") == NEEDS["Greedy"] and gradients_needed("SWR (sketch 8)") == "nothing"


@pytest.mark.parametrize("spec, row", [("Greedy:--sketch-dim=64", "Greedy (sketch 64)"),
                                       ("Greedy:--sketch-dim 256 --sketch-min-numel=16", "Greedy (sketch 256)"),
                                       ("Greedy:--sketch-dim=0", "Greedy"), ("RPB:--sign-loop=gram", "RPB")])
def test_a_bench_spec_with_a_sketch_is_the_sketched_runs_row(spec, row):
    from analysis.aggregate import bench_ratios

    ratios = bench_ratios({"seconds": {"D-RR": {"epoch_seconds": 2.0}, spec: {"epoch_seconds": 5.0}},
                           "peak_rss_mib": {"D-RR": 100.0, spec: 130.0}})
    assert ratios.loc[row].tolist() == pytest.approx([2.5, 1.3]) and len(ratios) == 2


def test_issue_60s_orderers_are_in_the_leaderboard_only_and_drawn_there(fabricated, monkeypatch):
    """The paper-vs-ours table and the benchmark figures keep the paper's comparison; the leaderboard figure
    has a point per orderer and panel, at the orderer's mean final value, and a curve per orderer."""
    import matplotlib.pyplot as plt

    from analysis import aggregate_all, load_runs
    from analysis.studies import plot_leaderboard
    from tests.test_figures import forbid_loading_and_aggregating

    root, taken = fabricated
    df = load_runs(root, include_incomplete=True, warn=False)
    table = "\n".join(tables_module().benchmark_table(df[df["study"] == ""], "LR-HMDA"))
    assert "ours D-RR" in table and "FlipFlop" not in table, table
    tables = aggregate_all(df)
    assert set(tables.curves["sorter"]) == {"CD-GraB", "D-RR"} and set(tables.times["sorter"]) == {"CD-GraB", "D-RR"}
    forbid_loading_and_aggregating(monkeypatch)
    fig = plot_leaderboard(tables.leaderboard, tables.leaderboard_curves)
    _, found = oracle(taken)
    curves_panel, loss_panel, acc_panel = fig.axes[:3]
    assert sorted(line.get_label() for line in curves_panel.get_lines()) == sorted(found)
    labels = [tick.get_text().rsplit(" (", 1)[0] for tick in loss_panel.get_yticklabels()]  # less "(k seeds)"
    for panel, column in ((loss_panel, 1), (acc_panel, 2)):
        points = [line for line in panel.get_lines() if line.get_marker() in ("o", "s", "^")
                  and len(line.get_xdata()) == 1]
        drawn = {labels[-int(line.get_ydata()[0])]: float(line.get_xdata()[0]) for line in points}
        assert drawn == pytest.approx({sorter: statistics.mean(values[column]) for sorter, values in found.items()})
    plt.close(fig)
