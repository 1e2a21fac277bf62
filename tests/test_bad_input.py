"""Every bad input is one line, exit status 2, and nothing written (docs/reliability.md).

The table drives every flag of every entry script (the parser's own list of them, so a new flag is in the
table or fails test_every_flag_has_bad_values) and of `python -m analysis` with bad values: empty,
negative, zero where it means nothing, NaN, inf, huge, the wrong type, paths that are files or under files.
In this process, through the parser and the checks run_entry_point makes before it reads any data
(`door`); a handful end to end. The expectations are the documented ranges, written out here, not read
from the code: a flag whose check is dropped fails."""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import runlog
from engine.cli import check_args, check_resume
from common.errors import UserFacingError
from engine.rundir import RunLock, claim_run_folder
from tests.helpers import DATA_DIR, REPO, entry_point, needs_data, run_python, run_script

SCRIPTS = ("main-LR-HMDA.py", "main-MLP-M4.py", "main-LSTM-Wiki2.py", "main-GPT2-Wiki103.py")
NUMBER_BAD = ("", "abc", "nan", "inf", "-inf", "-1", "1e400", "99999999999999999999")
# numeric flags for which 0 is meaningless too (0 is a valid seed, momentum, decay, warm-up, floor, ...)
ZERO_BAD = {"lr", "B", "node_cnt", "epochs", "max_train_examples", "max_eval_examples", "sketch_min_numel",
            "dist_timeout", "H", "H_base", "H_init", "power", "switch_epoch", "density", "bptt", "clip",
            "max_seq_length", "in_len", "hidden", "layers"}
WHOLE = {"seed", "B", "node_cnt", "epochs", "max_train_examples", "max_eval_examples", "sketch_dim",
         "sketch_min_numel", "H", "H_base", "H_init", "switch_epoch", "bptt", "max_seq_length", "in_len", "hidden",
         "layers"}  # a fraction is the wrong type
REAL = {"lr", "momentum", "weight_decay", "dist_timeout", "warmup_epochs", "min_lr", "alpha", "power", "density",
        "clip"}
EXTRA_BAD = {"momentum": ("1", "1.5"), "density": ("1.01",), "layers": ("1",), "max_seq_length": ("1",),
             "partition": ("", "dirichlet:0", "dirichlet:nan", "dirichlet:inf", "none"), "lr": ("1e308",),
             "seed": ("4294967296",), "dist_timeout": ("1e300",),
             "grad_chunk": ("", "none", "0", "-1", "1.5", "nan", "inf")}  # auto, all or a whole number >= 1
PATHS = {"data_dir", "hmda_file", "train_file", "cache_dir"}  # read where the data loads: end to end below
COMBINATIONS = [  # settings each fine alone
    ["--B", "6", "--node_cnt", "4"], ["--min-lr", "1", "--lr", "0.1"], ["--warmup-epochs", "3", "--epochs", "3"],
    ["--density", "0.5"], ["--reducer", "topk"], ["--sync", "qsr"], ["--sync", "post-local"],
    ["--switch-epoch", "9", "--epochs", "3"], ["--overwrite", "--resume"], ["--sketch-min-numel", "5"],
    ["--sorter", "D-RR", "--sketch-dim", "4"], ["--sorter", "D-RR", "--sign-loop", "gram"], ["--avg-m"],
    ["--log-herding", "--sync", "constant"], ["--average-opt-state"], ["--out", ""], ["--tf32=yes"],
    ["--compile", "aot_eager", "--sync", "constant"], ["--compile", "inductor", "--sketch-dim", "4"]]


@pytest.fixture(scope="module")
def scripts():
    return {script: entry_point(script) for script in SCRIPTS}


def door(benchmark, parser, argv) -> None:
    """What run_entry_point does with a command line before it reads data or starts the process group."""
    args = parser.parse_args(argv)
    out_given = args.out is not None
    check_args(args, benchmark, defaults=vars(parser.parse_args([])))
    check_resume(args, benchmark, out_given)
    lock = claim_run_folder(args, benchmark)
    if lock:
        lock.release()


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def refused(capsys, benchmark, parser, argv) -> str:
    """The one line a bad command line gets: exit 2 from the parser, or a UserFacingError from the checks."""
    try:
        door(benchmark, parser, argv)
    except SystemExit as stop:
        assert stop.code == 2, argv
        err = capsys.readouterr().err
    except UserFacingError as error:
        err = f"error: {error}\n"
    else:
        raise AssertionError(f"accepted: {argv}")
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in err and lines[0].startswith("error: "), (argv, err)
    return lines[0]


def bad_values(dest: str, action) -> list[str]:
    if dest in PATHS:
        return []
    if action.choices is not None:
        return ["", "x", "nan"]
    values = list(EXTRA_BAD.get(dest, ()))
    if dest in WHOLE | REAL:
        values += [*NUMBER_BAD, *(["0"] if dest in ZERO_BAD else []), *(["1.5"] if dest in WHOLE else [])]
    return values


def actions(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_flag_has_bad_values(scripts):
    """A numeric flag, a choice or a path: nothing with a value escapes the table."""
    for benchmark, parser, _ in scripts.values():
        for action in actions(parser):
            if action.nargs == 0:  # a switch: --tf32=yes in COMBINATIONS
                continue
            assert bad_values(action.dest, action) or action.dest in PATHS | {"out"}, (benchmark, action.dest)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bad_flag_value_is_one_line_exit_2_and_nothing_written(script, scripts, tmp_path, monkeypatch,
                                                                     capsys):
    benchmark, parser, _ = scripts[script]
    monkeypatch.chdir(tmp_path)  # the default --out lands here, if anything were written
    (tmp_path / "a-file").write_text("mine\n")
    cases = [[action.option_strings[-1], value] for action in actions(parser)
             for value in bad_values(action.dest, action)]
    cases += [["--out", "a-file"], ["--out", "a-file/run"], ["--out", ""], ["--out", " "], *COMBINATIONS]
    before = snapshot(tmp_path)
    for argv in cases:
        line = refused(capsys, benchmark, parser, argv)
        if argv[0] == "--B" and argv[1] == "0":
            assert "must be >= 1" in line and "divisible" not in line, line
    assert snapshot(tmp_path) == before
    assert len(cases) > 150


def test_an_unwritable_out_is_refused_before_anything_is_made(scripts, tmp_path, monkeypatch, capsys):
    benchmark, parser, _ = scripts["main-LR-HMDA.py"]
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))  # root
    line = refused(capsys, benchmark, parser, ["--out", str(locked / "run")])
    assert "cannot write in" in line and "permission denied" in line
    assert list(locked.iterdir()) == []


def finished_run(tmp_path) -> Path:
    """A copy of a run shipped in reproduction/: config.json and all 50 epochs in metrics.csv, no checkpoint."""
    run = tmp_path / "shipped"
    shutil.copytree(REPO / "reproduction" / "LR-HMDA" / "D-RR-node4-B16-lr0.005-seed0", run)
    return run


def test_a_finished_run_or_files_the_suite_did_not_write_are_never_overwritten(scripts, tmp_path, capsys):
    benchmark, parser, _ = scripts["main-LR-HMDA.py"]
    run = finished_run(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.csv").write_text("step,accuracy\n1,0.5\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text(json.dumps({"benchmark": "MLP-M4", "args": {"epochs": 3}}))
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "metrics.csv").write_text("\n".join((run / "metrics.csv").read_text().splitlines()[:4]) + "\n")
    before = snapshot(tmp_path)
    expected = {
        ("--sorter", "D-RR", "--out", run): "already holds a finished run (50 epochs",
        ("--sorter", "D-RR", "--out", run, "--resume", "--epochs", "60"): "no checkpoint.pt to continue to --epochs 60",
        ("--sorter", "D-RR", "--out", run, "--resume", "--lr", "0.01"): "its settings differ: lr",
        ("--out", mine): "metrics.csv that this suite did not write",
        ("--out", mine, "--resume"): "metrics.csv that this suite did not write",
        ("--out", theirs): "holds a run of MLP-M4, not LR-HMDA",
        ("--sorter", "D-RR", "--out", partial, "--resume"): "3 finished epochs in metrics.csv but no checkpoint.pt",
        ("--sorter", "D-RR", "--out", partial): "3 finished epochs in metrics.csv but no checkpoint.pt",
    }
    for argv, message in expected.items():
        assert message in refused(capsys, benchmark, parser, [str(word) for word in argv]), argv
    assert snapshot(tmp_path) == before
    (tmp_path / "new").mkdir()
    door(benchmark, parser, ["--out", str(tmp_path / "new")])  # an empty folder: a new run
    door(benchmark, parser, ["--out", str(mine), "--overwrite"])  # asked for: the suite's names removed
    assert not (mine / "metrics.csv").exists()


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = RunLock(out).acquire()
    with pytest.raises(UserFacingError, match=rf"in use by another run \(host .*, pid {os.getpid()}, since "):
        RunLock(out).acquire()  # another open file description: flock refuses it as it would another process
    first.release()
    assert not out.exists()  # made for the lock, removed with it
    dead = subprocess.Popen(["true"])
    dead.wait()
    out.mkdir(exist_ok=True)
    (out / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "then"}))
    RunLock(out).acquire().release()  # taken over
    alive = subprocess.Popen(["sleep", "30"])
    try:
        (out / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": alive.pid, "started": "now"}))
        with pytest.raises(UserFacingError, match=f"pid {alive.pid}"):
            RunLock(out).acquire()  # a live process on this host whose file system ignores flock
    finally:
        alive.kill()
        alive.wait()
    (out / ".lock").write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "started": "now"}))
    with pytest.raises(UserFacingError, match="host node-elsewhere, pid 1.*delete .*\\.lock"):
        RunLock(out).acquire()  # another node's: unknowable from here


def test_run_files_are_written_with_the_umask_s_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        for umask in (0o022, 0o077, 0o002):
            os.umask(umask)
            runlog.atomic_write_bytes(tmp_path / f"{umask:o}.csv", b"x")
            assert (tmp_path / f"{umask:o}.csv").stat().st_mode & 0o777 == 0o666 & ~umask
    finally:
        os.umask(previous)


def test_sigterm_names_torchrun_only_under_torchrun(monkeypatch):
    from engine.entry import terminated_line

    args = type("Args", (), {"out": "results/run"})()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert "torchrun" not in terminated_line(args, None)
    assert "results/run/checkpoint.pt" in terminated_line(args, None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert "stops every process when one fails" in terminated_line(args, None)


def checkpoint(tmp_path, **changes) -> tuple:
    from engine.optim import LRSchedule, Optimizer
    from sorters import build_sorter

    flat = torch.arange(3.0)
    optimizer, sorter = Optimizer("sgd", flat, LRSchedule(0.1, 2), momentum=0.9), build_sorter("D-RR", 2, 4, 3)
    state = {"epoch": 1, "args": {"lr": 0.1, "hmda_file": None}, "flat": flat, "optimizer": optimizer.state_dict(),
             "sorter": sorter.state_dict(), "rows": [], "rng": runlog_rng(), **changes}
    path = tmp_path / f"checkpoint-{len(list(tmp_path.iterdir()))}.pt"
    torch.save(state, path)
    return path, flat, optimizer, sorter


def runlog_rng():
    import random

    import numpy as np
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def test_a_checkpoint_of_another_benchmark_or_with_non_finite_parameters_is_named_as_such(tmp_path):
    from engine.checkpoint import restore

    cpu = torch.device("cpu")
    args = {"lr": 0.1, "hmda_file": None}
    for changes, message in (({"benchmark": "MLP-M4"}, "is a checkpoint of MLP-M4, not LR-HMDA"),
                             ({"args": {"lr": 0.1, "freq": "Weekly"}}, "is a checkpoint of MLP-M4, not LR-HMDA"),
                             ({"flat": torch.tensor([0.0, float("nan"), 1.0])}, "parameters in its checkpoint.pt are "
                                                                                "not finite")):
        path, flat, optimizer, sorter = checkpoint(tmp_path, **changes)
        with pytest.raises(UserFacingError, match=message):
            restore(path, args, flat, optimizer, sorter, cpu, benchmark="LR-HMDA")
    path, flat, optimizer, sorter = checkpoint(tmp_path)
    assert restore(path, args, flat, optimizer, sorter, cpu, benchmark="LR-HMDA")[2] == 2


def test_a_failed_write_is_one_line_and_keeps_the_last_version(tmp_path, monkeypatch):
    from engine.checkpoint import writing

    path = tmp_path / "checkpoint.pt"
    runlog.atomic_torch_save({"epoch": 1}, path)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserFacingError) as caught, writing(tmp_path, "epoch 2's files"):
        runlog.atomic_torch_save({"epoch": 2}, path)
    assert "\n" not in str(caught.value) and "No space left on device; free some disk space" in str(caught.value)
    assert torch.load(path)["epoch"] == 1 and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_analysis_refuses_a_missing_results_folder_and_an_out_it_cannot_or_may_not_write(tmp_path, capsys):
    from analysis.__main__ import main

    run = finished_run(tmp_path)
    (tmp_path / "a-file").write_text("")
    before = snapshot(tmp_path)
    for argv, message in (([str(tmp_path / "none")], "is not a folder"),
                          ([str(tmp_path), "--out", str(tmp_path / "a-file")], "is a file, not a folder"),
                          ([str(tmp_path), "--out", str(tmp_path / "a-file" / "x")], "which is a file"),
                          ([str(tmp_path), "--out", ""], "--out is empty"),
                          ([str(tmp_path), "--out", str(run / "figures")], "inside the run folder"),
                          ([str(tmp_path), "--band", "nan"], "invalid choice"),
                          ([str(tmp_path), "--expect-sorters"], "expected at least one argument")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and message in err, (argv, err)
    assert snapshot(tmp_path) == before


# end to end: the wiring in run_entry_point and the analysis' __main__

@needs_data("hmda/raw/hmda_train_preprocessed.zip")
def test_end_to_end_a_shipped_run_is_never_changed_and_a_held_folder_is_refused(tmp_path):
    run = finished_run(tmp_path)
    before = snapshot(tmp_path)
    issue = ["--sorter", "D-RR", "--epochs", "1", "--max-train-examples", "2000", "--out", run]
    for argv, status, message in ((issue, 2, "already holds a finished run"),
                                  ([*issue, "--resume"], 2, "its settings differ: max_train_examples"),
                                  (["--sorter", "D-RR", "--out", run, "--resume"], 0, "is finished: 50 epochs done"),
                                  (["--lr", "1e308", "--out", tmp_path / "new"], 2, "--lr: must be a finite number")):
        result = run_script("main-LR-HMDA.py", *argv)
        assert result.returncode == status and message in result.stderr, (argv, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert snapshot(tmp_path) == before
    lock = RunLock(tmp_path / "held").acquire()
    try:
        result = run_script("main-LR-HMDA.py", "--out", tmp_path / "held")
    finally:
        lock.release()
    assert result.returncode == 2 and f"in use by another run (host {socket.gethostname()}, pid {os.getpid()}" \
        in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert snapshot(tmp_path) == before


def test_end_to_end_analysis_of_a_missing_folder_is_one_line(tmp_path):
    result = run_python([sys.executable, "-m", "analysis", tmp_path / "nonexistent", "--out", tmp_path / "figures"])
    assert result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@needs_data("hmda/raw/hmda_train_preprocessed.zip")
def test_a_full_disk_is_one_line_and_resuming_a_finished_run_changes_nothing(tmp_path, monkeypatch, capsys):
    """In this process, through run_entry_point: the disk fills while epoch 2's checkpoint is written (the
    fourth fsync: config.json, epoch 1's checkpoint.pt and metrics.csv before it): one line, exit 2, epoch
    1 kept; --resume then finishes the run, and --resume of the finished run rewrites nothing."""
    from engine.entry import run_entry_point

    benchmark, parser, build = entry_point("main-LR-HMDA.py")
    out = tmp_path / "run"
    argv = ["main-LR-HMDA.py", "--data-dir", str(DATA_DIR), "--out", str(out), "--epochs", "2", "--node_cnt", "2",
            "--B", "6", "--max-train-examples", "77", "--max-eval-examples", "64", "--progress", "off"]
    real_fsync, calls = os.fsync, []

    def fills_up(fd):
        calls.append(fd)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    def run(*extra):
        monkeypatch.setattr(sys, "argv", [*argv, *extra])
        previous = signal.getsignal(signal.SIGTERM)
        try:
            run_entry_point(benchmark, parser, build)
        except SystemExit as stop:
            return stop.code
        finally:
            signal.signal(signal.SIGTERM, previous)
        return 0

    monkeypatch.setattr(os, "fsync", fills_up)
    assert run() == 2
    (line,) = capsys.readouterr().err.splitlines()[-1:]
    assert line.startswith("error: cannot write epoch 2's files in") and "free some disk space" in line, line
    assert torch.load(out / "checkpoint.pt", weights_only=False)["epoch"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.json", "metrics.csv"]
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert run("--resume") == 0
    before = snapshot(out)
    assert run("--resume") == 0 and "is finished: 2 epochs done" in capsys.readouterr().err
    assert snapshot(out) == before
    # train() itself, called directly (bench/, notebooks), refuses the finished run once its checkpoint is gone
    from engine.comm import LocalCommunicator
    from engine.train import train

    (out / "checkpoint.pt").unlink()
    before = snapshot(out)
    args = parser.parse_args(argv[1:])
    check_args(args, benchmark)
    with pytest.raises(UserFacingError, match="already holds a finished run"):
        train(build(args, torch.device("cpu")), args, LocalCommunicator(2, torch.device("cpu")), torch.device("cpu"))
    assert snapshot(out) == before


def test_under_torchrun_only_rank_0_takes_the_lock(scripts, tmp_path, monkeypatch):
    benchmark, parser, _ = scripts["main-LR-HMDA.py"]
    args = parser.parse_args(["--out", str(tmp_path / "run")])
    monkeypatch.setenv("RANK", "1")
    assert claim_run_folder(args, benchmark) is None and not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "0")
    lock = claim_run_folder(args, benchmark)
    assert (tmp_path / "run" / ".lock").exists()
    lock.release()
