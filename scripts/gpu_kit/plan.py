"""The plan, from measured epoch times: where each run goes on from (seed_from_shipped), how long its
epochs take (epoch_estimates), whether it may start (start_refusal) and when it must stop (stop_decision).
Rules over numbers and files; the run step (run.py) applies them."""
import gzip
import json
import os
import shutil
from pathlib import Path

from engine.rundir import metrics_rows  # no torch: the epochs a run's metrics.csv holds
from scripts.gpu_kit.grid import BENCHMARKS

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


def seed_from_shipped(run, shipped: Path) -> str:
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
