"""scripts/gpu_session.py, the GPU session kit, on the CPU: its run names are the sweeps', its stop rule,
and a dry run of the whole path (checks, queue, stop at an epoch end, packing, unpacking, going on on the
same machine and on a "new" one from a packed checkpoint) whose resumed LSTM CD-GraB run must equal an
uninterrupted run of the entry script (the oracle) to the last bit."""
import importlib.util
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
    """The sweep script, dry, given the grid's setting and each variant's arguments as extra arguments,
    names every queued run as the kit does and passes the same settings."""
    benchmark = bench_name
    spec = gpu_session.BENCHMARKS[benchmark]
    queued = [(sorter, seed) for b, sorter, seed in gpu_session.QUEUE if b == benchmark]
    for extra in {tuple(gpu_session.variant(sorter)[1]) for sorter, _ in queued}:
        group = [(s, seed) for s, seed in queued if tuple(gpu_session.variant(s)[1]) == extra]
        sorters = sorted({gpu_session.variant(s)[0] for s, _ in group})
        env = {**os.environ, "DRY_RUN": "1", "SORTERS": " ".join(sorters), "SEEDS": "0 1 2", "DATA": "datasets"}
        out = subprocess.run(["bash", str(REPO / "scripts" / f"sweep-{benchmark}.sh"), *spec["setting"], *extra],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        commands = dict(re.findall(r"run  (\S+): (.*)", out.stdout + out.stderr))
        for sorter, seed in group:
            name = gpu_session.run_name(benchmark, sorter, seed)
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
    spec = gpu_session.BENCHMARKS["LSTM-Wiki2"]
    assert spec["setting"] == (["--clip", f"{clip:g}"] if clip else []) and spec["epochs"] == 50
    run = gpu_session.Run("LSTM-Wiki2", "CD-GraB", 0, REPO / "nowhere", SimpleNamespace(epochs=None, tiny=False))
    argv = run.command(SimpleNamespace(data_dir="datasets", device="cuda", tiny=False), cudnn="on")
    assert argv[argv.index("--clip") + 1] == "0.25" and argv[argv.index("--epochs") + 1] == "50"
    assert not (REPO / "reproduction" / "LSTM-Wiki2" / run.name).exists()
    assert gpu_session.QUEUE[:2] == [("LSTM-Wiki2", "D-RR", 0), ("LSTM-Wiki2", "CD-GraB", 0)]
    grid = {(b, s, seed) for b in ("LSTM-Wiki2",) for s in ("CD-GraB", "D-RR", "Fold") for seed in (0, 1, 2)} | \
           {(b, s, seed) for b in ("GPT2-Wiki103",) for s in ("CD-GraB", "D-RR") for seed in (0, 1, 2)}
    assert set(gpu_session.QUEUE[:-1]) == grid and len(gpu_session.QUEUE) == len(grid) + 1
    assert gpu_session.QUEUE[-1] == ("GPT2-Wiki103", "CD-GraB-sketch1024", 0)  # the sketch after the grid
    sketch = gpu_session.Run(*gpu_session.QUEUE[-1], REPO / "nowhere", SimpleNamespace(epochs=None, tiny=False))
    argv = sketch.command(SimpleNamespace(data_dir="datasets", device="cuda", tiny=False), cudnn="on")
    assert argv[argv.index("--sorter") + 1] == "CD-GraB" and argv[argv.index("--sketch-dim") + 1] == "1024"
    assert sketch.name == "CD-GraB-node64-B64-lr0.0005-sketch-dim1024-seed0" and "--clip" not in argv


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
                                        (("GPT2-Wiki103", "CD-GraB"), ("GPT2-Wiki103", "D-RR"))] + \
                                       [("GPT2-Wiki103", "CD-GraB-sketch1024", 0)]
    assert select(["GPT2-Wiki103/CD-GraB-sketch1024"]) == [("GPT2-Wiki103", "CD-GraB-sketch1024", 0)]


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
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    short, longer = "GPT2-Wiki103/short-run", "GPT2-Wiki103/longer-run"
    gpu_session.unpack(fake_call(tmp_path / "call1", {short: (14, 30, False), longer: (5, 30, False)}), **places)
    gpu_session.unpack(fake_call(tmp_path / "call2", {short: (9, 30, False), longer: (12, 30, False)}), **places)
    assert len(read_metrics(into / short)) == 14 and len(read_metrics(into / longer)) == 12
    gpu_session.unpack(fake_call(tmp_path / "call3", {short: (30, 30, True)}), **places)
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
    assert "cannot travel" in runs[f"GPT2-Wiki103/{gpt2_name}"]["checkpoint"]  # never gzipped, never packed
    assert json.loads((out1 / "gpu-epochs.json").read_text())["benchmarks"]

    result = kit("--unpack", out1, *unpack_to)
    assert result.returncode == 0, result.stderr
    shipped = into / "LSTM-Wiki2" / lstm_name
    assert (shipped / "checkpoint.pt.gz").exists() and len(read_metrics(shipped)) == 2
    assert not (into / "GPT2-Wiki103" / gpt2_name / "checkpoint.pt.gz").exists()
    assert json.loads((tmp_path / "bench.json").read_text())["benchmarks"]
    (profile,) = tmp_path.glob("gpu-profile-cpu-*.txt")  # the first call's profile, of the CPU's activity here
    assert all(f"== LR-HMDA {sorter}: 2 steps profiled" in profile.read_text() for sorter in ("D-RR", "CD-GraB"))
    (record,) = (tmp_path / "sessions").glob(f"*/runs/LSTM-Wiki2/{lstm_name}/log.txt")  # run logs are kept
    assert "stopped after epoch 2" in record.read_text()

    # call 2, same machine: no checks again; GPT-2 goes on from this machine's own checkpoint
    second = kit(*common, "--work", box1, "--out", tmp_path / "out2", "--only", gpt2)
    assert second.returncode == 0, second.stderr
    assert "checks done on this machine earlier" in second.stderr
    assert session_json(tmp_path / "out2")["runs"][f"GPT2-Wiki103/{gpt2_name}"]["finished"]
    assert "resum" in (box1 / "runs" / "GPT2-Wiki103" / gpt2_name / "log.txt").read_text().lower()

    # call 3, a new machine: the LSTM run goes on from the packed checkpoint shipped in "reproduction/"
    # (--checks tests: the profile, then the CUDA tests beside the run; no LSTM check and no bench)
    third = kit(*common, "--work", box2, "--out", tmp_path / "out3", "--only", lstm, "--shipped", into,
                "--checks", "tests", "--tests", "tests/test_cuda.py")
    assert third.returncode == 0, third.stderr
    out3 = sorted(p.name for p in (tmp_path / "out3").iterdir())
    assert out3 == ["runs.tar.gz", "tests.log"], out3
    assert session_json(tmp_path / "out3")["checks"] == {"lstm_cudnn": "on", "bench": "skipped", "profile_exit": 0}
    with tarfile.open(tmp_path / "out3" / "runs.tar.gz") as tar:  # every lent GPU measures itself
        assert "gpu-profile.txt" in tar.getnames()
    assert "skipped" in (tmp_path / "out3" / "tests.log").read_text()
    entry = session_json(tmp_path / "out3")["runs"][f"LSTM-Wiki2/{lstm_name}"]
    assert entry["from"] == "shipped checkpoint (epoch 2)" and entry["finished"] and entry["epochs_this_call"] == 1
    result = kit("--unpack", tmp_path / "out3", *unpack_to)
    assert result.returncode == 0, result.stderr
    assert not (shipped / "checkpoint.pt.gz").exists()  # finished: the checkpoint goes away
    segments = json.loads((shipped / "config.json").read_text())["segments"]  # one per process, on two "machines"
    assert [(s["first_epoch"], s["last_epoch"], s["device"]) for s in segments] == [(1, 2, "cpu"), (3, 3, "cpu")]
    assert all(re.fullmatch(r"[0-9a-f]{40}", s["code_tree"]) for s in segments)

    # the oracle: the same run, uninterrupted, straight from the entry script
    spec = gpu_session.BENCHMARKS["LSTM-Wiki2"]
    fill = lambda a: a.replace("{data}", str(DATA_DIR))
    oracle = tmp_path / "oracle"
    check = run_script(spec["script"], "--sorter", "CD-GraB", "--seed", "0", *map(fill, spec["args"]), *spec["setting"],
                       "--epochs", "3",
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


# ---------------------------------------------------------------------------------------------- loses nothing
def fake_run(work, benchmark, sorter, epochs_done, epochs=5, checkpoint=True):
    """A Run of the kit whose folder holds `epochs_done` epochs (metrics.csv, config.json, log.txt and,
    with `checkpoint`, a checkpoint.pt of that epoch)."""
    import torch

    run = gpu_session.Run(benchmark, sorter, 0, work, SimpleNamespace(epochs=epochs, tiny=False))
    run.dir.mkdir(parents=True, exist_ok=True)
    (run.dir / "metrics.csv").write_text("epoch,train_loss\n" + "".join(f"{e},1.0\n" for e in range(1, epochs_done + 1)))
    (run.dir / "config.json").write_text(json.dumps({"args": {"epochs": epochs}}))
    (run.dir / "log.txt").write_text(f"epoch {epochs_done}\n")
    if checkpoint:
        torch.save({"epoch": epochs_done, "sorter": {}, "flat": torch.arange(1000.0 * epochs_done)}, run.dir / "checkpoint.pt")
        stamp = (epochs_done + 1) * 10**9  # a new mtime per epoch, as a real epoch end gives
        os.utime(run.dir / "checkpoint.pt", ns=(stamp, stamp))
    return run


def packed(out) -> dict:
    """run key -> epochs in the packed metrics.csv, and the packed checkpoints' epochs."""
    with tarfile.open(out / "runs.tar.gz", "r:gz") as tar:
        rows = {m.name.rsplit("/", 1)[0]: len(tar.extractfile(m).read().decode().splitlines()) - 1
                for m in tar.getmembers() if m.name.endswith("metrics.csv")}
    checkpoints = {p.name: gpu_session.checkpoint_epoch(p) for p in out.glob("ckpt-*")}
    return {"rows": rows, "checkpoints": checkpoints}


def test_the_pack_follows_every_epoch_and_gzips_only_new_checkpoints_that_travel(tmp_path, monkeypatch):
    """$OUT is rewritten as epochs end (a call cut at its limit returns them); a checkpoint is gzipped
    once per epoch, never for a run whose checkpoint cannot travel (GPT-2), and leaves $OUT when its run
    finishes."""
    gzipped = []
    slim = gpu_session.slim_checkpoint
    monkeypatch.setattr(gpu_session, "slim_checkpoint", lambda path: gzipped.append(path.parent.name) or slim(path))
    work, out = tmp_path / "work", tmp_path / "out"
    gpt2, lstm = fake_run(work, "GPT2-Wiki103", "CD-GraB", 1), fake_run(work, "LSTM-Wiki2", "CD-GraB", 1)
    runs, manifest = [gpt2, lstm], {"runs": {gpt2.key: {}, lstm.key: {}}}
    lstm_file = gpu_session.packed_checkpoint_name("LSTM-Wiki2", lstm.name)
    packer = gpu_session.Packer(work, out)
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


def ship(into, key, rows, epochs, checkpoint=None, mark="-1.0"):
    """A shipped run folder: config.json, metrics.csv (train_loss `mark`), a packed checkpoint of an epoch."""
    import gzip

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
        source.rename(folder / gpu_session.packed_checkpoint_name(benchmark, name))
    return folder


def shipped_now(folder) -> tuple:
    return (len(read_metrics(folder)), gpu_session.checkpoint_epoch(folder / "checkpoint.pt.gz"))


def test_unpack_keeps_a_shipped_checkpoint_until_a_newer_one_or_the_runs_end(tmp_path):
    """A run that advanced but brought no checkpoint back (no file slot) keeps the shipped checkpoint and
    the records it resumes; a newer checkpoint replaces it, an older one (a restart) does not; a finished
    run removes it."""
    into, key = tmp_path / "reproduction", "LSTM-Wiki2/CD-GraB-run"
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    folder = ship(into, key, rows=3, epochs=50, checkpoint=3)
    gpu_session.unpack(call_with_checkpoints(tmp_path / "c1", {key: (5, 50, False)}, {}), **places)
    assert shipped_now(folder) == (3, 3)
    assert len(list((tmp_path / "sessions").glob(f"*/runs/{key}/metrics.csv"))) == 1  # the call's record stays
    gpu_session.unpack(call_with_checkpoints(tmp_path / "c2", {key: (6, 50, False)}, {key: 6}), **places)
    assert shipped_now(folder) == (6, 6)
    gpu_session.unpack(call_with_checkpoints(tmp_path / "c3", {key: (2, 50, False)}, {key: 2}), **places)
    assert shipped_now(folder) == (6, 6)
    gpu_session.unpack(call_with_checkpoints(tmp_path / "c4", {key: (50, 50, True)}, {}), **places)
    assert shipped_now(folder) == (50, None)


def test_unpack_changes_a_finished_run_only_when_asked(tmp_path):
    into, key = tmp_path / "reproduction", "LSTM-Wiki2/D-RR-run"
    places = dict(into=into, bench_json=tmp_path / "bench.json", sessions=tmp_path / "sessions")
    folder = ship(into, key, rows=50, epochs=50)
    before = (folder / "metrics.csv").read_bytes()
    for call, unfinished in (("c1", (7, 50, False)), ("c2", (50, 50, True))):
        gpu_session.unpack(call_with_checkpoints(tmp_path / call, {key: unfinished}, {key: 7} if call == "c1" else {}),
                           **places)
        assert (folder / "metrics.csv").read_bytes() == before and shipped_now(folder) == (50, None)
    gpu_session.unpack(call_with_checkpoints(tmp_path / "c3", {key: (50, 50, True)}, {}), **places, replace_finished=True)
    assert (folder / "metrics.csv").read_bytes() != before and len(read_metrics(folder)) == 50


def test_a_run_that_ignores_its_stop_signal_is_killed_after_the_grace_and_the_kit_goes_on(tmp_path):
    script = "import signal, sys, time; {}; print('ready', flush=True); time.sleep(60)"
    ignores = "signal.signal(signal.SIGINT, signal.SIG_IGN)"
    runs = [fake_run(tmp_path, "LSTM-Wiki2", sorter, 1) for sorter in ("CD-GraB", "D-RR")]
    for run, setup in zip(runs, (ignores, "pass")):
        run.process = subprocess.Popen([sys.executable, "-c", script.format(setup)], stdout=subprocess.PIPE,
                                       start_new_session=True, text=True)
        assert run.process.stdout.readline() == "ready\n"
    stubborn, obedient = runs
    active = list(runs)
    try:
        gpu_session.supervise(active, now=100.0, stop_at=100.0, grace=5.0)  # the stop: both signalled
        obedient.process.wait(30)
        gpu_session.supervise(active, now=104.0, stop_at=100.0, grace=5.0)
        assert active == [stubborn] and stubborn.process.poll() is None  # within its grace
        gpu_session.supervise(active, now=105.5, stop_at=100.0, grace=5.0)
        assert active == [] and stubborn.process.poll() is not None and stubborn.failed.startswith("killed")
    finally:
        for run in runs:
            if run.process.poll() is None:
                run.process.kill()


def test_the_plan_starts_only_runs_that_can_finish_or_whose_checkpoint_travels():
    refusal = gpu_session.start_refusal  # START_SECONDS (30) + epochs x seconds against the time left
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
    alone = gpu_session.epoch_estimates(sessions, bench, parallel=1)
    assert alone[("GPT2-Wiki103", "CD-GraB")] == (17.0, "a/session.json")
    assert alone[("GPT2-Wiki103", "D-RR")][0] == pytest.approx(8.2 + 4.0)        # the bench's, with its evaluation
    assert alone[("LSTM-Wiki2", "Fold")][0] == pytest.approx(10.5 + 8.0)          # D-RR's, 8 s of evaluation assumed
    shared = gpu_session.epoch_estimates(sessions, bench, parallel=2)
    assert shared[("LSTM-Wiki2", "CD-GraB")] == (53.0, "b/session.json")          # the slowest of that sharing
    assert shared[("GPT2-Wiki103", "CD-GraB")][0] == pytest.approx(2 * (12.2 + 4.0))
    assert gpu_session.epoch_estimates(tmp_path / "none", tmp_path / "none.json", 1)[("LSTM-Wiki2", "D-RR")] == \
           (gpu_session.FALLBACK_EPOCH_SECONDS["LSTM-Wiki2"], "fallback")


@pytest.mark.slow
@needs_data("wikitext-2")
def test_sigterm_packs_every_finished_epoch_and_exits(tmp_path):
    """The device tool ends a call with SIGTERM: by then $OUT already holds the epochs that ended (packed
    at each epoch end), and the kit stops its run, packs once more and exits."""
    out = tmp_path / "out"
    argv = [sys.executable, KIT, "--device", "cpu", "--tiny", "--epochs", "40", "--data-dir", DATA_DIR, "--checks",
            "none", "--only", "LSTM-Wiki2/CD-GraB/0", "--work", tmp_path / "work", "--out", out, "--pack-every", "0",
            "--poll", "0.2", "--deadline", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CDGRAB_DATA": str(DATA_DIR)}
    kit_process = subprocess.Popen(list(map(str, argv)), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    key = f"LSTM-Wiki2/{gpu_session.run_name('LSTM-Wiki2', 'CD-GraB', 0)}"
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
    assert gpu_session.checkpoint_epoch(checkpoint) == entry["epochs_done"] >= during["epochs_done"]
