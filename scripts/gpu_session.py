#!/usr/bin/env python
"""One lent GPU session's device call, whole: CUDA checks, then the GPU reproduction queue, every run
stopped cleanly before a deadline and packed for the trip back; and the step here that unpacks it.

On the GPU machine (the body of one call; `datasets/` carried, see docs/gpus.md):

    python scripts/gpu_session.py --deadline 540 --out "$OUT"

Here, on what came back:

    python scripts/gpu_session.py --unpack /path/to/returned/files      # -> reproduction/, bench/results/

What a call does, in order:
1. Once per machine (a marker in --work): the CUDA-vs-CPU LSTM check (if cuDNN fails it, the LSTM
   runs pass --cudnn off, recorded in config.json), bench/gpu_epochs.py alone on the GPU, then
   bench/gpu_profile.py (a torch.profiler summary per benchmark and sorter), then the CUDA tests in
   the background while the runs train; --checks tests keeps the profile and the tests, --checks none
   none of them.
2. The queue (QUEUE, most valuable first), planned from measured epoch times (epoch_estimates: the
   shipped sessions', else the bench's, else a conservative fallback): a run starts only when it can
   finish before the stop, or, if its checkpoint can travel (LSTM), when one epoch can end. Each run
   continues from its checkpoint in --work (a second call on the same machine goes on where the first
   stopped), else from the packed checkpoint an earlier session left in
   reproduction/<benchmark>/<run>/checkpoint.pt.gz, else starts. --parallel runs share the GPU.
3. Before the deadline each run is stopped at an epoch end: a run whose current epoch cannot end in time
   (judged by its last epoch's length) is stopped at once, the others when their epoch ends or at the
   last moment; a run still alive --grace seconds after its stop signal is killed, and the kit goes
   on. SIGTERM to the kit stops the runs the same way, packs and exits.
4. Packing (Packer), under --out, at every epoch end (at most every --pack-every seconds) and at the
   end, so a call cut at its limit returns every finished epoch: at most 8 files of at most 16 MiB,
   runs.tar.gz (every run's config.json, metrics.csv and log, the bench's log, the profile, and
   session.json: what ran, on which device, the code tree hash, epoch times), tests.log,
   gpu-epochs.json, and one checkpoint per unfinished run whose checkpoint can travel, most valuable
   first, as long as they fit (ckpt-<benchmark>--<run>.pt.gz; CD-GraB's running sum, which a new epoch
   resets, zeroed so that it compresses away); gzipped once per epoch, never for a state it drops.
5. Here, --unpack (unpack_decision) replaces a shipped checkpoint only by a newer one of the same run,
   removes it only when the run finished, never changes a finished shipped run (unless
   --replace-finished), keeps the longer record where neither side has a checkpoint, and keeps every
   run's record and log as it came back in reproduction/gpu-sessions/<started>/runs/.

--device cpu --tiny runs the same path on tiny slices (the dry run in tests/test_gpu_session.py).
"""
import argparse
import csv
import gzip
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # engine.runlog: the code's tree hash and the commit it is (imported where used)

from engine.rundir import metrics_rows  # noqa: E402  (no torch: the epochs a run's metrics.csv holds)

MIB = 1 << 20
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * MIB, 64 * MIB  # what the device tool brings back

# benchmark -> entry script, the paper's settings (as scripts/sweep-<benchmark>.sh runs them), the grid's
# setting beyond them (extra arguments of the sweep), the run name's pattern (the sweep's, with {tag} for a
# variant's tag) and the tiny slice of the dry run. The LSTM grid runs with --clip 0.25: the setting
# analysis.lstm_setting picks from the shipped runs (without clipping, seed 0's D-RR and CD-GraB runs part
# at epoch 1, whose order is the same for both); the unclipped runs shipped so far (the original's HEAD)
# keep their names, which this queue does not touch.
BENCHMARKS = {
    "LSTM-Wiki2": {
        "script": "main-LSTM-Wiki2.py",
        "args": ["--lr", "5.0", "--node_cnt", "4", "--B", "16", "--carry-hidden"],
        "setting": ["--clip", "0.25"],
        "epochs": 50,
        "name": "{sorter}-node4-B16-lr5-carry-hidden-clip0.25{tag}-seed{seed}",
        "checkpoint_travels": True,  # parameters and momentum: 8 MiB packed
        "tiny": ["--node_cnt", "2", "--B", "4", "--bptt", "8", "--max-train-examples", "8",
                 "--max-eval-examples", "2"],
    },
    "GPT2-Wiki103": {  # the notebook's 30 epochs; WikiText-2 train stands in for WikiText-103 train
        "script": "main-GPT2-Wiki103.py",
        "args": ["--lr", "5e-4", "--node_cnt", "64", "--B", "64", "--train-file", "{data}/wikitext-2/train.txt"],
        "setting": [],
        "epochs": 30,
        "name": "{sorter}-node64-B64-lr0.0005{tag}-seed{seed}",
        "checkpoint_travels": False,  # parameters and AdamW's two moments: 73 MiB packed
        "tiny": ["--node_cnt", "2", "--B", "2", "--max-seq-length", "16", "--max-train-examples", "8",
                 "--max-eval-examples", "2", "--train-file", "{data}/wikitext-103/wiki.valid.tokens"],
    },
}
# a queued sorter name -> (the --sorter it runs, its extra arguments, the tag they add to the run name, as
# the sweeps name it: scripts/run_tag.py); a plain sorter name runs that sorter as it is
VARIANTS = {"CD-GraB-sketch1024": ("CD-GraB", ["--sketch-dim", "1024"], "-sketch-dim1024")}
# most valuable first (issue #44, goals 7-8): seed 0's LSTM D-RR and CD-GraB, whose epoch 1 shows whether
# the grid's setting measures order, and its Fold (the Fold question); then GPT-2 seed 0; then seeds 1 and
# 2 alike; then GPT-2 with sketched CD-GraB (D 1024). A GPT-2 run must finish in the call it starts in (its
# checkpoint cannot travel), so the plan starts one only where it can (start_refusal); the LSTM runs go
# on from session to session.
SEED_RUNS = (("LSTM-Wiki2", "D-RR"), ("LSTM-Wiki2", "CD-GraB"), ("LSTM-Wiki2", "Fold"),
             ("GPT2-Wiki103", "CD-GraB"), ("GPT2-Wiki103", "D-RR"))
QUEUE = [(benchmark, sorter, seed) for seed in (0, 1, 2) for benchmark, sorter in SEED_RUNS] + \
        [("GPT2-Wiki103", "CD-GraB-sketch1024", 0)]
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


def variant(queued: str) -> tuple[str, list, str]:
    """A queued sorter name's (--sorter, extra arguments, run-name tag)."""
    return VARIANTS.get(queued, (queued, [], ""))


def run_name(benchmark: str, queued: str, seed: int) -> str:
    sorter, _, tag = variant(queued)
    return BENCHMARKS[benchmark]["name"].format(sorter=sorter, tag=tag, seed=seed)


def packed_checkpoint_name(benchmark: str, name: str) -> str:
    return f"ckpt-{benchmark}--{name}.pt.gz"


# ---------------------------------------------------------------------------------------------- runs
class Run:
    """One queued run: its directory on this machine, its process, and when its epochs ended."""

    def __init__(self, benchmark, queued, seed, work: Path, args):
        self.benchmark, self.queued, self.seed = benchmark, queued, seed
        self.sorter, self.extra, _ = variant(queued)  # the --sorter it runs (epoch times are that sorter's)
        self.name = run_name(benchmark, queued, seed)
        self.dir = work / "runs" / benchmark / self.name
        spec = BENCHMARKS[benchmark]
        self.epochs = args.epochs or (TINY_EPOCHS if args.tiny else spec["epochs"])
        self.process = None
        self.stopping = False
        self.stop_sent = None  # time.monotonic() of the stop signal
        self.failed = None
        self.epoch_ends = []   # time.monotonic() of each epoch end seen in this call
        self.epochs_at_start = 0

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.name}"

    def epochs_done(self) -> int:
        return metrics_rows(self.dir / "metrics.csv")

    def finished(self) -> bool:
        return self.epochs_done() >= self.epochs

    def command(self, args, cudnn: str) -> list[str]:
        spec = BENCHMARKS[self.benchmark]
        fill = lambda a: a.replace("{data}", args.data_dir)
        argv = [sys.executable, str(ROOT / spec["script"]), "--sorter", self.sorter, "--seed", str(self.seed),
                *map(fill, spec["args"]), *spec["setting"], *self.extra, "--epochs", str(self.epochs), "--device", args.device,
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

    def stop(self, now: float) -> None:
        if self.process and self.process.poll() is None and self.stop_sent is None:
            self.stopping, self.stop_sent = True, now
            os.killpg(self.process.pid, signal.SIGINT)  # KeyboardInterrupt: the last epoch-end checkpoint stays

    def kill_if_overdue(self, now: float, grace: float) -> bool:
        """SIGKILL a run still alive `grace` seconds after its stop signal (a run that ignores it would hold
        its GPU share and the kit's end); its last epoch-end checkpoint stays. True when killed."""
        if self.stop_sent is None or now - self.stop_sent < grace or self.process.poll() is not None:
            return False
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.failed = f"killed: still running {grace:.0f} s after its stop signal"
        log(f"{self.key} {self.failed}")
        return True


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
def run_logged(argv, logpath: Path, timeout: float, env=None, stop=None) -> int | None:
    """Run argv with its output appended to logpath; the exit status, or None when it ran out of time
    (or the kit was asked to stop: `stop`)."""
    with open(logpath, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        process = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
        end = time.monotonic() + max(1.0, timeout)
        while process.poll() is None and time.monotonic() < end and not (stop and stop.asked):
            time.sleep(0.2)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            f.write(f"\n[gpu_session] stopped after {timeout:.0f} s or by a stop signal\n")
            return None
        return process.returncode


# in one process, beside the training runs: pytest.ini's addopts (-n auto, pytest-xdist) replaced, since the
# box has no pytest-xdist and its test processes would compete with the runs for the cores
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]


def checks_env(args) -> dict:
    return {**os.environ, "CDGRAB_DATA": str(Path(args.data_dir).resolve()), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}


def lstm_cudnn_check(args, work: Path, budget: float, stop=None) -> str:
    """'on' when the CUDA-vs-CPU LSTM check passes with cuDNN (or is skipped: no GPU), else 'off'."""
    status = run_logged([*PYTEST, *LSTM_CHECK], work / "tests.log", budget, checks_env(args), stop)
    return "off" if status not in (0, 5, None) else "on"  # 5: nothing collected; None: out of time, undecided


def run_bench(args, work: Path, budget: float, stop=None) -> int | None:
    argv = [sys.executable, str(ROOT / "bench" / "gpu_epochs.py"), "--data-dir", args.data_dir,
            "--json", str(work / "gpu-epochs.json")]
    if args.tiny:
        argv += ["--device", "cpu", "--benchmarks", "LR-HMDA", "--steps", "2"]
    return run_logged(argv, work / "bench.log", budget, checks_env(args), stop)


def run_profile(args, work: Path, budget: float, stop=None) -> int | None:
    """bench/gpu_profile.py: where a step's time goes on this machine, per benchmark and sorter."""
    argv = [sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--data-dir", args.data_dir,
            "--out", str(work / "gpu-profile.txt")]
    if args.tiny:  # the CPU's activity, on tiny slices
        argv += ["--device", "cpu", "--benchmarks", "LR-HMDA", "--steps", "2"]
    return run_logged(argv, work / "profile.log", budget, checks_env(args), stop)


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


def write_atomically(path: Path, data: bytes) -> None:
    """Into $OUT under a temporary name, then renamed: a call cut mid-write leaves the previous file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Packer:
    """Keeps $OUT what the device tool brings back at every moment of the call: pack() rewrites it from
    the runs' files (at each epoch end, at most every --pack-every seconds, and at the end), so a call
    cut at its limit returns every finished epoch. Within at most 8 files of at most 16 MiB: runs.tar.gz
    (every run's config.json, metrics.csv and log, bench.log, gpu-profile.txt, session.json), tests.log,
    gpu-epochs.json, and one checkpoint per unfinished run whose checkpoint can travel, most valuable
    first. A checkpoint is gzipped only when it changed and has a slot; one that cannot travel (a GPT-2
    run's) is never gzipped."""

    def __init__(self, work: Path, out: Path):
        self.work, self.out = work, out
        self.gzipped = {}  # run key -> (checkpoint.pt's mtime_ns, gzipped bytes)
        self.written = {}  # file name in $OUT -> the mtime_ns of the checkpoint.pt it packs
        self.last = None   # time.monotonic() of the last pack
        self.epochs = None  # the runs' epochs at the last pack

    def due(self, runs, now: float, every: float) -> bool:
        """An epoch ended (or a run exited) since the last pack, and the last one is `every` seconds old."""
        epochs = [(r.epochs_done(), r.process is not None and r.process.poll() is None) for r in runs]
        return epochs != self.epochs and (self.last is None or now - self.last >= every)

    def pack(self, runs, manifest: dict) -> None:
        out = self.out
        out.mkdir(parents=True, exist_ok=True)
        self.epochs = [(r.epochs_done(), r.process is not None and r.process.poll() is None) for r in runs]
        self.last = time.monotonic()
        others = [p for p in out.iterdir() if p.name not in ("tests.log", "gpu-epochs.json", "runs.tar.gz")
                  and not p.name.startswith(("ckpt-", "."))]  # what the caller wrote there takes slots too
        files = [name for name in ("tests.log", "gpu-epochs.json") if self.copy_small(name)]
        slots = MAX_FILES - len(others) - len(files) - 1  # runs.tar.gz
        room = MAX_TOTAL_BYTES - MIB - sum(p.stat().st_size for p in others if p.is_file()) - \
            sum((out / name).stat().st_size for name in files) - 2 * MIB  # runs.tar.gz's share, generously
        keep = self.pack_checkpoints(runs, manifest, slots, room)
        for stale in out.glob("ckpt-*"):  # a run that finished since, or lost its slot
            if stale.name not in keep:
                stale.unlink()
        write_atomically(out / "runs.tar.gz", self.archive(runs, manifest))
        log(f"packed {len(files) + 1 + len(keep)} files into {out}: {', '.join(files + ['runs.tar.gz'] + keep)}")

    def copy_small(self, name: str) -> bool:
        source = self.work / name
        if not source.exists() or source.stat().st_size > MAX_FILE_BYTES:
            return False
        write_atomically(self.out / name, source.read_bytes())
        return True

    def pack_checkpoints(self, runs, manifest: dict, slots: int, room: int) -> list[str]:
        """Writes the checkpoints that fit (most valuable first) and notes in the manifest where each went;
        returns their file names."""
        kept = []
        for run in runs:
            path = run.dir / "checkpoint.pt"
            if run.finished() or not path.exists():
                continue
            entry = manifest["runs"][run.key]
            if not BENCHMARKS[run.benchmark]["checkpoint_travels"]:
                entry["checkpoint"] = "left on this machine: it cannot travel (packed, larger than a file may be)"
                continue
            if len(kept) >= slots:
                entry["checkpoint"] = "left on this machine: no file slot left"
                continue
            data = self.gzip(run, path)
            if len(data) > MAX_FILE_BYTES or len(data) > room:
                entry["checkpoint"] = f"left on this machine: {len(data) / MIB:.1f} MiB packed does not fit"
                continue
            name = packed_checkpoint_name(run.benchmark, run.name)
            if self.written.get(name) != self.gzipped[run.key][0] or not (self.out / name).exists():
                write_atomically(self.out / name, data)
                self.written[name] = self.gzipped[run.key][0]
            kept.append(name)
            room -= len(data)
            entry["checkpoint"] = f"{name} ({len(data) / MIB:.1f} MiB, epoch {run.epochs_done()})"
        return kept

    def gzip(self, run, path: Path) -> bytes:
        """The run's packed checkpoint, made again only when checkpoint.pt changed."""
        stamp = path.stat().st_mtime_ns
        if run.key not in self.gzipped or self.gzipped[run.key][0] != stamp:
            self.gzipped[run.key] = (stamp, slim_checkpoint(path))
        return self.gzipped[run.key][1]

    def archive(self, runs, manifest: dict) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for run in runs:
                for name in ("config.json", "metrics.csv", "log.txt"):
                    if (run.dir / name).exists():
                        tar.add(run.dir / name, arcname=f"{run.benchmark}/{run.name}/{name}")
            for name in ("bench.log", "profile.log", "gpu-profile.txt"):
                if (self.work / name).exists():
                    tar.add(self.work / name, arcname=name)
            data = json.dumps(manifest, indent=1).encode()
            info = tarfile.TarInfo("session.json")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()


# ---------------------------------------------------------------------------------------------- planning
# Wall seconds an epoch where nothing measured says more: conservative (the slowest measured, rounded up:
# LSTM CD-GraB 64-68 s beside five other runs, GPT-2 60-61 s; docs/gpus.md), and seconds from a run's
# start to its first epoch's start (an assumption, not a measurement: session.json's
# first_epoch_wall_seconds measure it from now on)
FALLBACK_EPOCH_SECONDS = {"LSTM-Wiki2": 70.0, "GPT2-Wiki103": 65.0}
TINY_EPOCH_SECONDS = 5.0
START_SECONDS = 30.0
FALLBACK_EVAL_SECONDS = 8.0  # added to the bench's training seconds where it timed no evaluation


def epoch_estimates(sessions: Path, bench_json: Path, parallel: int) -> dict:
    """(benchmark, sorter) -> (wall seconds an epoch, where that comes from): the slowest median of the
    shipped sessions that ran as many runs side by side (session.json), else the bench's training seconds
    alone (gpu-epochs.json) plus its evaluation seconds (8 where it timed none), times `parallel` (the
    GPU shared by that many runs), else FALLBACK_EPOCH_SECONDS."""
    estimates = {}
    for path in sorted(sessions.glob("*/session.json")):
        manifest = json.loads(path.read_text())
        if manifest.get("tiny") or manifest.get("parallel") != parallel:
            continue
        for key, entry in manifest.get("runs", {}).items():
            seconds = entry.get("median_wall_seconds_per_epoch_this_call")
            benchmark, name = key.split("/")
            where = (benchmark, name.split("-node")[0])
            if seconds and seconds > estimates.get(where, (0,))[0]:
                estimates[where] = (seconds, f"{path.parent.name}/session.json")
    try:
        bench = json.loads(bench_json.read_text())["benchmarks"]
    except (OSError, ValueError, KeyError):
        bench = {}
    for benchmark in BENCHMARKS:
        for sorter in ("CD-GraB", "D-RR", "Fold"):
            if (benchmark, sorter) in estimates:
                continue
            times = bench.get(benchmark, {}).get("seconds_per_epoch", {})
            train = times.get(sorter, times.get("D-RR") if sorter == "Fold" else None)
            if train:
                evaluation = bench[benchmark].get("eval_seconds") or FALLBACK_EVAL_SECONDS
                estimates[(benchmark, sorter)] = ((train + evaluation) * parallel, f"{bench_json.name} x {parallel}")
            else:
                estimates[(benchmark, sorter)] = (FALLBACK_EPOCH_SECONDS[benchmark], "fallback")
    return estimates


def start_refusal(epochs_left: int, travels: bool, seconds_left: float, epoch_seconds: float) -> str | None:
    """Why a run should not start now (None: start it). A run whose checkpoint can travel starts when one
    epoch can end before the stop (its checkpoint goes on next session); one whose checkpoint cannot
    (GPT-2) only when all its epochs can, or its work would be lost with the machine."""
    if travels:
        need, what = START_SECONDS + epoch_seconds, "one epoch"
    else:
        need, what = START_SECONDS + epochs_left * epoch_seconds, f"its {epochs_left} epochs (its checkpoint cannot travel)"
    if need <= seconds_left:
        return None
    return f"not started: {what} need about {need:.0f} s ({epoch_seconds:.0f} s an epoch), {seconds_left:.0f} s were left"


# ---------------------------------------------------------------------------------------------- session
def device_description(device: str) -> str:
    if device != "cuda":
        return "cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "cuda"


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


class Stop:
    """SIGTERM (the device tool's end of a call) or SIGINT to the kit: the queue stops at once, the runs
    are stopped, and what they did is packed before the kit exits."""

    def __init__(self):
        self.asked = None

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame) -> None:
        if self.asked is None:
            self.asked = signal.Signals(signum).name
            log(f"{self.asked}: stopping the runs and packing")


def run_checks(args, work: Path, stop: Stop):
    """The first call's checks on a machine (see --checks): (what they found, the CUDA tests' process)."""
    marker = work / "checks.json"
    if args.checks == "none":
        return {"lstm_cudnn": "on", "skipped": True}, None
    if marker.exists():
        checks = json.loads(marker.read_text())
        log(f"checks done on this machine earlier: {checks}")
        return checks, None
    if args.checks == "tests":  # the CUDA tests beside the runs; no LSTM check (cuDNN on), no bench
        checks = {"lstm_cudnn": "on", "bench": "skipped"}
    else:
        cudnn = lstm_cudnn_check(args, work, min(120.0, 0.2 * args.deadline), stop)
        log(f"LSTM CUDA-vs-CPU check with cuDNN: {'passed' if cudnn == 'on' else 'FAILED: the LSTM runs use --cudnn off'}")
        status = run_bench(args, work, min(args.bench_seconds, 0.4 * args.deadline), stop)
        log(f"bench/gpu_epochs.py: {'done' if status == 0 else 'exit ' + str(status)}")
        checks = {"lstm_cudnn": cudnn, "bench_exit": status}
    # every lent GPU measures itself (the profile is what the CPU work between GPUs acts on), --checks
    # tests included: a minute at most before the runs
    profiled = run_profile(args, work, min(args.profile_seconds, 0.2 * args.deadline), stop)
    log(f"bench/gpu_profile.py: {'done' if profiled == 0 else 'exit ' + str(profiled)}")
    checks["profile_exit"] = profiled
    marker.write_text(json.dumps(checks))
    return checks, (None if stop.asked else start_tests(args, work))


def prepare(args, queue: list, work: Path) -> tuple[list, dict]:
    """The runs of the queue, each seeded from what an earlier session shipped, and the session record."""
    runs = [Run(*q, work, args) for q in queue]
    from engine import runlog
    manifest = {"tree": runlog.code_tree(), "device": device_description(args.device), "tiny": args.tiny,
                "parallel": args.parallel, "queue": [f"{r.key}" for r in runs], "deadline_s": args.deadline,
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {}}
    shipped = args.shipped or (None if args.tiny else ROOT / "reproduction")
    for run in runs:
        manifest["runs"][run.key] = {"from": seed_from_shipped(run, Path(shipped)) if shipped else "nothing shipped"}
    sessions = Path(shipped or ROOT / "reproduction") / "gpu-sessions"
    estimates = epoch_estimates(sessions, ROOT / "bench" / "results" / "gpu-epochs.json", args.parallel)
    for run in runs:
        run.estimate = (TINY_EPOCH_SECONDS, "tiny") if args.tiny else estimates[(run.benchmark, run.sorter)]
        manifest["runs"][run.key]["planned_epoch_seconds"] = [round(run.estimate[0], 1), run.estimate[1]]
    return runs, manifest


def start_next(pending: list, active: list, args, seconds_left: float, cudnn: str, manifest: dict) -> None:
    """Start queued runs while a slot is free, skipping those the plan refuses (start_refusal)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, args.parallel))
    while pending and len(active) < args.parallel and seconds_left > args.min_start_seconds:
        run = pending.pop(0)
        if run.finished():
            continue
        travels = BENCHMARKS[run.benchmark]["checkpoint_travels"]
        refusal = start_refusal(run.epochs - run.epochs_done(), travels, seconds_left, run.estimate[0])
        if refusal:
            manifest["runs"][run.key]["plan"] = refusal
            log(f"{run.key}: {refusal}")
            continue
        run.start(args, cudnn, threads)
        active.append(run)
        log(f"started {run.key} at epoch {run.epochs_done()}/{run.epochs}")


def supervise(active: list, now: float, stop_at: float, grace: float) -> None:
    """One look at the running runs: note epoch ends, drop those that exited, stop those the stop rule
    names, kill those that ignored their stop signal for `grace` seconds."""
    for run in list(active):
        run.poll_epochs()
        if run.process.poll() is not None:
            active.remove(run)
            if run.process.returncode != 0 and not run.stopping:
                run.failed = f"exit {run.process.returncode}"
                log(f"{run.key} failed ({run.failed}); see its log.txt")
            continue
        if run.kill_if_overdue(now, grace):
            active.remove(run)
            continue
        decision = stop_decision(run.epoch_ends, now, stop_at)
        if decision == "now":
            run.stop(now)
        elif decision == "after this epoch":
            run.stop_after_this_epoch()


def run_queue(args, runs: list, manifest: dict, packer: Packer, stop: Stop, stop_at: float, cudnn: str) -> None:
    """Train the queue until it is done or the stop; $OUT is packed again after epoch ends."""
    pending, active, last_line = [run for run in runs if not run.finished()], [], 0.0
    while True:
        now = time.monotonic()
        if stop.asked:
            stop_at = now
        supervise(active, now, stop_at, args.grace)
        if not stop.asked:
            start_next(pending, active, args, stop_at - now, cudnn, manifest)
        if not active and (not pending or stop_at - now <= args.min_start_seconds or stop.asked):
            return
        if packer.due(runs, now, args.pack_every):
            record_runs(manifest, runs)
            packer.pack(runs, manifest)
        if now - last_line >= args.progress_every:
            last_line = now
            status = ", ".join(f"{r.benchmark}/{r.queued}/s{r.seed} {r.epochs_done()}/{r.epochs}" for r in active)
            log(f"{(stop_at - now) / 60:.1f} min left; {len(active)} running: {status}; "
                f"{sum(r.finished() for r in runs)}/{len(runs)} finished")
        time.sleep(args.poll)


def record_runs(manifest: dict, runs: list) -> None:
    """Each run's epochs and epoch times so far into the session record."""
    for run in runs:
        seconds = [b - a for a, b in zip(run.epoch_ends[1:], run.epoch_ends[2:])]  # the first includes start-up
        train_seconds = epoch_column(run, "epoch_seconds")[run.epochs_at_start:]
        manifest["runs"][run.key].update({
            "median_train_seconds_this_call": median(train_seconds),
            "epochs_done": run.epochs_done(), "epochs": run.epochs, "finished": run.finished(),
            "failed": run.failed, "epochs_this_call": max(0, len(run.epoch_ends) - 1),
            "median_wall_seconds_per_epoch_this_call": median(seconds),
            "first_epoch_wall_seconds": run.epoch_ends[1] - run.epoch_ends[0] if len(run.epoch_ends) > 1 else None})


def wait_tests(tests, work: Path, budget: float):
    """The CUDA tests' exit status, after at most `budget` seconds (then they are stopped: None)."""
    try:
        tests.wait(budget)
    except subprocess.TimeoutExpired:
        os.killpg(tests.pid, signal.SIGKILL)
        tests.wait()
        with open(work / "tests.log", "a") as f:
            f.write("\n[gpu_session] the CUDA tests ran out of time\n")
    return tests.returncode


def session(args, queue: list) -> None:
    started = time.monotonic()
    stop_at = started + args.deadline - args.pack_seconds
    work, out = Path(args.work), Path(args.out)
    stop = Stop()
    stop.install()
    work.mkdir(parents=True, exist_ok=True)
    if args.data_archive:
        unpack_data(Path(args.data_archive), Path(args.data_dir))
    check_inputs(args)
    runs, manifest = prepare(args, queue, work)
    packer = Packer(work, out)
    packer.pack(runs, manifest)  # $OUT holds the session record from the start
    checks, tests = run_checks(args, work, stop)
    manifest["checks"] = checks
    packer.pack(runs, manifest)  # the bench and the profile come back even if the call is cut now
    run_queue(args, runs, manifest, packer, stop, stop_at, checks["lstm_cudnn"])
    stopping = [run for run in runs if run.process is not None and run.process.poll() is None]
    for run in stopping:  # those the stop rule left running at the end (or all, after SIGTERM)
        run.stop(time.monotonic())
    while any(run.process.poll() is None for run in stopping):
        if any(run.kill_if_overdue(time.monotonic(), args.grace) for run in stopping):
            continue
        time.sleep(0.2)
    if tests is not None:
        budget = 1.0 if stop.asked else max(1.0, started + args.deadline - 10 - time.monotonic())
        manifest["tests_exit"] = wait_tests(tests, work, min(budget, args.pack_seconds / 2))
    record_runs(manifest, runs)
    manifest["wall_seconds"] = round(time.monotonic() - started, 1)
    manifest["stopped_by"] = stop.asked
    packer.pack(runs, manifest)
    done = sum(r.finished() for r in runs)
    log(f"{done}/{len(runs)} runs finished; {time.monotonic() - started:.0f} s of the {args.deadline:.0f} s deadline")


# ---------------------------------------------------------------------------------------------- unpack
def checkpoint_epoch(path: Path) -> int | None:
    """The epoch a (gzipped) checkpoint was taken at, read from the checkpoint itself; None without one."""
    if not path.exists():
        return None
    import torch
    with gzip.open(path, "rb") as f:
        return int(torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)["epoch"])


def shipped_state(target: Path) -> dict:
    """What reproduction/<benchmark>/<run>/ holds: epochs, whether finished, its checkpoint's epoch."""
    rows = metrics_rows(target / "metrics.csv")
    try:
        epochs = json.loads((target / "config.json").read_text())["args"]["epochs"]
    except (OSError, ValueError, KeyError):
        epochs = None
    return {"rows": rows, "finished": epochs is not None and rows >= epochs,
            "checkpoint": checkpoint_epoch(target / "checkpoint.pt.gz")}


def unpack_decision(shipped: dict, came: dict, replace_finished: bool = False) -> str:
    """What --unpack does with a run a call brought back, given what is shipped (shipped_state) and what
    came (rows, finished, checkpoint: its packed checkpoint's epoch or None): "keep" the shipped files,
    "replace" them (records, and the checkpoint by the call's), or "finish" (records replaced, the
    checkpoint removed). A shipped checkpoint goes only for a newer one of the run or when it finished;
    a finished shipped run changes only with replace_finished; the longer record wins where neither
    side has a checkpoint; a run that can go on (a checkpoint) wins over one that cannot."""
    if shipped["finished"] and not replace_finished:
        return "keep"
    if came["finished"]:
        return "finish"
    if came["checkpoint"] is not None:
        return "replace" if shipped["checkpoint"] is None or came["checkpoint"] >= shipped["checkpoint"] else "keep"
    if shipped["checkpoint"] is not None:
        return "keep"  # the call's epochs past it came without a checkpoint: the next session redoes them
    return "replace" if came["rows"] > shipped["rows"] else "keep"


def unpack_run(tar, key: str, entry: dict, source: Path, into: Path, session_dir: Path, replace_finished: bool) -> None:
    benchmark, name = key.split("/")
    target = into / benchmark / name
    packed = source / packed_checkpoint_name(benchmark, name)
    came = {"rows": entry["epochs_done"], "finished": entry["finished"], "checkpoint": checkpoint_epoch(packed)}
    shipped = shipped_state(target)
    decision = unpack_decision(shipped, came, replace_finished)
    if decision == "keep":
        why = "finished" if shipped["finished"] else f"{shipped['rows']} epochs" + (
            f", checkpoint of epoch {shipped['checkpoint']}" if shipped["checkpoint"] is not None else "")
        print(f"{target}: kept as shipped ({why}); this call's run reached {entry['epochs_done']} epochs"
              f"{'' if came['checkpoint'] is None else ', checkpoint of epoch ' + str(came['checkpoint'])} "
              f"(its record: {session_dir / 'runs'})")
        return
    if came["rows"] < shipped["rows"]:  # a record longer than the one replacing it stays in the session folder
        keep_aside = session_dir / "replaced" / benchmark / name
        keep_aside.mkdir(parents=True, exist_ok=True)
        for file in ("config.json", "metrics.csv"):
            shutil.copy(target / file, keep_aside / file)
    target.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "metrics.csv"):
        write_atomically(target / file, tar.extractfile(f"{key}/{file}").read())
    if decision == "replace" and came["checkpoint"] is not None:
        shutil.copy(packed, target / ".checkpoint.pt.gz.tmp")
        os.replace(target / ".checkpoint.pt.gz.tmp", target / "checkpoint.pt.gz")
    elif decision == "finish":
        (target / "checkpoint.pt.gz").unlink(missing_ok=True)
    state = "finished" if entry["finished"] else f"epoch {entry['epochs_done']}/{entry['epochs']}"
    print(f"{target}: {state}{', checkpoint kept' if (target / 'checkpoint.pt.gz').exists() else ''}")


def keep_records(tar, session_dir: Path) -> None:
    """Every run's config.json, metrics.csv and log as the call brought them back, and the bench's and the
    profile's logs, under the session's folder (session_dir/runs/<benchmark>/<run>/)."""
    for member in tar.getmembers():
        if member.isfile() and member.name != "session.json" and not member.name.startswith("/") and ".." not in member.name:
            path = session_dir / "runs" / member.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tar.extractfile(member).read())


def unpack(source: Path, into: Path, bench_json: Path, sessions: Path, replace_finished: bool = False) -> None:
    """Runs -> into/<benchmark>/<run>/ (unpack_decision); gpu-epochs.json -> bench_json as it came; the
    profile -> gpu-profile-<device>-<date>.txt beside it; session.json, tests.log and every run's record
    and log -> sessions/<started>/."""
    from engine import runlog
    archive = source / "runs.tar.gz"
    if not archive.exists():
        fail(f"{source} holds no runs.tar.gz: pass the folder the device call's files came back in")
    with tarfile.open(archive, "r:gz") as tar:
        manifest = json.loads(tar.extractfile("session.json").read())
        if manifest["tiny"] and into.resolve() == (ROOT / "reproduction").resolve():
            fail("these are a --tiny dry run's runs: unpack them with --into somewhere other than reproduction/")
        session_dir = sessions / manifest["started"].replace(" ", "T").replace(":", "")
        session_dir.mkdir(parents=True, exist_ok=True)
        names = set(tar.getnames())
        for key, entry in manifest["runs"].items():
            if f"{key}/metrics.csv" in names and "epochs_done" in entry:  # else never started
                unpack_run(tar, key, entry, source, into, session_dir, replace_finished)
        keep_records(tar, session_dir)
        manifest["commit"] = runlog.commit_of_code_tree(manifest.get("tree"))
        (session_dir / "session.json").write_text(json.dumps(manifest, indent=1) + "\n")
        profile = session_dir / "runs" / "gpu-profile.txt"
        if profile.exists():
            device = re.sub(r"[^A-Za-z0-9]+", "-", manifest["device"].split(",")[0]).strip("-")
            shutil.copy(profile, bench_json.parent / f"gpu-profile-{device}-{manifest['started'][:10]}.txt")
    if (source / "tests.log").exists():
        shutil.copy(source / "tests.log", session_dir / "tests.log")
    if (source / "gpu-epochs.json").exists():
        report = json.loads((source / "gpu-epochs.json").read_text())
        bench_json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "gpu-epochs.json", bench_json)
        found = runlog.commit_of_code_tree(report.get("code_tree"))
        print(f"{bench_json}: the bench of {found or 'a code tree no commit here has (commit it, then look again)'}")


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
                             "and the profile before the runs, the CUDA tests beside them; the default), tests (the "
                             "profile, then the CUDA tests beside the runs; cuDNN on), none (straight to the queue; "
                             "cuDNN on)")
    parser.add_argument("--bench-seconds", type=float, default=150, help="time limit of the bench (default 150)")
    parser.add_argument("--pack-seconds", type=float, default=40,
                        help="seconds kept at the end for stopping and packing (default 40)")
    parser.add_argument("--grace", type=float, default=20,
                        help="seconds a run may take to stop after its stop signal before it is killed (default 20)")
    parser.add_argument("--pack-every", type=float, default=30,
                        help="$OUT is packed again after an epoch end, at most this often (seconds, default 30)")
    parser.add_argument("--profile-seconds", type=float, default=60,
                        help="time limit of the first call's profile, bench/gpu_profile.py, run by --checks all "
                             "and tests (default 60)")
    parser.add_argument("--min-start-seconds", type=float, default=60,
                        help="no run starts with less time than this left (default 60)")
    parser.add_argument("--progress-every", type=float, default=60, help="seconds between progress lines")
    parser.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--stop-after-epochs", type=int, default=0,
                        help="stop each run cleanly after this many epochs in this call (the dry run's "
                             "deterministic stop; default 0: only the deadline)")
    parser.add_argument("--unpack", metavar="DIR", help="here: unpack the files a device call brought back")
    parser.add_argument("--replace-finished", action="store_true",
                        help="with --unpack: let a run that came back replace a finished shipped run (never otherwise)")
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
        unpack(Path(args.unpack), Path(args.into), Path(args.bench_json), Path(args.sessions), args.replace_finished)
        return
    if not args.out:
        fail("pass --out DIR (on the device machine: --out \"$OUT\")")
    if args.parallel < 1 or args.deadline <= args.pack_seconds:
        fail("--parallel must be >= 1 and --deadline larger than --pack-seconds")
    session(args, select_queue(args.only))  # a typo in --only is refused before anything is unpacked


if __name__ == "__main__":
    main()
