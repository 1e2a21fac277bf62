"""One device call, whole (python scripts/gpu_session.py --out "$OUT"): the steps of the kit in the order
a lent machine's call needs them, each of them in its own module."""
import subprocess
import time
from pathlib import Path

from scripts.gpu_kit.base import ROOT, log
from scripts.gpu_kit.checks import run_checks, wait_tests
from scripts.gpu_kit.data import check_inputs, unpack_data
from scripts.gpu_kit.pack import Packer
from scripts.gpu_kit.plan import TINY_EPOCH_SECONDS, epoch_estimates, seed_from_shipped
from scripts.gpu_kit.run import Run, Stop, record_runs, run_queue, stop_all


def device_description(device: str) -> str:
    if device != "cuda":
        return "cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "cuda"


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


def session(args, queue: list) -> None:
    """Checks, plan, runs and packing of one call (args: scripts/gpu_session.py's flags; queue: the QUEUE
    entries to run, most valuable first)."""
    started = time.monotonic()
    # the runs stop --pack-seconds before the deadline: what is left is for their stop at an epoch end
    # (--grace at most) and the last pack, which must be in $OUT before the device tool ends the call
    stop_at = started + args.deadline - args.pack_seconds
    work, out = Path(args.work), Path(args.out)
    # from here on SIGTERM (how the device tool ends a call) stops the runs and packs instead of killing
    # the kit with every epoch since the last pack
    stop = Stop()
    stop.install()
    work.mkdir(parents=True, exist_ok=True)
    if args.data_archive:  # the machine starts bare: the data sets travel as one archive (--pack-data)
        unpack_data(Path(args.data_archive), Path(args.data_dir))
    check_inputs(args)  # missing data or no GPU: one line now, not a run that fails minutes in
    # the plan before anything runs: where each run goes on from (this machine's checkpoint, a shipped one,
    # or none) and how long its epochs take
    runs, manifest = prepare(args, queue, work)
    packer = Packer(work, out)
    packer.pack(runs, manifest)  # $OUT holds the session record from the start
    # the checks run before the queue: the LSTM check decides the LSTM runs' --cudnn, and the bench and
    # the profile must have the GPU to themselves (the CUDA tests then run beside the runs)
    checks, tests = run_checks(args, work, stop)
    manifest["checks"] = checks
    packer.pack(runs, manifest)  # the bench and the profile come back even if the call is cut now
    run_queue(args, runs, manifest, packer, stop, stop_at, checks["lstm_cudnn"])
    stop_all(runs, args.grace)  # the runs the stop rule left running (or all, after SIGTERM), at an epoch end
    if tests is not None:
        # the tests get what is left before the deadline's last 10 s, at most half the packing time; after
        # SIGTERM a second only: the device tool is ending the call
        budget = 1.0 if stop.asked else max(1.0, started + args.deadline - 10 - time.monotonic())
        manifest["tests_exit"] = wait_tests(tests, work, min(budget, args.pack_seconds / 2))
    record_runs(manifest, runs)
    manifest["wall_seconds"] = round(time.monotonic() - started, 1)
    manifest["stopped_by"] = stop.asked
    packer.pack(runs, manifest)  # the last pack: every run stopped, its last epoch-end checkpoint taken
    done = sum(r.finished() for r in runs)
    log(f"{done}/{len(runs)} runs finished; {time.monotonic() - started:.0f} s of the {args.deadline:.0f} s deadline")
