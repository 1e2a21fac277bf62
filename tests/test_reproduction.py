"""The shipped full-scale results: what is in reproduction/, and that analysis reads it by default."""
import subprocess
import sys

import pytest

import analysis.load as load
from analysis import load_herding, load_runs
from tests.helpers import REPO

SHIPPED = REPO / "reproduction"


def test_shipped_runs_are_complete_and_hold_only_config_and_metrics():
    run_dirs = sorted(path.parent for path in SHIPPED.rglob("config.json"))
    assert run_dirs, "no shipped runs"
    for run in run_dirs:
        assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.csv"], run  # never checkpoints
    df, problems = load_runs(SHIPPED, with_problems=True, warn=False)
    assert not problems, problems
    runs = df.groupby(["benchmark", "sorter"])["run_dir"].nunique().to_dict()
    assert {key: runs.get(key) for key in [("LR-HMDA", "CD-GraB"), ("LR-HMDA", "D-RR"), ("MLP-M4", "CD-GraB"),
                                           ("MLP-M4", "D-RR"), ("MLP-M4", "Fold")]} == {
        ("LR-HMDA", "CD-GraB"): 5, ("LR-HMDA", "D-RR"): 5, ("MLP-M4", "CD-GraB"): 3, ("MLP-M4", "D-RR"): 3,
        ("MLP-M4", "Fold"): 3}
    assert df[df["benchmark"].isin(["LR-HMDA", "MLP-M4"])].groupby("run_dir")["epoch"].max().eq(50).all()
    herding = load_herding(SHIPPED / "herding", warn=False)
    assert herding.groupby("method")["trial"].nunique().to_dict() == {"CD-GraB": 5, "D-RR": 5, "I-B": 5, "I-PB": 5}


def test_analysis_defaults_to_the_shipped_runs_without_runs_of_ones_own(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "REPO_ROOT", tmp_path)
    assert load.default_results_dir() == load.SHIPPED_RESULTS == SHIPPED
    (tmp_path / "results" / "LR-HMDA" / "mine").mkdir(parents=True)
    assert load.default_results_dir() == SHIPPED  # an empty results/ is not "runs of one's own"
    (tmp_path / "results" / "LR-HMDA" / "mine" / "config.json").write_text("{}")
    assert load.default_results_dir() == tmp_path / "results"


@pytest.mark.slow
def test_analysis_draws_the_reproduction_figures(tmp_path):
    done = subprocess.run([sys.executable, "-m", "analysis", str(SHIPPED), "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("LR-HMDA-vs-epoch", "MLP-M4-vs-epoch", "LSTM-Wiki2-vs-epoch", "GPT2-Wiki103-vs-epoch",
                 "herding-bound"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
    assert "MLP-M4" in (tmp_path / "final-metrics.csv").read_text()
