"""scripts/gpu_session.py, the GPU session kit, on the CPU: its run names are the sweeps', its stop rule,
and a dry run of the whole path (checks, queue, stop at an epoch end, packing, unpacking, going on on the
same machine and on a "new" one from a packed checkpoint) whose resumed LSTM CD-GraB run must equal an
uninterrupted run of the entry script (the oracle) to the last bit."""
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from tests.helpers import DATA_DIR, REPO, error_lines, needs_data, read_metrics, run_python, run_script

spec = importlib.util.spec_from_file_location("gpu_session", REPO / "scripts" / "gpu_session.py")
gpu_session = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_session)

KIT = REPO / "scripts" / "gpu_session.py"


def kit(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CDGRAB_DATA": str(DATA_DIR)}
    return run_python([sys.executable, KIT, *args], env=env, timeout=timeout)


@pytest.mark.parametrize("bench_name", gpu_session.BENCHMARKS)  # not "benchmark": pytest-benchmark owns it
def test_run_names_and_settings_are_the_sweeps(bench_name):
    """The sweep script, dry, names every queued run as the kit does and passes the same settings."""
    benchmark = bench_name
    queued = [(sorter, seed) for b, sorter, seed in gpu_session.QUEUE if b == benchmark]
    sorters = sorted({sorter for sorter, _ in queued})
    env = {**os.environ, "DRY_RUN": "1", "SORTERS": " ".join(sorters), "SEEDS": "0 1 2", "DATA": "datasets"}
    out = subprocess.run(["bash", str(REPO / "scripts" / f"sweep-{benchmark}.sh")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = re.findall(r"run  (\S+): (.*)", out.stdout + out.stderr)
    commands = dict(lines)
    for sorter, seed in queued:
        name = gpu_session.run_name(benchmark, sorter, seed)
        assert name in commands, (name, list(commands))
        settings = [a.replace("{data}", "datasets") for a in gpu_session.BENCHMARKS[benchmark]["args"]]
        assert " ".join(settings) in commands[name] or all(
            f"{flag} {value}" in commands[name] for flag, value in zip(settings[::2], settings[1::2])
            if flag.startswith("--") and not value.startswith("--")), commands[name]


def test_stop_rule():
    decide = gpu_session.stop_decision
    assert decide([0.0], now=99.0, stop_at=100.0) is None                     # no epoch yet: run on
    assert decide([0.0], now=100.0, stop_at=100.0) == "now"                   # the deadline
    assert decide([0.0, 20.0, 40.0], now=41.0, stop_at=100.0) is None         # 40 + 2 x 20 <= 100
    assert decide([0.0, 30.0, 60.0], now=61.0, stop_at=100.0) == "after this epoch"  # 60 + 30 <= 100 < 60 + 60
    assert decide([0.0, 30.0, 75.0], now=76.0, stop_at=100.0) == "now"        # 75 + 45 > 100: it cannot end


def test_only_selects_by_benchmark_sorter_and_seed_in_the_queues_order():
    select = gpu_session.select_queue
    assert select(None) == gpu_session.QUEUE
    assert select(["LSTM-Wiki2/CD-GraB"]) == [("LSTM-Wiki2", "CD-GraB", 0), ("LSTM-Wiki2", "CD-GraB", 1),
                                             ("LSTM-Wiki2", "CD-GraB", 2)]
    assert select(["LSTM-Wiki2/Fold/1", "GPT2-Wiki103/CD-GraB/0"]) == [("GPT2-Wiki103", "CD-GraB", 0),
                                                                      ("LSTM-Wiki2", "Fold", 1)]
    assert select(["GPT2-Wiki103"]) == [(b, s, seed) for seed in (0, 1, 2) for b, s in
                                        (("GPT2-Wiki103", "CD-GraB"), ("GPT2-Wiki103", "D-RR"))]


@pytest.mark.parametrize("entry", ["LSTM-wiki2", "LSTM-Wiki2/CD-GraB/3", "GPT2-Wiki103/Fold", "LSTM-Wiki2/CD-GraB/0/x"])
def test_an_only_entry_that_names_no_run_is_refused_before_anything_starts(tmp_path, entry):
    """A typo would spend a call of device time on an empty queue: one line, exit status 2, nothing made."""
    result = kit("--device", "cpu", "--out", tmp_path / "out", "--work", tmp_path / "work", "--only", entry)
    assert result.returncode == 2, result.stderr
    assert len(error_lines(result)) == 1 and entry in error_lines(result)[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_the_kits_pytest_runs_where_pytest_xdist_is_missing():
    """The GPU box has no pytest-xdist, which pytest.ini's addopts (-n auto) need: the kit's pytest command
    must collect there (-p no:xdist stands in for the missing plugin; exit 4 would be a usage error)."""
    collect = [*gpu_session.PYTEST, "-p", "no:xdist", "--collect-only", "tests/test_partition.py"]
    result = subprocess.run(collect, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "test_partition_names_are_canonical" in result.stdout, result.stdout + result.stderr


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
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder


def test_unpack_refuses_a_dry_run_into_reproduction(tmp_path):
    result = kit("--unpack", fake_call(tmp_path / "call", {}, tiny=True))
    assert result.returncode == 2
    assert len(error_lines(result)) == 1 and "--into" in result.stderr
    assert kit("--unpack", tmp_path / "nothing-here").returncode == 2


def test_unpack_keeps_a_longer_shipped_run_over_a_restart_that_stopped_short(tmp_path):
    """A GPT-2 run restarts every session (its checkpoint cannot travel): when it comes back with fewer
    epochs than the shipped record, the shipped record stays; a longer or finished run replaces it."""
    into = tmp_path / "reproduction"
    places = ["--into", into, "--bench-json", tmp_path / "bench.json", "--sessions", tmp_path / "sessions"]
    short, longer = "GPT2-Wiki103/short-run", "GPT2-Wiki103/longer-run"
    first = fake_call(tmp_path / "call1", {short: (14, 30, False), longer: (5, 30, False)})
    assert kit("--unpack", first, *places).returncode == 0
    second = fake_call(tmp_path / "call2", {short: (9, 30, False), longer: (12, 30, False)})
    result = kit("--unpack", second, *places)
    assert result.returncode == 0, result.stderr
    assert len(read_metrics(into / short)) == 14 and "kept as shipped (14 epochs)" in result.stdout
    assert len(read_metrics(into / longer)) == 12
    third = fake_call(tmp_path / "call3", {short: (30, 30, True)})
    assert kit("--unpack", third, *places).returncode == 0
    assert len(read_metrics(into / short)) == 30


def session_json(out):
    with tarfile.open(out / "runs.tar.gz", "r:gz") as tar:
        return json.loads(tar.extractfile("session.json").read())


@pytest.mark.slow
@needs_data("wikitext-2", "wikitext-103/wiki.valid.tokens", "gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt",
            "hmda/raw/hmda_train_preprocessed.zip")
def test_dry_run_stops_packs_unpacks_and_goes_on_to_the_same_result(tmp_path):
    lstm, gpt2 = "LSTM-Wiki2/CD-GraB/0", "GPT2-Wiki103/D-RR/0"
    lstm_name = gpu_session.run_name("LSTM-Wiki2", "CD-GraB", 0)
    gpt2_name = gpu_session.run_name("GPT2-Wiki103", "D-RR", 0)
    box1, box2, into = tmp_path / "box1", tmp_path / "box2", tmp_path / "reproduction"
    common = ["--device", "cpu", "--tiny", "--epochs", "3", "--data-dir", DATA_DIR, "--progress-every", "5",
              "--min-start-seconds", "0", "--pack-seconds", "5", "--deadline", "240", "--parallel", "2"]
    unpack_to = ["--into", into, "--bench-json", tmp_path / "bench.json", "--sessions", tmp_path / "sessions"]

    # call 1: checks (the CUDA tests skip on the CPU), both runs stopped after 2 of their 3 epochs
    first = kit(*common, "--work", box1, "--out", tmp_path / "out1", "--only", lstm, gpt2, "--stop-after-epochs", 2,
                "--tests", "tests/test_cuda.py")
    assert first.returncode == 0, first.stderr
    out1 = tmp_path / "out1"
    files = sorted(p.name for p in out1.iterdir())
    assert files == sorted(["runs.tar.gz", "tests.log", "gpu-epochs.json",
                            gpu_session.packed_checkpoint_name("LSTM-Wiki2", lstm_name)])
    assert all(p.stat().st_size <= gpu_session.MAX_FILE_BYTES for p in out1.iterdir())
    manifest = session_json(out1)
    assert manifest["checks"]["lstm_cudnn"] == "on" and manifest["checks"]["bench_exit"] == 0
    assert "skipped" in (out1 / "tests.log").read_text()
    runs = manifest["runs"]
    assert runs[f"LSTM-Wiki2/{lstm_name}"]["epochs_done"] == 2 and not runs[f"LSTM-Wiki2/{lstm_name}"]["finished"]
    assert runs[f"GPT2-Wiki103/{gpt2_name}"]["epochs_done"] == 2
    assert "does not fit" in runs[f"GPT2-Wiki103/{gpt2_name}"]["checkpoint"]  # 6.8M parameters and two moments
    assert json.loads((out1 / "gpu-epochs.json").read_text())["benchmarks"]

    result = kit("--unpack", out1, *unpack_to)
    assert result.returncode == 0, result.stderr
    shipped = into / "LSTM-Wiki2" / lstm_name
    assert (shipped / "checkpoint.pt.gz").exists() and len(read_metrics(shipped)) == 2
    assert not (into / "GPT2-Wiki103" / gpt2_name / "checkpoint.pt.gz").exists()
    assert json.loads((tmp_path / "bench.json").read_text())["benchmarks"]

    # call 2, same machine: no checks again; GPT-2 goes on from this machine's own checkpoint
    second = kit(*common, "--work", box1, "--out", tmp_path / "out2", "--only", gpt2)
    assert second.returncode == 0, second.stderr
    assert "checks done on this machine earlier" in second.stderr
    assert session_json(tmp_path / "out2")["runs"][f"GPT2-Wiki103/{gpt2_name}"]["finished"]
    assert "resum" in (box1 / "runs" / "GPT2-Wiki103" / gpt2_name / "log.txt").read_text().lower()

    # call 3, a new machine: the LSTM run goes on from the packed checkpoint shipped in "reproduction/"
    # (--checks tests: the CUDA tests beside the run, no LSTM check and no bench)
    third = kit(*common, "--work", box2, "--out", tmp_path / "out3", "--only", lstm, "--shipped", into,
                "--checks", "tests", "--tests", "tests/test_cuda.py")
    assert third.returncode == 0, third.stderr
    out3 = sorted(p.name for p in (tmp_path / "out3").iterdir())
    assert out3 == ["runs.tar.gz", "tests.log"], out3
    assert session_json(tmp_path / "out3")["checks"] == {"lstm_cudnn": "on", "bench": "skipped"}
    assert "skipped" in (tmp_path / "out3" / "tests.log").read_text()
    entry = session_json(tmp_path / "out3")["runs"][f"LSTM-Wiki2/{lstm_name}"]
    assert entry["from"] == "shipped checkpoint (epoch 2)" and entry["finished"] and entry["epochs_this_call"] == 1
    result = kit("--unpack", tmp_path / "out3", *unpack_to)
    assert result.returncode == 0, result.stderr
    assert not (shipped / "checkpoint.pt.gz").exists()  # finished: the checkpoint goes away

    # the oracle: the same run, uninterrupted, straight from the entry script
    spec = gpu_session.BENCHMARKS["LSTM-Wiki2"]
    fill = lambda a: a.replace("{data}", str(DATA_DIR))
    oracle = tmp_path / "oracle"
    check = run_script(spec["script"], "--sorter", "CD-GraB", "--seed", "0", *map(fill, spec["args"]), "--epochs", "3",
                       "--device", "cpu", "--data-dir", DATA_DIR, "--out", oracle, "--progress", "off",
                       *map(fill, spec["tiny"]))
    assert check.returncode == 0, check.stderr
    keys = ("train_loss", "valid_loss", "test_loss")
    assert [[row[k] for k in keys] for row in read_metrics(shipped)] == \
           [[row[k] for k in keys] for row in read_metrics(oracle)]


@needs_data("wikitext-2", "wikitext-103", "gpt2-tokenizer", "hmda", "m4")
def test_data_travel_as_one_archive_and_arrive_whole(tmp_path):
    archive = tmp_path / "carry" / "datasets.tar.gz"
    gpu_session.pack_data(DATA_DIR, archive)
    gpu_session.unpack_data(archive, tmp_path / "datasets")
    for folder in gpu_session.DATA_FOLDERS:
        here = {p.relative_to(DATA_DIR): p.stat().st_size for p in (DATA_DIR / folder).rglob("*") if p.is_file()}
        there = {p.relative_to(tmp_path / "datasets"): p.stat().st_size
                 for p in (tmp_path / "datasets" / folder).rglob("*") if p.is_file()}
        assert here == there, folder
