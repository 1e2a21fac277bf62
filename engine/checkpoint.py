"""checkpoint.pt and the logs it vouches for: written after every epoch (save_epoch), read back by
--resume (resume, restore). What a checkpoint holds and what reads it change together, so they stand
here side by side: the model's flat parameters, the optimizer's (or the local workers') and the
reducer's state, the sorter's state, the metrics rows, the recorded orders and the random generators.
"""
import contextlib
import errno
import random
import sys
from pathlib import Path

import numpy as np
import torch

from common.errors import UserFacingError
from engine import runlog
from engine.cli import describe_changes
from engine.flags import benchmark_of, changed_on_resume
from engine.run_setup import Run
from engine.rundir import metrics_rows


def save_epoch(run: Run, rows: list[dict], recorded_orders: list) -> None:
    """checkpoint.pt (read back by restore), orders.pt, metrics.csv and the epoch's line on stderr, by
    rank 0; every rank takes part in collecting the optimizer's, reducer's and sorter's state."""
    # collectives with local steps / reducers, and an exact sorter's running sum divided over the processes
    strategy_state = run.optimizer.state_dict(), run.reducer.state_dict(), run.sorter.state_dict()
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
    strategy_state: the optimizer's, the reducer's and the sorter's state_dict."""
    row, task, args = rows[-1], run.task, run.args
    runlog.atomic_torch_save({
        "benchmark": task.name, "epoch": row["epoch"], "args": dict(vars(args)), "flat": task.model.flat.detach().cpu(),
        "optimizer": strategy_state[0], "reducer": strategy_state[1], "sorter": strategy_state[2],
        "rows": rows, "orders": recorded_orders, "rng": rng_states(run.device),
    }, run.out / "checkpoint.pt")
    if args.record_orders:
        runlog.atomic_torch_save(recorded_orders, run.out / "orders.pt")
    runlog.write_metrics(run.out / "metrics.csv", rows, task.metric_columns)


def rng_states(device) -> dict:
    """The random number generators' states, for the checkpoint; with CUDA also the device's generator."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


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


def set_rng_states(states: dict, device) -> None:
    """Restore rng_states(); the CUDA generator only when this run and the checkpoint's both used CUDA."""
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def write_logs(out: Path, rows: list[dict], recorded_orders: list, metric_columns) -> None:
    """metrics.csv from a checkpoint's metrics rows, and orders.pt when it holds recorded orders (rank 0)."""
    if recorded_orders:
        runlog.atomic_torch_save(recorded_orders, out / "orders.pt")
    runlog.write_metrics(out / "metrics.csv", rows, metric_columns)


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

