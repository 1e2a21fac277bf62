"""The training loop shared by every benchmark: train() runs the epochs, train_epoch() the steps.

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

Around the loop: engine/run_setup.py builds what a run is made of (Run), engine/steps.py holds the three
kinds of step, engine/checkpoint.py saves and restores the epochs, engine/progress.py says how far the
run is and times it, engine/entry.py runs an entry script around train().
"""
import contextlib
import math
import os
import time
from pathlib import Path

import torch

from common.errors import UserFacingError
from engine import runlog
from engine.checkpoint import resume, save_epoch, writing
from engine.overlap import BackgroundSorter
from engine.progress import LossCheck, ProgressLines, RegionTimer, progress_mode, say, start_line
from engine.run_setup import Run, build_run, run_config
from engine.rundir import RunFinished, check_run_folder
from engine.steps import data_parallel_step, exact_records_step, flush_deferred, local_step, sparsified_step
from sorters import NonFiniteGradientError


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
    begin_segment(run, first_epoch)
    progress = ProgressLines(run, first_epoch) if progress_mode(args, run.writer) == "lines" else None
    end = f"{task.name}: done: {run.out} (after epoch {args.epochs})"
    for epoch in range(first_epoch, args.epochs + 1):
        bytes_before = run.comm_bytes()
        orders, seconds = train_epoch(run, epoch, epochs_saved=bool(rows), progress=progress)
        metrics = evaluate(run, epoch, progress)
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
    end_segment(run, len(rows))
    say(run, end)
    return rows


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
    seconds = finish_epoch(run, timer)
    seconds["epoch"] = time.perf_counter() - epoch_start
    return orders, seconds


def finish_epoch(run: Run, timer: RegionTimer) -> dict:
    """What the epoch's end owes before evaluation: the deferred unit gradients to the sorter, the local
    workers' last averaging. Returns the seconds per region."""
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
    return seconds


def take_step(run: Run, local_orders, step: int, global_step: int, timer):
    """Step `step` of the epoch (0-based) with the strategy the run uses: each local worker takes its
    units local_orders[:, step*k:(step+1)*k] (local_orders (n_local, m)). Returns the local loss (a scalar, or
    the local losses whose mean it is: data_parallel_step)."""
    k = run.task.units_per_step
    unit_ids, positions = local_orders[:, step * k:(step + 1) * k], range(step * k, (step + 1) * k)
    if run.local is not None:
        return local_step(run.task, run.sorter, run.exchange, run.local, unit_ids, positions, global_step,
                          timer, run.args.unit_grad_gather == "round")
    if run.exact is not None:
        return exact_records_step(run.task, run.sorter, run.exchange, run.optimizer, run.exact, unit_ids, positions,
                                  timer)
    if run.per_worker_grads:
        return sparsified_step(run.task, run.sorter, run.exchange, run.optimizer, unit_ids, positions, timer)
    return data_parallel_step(run.task, run.sorter, run.exchange, run.optimizer, unit_ids, positions, timer,
                              run.herding_log)


def evaluate(run: Run, epoch: int, progress) -> dict:
    """The task's metrics after `epoch`, without autograd (announced and timed by the progress lines)."""
    with torch.no_grad(), (progress.evaluating(epoch) if progress else contextlib.nullcontext()):
        return run.task.evaluate(run.task.model.flat, run.comm)


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


def communication_stats(local, reducer, steps_per_epoch: int) -> dict:
    """The epoch's metrics.csv communication columns: syncs (averaging steps; every step when
    data-parallel), mean_H (steps per averaging), density (mean fraction of coordinates sent per
    exchange), threshold (ExDyna's lambda at the epoch's end), load_imbalance (ExDyna's padding)."""
    stats = local.epoch_stats() if local is not None else {"syncs": steps_per_epoch, "mean_H": 1.0}
    reduced = reducer.epoch_stats()
    if reducer.name == "dense":
        reduced = {"density": 1.0, "threshold": math.nan, "load_imbalance": 0.0}
    return {**stats, **{key: reduced[key] for key in ("density", "threshold", "load_imbalance")}}


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


def begin_segment(run: Run, first_epoch: int) -> None:
    """config.json (rank 0) with this start of the run as its newest segment: a resumed run keeps the
    earlier segments, since they describe how the earlier epochs were made."""
    if run.writer:
        with writing(run.out, "config.json"):
            runlog.write_config(run.out / "config.json",
                                runlog.with_segment(run.out / "config.json", run_config(run), first_epoch))


def end_segment(run: Run, epochs_done: int) -> None:
    """Mark in config.json (rank 0) the epoch this start of the run ended after."""
    if run.writer:
        with writing(run.out, "config.json"):
            runlog.end_segment(run.out / "config.json", epochs_done)
