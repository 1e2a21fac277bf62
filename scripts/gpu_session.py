#!/usr/bin/env python
"""One lent GPU session's device call, whole: CUDA checks, then the GPU reproduction queue, every run
stopped cleanly before a deadline and packed for the trip back; and the step here that unpacks it.

On the GPU machine (the body of one call; `datasets/` carried, see docs/gpus.md):

    python scripts/gpu_session.py --deadline 540 --out "$OUT"

Here, on what came back:

    python scripts/gpu_session.py --unpack /path/to/returned/files      # -> reproduction/, bench/results/

What a call does, in order:
1. Once per machine (a marker in --work): the CUDA-vs-CPU LSTM check (if cuDNN fails it, the LSTM
   runs pass --cudnn off, recorded in config.json), bench/gpu_epochs.py alone on the GPU, then the
   CUDA tests in the background while the runs train; --checks tests keeps only the tests, --checks
   none none of them.
2. The queue (QUEUE, most valuable first): each run continues from its checkpoint in --work (a second
   call on the same machine goes on where the first stopped), else from the packed checkpoint an earlier
   session left in reproduction/<benchmark>/<run>/checkpoint.pt.gz, else starts. --parallel runs share
   the GPU; a finished run frees its slot for the next.
3. Before the deadline each run is stopped at an epoch end: a run whose current epoch cannot end in time
   (judged by its last epoch's length) is stopped at once, the others when their epoch ends or at the
   last moment. Nothing but the unfinished epoch is lost (checkpoints are taken at epoch ends).
4. Packing, under --out, at most 8 files of at most 16 MiB: runs.tar.gz (every run's config.json,
   metrics.csv and log, and session.json: what ran, on which device, epoch times), tests.log,
   gpu-epochs.json, and the checkpoints of unfinished runs, most valuable first, as long as they fit
   (ckpt-<benchmark>--<run>.pt.gz; what a new epoch resets, CD-GraB's running sum, is zeroed so that
   it compresses away).
5. Here, --unpack puts each run that came back in place of the shipped one, except an unfinished run
   that restarted (a GPT-2 run: its checkpoint cannot travel) and reached fewer epochs than the
   shipped one: the longer record stays.

--device cpu --tiny runs the same path on tiny slices (the dry run in tests/test_gpu_session.py).
"""
import argparse
import csv
import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * MIB, 64 * MIB  # what the device tool brings back

# benchmark -> entry script, the paper's settings (as scripts/sweep-<benchmark>.sh runs them), the run
# name's pattern (the sweep's), and the tiny slice of the dry run
BENCHMARKS = {
    "LSTM-Wiki2": {
        "script": "main-LSTM-Wiki2.py",
        "args": ["--lr", "5.0", "--node_cnt", "4", "--B", "16", "--carry-hidden"],
        "epochs": 50,
        "name": "{sorter}-node4-B16-lr5-carry-hidden-seed{seed}",
        "tiny": ["--node_cnt", "2", "--B", "4", "--bptt", "8", "--max-train-examples", "8",
                 "--max-eval-examples", "2"],
    },
    "GPT2-Wiki103": {  # the notebook's 30 epochs; WikiText-2 train stands in for WikiText-103 train
        "script": "main-GPT2-Wiki103.py",
        "args": ["--lr", "5e-4", "--node_cnt", "64", "--B", "64", "--train-file", "{data}/wikitext-2/train.txt"],
        "epochs": 30,
        "name": "{sorter}-node64-B64-lr0.0005-seed{seed}",
        "tiny": ["--node_cnt", "2", "--B", "2", "--max-seq-length", "16", "--max-train-examples", "8",
                 "--max-eval-examples", "2", "--train-file", "{data}/wikitext-103/wiki.valid.tokens"],
    },
}
# most valuable first: CD-GraB and D-RR at seed 0, the LSTM's Fold, then seeds 1 and 2. GPT-2 leads each
# seed: its checkpoints (parameters and AdamW's two moments) are too large to travel between sessions,
# so a GPT-2 run must finish on the machine it started on, while the LSTM's go on from session to session.
QUEUE = [(benchmark, sorter, seed) for seed in (0, 1, 2)
         for benchmark, sorter in (("GPT2-Wiki103", "CD-GraB"), ("GPT2-Wiki103", "D-RR"), ("LSTM-Wiki2", "CD-GraB"),
                                   ("LSTM-Wiki2", "D-RR"), ("LSTM-Wiki2", "Fold"))]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_host_sync.py", "tests/test_overlap_cuda.py"]
LSTM_CHECK = ["tests/test_cuda.py::test_gradients_and_evaluation_agree_with_the_cpu[LSTM-Wiki2]"]  # cuDNN, the runs' units
TINY_EPOCHS = 6


def log(message: str) -> None:
    print(f"[gpu_session {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def select_queue(only) -> list:
    """The QUEUE entries that --only names, in QUEUE's order (most valuable first). Each entry of `only` is
    BENCHMARK, BENCHMARK/SORTER or BENCHMARK/SORTER/SEED; one that names no queued run is refused, since
    a typo would otherwise spend a call of device time on nothing."""
    if not only:
        return list(QUEUE)
    keys = [(b, s, str(seed)) for b, s, seed in QUEUE]
    wanted = [tuple(entry.split("/")) for entry in only]  # a prefix of a key; 4 parts match none
    for entry, parts in zip(only, wanted):
        if not any(key[:len(parts)] == parts for key in keys):
            runs = sorted({f"{b}/{s}" for b, s, _ in QUEUE})
            fail(f"--only {entry!r} names no queued run: give BENCHMARK[/SORTER[/SEED]], one of "
                 f"{', '.join(runs)}, seeds {QUEUE[0][2]}-{QUEUE[-1][2]}")
    return [q for q, key in zip(QUEUE, keys) if any(key[:len(parts)] == parts for parts in wanted)]


def run_name(benchmark: str, sorter: str, seed: int) -> str:
    return BENCHMARKS[benchmark]["name"].format(sorter=sorter, seed=seed)


def packed_checkpoint_name(benchmark: str, name: str) -> str:
    return f"ckpt-{benchmark}--{name}.pt.gz"


# ---------------------------------------------------------------------------------------------- runs
class Run:
    """One queued run: its directory on this machine, its process, and when its epochs ended."""

    def __init__(self, benchmark, sorter, seed, work: Path, args):
        self.benchmark, self.sorter, self.seed = benchmark, sorter, seed
        self.name = run_name(benchmark, sorter, seed)
        self.dir = work / "runs" / benchmark / self.name
        spec = BENCHMARKS[benchmark]
        self.epochs = args.epochs or (TINY_EPOCHS if args.tiny else spec["epochs"])
        self.process = None
        self.stopping = False
        self.failed = None
        self.epoch_ends = []   # time.monotonic() of each epoch end seen in this call
        self.epochs_at_start = 0

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.name}"

    def epochs_done(self) -> int:
        try:
            lines = (self.dir / "metrics.csv").read_text().splitlines()
        except OSError:
            return 0
        return max(0, len([line for line in lines[1:] if line.strip()]))

    def finished(self) -> bool:
        return self.epochs_done() >= self.epochs

    def command(self, args, cudnn: str) -> list[str]:
        spec = BENCHMARKS[self.benchmark]
        fill = lambda a: a.replace("{data}", args.data_dir)
        argv = [sys.executable, str(ROOT / spec["script"]), "--sorter", self.sorter, "--seed", str(self.seed),
                *map(fill, spec["args"]), "--epochs", str(self.epochs), "--device", args.device,
                "--data-dir", args.data_dir, "--out", str(self.dir), "--resume", "--progress", "off"]
        if args.tiny:
            argv += list(map(fill, spec["tiny"]))
        if self.benchmark == "LSTM-Wiki2" and cudnn == "off":
            argv += ["--cudnn", "off"]
        return argv

    def start(self, args, cudnn: str, threads: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # the engine stops cleanly at the end of the epoch this file names (empty: the current one)
        self.stop_file.unlink(missing_ok=True)
        if args.stop_after_epochs:
            self.stop_file.write_text(f"{self.epochs_done() + args.stop_after_epochs}\n")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
               "CDGRAB_STOP_FILE": str(self.stop_file)}
        env.setdefault("CDGRAB_CACHE", str(Path(args.work) / "cache"))
        logfile = open(self.dir / "log.txt", "a")
        logfile.write(f"\n# gpu_session {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command(args, cudnn))}\n")
        logfile.flush()
        self.epochs_at_start = self.epochs_done()
        self.epoch_ends = [time.monotonic()]
        self.process = subprocess.Popen(self.command(args, cudnn), cwd=ROOT, env=env, stdout=logfile,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        logfile.close()

    def poll_epochs(self) -> None:
        """Note the time of every epoch end since the last poll."""
        done = self.epochs_done() - self.epochs_at_start
        while len(self.epoch_ends) - 1 < done:
            self.epoch_ends.append(time.monotonic())

    def epoch_seconds(self):
        """The last epoch's length in this call (the first one includes start-up); None before one ended."""
        return self.epoch_ends[-1] - self.epoch_ends[-2] if len(self.epoch_ends) >= 2 else None

    @property
    def stop_file(self) -> Path:
        return self.dir / "stop-after-epoch"

    def stop_after_this_epoch(self) -> None:
        if not self.stop_file.exists():
            self.stop_file.write_text("")

    def stop(self) -> None:
        if self.process and self.process.poll() is None and not self.stopping:
            self.stopping = True
            os.killpg(self.process.pid, signal.SIGINT)  # KeyboardInterrupt: the last epoch-end checkpoint stays

    def wait_stopped(self, seconds: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def stop_decision(epoch_ends: list[float], now: float, stop_at: float) -> str | None:
    """How to stop a run: "now" at stop_at, or when its current epoch, as long as its last one, would end
    after stop_at (lost either way; its GPU share helps the others); "after this epoch" when the next
    one would; else None. epoch_ends: the run's start in this call and the times its epochs ended since
    (monotonic seconds)."""
    if now >= stop_at:
        return "now"
    if len(epoch_ends) < 2:
        return None  # no epoch ended yet in this call: no estimate
    last = epoch_ends[-1] - epoch_ends[-2]
    if epoch_ends[-1] + last > stop_at:
        return "now"
    return "after this epoch" if epoch_ends[-1] + 2 * last > stop_at else None


def metrics_rows(path: Path) -> int:
    """Epochs a metrics.csv holds (0 when there is none)."""
    if not path.exists():
        return 0
    return len([line for line in path.read_text().splitlines()[1:] if line.strip()])


def seed_from_shipped(run: Run, shipped: Path) -> str:
    """Put the packed checkpoint an earlier session shipped (reproduction/<benchmark>/<run>/) into the
    run's directory unless this machine's own is as far or further; returns what was done."""
    source = shipped / run.benchmark / run.name
    packed = source / "checkpoint.pt.gz"
    try:
        shipped_epochs = metrics_rows(source / "metrics.csv")
        shipped_target = json.loads((source / "config.json").read_text())["args"]["epochs"]
    except (OSError, ValueError, KeyError):
        return "nothing shipped"
    if shipped_target == run.epochs and shipped_epochs >= run.epochs:  # finished in an earlier session
        run.dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "metrics.csv"):
            shutil.copy(source / name, run.dir / name)
        return "finished earlier"
    if not packed.exists():
        return "no shipped checkpoint"
    if shipped_target != run.epochs:
        return f"shipped checkpoint not used: its run asks for {shipped_target} epochs, this one for {run.epochs}"
    if (run.dir / "checkpoint.pt").exists() and run.epochs_done() >= shipped_epochs:
        return f"this machine's checkpoint (epoch {run.epochs_done()})"
    run.dir.mkdir(parents=True, exist_ok=True)
    with gzip.open(packed, "rb") as f, open(run.dir / "checkpoint.pt.tmp", "wb") as out:
        shutil.copyfileobj(f, out)
    os.replace(run.dir / "checkpoint.pt.tmp", run.dir / "checkpoint.pt")
    for name in ("config.json", "metrics.csv"):
        shutil.copy(source / name, run.dir / name)
    return f"shipped checkpoint (epoch {shipped_epochs})"


def epoch_column(run: Run, column: str) -> list[float]:
    try:
        with open(run.dir / "metrics.csv") as f:
            return [float(row[column]) for row in csv.DictReader(f)]
    except (OSError, KeyError, ValueError):
        return []


def median(values):
    return sorted(values)[len(values) // 2] if values else None


# ---------------------------------------------------------------------------------------------- checks
def run_logged(argv, logpath: Path, timeout: float, env=None) -> int | None:
    """Run argv with its output appended to logpath; the exit status, or None when it ran out of time."""
    with open(logpath, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        process = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
        try:
            return process.wait(max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            f.write(f"\n[gpu_session] stopped after {timeout:.0f} s\n")
            return None


# in one process, beside the training runs: pytest.ini's addopts (-n auto, pytest-xdist) replaced, since the
# box has no pytest-xdist and its test processes would compete with the runs for the cores
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]


def checks_env(args) -> dict:
    return {**os.environ, "CDGRAB_DATA": str(Path(args.data_dir).resolve()), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}


def lstm_cudnn_check(args, work: Path, budget: float) -> str:
    """'on' when the CUDA-vs-CPU LSTM check passes with cuDNN (or is skipped: no GPU), else 'off'."""
    status = run_logged([*PYTEST, *LSTM_CHECK],
                        work / "tests.log", budget, checks_env(args))
    return "off" if status not in (0, 5, None) else "on"  # 5: nothing collected; None: out of time, undecided


def run_bench(args, work: Path, budget: float) -> int | None:
    argv = [sys.executable, str(ROOT / "bench" / "gpu_epochs.py"), "--data-dir", args.data_dir,
            "--json", str(work / "gpu-epochs.json")]
    if args.tiny:
        argv += ["--device", "cpu", "--benchmarks", "LR-HMDA", "--steps", "2"]
    return run_logged(argv, work / "bench.log", budget, checks_env(args))


def start_tests(args, work: Path):
    tests = args.tests if args.tests is not None else CUDA_TESTS
    if not tests:
        return None
    f = open(work / "tests.log", "a")
    argv = [*PYTEST, "-rfEs", *tests]
    f.write(f"$ {' '.join(argv)}\n")
    f.flush()
    process = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                               env=checks_env(args))
    f.close()
    return process


# ---------------------------------------------------------------------------------------------- packing
def slim_checkpoint(path: Path) -> bytes:
    """checkpoint.pt, gzipped, with what the next epoch resets zeroed: taken at an epoch end, the
    balancers' running sums are replaced by zeros at the next epoch's start (sorters.base.PairBalancer),
    so zeros resume the same run and compress to almost nothing."""
    import torch
    state = torch.load(path, map_location="cpu", weights_only=False)
    sorter = state.get("sorter") or {}
    for key in ("running_sum", "running_sums"):
        if torch.is_tensor(sorter.get(key)) and sorter.get("pending") is None:
            sorter[key] = torch.zeros_like(sorter[key])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return gzip.compress(buffer.getvalue(), compresslevel=6)


def pack(runs, work: Path, out: Path, manifest: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    others = [p for p in out.iterdir() if p.name not in ("tests.log", "gpu-epochs.json", "runs.tar.gz")
              and not p.name.startswith("ckpt-")]  # what the caller wrote there takes slots too
    max_files = MAX_FILES - len(others)
    files = []
    for name in ("tests.log", "gpu-epochs.json"):
        if (work / name).exists() and (work / name).stat().st_size <= MAX_FILE_BYTES:
            shutil.copy(work / name, out / name)
            files.append(name)
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for run in runs:
            for name in ("config.json", "metrics.csv", "log.txt"):
                if (run.dir / name).exists():
                    tar.add(run.dir / name, arcname=f"{run.benchmark}/{run.name}/{name}")
        for name in ("bench.log",):
            if (work / name).exists():
                tar.add(work / name, arcname=name)
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo("session.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    (out / "runs.tar.gz").write_bytes(archive.getvalue())
    files.append("runs.tar.gz")
    total = sum((out / name).stat().st_size for name in files) + sum(p.stat().st_size for p in others if p.is_file())
    for run in runs:  # most valuable first
        if run.finished() or not (run.dir / "checkpoint.pt").exists():
            continue
        entry = manifest["runs"][run.key]
        if len(files) >= max_files:
            entry["checkpoint"] = "left on this machine: no file slot left"
            continue
        data = slim_checkpoint(run.dir / "checkpoint.pt")
        if len(data) > MAX_FILE_BYTES or total + len(data) > MAX_TOTAL_BYTES - MIB:
            entry["checkpoint"] = f"left on this machine: {len(data) / MIB:.1f} MiB packed does not fit"
            continue
        name = packed_checkpoint_name(run.benchmark, run.name)
        (out / name).write_bytes(data)
        files.append(name)
        total += len(data)
        entry["checkpoint"] = f"{name} ({len(data) / MIB:.1f} MiB)"
    # the manifest again, now with where each checkpoint went
    rewrite_manifest(out / "runs.tar.gz", manifest)
    log(f"packed {len(files)} files, {total / MIB:.1f} MiB: {', '.join(files)}")


def rewrite_manifest(archive_path: Path, manifest: dict) -> None:
    with tarfile.open(archive_path, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.name != "session.json"]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo("session.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    archive_path.write_bytes(buffer.getvalue())


# ---------------------------------------------------------------------------------------------- session
def device_description(device: str) -> str:
    if device != "cuda":
        return "cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "cuda"


def source_tree() -> str | None:
    """The git tree hash of the working tree as it is (tracked and unignored files): the device
    machine's .git can be older than the tree that travelled, so --unpack finds the commit by this."""
    index = Path("/tmp") / f"gpu_session-index-{os.getpid()}"
    env = {**os.environ, "GIT_INDEX_FILE": str(index)}
    try:
        add = subprocess.run(["git", "add", "-A"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        tree = subprocess.run(["git", "write-tree"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        index.unlink(missing_ok=True)
    return tree.stdout.strip() if add.returncode == 0 and tree.returncode == 0 else None


def commit_of_tree(tree: str | None) -> str | None:
    """The newest commit here whose tree is `tree` (None when none is)."""
    if not tree:
        return None
    out = subprocess.run(["git", "log", "--all", "--format=%H %T"], cwd=ROOT, capture_output=True, text=True)
    return next((line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == [tree]), None)


DATA_FOLDERS = ("wikitext-2", "wikitext-103", "gpt2-tokenizer", "hmda", "m4")  # the runs', the tests' and the bench's


def pack_data(source: Path, archive: Path) -> None:
    """Here: the data sets the session needs, as one gzipped tar (a third of their size), to carry."""
    missing = [name for name in DATA_FOLDERS if not (source / name).is_dir()]
    if missing:
        fail(f"{source} lacks {', '.join(missing)}: pass the data folder (scripts/download_data.sh fills one)")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name in DATA_FOLDERS:
            tar.add(source / name, arcname=name)
    print(f"{archive}: {archive.stat().st_size / MIB:.1f} MiB; carry {archive.parent.name} and pass "
          f"--data-archive {archive.relative_to(ROOT) if archive.is_relative_to(ROOT) else archive}")


def unpack_data(archive: Path, data_dir: Path) -> None:
    """On the machine: the carried archive into --data-dir, unless it holds the data already."""
    if all((data_dir / name).is_dir() for name in DATA_FOLDERS):
        return
    if not archive.exists():
        fail(f"no {archive}: make it here with --pack-data DATA and carry its folder")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(data_dir, filter="data")
    log(f"data sets unpacked from {archive} into {data_dir}")


def check_inputs(args) -> None:
    data = Path(args.data_dir)
    needed = ["wikitext-2/train.txt", "wikitext-2/valid.txt", "wikitext-2/test.txt", "wikitext-103/wiki.valid.tokens",
              "gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt"]
    missing = [name for name in needed if not (data / name).exists()]
    if missing:
        fail(f"{data} lacks {', '.join(missing)}: copy the data sets there (carry that folder on the device "
             f"machine) or pass --data-dir")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            fail("no CUDA device is visible: run this on the GPU machine, or pass --device cpu (with --tiny)")


def session(args, queue: list) -> None:
    started = time.monotonic()
    stop_at = started + args.deadline - args.pack_seconds
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    if args.data_archive:
        unpack_data(Path(args.data_archive), Path(args.data_dir))
    check_inputs(args)
    runs = [Run(*q, work, args) for q in queue]
    manifest = {"tree": source_tree(), "device": device_description(args.device), "tiny": args.tiny,
                "parallel": args.parallel, "queue": [f"{r.key}" for r in runs], "deadline_s": args.deadline, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "runs": {}}

    marker = work / "checks.json"
    tests = None
    if args.checks == "none":
        checks = {"lstm_cudnn": "on", "skipped": True}
    elif marker.exists():
        checks = json.loads(marker.read_text())
        log(f"checks done on this machine earlier: {checks}")
    elif args.checks == "tests":  # the CUDA tests beside the runs; no LSTM check (cuDNN on), no bench
        checks = {"lstm_cudnn": "on", "bench": "skipped"}
        marker.write_text(json.dumps(checks))
        tests = start_tests(args, work)
    else:
        cudnn = lstm_cudnn_check(args, work, min(120.0, 0.2 * args.deadline))
        log(f"LSTM CUDA-vs-CPU check with cuDNN: {'passed' if cudnn == 'on' else 'FAILED: the LSTM runs use --cudnn off'}")
        status = run_bench(args, work, min(args.bench_seconds, 0.4 * args.deadline))
        log(f"bench/gpu_epochs.py: {'done' if status == 0 else 'exit ' + str(status)}")
        checks = {"lstm_cudnn": cudnn, "bench_exit": status}
        marker.write_text(json.dumps(checks))
        tests = start_tests(args, work)
    manifest["checks"] = checks

    shipped = args.shipped or (None if args.tiny else ROOT / "reproduction")
    for run in runs:
        manifest["runs"][run.key] = {"from": seed_from_shipped(run, Path(shipped)) if shipped else "nothing shipped"}

    pending = [run for run in runs if not run.finished()]
    active, last_line = [], 0.0
    threads = max(1, (os.cpu_count() or 1) // max(1, args.parallel))
    while True:
        now = time.monotonic()
        for run in list(active):
            run.poll_epochs()
            if run.process.poll() is not None:
                active.remove(run)
                if run.process.returncode != 0 and not run.stopping:
                    run.failed = f"exit {run.process.returncode}"
                    log(f"{run.key} failed ({run.failed}); see its log.txt")
                continue
            decision = stop_decision(run.epoch_ends, now, stop_at)
            if decision == "now":
                run.stop()
            elif decision == "after this epoch":
                run.stop_after_this_epoch()
        while pending and len(active) < args.parallel and stop_at - now > args.min_start_seconds:
            run = pending.pop(0)
            if run.finished():
                continue
            run.start(args, checks["lstm_cudnn"], threads)
            active.append(run)
            log(f"started {run.key} at epoch {run.epochs_done()}/{run.epochs}")
        if not active and (not pending or stop_at - now <= args.min_start_seconds):
            break
        if now - last_line >= args.progress_every:
            last_line = now
            status = ", ".join(f"{r.benchmark}/{r.sorter}/s{r.seed} {r.epochs_done()}/{r.epochs}" for r in active)
            log(f"{(stop_at - now) / 60:.1f} min left; {len(active)} running: {status}; "
                f"{sum(r.finished() for r in runs)}/{len(runs)} finished")
        time.sleep(args.poll)
    for run in active:
        run.wait_stopped(10)

    if tests is not None:
        budget = max(1.0, started + args.deadline - 10 - time.monotonic())
        try:
            tests.wait(min(budget, args.pack_seconds / 2))
        except subprocess.TimeoutExpired:
            os.killpg(tests.pid, signal.SIGKILL)
            tests.wait()
            with open(work / "tests.log", "a") as f:
                f.write("\n[gpu_session] the CUDA tests ran out of time\n")
        manifest["tests_exit"] = tests.returncode
    for run in runs:
        seconds = [b - a for a, b in zip(run.epoch_ends[1:], run.epoch_ends[2:])]  # the first includes start-up
        train_seconds = epoch_column(run, "epoch_seconds")[run.epochs_at_start:]
        manifest["runs"][run.key].update({
            "median_train_seconds_this_call": median(train_seconds),
            "epochs_done": run.epochs_done(), "epochs": run.epochs, "finished": run.finished(),
            "failed": run.failed, "epochs_this_call": max(0, len(run.epoch_ends) - 1),
            "median_wall_seconds_per_epoch_this_call": median(seconds)})
    manifest["wall_seconds"] = round(time.monotonic() - started, 1)
    pack(runs, work, out, manifest)
    done = sum(r.finished() for r in runs)
    log(f"{done}/{len(runs)} runs finished; {time.monotonic() - started:.0f} s of the {args.deadline:.0f} s deadline")


# ---------------------------------------------------------------------------------------------- unpack
def unpack(source: Path, into: Path, bench_json: Path, sessions: Path) -> None:
    """Runs -> into/<benchmark>/<run>/ (config.json, metrics.csv; the packed checkpoint while
    unfinished, none once finished); gpu-epochs.json -> bench_json; session.json and tests.log ->
    sessions/<started>/."""
    archive = source / "runs.tar.gz"
    if not archive.exists():
        fail(f"{source} holds no runs.tar.gz: pass the folder the device call's files came back in")
    with tarfile.open(archive, "r:gz") as tar:
        manifest = json.loads(tar.extractfile("session.json").read())
        if manifest["tiny"] and into.resolve() == (ROOT / "reproduction").resolve():
            fail("these are a --tiny dry run's runs: unpack them with --into somewhere other than reproduction/")
        for key, entry in manifest["runs"].items():
            benchmark, name = key.split("/")
            names = {m.name for m in tar.getmembers()}
            if f"{key}/metrics.csv" not in names:
                continue  # never started
            target = into / benchmark / name
            shipped = metrics_rows(target / "metrics.csv")
            if not entry["finished"] and entry["epochs_done"] < shipped:
                # a run that restarted (its checkpoint could not travel) and stopped short of the shipped one
                print(f"{target}: kept as shipped ({shipped} epochs); this call's run restarted and reached "
                      f"{entry['epochs_done']}")
                continue
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            for file in ("config.json", "metrics.csv"):
                (target / file).write_bytes(tar.extractfile(f"{key}/{file}").read())
            packed = source / packed_checkpoint_name(benchmark, name)
            if not entry["finished"] and packed.exists():
                shutil.copy(packed, target / "checkpoint.pt.gz")
            state = "finished" if entry["finished"] else f"epoch {entry['epochs_done']}/{entry['epochs']}"
            print(f"{target}: {state}{', checkpoint kept' if (target / 'checkpoint.pt.gz').exists() else ''}")
        manifest["commit"] = commit_of_tree(manifest.get("tree"))
        stamp = manifest["started"].replace(" ", "T").replace(":", "")
        session_dir = sessions / stamp
        session_dir.mkdir(parents=True, exist_ok=True)
        (session_dir / "session.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if (source / "tests.log").exists():
        shutil.copy(source / "tests.log", session_dir / "tests.log")
    if (source / "gpu-epochs.json").exists():
        report = json.loads((source / "gpu-epochs.json").read_text())
        if manifest["commit"]:  # the machine's git saw an older HEAD: name the commit the tree is
            report.update(git_commit=manifest["commit"], git_clean=True,
                          git_note="the device machine's .git was older than the tree that travelled; "
                                   "this commit's tree equals that tree (scripts/gpu_session.py source_tree)")
        bench_json.parent.mkdir(parents=True, exist_ok=True)
        bench_json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"{bench_json}: from {manifest['commit'] or 'a tree no commit here has'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deadline", type=float, default=540,
                        help="seconds from start by which everything, packing included, is done (default 540)")
    parser.add_argument("--out", help="where the packed files go (the device call's $OUT)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda")
    parser.add_argument("--tiny", action="store_true", help=f"tiny slices, {TINY_EPOCHS} epochs (the dry run)")
    parser.add_argument("--epochs", type=int, help="override every run's epoch count")
    parser.add_argument("--data-dir", default=os.environ.get("CDGRAB_DATA", "datasets"),
                        help="data folder, relative to the repository as it travels (default $CDGRAB_DATA, "
                             "else datasets)")
    parser.add_argument("--data-archive", metavar="TAR_GZ",
                        help="on the machine: unpack this carried archive (--pack-data) into --data-dir first")
    parser.add_argument("--pack-data", metavar="DATA",
                        help="here: pack DATA's data sets into gpu-data/datasets.tar.gz to carry, and exit")
    parser.add_argument("--work", default="/tmp/cdgrab-gpu-session",
                        help="this machine's run directories and check marker (default /tmp/cdgrab-gpu-session)")
    parser.add_argument("--shipped", help="where earlier sessions' runs and packed checkpoints wait (default "
                                           "reproduction/; with --tiny none)")
    parser.add_argument("--parallel", type=int, default=4,
                        help="runs side by side on the GPU (default 4: GPT-2 slowed 4x beside five others)")
    parser.add_argument("--only", nargs="+", metavar="BENCHMARK[/SORTER[/SEED]]",
                        help="run only these queue entries, e.g. GPT2-Wiki103, LSTM-Wiki2/CD-GraB (every "
                             "seed) or LSTM-Wiki2/CD-GraB/0; the queue's order stays")
    parser.add_argument("--tests", nargs="*", help=f"test files for the first call (default: {' '.join(CUDA_TESTS)})")
    parser.add_argument("--checks", choices=("all", "tests", "none"), default="all",
                        help="what the first call on a machine checks: all (the LSTM cuDNN check and the bench "
                             "before the runs, the CUDA tests beside them; the default), tests (only the CUDA "
                             "tests, beside the runs; cuDNN on), none (straight to the queue; cuDNN on)")
    parser.add_argument("--bench-seconds", type=float, default=150, help="time limit of the bench (default 150)")
    parser.add_argument("--pack-seconds", type=float, default=40,
                        help="seconds kept at the end for stopping and packing (default 40)")
    parser.add_argument("--min-start-seconds", type=float, default=60,
                        help="no run starts with less time than this left (default 60)")
    parser.add_argument("--progress-every", type=float, default=60, help="seconds between progress lines")
    parser.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--stop-after-epochs", type=int, default=0,
                        help="stop each run cleanly after this many epochs in this call (the dry run's "
                             "deterministic stop; default 0: only the deadline)")
    parser.add_argument("--unpack", metavar="DIR", help="here: unpack the files a device call brought back")
    parser.add_argument("--into", default=str(ROOT / "reproduction"), help="with --unpack: runs go here")
    parser.add_argument("--bench-json", default=str(ROOT / "bench" / "results" / "gpu-epochs.json"),
                        help="with --unpack: where gpu-epochs.json goes")
    parser.add_argument("--sessions", default=str(ROOT / "reproduction" / "gpu-sessions"),
                        help="with --unpack: where each session's session.json and tests.log go")
    args = parser.parse_args()
    if args.pack_data:
        pack_data(Path(args.pack_data), ROOT / "gpu-data" / "datasets.tar.gz")
        return
    if args.unpack:
        unpack(Path(args.unpack), Path(args.into), Path(args.bench_json), Path(args.sessions))
        return
    if not args.out:
        fail("pass --out DIR (on the device machine: --out \"$OUT\")")
    if args.parallel < 1 or args.deadline <= args.pack_seconds:
        fail("--parallel must be >= 1 and --deadline larger than --pack-seconds")
    session(args, select_queue(args.only))  # a typo in --only is refused before anything is unpacked


if __name__ == "__main__":
    main()
