"""What a run says while it runs, and where its time goes: none of it changes what is trained.

say / start_line: the lines rank 0 prints; progress_mode: a tqdm bar, plain lines (ProgressLines, for
logs) or nothing; LossCheck: the training loss read on the host every LOSS_CHECK_EVERY steps, which stops
a diverged run and feeds the bar or the lines; RegionTimer: seconds per region of the step loop (the
sorter, communication, compute), for metrics.csv.
"""
import contextlib
import math
import os
import sys
import time

import torch
from tqdm import tqdm

from common.errors import UserFacingError
from engine.cli import PROGRESS_EVERY_SECONDS
from engine.run_setup import Run

# steps between host reads (and the finiteness check) of the training loss: a read waits for the device
# to finish the queued steps (and, under torchrun, for every process), so it is not done every step
LOSS_CHECK_EVERY = 50


def say(run: Run, line: str) -> None:
    """One line on stderr, by the writing rank (rank 0) only."""
    if run.writer:
        print(line, file=sys.stderr, flush=True)


def start_line(run: Run, first_epoch: int) -> str:
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

    def __init__(self, run: Run, first_epoch: int):
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
        """local_loss: this process's mean loss of 0-based step `step` (a device scalar), or the losses whose
        mean it is (the local units' (n_local, k): summed as they are, averaged at the check, one kernel a
        step instead of two)."""
        if self.loss_sum.shape != local_loss.shape:  # summed so far as the mean of every element: the same mean
            self.loss_sum = self.loss_sum.mean() + torch.zeros(local_loss.shape, dtype=torch.float64,
                                                               device=self.loss_sum.device)
        self.loss_sum += local_loss
        if not (step + 1) % LOSS_CHECK_EVERY or step + 1 == self.run.steps_per_epoch:
            self.check(step)
        if self.progress:  # a clock read per step; the loss as of its last host read (no extra sync)
            self.progress.step(self.epoch, step, self.epoch_loss / self.checked_step if self.checked_step else None)

    def check(self, step: int) -> None:
        """Read the loss summed since the last check (steps checked_step..step, 0-based) on the host."""
        # the only host read of the loss: all processes check the same steps, so they stop together
        comm, n_local = self.run.comm, len(self.run.comm.local_workers)
        local = self.loss_sum if self.loss_sum.dim() == 0 else self.loss_sum.mean()  # the steps' means, summed
        window_loss = comm.all_reduce_sum((local * n_local).reshape(1, 1)).item() / self.run.task.n_workers
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

