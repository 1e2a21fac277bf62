"""scripts/gpu_session.py, the GPU session kit, and its steps (scripts/gpu_kit/), on the CPU: its run names
are the sweeps', its plan and stop rule, its checks' command lines, packing and unpacking (nothing lost),
the grace period, SIGTERM, and a dry run of a whole session: three calls on two "machines" (stop at an
epoch end, pack, unpack, go on on the same machine, then on a new one from the packed checkpoint), whose
resumed LSTM CD-GraB run must equal an uninterrupted run of the entry script (the oracle) to the last bit.

The dry run calls the kit in this process with the checks' programs stood in for (pytest by a one-line
program, the bench and the profile by their report files): tests/test_gpu_bench.py runs bench/gpu_epochs.py
and bench/gpu_profile.py, and here the command lines the kit gives them are parsed by their own parsers
and the kit's pytest command collects the tests it names. The runs themselves are real processes."""
import contextlib
import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from types import SimpleNamespace
from unittest import mock

import pytest

from scripts import gpu_session
from scripts.gpu_kit import base, checks, data, grid, pack, plan, run, unpack
from tests.git_checkout import GIT_CHECKOUT, UNKNOWN_COMMIT
from tests.helpers import DATA_DIR, REPO, error_lines, needs_data, read_metrics, run_script

KIT = REPO / "scripts" / "gpu_session.py"
LSTM_KEY = f"LSTM-Wiki2/{grid.run_name('LSTM-Wiki2', 'CD-GraB', 0)}"


def call_kit(*argv):
    """gpu_session.main() with these arguments, in this process: (returncode, stderr) as from a subprocess.
    The signal handlers the kit installs (SIGTERM, SIGINT) are this process's own again afterwards."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    stderr, code = io.StringIO(), 0
    try:
        with mock.patch.object(sys, "argv", [str(KIT), *map(str, argv)]), contextlib.redirect_stderr(stderr):
            gpu_session.main()
    except SystemExit as exit:
        code = exit.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return SimpleNamespace(returncode=code, stderr=stderr.getvalue())


def session_json(out):
    with tarfile.open(out / "runs.tar.gz", "r:gz") as tar:
        return json.loads(tar.extractfile("session.json").read())


# ---------------------------------------------------------------------------------------------- what runs
@pytest.mark.parametrize("bench_name", grid.BENCHMARKS)  # not "benchmark": pytest-benchmark owns it
def test_run_names_and_settings_are_the_sweeps(bench_name):
    """The sweep script, dry, given the grid's setting and each variant's arguments as extra arguments,
    names every queued run as the kit does and passes the same settings."""
    benchmark = bench_name
    spec = grid.BENCHMARKS[benchmark]
    queued = [(sorter, seed) for b, sorter, seed in grid.QUEUE if b == benchmark]
    for extra in {tuple(grid.variant(sorter)[1]) for sorter, _ in queued}:
        group = [(s, seed) for s, seed in queued if tuple(grid.variant(s)[1]) == extra]
        sorters = sorted({grid.variant(s)[0] for s, _ in group})
        env = {**os.environ, "DRY_RUN": "1", "SORTERS": " ".join(sorters), "SEEDS": "0 1 2", "DATA": "datasets",
               "PYTHON": sys.executable}  # the sweep's own snippets need torch, whatever `python` PATH has
        out = subprocess.run(["bash", str(REPO / "scripts" / f"sweep-{benchmark}.sh"), *spec["setting"], *extra],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        commands = dict(re.findall(r"run  (\S+): (.*)", out.stdout + out.stderr))
        for sorter, seed in group:
            name = grid.run_name(benchmark, sorter, seed)
            assert name in commands, (name, list(commands))
            settings = [a.replace("{data}", "datasets") for a in spec["args"] + spec["setting"] + list(extra)]
            flags = [(flag, value) for flag, value in zip(settings, settings[1:] + [""]) if flag.startswith("--")]
            assert all(f"{flag} {value}" in commands[name] if value and not value.startswith("--")
                       else flag in commands[name].split() for flag, value in flags), commands[name]


def test_the_lstm_grid_runs_in_the_setting_the_rule_picks_and_seed_0_leads():
    """The kit's LSTM runs pass the --clip that analysis.lstm_setting picks from the shipped runs, under new
    names (the shipped unclipped runs keep theirs and are never resumed by the kit), and the first runs
    queued are seed 0's LSTM D-RR and CD-GraB (goal 7), 50 epochs."""
    from analysis.lstm_setting import decide

    clip = decide(REPO / "reproduction").clip
    spec = grid.BENCHMARKS["LSTM-Wiki2"]
    assert spec["setting"] == (["--clip", f"{clip:g}"] if clip else []) and spec["epochs"] == 50
    lstm = run.Run("LSTM-Wiki2", "CD-GraB", 0, REPO / "nowhere", SimpleNamespace(epochs=None, tiny=False))
    argv = lstm.command(SimpleNamespace(data_dir="datasets", device="cuda", tiny=False), cudnn="on")
    assert argv[argv.index("--clip") + 1] == "0.25" and argv[argv.index("--epochs") + 1] == "50"
    shipped = REPO / "reproduction" / "LSTM-Wiki2"
    assert lstm.name not in {p.name for p in shipped.iterdir()
                             if json.loads((p / "config.json").read_text())["args"].get("clip") != clip}
    assert grid.QUEUE[:2] == [("LSTM-Wiki2", "D-RR", 0), ("LSTM-Wiki2", "CD-GraB", 0)]
    full = {(b, s, seed) for b in ("LSTM-Wiki2",) for s in ("CD-GraB", "D-RR", "Fold") for seed in (0, 1, 2)} | \
           {(b, s, seed) for b in ("GPT2-Wiki103",) for s in ("CD-GraB", "D-RR") for seed in (0, 1, 2)}
    assert set(grid.QUEUE[:len(full)]) == full
    assert grid.QUEUE[len(full)] == ("GPT2-Wiki103", "CD-GraB-sketch1024", 0)  # the sketch after the grid
    sketch = run.Run(*grid.QUEUE[len(full)], REPO / "nowhere", SimpleNamespace(epochs=None, tiny=False))
    argv = sketch.command(SimpleNamespace(data_dir="datasets", device="cuda", tiny=False), cudnn="on")
    assert argv[argv.index("--sorter") + 1] == "CD-GraB" and argv[argv.index("--sketch-dim") + 1] == "1024"
    assert sketch.name == "CD-GraB-node64-B64-lr0.0005-sketch-dim1024-seed0" and "--clip" not in argv


def test_issue_60s_orderers_queue_after_the_grid_seed_0_first_with_greedy_sketched():
    """After the grid and its sketch run come the leaderboard's orderers, every one on both GPU benchmarks
    for seeds 0-2 (seed 0 of all first), but MB-GraB on GPT-2, where a worker's step is one example (it would
    be CD-GraB); Greedy keeps sketches (4096 on the LSTM, 1024 on GPT-2), as RPB balances them on GPT-2."""
    orderers = grid.QUEUE[grid.QUEUE.index(("GPT2-Wiki103", "CD-GraB-sketch1024", 0)) + 1:]
    expected = {(b, s) for b in grid.BENCHMARKS for s in ("FlipFlop", "SWR", "RPB", "Greedy")} | {("LSTM-Wiki2", "MB-GraB")}
    assert {(b, grid.variant(s)[0]) for b, s, _ in orderers} == expected
    assert [seed for *_, seed in orderers] == sorted(seed for *_, seed in orderers)  # seed 0 of every one first
    assert {seed for *_, seed in orderers} == {0, 1, 2} and len(orderers) == 3 * len(expected)
    spec = grid.BENCHMARKS["GPT2-Wiki103"]
    assert spec["args"][spec["args"].index("--node_cnt") + 1] == spec["args"][spec["args"].index("--B") + 1]
    names = {grid.run_name(b, s, seed): grid.variant(s) for b, s, seed in orderers}
    assert names["Greedy-node4-B16-lr5-carry-hidden-clip0.25-sketch-dim4096-seed0"][:2] == ("Greedy", ["--sketch-dim", "4096"])
    assert names["Greedy-node64-B64-lr0.0005-sketch-dim1024-seed2"][:2] == ("Greedy", ["--sketch-dim", "1024"])
    assert names["RPB-node64-B64-lr0.0005-sketch-dim1024-seed1"][0] == "RPB"
    assert "FlipFlop-node4-B16-lr5-carry-hidden-clip0.25-seed0" in names


def test_a_failed_lstm_check_turns_cudnn_off_for_the_lstm_runs_only(tmp_path, monkeypatch):
    """The LSTM check's exit status decides --cudnn: passed (0), nothing collected (5: no GPU) or out of
    time (None: undecided) keep cuDNN; a failure turns it off, on the LSTM runs alone."""
    args = SimpleNamespace(data_dir="datasets", device="cuda", tiny=False)
    for status, cudnn in ((0, "on"), (5, "on"), (None, "on"), (1, "off"), (4, "off")):
        monkeypatch.setattr(checks, "run_logged", lambda *a, status=status, **k: status)
        assert checks.lstm_cudnn_check(args, tmp_path, 1.0) == cudnn, status
    lstm, gpt2 = (run.Run(b, "D-RR", 0, tmp_path, SimpleNamespace(epochs=None, tiny=False))
                  for b in ("LSTM-Wiki2", "GPT2-Wiki103"))
    argv = lstm.command(args, cudnn="off")
    assert argv[argv.index("--cudnn") + 1] == "off" and "--cudnn" not in lstm.command(args, cudnn="on")
    assert "--cudnn" not in gpt2.command(args, cudnn="off")



def test_every_flag_has_help():
    flags = [action for action in gpu_session.make_parser()._actions if action.dest != "help"]
    assert len(flags) == 28 and all(action.help for action in flags)


@pytest.mark.parametrize("flags", [["--parallel", "0"], ["--deadline", "40", "--pack-seconds", "40"], []])
def test_a_call_that_cannot_work_is_refused_in_one_line(tmp_path, flags):
    """No --out, no slot for a run, or no time left once packing is kept aside: exit 2 before anything."""
    out = [] if not flags else ["--out", tmp_path / "out"]
    result = call_kit("--device", "cpu", "--work", tmp_path / "work", *out, *flags)
    assert result.returncode == 2 and result.stderr.strip() == error_lines(result)[0], result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()

# ---------------------------------------------------------------------------------------------- the plan
def test_stop_rule():
    decide = plan.stop_decision
    assert decide([0.0], now=99.0, stop_at=100.0) is None                     # no epoch yet: run on
    assert decide([0.0], now=100.0, stop_at=100.0) == "now"                   # the deadline
    assert decide([0.0, 20.0, 40.0], now=41.0, stop_at=100.0) is None         # 40 + 2 x 20 <= 100
    assert decide([0.0, 30.0, 60.0], now=61.0, stop_at=100.0) == "after this epoch"  # 60 + 30 <= 100 < 60 + 60
    assert decide([0.0, 30.0, 75.0], now=76.0, stop_at=100.0) == "now"        # 75 + 45 > 100: it cannot end


def test_only_selects_by_benchmark_sorter_and_seed_in_the_queues_order():
    select = grid.select_queue
    assert select(None) == grid.QUEUE
    assert select(["LSTM-Wiki2/CD-GraB"]) == [("LSTM-Wiki2", "CD-GraB", 0), ("LSTM-Wiki2", "CD-GraB", 1),
                                             ("LSTM-Wiki2", "CD-GraB", 2)]
    assert select(["LSTM-Wiki2/Fold/1", "GPT2-Wiki103/CD-GraB/0"]) == [("GPT2-Wiki103", "CD-GraB", 0),
                                                                      ("LSTM-Wiki2", "Fold", 1)]
    assert select(["GPT2-Wiki103"]) == [(b, s, seed) for seed in (0, 1, 2) for b, s in
                                        (("GPT2-Wiki103", "CD-GraB"), ("GPT2-Wiki103", "D-RR"))] + \
                                       [("GPT2-Wiki103", "CD-GraB-sketch1024", 0)] + \
                                       [("GPT2-Wiki103", s, seed) for seed in (0, 1, 2) for s in
                                        ("FlipFlop", "SWR", "RPB-sketch1024", "Greedy-sketch1024")]
    assert select(["GPT2-Wiki103/CD-GraB-sketch1024"]) == [("GPT2-Wiki103", "CD-GraB-sketch1024", 0)]


@pytest.mark.parametrize("entry", ["LSTM-wiki2", "LSTM-Wiki2/CD-GraB/3", "GPT2-Wiki103/Fold", "LSTM-Wiki2/CD-GraB/0/x"])
def test_an_only_entry_that_names_no_run_is_refused_before_anything_starts(tmp_path, entry):
    """A typo would spend a call of device time on an empty queue: one line, exit status 2, nothing made."""
    result = call_kit("--device", "cpu", "--out", tmp_path / "out", "--work", tmp_path / "work", "--only", entry)
    assert result.returncode == 2, result.stderr
    assert len(error_lines(result)) == 1 and entry in error_lines(result)[0], result.stderr
    assert result.stderr.strip() == error_lines(result)[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_the_plan_starts_only_runs_that_can_finish_or_whose_checkpoint_travels():
    refusal = plan.start_refusal  # START_SECONDS (30) + epochs x seconds against the time left
    assert refusal(45, True, seconds_left=100, epoch_seconds=60) is None          # one epoch fits, it travels
    assert "one epoch" in refusal(45, True, seconds_left=80, epoch_seconds=60)
    assert refusal(30, False, seconds_left=565, epoch_seconds=17.2) is None       # 30 + 516 <= 565
    assert "cannot travel" in refusal(30, False, seconds_left=540, epoch_seconds=17.2)


def test_epoch_estimates_come_from_the_shipped_sessions_then_the_bench_then_a_fallback(tmp_path):
    sessions, bench = tmp_path / "sessions", tmp_path / "gpu-epochs.json"
    for stamp, parallel, key, seconds in (("a", 1, "GPT2-Wiki103/CD-GraB-node64-B64-lr0.0005-seed0", 17.0),
                                          ("b", 2, "LSTM-Wiki2/CD-GraB-node4-B16-lr5-carry-hidden-seed0", 53.0),
                                          ("c", 2, "LSTM-Wiki2/CD-GraB-node4-B16-lr5-carry-hidden-seed1", 49.0)):
        (sessions / stamp).mkdir(parents=True)
        (sessions / stamp / "session.json").write_text(json.dumps(
            {"parallel": parallel, "runs": {key: {"median_wall_seconds_per_epoch_this_call": seconds}}}))
    bench.write_text(json.dumps({"benchmarks": {"GPT2-Wiki103": {"seconds_per_epoch": {"CD-GraB": 12.2, "D-RR": 8.2},
                                                                 "eval_seconds": 4.0},
                                                "LSTM-Wiki2": {"seconds_per_epoch": {"CD-GraB": 37.0, "D-RR": 10.5}}}}))
    alone = plan.epoch_estimates(sessions, bench, parallel=1)
    assert alone[("GPT2-Wiki103", "CD-GraB")] == (17.0, "a/session.json")
    assert alone[("GPT2-Wiki103", "D-RR")][0] == pytest.approx(8.2 + 4.0)        # the bench's, with its evaluation
    assert alone[("LSTM-Wiki2", "Fold")][0] == pytest.approx(10.5 + 8.0)          # D-RR's, 8 s of evaluation assumed
    shared = plan.epoch_estimates(sessions, bench, parallel=2)
    assert shared[("LSTM-Wiki2", "CD-GraB")] == (53.0, "b/session.json")          # the slowest of that sharing
    assert shared[("GPT2-Wiki103", "CD-GraB")][0] == pytest.approx(2 * (12.2 + 4.0))
    assert plan.epoch_estimates(tmp_path / "none", tmp_path / "none.json", 1)[("LSTM-Wiki2", "D-RR")] == \
           (plan.FALLBACK_EPOCH_SECONDS["LSTM-Wiki2"], "fallback")


# ---------------------------------------------------------------------------------------------- the checks
def test_the_checks_give_the_bench_and_the_profile_flags_they_accept(tmp_path, monkeypatch):
    """What the kit runs as its bench and profile parses with their own parsers: on the GPU every
    benchmark on CUDA, in the dry run (--tiny) LR-HMDA for 2 steps on the CPU; the reports land in --work,
    where the packer takes them from."""
    from bench import gpu_epochs, gpu_profile

    seen = []
    monkeypatch.setattr(checks, "run_logged", lambda argv, *a, **k: seen.append(argv) or 0)
    for tiny in (False, True):
        args = SimpleNamespace(data_dir="datasets", tiny=tiny)
        assert checks.run_bench(args, tmp_path, 1.0) == 0 and checks.run_profile(args, tmp_path, 1.0) == 0
    for (bench_argv, profile_argv), tiny in zip((seen[:2], seen[2:]), (False, True)):
        assert bench_argv[:2] == [sys.executable, str(REPO / "bench" / "gpu_epochs.py")]
        assert profile_argv[:2] == [sys.executable, str(REPO / "bench" / "gpu_profile.py")]
        bench = gpu_epochs.make_parser().parse_args(bench_argv[2:])
        profile = gpu_profile.make_parser().parse_args(profile_argv[2:])
        assert bench.json == str(tmp_path / "gpu-epochs.json") and profile.out == str(tmp_path / "gpu-profile.txt")
        assert bench.data_dir == profile.data_dir == "datasets"
        assert bench.device == profile.device == ("cpu" if tiny else "cuda")
        assert bench.benchmarks == (["LR-HMDA"] if tiny else list(gpu_epochs.SETTINGS))
        assert profile.benchmarks == (["LR-HMDA"] if tiny else ["LSTM-Wiki2", "GPT2-Wiki103", "MLP-M4", "LR-HMDA"])
        steps = gpu_epochs.parse_steps(bench.steps, bench.benchmarks)  # one-line error if the bench refused them
        assert (steps["LR-HMDA"], profile.steps) == ((2, 2) if tiny else (gpu_epochs.DEFAULT_STEPS["LR-HMDA"], None))


def test_the_kits_pytest_collects_its_checks_where_pytest_xdist_is_missing():
    """The GPU box has no pytest-xdist, which pytest.ini's addopts (-n auto) need: the kit's pytest command
    must collect there (-p no:xdist stands in for the missing plugin; exit 4 would be a usage error), and
    the LSTM check and the CUDA tests it names must exist (a renamed test would turn cuDNN off)."""
    collect = [*checks.PYTEST, "-p", "no:xdist", "--collect-only", *grid.LSTM_CHECK, *grid.CUDA_TESTS]
    result = subprocess.run(collect, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert grid.LSTM_CHECK[0] in result.stdout.split(), result.stdout
    assert all(any(line.startswith(f"{path}::") for line in result.stdout.split()) for path in grid.CUDA_TESTS)


def test_checks_none_checks_nothing(tmp_path):
    found, tests = checks.run_checks(SimpleNamespace(checks="none"), tmp_path, run.Stop())
    assert found == {"lstm_cudnn": "on", "skipped": True} and tests is None and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- a dry run
STAND_IN_PYTEST = [sys.executable, "-c", "print('1 skipped (pytest, stood in for)')"]


def stand_in(report: str, text: str, seen: list):
    """bench/gpu_epochs.py's or bench/gpu_profile.py's stand-in: its report file in --work, exit 0 (and
    its report's name in the list of the current call, seen[-1])."""
    def run_it(args, work, budget, stop=None):
        seen[-1].append(report)
        (work / report).write_text(text)
        return 0
    return run_it


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """Three calls of the kit on the LSTM CD-GraB run (3 tiny epochs) and an --unpack after each, as a
    session does them: call 1 on machine 1 (--checks all) stops after epoch 1; call 2 on the same machine
    goes on from its own checkpoint and stops after epoch 2; call 3 on machine 2 (--checks tests) goes on
    from the checkpoint call 2 packed and --unpack shipped, and finishes. Then the oracle: the entry script,
    3 epochs uninterrupted. Returns the calls' results, the checks each ran and the shipped run after
    each unpack (epochs in metrics.csv, its packed checkpoint's epoch)."""
    tmp = tmp_path_factory.mktemp("dry-run")
    into, shipped = tmp / "reproduction", tmp / "reproduction" / LSTM_KEY
    common = ["--device", "cpu", "--tiny", "--epochs", "3", "--data-dir", DATA_DIR, "--progress-every", "5",
              "--min-start-seconds", "0", "--pack-seconds", "5", "--deadline", "240", "--parallel", "2",
              "--poll", "0.2", "--only", "LSTM-Wiki2/CD-GraB/0"]
    calls = [("box1", ["--stop-after-epochs", 1]), ("box1", ["--stop-after-epochs", 1]),
             ("box2", ["--shipped", into, "--checks", "tests"])]
    results, seen, after_unpack = [], [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checks, "PYTEST", STAND_IN_PYTEST)
        patch.setattr(checks, "run_bench", stand_in("gpu-epochs.json", '{"benchmarks": {"LR-HMDA": {}}}', seen))
        patch.setattr(checks, "run_profile", stand_in("gpu-profile.txt", "# the profile, stood in for\n", seen))
        for number, (box, extra) in enumerate(calls, 1):
            out = tmp / f"out{number}"
            seen.append([])
            results.append(call_kit(*common, "--work", tmp / box, "--out", out, *extra))
            assert results[-1].returncode == 0, results[-1].stderr
            unpacked = call_kit("--unpack", out, "--into", into, "--bench-json", tmp / "bench.json",
                                "--sessions", tmp / "sessions")
            assert unpacked.returncode == 0, unpacked.stderr
            after_unpack.append((len(read_metrics(shipped)), unpack.checkpoint_epoch(shipped / "checkpoint.pt.gz")))
    spec = grid.BENCHMARKS["LSTM-Wiki2"]
    fill = lambda a: a.replace("{data}", str(DATA_DIR))
    oracle = run_script(spec["script"], "--sorter", "CD-GraB", "--seed", "0", *map(fill, spec["args"]),
                        *spec["setting"], "--epochs", "3", "--device", "cpu", "--data-dir", DATA_DIR,
                        "--out", tmp / "oracle", "--progress", "off", *map(fill, spec["tiny"]))
    assert oracle.returncode == 0, oracle.stderr
    return SimpleNamespace(tmp=tmp, results=results, shipped=shipped, after_unpack=after_unpack, checks_run=seen,
                           oracle=tmp / "oracle")


# what the kit checks for before it starts (data.check_inputs): the LSTM's, GPT-2's and its tokenizer's
DRY_RUN_DATA = ("wikitext-2", "wikitext-103/wiki.valid.tokens", "gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt")


@pytest.mark.slow
@needs_data(*DRY_RUN_DATA)
def test_a_call_packs_what_came_of_it_within_the_limits(dry_run):
    out1 = dry_run.tmp / "out1"
    files = sorted(p.name for p in out1.iterdir())
    assert files == sorted(["runs.tar.gz", "tests.log", "gpu-epochs.json",
                            grid.packed_checkpoint_name(*LSTM_KEY.split("/"))])
    assert all(p.stat().st_size <= base.MAX_FILE_BYTES for p in out1.iterdir())
    entry = session_json(out1)["runs"][LSTM_KEY]
    assert entry["epochs_done"] == 1 and not entry["finished"] and entry["epochs_this_call"] == 1
    assert entry["checkpoint"].startswith(grid.packed_checkpoint_name(*LSTM_KEY.split("/")))
    assert unpack.checkpoint_epoch(out1 / grid.packed_checkpoint_name(*LSTM_KEY.split("/"))) == 1
    with tarfile.open(out1 / "runs.tar.gz") as tar:
        names = tar.getnames()
        log = tar.extractfile(f"{LSTM_KEY}/log.txt").read().decode()
    assert {f"{LSTM_KEY}/config.json", f"{LSTM_KEY}/metrics.csv", "gpu-profile.txt"} <= set(names)
    assert "stopped after epoch 1" in log


@pytest.mark.slow
@needs_data(*DRY_RUN_DATA)
def test_the_first_call_on_a_machine_checks_and_later_calls_there_do_not(dry_run):
    """--checks all: the LSTM check, the bench and the profile before the runs, the CUDA tests beside them;
    a second call on the machine checks nothing; --checks tests on a new machine: the profile (every lent
    GPU measures itself) and the tests, no bench."""
    second = dry_run.results[1]
    assert dry_run.checks_run == [["gpu-epochs.json", "gpu-profile.txt"], [], ["gpu-profile.txt"]]
    out = [dry_run.tmp / f"out{n}" for n in (1, 2, 3)]
    assert session_json(out[0])["checks"] == {"lstm_cudnn": "on", "bench_exit": 0, "profile_exit": 0}
    tests_log = (out[0] / "tests.log").read_text()  # the LSTM check, then the CUDA tests, with their output
    assert f"{grid.LSTM_CHECK[0]}\n" in tests_log and f"-rfEs {' '.join(grid.CUDA_TESTS)}\n" in tests_log
    assert "stood in for" in tests_log and session_json(out[0])["tests_exit"] == 0
    assert "checks done on this machine earlier" in second.stderr and "tests_exit" not in session_json(out[1])
    assert sorted(p.name for p in out[2].iterdir()) == ["runs.tar.gz", "tests.log"]
    assert session_json(out[2])["checks"] == {"lstm_cudnn": "on", "bench": "skipped", "profile_exit": 0}
    with tarfile.open(out[2] / "runs.tar.gz") as tar:
        assert "gpu-profile.txt" in tar.getnames()
    assert grid.LSTM_CHECK[0] not in (out[2] / "tests.log").read_text() and "-rfEs" in (out[2] / "tests.log").read_text()


@pytest.mark.slow
@needs_data(*DRY_RUN_DATA)
def test_unpack_ships_the_newest_checkpoint_until_the_run_finishes_and_keeps_every_record(dry_run):
    """After each call's --unpack: the run's records and its newest checkpoint, until it finished (then no
    checkpoint); every call's record and log in its session folder; the bench's JSON and the profile."""
    assert dry_run.after_unpack == [(1, 1), (2, 2), (3, None)]
    third = session_json(dry_run.tmp / "out3")["runs"][LSTM_KEY]
    assert third["from"] == "shipped checkpoint (epoch 2)" and third["finished"] and third["epochs_this_call"] == 1
    second = session_json(dry_run.tmp / "out2")["runs"][LSTM_KEY]
    assert second["from"] == "nothing shipped" and second["epochs_this_call"] == 1  # the machine's own checkpoint
    logs = [member_text(archive, f"{LSTM_KEY}/log.txt")
            for archive in sorted((dry_run.tmp / "sessions").glob("*/runs.tar.gz"))]
    assert len(logs) == 3 and "stopped after epoch 2" in logs[1]
    assert not list((dry_run.tmp / "sessions").rglob("config.json"))  # packed: no second copy of a run folder
    assert len(list((dry_run.tmp / "sessions").glob("*/session.json"))) == 3
    assert json.loads((dry_run.tmp / "bench.json").read_text()) == {"benchmarks": {"LR-HMDA": {}}}
    profiles = list(dry_run.tmp.glob("gpu-profile-cpu-*.txt"))  # calls 1 and 3: one file a day
    assert profiles and {p.read_text() for p in profiles} == {"# the profile, stood in for\n"}


@pytest.mark.slow
@needs_data(*DRY_RUN_DATA)
def test_a_run_resumed_across_calls_and_machines_equals_an_uninterrupted_one(dry_run):
    """Bit for bit, and its config.json keeps one record per segment (one per process, on two machines)."""
    keys = ("train_loss", "valid_loss", "test_loss")
    assert [[row[k] for k in keys] for row in read_metrics(dry_run.shipped)] == \
           [[row[k] for k in keys] for row in read_metrics(dry_run.oracle)]
    segments = json.loads((dry_run.shipped / "config.json").read_text())["segments"]
    assert [(s["first_epoch"], s["last_epoch"], s["device"]) for s in segments] == [(1, 1, "cpu"), (2, 2, "cpu"),
                                                                                   (3, 3, "cpu")]
    if GIT_CHECKOUT:
        assert all(re.fullmatch(r"[0-9a-f]{40}", s["code_tree"]) for s in segments)
    else:  # a source archive: the code is named as unknown, the run goes on
        assert all(s["code_tree"] is None and s["commit"] == s["git_describe"] == UNKNOWN_COMMIT for s in segments)


# ---------------------------------------------------------------------------------------------- data
def test_data_travel_as_one_archive_and_arrive_whole(tmp_path, monkeypatch):
    """--pack-data packs every data folder the session needs and --data-archive unpacks them as they were
    (a stand-in data folder of the same names: the real one is 40 MiB); a missing folder is one line."""
    source = tmp_path / "data"
    for number, folder in enumerate(data.DATA_FOLDERS):
        (source / folder / "sub").mkdir(parents=True)
        (source / folder / "sub" / "file.txt").write_bytes(os.urandom(100 + number))
    archive = tmp_path / "carry" / "datasets.tar.gz"
    data.pack_data(source, archive)
    data.unpack_data(archive, tmp_path / "datasets")
    for folder in data.DATA_FOLDERS:
        here = {p.relative_to(source): p.read_bytes() for p in (source / folder).rglob("*") if p.is_file()}
        there = {p.relative_to(tmp_path / "datasets"): p.read_bytes()
                 for p in (tmp_path / "datasets" / folder).rglob("*") if p.is_file()}
        assert here == there, folder
    (source / data.DATA_FOLDERS[-1] / "sub" / "file.txt").unlink()
    (source / data.DATA_FOLDERS[-1] / "sub").rmdir()
    (source / data.DATA_FOLDERS[-1]).rmdir()
    with pytest.raises(SystemExit) as refused:
        data.pack_data(source, tmp_path / "again.tar.gz")
    assert refused.value.code == 2 and not (tmp_path / "again.tar.gz").exists()


@needs_data("wikitext-2", "wikitext-103", "gpt2-tokenizer", "hmda", "m4")
def test_the_data_folder_holds_every_folder_the_archive_carries():
    assert all((DATA_DIR / folder).is_dir() for folder in data.DATA_FOLDERS)


# ---------------------------------------------------------------------------------------------- loses nothing
def fake_call(folder, runs: dict, tiny=False):
    """The files of a device call that brought back `runs` ({"<benchmark>/<run>": (epochs_done, epochs,
    finished)}): runs.tar.gz with each run's config.json and metrics.csv, and session.json."""
    folder.mkdir(parents=True)
    manifest = {"tiny": tiny, "started": "2026-01-01 00:00:00", "runs": {
        key: {"epochs_done": done, "epochs": epochs, "finished": finished} for key, (done, epochs, finished) in runs.items()}}
    members = {"session.json": json.dumps(manifest)}
    for key, (done, epochs, _) in runs.items():
        members[f"{key}/config.json"] = json.dumps({"args": {"epochs": epochs}})
        members[f"{key}/metrics.csv"] = "epoch,train_loss\n" + "".join(f"{e},{1 / e}\n" for e in range(1, done + 1))
    with tarfile.open(folder / "runs.tar.gz", "w:gz") as tar:
        for name, text in members.items():
            payload = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return folder


def test_unpack_refuses_a_dry_run_into_reproduction(tmp_path):
    result = call_kit("--unpack", fake_call(tmp_path / "call", {}, tiny=True))
    assert result.returncode == 2
    assert len(error_lines(result)) == 1 and "--into" in result.stderr
    assert call_kit("--unpack", tmp_path / "nothing-here").returncode == 2


def test_unpack_keeps_a_longer_shipped_run_over_a_restart_that_stopped_short(tmp_path):
    """A GPT-2 run restarts every session (its checkpoint cannot travel): when it comes back with fewer
    epochs than the shipped record, the shipped record stays; a longer or finished run replaces it."""
    into = tmp_path / "reproduction"
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    short, longer = "GPT2-Wiki103/short-run", "GPT2-Wiki103/longer-run"
    unpack.unpack(fake_call(tmp_path / "call1", {short: (14, 30, False), longer: (5, 30, False)}), **places)
    unpack.unpack(fake_call(tmp_path / "call2", {short: (9, 30, False), longer: (12, 30, False)}), **places)
    assert len(read_metrics(into / short)) == 14 and len(read_metrics(into / longer)) == 12
    unpack.unpack(fake_call(tmp_path / "call3", {short: (30, 30, True)}), **places)
    assert len(read_metrics(into / short)) == 30


def fake_run(work, benchmark, sorter, epochs_done, epochs=5, checkpoint=True):
    """A Run of the kit whose folder holds `epochs_done` epochs (metrics.csv, config.json, log.txt and,
    with `checkpoint`, a checkpoint.pt of that epoch)."""
    import torch

    fake = run.Run(benchmark, sorter, 0, work, SimpleNamespace(epochs=epochs, tiny=False))
    fake.dir.mkdir(parents=True, exist_ok=True)
    (fake.dir / "metrics.csv").write_text("epoch,train_loss\n" + "".join(f"{e},1.0\n" for e in range(1, epochs_done + 1)))
    (fake.dir / "config.json").write_text(json.dumps({"args": {"epochs": epochs}}))
    (fake.dir / "log.txt").write_text(f"epoch {epochs_done}\n")
    if checkpoint:
        torch.save({"epoch": epochs_done, "sorter": {}, "flat": torch.arange(1000.0 * epochs_done)}, fake.dir / "checkpoint.pt")
        stamp = (epochs_done + 1) * 10**9  # a new mtime per epoch, as a real epoch end gives
        os.utime(fake.dir / "checkpoint.pt", ns=(stamp, stamp))
    return fake


def packed(out) -> dict:
    """run key -> epochs in the packed metrics.csv, and the packed checkpoints' epochs."""
    with tarfile.open(out / "runs.tar.gz", "r:gz") as tar:
        rows = {m.name.rsplit("/", 1)[0]: len(tar.extractfile(m).read().decode().splitlines()) - 1
                for m in tar.getmembers() if m.name.endswith("metrics.csv")}
    checkpoints = {p.name: unpack.checkpoint_epoch(p) for p in out.glob("ckpt-*")}
    return {"rows": rows, "checkpoints": checkpoints}


def test_the_pack_follows_every_epoch_and_gzips_only_new_checkpoints_that_travel(tmp_path, monkeypatch):
    """$OUT is rewritten as epochs end (a call cut at its limit returns them); a checkpoint is gzipped
    once per epoch, never for a run whose checkpoint cannot travel (GPT-2), and leaves $OUT when its run
    finishes."""
    gzipped = []
    slim = pack.slim_checkpoint
    monkeypatch.setattr(pack, "slim_checkpoint", lambda path: gzipped.append(path.parent.name) or slim(path))
    work, out = tmp_path / "work", tmp_path / "out"
    gpt2, lstm = fake_run(work, "GPT2-Wiki103", "CD-GraB", 1), fake_run(work, "LSTM-Wiki2", "CD-GraB", 1)
    runs, manifest = [gpt2, lstm], {"runs": {gpt2.key: {}, lstm.key: {}}}
    lstm_file = grid.packed_checkpoint_name("LSTM-Wiki2", lstm.name)
    packer = pack.Packer(work, out)
    packer.pack(runs, manifest)
    assert packed(out) == {"rows": {gpt2.key: 1, lstm.key: 1}, "checkpoints": {lstm_file: 1}}
    assert not packer.due(runs, now=1e9, every=0)  # nothing new
    packer.pack(runs, manifest)
    assert gzipped == [lstm.name] and "cannot travel" in manifest["runs"][gpt2.key]["checkpoint"]
    fake_run(work, "LSTM-Wiki2", "CD-GraB", 2)
    assert packer.due(runs, now=1e9, every=0) and not packer.due(runs, now=packer.last + 1, every=30)
    packer.pack(runs, manifest)
    assert packed(out) == {"rows": {gpt2.key: 1, lstm.key: 2}, "checkpoints": {lstm_file: 2}}
    fake_run(work, "LSTM-Wiki2", "CD-GraB", 5)  # finished: its checkpoint leaves $OUT
    packer.pack(runs, manifest)
    assert packed(out) == {"rows": {gpt2.key: 1, lstm.key: 5}, "checkpoints": {}}
    assert gzipped == [lstm.name] * 2 and sorted(p.name for p in out.iterdir()) == ["runs.tar.gz"]


def test_a_slim_checkpoint_zeroes_only_the_running_sums_a_new_epoch_resets(tmp_path):
    """CD-GraB's running sum at an epoch end is replaced by zeros at the next epoch's start: packed as
    zeros; a sum with a pending step (taken mid-epoch) and every other tensor travel as they are."""
    import torch

    state = {"epoch": 3, "flat": torch.arange(6.0), "sorter": {"running_sum": torch.ones(4), "pending": None}}
    torch.save(state, tmp_path / "checkpoint.pt")
    slim = torch.load(io.BytesIO(gzip.decompress(pack.slim_checkpoint(tmp_path / "checkpoint.pt"))), weights_only=False)
    assert torch.equal(slim["sorter"]["running_sum"], torch.zeros(4)) and torch.equal(slim["flat"], torch.arange(6.0))
    state["sorter"]["pending"] = torch.ones(4)
    torch.save(state, tmp_path / "checkpoint.pt")
    slim = torch.load(io.BytesIO(gzip.decompress(pack.slim_checkpoint(tmp_path / "checkpoint.pt"))), weights_only=False)
    assert torch.equal(slim["sorter"]["running_sum"], torch.ones(4))


def ship(into, key, rows, epochs, checkpoint=None, mark="-1.0"):
    """A shipped run folder: config.json, metrics.csv (train_loss `mark`), a packed checkpoint of an epoch."""
    import torch

    folder = into / key
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"args": {"epochs": epochs}}))
    (folder / "metrics.csv").write_text("epoch,train_loss\n" + "".join(f"{e},{mark}\n" for e in range(1, rows + 1)))
    if checkpoint is not None:
        buffer = io.BytesIO()
        torch.save({"epoch": checkpoint}, buffer)
        (folder / "checkpoint.pt.gz").write_bytes(gzip.compress(buffer.getvalue()))
    return folder


def call_with_checkpoints(folder, runs: dict, checkpoints: dict):
    """fake_call, plus the packed checkpoints {key: epoch} a call brought back."""
    fake_call(folder, runs)
    for key, epoch in checkpoints.items():
        benchmark, name = key.split("/")
        source = ship(folder / "tmp", key, 0, 1, checkpoint=epoch) / "checkpoint.pt.gz"
        source.rename(folder / grid.packed_checkpoint_name(benchmark, name))
    return folder


def member_text(archive, name: str) -> str:
    with tarfile.open(archive, "r:gz") as tar:
        return tar.extractfile(name).read().decode()


def test_unpack_keeps_a_longer_record_it_replaces_packed_in_the_session_folder(tmp_path):
    """A run that comes back shorter but with a checkpoint (it can go on) replaces a longer shipped record
    that cannot; the longer record is kept, packed, so that no run folder appears twice under the tree."""
    into, key = tmp_path / "reproduction", "LSTM-Wiki2/Fold-run"
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    folder = ship(into, key, rows=20, epochs=50, mark="-2.0")
    unpack.unpack(call_with_checkpoints(tmp_path / "c1", {key: (5, 50, False)}, {key: 5}), **places)
    assert shipped_now(folder) == (5, 5)
    aside = list((tmp_path / "sessions").glob("*/replaced/*.tar.gz"))
    assert len(aside) == 1 and member_text(aside[0], f"{key}/metrics.csv").count(",-2.0\n") == 20
    assert not list((tmp_path / "sessions").rglob("config.json"))


def shipped_now(folder) -> tuple:
    return (len(read_metrics(folder)), unpack.checkpoint_epoch(folder / "checkpoint.pt.gz"))


def test_unpack_keeps_a_shipped_checkpoint_until_a_newer_one_or_the_runs_end(tmp_path):
    """A run that advanced but brought no checkpoint back (no file slot) keeps the shipped checkpoint and
    the records it resumes; a newer checkpoint replaces it, an older one (a restart) does not; a finished
    run removes it."""
    into, key = tmp_path / "reproduction", "LSTM-Wiki2/CD-GraB-run"
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    folder = ship(into, key, rows=3, epochs=50, checkpoint=3)
    unpack.unpack(call_with_checkpoints(tmp_path / "c1", {key: (5, 50, False)}, {}), **places)
    assert shipped_now(folder) == (3, 3)
    records = list((tmp_path / "sessions").glob("*/runs.tar.gz"))  # the call's record stays
    assert len(records) == 1 and member_text(records[0], f"{key}/metrics.csv").count("\n") == 1 + 5
    unpack.unpack(call_with_checkpoints(tmp_path / "c2", {key: (6, 50, False)}, {key: 6}), **places)
    assert shipped_now(folder) == (6, 6)
    unpack.unpack(call_with_checkpoints(tmp_path / "c3", {key: (2, 50, False)}, {key: 2}), **places)
    assert shipped_now(folder) == (6, 6)
    unpack.unpack(call_with_checkpoints(tmp_path / "c4", {key: (50, 50, True)}, {}), **places)
    assert shipped_now(folder) == (50, None)


def test_unpack_changes_a_finished_run_only_when_asked(tmp_path):
    into, key = tmp_path / "reproduction", "LSTM-Wiki2/D-RR-run"
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    folder = ship(into, key, rows=50, epochs=50)
    before = (folder / "metrics.csv").read_bytes()
    for call, unfinished in (("c1", (7, 50, False)), ("c2", (50, 50, True))):
        unpack.unpack(call_with_checkpoints(tmp_path / call, {key: unfinished}, {key: 7} if call == "c1" else {}),
                      **places)
        assert (folder / "metrics.csv").read_bytes() == before and shipped_now(folder) == (50, None)
    unpack.unpack(call_with_checkpoints(tmp_path / "c3", {key: (50, 50, True)}, {}), **places, replace_finished=True)
    assert (folder / "metrics.csv").read_bytes() != before and len(read_metrics(folder)) == 50


def stubborn_and_obedient(tmp_path) -> list:
    """Two runs of the kit as processes: one ignores SIGINT (the kit's stop signal), one obeys it."""
    script = "import signal, sys, time; {}; print('ready', flush=True); time.sleep(60)"
    ignores = "signal.signal(signal.SIGINT, signal.SIG_IGN)"
    obeys = "pass"  # Python's own KeyboardInterrupt handler, which run.spawn makes sure it installs
    runs = [fake_run(tmp_path, "LSTM-Wiki2", sorter, 1) for sorter in ("CD-GraB", "D-RR")]
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a kit started with `&` without job control
    try:
        for fake, setup in zip(runs, (ignores, obeys)):
            fake.process = run.spawn([sys.executable, "-c", script.format(setup)], stdout=subprocess.PIPE, text=True)
            assert fake.process.stdout.readline() == "ready\n"
    finally:
        signal.signal(signal.SIGINT, inherited)
    return runs


def test_a_run_that_ignores_its_stop_signal_is_killed_after_the_grace_and_the_kit_goes_on(tmp_path):
    runs = stubborn_and_obedient(tmp_path)
    stubborn, obedient = runs
    active = list(runs)
    try:
        run.supervise(active, now=100.0, stop_at=100.0, grace=5.0)  # the stop: both signalled
        obedient.process.wait(30)
        run.supervise(active, now=104.0, stop_at=100.0, grace=5.0)
        assert active == [stubborn] and stubborn.process.poll() is None  # within its grace
        run.supervise(active, now=105.5, stop_at=100.0, grace=5.0)
        assert active == [] and stubborn.process.poll() is not None and stubborn.failed.startswith("killed")
    finally:
        for fake in runs:
            if fake.process.poll() is None:
                fake.process.kill()



def test_the_calls_end_stops_every_run_and_kills_one_that_ignores_it_after_the_grace(tmp_path):
    runs = stubborn_and_obedient(tmp_path)
    try:
        start = time.monotonic()
        run.stop_all(runs, grace=0.5)
        assert all(fake.process.poll() is not None for fake in runs) and time.monotonic() - start < 20
        assert runs[0].failed.startswith("killed") and runs[1].failed is None
    finally:
        for fake in runs:
            if fake.process.poll() is None:
                fake.process.kill()

@pytest.mark.slow
@needs_data(*DRY_RUN_DATA)
def test_sigterm_packs_every_finished_epoch_and_exits(tmp_path):
    """The device tool ends a call with SIGTERM: by then $OUT already holds the epochs that ended (packed
    at each epoch end), and the kit stops its run, packs once more and exits."""
    out = tmp_path / "out"
    argv = [sys.executable, KIT, "--device", "cpu", "--tiny", "--epochs", "40", "--data-dir", DATA_DIR, "--checks",
            "none", "--only", "LSTM-Wiki2/CD-GraB/0", "--work", tmp_path / "work", "--out", out, "--pack-every", "0",
            "--poll", "0.2", "--deadline", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CDGRAB_DATA": str(DATA_DIR)}
    kit_process = subprocess.Popen(list(map(str, argv)), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    key = LSTM_KEY
    try:
        for _ in range(600):  # until the pack holds two epochs (at most a minute)
            if (out / "runs.tar.gz").exists() and session_json(out)["runs"][key].get("epochs_done", 0) >= 2:
                break
            time.sleep(0.1)
        during = session_json(out)["runs"][key]
        assert during["epochs_done"] >= 2 and not during["finished"], during
        kit_process.send_signal(signal.SIGTERM)
        assert kit_process.wait(60) == 0, kit_process.stderr.read()
    finally:
        if kit_process.poll() is None:
            kit_process.kill()
    after = session_json(out)
    entry = after["runs"][key]
    assert after["stopped_by"] == "SIGTERM" and entry["epochs_done"] < 40 and not entry["failed"], after
    (checkpoint,) = out.glob("ckpt-*")
    assert unpack.checkpoint_epoch(checkpoint) == entry["epochs_done"] >= during["epochs_done"]
