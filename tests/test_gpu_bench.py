"""bench/gpu_epochs.py on the CPU at a tiny size (its numbers need a GPU; this checks what it measures
and how it reports it): the report's layout, the textbook loop against an independent computation and
against the engine's loss, the benchmarks' real steps per epoch, the scaling to seconds per epoch, and
one-line errors for bad input."""
import importlib.util
import json
import re
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from tests.git_checkout import GIT_CHECKOUT, expected_head, git
from tests.helpers import DATA_DIR, REPO, check_ok, error_lines, needs_data, run_python

HMDA, M4 = "hmda/raw/hmda_train_preprocessed.zip", "m4/Weekly-train.csv"
STEPS = {"LR-HMDA": 6, "MLP-M4": 100}  # MLP-M4: enough steps that their time is a good part of the run's
RUNS = {"textbook", "D-RR", "CD-GraB"}
PER_RUN = ("seconds_per_epoch", "host_syncs_per_step", "peak_gpu_memory_gib", "seconds_per_step")


def run_bench(*args, timeout: float = 300):
    env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1"}
    return run_python([sys.executable, "bench/gpu_epochs.py", *args], env=env, timeout=timeout)


@pytest.fixture(scope="module")
def head_at_start():
    """HEAD's commit (or "unknown commit") as the bench run starts: in a checkout others commit to meanwhile,
    HEAD at the assertion may be newer than the code the run recorded."""
    return expected_head()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, head_at_start):
    """(report from the --json file, stdout, seconds the command took) of one tiny CPU run."""
    path = tmp_path_factory.mktemp("gpu-bench") / "report.json"
    start = time.perf_counter()
    result = run_bench("--device", "cpu", "--benchmarks", "LR-HMDA", "MLP-M4", "--steps", "6", "MLP-M4=100",
                       "--json", path)
    wall = time.perf_counter() - start
    check_ok(result)
    return json.loads(path.read_text()), result.stdout, wall


def bench_module():
    spec = importlib.util.spec_from_file_location("gpu_epochs", REPO / "bench" / "gpu_epochs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@needs_data(HMDA, M4)
def test_report_layout(smoke, head_at_start):
    report, stdout, _ = smoke
    assert json.loads(stdout) == report  # the printed object is the written one
    assert report["git_commit"] == head_at_start  # "unknown commit" in a source archive
    clean = git("status", "--porcelain", "--untracked-files=all") == "" if GIT_CHECKOUT else None
    assert report["git_clean"] is clean
    assert report["goals"] == {"D-RR/textbook": 1.1, "CD-GraB/D-RR": 1.15}
    assert report["torch"] == torch.__version__ and report["device"].startswith("cpu")
    assert "steps_per_epoch" in report["steps_note"]
    # finds the commit where the machine's .git is older; none without a .git
    assert re.fullmatch(r"[0-9a-f]{40}", report["code_tree"]) if GIT_CHECKOUT else report["code_tree"] is None
    assert list(report["benchmarks"]) == ["LR-HMDA", "MLP-M4"]
    for name, entry in report["benchmarks"].items():
        assert entry["steps_timed"] == entry["steps_warmup"] == STEPS[name]
        for key in PER_RUN:
            assert set(entry[key]) == RUNS, key
        assert set(entry["ratios"]) == set(entry["meets_goals"]) == {"D-RR/textbook", "CD-GraB/D-RR"}
        assert set(entry["split_seconds_per_epoch"]) == {"D-RR", "CD-GraB"}
        # the CPU has no GPU memory to measure nor synchronisations to count
        assert set(entry["host_syncs_per_step"].values()) == set(entry["peak_gpu_memory_gib"].values()) == {None}


@pytest.mark.slow
@needs_data(HMDA, M4)
def test_steps_per_epoch_are_the_benchmarks_real_ones(smoke):
    from data.hmda import load_hmda
    from data.m4 import load_m4

    benchmarks = smoke[0]["benchmarks"]
    # LR-HMDA: B 16 examples per step, an even number of steps
    assert benchmarks["LR-HMDA"]["steps_per_epoch"] == len(load_hmda(DATA_DIR).train_x) // 16 // 2 * 2
    # MLP-M4 with 4 workers and B 16: m windows per worker, a multiple of 4 (k = 4 per step, and even)
    windows = len(load_m4(DATA_DIR, freq="Weekly", in_len=20, out_len=6, stride=3).train_x)
    assert benchmarks["MLP-M4"]["steps_per_epoch"] == windows // 4 // 4 * 4 // 4


@pytest.mark.slow
@needs_data(HMDA, M4)
def test_seconds_per_epoch_scale_the_timed_steps(smoke):
    report, _, wall = smoke
    timed_total = 0.0
    for entry in report["benchmarks"].values():
        per_step, per_epoch = entry["seconds_per_step"], entry["seconds_per_epoch"]
        for run in RUNS:
            assert per_step[run] > 0
            assert per_epoch[run] == pytest.approx(per_step[run] * entry["steps_per_epoch"], rel=1e-5)
            timed_total += per_step[run] * entry["steps_timed"]
        assert entry["ratios"]["D-RR/textbook"] == pytest.approx(per_epoch["D-RR"] / per_epoch["textbook"], abs=1e-3)
        assert entry["ratios"]["CD-GraB/D-RR"] == pytest.approx(per_epoch["CD-GraB"] / per_epoch["D-RR"], abs=1e-3)
        for sorter, split in entry["split_seconds_per_epoch"].items():  # the regions lie inside the epoch
            assert 0.5 * per_epoch[sorter] < sum(split.values()) <= per_epoch[sorter] * (1 + 1e-3), (sorter, split)
    # the timed steps are part of what the command did: a time per step not divided by the steps exceeds it
    assert timed_total < wall


@pytest.mark.slow
@needs_data(HMDA, M4)
def test_textbook_loss_matches_an_independent_computation(smoke):
    """The first step's loss is the initial model's loss on the engine's step-0 batch (k units of every
    worker); a pass later the same batches give a lower mean loss."""
    from data.hmda import load_hmda
    from data.m4 import load_m4
    from models.mlp import AutoregressiveMLP

    n, k = 4, 4  # both benchmarks: 4 workers, B 16
    hmda = load_hmda(DATA_DIR)
    m = STEPS["LR-HMDA"] * 16 // n  # examples per worker; contiguous split: worker r owns rows r*m .. (r+1)*m - 1
    rows = [r * m + j for r in range(n) for j in range(k)]
    m4 = load_m4(DATA_DIR, freq="Weekly", in_len=20, out_len=6, stride=3)
    pool = STEPS["MLP-M4"] * 16  # random split of the first windows, seeded by --seed
    ids = torch.randperm(pool, generator=torch.Generator().manual_seed(0)).reshape(n, pool // n)[:, :k].flatten()
    with torch.no_grad():
        torch.manual_seed(0)  # --seed 0 seeds the model's initialisation
        linear = torch.nn.Linear(hmda.num_features, 1)
        lr_loss = F.binary_cross_entropy_with_logits(linear(hmda.train_x[rows]).squeeze(-1), hmda.train_y[rows])
        torch.manual_seed(0)
        mlp = AutoregressiveMLP(20, 64, 3)
        mlp_loss = F.mse_loss(mlp(m4.train_x[ids], 6), m4.train_y[ids])

    benchmarks = smoke[0]["benchmarks"]
    for name, expected in (("LR-HMDA", lr_loss), ("MLP-M4", mlp_loss)):
        textbook = benchmarks[name]["textbook"]
        assert textbook["loss_first_step"] == pytest.approx(float(expected), rel=1e-5), name
        assert textbook["loss_timed_pass_mean"] < textbook["loss_warmup_pass_mean"], name
        assert textbook["optimizer"] == "SGD" and textbook["optimizer_settings"]["momentum"] == 0.9
        assert textbook["clip_grad_norm"] is None


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=needs_data(data)) for name, data in
                                  (("LR-HMDA", HMDA), ("MLP-M4", M4), ("LSTM-Wiki2", "wikitext-2"))])
def test_textbook_steps_compute_the_engines_loss(name):
    """Steps 0 and 1 of the textbook loop see the batches of the engine's steps 0 and 1 in the identity
    order (the LSTM: with the hidden state carried from step 0), at the same parameters."""
    bench = bench_module()
    _, task = bench.build_task(name, 4, str(DATA_DIR), torch.device("cpu"), [])
    n, k = task.n_workers, task.units_per_step
    task.start_epoch(1)
    engine_losses = []
    with torch.no_grad():
        for step in range(2):
            loss, aux = task.loss(task.model.flat, task.units(list(range(n)), torch.arange(step * k, (step + 1) * k)
                                                              .expand(n, k)))
            task.end_step(aux)  # the LSTM's carried hidden state
            engine_losses.append(float(loss))
        step_loss = bench.TEXTBOOK_LOSS[name](task, bench.textbook_model(task))
        assert [float(step_loss(step)) for step in range(2)] == pytest.approx(engine_losses, rel=1e-6)


@pytest.mark.slow
@needs_data(HMDA)
def test_the_profile_summarises_every_run_it_was_asked_for(tmp_path, capsys):
    """bench/gpu_profile.py as the GPU kit's dry run calls it (the CPU's activity, LR-HMDA, 2 steps), in
    this process: a header naming the code tree, then per sorter its training seconds and the operators
    with the most self time, from the profiled epoch's steps."""
    from bench import gpu_profile
    from engine import runlog

    out = tmp_path / "profile" / "gpu-profile.txt"
    gpu_profile.main(["--device", "cpu", "--benchmarks", "LR-HMDA", "--steps", "2", "--rows", "5", "--out", str(out)])
    text = out.read_text()
    header, _, sections = text.partition("\n\n")
    assert header.startswith("# bench/gpu_profile.py on cpu, torch ") and f"code tree {runlog.code_tree()}" in header
    runs = re.findall(r"^== LR-HMDA (\S+): 2 steps profiled, ([0-9.]+) s of training .*; per step: kernel launches and "
                      r"host synchronisations: none on the CPU$", sections, flags=re.M)
    assert [sorter for sorter, _ in runs] == ["D-RR", "CD-GraB"] and all(float(s) > 0 for _, s in runs)
    tables = re.split(r"^== .*$", sections, flags=re.M)[1:]
    assert all("Self CPU" in table and "aten::" in table for table in tables), sections
    assert f"{out}: 2 runs profiled" in capsys.readouterr().err


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    (line,) = error_lines(result)
    assert result.stderr.strip() == line
    return line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_gpu_is_one_line(tmp_path):
    line = one_error_line(run_bench("--device", "cuda", "--json", tmp_path / "report.json"))
    assert "no CUDA device" in line and "--device cpu" in line
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--data-dir", "{tmp}/nowhere"], "is not a folder"),
    (["--data-dir", "{tmp}", "--benchmarks", "LR-HMDA"], "LR-HMDA: no HMDA data"),
    (["--steps", "5"], "even"),
    (["--steps", "LSTM=4"], "unknown benchmark"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    args = [arg.format(tmp=tmp_path) for arg in args]
    assert message in one_error_line(run_bench("--device", "cpu", *args, "--json", tmp_path / "report.json"))


def test_every_flag_has_help():
    flags = [action for action in bench_module().make_parser()._actions if action.dest != "help"]
    assert {action.dest for action in flags} == {"data_dir", "benchmarks", "steps", "device", "json", "one",
                                                  "compile"}
    assert all(action.help for action in flags)
