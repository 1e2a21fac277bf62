"""LR-HMDA end to end on the real data: modes agree, resume is exact, bad input fails cleanly."""
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from sorters import SORTER_NAMES
from tests.helpers import (DATA_DIR, REPO, assert_runs_agree, check_ok, check_run_files, entry_point, entry_task,
                           error_lines, metrics_header, needs_data, read_metrics, run_python, run_script)

pytestmark = [needs_data("hmda/raw/hmda_train_preprocessed.zip"), pytest.mark.slow]
SCRIPT = "main-LR-HMDA.py"
QUICK = ["--max-train-examples", "1600", "--max-eval-examples", "2000", "--record-orders"]
RESULT_COLUMNS = ("train_loss", "test_loss", "train_acc", "test_acc")


@pytest.mark.parametrize("sorter", SORTER_NAMES)
def test_every_sorter_trains_and_writes_the_run_directory(tmp_path, sorter):
    out = tmp_path / sorter
    check_ok(run_script(SCRIPT, "--sorter", sorter, "--epochs", "2", "--out", out, *QUICK))
    assert metrics_header(out) == ["epoch", "train_loss", "test_loss", "train_acc", "test_acc", "epoch_seconds",
                                   "sorter_seconds", "comm_seconds", "compute_seconds", "comm_bytes",
          "syncs", "mean_H", "density", "threshold", "load_imbalance"]
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    assert all(0.5 < r["test_acc"] <= 1 for r in rows)
    config = json.loads((out / "config.json").read_text())
    assert config["sizes"] == {"n_workers": 4, "world_size": 1, "workers_per_process": 4, "units_per_worker": 400,
                               "units_per_step": 4, "steps_per_epoch": 100, "d": 26, "global_batch": 16}
    assert config["data"]["source"] == "hmda-2018-sample" and config["args"]["sorter"] == sorter
    assert {"torch", "numpy", "python"} <= set(config["versions"])
    check_run_files(out, epochs=2, m=400)


@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR", "CD-GraB --sign-loop gram"])
def test_one_process_and_torchrun_give_the_same_orders_and_losses(tmp_path, sorter):
    """(The Gram sign loop, the GPU's, decides its pairs several steps at a time: 2 processes.)"""
    single, flags = tmp_path / "single", ["--sorter", *sorter.split()]
    check_ok(run_script(SCRIPT, *flags, "--epochs", "2", "--out", single, *QUICK))
    for nproc in (2,) if "gram" in sorter else (2, 4):
        multi = tmp_path / f"nproc{nproc}"
        check_ok(run_script(SCRIPT, *flags, "--epochs", "2", "--out", multi, *QUICK, nproc=nproc))
        assert_runs_agree(single, multi, RESULT_COLUMNS)
        assert json.loads((multi / "config.json").read_text())["sizes"]["world_size"] == nproc


def test_the_gram_sign_loop_gives_the_compiled_loops_orders_and_losses(tmp_path):
    """--sign-loop gram (the GPU's: pairs decided several steps at a time, S in float64 products) against the
    CPU's compiled sequential loop on the real data: the same orders and losses, bit for bit."""
    runs = {loop: tmp_path / loop for loop in ("compiled", "gram")}
    for loop, out in runs.items():
        check_ok(run_script(SCRIPT, "--sorter", "CD-GraB", "--sign-loop", loop, "--epochs", "3", "--out", out, *QUICK))
    assert_runs_agree(runs["compiled"], runs["gram"], RESULT_COLUMNS, exact=True)


def test_fast_paths_agree_with_the_general_paths(tmp_path):
    """Overlapped balancing (a background thread) gives bit-identical orders and losses; the
    outer-product per-example gradients give the orders of torch.func.vmap and losses to rounding."""
    runs = {name: tmp_path / name for name in ("sequential", "overlap", "vmap")}
    flags = {"sequential": ["--overlap", "off"], "overlap": ["--overlap", "on"], "vmap": ["--unit-grads", "vmap"]}
    for name, out in runs.items():
        check_ok(run_script(SCRIPT, "--sorter", "CD-GraB", "--epochs", "2", "--out", out, *QUICK, *flags[name]))
    assert_runs_agree(runs["sequential"], runs["overlap"], RESULT_COLUMNS, exact=True)
    assert_runs_agree(runs["sequential"], runs["vmap"], RESULT_COLUMNS, rel=1e-5)
    # sorter_seconds is the sorter's time either way (with --overlap the worker thread's wall time, which
    # at d = 26 is mostly waiting for the interpreter lock: several times the sequential figure)
    for sequential, overlapped in zip(read_metrics(runs["sequential"]), read_metrics(runs["overlap"])):
        assert 0.1 < overlapped["sorter_seconds"] / sequential["sorter_seconds"] < 20, (sequential, overlapped)


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    check_ok(run_script(SCRIPT, "--epochs", "3", "--out", straight, *QUICK))
    # dies abruptly in the middle of epoch 2 (100 steps per epoch)
    result = run_script(SCRIPT, "--epochs", "3", "--out", crashed, *QUICK, env={"CDGRAB_FAULT": "exit:0:150"})
    assert result.returncode != 0
    assert [r["epoch"] for r in read_metrics(crashed)] == [1]  # complete file, finished epochs only
    refused = run_script(SCRIPT, "--epochs", "3", "--out", crashed, *QUICK)
    assert refused.returncode == 2 and "--resume" in error_lines(refused)[0]
    check_ok(run_script(SCRIPT, "--epochs", "3", "--out", crashed, "--resume", *QUICK))
    assert_runs_agree(straight, crashed, RESULT_COLUMNS, exact=True)
    # a resumed run may change the process count but not the experiment
    check_ok(run_script(SCRIPT, "--epochs", "4", "--out", crashed, "--resume", *QUICK, nproc=2))
    changed = run_script(SCRIPT, "--epochs", "5", "--out", crashed, "--resume", "--lr", "0.1", *QUICK)
    assert changed.returncode == 2 and "--lr" in error_lines(changed)[0]


def test_resume_rewrites_logs_a_kill_left_behind_the_checkpoint(tmp_path):
    """Killed after saving the last epoch's checkpoint.pt but before metrics.csv / orders.pt: --resume
    has no epoch left to run, yet must bring both in line with the checkpoint, say the run is
    finished and exit 0, leaving config.json alone."""
    out = tmp_path / "run"
    check_ok(run_script(SCRIPT, "--epochs", "2", "--out", out, *QUICK))
    files = {name: (out / name).read_bytes() for name in ("metrics.csv", "orders.pt", "config.json")}
    metrics_lines = files["metrics.csv"].decode().splitlines(keepends=True)
    for damage in ("behind", "gone"):
        if damage == "behind":  # the state after epoch 1: one row, one order
            (out / "metrics.csv").write_text("".join(metrics_lines[:2]))
            torch.save(torch.load(out / "orders.pt")[:1], out / "orders.pt")
        else:
            (out / "metrics.csv").unlink()
            (out / "orders.pt").unlink()
        result = run_script(SCRIPT, "--epochs", "2", "--out", out, "--resume", *QUICK)
        check_ok(result)
        assert f"{out} is finished: 2 epochs done" in result.stderr and "epoch 1/2" not in result.stderr
        assert {name: (out / name).read_bytes() for name in files} == files, damage
    # asking for fewer epochs than were run is finished too; asking for more trains on
    check_ok(run_script(SCRIPT, "--epochs", "1", "--out", out, "--resume", *QUICK))
    assert (out / "metrics.csv").read_bytes() == files["metrics.csv"]
    check_ok(run_script(SCRIPT, "--epochs", "3", "--out", out, "--resume", *QUICK))
    check_run_files(out, epochs=3, m=400)


def test_an_unreadable_checkpoint_gets_one_clear_line(tmp_path):
    """checkpoint.pt cut short (a full disk, an interrupted copy) or overwritten: --resume names the file and
    what to do in one line, exits 2 and leaves the run directory as it was."""
    out = tmp_path / "run"
    check_ok(run_script(SCRIPT, "--epochs", "1", "--out", out, *QUICK))
    checkpoint = (out / "checkpoint.pt").read_bytes()
    for damaged in (checkpoint[:len(checkpoint) // 2], checkpoint[:100], b"not a checkpoint\n" * 8):
        (out / "checkpoint.pt").write_bytes(damaged)
        files = {path.name: path.read_bytes() for path in out.iterdir()}
        result = run_script(SCRIPT, "--epochs", "2", "--out", out, "--resume", *QUICK)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        (line,) = [line for line in result.stderr.splitlines() if line.strip()]
        assert line.startswith("error: cannot resume: ") and "another --out" in line
        assert f"{out / 'checkpoint.pt'} is unreadable (corrupt or truncated)" in line
        assert {path.name: path.read_bytes() for path in out.iterdir()} == files
    # readable, but not what this version writes: a key missing at the top, or inside the sorter's state
    state = torch.load(io.BytesIO(checkpoint), weights_only=False)
    without_sorter = {key: value for key, value in state.items() if key != "sorter"}
    sorter_without_n = {**state, "sorter": {key: value for key, value in state["sorter"].items() if key != "n"}}
    for damaged, message in ((without_sorter, "checkpoint.pt lacks sorter (not a checkpoint of this version"),
                             (sorter_without_n, "missing n; the checkpoint was written by another version")):
        torch.save(damaged, out / "checkpoint.pt")
        files = {path.name: path.read_bytes() for path in out.iterdir()}
        result = run_script(SCRIPT, "--epochs", "2", "--out", out, "--resume", *QUICK)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        (line,) = [line for line in result.stderr.splitlines() if line.strip()]
        assert line.startswith("error: cannot resume") and message in line and "another --out" in line, line
        assert {path.name: path.read_bytes() for path in out.iterdir()} == files


TINY = ["--max-train-examples", "128", "--max-eval-examples", "32"]  # 8 steps of B = 16


def test_a_run_says_where_it_writes_and_how_far_it_is(tmp_path, monkeypatch, capsys):
    """A line with the run directory first and last (also with --progress off); with --progress auto
    and stderr no terminal, plain progress lines (here every step: $CDGRAB_PROGRESS_EVERY=0) with the
    epoch, step, loss and time left, and before an evaluation when the last one took the interval;
    none with --progress off. In this process (engine.train.train, as run_entry_point calls it)."""
    from engine.comm import LocalCommunicator
    from engine.train import train

    monkeypatch.chdir(tmp_path)  # the default --out lands here
    monkeypatch.setenv("CDGRAB_PROGRESS_EVERY", "0")
    cpu = torch.device("cpu")

    def stderr_lines(*argv):
        task, args = entry_task(SCRIPT, cpu, *TINY, *argv)
        train(task, args, LocalCommunicator(args.node_cnt, cpu), cpu)
        return capsys.readouterr().err.splitlines()

    out = "results/LR-HMDA/CD-GraB-node4-B16-lr0.005-max-train-examples128-max-eval-examples32-seed0"
    lines = stderr_lines("--epochs", "2", "--resume", "--progress", "auto")
    assert lines[0] == f"LR-HMDA: no checkpoint in {out}, starting a new run (epochs 1-2)", lines
    assert lines[-1] == f"LR-HMDA: done: {out} (after epoch 2)", lines
    steps = [line for line in lines if " step " in line]
    assert [re.search(r"epoch (\d)/2 step (\d+)/8 ", line).groups() for line in steps] == \
        [(str(epoch), str(step)) for epoch in (1, 2) for step in range(1, 9)]
    assert re.fullmatch(r"LR-HMDA CD-GraB epoch 2/2 step 8/8 \| loss 0\.\d{4} \| 0s left", steps[-1]), steps
    assert [line for line in lines if "evaluating" in line] == [
        "LR-HMDA CD-GraB epoch 2/2: evaluating (the last evaluation took 0s)"]  # none before the first
    lines = stderr_lines("--epochs", "3", "--resume", "--progress", "off")
    assert lines[0] == f"LR-HMDA: resuming {out} after epoch 2 (epochs 3-3)", lines
    assert lines[-1] == f"LR-HMDA: done: {out} (after epoch 3)" and len(lines) == 3, lines  # and epoch 3's


def test_resume_refuses_to_start_over_when_the_default_out_names_no_run_but_others_exist(tmp_path):
    """--resume with a changed setting and the default --out names a folder that does not exist: rather
    than start a new run there, one line names the folders looked at and what differs from the nearest
    run, exit 2, before the data are read; nothing is written."""
    runs = tmp_path / "results" / "LR-HMDA"
    _, parser, _ = entry_point(SCRIPT)
    for name, argv in (("CD-GraB-node4-B16-lr0.005-seed0", []),
                       ("CD-GraB-node4-B16-lr0.1-seed7", ["--lr", "0.1", "--seed", "7"])):
        (runs / name).mkdir(parents=True)
        (runs / name / "checkpoint.pt").write_bytes(b"")  # only config.json is read
        (runs / name / "config.json").write_text(json.dumps({"args": vars(parser.parse_args(argv))}))
    before = sorted(runs.iterdir())
    result = run_script(SCRIPT, "--lr", "0.01", "--resume", "--data-dir", tmp_path / "no-data", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: --resume: no run to resume in results/LR-HMDA/CD-GraB-node4-B16-lr0.01-seed0 ")
    assert ("results/LR-HMDA/: the nearest, results/LR-HMDA/CD-GraB-node4-B16-lr0.005-seed0, differs in --lr 0.005 "
            "(now 0.01);") in line and "drop --resume" in line, line
    assert sorted(runs.iterdir()) == before


@pytest.mark.parametrize("args,message", [
    (["--epochs", "0"], "--epochs: must be >= 1"),  # engine.cli.check_args, before the process group
    (["--sorter", "GraB"], "invalid choice: 'GraB'"),  # argparse
    (["--resume"], "checkpoint.pt is unreadable"),  # after the process group is up
])
def test_bad_input_under_torchrun_is_reported_once(tmp_path, args, message):
    """Every rank sees the error; rank 0 alone prints it, and exits 2. torchrun itself then exits 1 and
    prints its ChildFailedError summary, whatever the ranks' status, whose root cause shows our line
    (from $TORCHELASTIC_ERROR_FILE) in its next-to-last line (docs/run-directory.md, "Bad input")."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint\n")
    result = run_script(SCRIPT, "--epochs", "2", "--out", out, *QUICK, *args, nproc=2, timeout=120)
    (line,) = error_lines(result)
    assert message in line, result.stderr
    assert result.returncode == 1
    root_cause = result.stderr.split("Root Cause")[-1]
    assert re.search(r"rank\s*:\s*0\b", root_cause) and re.search(r"exitcode\s*:\s*2\b", root_cause), result.stderr
    *_, shown, border = result.stderr.strip().splitlines()
    assert shown == f"  traceback : {line}" and set(border) == {"="}, result.stderr


def test_a_dead_rank_stops_the_others_quickly(tmp_path):
    start = time.monotonic()
    result = run_script(SCRIPT, "--epochs", "2", "--out", tmp_path / "run", *QUICK, nproc=2,
                        env={"CDGRAB_FAULT": "exit:1:20"}, timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 60


def test_non_finite_loss_stops_and_keeps_the_finished_epochs(tmp_path):
    out = tmp_path / "run"
    result = run_script(SCRIPT, "--epochs", "3", "--out", out, *QUICK, env={"CDGRAB_FAULT": "nan:130"})
    assert result.returncode == 2
    (line,) = error_lines(result)
    assert "loss became nan at epoch 2" in line and "lower --lr" in line
    assert [r["epoch"] for r in read_metrics(out)] == [1]
    assert torch.load(out / "checkpoint.pt", weights_only=False)["epoch"] == 1
    diverged = run_script(SCRIPT, "--epochs", "1", "--out", tmp_path / "diverged", *QUICK,  # in the first epoch
                          env={"CDGRAB_FAULT": "nan:5"})  # (an --lr that overflows float32 is refused at the door)
    assert diverged.returncode == 2 and "nothing was saved" in error_lines(diverged)[0]
    assert not (tmp_path / "diverged" / "metrics.csv").exists()


def test_non_finite_gradients_stop_cd_grab_with_one_line_naming_the_step(tmp_path):
    """Parameters turned NaN mid-epoch 2 (a divergence): CD-GraB's sorter refuses the NaN gradients at that
    step (on the CPU, before the loss is next read): one line, exit 2, epoch 1 kept."""
    out = tmp_path / "run"
    result = run_script(SCRIPT, "--sorter", "CD-GraB", "--epochs", "3", "--out", out, *QUICK,
                        env={"CDGRAB_FAULT": "nan-params:103"})
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = error_lines(result)
    assert "gradients became non-finite" in line and "epoch 2" in line and "lower --lr" in line, line
    assert "epochs 1-1 are saved" in line
    assert [r["epoch"] for r in read_metrics(out)] == [1]


def test_sigterm_stops_a_run_with_one_line(tmp_path):
    """SIGTERM (how torchrun stops every process when one fails) mid-run: one line that says so and where
    the last finished epoch is, exit status 143, no traceback; the finished epochs stay."""
    out = tmp_path / "run"
    env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, SCRIPT, "--epochs", "50", "--out", str(out), *QUICK, "--progress", "off"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143 and "Traceback" not in stderr, stderr
    assert not [line for line in stderr.splitlines() if line.startswith("error: ")], stderr  # not bad input
    (line,) = [line for line in stderr.splitlines() if "SIGTERM" in line]
    assert line.startswith("stopped by SIGTERM") and f"{out}/checkpoint.pt (continue with --resume)" in line
    assert len(read_metrics(out)) >= 1


@pytest.mark.parametrize("args,message", [
    (["--B", "15"], r"--B 15 is not divisible by --node_cnt 4"),
    (["--sorter", "GraB"], r"invalid choice: 'GraB'"),
    (["--data-dir", "/nonexistent"], r"no HMDA data in .*expected .*download_data\.sh"),
    (["--max-train-examples", "20"], r"20 training examples are too few for --node_cnt 4 and --B 16: need at least 32"),
    (["--epochs", "0"], r"--epochs: must be >= 1"),
])
def test_bad_input_gets_one_clear_line(tmp_path, args, message):
    result = run_script(SCRIPT, "--out", tmp_path / "run", *args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), result.stderr
    assert "Traceback" not in result.stderr


def test_node_count_must_be_a_multiple_of_the_process_count(tmp_path):
    result = run_script(SCRIPT, "--node_cnt", "3", "--B", "6", "--out", tmp_path / "run", *QUICK, nproc=2)
    assert result.returncode != 0
    assert "--node_cnt 3 is not a multiple of the 2 torchrun processes" in result.stderr


def test_help_explains_every_flag():
    result = run_python([sys.executable, SCRIPT, "--help"], check=True)
    flags = re.findall(r"^  (--[\w-]+)", result.stdout, flags=re.M)
    assert {"--sorter", "--seed", "--lr", "--momentum", "--weight_decay", "--B", "--node_cnt", "--epochs",
            "--data-dir", "--out", "--device", "--backend", "--max-train-examples", "--resume",
            "--hmda-file"} <= set(flags)
    for block in re.split(r"\n(?=  -)", result.stdout.split("options:")[1])[1:]:
        assert len(block.split(None, 2)) >= 2 and re.search(r"[a-z]{3,}", block.split("\n", 1)[-1]), block


def test_closed_form_per_example_gradients_equal_autograd():
    """LR's closed-form per-example gradients (sigmoid(w.x + b) - y) * [x, 1] against an independent
    float64 autograd gradient of each example's own loss, at trained-looking (non-zero) parameters."""
    import torch.nn.functional as F

    from tests.helpers import entry_task

    task, _ = entry_task(SCRIPT, torch.device("cpu"), "--max-train-examples", "64", "--max-eval-examples", "8")
    flat = task.model.flat
    with torch.no_grad():
        flat.copy_(torch.randn(flat.shape, generator=torch.Generator().manual_seed(0)))
    unit_ids = torch.tensor([[3, 0, 7, 1], [2, 5, 4, 6]])
    x, y = task.units([0, 1], unit_ids)
    grads, losses = task.unit_grads(flat, (x, y), 2, 4)
    assert grads.shape == (2, 4, 26) and losses.shape == (2, 4)
    from bench.dispatch_count import OpCounter
    with OpCounter() as counter:  # the logits, the losses, the residual made in the bias's column, r x: no copy
        task.unit_grads(flat, (x, y), 2, 4)
    assert counter.kernel_ops == 5, counter.kernel_calls()
    for i in range(8):
        w = flat.detach().double().clone().requires_grad_()
        loss = F.binary_cross_entropy_with_logits(x[i].double() @ w[:-1] + w[-1], y[i].double())
        loss.backward()
        torch.testing.assert_close(grads.reshape(8, 26)[i].double(), w.grad, rtol=1e-5, atol=1e-7)
        assert float(losses.reshape(8)[i]) == pytest.approx(loss.item(), rel=1e-5)


def test_closed_form_batch_gradient_equals_autograd_to_the_bit():
    """D-RR's batch gradient in closed form (LogisticHMDA.batch_grad, no autograd graph) over a few SGD steps:
    each step's gradient against an independent float64 autograd gradient of the mean loss, and the gradient
    and loss bit for bit those of the general autograd path (Task.batch_grad: the path before the closed form),
    so D-RR's losses and orders are unchanged by it."""
    import torch.nn.functional as F

    from engine.task import Task
    from tests.helpers import entry_task

    task, _ = entry_task(SCRIPT, torch.device("cpu"), "--max-train-examples", "256", "--max-eval-examples", "8")
    flat, generator = task.model.flat, torch.Generator().manual_seed(0)
    with torch.no_grad():
        flat.copy_(torch.randn(flat.shape, generator=generator))
    for _ in range(5):
        x, y = task.units([0, 1, 2, 3], torch.randint(0, task.n_units, (4, 4), generator=generator))
        grad, loss, aux = task.batch_grad(flat, (x, y))
        grad = grad.clone()
        general_grad, general_loss, _ = Task.batch_grad(task, flat, (x, y))
        assert aux is None and torch.equal(grad, general_grad) and torch.equal(loss, general_loss)
        w = flat.detach().double().clone().requires_grad_()
        oracle = F.binary_cross_entropy_with_logits(x.double() @ w[:-1] + w[-1], y.double())
        oracle.backward()
        torch.testing.assert_close(grad.double(), w.grad, rtol=1e-5, atol=1e-7)
        assert float(loss) == pytest.approx(oracle.item(), rel=1e-5)
        with torch.no_grad():
            flat.sub_(0.5 * grad)  # the next step's parameters depend on this step's gradient
