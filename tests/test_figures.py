"""What the benchmark figures draw, read from the matplotlib objects (line data, colours, axis scales),
not from pixels: the paper's stars only beside runs with the paper's settings, a colour per curve, and
value axes that show a difference at its size. Small run folders written here, Agg backend."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from analysis import aggregate_all, load_runs, plots  # noqa: E402
from analysis.aggregate import benchmark_curves  # noqa: E402
from engine.flags import FLAGS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "reproduction"
COLUMNS = {"LSTM-Wiki2": ["train_loss", "test_loss", "valid_loss", "train_ppl", "valid_ppl", "test_ppl"],
           "GPT2-Wiki103": ["train_loss", "test_loss", "valid_loss", "train_ppl", "valid_ppl", "test_ppl"],
           "LR-HMDA": ["train_loss", "test_loss", "train_acc", "test_acc"]}
TIMES = ["epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds", "comm_bytes"]


def shipped_args(benchmark: str) -> dict:
    """The config.json args of a shipped run of `benchmark` made with the sweep's settings (the paper's,
    where a shipped run has them: the LSTM's clipped runs, not its HEAD variant)."""
    from analysis.paper_values import has_paper_settings

    found = [json.loads(config.read_text())["args"]
             for config in sorted((SHIPPED / benchmark).glob("CD-GraB-*-seed0/config.json"))]
    return next((args for args in found if has_paper_settings(benchmark, args)), found[0])


def write_run(root, benchmark, sorter, seed, args, rows, value):
    """A run folder: config.json with `args` (sorter and seed set here) and `rows` epochs of metrics,
    every metric column value(column, epoch)."""
    run = Path(root) / benchmark / f"{sorter}-{len(list(Path(root).rglob('config.json')))}-seed{seed}"
    run.mkdir(parents=True)
    config = {"benchmark": benchmark, "args": {**args, "sorter": sorter, "seed": seed, "out": str(run)}}
    (run / "config.json").write_text(json.dumps(config))
    columns = COLUMNS[benchmark]
    lines = [",".join(["epoch", *columns, *TIMES])]
    for e in range(1, rows + 1):
        metrics = [repr(float(value(c, e))) for c in columns]
        lines.append(",".join([str(e), *metrics, "2.0", "0.2", "0.5", "1.0", "1e6"]))
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")


def falling(shift):
    return lambda column, epoch: (400.0 if column.endswith("_ppl") else 6.0) / epoch ** 0.1 + shift


def load_and_aggregate_functions() -> dict:
    """{name: function} of every function defined in analysis/load.py and analysis/aggregate.py: drawing
    calls none of them (the tables come in sorted, with rank columns where an order matters)."""
    import importlib
    import inspect

    # the modules by name: the package's attribute `analysis.aggregate` is the function aggregate()
    modules = [importlib.import_module(name) for name in ("analysis.load", "analysis.aggregate")]
    return {name: f for module in modules for name, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__}


def forbid_loading_and_aggregating(monkeypatch):
    """Make every load/aggregate function raise wherever analysis/ holds it (a module that imported it by
    name included), so that drawing which reads runs or computes a table itself fails the test."""
    banned = load_and_aggregate_functions()

    def raiser(name):
        def called(*args, **kwargs):
            raise AssertionError(f"drawing called analysis {name}(): figures draw from aggregated tables only")
        return called

    for module in [m for name, m in sys.modules.items() if name == "analysis" or name.startswith("analysis.")]:
        for attr, value in list(vars(module).items()):
            if any(value is f for f in banned.values()):
                monkeypatch.setattr(module, attr, raiser(attr))


def test_figure_code_never_loads_or_aggregates():
    """The one-pass shape (load -> aggregate -> draw), read from the code: no function of analysis/plots.py or
    analysis/studies.py calls a function of analysis/load.py or analysis/aggregate.py, so
    no figure asks for its pieces itself. The tests that draw (here and in test_notebooks.py) do so with those
    functions made to raise too (forbid_loading_and_aggregating)."""
    import ast

    banned = set(load_and_aggregate_functions())
    for path in (REPO / "analysis" / "plots.py", REPO / "analysis" / "studies.py"):
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            calls = [n.func for n in ast.walk(function) if isinstance(n, ast.Call)]
            used = {getattr(f, "id", None) or getattr(f, "attr", None) for f in calls}  # f(...), module.f(...)
            assert not used & banned, f"{path.name}:{function.name} calls {sorted(used & banned)}"


def curves_of(*args, **kwargs):
    """The benchmark figures' table (aggregate.benchmark_curves) of load_runs(*args, **kwargs)."""
    return benchmark_curves(load_runs(*args, **kwargs))


def stars(ax):
    return [line for line in ax.get_lines() if line.get_marker() == "*"]


def curves(ax):
    return [line for line in ax.get_lines() if line.get_marker() != "*"]


def test_paper_stars_only_beside_runs_with_the_papers_settings(tmp_path):
    paper = shipped_args("LSTM-Wiki2")  # 4 workers, B 16, lr 5, --carry-hidden, 50 epochs
    # runs of other settings only: a smoke run (first 128 units, 2 epochs), another worker count, a
    # 10-epoch run that never reaches the paper's epoch 50
    write_run(tmp_path / "others", "LSTM-Wiki2", "CD-GraB", 0, {**paper, "max_train_examples": 128, "epochs": 2}, 2,
              falling(0.0))
    write_run(tmp_path / "others", "LSTM-Wiki2", "D-RR", 0, {**paper, "node_cnt": 8, "B": 32}, 3, falling(0.1))
    write_run(tmp_path / "others", "LSTM-Wiki2", "CD-GraB", 1, {**paper, "epochs": 10}, 3, falling(0.05))
    fig = plots.plot_benchmark(curves_of(tmp_path / "others", include_incomplete=True, warn=False), "LSTM-Wiki2")
    assert len(fig.axes) == 2 and [stars(ax) for ax in fig.axes] == [[], []]
    plt.close(fig)

    # the paper's settings, 3 of 50 epochs run, beside a D-RR run with 8 workers: CD-GraB's stars only,
    # at the paper's values, in the colour of CD-GraB's curve
    write_run(tmp_path / "mixed", "LSTM-Wiki2", "CD-GraB", 0, paper, 3, falling(0.0))
    write_run(tmp_path / "mixed", "LSTM-Wiki2", "D-RR", 0, {**paper, "node_cnt": 8, "B": 32}, 3, falling(0.1))
    df = load_runs(tmp_path / "mixed", include_incomplete=True, warn=False)
    fig = plots.plot_benchmark(benchmark_curves(df), "LSTM-Wiki2")
    for ax, value in zip(fig.axes, (5.311, 223.6)):
        (star,) = stars(ax)
        assert (star.get_xdata()[0], star.get_ydata()[0]) == (50, value)
        cd_grab = [line for line in curves(ax) if line.get_label().startswith("CD-GraB")]
        assert len(cd_grab) == 1 and to_hex(star.get_color()) == to_hex(cd_grab[0].get_color())
    plt.close(fig)


def test_two_settings_of_one_sorter_have_their_own_colours_and_legend_entries(tmp_path):
    paper = shipped_args("LSTM-Wiki2")
    for carry in (True, False):
        write_run(tmp_path, "LSTM-Wiki2", "CD-GraB", 0, {**paper, "carry_hidden": carry}, 3, falling(0.2 * carry))
    write_run(tmp_path, "LSTM-Wiki2", "D-RR", 0, paper, 3, falling(0.5))
    fig = plots.plot_benchmark(curves_of(tmp_path, include_incomplete=True, warn=False), "LSTM-Wiki2")
    for ax in fig.axes:
        colors = {line.get_label(): to_hex(line.get_color()) for line in curves(ax)}
        assert sorted(colors) == ["CD-GraB (carried hidden state) (1 seed)", "CD-GraB (zero hidden state) (1 seed)",
                                  "D-RR (carried hidden state) (1 seed)"]
        assert len(set(colors.values())) == 3, colors
        # a sorter with one setting keeps its colour
        assert colors["D-RR (carried hidden state) (1 seed)"] == to_hex("tab:blue")
        # the star goes with the paper's setting (carried state), which keeps CD-GraB's own colour
        assert {to_hex(star.get_color()) for star in stars(ax)} == {to_hex("tab:red"), to_hex("tab:blue")}
        assert colors["CD-GraB (carried hidden state) (1 seed)"] == to_hex("tab:red")
    (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    legend = [text.get_text() for text in legend.get_texts()]
    assert legend.count("CD-GraB (carried hidden state) (1 seed)") == legend.count(
        "CD-GraB (zero hidden state) (1 seed)") == 1
    plt.close(fig)


def test_value_axes_show_small_differences_at_their_size(tmp_path):
    args = shipped_args("GPT2-Wiki103")
    # every metric within 1e-4 of 4.0: the two sorters differ by 1e-4
    for sorter, shift in (("CD-GraB", 0.0), ("D-RR", 1e-4)):
        write_run(tmp_path / "close", "GPT2-Wiki103", sorter, 0, args, 3,
                  lambda column, epoch, shift=shift: 4.0 + shift + 1e-5 * epoch)
    fig = plots.plot_benchmark(curves_of(tmp_path / "close", include_incomplete=True, warn=False), "GPT2-Wiki103")
    fig.canvas.draw()
    assert [ax.get_ylabel() for ax in fig.axes] == ["train loss", "validation perplexity", "test perplexity"]
    assert [ax.get_yscale() for ax in fig.axes] == ["linear"] * 3
    for ax in fig.axes:
        values = [y for line in curves(ax) for y in line.get_ydata()]
        spread = max(values) - min(values)
        low, high = ax.get_ylim()
        assert spread <= high - low <= 3 * spread, (ax.get_ylabel(), low, high)
        # tick labels carry the values themselves, no "+4" or "1e-4" beside the axis
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_ylabel()
        ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_yticklabels() if t.get_text()]
        assert ticks and all(3.99 < t < 4.01 for t in ticks), ticks
    plt.close(fig)
    # a perplexity falling from 1000 to 50 spans more than a factor of 10: log axis
    for sorter in ("CD-GraB", "D-RR"):
        write_run(tmp_path / "wide", "GPT2-Wiki103", sorter, 0, args, 3,
                  lambda column, epoch: 1000.0 / 4.5 ** (epoch - 1) if column.endswith("_ppl") else 4.0)
    fig = plots.plot_benchmark(curves_of(tmp_path / "wide", include_incomplete=True, warn=False), "GPT2-Wiki103")
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log", "log"]
    plt.close(fig)


def test_a_far_paper_value_is_marked_at_the_edge_not_stretching_the_axis(tmp_path):
    """LR-HMDA's paper values come from other data (0.335 train loss where the runs sit at 0.276): the
    runs' curves keep the panel, the stars keep their values and a note at the edge says where they are."""
    paper = shipped_args("LR-HMDA")
    for sorter, shift in (("CD-GraB", 0.0), ("D-RR", 0.001)):
        write_run(tmp_path, "LR-HMDA", sorter, 0, paper, 3,
                  lambda column, epoch, shift=shift: (0.276 if "loss" in column else 0.905) + shift + 0.001 / epoch)
    fig = plots.plot_benchmark(curves_of(tmp_path, include_incomplete=True, warn=False), "LR-HMDA")
    train = fig.axes[0]
    low, high = train.get_ylim()
    assert high < 0.3  # the curves' range, not up to the paper's 0.335
    assert {star.get_ydata()[0] for star in stars(train)} == {0.33546, 0.33724}
    notes = [text.get_text() for text in train.texts]
    assert any("paper CD-GraB: 0.33546" in note and "↑" in note for note in notes), notes
    plt.close(fig)


def test_shipped_runs_with_the_papers_settings(tmp_path):
    """The shipped benchmark runs have the paper's settings, except GPT-2's, which train on the
    WikiText-2 stand-in, and the LSTM's unclipped runs (the original's HEAD variant; the paper's time
    clipped to 0.25); the study runs that change a setting do not."""
    df = load_runs(SHIPPED, include_incomplete=True, warn=False).drop_duplicates("run_dir")
    own = df[df["study"] == ""]
    lstm = own[own["benchmark"] == "LSTM-Wiki2"].drop_duplicates("run_dir")
    clipped = lstm["run_dir"].astype(str).str.contains("-clip0.25-")
    assert clipped.any() and (~clipped).any()
    assert lstm.loc[clipped, "paper_settings"].all() and not lstm.loc[~clipped, "paper_settings"].any()
    assert own[own["benchmark"] != "LSTM-Wiki2"].groupby("benchmark")["paper_settings"].agg(set).to_dict() == {
        "GPT2-Wiki103": {False}, "LR-HMDA": {True}, "MLP-M4": {True}}
    assert not df.loc[df["study"].isin(["sketching", "heterogeneity", "scaling", "communication"]),
                      "paper_settings"].any()


# not "benchmark": pytest-benchmark owns that name
@pytest.mark.parametrize("bench_name", ["LR-HMDA", "LSTM-Wiki2", "MLP-M4", "GPT2-Wiki103"])
def test_paper_settings_are_what_the_sweep_runs(bench_name, tmp_path):
    """analysis.paper_values.PAPER_SETTINGS names every result-changing setting, with the value the
    sweep gives it (the sweep's command line, as the entry script parses it) where the data are complete."""
    from analysis.paper_values import PAPER_SETTINGS, PAPER_VALUES, has_paper_settings
    from tests.helpers import entry_point

    benchmark = bench_name
    data = tmp_path / "data"
    (data / "wikitext-103").mkdir(parents=True)
    (data / "wikitext-103" / "wiki.train.raw").write_text("")  # GPT-2's own train split is there
    env = {**os.environ, "DRY_RUN": "1", "SORTERS": "CD-GraB", "SEEDS": "0", "DATA": str(data),
           "RESULTS": str(tmp_path / "results"), "PYTHON": sys.executable}
    env.pop("EPOCHS", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / f"sweep-{benchmark}.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (command,) = re.findall(r"run  \S+: \S+ \S+ (.*)", out.stdout)
    _, parser, _ = entry_point(f"main-{benchmark}.py")
    args = vars(parser.parse_args(command.split()))
    changing = {name for name, flag in FLAGS.items() if not flag.resumable and flag.out != "never"} - {"sorter", "seed"}
    assert PAPER_SETTINGS[benchmark] == {key: value for key, value in args.items() if key in changing}
    assert args["epochs"] >= max(PAPER_VALUES[benchmark][0]) and has_paper_settings(benchmark, args)
    assert not has_paper_settings(benchmark, {**args, "epochs": 2})
    assert not has_paper_settings(benchmark, {**args, "max_train_examples": 128})


def test_a_curve_says_where_its_seeds_end_and_studies_with_figures_stay_out_of_scaling(tmp_path):
    paper = shipped_args("LR-HMDA")
    write_run(tmp_path / "own", "LR-HMDA", "D-RR", 0, paper, 3, falling(0.0))
    write_run(tmp_path / "own", "LR-HMDA", "D-RR", 1, paper, 2, falling(0.01))  # partial: stopped at epoch 2
    fig = plots.plot_benchmark(curves_of(tmp_path / "own", include_incomplete=True, warn=False), "LR-HMDA")
    assert [line.get_label() for line in curves(fig.axes[0])] == ["D-RR (2 seeds to epoch 2, 1 after)"]
    plt.close(fig)
    # the reorderers study runs 1 and 4 workers at one batch: its own figure, not a worker-scaling row
    for n in (1, 4):
        write_run(tmp_path / "studies" / "reorderers", "LR-HMDA", "KH-SGD", 0, {**paper, "node_cnt": n}, 3,
                  falling(0.0))
    df = load_runs(tmp_path / "studies", include_incomplete=True, warn=False)
    tables = aggregate_all(df)
    assert set(df["study"]) == {"reorderers"} and plots.plot_scaling(tables.scaling, tables.scaling_herding) is None


def test_worker_scaling_draws_the_sketched_herding_runs_apart_from_exact_and_d_rr():
    """The shipped herding CSVs (exact, sketched at D 4 and 8, D-RR): one right-panel line each, the sketched
    ones in the sketched colour with a marker per D, none in the fallback black."""
    from analysis import load_herding

    cost = json.loads((REPO / "bench" / "results" / "scaling-cost.json").read_text())
    herding = {"m = 292": load_herding(SHIPPED / "herding-scaling" / "fixed-m")}
    fig = plots.plot_worker_scaling(cost, herding)
    lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    assert set(lines) == {f"{method}, m = 292" for method in ("CD-GraB", "CD-GraB+sketch4", "CD-GraB+sketch8", "D-RR")}
    colors = {label: to_hex(line.get_color()) for label, line in lines.items()}
    assert colors["CD-GraB+sketch4, m = 292"] == colors["CD-GraB+sketch8, m = 292"] != colors["CD-GraB, m = 292"]
    assert "#000000" not in colors.values()
    assert lines["CD-GraB+sketch4, m = 292"].get_marker() != lines["CD-GraB+sketch8, m = 292"].get_marker()
    plt.close(fig)


def test_sketching_figure_draws_the_structured_map_apart_from_the_countsketch(monkeypatch):
    """Issue #31: the shipped structured-sketch runs (TensorSketch blocks for the weight matrices) are their own
    curves in the sketching figures' herding-bound and 10-epoch train-loss panels, in their D's colour but
    dashed with square markers, beside the CountSketch's solid round-marked curve, exact CD-GraB and D-RR;
    the ratio panel puts each seed's herding bound over exact CD-GraB's of the same seed, read here from the
    runs' metrics.csv, with the 1.25x goal line."""
    import pandas as pd

    from analysis.studies import plot_sketching

    tables = aggregate_all(load_runs(SHIPPED, warn=False))
    with monkeypatch.context() as patch:  # drawn from the tables alone
        forbid_loading_and_aggregating(patch)
        figs = {benchmark: plot_sketching(tables.sketching, tables.sketching_panels, tables.sketching_ratios, benchmark)
                for benchmark in ("MLP-M4", "LR-HMDA")}
    for benchmark, dims in {"MLP-M4": (64, 256, 1024), "LR-HMDA": (8, 16)}.items():
        fig = figs[benchmark]
        titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
        assert titles[0].startswith("herding bound of the real gradients") and "10 epochs" in titles[0], titles
        assert titles[1].startswith("train loss (first") and "10 epochs" in titles[1], titles
        assert titles[-1].startswith("herding bound vs exact CD-GraB"), titles
        for ax, column in ((fig.axes[0], "herding_bound"), (fig.axes[1], "train_loss")):
            lines = {line.get_label(): line for line in ax.get_lines()}
            legend = {text.get_text() for text in ax.get_legend().get_texts()}
            assert {"CD-GraB exact (3 seeds)", "D-RR (3 seeds)"} <= set(lines) and set(lines) <= legend
            for D in dims:
                plain, structured = lines[f"CD-GraB, D = {D} (3 seeds)"], lines[f"CD-GraB, D = {D}, structured (3 seeds)"]
                assert to_hex(plain.get_color()) == to_hex(structured.get_color())
                assert (plain.get_marker(), plain.get_linestyle()) == ("o", "-")
                assert (structured.get_marker(), structured.get_linestyle()) == ("s", "--")
                runs = sorted((SHIPPED / "sketching" / benchmark).glob(f"*-sketch-dim{D}-sketch-min-numel16-seed*"))
                assert len(runs) == 3
                mean = pd.concat([pd.read_csv(run / "metrics.csv").set_index("epoch")[column] for run in runs],
                                 axis=1).mean(axis=1)
                assert list(structured.get_xdata()) == list(mean.index)
                assert structured.get_ydata() == pytest.approx(mean.to_numpy(), rel=1e-12)
        ratio_ax = [ax for ax in fig.axes if ax.get_visible()][-1]
        points = {line.get_label(): line for line in ratio_ax.get_lines()}
        assert 1.25 in [line.get_ydata()[0] for line in ratio_ax.get_lines() if line.get_linestyle() == ":"]
        scaling = {seed: pd.read_csv(next((SHIPPED / "scaling" / benchmark).glob(f"CD-GraB-node4-B16-*-seed{seed}"))
                                     / "metrics.csv").set_index("epoch")["herding_bound"] for seed in range(3)}
        for D in dims:
            plain = points[f"CD-GraB, D = {D}: mean of epochs 2+"]
            structured = points[f"CD-GraB, D = {D}, structured: mean of epochs 2+"]
            last = points[f"CD-GraB, D = {D}, structured: last epoch"]
            assert structured.get_marker() == last.get_marker() == "s" and plain.get_marker() == "o"
            assert last.get_fillstyle() == "none" and structured.get_fillstyle() == "full"
            assert min(structured.get_xdata()) > max(plain.get_xdata())  # right of the CountSketch of its D
            bounds = {int(run.name[-1]): pd.read_csv(run / "metrics.csv").set_index("epoch")["herding_bound"]
                      for run in (SHIPPED / "sketching" / benchmark).glob(f"*-sketch-dim{D}-sketch-min-numel16-seed*")}
            assert sorted(structured.get_ydata()) == pytest.approx(sorted(
                bounds[s].loc[2:].mean() / scaling[s].loc[2:].mean() for s in range(3)), rel=1e-12)
            assert sorted(last.get_ydata()) == pytest.approx(sorted(
                bounds[s].loc[10] / scaling[s].loc[10] for s in range(3)), rel=1e-12)
        plt.close(fig)
