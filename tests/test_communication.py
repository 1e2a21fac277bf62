"""--sync (local SGD, QSR) and --reducer (top-k, ExDyna) end to end on the real data: one process equals
torchrun, resume equals an uninterrupted run, the communication columns add up, bad input fails in one line."""
import json

import pytest

from tests.helpers import assert_runs_agree, check_ok, error_lines, needs_data, read_metrics, run_script

pytestmark = pytest.mark.slow
HMDA, M4 = "hmda/raw/hmda_train_preprocessed.zip", "m4/Weekly-train.csv"
BENCHMARKS = {
    "LR-HMDA": ("main-LR-HMDA.py", ["--max-train-examples", "1600", "--max-eval-examples", "2000"],
                ("train_loss", "test_loss", "train_acc", "test_acc"), HMDA),
    "MLP-M4": ("main-MLP-M4.py", ["--max-train-examples", "1600", "--max-eval-examples", "200", "--node_cnt", "4",
                                  "--B", "16"], ("train_loss", "test_loss", "valid_loss", "test_smape"), M4),
}
QSR = ["--sync", "qsr", "--alpha", "0.012", "--H-base", "2", "--lr-schedule", "cosine", "--warmup-epochs", "0.2"]
EXDYNA = ["--reducer", "exdyna", "--density", "0.5"]


def run(benchmark, out, *extra, nproc=None, env=None):
    script, quick, _, _ = BENCHMARKS[benchmark]
    return run_script(script, "--epochs", "2", "--record-orders", "--out", out, *quick, *extra, nproc=nproc, env=env)


@pytest.mark.parametrize("bench_name", [pytest.param(b, marks=needs_data(BENCHMARKS[b][3])) for b in BENCHMARKS])
@pytest.mark.parametrize("strategy", ["qsr", "exdyna"])
@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR"])
def test_one_process_equals_torchrun(tmp_path, bench_name, strategy, sorter):
    flags = {"qsr": QSR, "exdyna": EXDYNA}[strategy]
    single, multi = tmp_path / "single", tmp_path / "multi"
    check_ok(run(bench_name, single, "--sorter", sorter, *flags))
    check_ok(run(bench_name, multi, "--sorter", sorter, *flags, nproc=2))
    # with local steps each worker's gradients come from one batched pass over the process's workers
    # (engine/linear_stack.py): 4 in one process, 2 per process under torchrun, so the batched kernels round differently (orders, bytes and
    # rounds must still agree exactly); 1e-5 held by chance before the warm-up's step 0 took lr 0 (s / w)
    assert_runs_agree(single, multi, BENCHMARKS[bench_name][2], rel=5e-5 if strategy == "qsr" else 1e-5)
    for a, b in zip(read_metrics(single), read_metrics(multi)):
        assert (a["syncs"], a["mean_H"], a["density"]) == (b["syncs"], b["mean_H"], b["density"])


@needs_data(HMDA)
def test_qsr_rounds_grow_and_cover_every_step(tmp_path):
    out = tmp_path / "qsr"
    check_ok(run("LR-HMDA", out, "--sorter", "D-RR", *QSR))
    rows = read_metrics(out)
    steps = json.loads((out / "config.json").read_text())["sizes"]["steps_per_epoch"]
    # rounds run across epoch ends: only over the whole run do the rounds that closed tile the steps
    assert sum(row["syncs"] * row["mean_H"] for row in rows) == pytest.approx(len(rows) * steps)
    for row in rows:
        assert row["comm_bytes"] == row["syncs"] * 4 * 26 * 4  # one d-vector per worker per averaging
    assert rows[1]["mean_H"] > rows[0]["mean_H"] > 1  # H grows as the cosine learning rate decays


CROSSING = ["--sync", "constant", "--H", "30"]  # 100 steps per epoch: the round of steps 91-120 spans the epochs


@needs_data(HMDA)
def test_rounds_cross_epoch_ends_and_resume_mid_round(tmp_path):
    """A round is cut only by the run's end: with H 30 and 100 steps per epoch the averagings fall on
    steps 30, 60, 90 | 120, 150, 180 and 200 (the last round capped at 20). Resuming from the checkpoint
    of epoch 1, written 10 steps into a round, continues it exactly (every worker's parameters and
    momentum, the round's position, CD-GraB's gathered gradients)."""
    flags = ["--sorter", "CD-GraB", *CROSSING]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    check_ok(run("LR-HMDA", straight, *flags))
    first, second = read_metrics(straight)
    assert (first["syncs"], first["mean_H"]) == (3, 30.0)
    assert (second["syncs"], second["mean_H"]) == (4, (30 + 30 + 30 + 20) / 4)
    assert (first["comm_bytes"] - 4 * 400 * 26 * 4, second["comm_bytes"] - 4 * 400 * 26 * 4) == \
           (3 * 4 * 26 * 4, 4 * 4 * 26 * 4)  # CD-GraB's gathers (every unit's gradient once) + the averagings
    assert run("LR-HMDA", crashed, *flags, env={"CDGRAB_FAULT": "exit:0:150"}).returncode != 0  # dies in epoch 2
    check_ok(run("LR-HMDA", crashed, *flags, "--resume"))
    assert_runs_agree(straight, crashed, BENCHMARKS["LR-HMDA"][2], exact=True)
    multi = tmp_path / "torchrun"  # the epoch-end mean of a round in progress is a real collective here
    check_ok(run("LR-HMDA", multi, *flags, nproc=2))
    assert_runs_agree(straight, multi, BENCHMARKS["LR-HMDA"][2], rel=5e-5)


@needs_data(HMDA)
def test_resume_reproduces_the_h_sequence_and_reducer_state(tmp_path):
    flags = ["--sorter", "CD-GraB", *QSR, "--reducer", "exdyna", "--density", "0.5"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    check_ok(run("LR-HMDA", straight, *flags))
    assert run("LR-HMDA", crashed, *flags, env={"CDGRAB_FAULT": "exit:0:150"}).returncode != 0  # dies in epoch 2
    check_ok(run("LR-HMDA", crashed, *flags, "--resume"))
    assert_runs_agree(straight, crashed, BENCHMARKS["LR-HMDA"][2], exact=True)
    for a, b in zip(read_metrics(straight), read_metrics(crashed)):
        assert [a[c] for c in ("syncs", "mean_H", "density", "threshold")] == \
               [b[c] for c in ("syncs", "mean_H", "density", "threshold")]
    changed = run("LR-HMDA", crashed, *flags, "--H-base", "3", "--resume")
    assert changed.returncode == 2 and "--H-base 2 (now 3)" in error_lines(changed)[0]  # spelled as typed
    longer = run("LR-HMDA", crashed, *flags, "--resume", "--epochs", "3")
    assert longer.returncode == 2 and "--epochs" in error_lines(longer)[0]  # the cosine would be stretched


@needs_data(HMDA)
@pytest.mark.parametrize("args, message", [
    (["--sync", "constant", "--H", "0"], "--H: must be >= 1"),
    (["--sync", "qsr", "--alpha", "-1"], "--alpha: must be a finite number in [0, "),
    (["--sync", "qsr"], "--alpha >= 0"),
    (["--sync", "post-local", "--H", "2"], "--switch-epoch"),
    (["--reducer", "exdyna", "--density", "0"], "(0, 1]"),
    (["--reducer", "topk", "--density", "1.5"], "(0, 1]"),
    (["--reducer", "topk"], "--density"),
    (["--reducer", "exdyna", "--density", "0.05"], "fewer than one per worker"),
    (["--sync", "post-local", "--switch-epoch", "2", "--reducer", "exdyna", "--density", "0.5"], "not supported"),
    (["--lr-schedule", "cosine", "--warmup-epochs", "5"], "--warmup-epochs"),
    (["--density", "0.5"], "--density only applies"),
])
def test_bad_communication_settings_get_one_line(tmp_path, args, message):
    result = run("LR-HMDA", tmp_path / "bad", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = error_lines(result)
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "bad" / "metrics.csv").exists()


@pytest.mark.parametrize("bench_name, script, quick", [
    pytest.param("LR-HMDA", "main-LR-HMDA.py", BENCHMARKS["LR-HMDA"][1], marks=needs_data(HMDA)),
    pytest.param("LSTM-Wiki2", "main-LSTM-Wiki2.py", ["--max-train-examples", "8", "--max-eval-examples", "2",
                                                      "--bptt", "10", "--carry-hidden", "--lr", "1.0"],
                 marks=needs_data("wikitext-2/train.txt")),
])
def test_averaging_every_step_equals_gradient_averaging(tmp_path, bench_name, script, quick):
    """With plain SGD an average of the workers' parameters after each local step is the step with the
    averaged gradient: the per-worker gradient paths (one batched pass over the workers for LR, a loop with the carried
    hidden state for the LSTM) must reproduce the data-parallel run."""
    runs = {name: tmp_path / name for name in ("data-parallel", "local")}
    flags = {"data-parallel": [], "local": ["--sync", "constant", "--H", "1"]}
    for name, out in runs.items():
        check_ok(run_script(script, "--sorter", "CD-GraB", "--epochs", "2", "--momentum", "0", "--record-orders",
                            "--out", out, *quick, *flags[name]))
    columns = ("train_loss", "test_loss")
    assert_runs_agree(runs["data-parallel"], runs["local"], columns, rel=1e-4, bytes_equal=False)


@needs_data(HMDA)
def test_unit_gradients_gathered_per_round_or_per_step_give_the_same_run(tmp_path):
    """CD-GraB under local steps: one all-gather per round moves the same bytes and gives the same orders
    and losses as one per step (torchrun, so the gathers are real collectives)."""
    runs = {gather: tmp_path / gather for gather in ("round", "step")}
    for gather, out in runs.items():
        check_ok(run("LR-HMDA", out, "--sorter", "CD-GraB", *QSR, "--unit-grad-gather", gather, nproc=2))
    assert_runs_agree(runs["round"], runs["step"], BENCHMARKS["LR-HMDA"][2], exact=True)


@needs_data(HMDA)
def test_post_local_is_data_parallel_until_the_switch(tmp_path):
    out = tmp_path / "post-local"
    check_ok(run("LR-HMDA", out, "--sorter", "D-RR", "--sync", "post-local", "--switch-epoch", "2", "--H", "5"))
    first, second = read_metrics(out)
    assert (first["syncs"], first["mean_H"]) == (100, 1.0)  # 100 steps per epoch, a gradient average each
    assert (second["syncs"], second["mean_H"]) == (20, 5.0)


@needs_data(HMDA)
def test_post_local_before_its_switch_sends_what_an_every_step_epoch_sends(tmp_path):
    """With a balancing sorter the gathered unit gradients already give the mean gradient: before the
    switch post-local must not also all-reduce the workers' gradients (the bytes of the gradient twice)."""
    runs = {"every-step": [], "post-local": ["--sync", "post-local", "--switch-epoch", "2", "--H", "5"]}
    rows = {}
    for name, flags in runs.items():
        check_ok(run("LR-HMDA", tmp_path / name, "--sorter", "CD-GraB", *flags))
        rows[name] = read_metrics(tmp_path / name)
    assert rows["post-local"][0]["comm_bytes"] == rows["every-step"][0]["comm_bytes"] > 0
    assert rows["post-local"][0]["train_loss"] == pytest.approx(rows["every-step"][0]["train_loss"], rel=1e-6)
