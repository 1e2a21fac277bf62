"""The sweep scripts' skip/resume logic, with a fake PYTHON that records its argv and writes a
schema-exact run dir (so the real entry scripts are not needed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import python_exec_env, run_python

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PAPER = {  # benchmark: (lr as passed, node_cnt, B, run-dir lr)
    "LR-HMDA": ("5e-3", "4", "16", "0.005"),
    "LSTM-Wiki2": ("5.0", "4", "16", "5"),
    "MLP-M4": ("1e-3", "4", "16", "0.001"),  # the paper's figure (the authors' notebook), not the original README
    "GPT2-Wiki103": ("5e-4", "64", "64", "0.0005"),
}
TAGS = {"LSTM-Wiki2": "-carry-hidden-clip0.25"}  # run-name part before -seed<N> that names a variant

# The sweeps' own helper snippets (`$PYTHON - ARGS <<'PY'`, `$PYTHON -c ...`) run on the real
# interpreter, unrecorded. Anything else is recorded (one JSON line of argv per call in $FAKE_LOG).
# For an entry script (main-*.py, possibly behind torchrun) it writes config.json and appends the
# missing metrics rows to --out, like a run that resumes; FAKE_STOP_AFTER=k stops after epoch k and
# exits 1 (a crash). Anything else: exit 0.
FAKE = r'''#!{python}
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
if argv[:1] in (["-"], ["-c"]):  # run_tag.py fed on stdin: a real python (the script server's, if any)
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    os.execv(python, [python, *argv])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\n")
scripts = [a for a in argv if Path(a).name.startswith("main-") and a.endswith(".py")]
if not scripts:
    sys.exit(0)
def flag(name):
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name][-1]
out, epochs = Path(flag("--out")), int(flag("--epochs"))
benchmark = Path(scripts[0]).stem[len("main-"):]
out.mkdir(parents=True, exist_ok=True)
args = {"sorter": flag("--sorter"), "seed": int(flag("--seed")), "lr": float(flag("--lr")), "momentum": 0.9,
        "weight_decay": 0.0, "B": int(flag("--B")), "node_cnt": int(flag("--node_cnt")), "epochs": epochs,
        "data_dir": flag("--data-dir"), "out": str(out), "device": "cpu", "backend": None,
        "max_train_examples": None, "resume": "--resume" in argv}
(out / "config.json").write_text(json.dumps({"benchmark": benchmark, "args": args, "sizes": {}, "data": {},
                                             "versions": {}, "git_commit": "0"}))
metrics = out / "metrics.csv"
header = "epoch,train_loss,test_loss,train_acc,test_acc,epoch_seconds,sorter_seconds,comm_seconds,compute_seconds,comm_bytes"
rows = metrics.read_text().splitlines()[1:] if "--resume" in argv and metrics.exists() else []
stop = int(os.environ.get("FAKE_STOP_AFTER", epochs))
for e in range(len(rows) + 1, min(epochs, stop) + 1):
    rows.append(f"{e},1.0,1.0,0.5,0.5,1.0,0.1,0.2,0.7,100")
metrics.write_text("\n".join([header] + rows) + "\n")
sys.exit(1 if stop < epochs else 0)
'''


@pytest.fixture
def env(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE.replace("{python}", sys.executable, 1))
    fake.chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    return {**os.environ, **python_exec_env(), "PYTHON": str(fake), "TORCHRUN": f"{fake} torchrun", "FAKE_LOG": str(tmp_path / "calls.jsonl"),
            "RESULTS": str(tmp_path / "results"), "DATA": str(data), "SEEDS": "0 1", "EPOCHS": "2"}


def sweep(bench, env, *args, check=True, **extra):
    proc = subprocess.run(["bash", str(SCRIPTS / f"sweep-{bench}.sh"), *args], env={**env, **extra},
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def calls(env):
    """The recorded argv lists, and clear the log."""
    log = Path(env["FAKE_LOG"])
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return [json.loads(line) for line in lines]


def value(argv, name):
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name][-1]


@pytest.mark.parametrize("bench", PAPER)
def test_fresh_sweep_uses_paper_settings_and_layout(bench, env):
    sweep(bench, env, "--max-train-examples", "64")
    lr, node_cnt, B, lr_name = PAPER[bench]
    recorded = calls(env)
    assert len(recorded) == 4  # 2 sorters x 2 seeds
    for argv in recorded:
        assert argv[0] == str(SCRIPTS.parent / f"main-{bench}.py")
        assert (value(argv, "--lr"), value(argv, "--node_cnt"), value(argv, "--B")) == (lr, node_cnt, B)
        assert value(argv, "--epochs") == "2" and value(argv, "--max-train-examples") == "64"
        assert argv[-1] == "--resume"
        # --max-train-examples 64 changes results: the run name says so (not the paper run's folder)
        name = (f"{value(argv, '--sorter')}-node{node_cnt}-B{B}-lr{lr_name}{TAGS.get(bench, '')}"
                f"-max-train-examples64-seed{value(argv, '--seed')}")
        assert value(argv, "--out") == f"{env['RESULTS']}/{bench}/{name}"
    assert {(value(a, "--sorter"), value(a, "--seed")) for a in recorded} == {
        ("CD-GraB", "0"), ("CD-GraB", "1"), ("D-RR", "0"), ("D-RR", "1")}
    if bench == "GPT2-Wiki103":  # no WikiText-103 train split in DATA: WikiText-2's stands in
        assert all(value(a, "--train-file") == f"{env['DATA']}/wikitext-2/train.txt" for a in recorded)
    else:
        assert not any("--train-file" in a for a in recorded)
    # the LSTM carries its hidden state, as the original code behind the paper's curves
    assert all(("--carry-hidden" in a) == (bench == "LSTM-Wiki2") for a in recorded)


def dry_run_names(bench, env, *args, **extra):
    """The run names a DRY_RUN=1 sweep prints, in order; nothing is run."""
    proc = sweep(bench, env, *args, DRY_RUN="1", **extra)
    assert calls(env) == []
    return [line.split("] run  ", 1)[1].split(":", 1)[0] for line in proc.stdout.splitlines() if "] run  " in line]


def test_extra_args_that_change_results_name_the_run(env):
    one = {"SORTERS": "CD-GraB", "SEEDS": "0"}
    assert dry_run_names("MLP-M4", env, **one) == ["CD-GraB-node4-B16-lr0.001-seed0"]  # no extra args: as before
    assert dry_run_names("MLP-M4", env, "--sketch-dim", "64", **one) == ["CD-GraB-node4-B16-lr0.001-sketch-dim64-seed0"]
    assert dry_run_names("MLP-M4", env, "--max-train-examples", "512") == [
        "CD-GraB-node4-B16-lr0.001-max-train-examples512-seed0", "CD-GraB-node4-B16-lr0.001-max-train-examples512-seed1",
        "D-RR-node4-B16-lr0.001-max-train-examples512-seed0", "D-RR-node4-B16-lr0.001-max-train-examples512-seed1"]
    # a value-named setting first, then the others in the parser's order (as the entry script's default --out)
    assert dry_run_names("MLP-M4", env, "--sketch-dim=64", "--reducer", "topk", "--density", "0.01",
                         "--max-train-examples", "512", **one) == [
        "CD-GraB-node4-B16-lr0.001-topk-max-train-examples512-sketch-dim64-density0.01-seed0"]
    # the name's own parts, --epochs and settings that do not change results add nothing
    assert dry_run_names("MLP-M4", env, "--progress", "off", "--data-dir", "/elsewhere", "--record-orders",
                         "--lr", "2e-3", "--epochs", "3", "--log-herding", **one) == ["CD-GraB-node4-B16-lr0.002-seed0"]
    # an extra argument equal to the sweep's own setting changes nothing
    assert dry_run_names("MLP-M4", env, "--node_cnt", "4", "--momentum", "0.9", **one) == ["CD-GraB-node4-B16-lr0.001-seed0"]
    # after the benchmark's variant tag; the sweep's own flags (--carry-hidden) are no extra tag
    assert dry_run_names("LSTM-Wiki2", env, "--clip", "0.25", **one) == ["CD-GraB-node4-B16-lr5-carry-hidden-clip0.25-seed0"]
    assert dry_run_names("heterogeneity", env, "--max-train-examples", "512", PARTITIONS="dirichlet:0.1", **one) == [
        "CD-GraB-node4-B16-lr0.005-dirichlet0.1-max-train-examples512-seed0"]


def test_variant_is_not_skipped_as_the_finished_paper_run(env):
    one = {"SORTERS": "CD-GraB", "SEEDS": "0"}
    sweep("MLP-M4", env, **one)
    (argv,) = calls(env)
    results = Path(env["RESULTS"]) / "MLP-M4"
    assert value(argv, "--out") == str(results / "CD-GraB-node4-B16-lr0.001-seed0")
    sweep("MLP-M4", env, "--sketch-dim", "64", **one)  # the exact run is finished: the sketched one still runs
    (argv,) = calls(env)
    assert value(argv, "--out") == str(results / "CD-GraB-node4-B16-lr0.001-sketch-dim64-seed0")
    assert value(argv, "--sketch-dim") == "64"
    sweep("MLP-M4", env, "--max-train-examples", "512", **one)  # the quick run: its own folder too
    (argv,) = calls(env)
    assert value(argv, "--out") == str(results / "CD-GraB-node4-B16-lr0.001-max-train-examples512-seed0")
    proc = sweep("MLP-M4", env, "--progress", "off", **one)  # the full run again: finished, skipped
    assert calls(env) == [] and "skip CD-GraB-node4-B16-lr0.001-seed0: finished" in proc.stdout


@pytest.mark.parametrize("args, error", [
    (["--bogus", "1"], "error: unrecognized arguments: --bogus 1; see main-MLP-M4.py --help"),
    (["--sketch-dim", "many"], "error: argument --sketch-dim: expected a whole number, got 'many'; see main-MLP-M4.py --help"),
    (["--max-train-examples", "0"], "error: argument --max-train-examples: must be >= 1, got 0; see main-MLP-M4.py --help"),
    # checked for every sorter before any run: D-RR takes no sketch (not a failure after the CD-GraB runs)
    (["--sketch-dim", "64"], "error: --sketch-dim applies to the sorters that balance gradients (CD-GraB, I-B, "
                             "I-PB, KH-SGD, SBW, Greedy, MB-GraB, RPB); --sorter D-RR uses none: drop --sketch-dim"),
    (["--seed", "3"], "error: the sweep sets --sorter and --seed of each run (and names the run by them): drop "
                      "them from the extra arguments and set SORTERS / SEEDS instead"),
])
def test_bad_extra_args_stop_the_sweep_with_one_line(env, args, error):
    for dry_run in ("1", "0"):
        proc = sweep("MLP-M4", env, *args, check=False, DRY_RUN=dry_run)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [error]
        assert "] run " not in proc.stdout and calls(env) == []


def test_run_tag_prints_the_entry_scripts_tag():
    def run_tag(*argv):
        proc = run_python([sys.executable, SCRIPTS / "run_tag.py", *argv], cwd=None, timeout=60)
        return proc.returncode, proc.stdout, proc.stderr
    fixed = ["--lr", "5e-3", "--node_cnt", "4", "--B", "16", "--partition", "random"]
    assert run_tag(str(REPO / "main-LR-HMDA.py"), "--", *fixed, "--") == (0, "\n", "")
    assert run_tag(str(REPO / "main-LR-HMDA.py"), "D-RR", "--", *fixed, "--", "--partition", "label-sorted", "--tf32",
                   "--weight-decay", "1e-4") == (0, "-label-sorted-weight-decay0.0001-tf32\n", "")


def test_lstm_zero_state_and_unclipped_variants_are_one_variable_away(env):
    sweep("LSTM-Wiki2", env, LSTM_STATE="zero", SORTERS="D-RR", SEEDS="0")
    (argv,) = calls(env)
    assert "--carry-hidden" not in argv and value(argv, "--clip") == "0.25"
    assert value(argv, "--out") == f"{env['RESULTS']}/LSTM-Wiki2/D-RR-node4-B16-lr5-zero-hidden-clip0.25-seed0"
    sweep("LSTM-Wiki2", env, SORTERS="D-RR", SEEDS="0")  # the default variant is another run, not a resume
    (argv,) = calls(env)
    assert "--carry-hidden" in argv and value(argv, "--out").endswith("D-RR-node4-B16-lr5-carry-hidden-clip0.25-seed0")
    sweep("LSTM-Wiki2", env, LSTM_CLIP="none", SORTERS="D-RR", SEEDS="0")  # the shipped HEAD variant's name
    (argv,) = calls(env)
    assert "--clip" not in argv and value(argv, "--out").endswith("D-RR-node4-B16-lr5-carry-hidden-seed0")
    for variable, bad in (("LSTM_STATE", "zeros"), ("LSTM_CLIP", "0.5")):
        proc = sweep("LSTM-Wiki2", env, check=False, **{variable: bad})
        assert proc.returncode == 2 and variable in proc.stderr and calls(env) == []


def test_m4_readme_setting_on_request(env):
    sweep("MLP-M4", env, M4_SETTING="readme", SORTERS="CD-GraB", SEEDS="0")
    (argv,) = calls(env)
    assert (value(argv, "--node_cnt"), value(argv, "--B"), value(argv, "--lr")) == ("32", "32", "1e-3")
    assert value(argv, "--out") == f"{env['RESULTS']}/MLP-M4/CD-GraB-node32-B32-lr0.001-seed0"
    proc = sweep("MLP-M4", env, check=False, M4_SETTING="notebook")
    assert proc.returncode == 2 and "M4_SETTING" in proc.stderr and calls(env) == []


def test_finished_runs_are_skipped_and_unfinished_resumed(env):
    sweep("LR-HMDA", env)
    assert len(calls(env)) == 4
    proc = sweep("LR-HMDA", env)  # everything finished: nothing runs
    assert calls(env) == [] and proc.stdout.count("] skip ") == 4
    run = Path(env["RESULTS"]) / "LR-HMDA" / "D-RR-node4-B16-lr0.005-seed1"
    metrics = run / "metrics.csv"
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:2]) + "\n")  # only epoch 1 left
    sweep("LR-HMDA", env)
    (argv,) = calls(env)
    assert value(argv, "--out") == str(run) and argv[-1] == "--resume"
    assert len(metrics.read_text().splitlines()) == 3  # resumed to 2 epochs
    proc = sweep("LR-HMDA", env, EPOCHS="1")  # fewer: finished, never touched (the engine would say so too)
    assert calls(env) == [] and proc.stdout.count("] skip ") == 4
    sweep("LR-HMDA", env, EPOCHS="3")  # more epochs asked than the runs were made for: all resume
    assert len(calls(env)) == 4


def test_crash_stops_sweep_and_rerun_resumes(env):
    proc = sweep("LR-HMDA", env, check=False, FAKE_STOP_AFTER="1")
    assert proc.returncode != 0 and len(calls(env)) == 1
    sweep("LR-HMDA", env)
    recorded = calls(env)
    assert len(recorded) == 4 and all(a[-1] == "--resume" for a in recorded)
    log = Path(env["RESULTS"]) / "logs" / "LR-HMDA" / "CD-GraB-node4-B16-lr0.005-seed0.log"
    assert log.exists()


def test_torchrun_and_overrides(env):
    sweep("MLP-M4", env, "--lr", "2e-3", NPROC="4", SORTERS="CD-GraB", SEEDS="3")
    (argv,) = calls(env)
    assert argv[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]
    assert value(argv, "--lr") == "2e-3"
    assert value(argv, "--out").endswith("MLP-M4/CD-GraB-node4-B16-lr0.002-seed3")
    proc = sweep("LR-HMDA", env, check=False, NPROC="3")  # 4 workers cannot split over 3 processes
    assert proc.returncode != 0 and "multiple" in proc.stderr and calls(env) == []


def test_torchrun_is_that_of_the_sweeps_python_by_default(env):
    """Without TORCHRUN, NPROC > 1 starts `$PYTHON -m torch.distributed.run`: the launcher of the same
    interpreter, not a `torchrun` found on PATH."""
    sweep("MLP-M4", {key: value for key, value in env.items() if key != "TORCHRUN"}, NPROC="4", SORTERS="CD-GraB",
          SEEDS="3")
    (argv,) = calls(env)  # the fake PYTHON's arguments
    assert argv[:4] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    assert Path(argv[4]).name == "main-MLP-M4.py"


def test_the_interpreter_is_the_activated_venv_else_the_checkouts_venv_else_python3(tmp_path):
    """Without PYTHON, a sweep (a dry run, in a checkout holding just the scripts) starts $VIRTUAL_ENV/bin/python,
    else the checkout's .venv/bin/python, else python3 from PATH; PYTHON wins over all of them; --help says
    which it starts."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("sweep-common.sh", "sweep-LR-HMDA.sh"):
        (checkout / "scripts" / name).write_text((SCRIPTS / name).read_text())
    pythons = {}
    for name, folder in (("checkout", checkout / ".venv"), ("activated", tmp_path / "activated")):
        (folder / "bin").mkdir(parents=True)
        pythons[name] = folder / "bin" / "python"  # a real interpreter: the sweep's own snippet runs on it
        pythons[name].write_text(f"#!/bin/sh\nexec '{sys.executable}' \"$@\"\n")
    base = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "VIRTUAL_ENV", "TORCHRUN")}
    base.update(DRY_RUN="1", SORTERS="D-RR", SEEDS="0", RESULTS=str(tmp_path / "results"), DATA=str(tmp_path),
                NPROC="2", PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")  # python3: this interpreter's

    def launcher(**env):
        proc = subprocess.run(["bash", str(checkout / "scripts" / "sweep-LR-HMDA.sh")], env={**base, **env},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        (command,) = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if "] run  " in line]
        helped = subprocess.run(["bash", str(checkout / "scripts" / "sweep-LR-HMDA.sh"), "--help"],
                                env={**base, **env}, capture_output=True, text=True, timeout=60).stdout
        python = command.split(" -m torch.distributed.run --standalone --nproc_per_node=2 ")[0]
        assert f"here: {python})" in helped, helped
        return python

    assert launcher() == "python3"  # neither venv's python is executable yet
    pythons["checkout"].chmod(0o755)
    assert launcher() == str(pythons["checkout"])
    assert launcher(VIRTUAL_ENV=str(tmp_path / "activated")) == str(pythons["checkout"])  # not executable there
    pythons["activated"].chmod(0o755)
    assert launcher(VIRTUAL_ENV=str(tmp_path / "activated")) == str(pythons["activated"])
    assert launcher(VIRTUAL_ENV=str(tmp_path / "activated"), PYTHON=str(pythons["checkout"])) == str(pythons["checkout"])


def test_gpt2_uses_wikitext103_train_split_when_present(env):
    folder = Path(env["DATA"]) / "wikitext-103"
    folder.mkdir()
    (folder / "wiki.train.tokens").write_text(" = x = \n")
    sweep("GPT2-Wiki103", env, SEEDS="0", SORTERS="D-RR")
    (argv,) = calls(env)
    assert "--train-file" not in argv and value(argv, "--data-dir") == env["DATA"]


def test_heterogeneity_sweep_runs_every_partition_in_its_own_folder(env):
    sweep("heterogeneity", env, SORTERS="CD-GraB I-B", SEEDS="0")
    recorded = calls(env)
    assert [(value(a, "--sorter"), value(a, "--partition")) for a in recorded] == [
        (sorter, partition) for partition in ["random", "dirichlet:1.0", "dirichlet:0.1", "label-sorted"]
        for sorter in ["CD-GraB", "I-B"]]
    assert all(value(a, "--max-train-examples") == "20000" and value(a, "--node_cnt") == "4" for a in recorded)
    tags = [value(a, "--out").rsplit("-lr0.005-", 1)[1] for a in recorded]
    assert tags[::2] == ["random-seed0", "dirichlet1.0-seed0", "dirichlet0.1-seed0", "label-sorted-seed0"]
    assert value(recorded[0], "--out") == f"{env['RESULTS']}/heterogeneity/LR-HMDA/CD-GraB-node4-B16-lr0.005-random-seed0"
    proc = sweep("heterogeneity", env, SORTERS="CD-GraB I-B", SEEDS="0")  # finished: all skipped
    assert calls(env) == [] and proc.stdout.count("] skip ") == 8


def test_scaling_sweep_grows_the_batch_with_the_workers(env):
    sweep("scaling", env, SORTERS="D-RR", SEEDS="1", WORKERS="4 64")
    recorded = calls(env)
    assert [(Path(a[0]).stem, value(a, "--node_cnt"), value(a, "--B")) for a in recorded] == [
        ("main-LR-HMDA", "4", "16"), ("main-LR-HMDA", "64", "256"), ("main-MLP-M4", "4", "16"), ("main-MLP-M4", "64", "256")]
    assert all("--log-herding" in a for a in recorded)
    assert value(recorded[3], "--out") == f"{env['RESULTS']}/scaling/MLP-M4/D-RR-node64-B256-lr0.001-seed1"
    assert [value(a, "--max-train-examples") for a in recorded] == ["20000", "20000", "8000", "8000"]
    proc = sweep("scaling", env, check=False, BENCHMARKS="LSTM-Wiki2")
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr


def test_communication_sweep_runs_every_strategy_in_its_own_folder(env):
    sweep("communication", env, SORTERS="D-RR", SEEDS="0")
    recorded = calls(env)
    flags = [(value(a, "--sync"), value(a, "--reducer")) for a in recorded]
    assert flags == [(sync, reducer) for sync in ("every-step", "constant", "qsr") for reducer in ("dense", "exdyna")]
    assert all(value(a, "--lr-schedule") == "cosine" and value(a, "--node_cnt") == "4" for a in recorded)
    assert value(recorded[5], "--alpha") == "0.002" and value(recorded[5], "--density") == "0.01"
    assert value(recorded[5], "--out") == f"{env['RESULTS']}/communication/MLP-M4/D-RR-node4-B16-lr0.001-qsr-exdyna-seed0"
    proc = sweep("communication", env, SORTERS="D-RR", SEEDS="0")  # finished: all skipped
    assert calls(env) == [] and proc.stdout.count("] skip ") == 6
    proc = sweep("communication", env, check=False, STRATEGIES="hourly")
    assert proc.returncode == 2 and "unknown strategy" in proc.stderr


@pytest.mark.parametrize("script", ["sweep-LR-HMDA.sh", "sweep-LSTM-Wiki2.sh", "sweep-MLP-M4.sh",
                                    "sweep-GPT2-Wiki103.sh", "reproduce-all.sh", "sweep-heterogeneity.sh",
                                    "sweep-scaling.sh", "sweep-communication.sh"])
def test_help(script):
    proc = subprocess.run(["bash", str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "SEEDS" in proc.stdout and "RESULTS" in proc.stdout
    variable = {"sweep-LSTM-Wiki2.sh": "LSTM_STATE", "sweep-MLP-M4.sh": "M4_SETTING",
                "sweep-heterogeneity.sh": "PARTITIONS", "sweep-scaling.sh": "WORKERS",
                "sweep-communication.sh": "STRATEGIES"}.get(script)
    assert variable is None or variable in proc.stdout


def test_reproduce_all_chains_everything(env, tmp_path):
    proc = subprocess.run(["bash", str(SCRIPTS / "reproduce-all.sh"), "--max-train-examples", "8"],
                          env={**env, "SEEDS": "0", "SORTERS": "CD-GraB", "EPOCHS": "1",
                               "HERDING_ARGS": "--scale 0.001 --trials 1", "FIGURES": str(tmp_path / "fig")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorded = calls(env)
    entry = [a for a in recorded if Path(a[0]).name.startswith("main-")]
    assert [Path(a[0]).stem for a in entry] == ["main-LR-HMDA", "main-LSTM-Wiki2", "main-MLP-M4", "main-GPT2-Wiki103"]
    assert all(value(a, "--max-train-examples") == "8" for a in entry)
    herding = [a for a in recorded if a[0].endswith("herding_simulation.py")]
    assert herding == [[str(SCRIPTS / "herding_simulation.py"), "--out", f"{env['RESULTS']}/herding",
                        "--scale", "0.001", "--trials", "1"]]
    assert ["-m", "analysis", env["RESULTS"], "--out", str(tmp_path / "fig")] in recorded


def test_herding_simulation_runs_the_papers_five_trials(tmp_path):
    run_python([sys.executable, SCRIPTS / "herding_simulation.py", "--scale", "0.0001", "--workers", "5",
                "--rounds", "1", "--methods", "D-RR", "--out", tmp_path], cwd=None, check=True, timeout=60)
    assert sorted(p.name for p in tmp_path.glob("*.csv")) == [f"n5-m20-trial{t}-D-RR.csv" for t in range(5)]


def test_herding_simulation_smallest_scale(tmp_path):
    """The real simulation at --scale 0.001: tidy CSVs, identical round-0 bounds across methods."""
    out = tmp_path / "herding"
    run_python([sys.executable, SCRIPTS / "herding_simulation.py", "--scale", "0.001", "--trials", "1",
                "--workers", "5", "10", "--rounds", "3", "--methods", "CD-GraB I-B I-PB D-RR ALL",
                "--out", out], cwd=None, check=True, timeout=60)
    import pandas as pd
    df = pd.concat([pd.read_csv(p) for p in sorted(out.glob("*.csv"))])
    assert list(df.columns[:7]) == ["n_workers", "m", "d", "trial", "method", "round", "bound"]
    assert len(df) == 2 * 5 * 4 and set(df["method"]) == {"CD-GraB", "I-B", "I-PB", "D-RR", "ALL"}
    parallel = df[(df["round"] == 0) & (df["method"] != "ALL")]
    assert parallel.groupby("n_workers")["bound"].nunique().eq(1).all()  # same initial order
    cd = df[df["method"] == "CD-GraB"].set_index(["n_workers", "round"])["bound"]
    assert (cd.xs(3, level="round") < cd.xs(0, level="round")).all()  # balancing lowers the bound
    assert not list(out.glob("*.tmp*"))


def test_herding_simulation_sketched_sorter_balances_sketches_and_is_scored_on_the_vectors():
    """"<sorter>+sketch<D>" runs the sorter on P z (P the sketch's dense (D, d) matrix here, an independent
    path to the same map) and scores the orders by z's own bound; D >= d is the exact run."""
    import importlib.util

    from sorters import GradientSketch, build_sorter, parallel_herding_bound

    spec = importlib.util.spec_from_file_location("herding_simulation", SCRIPTS / "herding_simulation.py")
    simulation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(simulation)
    assert simulation.parse_methods("CD-GraB D-RR", 4) == ["CD-GraB+sketch4", "D-RR"]
    z = simulation.make_vectors(400, 4, 16, trial=0)  # (4 workers, 100, 16)
    sketched = [bound for _, bound, _ in simulation.simulate(z, "CD-GraB+sketch4", rounds=3, seed=0, chunk=7)]

    z64 = torch.from_numpy(z)
    seen = (z64 @ GradientSketch(16, 4, seed=0).matrix().T).float()  # (4, 100, 4)
    sorter = build_sorter("CD-GraB", 4, 100, 4, seed=0)
    expected = []
    for _ in range(4):
        orders = sorter.sort()
        expected.append(parallel_herding_bound(z64, orders, center=False))
        ordered = torch.gather(seen, 1, orders[:, :, None].expand(4, 100, 4))
        sorter.step(ordered, torch.arange(100))
    assert sketched == pytest.approx(expected, rel=1e-12)
    exact = [bound for _, bound, _ in simulation.simulate(z, "CD-GraB", rounds=3, seed=0)]
    assert [bound for _, bound, _ in simulation.simulate(z, "CD-GraB+sketch16", rounds=3, seed=0)] == exact
    assert sketched[0] == exact[0] and sketched[3] != exact[3]
