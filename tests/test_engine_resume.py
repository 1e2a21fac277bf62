"""The engine (an entry script, engine/train.py) across fresh processes and process counts, against the
uninterrupted run in one process: LR-HMDA with 2 simulated workers taking 3 examples each per step (so
CD-GraB's pairs span steps), out of 77 examples (5 left over, as drop_last leaves them).

Resume. The engine checkpoints at epoch ends only (checkpoint.pt after each epoch; a crash or
$CDGRAB_STOP_FILE resumes from the last one), so epoch ends are its resumable boundaries; mid-epoch and
mid-pair boundaries are the sampler's (tests/test_sampler_resume.py). Local-SGD rounds run across epoch
ends, so with --sync an epoch end falls inside a round (checked below). The resumed run stops after every
epoch: epochs 1-2 in one process (a fresh one for epoch 2: the same bits as the oracle), epoch 3 with 2
gloo processes (torchrun, resuming the one-process checkpoint), epoch 4 in one process again (resuming
the two-process one). The configs cover exchanges and sorter state whose engine resume no other test
covers (tests/test_lr_hmda.py: CD-GraB; test_reorderers.py: KH-SGD; test_communication.py: CD-GraB with
local steps and ExDyna, one process); every sorter's own state is resumed at every step boundary in
tests/test_sampler_resume.py.

Two processes. The sorters and exchanges no other one-process-versus-torchrun test runs (the others:
CD-GraB and D-RR in test_lr_hmda.py and test_mlp_m4.py, KH-SGD and SBW in test_reorderers.py, QSR and
ExDyna in test_communication.py, sketched CD-GraB in test_sketch.py, and the resumed runs here).

Another process count may round differently (each process forms its workers' gradients in one batched
pass), so there the losses agree to rel 1e-5, everything else exactly: orders, bytes sent, averagings and
round lengths, achieved density."""
import json

import pytest

from tests.helpers import assert_runs_agree, check_ok, needs_data, read_metrics, run_script

pytestmark = [needs_data("hmda/raw/hmda_train_preprocessed.zip"), pytest.mark.slow]
SCRIPT = "main-LR-HMDA.py"
EPOCHS, STEPS = 4, 12  # 36 examples per worker, 3 per step
COMMON = ["--node_cnt", "2", "--B", "6", "--max-train-examples", "77", "--max-eval-examples", "64",
          "--epochs", str(EPOCHS), "--record-orders"]
RESULTS = ("train_loss", "test_loss", "train_acc", "test_acc")
EXCHANGED = ("comm_bytes", "syncs", "mean_H", "density")
RESUMED = {
    # rounds of 5: epoch ends 24 and 36 inside a round; every worker's parameters and momentum, top-k's
    # residuals, I-B's stale means, the sketch map drawn anew in each process (I-B's signs follow the
    # sketches; SBW's mostly follow its random draws), balancing in a background thread
    "I-B-local-topk-sketch": ["--sorter", "I-B", "--sync", "constant", "--H", "5", "--reducer", "topk", "--density",
                              "0.3", "--sketch-dim", "8", "--overlap", "on"],
    # QSR's round lengths from the cosine schedule, ExDyna's threshold and partitions, SBW's b_max
    "SBW-qsr-exdyna": ["--sorter", "SBW", "--sync", "qsr", "--alpha", "0.012", "--H-base", "2", "--lr-schedule",
                       "cosine", "--reducer", "exdyna", "--density", "0.5"],
    # exact CD-GraB from layer records (sorters.ExactCDGraB: float32 running sum, near-ties), pairs across
    # steps (3 units a step), the records all-gathered in the two-process leg
    "CD-GraB-exact-low-memory": ["--sorter", "CD-GraB", "--exact-low-memory", "on"],
}
LEGS = ((1, None), (2, None), (3, 2), (EPOCHS, None))  # (stop after epoch, torchrun processes)
TWO_PROCESSES = {
    "D-SO-post-local": ["--sorter", "D-SO", "--sync", "post-local", "--switch-epoch", "2", "--H", "5"],
    # sketches of the unit gradients gathered once per round
    "I-PB-linear-sketch": ["--sorter", "I-PB", "--sync", "linear", "--alpha", "0.02", "--H-base", "2",
                           "--sketch-dim", "8"],
    "Fold-topk": ["--sorter", "Fold", "--reducer", "topk", "--density", "0.3"],  # sparsified, data-parallel
}


def assert_same_run(expected_dir, got_dir, exact_epochs: int) -> None:
    """The same orders, exchanges and (to rel 1e-5; bit for bit in the first exact_epochs) results."""
    assert_runs_agree(expected_dir, got_dir, RESULTS, rel=1e-5)
    for epoch, (a, b) in enumerate(zip(read_metrics(expected_dir), read_metrics(got_dir)), 1):
        columns = EXCHANGED + (RESULTS if epoch <= exact_epochs else ())
        assert [a[c] for c in columns] == [b[c] for c in columns], (epoch, columns, a, b)


def stopped_and_resumed(out, flags, tmp_path) -> None:
    """The run in LEGS: each leg a fresh start (--resume after the first) that stops after its epoch."""
    stop = tmp_path / "stop"
    for i, (epoch, nproc) in enumerate(LEGS):
        stop.write_text(f"{epoch}\n")
        check_ok(run_script(SCRIPT, *COMMON, *flags, "--out", out, *(["--resume"] if i else []), nproc=nproc,
                            env={"CDGRAB_STOP_FILE": str(stop)}))
        assert len(read_metrics(out)) == epoch
    # config.json keeps one record per leg, appended on each resume (engine.runlog.with_segment)
    segments = json.loads((out / "config.json").read_text())["segments"]
    assert [(s["first_epoch"], s["last_epoch"], s["device"]) for s in segments] == \
           [(1, 1, "cpu"), (2, 2, "cpu"), (3, 3, "cpu"), (4, 4, "cpu")], segments


@pytest.mark.parametrize("name", RESUMED)
def test_stopped_after_every_epoch_and_resumed_with_another_process_count_equals_the_uninterrupted_run(
        tmp_path, name):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check_ok(run_script(SCRIPT, *COMMON, *RESUMED[name], "--out", straight))
    stopped_and_resumed(resumed, RESUMED[name], tmp_path)
    assert_same_run(straight, resumed, exact_epochs=2)  # one process throughout epochs 1-2
    if "--sync" in RESUMED[name]:  # the averagings closed fewer steps than the epochs ended: mid-round
        rows = read_metrics(straight)
        closed = [sum(row["syncs"] * row["mean_H"] for row in rows[:epoch]) for epoch in (2, 3)]
        assert closed[0] < 2 * STEPS and closed[1] < 3 * STEPS, closed


@pytest.mark.parametrize("name", TWO_PROCESSES)
def test_two_gloo_processes_equal_one_process(tmp_path, name):
    flags = [*TWO_PROCESSES[name], "--epochs", "2"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    check_ok(run_script(SCRIPT, *COMMON, *flags, "--out", single))
    check_ok(run_script(SCRIPT, *COMMON, *flags, "--out", multi, nproc=2))
    assert_same_run(single, multi, exact_epochs=0)
