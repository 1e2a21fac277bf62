"""The queue's runs as processes on the machine: each started with --resume from its folder in --work,
watched for epoch ends, asked to stop at an epoch end before the deadline (plan.stop_decision), and
killed when it ignores that request for --grace seconds; SIGTERM to the kit (Stop) stops them all."""
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.rundir import metrics_rows  # no torch: the epochs a run's metrics.csv holds
from scripts.gpu_kit.base import ROOT, log
from scripts.gpu_kit.grid import BENCHMARKS, TINY_EPOCHS, run_name, variant
from scripts.gpu_kit.plan import start_refusal, stop_decision

def spawn(argv: list, **popen_kwargs) -> subprocess.Popen:
    """Start a run in a session of its own (the kit signals its whole process group), with SIGINT's default
    action restored: a kit started in the background by a shell without job control has SIGINT ignored,
    children inherit that, and Python then installs no KeyboardInterrupt handler, so the kit's stop signal
    would be lost and the run killed after --grace."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_default_sigint, **popen_kwargs)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
        self.process = spawn(self.command(args, cudnn), cwd=ROOT, env=env, stdout=logfile, stderr=subprocess.STDOUT)
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


def run_queue(args, runs: list, manifest: dict, packer, stop: Stop, stop_at: float, cudnn: str) -> None:
    """Train the queue until it is done or the stop; $OUT is packed again after epoch ends (packer: a
    pack.Packer)."""
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


def stop_all(runs: list, grace: float) -> None:
    """Stop the runs still going (those the stop rule left running at the end, or all of them after
    SIGTERM) and wait for them; one that ignores its stop signal for `grace` seconds is killed."""
    stopping = [run for run in runs if run.process is not None and run.process.poll() is None]
    for run in stopping:
        run.stop(time.monotonic())
    while any(run.process.poll() is None for run in stopping):
        if any(run.kill_if_overdue(time.monotonic(), grace) for run in stopping):
            continue
        time.sleep(0.2)


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


def epoch_column(run: Run, column: str) -> list[float]:
    try:
        with open(run.dir / "metrics.csv") as f:
            return [float(row[column]) for row in csv.DictReader(f)]
    except (OSError, KeyError, ValueError):
        return []


def median(values):
    return sorted(values)[len(values) // 2] if values else None
