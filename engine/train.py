"""The training loop shared by every benchmark, and the wrapper that runs an entry script.

Per epoch:   orders = sorter.sort()
Per step t:  every local worker j takes its units orders[j, t:t+k]
             gradients  (per unit when the sorter balances, else one batch gradient)
             exchange   (all-gather unit gradients, or all-reduce the mean gradient)
             sorter.step(all workers' unit gradients, positions t..t+k-1)
             optimizer step with the global-batch gradient
After epoch: evaluate, append a metrics row, save checkpoint.pt and metrics.csv; stop early when the
             file $CDGRAB_STOP_FILE asks for it (stop_requested).

With --sync other than every-step (engine/local_sgd.py) every worker keeps its own parameters and
optimizer state and steps on its own gradient, and the workers average every H steps; with a
sparsifying --reducer (engine/reducers.py) what is averaged (the gradient, or the parameters' change
since the last averaging) is compressed with error feedback. Both need each worker's own gradient,
so their steps go through Task.worker_gradients.
"""
import contextlib
import errno
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.errors import UserFacingError, exit_with_error, tell_launcher
from engine import runlog
from engine.cli import PROGRESS_EVERY_SECONDS, check_args, check_resume, describe_changes
from engine.comm import GradientExchange, make_communicator
from engine.device import set_tf32, setup_device, tf32_settings
from engine.flags import benchmark_of, changed_on_resume
from engine.herding_log import HerdingLog
from engine.local_sgd import LocalWorkers, SyncSchedule
from engine.optim import LRSchedule, Optimizer
from engine.overlap import BackgroundSorter
from engine.reducers import make_reducer
from engine.rundir import RunFinished, check_run_folder, claim_run_folder, metrics_rows
from engine.sketching import make_sketch, sketch_config
from sorters import NonFiniteGradientError, build_sorter
from sorters.balance import sign_loop_for

LOSS_CHECK_EVERY = 50  # steps between host reads (and the finiteness check) of the training loss
# --overlap auto: below OVERLAP_MIN_D the thread hand-off costs about what the sorter does; above
# OVERLAP_MAX_BUFFER the second per-unit gradient buffer costs more memory than it saves time (GPT-2:
# 1.75 GB for 8% of a step)
OVERLAP_MIN_D, OVERLAP_MAX_BUFFER = 65_536, 256 * 2**20


class RegionTimer:
    """Seconds per region of the step loop, at the cost of one clock read per region boundary.

    `lap(region)` charges the time since the previous lap (or `start`) to `region`. On CUDA the
    boundaries are recorded as events and read once, at the epoch's end (`seconds()`), so the
    timing adds no host synchronisation to a step; on the CPU they are perf_counter readings.
    """

    REGIONS = ("sorter", "comm", "compute")

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(self.REGIONS, 0.0)
        self.events = []  # CUDA: (region, end event) in order
        self.start()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self):
        self.last = self._now()
        if self.cuda:
            self.events.append((None, self.last))

    def lap(self, region: str):
        now = self._now()
        if self.cuda:
            self.events.append((region, now))
        else:
            self.totals[region] += now - self.last
        self.last = now

    def seconds(self) -> dict:
        if self.cuda and len(self.events) > 1:
            self.events[-1][1].synchronize()
            for (_, begin), (region, end) in zip(self.events, self.events[1:]):
                if region is not None:
                    self.totals[region] += begin.elapsed_time(end) / 1000
            self.events = self.events[-1:]
        return dict(self.totals)


def run_entry_point(benchmark: str, parser, build_task) -> None:
    """Parse, check, set up workers, build the task, train; turn failures into one-line errors.

    build_task(args, device) -> Task. Exit status: 0 ok, 2 bad input / failed run, 1 lost a peer, 130
    interrupted (Ctrl-C), 143 stopped by SIGTERM.
    """
    args = parser.parse_args()
    out_given, comm, lock = args.out is not None, None, None
    # torchrun stops every process with SIGTERM when one fails or its node loses the rendezvous: say so
    # in one line rather than vanish without a word
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        # every check that needs no data comes before the process group: a bad run fails before torchrun's
        # rendezvous, and in every process alike
        check_args(args, benchmark, defaults=vars(parser.parse_args([])))
        check_resume(args, benchmark, out_given)
        lock = claim_run_folder(args, benchmark)  # one writer (rank 0); finished runs and others' files untouched
        device, backend = setup_device(args.device, args.backend)
        set_tf32(args.tf32)
        comm = make_communicator(args.node_cnt, device, backend, args.dist_timeout)
        torch.manual_seed(args.seed)
        task = build_task(args, device)
        train(task, args, comm, device)
        comm.close(finished=True)
    except RunFinished as finished:  # --resume of a finished run without a checkpoint: exit 0, nothing changed
        if int(os.environ.get("RANK", "0")) == 0:
            print(finished, file=sys.stderr)
    except UserFacingError as error:
        quiet_sigterm()  # a rank waiting in exit_with_error while rank 0 reports: torchrun's SIGTERM ends it
        exit_with_error(str(error))  # under torchrun: printed once (rank 0), every rank exits 2
    except KeyboardInterrupt:
        quiet_sigterm()
        print(f"interrupted; the last finished epoch is in {args.out or '--out'}/checkpoint.pt (continue with "
              "--resume)", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        quiet_sigterm()
        print(terminated_line(args, comm), file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except (RuntimeError, ConnectionError) as error:
        quiet_sigterm()
        if out_of_memory(error):
            exit_with_error(f"out of memory ({str(error).strip().splitlines()[0][:200]}); make the run smaller "
                            "(--B, the model's size flags, --max-train-examples) or use a larger device")
        if comm is None or comm.world_size == 1:
            raise
        # under torchrun a failed collective almost always means a peer died; say so in one line
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        line = (f"error: rank {comm.rank}: a collective failed ({first_line}); did another rank die? see its "
                f"output above. The last finished epoch is in {args.out}/checkpoint.pt (continue with --resume)")
        print(line, file=sys.stderr)
        tell_launcher(line)
        sys.exit(1)
    finally:
        quiet_sigterm()
        if comm is not None:
            comm.close()
        if lock is not None:
            lock.release()


def terminated_line(args, comm) -> str:
    """What a run stopped by SIGTERM says (no "error:" prefix: under torchrun the error is another rank's,
    reported by it, or a lost node's); torchrun named only when the run is under it."""
    rank = f"rank {comm.rank}: " if comm is not None and comm.world_size > 1 else ""
    why = (" (torchrun stops every process when one fails or a node is lost: see the output above)"
           if "TORCHELASTIC_RUN_ID" in os.environ else "")
    return (f"{rank}stopped by SIGTERM{why}; the last finished epoch is in {args.out or '--out'}/checkpoint.pt "
            "(continue with --resume)")


def out_of_memory(error: BaseException) -> bool:
    """Whether a RuntimeError is an allocation that failed (the CPU allocator's, or CUDA's)."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


class Terminated(Exception):
    """SIGTERM arrived (raise_terminated, run_entry_point's handler)."""


def raise_terminated(signum, frame):
    raise Terminated()


def quiet_sigterm() -> None:
    """SIGTERM's default again: once a run is on its way out (an error said, or the end), a SIGTERM ends
    it without a second line or a traceback from inside the exit path."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class Run:
    """What train() builds once, from the task and the args, for its helpers below.
    optimizer: what steps and is checkpointed (LocalWorkers with local steps, `local`; else an
    Optimizer and local None)."""
    task: object
    args: object
    comm: object
    device: torch.device
    sorter: object
    reducer: object
    exchange: GradientExchange
    lr_schedule: LRSchedule
    optimizer: object
    local: LocalWorkers | None
    herding_log: HerdingLog | None
    steps_per_epoch: int
    per_worker_grads: bool  # each worker's own gradient: needed by local steps and by error feedback
    fault: "FaultInjection"

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    @property
    def writer(self) -> bool:  # rank 0 writes the run directory
        return self.comm.rank == 0

    def comm_bytes(self) -> int:
        """Bytes sent so far by the gradient exchange, the reducer and the local-SGD averaging."""
        return self.exchange.comm_bytes + self.reducer.comm_bytes + (self.local.comm_bytes if self.local else 0)


def train(task, args, comm, device) -> list[dict]:
    """Train `task` for args.epochs; write the run directory (rank 0). Returns the metrics rows.

    Build the sorter, reducer, exchange and optimizer; resume from <out>/checkpoint.pt (--resume);
    write config.json; then per epoch: train its steps, evaluate, append a metrics row, save the
    checkpoint and the logs.
    """
    run = build_run(task, args, comm, device)
    try:  # run_entry_point checked the folder already, under its lock; a direct call (tests, bench/) here
        check_run_folder(args, task.name)
    except RunFinished as finished:
        say(run, str(finished))
        return []
    rows, recorded_orders, first_epoch = resume(run) if (run.out / "checkpoint.pt").exists() else ([], [], 1)
    say(run, start_line(run, first_epoch))
    if first_epoch > args.epochs and (run.out / "config.json").exists():
        say(run, f"{task.name}: done: {run.out} (after epoch {len(rows)})")
        return rows  # keep config.json: it describes the run that made these epochs
    if run.writer:
        with writing(run.out, "config.json"):  # earlier segments kept, this one appended
            runlog.write_config(run.out / "config.json",
                                runlog.with_segment(run.out / "config.json", run_config(run), first_epoch))
    progress = ProgressLines(run, first_epoch) if progress_mode(args, run.writer) == "lines" else None
    end = f"{task.name}: done: {run.out} (after epoch {args.epochs})"
    for epoch in range(first_epoch, args.epochs + 1):
        bytes_before = run.comm_bytes()
        orders, seconds = train_epoch(run, epoch, epochs_saved=bool(rows), progress=progress)
        with torch.no_grad(), (progress.evaluating(epoch) if progress else contextlib.nullcontext()):
            metrics = task.evaluate(task.model.flat, comm)
        rows.append(metrics_row(run, epoch, metrics, seconds, run.comm_bytes() - bytes_before))
        if args.record_orders:
            recorded_orders.append(orders.to(torch.int32).cpu())
        save_epoch(run, rows, recorded_orders)
        if progress:
            progress.printed()  # the epoch's line says where the run is
        if epoch < args.epochs and stop_requested(epoch, comm):
            end = (f"{task.name}: stopped after epoch {epoch} of {args.epochs} ($CDGRAB_STOP_FILE): {run.out}; "
                   "continue with --resume")
            break
    if isinstance(run.sorter, BackgroundSorter):
        run.sorter.close()
    if run.writer:
        with writing(run.out, "config.json"):
            runlog.end_segment(run.out / "config.json", len(rows))
    say(run, end)
    return rows


def say(run: "Run", line: str) -> None:
    """One line on stderr, by the writing rank (rank 0) only."""
    if run.writer:
        print(line, file=sys.stderr, flush=True)


def start_line(run: "Run", first_epoch: int) -> str:
    """The run's first line: where it writes, and whether it starts, resumes or is finished already."""
    name, out, epochs = run.task.name, run.out, run.args.epochs
    if first_epoch > epochs:
        return f"{name}: {out} is finished: {first_epoch - 1} epochs done (--epochs {epochs}); nothing to resume"
    if first_epoch > 1:
        return f"{name}: resuming {out} after epoch {first_epoch - 1} (epochs {first_epoch}-{epochs})"
    fresh = f"no checkpoint in {out}, starting a new run" if run.args.resume else f"new run in {out}"
    return f"{name}: {fresh} (epochs 1-{epochs})"


def progress_mode(args, writer: bool) -> str | None:
    """How rank 0 shows progress within an epoch: "bar" (tqdm: --progress on, or auto on a terminal),
    "lines" (auto off a terminal: ProgressLines), or None (--progress off, and every other rank)."""
    if not writer or args.progress == "off":
        return None
    return "bar" if args.progress == "on" or sys.stderr.isatty() else "lines"


class ProgressLines:
    """Plain progress lines for logs (--progress auto when stderr is no terminal): at the first step that
    ends PROGRESS_EVERY_SECONDS or more after the last line (or the epoch's line), one line with the
    epoch, the step, the epoch's mean training loss so far (as of its last host read) and the time
    left, estimated from the pace of this process's steps so far, evaluations included. Before an
    evaluation that took that long the last time, a line that says it is evaluating."""

    def __init__(self, run: "Run", first_epoch: int):
        self.run, self.every = run, progress_interval()
        self.start = self.last = time.monotonic()
        self.steps_before = (first_epoch - 1) * run.steps_per_epoch  # done by earlier starts of the run
        self.total_steps = run.args.epochs * run.steps_per_epoch
        self.eval_seconds = None  # the last evaluation's, in this start

    def step(self, epoch: int, step: int, loss: float | None) -> None:
        """After 0-based step `step` of `epoch`; loss: the epoch's mean training loss so far (None: none read
        yet)."""
        now = time.monotonic()
        if now - self.last < self.every:
            return
        spe, name = self.run.steps_per_epoch, f"{self.run.task.name} {self.run.sorter.name}"
        done = (epoch - 1) * spe + step + 1
        left = (now - self.start) / (done - self.steps_before) * (self.total_steps - done)
        shown = "-" if loss is None else f"{loss:.4f}"
        say(self.run, f"{name} epoch {epoch}/{self.run.args.epochs} step {step + 1}/{spe} | loss {shown} | "
                      f"{duration(left)} left")
        self.last = now

    @contextlib.contextmanager
    def evaluating(self, epoch: int):
        """Around the evaluation after `epoch`: says so first when the last one took PROGRESS_EVERY_SECONDS
        or more (the LSTM's and GPT-2's full evaluations take minutes), and times it."""
        start = time.monotonic()
        if self.eval_seconds is not None and self.eval_seconds >= self.every:
            say(self.run, f"{self.run.task.name} {self.run.sorter.name} epoch {epoch}/{self.run.args.epochs}: "
                          f"evaluating (the last evaluation took {duration(self.eval_seconds)})")
            self.last = start
        yield
        self.eval_seconds = time.monotonic() - start

    def printed(self) -> None:
        """Another line (the epoch's) has just said where the run is."""
        self.last = time.monotonic()


def progress_interval() -> float:
    """Seconds between ProgressLines' lines: PROGRESS_EVERY_SECONDS, or $CDGRAB_PROGRESS_EVERY."""
    text = os.environ.get("CDGRAB_PROGRESS_EVERY", "")
    try:
        return float(text) if text else PROGRESS_EVERY_SECONDS
    except ValueError:
        raise UserFacingError(f"$CDGRAB_PROGRESS_EVERY must be a number of seconds, got {text!r}") from None


def duration(seconds: float) -> str:
    """'1h 02m', '3m 05s' or '42s'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"


def stop_requested(epoch: int, comm) -> bool:
    """Whether to stop after this epoch, its checkpoint saved: the file named by $CDGRAB_STOP_FILE exists
    and is empty (stop at the next epoch end) or holds an epoch number <= `epoch`. A scheduler (such
    as scripts/gpu_session.py before a deadline) asks a run to stop cleanly this way. Every process
    reads the file and the processes agree (any one seeing it stops all), so they never part ways."""
    path = os.environ.get("CDGRAB_STOP_FILE")
    wanted = 0.0
    if path:
        try:
            text = Path(path).read_text().strip()
            wanted = 1.0 if not text or int(text) <= epoch else 0.0
        except FileNotFoundError:
            pass
        except ValueError:
            wanted = 1.0  # not a number: a plain "stop"
    if comm.world_size > 1:
        wanted = comm.all_reduce_sum(torch.tensor([[wanted]], dtype=torch.float64, device=comm.device)).item()
    return wanted > 0


def build_run(task, args, comm, device) -> Run:
    """The sorter (with --overlap in a background thread), the reducer and exchange, the learning-rate
    schedule, and the optimizer or LocalWorkers; sizes checked."""
    n, m, k, d = task.n_workers, task.n_units, task.units_per_step, task.model.d
    if m % k:
        raise UserFacingError(f"{task.name}: {m} units per worker is not a multiple of {k} units per step")
    steps_per_epoch = m // k
    task.unit_grad_path = args.unit_grads
    sketch = make_sketch(args, d, task.model)  # --sketch-dim: the sorter balances (n, k, D) sketches (engine/sketching.py)
    sorted_d = sketch.dim if sketch else d
    sorter = build_sorter(args.sorter, n, m, sorted_d, seed=args.seed, device=device, epochs=args.epochs,
                          sign_loop=resolve_sign_loop(args, device, d, sorted_d))
    reducer = make_reducer(args.reducer, comm, d, device, args.density)
    exchange = GradientExchange(comm, gather_unit_grads=sorter.uses_grads, reducer=reducer, sketch=sketch)
    sorter = with_overlap(sorter, task, args.overlap, len(comm.local_workers), device, sketch)
    lr_schedule = LRSchedule(args.lr, steps_per_epoch, task.lr_decay_every, task.lr_decay_gamma, kind=args.lr_schedule,
                             total_epochs=args.epochs, warmup_epochs=args.warmup_epochs, min_lr=args.min_lr)
    local = build_local_workers(task, args, comm, reducer, lr_schedule, steps_per_epoch)
    optimizer = Optimizer(task.optimizer, task.model.flat, lr_schedule, args.momentum, args.weight_decay) \
        if local is None else local
    herding_log = HerdingLog(n, m, d, comm, task.model, device) if args.log_herding else None
    return Run(task, args, comm, device, sorter, reducer, exchange, lr_schedule, optimizer, local, herding_log,
               steps_per_epoch, per_worker_grads=local is not None or args.reducer != "dense",
               fault=FaultInjection.from_environment(comm.rank))


def resolve_sign_loop(args, device, d: int, sorted_d: int) -> str | None:
    """CD-GraB's sign loop: --sign-loop, or for auto the one sorters.balance.sign_loop_for picks."""
    if args.sorter != "CD-GraB":
        return None
    chosen = getattr(args, "sign_loop", "auto")
    if chosen == "compiled" and torch.device(device).type != "cpu":
        raise UserFacingError(f"--sign-loop compiled runs on the CPU only; on {device} use gram or auto")
    return sign_loop_for(device, d, sorted_d) if chosen == "auto" else chosen


def with_overlap(sorter, task, overlap: str, n_local: int, device, sketch=None):
    """The sorter, run in a background thread when --overlap asks for it (auto: when the sorted vectors
    (d, or the sketch's D) are long enough and the second per-unit gradient buffer small enough); sets how
    many buffers the task rotates."""
    k, d, flat = task.units_per_step, task.model.d, task.model.flat
    sorted_d = sketch.dim if sketch else d
    second_buffer_bytes = n_local * k * d * flat.element_size()
    overlapping = sorter.uses_grads and (overlap == "on" or (overlap == "auto" and sorted_d >= OVERLAP_MIN_D
                                                             and second_buffer_bytes <= OVERLAP_MAX_BUFFER))
    # with k odd a pair's first unit comes a step before its second: rather than copy it, the sorter keeps
    # a reference, and the task rotates one more gradient buffer so that it stays intact
    sorter.grads_stay_valid = sorter.uses_grads and k % 2 == 1
    # sketches are fresh tensors every step: the sorter never holds the task's buffer
    task.grad_buffers = 1 if sketch else 1 + overlapping + sorter.grads_stay_valid
    return BackgroundSorter(sorter, device) if overlapping else sorter  # balances step t during step t + 1


def build_local_workers(task, args, comm, reducer, lr_schedule, steps_per_epoch: int) -> LocalWorkers | None:
    """LocalWorkers for --sync other than every-step (each worker's own parameters and optimizer state,
    averaged every H steps); None for the paper's data-parallel training."""
    if args.sync == "every-step":
        return None
    sync = SyncSchedule(args.sync, H=args.H, h_base=args.H_base, h_init=args.H_init, alpha=args.alpha or 0.0,
                        power=args.power, switch_step=((args.switch_epoch or 1) - 1) * steps_per_epoch,
                        warmup_steps=lr_schedule.warmup_steps, total_steps=args.epochs * steps_per_epoch)
    return LocalWorkers(task.model.flat, comm, task.optimizer, lr_schedule, sync, reducer, args.momentum,
                        args.weight_decay, averaged_state(args))


def averaged_state(args) -> tuple:
    """The optimizer buffers --avg-m / --avg-v ask LocalWorkers to average (AdamW's moments)."""
    return tuple(name for name, on in (("exp_avg", args.avg_m), ("exp_avg_sq", args.avg_v)) if on)


def resume(run: Run) -> tuple[list, list, int]:
    """Restore <out>/checkpoint.pt into the run (only with --resume); rewrite the logs from it (rank 0).
    Returns (metrics rows so far, recorded orders, first epoch to run)."""
    out, args = run.out, run.args
    if not args.resume:
        raise UserFacingError(f"{out} already holds a run (checkpoint.pt); pass --resume to continue it, "
                              "or choose another --out")
    rows, recorded_orders, first_epoch = restore(out / "checkpoint.pt", dict(vars(args)), run.task.model.flat,
                                                 run.optimizer, run.sorter, run.device, run.reducer, run.task.name)
    # checkpoint.pt is saved before orders.pt and metrics.csv, so a run killed in between left them an epoch
    # behind; the checkpoint is the truth, and may be the last epoch's. Logs that agree stay untouched.
    if run.writer and metrics_rows(out / "metrics.csv") != len(rows):
        with writing(out, "metrics.csv"):
            write_logs(out, rows, recorded_orders, run.task.metric_columns)
    return rows, recorded_orders, first_epoch


@contextlib.contextmanager
def writing(out: Path, what: str):
    """Turns a failed write of the run directory (a full disk, a lost permission) into one line: the files
    are written atomically, so each keeps its last complete version (checkpoint.pt: the last epoch saved)."""
    try:
        yield
    except OSError as error:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        raise UserFacingError(f"cannot write {what} in {out}: {error.strerror or error}; "
                              f"{'free some disk space, then ' if full else ''}continue with --resume "
                              "(checkpoint.pt holds the last epoch saved)") from None


def run_config(run: Run) -> dict:
    """config.json: the benchmark, its args, sizes, data, strategies, device and versions."""
    task, args, comm, sorter = run.task, run.args, run.comm, run.sorter
    return {
        "benchmark": task.name,
        "args": dict(vars(args)),
        "sizes": {"n_workers": task.n_workers, "world_size": comm.world_size,
                  "workers_per_process": len(comm.local_workers), "units_per_worker": task.n_units,
                  "units_per_step": task.units_per_step, "steps_per_epoch": run.steps_per_epoch,
                  "d": task.model.d, "global_batch": task.global_batch},
        "data": task.data_info,
        "sorter": {"name": sorter.name, "uses_grads": sorter.uses_grads,
                   "sign_loop": getattr(sorter, "sign_loop", None),
                   "sketch": sketch_config(args, run.exchange.sketch)},
        "optimizer": {"name": task.optimizer, "lr_decay_every": task.lr_decay_every,
                      "lr_decay_gamma": task.lr_decay_gamma, "lr_schedule": args.lr_schedule,
                      "warmup_steps": run.lr_schedule.warmup_steps},
        "communication": {"sync": args.sync, "reducer": args.reducer, "per_worker_grads": run.per_worker_grads,
                          "worker_gradients": ("vmap" if task.vmap_over_workers else "loop")
                          if run.per_worker_grads else None},
        "device": str(run.device),
        "tf32": tf32_settings(),  # what the run computed with (set from --tf32 by run_entry_point)
        "versions": runlog.library_versions(),
        "git_commit": runlog.git_commit(),
    }


def train_epoch(run: Run, epoch: int, epochs_saved: bool, progress=None) -> tuple[torch.Tensor, dict]:
    """The epoch's orders, then its steps, then what the epoch's end owes (deferred unit gradients, the
    local workers' last averaging). progress: ProgressLines (rank 0, no bar), or None. Returns (orders
    (n, m), seconds: per region and the whole epoch)."""
    task = run.task
    epoch_start = time.perf_counter()
    task.start_epoch(epoch)
    timer = RegionTimer(run.device)
    losses = LossCheck(run, epoch, epochs_saved, progress)
    try:  # the sorters refuse NaN/inf gradients: in step() on the CPU, at the next sort() on a device
        orders = run.sorter.sort()
        workers = run.comm.local_workers
        # (n_local, m), on the device: each step's unit ids are then a slice, with no copy from the host
        local_orders = orders[workers[0]:workers[-1] + 1]
        timer.lap("sorter")
        for step in range(run.steps_per_epoch):
            global_step = step + (epoch - 1) * run.steps_per_epoch
            run.fault.before_step(global_step, run.task.model.flat)
            local_loss = take_step(run, local_orders, step, global_step, timer)
            losses.add(run.fault.poison(local_loss.detach(), global_step), step)
            timer.lap("compute")
    except NonFiniteGradientError as error:
        raise UserFacingError(losses.stop_line(f"the gradients became non-finite ({error})")) from None
    losses.close()
    flush_deferred(run.exchange, run.sorter, timer)  # a round in progress: the sorter's epoch needs its gradients
    timer.lap("sorter")
    if run.local is not None:
        run.local.end_epoch()  # evaluation and the checkpoint see the mean of the workers' parameters
        timer.lap("comm")
    seconds = timer.seconds()
    if isinstance(run.sorter, BackgroundSorter):
        # the loop's 'sorter' region saw only the hand-offs, waits for a step still running included;
        # count the steps' own time in place of those waits, so that the column is the time the
        # sorter's work took, as without --overlap
        step_seconds, waited_seconds = run.sorter.take_seconds()
        seconds["sorter"] += step_seconds - waited_seconds
    seconds["epoch"] = time.perf_counter() - epoch_start
    return orders, seconds


def take_step(run: Run, local_orders, step: int, global_step: int, timer):
    """Step `step` of the epoch (0-based) with the strategy the run uses: each local worker takes its
    units local_orders[:, step*k:(step+1)*k] (local_orders (n_local, m)). Returns the local loss."""
    k = run.task.units_per_step
    unit_ids, positions = local_orders[:, step * k:(step + 1) * k], range(step * k, (step + 1) * k)
    if run.local is not None:
        return local_step(run.task, run.sorter, run.exchange, run.local, unit_ids, positions, global_step,
                          timer, run.args.unit_grad_gather == "round")
    if run.per_worker_grads:
        return sparsified_step(run.task, run.sorter, run.exchange, run.optimizer, unit_ids, positions, timer)
    return data_parallel_step(run.task, run.sorter, run.exchange, run.optimizer, unit_ids, positions, timer,
                              run.herding_log)


class LossCheck:
    """The training loss, read on the host once every LOSS_CHECK_EVERY steps (and at the epoch's end),
    summed over all workers: stops the run when it is not finite, feeds the progress bar or the
    progress lines (rank 0)."""

    def __init__(self, run: Run, epoch: int, epochs_saved: bool, progress=None):
        self.run, self.epoch, self.epochs_saved, self.progress = run, epoch, epochs_saved, progress
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # local losses since the last check
        self.checked_step, self.epoch_loss = 0, 0.0
        args, name = run.args, run.task.name
        show = progress_mode(args, run.writer) == "bar"
        self.bar = tqdm(total=run.steps_per_epoch, desc=f"{name} {run.sorter.name} epoch {epoch}/{args.epochs}",
                        disable=not show, leave=False, mininterval=0.5, file=sys.stderr)

    def add(self, local_loss: torch.Tensor, step: int) -> None:
        """local_loss: this process's mean loss of 0-based step `step` (a device scalar)."""
        self.loss_sum += local_loss
        if not (step + 1) % LOSS_CHECK_EVERY or step + 1 == self.run.steps_per_epoch:
            self.check(step)
        if self.progress:  # a clock read per step; the loss as of its last host read (no extra sync)
            self.progress.step(self.epoch, step, self.epoch_loss / self.checked_step if self.checked_step else None)

    def check(self, step: int) -> None:
        """Read the loss summed since the last check (steps checked_step..step, 0-based) on the host."""
        # the only host read of the loss: all processes check the same steps, so they stop together
        comm, n_local = self.run.comm, len(self.run.comm.local_workers)
        window_loss = comm.all_reduce_sum((self.loss_sum * n_local).reshape(1, 1)).item() / self.run.task.n_workers
        if not math.isfinite(window_loss):
            raise UserFacingError(self.stop_line(f"the training loss became {window_loss} at epoch {self.epoch}, "
                                                 f"between steps {self.checked_step + 1} and {step + 1}"))
        self.epoch_loss += window_loss
        self.loss_sum.zero_()
        self.bar.update(step + 1 - self.checked_step)
        self.bar.set_postfix(loss=f"{self.epoch_loss / (step + 1):.4f}", refresh=False)
        self.checked_step = step + 1

    def stop_line(self, what: str) -> str:
        """The one line that stops a diverged run: what happened, what to do, what is saved."""
        saved = (f"epochs 1-{self.epoch - 1} are saved in {self.run.out / 'checkpoint.pt'} and metrics.csv"
                 if self.epochs_saved else "no epoch had finished, so nothing was saved")
        return f"{self.run.task.name}: {what}; lower --lr and start a new run ({saved})"

    def close(self) -> None:
        self.bar.close()


def metrics_row(run: Run, epoch: int, metrics: dict, seconds: dict, comm_bytes: int) -> dict:
    """The epoch's metrics.csv row: the task's metrics, the seconds per region, the communication
    columns (and with --log-herding the herding bound)."""
    task = run.task
    row = {"epoch": epoch, **{key: float(metrics[key]) for key in ("train_loss", "test_loss", *task.metric_columns)},
           "epoch_seconds": seconds["epoch"], "sorter_seconds": seconds["sorter"],
           "comm_seconds": seconds["comm"], "compute_seconds": seconds["compute"], "comm_bytes": comm_bytes,
           **communication_stats(run.local, run.reducer, run.steps_per_epoch)}
    if run.herding_log:
        row["herding_bound"] = run.herding_log.bound()
    return row


def save_epoch(run: Run, rows: list[dict], recorded_orders: list) -> None:
    """checkpoint.pt (read back by restore), orders.pt, metrics.csv and the epoch's line on stderr, by
    rank 0; every rank takes part in collecting the optimizer's and reducer's state."""
    strategy_state = run.optimizer.state_dict(), run.reducer.state_dict()  # collectives with local steps / reducers
    if not run.writer:
        return
    row, task, args = rows[-1], run.task, run.args
    with runlog.signals_deferred(), writing(run.out, f"epoch {row['epoch']}'s files"):  # SIGTERM / Ctrl-C now
        write_epoch_files(run, rows, recorded_orders, strategy_state)  # stop the run after all three are written
    shown = " | ".join(f"{key} {row[key]:.4f}" for key in ("train_loss", "test_loss", *task.metric_columns))
    print(f"{task.name} {run.sorter.name} epoch {row['epoch']}/{args.epochs} | {shown} | {row['epoch_seconds']:.1f} s",
          file=sys.stderr, flush=True)


def write_epoch_files(run: Run, rows: list[dict], recorded_orders: list, strategy_state: tuple) -> None:
    """checkpoint.pt, orders.pt (--record-orders) and metrics.csv of the epoch just finished (rank 0);
    strategy_state: the optimizer's and the reducer's state_dict."""
    row, task, args = rows[-1], run.task, run.args
    runlog.atomic_torch_save({
        "benchmark": task.name, "epoch": row["epoch"], "args": dict(vars(args)), "flat": task.model.flat.detach().cpu(),
        "optimizer": strategy_state[0], "reducer": strategy_state[1], "sorter": run.sorter.state_dict(),
        "rows": rows, "orders": recorded_orders, "rng": rng_states(run.device),
    }, run.out / "checkpoint.pt")
    if args.record_orders:
        runlog.atomic_torch_save(recorded_orders, run.out / "orders.pt")
    runlog.write_metrics(run.out / "metrics.csv", rows, task.metric_columns)


def data_parallel_step(task, sorter, exchange, optimizer, unit_ids, positions, timer, herding_log=None):
    """One step of the paper's data-parallel training on the shared parameters; returns the local loss.
    herding_log (--log-herding): keeps this step's per-unit gradients (computed on the side for D-RR & co.)."""
    flat, (n_local, k) = task.model.flat, unit_ids.shape
    batch = task.units(exchange.comm.local_workers, unit_ids)
    real_unit_grads = None  # this step's (n_local, k, d) per-unit gradients, where they were formed
    if sorter.uses_grads and task.sketches_from_records(flat, exchange.sketch):  # --sketch-dim, no (units, d)
        unit_grads, local_mean_grad, unit_losses = task.unit_sketches(flat, batch, n_local, k, exchange.sketch)
        local_loss, aux = unit_losses.mean(), None
    elif sorter.uses_grads:
        unit_grads, unit_losses = task.unit_grads(flat, batch, n_local, k)
        local_mean_grad, local_loss, aux, real_unit_grads = None, unit_losses.mean(), None, unit_grads
    else:
        unit_grads = None
        local_mean_grad, local_loss, aux = task.batch_grad(flat, batch)
    timer.lap("compute")
    update, every_unit_grad = exchange.exchange(unit_grads, local_mean_grad)
    timer.lap("comm")
    if herding_log:  # the real gradients: not the sketches a --sketch-dim sorter gathered
        gathered = every_unit_grad if exchange.sketch is None else None
        herding_log.record(positions.start // k, gathered, lambda: real_unit_grads if real_unit_grads is not None
                           else task.unit_grads(flat, batch, n_local, k)[0])
        timer.lap("compute")
    sorter.step(every_unit_grad, positions)
    del unit_grads, real_unit_grads, every_unit_grad  # (n, k, d) can be GBs: free before the next step computes
    timer.lap("sorter")
    if task.clip_grad_norm:
        update = clip_to_norm(update, task.clip_grad_norm)
    optimizer.step(update)
    task.end_step(aux)
    return local_loss


def sparsified_step(task, sorter, exchange, optimizer, unit_ids, positions, timer):
    """One step on the shared parameters whose gradient average goes through a sparsifying reducer
    (--reducer topk / exdyna: its error feedback needs each worker's own gradient). Returns the local loss."""
    worker_grads, unit_grads, losses = task.worker_gradients(task.model.flat, exchange.comm.local_workers,
                                                             unit_ids, per_unit=sorter.uses_grads)
    timer.lap("compute")
    update = exchange_and_sort(exchange, sorter, unit_grads, worker_grads, positions, timer)
    del unit_grads  # (n_local, k, d): free before the next step computes
    if task.clip_grad_norm:
        update = clip_to_norm(update, task.clip_grad_norm)
    optimizer.step(update)
    return losses.mean()


def local_step(task, sorter, exchange, local, unit_ids, positions, global_step, timer,
               gather_per_round: bool = True):
    """One step of local SGD (`local`: LocalWorkers): each worker steps on its own gradient, and the
    round's last step averages the workers; --sync post-local before its switch: a data-parallel step.
    Returns the local loss.

    The balancing sorters' unit gradients are all-gathered once per round (gather_per_round; at the
    latest every GradientExchange.DEFER_LIMIT_BYTES) or every step: the same bytes and the same
    orders, fewer collectives (bench/gather_batching.py)."""
    worker_grads, unit_grads, losses = task.worker_gradients(local.params, exchange.comm.local_workers, unit_ids,
                                                             per_unit=sorter.uses_grads)
    timer.lap("compute")
    data_parallel = local.data_parallel(global_step)
    if data_parallel:
        gradients = exchange_and_sort(exchange, sorter, unit_grads, worker_grads, positions, timer)
        del unit_grads
    else:
        gradients = worker_grads
    if task.clip_grad_norm:  # per worker with local steps, as the reference clips the local gradient
        gradients = clip_to_norm(gradients, task.clip_grad_norm)
    round_over = local.step(gradients, global_step)
    timer.lap("compute")
    if round_over:
        local.average()
        timer.lap("comm")
    if data_parallel:  # the sorter has had this step's gradients
        return losses.mean()
    if not sorter.uses_grads:
        sorter.step(None, positions)
    elif not gather_per_round:
        sorter.step(exchange.gather_unit_grads(unit_grads), positions)
    elif exchange.defer_unit_grads(unit_grads, positions) or round_over:
        flush_deferred(exchange, sorter, timer)
    timer.lap("sorter")
    return losses.mean()


def exchange_and_sort(exchange, sorter, unit_grads, worker_grads, positions, timer) -> torch.Tensor:
    """Average the workers' gradients worker_grads (n_local, d) through the reducer, and hand every
    worker's unit gradients (unit_grads (n_local, k, d) gathered, or None) to the sorter. Returns the
    average (d,)."""
    update, every_unit_grad = exchange.exchange(unit_grads, None, worker_grads)
    timer.lap("comm")
    sorter.step(every_unit_grad, positions)
    del every_unit_grad
    timer.lap("sorter")
    return update


def flush_deferred(exchange, sorter, timer) -> None:
    """Gather the deferred unit gradients in one collective and hand them to the sorter in step order."""
    gathered = exchange.flush_unit_grads()
    timer.lap("comm")
    for every_unit_grad, positions in gathered:
        sorter.step(every_unit_grad, positions)


CHECKPOINT_KEYS = ("epoch", "args", "flat", "optimizer", "sorter", "rows", "rng")  # what restore() reads


def restore(checkpoint_path, arg_dict, flat, optimizer, sorter, device, reducer=None, benchmark=None):
    """Load a checkpoint into the run's objects; refuse one made with different settings.
    optimizer: the Optimizer, or LocalWorkers with local steps; reducer: engine.reducers' (None: a
    checkpoint without reducer state); benchmark: fills in its defaults of flags a checkpoint predates.
    Returns (metrics rows so far, recorded orders, first epoch to run)."""
    state = load_checkpoint(checkpoint_path)
    made_by = state.get("benchmark") or benchmark_of(state["args"])
    if benchmark and made_by and made_by != benchmark:
        raise UserFacingError(f"cannot resume {checkpoint_path.parent}: its checkpoint.pt is a checkpoint of {made_by}, "
                              f"not {benchmark}; continue it with main-{made_by}.py, or choose another --out")
    # what engine/flags.py says may not change (and --epochs, for the sorters whose thresholds depend on it)
    changed = changed_on_resume(state["args"], arg_dict, benchmark, epochs_fixed=sorter.uses_total_epochs)
    if changed:
        raise UserFacingError(f"cannot resume {checkpoint_path.parent}: these settings differ from the checkpoint: "
                              + describe_changes(changed, most=len(changed)))
    another_version = (f"cannot resume {checkpoint_path.parent}: {{}}; the checkpoint was written by another "
                       "version of the suite, so start a new run (or choose another --out)")
    if not torch.is_tensor(state["flat"]) or state["flat"].shape != flat.shape:
        raise UserFacingError(another_version.format(f"its parameters are not the model's {tuple(flat.shape)}"))
    if not torch.isfinite(state["flat"]).all():
        raise UserFacingError(f"cannot resume {checkpoint_path.parent}: the parameters in its checkpoint.pt are not "
                              "finite (NaN or inf); start a new run (another --out, or --overwrite)")
    flat.copy_(state["flat"])
    try:
        optimizer.load_state_dict(state["optimizer"])
        if reducer is not None and "reducer" in state:  # older checkpoints: dense, nothing to restore
            reducer.load_state_dict(state["reducer"])
        sorter.load_state_dict(state["sorter"])
        set_rng_states(state["rng"], device)
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # e.g. the torchopt-based versions' state
        detail = f"its state lacks {error}" if isinstance(error, KeyError) else error
        raise UserFacingError(another_version.format(detail)) from None
    return state["rows"], state.get("orders", []), state["epoch"] + 1


def load_checkpoint(checkpoint_path) -> dict:
    """checkpoint.pt as a dict holding CHECKPOINT_KEYS; a damaged file or one from elsewhere: one line."""
    # onto the CPU whatever device wrote it: the RNG states must stay CPU tensors, and the
    # load_state_dict methods move flat parameters, optimizer and sorter state to the run's device
    try:
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    except Exception:  # a damaged file fails in many ways (EOFError, UnpicklingError, OSError, RuntimeError)
        raise UserFacingError(f"cannot resume: {checkpoint_path} is unreadable (corrupt or truncated); start a new "
                              f"run with another --out, or delete {checkpoint_path} to start this one afresh") from None
    if not isinstance(state, dict):
        state = {}
    missing = [key for key in CHECKPOINT_KEYS if key not in state or (key == "args" and not isinstance(state[key], dict))]
    if missing:
        raise UserFacingError(f"cannot resume: {checkpoint_path} lacks {', '.join(missing)} (not a checkpoint of this "
                              f"version of the suite); start a new run with another --out, or delete "
                              f"{checkpoint_path} to start this one afresh")
    return state


def communication_stats(local, reducer, steps_per_epoch: int) -> dict:
    """The epoch's metrics.csv communication columns: syncs (averaging steps; every step when
    data-parallel), mean_H (steps per averaging), density (mean fraction of coordinates sent per
    exchange), threshold (ExDyna's lambda at the epoch's end), load_imbalance (ExDyna's padding)."""
    stats = local.epoch_stats() if local is not None else {"syncs": steps_per_epoch, "mean_H": 1.0}
    reduced = reducer.epoch_stats()
    if reducer.name == "dense":
        reduced = {"density": 1.0, "threshold": math.nan, "load_imbalance": 0.0}
    return {**stats, **{key: reduced[key] for key in ("density", "threshold", "load_imbalance")}}


def write_logs(out: Path, rows: list[dict], recorded_orders: list, metric_columns) -> None:
    """metrics.csv from a checkpoint's metrics rows, and orders.pt when it holds recorded orders (rank 0)."""
    if recorded_orders:
        runlog.atomic_torch_save(recorded_orders, out / "orders.pt")
    runlog.write_metrics(out / "metrics.csv", rows, metric_columns)


def rng_states(device) -> dict:
    """The random number generators' states, for the checkpoint; with CUDA also the device's generator."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device) -> None:
    """Restore rng_states(); the CUDA generator only when this run and the checkpoint's both used CUDA."""
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def clip_to_norm(gradient: torch.Tensor, max_norm: float) -> torch.Tensor:
    """(d,) gradient, or (n_local, d) one per worker, each scaled down to L2 norm max_norm when larger
    (torch's clip_grad_norm_ rule)."""
    norm = gradient.norm(dim=-1, keepdim=True)
    return gradient * (max_norm / (norm + 1e-6)).clamp(max=1.0)


class FaultInjection:
    """Test hook. CDGRAB_FAULT=exit:RANK:STEP makes that rank exit abruptly before global step STEP
    (0-based, counted over the whole run); CDGRAB_FAULT=nan:STEP makes every rank see a NaN loss there;
    CDGRAB_FAULT=nan-params:STEP turns the parameters NaN before that step (NaN gradients, as a divergence)."""

    def __init__(self, kind: str | None = None, step: int = -1):
        self.kind, self.step = kind, step

    @classmethod
    def from_environment(cls, rank: int) -> "FaultInjection":
        spec = os.environ.get("CDGRAB_FAULT", "")
        kind, *numbers = spec.split(":") if spec else (None,)
        if kind == "exit" and int(numbers[0]) == rank:
            return cls("exit", int(numbers[1]))
        if kind in ("nan", "nan-params"):
            return cls(kind, int(numbers[0]))
        return cls()

    def before_step(self, global_step: int, flat: torch.Tensor) -> None:
        if self.kind == "exit" and global_step == self.step:
            os._exit(3)
        if self.kind == "nan-params" and global_step == self.step:
            with torch.no_grad():
                flat.fill_(float("nan"))

    def poison(self, local_loss: torch.Tensor, global_step: int) -> torch.Tensor:
        return local_loss + float("nan") if self.kind == "nan" and global_step == self.step else local_loss
