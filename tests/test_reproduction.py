"""The shipped full-scale results: what is in reproduction/, and that analysis reads it by default."""
import json
import sys

import pytest

import analysis.load as load
from analysis import load_herding, load_runs
from tests.helpers import REPO, read_metrics, release_check, run_python

SHIPPED = REPO / "reproduction"


GPU_BENCHMARKS = ("LSTM-Wiki2", "GPT2-Wiki103")  # grow session by session (scripts/gpu_session.py)


@pytest.fixture(scope="module")
def shipped_read():
    """load_runs(SHIPPED, with_problems=True): the shipped runs are read once for the module (about 2 s of
    CPU a read); each test takes its own copy of the frame (shipped() below)."""
    return load_runs(SHIPPED, with_problems=True, warn=False)


@pytest.fixture
def shipped(shipped_read):
    """load_runs(SHIPPED, warn=False), a copy of the module's one read."""
    return shipped_read[0].copy()


def test_shipped_runs_are_complete_and_hold_only_config_and_metrics(shipped_read):
    """Every shipped run holds config.json and metrics.csv; only an unfinished GPU run may also hold its
    packed checkpoint (small, for the next GPU session), and only GPU runs may be unfinished."""
    run_dirs = sorted(path.parent for path in SHIPPED.rglob("config.json"))
    assert run_dirs, "no shipped runs"
    for run in run_dirs:
        files = sorted(p.name for p in run.iterdir())
        done = len(read_metrics(run)) >= json.loads((run / "config.json").read_text())["args"]["epochs"]
        if run.parent.name in GPU_BENCHMARKS and not done and "checkpoint.pt.gz" in files:
            assert (run / "checkpoint.pt.gz").stat().st_size <= 16 << 20, run
            files.remove("checkpoint.pt.gz")
        assert files == ["config.json", "metrics.csv"], run
    df, problems = shipped_read[0].copy(), shipped_read[1]
    unfinished = [str(p) for p in problems if "incomplete" in str(p)]
    assert all(any(f"/{b}/" in p for b in GPU_BENCHMARKS) for p in unfinished), unfinished
    assert len(unfinished) == len(problems), problems
    own = df[df["study"] == ""]  # the benchmarks' own runs; the studies are checked below
    runs = own.groupby(["benchmark", "sorter"])["run_dir"].nunique().to_dict()
    assert {key: runs.get(key) for key in [("LR-HMDA", "CD-GraB"), ("LR-HMDA", "D-RR"), ("MLP-M4", "CD-GraB"),
                                           ("MLP-M4", "D-RR"), ("MLP-M4", "Fold")]} == {
        ("LR-HMDA", "CD-GraB"): 5, ("LR-HMDA", "D-RR"): 5, ("MLP-M4", "CD-GraB"): 3, ("MLP-M4", "D-RR"): 3,
        ("MLP-M4", "Fold"): 3}
    assert own[own["benchmark"].isin(["LR-HMDA", "MLP-M4"])].groupby("run_dir")["epoch"].max().eq(50).all()
    # issue #60's orderers: 5 seeds on LR-HMDA, 3 on MLP-M4 (Greedy there on --sketch-dim 64, in the leaderboard's
    # own folder, where its sketch does not relabel the benchmark's runs)
    assert {key: runs.get(key) for key in [(b, s) for b in ("LR-HMDA", "MLP-M4")
                                           for s in ("FlipFlop", "SWR", "Greedy", "MB-GraB", "RPB")]} == {
        **{("LR-HMDA", s): 5 for s in ("FlipFlop", "SWR", "Greedy", "MB-GraB", "RPB")},
        **{("MLP-M4", s): 3 for s in ("FlipFlop", "SWR", "MB-GraB", "RPB")}, ("MLP-M4", "Greedy"): None}
    board = df[df["study"] == "leaderboard"]
    assert board.groupby(["benchmark", "sorter"])["run_dir"].nunique().to_dict() == {("MLP-M4", "Greedy"): 3}
    assert board.groupby("run_dir")["epoch"].max().eq(50).all()
    assert set(own["setting"]) == {""} or "sketch_dim" not in " ".join(own["setting"])  # no run relabelled
    herding = load_herding(SHIPPED / "herding", warn=False)
    # (vectors a trial, method) -> trials, each with every worker count (10^6: the paper's scale)
    runs = herding.assign(vectors=herding["n_workers"] * herding["m"]).groupby(["vectors", "method", "trial"])
    assert runs["n_workers"].nunique().eq(5).all()
    trials = runs.size().reset_index().groupby(["vectors", "method"])["trial"].nunique().to_dict()
    assert trials == {**{(10**6, method): 5 for method in ("CD-GraB", "D-RR", "I-B", "I-PB", "KH-SGD", "SBW", "MB-GraB",
                                                           "FlipFlop", "SWR", "RPB")},
                      **{(10**5, method): 3 for method in ("Greedy", "CD-GraB", "D-RR")}}  # Greedy's affordable scale


def test_shipped_studies_are_complete(shipped):
    """Issue #10: 4 partitions x 4 sorters x 3 seeds on LR-HMDA; 2 benchmarks x 3 worker counts x 2 sorters
    x 3 seeds with the herding bound logged every epoch."""
    df = shipped
    het = df[df["study"] == "heterogeneity"].drop_duplicates("run_dir")
    assert het.groupby(["partition", "sorter"])["seed"].nunique().to_dict() == {
        (p, s): 3 for p in ["random", "dirichlet:1", "dirichlet:0.1", "label-sorted"]
        for s in ["CD-GraB", "D-RR", "I-B", "I-PB"]}
    scaling = df[df["study"] == "scaling"]
    assert scaling.drop_duplicates("run_dir").groupby(["benchmark", "node_cnt", "sorter"])["seed"].nunique().to_dict() == {
        (b, n, s): 3 for b in ["LR-HMDA", "MLP-M4"] for n in [4, 16, 64] for s in ["CD-GraB", "D-RR"]}
    assert scaling["herding_bound"].notna().all() and (scaling["B"] == 4 * scaling["node_cnt"]).all()


def test_shipped_communication_study_is_complete(shipped):
    """Issue #9: {every-step, constant, qsr} x {dense, exdyna} x {CD-GraB, D-RR} x 3 seeds on MLP-M4; QSR's
    rounds tile every run and grow as the cosine learning rate decays."""
    from analysis.aggregate import communication_table

    df = shipped
    table = communication_table(df)
    assert len(table) == 12 and (table["seeds"] == 3).all() and (table["epochs"] == 4).all()
    runs = df[df["study"] == "communication"]
    steps = (runs["syncs"] * runs["mean_H"]).groupby(runs["run_dir"]).sum()  # an epoch with no averaging: NaN
    assert (steps.round() == 4 * 6711).all()  # rounds may cross epoch ends, but they tile the run
    qsr = runs[runs["run_dir"].str.contains("-qsr-")].groupby("epoch")["mean_H"].mean()
    assert list(qsr) == sorted(qsr) and qsr.iloc[-1] > 10 * qsr.iloc[0]


def test_shipped_sketching_study_is_complete_and_sends_what_the_formula_says(shipped):
    """Issue #20: sketched CD-GraB (D = 64, 256, 1024) x 3 seeds with --log-herding, 10 epochs on 8,000 MLP-M4
    windows, drawn against the scaling study's exact CD-GraB and D-RR runs of the same settings; issue #31:
    the same with the structured map (--sketch-min-numel 16: every weight matrix a TensorSketch block), on
    MLP-M4 and LR-HMDA. Bytes per epoch from the documented formula, steps * 4 * (n k D + n d) for a sketch
    of either family, steps * 4 * n k d exact and steps * 4 * n d for D-RR (n = k = 4, d = 5,569, 500 steps)."""
    from analysis.aggregate import sketching_runs
    from analysis.load import load_configs

    runs = sketching_runs(shipped, "MLP-M4")
    herding = runs[~runs["full_data"]]
    dims = (64, 256, 1024)
    assert herding.groupby("variant")["run_dir"].nunique().to_dict() == {
        "CD-GraB exact": 3, "D-RR": 3, **{f"CD-GraB, D = {D}{suffix}": 3 for D in dims for suffix in ("", ", structured")}}
    assert (herding.groupby("run_dir")["epoch"].max() == 10).all() and herding["herding_bound"].notna().all()
    n = k = 4
    d, steps = 5569, 500
    expected = {"CD-GraB exact": steps * 4 * n * k * d, "D-RR": steps * 4 * n * d,
                **{f"CD-GraB, D = {D}{suffix}": steps * 4 * (n * k * D + n * d) for D in dims
                   for suffix in ("", ", structured")}}
    assert herding.groupby("variant")["comm_bytes"].agg(set).to_dict() == {v: {b} for v, b in expected.items()}
    # the structured runs' maps: the MLP's three weight matrices (20 -> 64, 64 -> 64, 64 -> 1) are the blocks
    structured = load_configs(herding[herding["structured"]])["blocks"]
    assert len(structured) == 9 and all(blocks == [[0, 64, 20], [1344, 64, 64], [5504, 1, 64]] for blocks in structured)
    full = runs[runs["full_data"]]  # the paper figure's setting, 30 epochs: 6,711 steps per epoch
    assert full.groupby("variant")["run_dir"].nunique().to_dict() == {"CD-GraB exact": 3, "CD-GraB, D = 64": 3, "D-RR": 3}
    assert (full.groupby("run_dir")["epoch"].max() == 30).all()
    assert set(full.loc[full["variant"] == "CD-GraB, D = 64", "comm_bytes"]) == {6711 * 4 * (n * k * 64 + n * d)}
    lr = sketching_runs(shipped.copy(), "LR-HMDA")  # d = 26: D = 8 and 16, 1,250 steps
    assert lr.groupby("variant")["run_dir"].nunique().to_dict() == {
        "CD-GraB exact": 3, "D-RR": 3, **{f"CD-GraB, D = {D}{suffix}": 3 for D in (8, 16) for suffix in ("", ", structured")}}
    for variant in ("CD-GraB, D = 8", "CD-GraB, D = 8, structured"):
        assert set(lr.loc[lr["variant"] == variant, "comm_bytes"]) == {1250 * 4 * (n * k * 8 + n * 26)}
    # LR's one weight is 1 x 25: a one-row block (the bias stays CountSketched)
    assert {str(blocks) for blocks in load_configs(lr[lr["structured"]])["blocks"]} == {"[[0, 1, 25]]"}


def test_shipped_reorderers_study_is_complete_and_matched_with_its_baselines(shipped):
    """Issue #21: KH-SGD and SBW on LR-HMDA with 1 worker (seeds 1-5, with CD-GraB and D-RR of their own)
    and 4 workers (seeds 0-4), and on MLP-M4 with 4 workers (seeds 0-2), each drawn against the CD-GraB and
    D-RR runs of exactly its settings (the benchmark's own runs for 4 workers; not e.g. the scaling or
    heterogeneity studies' runs of other worker counts or data), all 50 epochs."""
    from analysis.aggregate import reorderer_runs

    df = shipped
    sorters = ["CD-GraB", "D-RR", "KH-SGD", "SBW"]
    for benchmark, groups in {"LR-HMDA": {1: [1, 2, 3, 4, 5], 4: [0, 1, 2, 3, 4]}, "MLP-M4": {4: [0, 1, 2]}}.items():
        runs = reorderer_runs(df, benchmark)
        seeds = runs.groupby(["node_cnt", "sorter"])["seed"].agg(lambda s: sorted(set(s))).to_dict()
        assert seeds == {(n, sorter): wanted for n, wanted in groups.items() for sorter in sorters}, benchmark
        assert (runs.groupby("run_dir")["epoch"].max() == 50).all() and runs.groupby("run_dir").size().eq(50).all()
        counts = runs.groupby(["node_cnt", "sorter"])["run_dir"].nunique().to_dict()
        assert counts == {(n, sorter): len(wanted) for n, wanted in groups.items() for sorter in sorters}, benchmark
        assert runs["lr"].nunique() == runs["B"].nunique() == runs["partition"].nunique() == 1, benchmark


def test_analysis_defaults_to_the_shipped_runs_without_runs_of_ones_own(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "REPO_ROOT", tmp_path)
    assert load.default_results_dir() == load.SHIPPED_RESULTS == SHIPPED
    (tmp_path / "results" / "LR-HMDA" / "mine").mkdir(parents=True)
    assert load.default_results_dir() == SHIPPED  # an empty results/ is not "runs of one's own"
    (tmp_path / "results" / "LR-HMDA" / "mine" / "config.json").write_text("{}")
    assert load.default_results_dir() == tmp_path / "results"


@release_check  # python -m analysis over every shipped run: about 25 s, the test command's second longest
@pytest.mark.slow
def test_analysis_draws_the_reproduction_figures(tmp_path):
    done = run_python([sys.executable, "-m", "analysis", SHIPPED, "--out", tmp_path], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("LR-HMDA-vs-epoch", "MLP-M4-vs-epoch", "LSTM-Wiki2-vs-epoch", "GPT2-Wiki103-vs-epoch",
                 "herding-bound", "heterogeneity", "scaling", "communication-MLP-M4", "sketching-MLP-M4", "sketching-LR-HMDA",
                 "reorderers-LR-HMDA", "reorderers-MLP-M4", "leaderboard"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
    assert "MLP-M4" in (tmp_path / "final-metrics.csv").read_text()


# ---------------------------------------------------------------------------------------------- the LSTM setting
LSTM_CONFIG = json.loads((SHIPPED / "LSTM-Wiki2" / "D-RR-node4-B16-lr5-carry-hidden-seed0" / "config.json").read_text())


def fabricate_lstm_run(root, sorter, seed, clip, losses, **changed):
    """An LSTM-Wiki2 run folder: the shipped config.json with this sorter, seed and --clip, and a metrics.csv
    of these train losses (epochs 1, 2, ...)."""
    config = json.loads(json.dumps(LSTM_CONFIG))
    config["args"].update(sorter=sorter, seed=seed, clip=clip, **changed)
    folder = root / "LSTM-Wiki2" / f"{sorter}-seed{seed}-clip{clip}-{len(changed)}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.csv").write_text("epoch,train_loss,epoch_seconds\n" +
                                        "".join(f"{e},{loss},1.0\n" for e, loss in enumerate(losses, 1)))
    return folder


def test_the_lstm_setting_rule_on_the_shipped_runs():
    """Today: unclipped seed 0 is 0.75 apart at epoch 1 (7.093 vs 6.340), clipped 0.0014 (6.014 vs 6.013):
    the rule gives --clip 0.25 because only the clipped runs agree."""
    from analysis.lstm_setting import decide

    decision = decide(SHIPPED)
    assert decision.clip == 0.25 and not decision.provisional, decision
    assert round(decision.losses[None]["D-RR"], 3) == 7.093 and round(decision.losses[None]["CD-GraB"], 3) == 6.340
    assert round(decision.losses[0.25]["D-RR"], 3) == 6.014 and round(decision.losses[0.25]["CD-GraB"], 3) == 6.013
    assert decision.reason.startswith("only there")


@pytest.mark.parametrize("unclipped, clipped, chosen, provisional, why", [
    ((7.093, 6.340), (6.500, 6.505), 0.25, False, "only there"),            # only the clipped pair agrees
    ((6.500, 6.509), (6.500, 6.600), None, False, "only there"),            # only the unclipped pair agrees
    ((6.500, 6.505), (6.500, 6.505), 0.25, False, "both settings agree"),
    ((7.093, 6.340), (6.500, 6.520), 0.25, False, "neither setting agrees"),  # 0.02 apart: not within 0.01
    ((6.500, 6.505), None, None, True, "provisional"),                       # clipped not run: could still be both
    (None, None, 0.25, True, "provisional"),
])
def test_the_lstm_setting_rule_picks_the_setting_where_epoch_1_agrees(tmp_path, unclipped, clipped, chosen,
                                                                      provisional, why):
    from analysis.lstm_setting import decide, markdown

    for clip, pair in ((None, unclipped), (0.25, clipped)):
        for sorter, loss in zip(("D-RR", "CD-GraB"), pair or ()):
            fabricate_lstm_run(tmp_path, sorter, 0, clip, [loss, loss - 0.5])
    # runs the rule must ignore: another seed, a sorter outside the pair, other settings than the paper's
    fabricate_lstm_run(tmp_path, "CD-GraB", 1, 0.25, [1.0])
    fabricate_lstm_run(tmp_path, "Fold", 0, 0.25, [1.0])
    fabricate_lstm_run(tmp_path, "CD-GraB", 0, 0.25, [1.0], carry_hidden=False)
    fabricate_lstm_run(tmp_path, "D-RR", 0, None, [1.0], lr=1.0)
    decision = decide(tmp_path)
    assert (decision.clip, decision.provisional) == (chosen, provisional), decision
    assert why in decision.reason
    table = "\n".join(markdown(decision))
    if clipped:
        assert f"| {clipped[0]:.5f} | {clipped[1]:.5f} | {abs(clipped[0] - clipped[1]):.5f} |" in table
    else:
        assert "| not run yet | not run yet | - | - |" in table


# ---------------------------------------------------------------------------------------------- honest tables
def tables_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("reproduction_tables", REPO / "scripts" / "reproduction_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_std_is_the_population_std_over_seeds():
    """The paper's notebooks shade numpy's std of the seeds' curves (ddof 0); the tables use the same."""
    import statistics

    tables = tables_module()
    values = [5.0, 5.5, 7.0]
    assert tables.mean_std(values) == f"{statistics.mean(values):.5f} ± {statistics.pstdev(values):.5f} (n=3)"
    assert tables.mean_std([5.0]) == "5.00000 (n=1)" and tables.mean_std([]) == "-"


def session_record(root, stamp, runs: dict, tests=False, device="NVIDIA H200, 143771 MiB"):
    """A gpu-sessions/<stamp>/session.json whose calls trained {run key: (first epoch, last epoch)}."""
    folder = root / "gpu-sessions" / stamp
    folder.mkdir(parents=True)
    manifest = {"device": device, "tiny": False, "runs": {
        key: {"epochs_done": last, "epochs_this_call": last - first + 1} for key, (first, last) in runs.items()}}
    manifest["runs"]["LSTM-Wiki2/waiting-run"] = {"epochs_done": 3, "epochs_this_call": 0}  # trained nothing
    if tests:
        manifest["tests_exit"] = 0
    (folder / "session.json").write_text(json.dumps(manifest))


def test_tables_compare_every_column_at_one_epoch_over_the_same_seeds_and_time_only_epochs_alone(tmp_path):
    """Partial runs: every column is read at the last epoch where some seed has both of the paper's sorters,
    over those seeds only (a sorter's other seeds are left out); a column with fewer seeds names them; the
    runs of another setting (--clip) get their own table; seconds per epoch count only epochs a run trained
    alone on the GPU, per the session records (an epoch trained again later is decided by the later call)."""
    from analysis import load_runs

    tables = tables_module()
    drr0 = fabricate_lstm_run(tmp_path, "D-RR", 0, None, [7.0, 6.0, 5.0, 4.0])
    fabricate_lstm_run(tmp_path, "D-RR", 1, None, [7.0, 6.5])
    cd0 = fabricate_lstm_run(tmp_path, "CD-GraB", 0, None, [6.0, 5.0, 3.0])
    fabricate_lstm_run(tmp_path, "CD-GraB", 1, None, [6.0, 5.5, 5.25, 5.0])
    fabricate_lstm_run(tmp_path, "CD-GraB", 2, None, [6.0, 5.5, 4.0])   # no D-RR of seed 2: left out
    fabricate_lstm_run(tmp_path, "Fold", 0, None, [9.0, 8.0, 1.0])
    fabricate_lstm_run(tmp_path, "D-RR", 0, 0.25, [2.0])               # another setting: its own table
    for folder, seconds in ((drr0, [10.0, 20.0, 30.0, 40.0]), (cd0, [1.0, 2.0, 4.0])):
        (folder / "metrics.csv").write_text("epoch,train_loss,epoch_seconds\n" + "".join(
            f"{e},{line.split(',')[1]},{s}\n" for e, (line, s) in
            enumerate(zip((folder / "metrics.csv").read_text().splitlines()[1:], seconds), 1)))
    key = lambda folder: f"LSTM-Wiki2/{folder.name}"
    session_record(tmp_path, "2026-01-01T000000", {key(drr0): (1, 2), key(cd0): (1, 1)})      # shared
    session_record(tmp_path, "2026-01-01T001000", {key(drr0): (3, 3)}, tests=True)          # tests beside it
    session_record(tmp_path, "2026-01-01T002000", {key(cd0): (2, 3)})                       # alone
    session_record(tmp_path, "2026-01-01T003000", {key(drr0): (4, 4)}, device="H100, 80 GiB")  # alone
    session_record(tmp_path, "2026-01-01T004000", {key(cd0): (3, 3), "LSTM-Wiki2/x": (1, 1)})  # redoes 3, shared
    df = load_runs(tmp_path, include_incomplete=True, warn=False)
    text = "\n".join(tables.benchmark_table(df, "LSTM-Wiki2", tables.alone_epochs(tmp_path)))
    # seed 0: both reached 3; seed 1: 2; so epoch 3 over seed 0: CD-GraB 3.0, D-RR 5.0, Fold 1.0
    assert ("| train_loss | 3 (partial; seed 0; paper: 50) | 5.311 | 5.361 | 3.00000 (n=1) | 5.00000 (n=1) | "
            "1.00000 (n=1) |") in text, text
    # seconds: CD-GraB seed 0's epoch 2 (2 s; its epoch 3 was trained again beside another run), D-RR seed 0's
    # epoch 4 (40 s); nothing else alone
    assert ("| training s/epoch alone on the GPU (mean over epochs) | | | | 2.0 (1 epoch, NVIDIA H200) | "
            "40.0 (1 epoch, H100) | - (no epoch alone) |") in text, text
    assert "| LSTM-Wiki2 (clip=0.25) | epoch |" in text and "| LSTM-Wiki2 (clip unset) | epoch |" in text
    # all of seeds 0 and 1 at the paper's epoch: both seeds; a sorter with one of them says which
    at_paper = df[df["setting"] == "clip unset"].copy()
    at_paper.loc[(at_paper["seed"] == 0) & (at_paper["epoch"] == 3), "epoch"] = 50
    at_paper.loc[(at_paper["seed"] == 1) & (at_paper["epoch"] == 2), "epoch"] = 50
    text = "\n".join(tables.setting_table(at_paper, "LSTM-Wiki2", "", {}))
    assert "| train_loss | 50 (seeds 0-1) | 5.311 | 5.361 | 4.25000 ± 1.25000 (n=2) | 5.75000 ± 0.75000 (n=2) | " \
           "1.00000 (n=1: seed 0) |" in text, text
