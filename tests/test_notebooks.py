"""The analysis layer on synthetic, schema-exact run directories: aggregation numbers, the
`python -m analysis` command, and every notebook executed headless (nbclient)."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

import matplotlib

matplotlib.use("Agg")  # files only, before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from analysis import aggregate, aggregate_all, aggregate_herding, final_table, format_table, load_runs, plots  # noqa: E402
from analysis.aggregate import benchmark_curves  # noqa: E402
from analysis.load import RESUMABLE_ARGS  # noqa: E402
from analysis.paper_values import PAPER_SETTINGS  # noqa: E402
from tests.helpers import run_python  # noqa: E402
from tests.test_figures import forbid_loading_and_aggregating  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
BENCH_COLUMNS = {  # metrics.csv columns between test_loss and the timing columns
    "LR-HMDA": ["train_acc", "test_acc"],
    "LSTM-Wiki2": ["valid_loss", "train_ppl", "valid_ppl", "test_ppl"],
    "MLP-M4": ["valid_loss", "test_smape"],
    "GPT2-Wiki103": ["valid_loss", "train_ppl", "valid_ppl", "test_ppl"],
}
TIME_COLUMNS = ["epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds", "comm_bytes"]
COMMUNICATION_COLUMNS = ["syncs", "mean_H", "density", "threshold", "load_imbalance"]
SETTINGS = {"LR-HMDA": (4, 16, 0.005), "LSTM-Wiki2": (4, 16, 5.0), "MLP-M4": (32, 32, 0.001),
            "GPT2-Wiki103": (64, 64, 0.0005)}


def write_run(root, benchmark, sorter, seed, epochs=3, rows=None, values=None, args=None, folder="", extra=(),
              study="", tag=""):
    """A run dir exactly as the entry scripts write it; `rows` finished epochs (default all), metric
    values from `values(column, epoch)` (default a smooth synthetic curve), `args` added to or
    overriding the default ones, `folder` between the benchmark and the run name, `extra` columns after
    the standard ones (herding_bound, the communication columns), `study` between the results root and
    the benchmark (a study sweep's folder), `tag` in the run name. Returns the dir."""
    node_cnt, B, lr = SETTINGS[benchmark]
    run_dir = Path(root) / study / benchmark / folder / f"{sorter}-node{node_cnt}-B{B}-lr{lr}{tag}-seed{seed}"
    run_dir.mkdir(parents=True)
    args = {"sorter": sorter, "seed": seed, "lr": lr, "momentum": 0.9, "weight_decay": 0.0, "B": B,
            "node_cnt": node_cnt, "epochs": epochs, "data_dir": "datasets", "out": str(run_dir),
            "device": "cpu", "backend": None, "max_train_examples": None, "resume": False, **(args or {})}
    config = {"benchmark": benchmark, "args": args,
              "sizes": {"n_workers": node_cnt, "world_size": 1, "units_per_worker": 100, "units_per_step": B // node_cnt,
                        "steps_per_epoch": 100, "d": 27, "global_batch": B},
              "data": {"source": "synthetic", "files": []}, "versions": {"torch": "2.13.0"}, "git_commit": "0" * 40}
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))
    columns = ["epoch", "train_loss", "test_loss"] + BENCH_COLUMNS[benchmark] + TIME_COLUMNS + list(extra)
    shift = 0.1 * seed + (0.0 if sorter == "CD-GraB" else 0.2)
    values = values or (lambda c, e: 1.0 + 1.0 / e + shift if not c.endswith("seconds") and c != "comm_bytes"
                        else {"epoch_seconds": 2.0, "sorter_seconds": 0.2, "comm_seconds": 0.5,
                              "compute_seconds": 1.0, "comm_bytes": 1e6}[c] + shift)
    lines = [",".join(columns)]
    for e in range(1, (epochs if rows is None else rows) + 1):
        lines.append(",".join([str(e)] + [repr(float(values(c, e))) for c in columns[1:]]))
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    return run_dir


def write_herding(folder, trials=2):
    """A tiny herding CSV set in the schema of scripts/herding_simulation.py."""
    folder.mkdir(parents=True, exist_ok=True)
    for n, m in [(5, 200), (10, 100)]:
        for method in ["CD-GraB", "D-RR"]:
            lines = ["n_workers,m,d,trial,method,round,bound,seconds"]
            for trial in range(trials):
                for r in range(4):
                    bound = 10.0 / (1 + r) if method == "CD-GraB" else 10.0 + trial
                    lines.append(f"{n},{m},16,{trial},{method},{r},{bound},{0.1 * r}")
            (folder / f"n{n}-m{m}-trial-all-{method}.csv").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """2 sorters x 2 seeds x 3 epochs per benchmark, a herding set, and three broken runs."""
    root = tmp_path_factory.mktemp("results")
    for benchmark in BENCH_COLUMNS:
        for sorter in ["CD-GraB", "D-RR"]:
            for seed in [0, 1]:
                write_run(root, benchmark, sorter, seed)
    write_herding(root / "herding")
    for sorter in ["CD-GraB", "D-RR"]:  # the communication study: its own folder, its own figure
        for sync in ["every-step", "qsr"]:
            for reducer in ["dense", "exdyna"]:
                write_run(root, "MLP-M4", sorter, 0, study="communication", tag=f"-{sync}-{reducer}",
                          args={"sync": sync, "reducer": reducer, "lr_schedule": "cosine"},
                          extra=COMMUNICATION_COLUMNS)
    write_run(root, "LR-HMDA", "I-B", 0, rows=2)                       # unfinished: 2 of 3 epochs
    broken = write_run(root, "MLP-M4", "I-PB", 0)
    (broken / "config.json").write_text("{not json")                    # unreadable config
    (root / "LSTM-Wiki2" / "stray").mkdir()
    (root / "LSTM-Wiki2" / "stray" / "metrics.csv").write_text("epoch\n")  # metrics without config
    return root


@pytest.fixture(scope="module")
def study_results(tmp_path_factory):
    """The two studies' layouts (<root>/<study>/<benchmark>/<run>) next to a benchmark's own runs:
    LR-HMDA partitions x 2 sorters x 2 seeds, and LR-HMDA / MLP-M4 at n = 4 and 16 with herding_bound."""
    root = tmp_path_factory.mktemp("studies")
    skew = {"random": 0.0, "dirichlet:1": 0.01, "label-sorted": 0.05}
    for partition, worse in skew.items():
        for sorter in ["CD-GraB", "D-RR"]:
            for seed in [0, 1]:
                write_run(root / "heterogeneity", "LR-HMDA", sorter, seed, folder=partition.replace(":", ""),
                          args={"partition": partition, "max_train_examples": 20000},
                          values=lambda c, e, w=worse, s=seed: 0.3 + w + 0.001 * s if c == "train_loss" else 1.0)
    for benchmark in ["LR-HMDA", "MLP-M4"]:
        for n in [4, 16]:
            for sorter in ["CD-GraB", "D-RR"]:
                for seed in [0, 1]:
                    write_run(root / "scaling", benchmark, sorter, seed, folder=f"n{n}", extra=["herding_bound"],
                              args={"node_cnt": n, "B": 4 * n, "log_herding": True},
                              values=lambda c, e, n=n: 10.0 * n / e if c == "herding_bound" else 1.0 + 1 / e)
    write_run(root, "LR-HMDA", "CD-GraB", 0)  # a benchmark's own run, from before --partition existed
    return root


def test_study_runs_are_labelled_and_drawn_by_what_varies(study_results, tmp_path, monkeypatch):
    df = load_runs(study_results, warn=False)
    runs = df.drop_duplicates("run_dir")
    assert runs.groupby("study")["run_dir"].nunique().to_dict() == {"": 1, "heterogeneity": 12, "scaling": 16}
    own = runs[runs["study"] == ""].iloc[0]
    assert (own["partition"], own["setting"]) == ("contiguous", "")  # the default of a run without the arg
    het = runs[runs["study"] == "heterogeneity"]
    assert set(het["setting"]) == {"heterogeneity: partition=random", "heterogeneity: partition=dirichlet:1",
                                   "heterogeneity: partition=label-sorted"}
    assert set(runs.loc[runs["study"] == "scaling", "setting"]) == {"scaling: B=16, n=4", "scaling: B=64, n=16"}
    tables = aggregate_all(df)
    fig = plots.plot_heterogeneity(tables.heterogeneity)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["random", "dirichlet:1", "label-sorted"]
    cd_loss = fig.axes[0].get_lines()[0].get_ydata()  # CD-GraB's mean final train loss per partition
    assert list(cd_loss) == pytest.approx([0.3005, 0.3105, 0.3505])
    plt.close(fig)
    fig = plots.plot_scaling(tables.scaling, tables.scaling_herding)
    assert len(fig.axes) == 6 and fig.axes[2].get_yscale() == "log"  # 2 benchmarks x (loss, metric, herding)
    assert {line.get_label() for line in fig.axes[2].get_lines()} == {"CD-GraB, n=4", "CD-GraB, n=16", "D-RR, n=4",
                                                                     "D-RR, n=16"}
    plt.close(fig)
    with monkeypatch.context() as patch:  # every figure drawn from the tables alone
        forbid_loading_and_aggregating(patch)
        names = {Path(p).stem for p in plots.draw_all(tables, tmp_path)}
    # the benchmarks' figures show their own runs only; each study has its own figure
    assert names == {"LR-HMDA-vs-epoch", "LR-HMDA-vs-seconds", "LR-HMDA-time-breakdown", "heterogeneity", "scaling"}


def test_load_runs_columns_and_problems(results):
    df, problems = load_runs(results, with_problems=True, warn=False)
    assert list(df.columns[:12]) == ["benchmark", "sorter", "seed", "node_cnt", "B", "lr", "setting", "run_dir",
                                     "partition", "study", "paper_settings", "epoch"]
    assert not df["paper_settings"].any()  # 3-epoch runs, without most of the paper's settings in their args
    paper, study = df[df["study"] == ""], df[df["study"] == "communication"]
    assert (paper["setting"] == "").all()  # every benchmark's runs share their settings
    # a study's runs are labelled among themselves, so the benchmark's own runs stay unlabelled
    assert set(study["setting"]) == {f"communication: reducer={r}, sync={s}" for r in ("dense", "exdyna")
                                     for s in ("every-step", "qsr")}
    assert df.columns[-1] == "cum_seconds"
    assert len(paper) == 4 * 2 * 2 * 3 and paper["run_dir"].nunique() == 16 and study["run_dir"].nunique() == 8
    assert {"test_acc", "test_ppl", "test_smape", "comm_bytes"} <= set(df.columns)
    run = df[df["run_dir"] == df["run_dir"].iloc[0]]
    assert run["cum_seconds"].tolist() == pytest.approx(run["epoch_seconds"].cumsum().tolist())
    reasons = " | ".join(str(p) for p in problems)
    assert len(problems) == 3 and "incomplete: 2/3" in reasons and "config.json" in reasons
    with pytest.warns(UserWarning, match="skipped run"):
        load_runs(results)
    assert load_runs(results, include_incomplete=True, warn=False)["run_dir"].nunique() == 16 + 8 + 1


def test_aggregate_hand_example(tmp_path):
    """Two seeds whose train_loss is 1.0 and 3.0 at epoch 1, 2.0 and 2.0 at epoch 2; the std is the
    population std (the paper's convention): sqrt(((1 - 2)^2 + (3 - 2)^2) / 2) = 1."""
    table = {0: {1: 1.0, 2: 2.0}, 1: {1: 3.0, 2: 2.0}}
    for seed in (0, 1):
        write_run(tmp_path, "LR-HMDA", "CD-GraB", seed, epochs=2,
                  values=lambda c, e, seed=seed: table[seed][e] if c in ("train_loss", "test_acc") else 1.0 + seed)
    df = load_runs(tmp_path)
    agg = aggregate(df, ["train_loss"]).set_index("epoch")
    assert agg.loc[1, "mean"] == 2.0 and agg.loc[1, "std"] == pytest.approx(1.0)
    assert (agg.loc[1, "min"], agg.loc[1, "max"], agg.loc[1, "count"]) == (1.0, 3.0, 2)
    assert (agg.loc[1, "lo"], agg.loc[1, "hi"]) == pytest.approx((1.0, 3.0))
    assert agg.loc[2, "std"] == 0.0
    # epoch_seconds is 1.0 (seed 0) and 2.0 (seed 1): mean cumulative seconds 1.5, then 3.0
    assert agg["seconds"].tolist() == pytest.approx([1.5, 3.0])
    minmax = aggregate(df, ["train_loss"], band="minmax").set_index("epoch")
    assert (minmax.loc[1, "lo"], minmax.loc[1, "hi"]) == (1.0, 3.0)
    final = final_table(df).iloc[0]
    assert (final["metric"], final["mean"], final["std"], final["seeds"]) == ("test_acc", 2.0, 0.0, 2)


def test_runs_differing_in_any_setting_are_separate_curves(tmp_path):
    """LSTM runs that differ only in --carry-hidden, or in --max-train-examples, are not duplicates: each
    is its own curve and table row, labelled by what differs. Changing only resumable args (where the
    data lives, the device) makes a duplicate, skipped."""
    for seed in (0, 1):
        for carry in (True, False):
            write_run(tmp_path, "LSTM-Wiki2", "CD-GraB", seed, args={"carry_hidden": carry, "clip": None},
                      folder=f"carry-{carry}")
    write_run(tmp_path, "LSTM-Wiki2", "D-RR", 0, args={"carry_hidden": True, "clip": None})
    write_run(tmp_path, "LSTM-Wiki2", "D-RR", 0, args={"carry_hidden": True, "clip": None, "data_dir": "/elsewhere",
                                                       "device": "cuda"}, folder="moved")
    write_run(tmp_path, "MLP-M4", "D-RR", 0, args={"max_train_examples": 128})
    write_run(tmp_path, "MLP-M4", "D-RR", 0, folder="full")
    df, problems = load_runs(tmp_path, with_problems=True, warn=False)
    assert [p.path for p in problems] == [str(tmp_path / "LSTM-Wiki2" / "moved" / "D-RR-node4-B16-lr5.0-seed0")]
    assert "duplicate of" in problems[0].reason
    runs = df.drop_duplicates("run_dir").set_index("run_dir")
    assert runs["benchmark"].value_counts().to_dict() == {"LSTM-Wiki2": 5, "MLP-M4": 2}
    lstm = runs[runs["benchmark"] == "LSTM-Wiki2"]
    assert sorted(lstm.groupby(["sorter", "setting"]).size().items()) == [
        (("CD-GraB", "carried hidden state"), 2), (("CD-GraB", "zero hidden state"), 2),
        (("D-RR", "carried hidden state"), 1)]
    assert sorted(runs.loc[runs["benchmark"] == "MLP-M4", "setting"]) == ["all training units",
                                                                           "first 128 training units"]
    table = final_table(df)
    assert len(table) == 5 and set(table.loc[table["benchmark"] == "LSTM-Wiki2", "seeds"]) == {1, 2}
    assert "zero hidden state" in format_table(table)
    fig = plots.plot_benchmark(benchmark_curves(df), "LSTM-Wiki2")
    assert sorted(label for label in fig.axes[0].get_legend_handles_labels()[1] if not label.startswith("paper")) == [
        "CD-GraB (carried hidden state) (2 seeds)", "CD-GraB (zero hidden state) (2 seeds)",
        "D-RR (carried hidden state) (1 seed)"]
    plt.close(fig)


def test_figures_show_one_epoch_runs_the_paper_values_and_say_what_they_measure(tmp_path):
    # the paper's settings, one of 50 epochs run: the paper's values are drawn beside them
    for sorter in ("CD-GraB", "D-RR"):
        write_run(tmp_path, "LSTM-Wiki2", sorter, 0, epochs=50, rows=1, args=PAPER_SETTINGS["LSTM-Wiki2"])
    df = load_runs(tmp_path, include_incomplete=True, warn=False)
    fig = plots.plot_benchmark(benchmark_curves(df), "LSTM-Wiki2")
    curves = [line for line in fig.axes[0].get_lines() if not line.get_label().startswith("paper")]
    # one epoch is one point: drawn only as a marker
    assert len(curves) == 2 and all(len(line.get_xdata()) == 1 and line.get_marker() not in (None, "None", "")
                                    for line in curves)
    paper = {line.get_label(): (line.get_xdata()[0], line.get_ydata()[0]) for line in fig.axes[0].get_lines()
             if line.get_label().startswith("paper")}
    assert paper == {"paper CD-GraB (epoch 50)": (50, 5.311), "paper D-RR (epoch 50)": (50, 5.361)}
    assert "paper CD-GraB (epoch 50)" in fig.axes[0].get_legend_handles_labels()[1]
    test_ppl = fig.axes[[ax.get_ylabel() for ax in fig.axes].index("test perplexity")]
    assert {line.get_ydata()[0] for line in test_ppl.get_lines() if line.get_label().startswith("paper")} == {223.6, 231.9}
    plt.close(fig)
    fig = plots.plot_benchmark(benchmark_curves(df), "LSTM-Wiki2", x="seconds")
    assert "training seconds" in fig.axes[0].get_xlabel() and "evaluation excluded" in fig.axes[0].get_xlabel()
    assert not [line for line in fig.axes[0].get_lines() if line.get_label().startswith("paper")]  # no time known
    plt.close(fig)
    # the herding figure speaks the suite's letters: n workers, m units each
    hdf = pd.DataFrame([{"n_workers": 5, "m": 200, "d": 16, "trial": 0, "method": "CD-GraB", "round": r, "bound": 3.0}
                        for r in range(3)])
    fig = plots.plot_herding(aggregate_herding(hdf))
    assert fig.axes[0].get_title() == "n=5 workers, m=200 units each"
    plt.close(fig)


def test_analysis_reads_the_engines_flag_table_without_torch():
    """analysis/ takes which args may change on resume from engine/flags.py, the table resume checks
    against, and stays free of torch (notebooks and figures start without it)."""
    from engine.flags import RESUMABLE_FLAGS

    assert RESUMABLE_ARGS is RESUMABLE_FLAGS
    probe = "import sys, analysis.load; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_cli(results, tmp_path):
    out = tmp_path / "figures"
    proc = run_python([sys.executable, "-m", "analysis", results, "--out", out, "--band", "minmax"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "Final metric" in text and "test_smape" in text and "CD-GraB" in text and "D-RR" in text
    assert "incomplete: 2/3 epochs" in text and "unreadable config.json" in text
    for benchmark in BENCH_COLUMNS:
        for kind in ("vs-epoch", "vs-seconds", "time-breakdown"):
            for ext in ("png", "pdf"):
                assert (out / f"{benchmark}-{kind}.{ext}").stat().st_size > 0
    assert (out / "herding-bound.png").exists() and (out / "herding-bound.pdf").exists()
    assert (out / "final-metrics.csv").read_text().count("\n") == 1 + 4 * 2 + 8  # + the communication study
    assert (out / "communication-MLP-M4.png").stat().st_size > 0
    help_text = run_python([sys.executable, "-m", "analysis", "--help"]).stdout
    assert all(flag in help_text for flag in ("--out", "--band", "--herding-dir"))


def test_cli_empty_results_is_not_fatal(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_python([sys.executable, "-m", "analysis", tmp_path / "empty", "--out", tmp_path / "f"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "no finished runs" in proc.stdout and "no herding simulation CSVs" in proc.stdout
    # a folder that is not there is a mistyped argument, not an empty result (tests/test_bad_input.py)


def test_notebooks_stored_without_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"LR-HMDA.ipynb", "LSTM-Wiki2.ipynb", "MLP-M4.ipynb",
                                           "GPT2-Wiki103.ipynb", "herding-bound.ipynb", "heterogeneity.ipynb",
                                           "scaling.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[0].source
        assert nb.cells[0].cell_type == "code" and "RESULTS_DIR" in first and "sys.path" in first
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory):
    """A kernel spec manager whose python3 kernel is this interpreter (sys.executable), whatever
    python3 kernel spec or `python` the machine has elsewhere."""
    folder = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(folder / "python3")  # argv: [sys.executable, "-m", "ipykernel_launcher", ...]
    return KernelSpecManager(kernel_dirs=[str(folder)])


def test_notebook_kernel_is_this_interpreter(kernel_specs):
    assert kernel_specs.get_kernel_spec("python3").argv[0] == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, results, study_results, monkeypatch, kernel_specs):
    studies = path.stem in ("heterogeneity", "scaling")
    monkeypatch.setenv("CDGRAB_RESULTS", str(study_results if studies else results))
    monkeypatch.setenv("CDGRAB_HERDING", str(results / "herding"))
    nb = nbformat.read(path, as_version=4)
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=kernel_specs)
    try:  # a client handed its kernel manager leaves the kernel running: shut it down here
        NotebookClient(nb, km=kernel, timeout=120,
                       resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()  # raises on a cell error
    finally:
        if kernel.has_kernel:
            kernel.shutdown_kernel(now=True)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == {"herding-bound": 1, "heterogeneity": 1, "scaling": 1, "communication": 2}.get(
        path.stem, 3), path.name
    text = "".join(o.get("text", "") for o in outputs)
    assert "nothing to plot" not in text
