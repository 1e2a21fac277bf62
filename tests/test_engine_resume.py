"""The engine (an entry script, engine/train.py) stopped after each epoch and resumed in a fresh process,
the process count changing on the way, equals the uninterrupted run.

The engine checkpoints at epoch ends only (checkpoint.pt after each epoch; a crash or $CDGRAB_STOP_FILE
resumes from the last one), so epoch ends are its resumable boundaries; mid-epoch and mid-pair
boundaries are the sampler's (tests/test_sampler_resume.py). Local-SGD rounds run across epoch ends, so
with --sync an epoch end falls inside a round (checked below).

The oracle is the uninterrupted run in one process (2 simulated workers, 4 epochs). The resumed run does
epochs 1-2 in one process (a fresh one for epoch 2: the same bits as the oracle), epoch 3 with 2 gloo
processes (torchrun, resuming the one-process checkpoint) and epoch 4 in one process again (resuming the
two-process checkpoint). Another process count may round differently (each process forms its workers'
gradients in one batched pass), so from epoch 3 on the losses agree to rel 1e-5 and everything else
exactly: orders, bytes sent, averagings and round lengths, achieved density. The configs cover exchanges
and sorter state whose engine resume no other test covers (tests/test_lr_hmda.py: CD-GraB; test_reorderers.py:
KH-SGD; test_communication.py: CD-GraB with local steps and ExDyna, one process); every sorter's own state
is resumed at every step boundary in tests/test_sampler_resume.py."""
import pytest

from tests.helpers import assert_runs_agree, check_ok, needs_data, read_metrics, run_script

pytestmark = [needs_data("hmda/raw/hmda_train_preprocessed.zip"), pytest.mark.slow]
SCRIPT = "main-LR-HMDA.py"
EPOCHS, STEPS = 4, 12  # 72 examples, 2 workers of 36, 3 per step: CD-GraB's pairs span steps
COMMON = ["--node_cnt", "2", "--B", "6", "--max-train-examples", "72", "--max-eval-examples", "64",
          "--epochs", str(EPOCHS), "--record-orders"]
RESULTS = ("train_loss", "test_loss", "train_acc", "test_acc")
EXCHANGED = ("comm_bytes", "syncs", "mean_H", "density")
CONFIGS = {
    # rounds of 5: epoch ends 24 and 36 inside a round; every worker's parameters and momentum, top-k's
    # residuals, D-RR's generator
    "D-RR-local-topk": ["--sorter", "D-RR", "--sync", "constant", "--H", "5", "--reducer", "topk", "--density", "0.3"],
    # QSR's round lengths from the cosine schedule, ExDyna's threshold and partitions, SBW's b_max
    "SBW-qsr-exdyna": ["--sorter", "SBW", "--sync", "qsr", "--alpha", "0.012", "--H-base", "2", "--lr-schedule",
                       "cosine", "--reducer", "exdyna", "--density", "0.5"],
    # I-B's stale means across epoch ends, the sketch map drawn anew in each process, balancing in a thread
    "I-B-sketch-overlap": ["--sorter", "I-B", "--sketch-dim", "8", "--overlap", "on"],
}
LEGS = ((1, None), (2, None), (3, 2), (EPOCHS, None))  # (stop after epoch, torchrun processes)


def stopped_and_resumed(out, flags, tmp_path) -> None:
    """The run in LEGS: each leg a fresh start (--resume after the first) that stops after its epoch."""
    stop = tmp_path / "stop"
    for i, (epoch, nproc) in enumerate(LEGS):
        stop.write_text(f"{epoch}\n")
        check_ok(run_script(SCRIPT, *COMMON, *flags, "--out", out, *(["--resume"] if i else []), nproc=nproc,
                            env={"CDGRAB_STOP_FILE": str(stop)}))
        assert len(read_metrics(out)) == epoch


@pytest.mark.parametrize("name", CONFIGS)
def test_stopped_after_every_epoch_and_resumed_with_another_process_count_equals_the_uninterrupted_run(
        tmp_path, name):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check_ok(run_script(SCRIPT, *COMMON, *CONFIGS[name], "--out", straight))
    stopped_and_resumed(resumed, CONFIGS[name], tmp_path)
    assert_runs_agree(straight, resumed, RESULTS, rel=1e-5)  # orders exactly (every epoch), losses, bytes
    expected, got = read_metrics(straight), read_metrics(resumed)
    for epoch, (a, b) in enumerate(zip(expected, got), 1):
        columns = EXCHANGED + (RESULTS if epoch <= 2 else ())  # one process throughout: bit for bit
        assert [a[c] for c in columns] == [b[c] for c in columns], (epoch, columns, a, b)
    if "--sync" in CONFIGS[name]:  # the averagings closed fewer steps than the epochs ended: mid-round
        closed = [sum(row["syncs"] * row["mean_H"] for row in expected[:epoch]) for epoch in (2, 3)]
        assert closed[0] < 2 * STEPS and closed[1] < 3 * STEPS, closed
