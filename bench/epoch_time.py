"""Seconds per epoch of an entry script for several sorters, measured back to back in one run.

    OMP_NUM_THREADS=1 python bench/epoch_time.py main-LR-HMDA.py --sorters D-RR CD-GraB -- --max-train-examples 64000

Everything after `--` goes to the entry script. Each round runs every sorter once (a fresh run of
--epochs epochs, in a process of its own), so sorters take turns and a slow patch of a shared machine
hits them alike; each number is the median over the rounds of the training seconds of epoch --epoch
(evaluation excluded; epoch 1 also pays one-off costs such as compiling the sign loop). Prints ONE JSON
object: per sorter the epoch's seconds and its sorter / comm / compute split, and the ratio of each
sorter's seconds to the first sorter's, with the commit measured and the load average before and after.

    ... --record bench/results/cpu-epochs.json --label "MLP-M4 --max-train-examples 32000 (32 workers, B 32)"

also writes the run into that file's "runs" under the label (replacing a run of the same label, keeping
the others; the other runs keep the commit they were measured on).
"""
import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds")


def one_run(script: str, sorter: str, epochs: int, extra: list[str], out: Path) -> dict:
    """Train `sorter` for `epochs` epochs; the metrics rows, as {epoch: {column: seconds}}."""
    subprocess.run([sys.executable, script, "--sorter", sorter, "--epochs", str(epochs), "--out", str(out),
                    "--progress", "off", *extra], cwd=REPO, check=True, stderr=subprocess.DEVNULL)
    with open(out / "metrics.csv") as f:
        return {int(row["epoch"]): {key: float(row[key]) for key in COLUMNS} for row in csv.DictReader(f)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="entry script, e.g. main-LR-HMDA.py")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to time; the first "
                        "is the reference of the ratios")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run")
    parser.add_argument("--epoch", type=int, default=None, help="the epoch reported (default: the last)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per sorter, interleaved; medians reported")
    parser.add_argument("--record", type=Path, default=None, help="also write the result into this JSON file's "
                        "\"runs\" (e.g. bench/results/cpu-epochs.json), under --label")
    parser.add_argument("--label", default=None, help="the run's key in --record's file (required with --record)")
    argv, extra = sys.argv[1:], []
    if "--" in argv:  # everything after -- belongs to the entry script
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    epoch = args.epoch or args.epochs
    if not 1 <= epoch <= args.epochs or args.rounds < 1:
        parser.error(f"need 1 <= --epoch <= --epochs and --rounds >= 1, got {epoch}, {args.epochs}, {args.rounds}")
    if args.record is not None and not args.label:
        parser.error("--record needs --label (the run's key in the file)")
    samples = {sorter: [] for sorter in args.sorters}
    load_before, commit = os.getloadavg(), measured_commit()
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for sorter in args.sorters:
                rows = one_run(args.script, sorter, args.epochs, extra, Path(tmp) / f"{sorter}-{round_}")
                samples[sorter].append(rows[epoch])
    medians = {sorter: {key: round(statistics.median(row[key] for row in rows), 4) for key in COLUMNS}
               for sorter, rows in samples.items()}
    base = medians[args.sorters[0]]["epoch_seconds"]
    result = {
        "script": args.script, "entry_args": extra, "epochs": args.epochs, "epoch_reported": epoch,
        "rounds": args.rounds, "seconds": medians,
        "ratio_to_first": {sorter: round(m["epoch_seconds"] / base, 3) for sorter, m in medians.items()},
        "git_commit": commit, "date": datetime.date.today().isoformat(),
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "cpus": os.cpu_count(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    print(json.dumps(result, indent=1))
    if args.record is not None:
        record(args.record, args.label, result, args.sorters)


def measured_commit() -> str:
    """The checked-out commit, with "-dirty" when code differs from it: changes under bench/results/ (what
    this bench writes) do not count. "unknown commit" without a git checkout (engine.runlog)."""
    sys.path.insert(0, str(REPO))
    from engine import runlog

    head = runlog.head_commit()
    changed = runlog.run_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results",
                             text=True)
    if head == runlog.UNKNOWN_COMMIT or changed is None or changed.returncode:
        return runlog.UNKNOWN_COMMIT
    return head + ("-dirty" if changed.stdout.strip() else "")


def record(path: Path, label: str, result: dict, sorters: list[str]) -> None:
    """Write `result` into path's "runs" under `label` (the file's other runs kept), with the ratio of each
    later sorter to the first as "SORTER/FIRST". Runs recorded before the file kept per-run commits take
    the file's top-level "git_commit" and "date" into their own entry first."""
    report = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    inherited = {key: report.pop(key) for key in ("git_commit", "date") if key in report}
    for run in report["runs"].values():
        for key, value in inherited.items():
            run.setdefault(key, value)
    ratios = {f"{sorter}/{sorters[0]}": result["ratio_to_first"][sorter] for sorter in sorters[1:]}
    report["runs"][label] = {**result, **ratios}
    path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
