"""Seconds per epoch of each communication strategy against every-step, back to back in one run.

    OMP_NUM_THREADS=1 CDGRAB_DATA=../shared/data python bench/communication.py    # MLP-M4, 4 workers, B 16
    python bench/communication.py --script main-LR-HMDA.py -- --max-train-examples 64000

For every sorter and every strategy (every-step, constant H = 4, QSR, each with the dense and the ExDyna
reducer) one short run of the entry script; the rounds are interleaved (strategy A, B, ..., then A, B, ...
again) so that a change in the machine's load hits every strategy alike, and the median epoch time per
strategy is divided by the median of every-step + dense of the same sorter. Prints one JSON object:
    {"<sorter>": {"<sync>+<reducer>": {"epoch_seconds": s, "ratio": r, "comm_seconds": c,
                                        "megabytes_per_epoch": b, "syncs_per_epoch": n}, ...}, ...,
     "settings": {...}}
Everything after `--` goes to every run (after the defaults below, so it overrides them).
"""
import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "every-step+dense": [],
    "constant+dense": ["--sync", "constant", "--H", "4"],
    "qsr+dense": ["--sync", "qsr", "--H-base", "4", "--alpha", "0.002"],
    "every-step+exdyna": ["--reducer", "exdyna", "--density", "0.01"],
    "constant+exdyna": ["--sync", "constant", "--H", "4", "--reducer", "exdyna", "--density", "0.01"],
    "qsr+exdyna": ["--sync", "qsr", "--H-base", "4", "--alpha", "0.002", "--reducer", "exdyna", "--density", "0.01"],
}
DEFAULTS = ["--node_cnt", "4", "--B", "16", "--lr", "1e-3", "--lr-schedule", "cosine", "--max-train-examples", "16000",
            "--max-eval-examples", "500"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", default="main-MLP-M4.py", help="entry script")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to time")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every strategy")
    argv, extra = sys.argv[1:], []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    epochs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for sorter in args.sorters:
                for name, flags in STRATEGIES.items():
                    out = Path(tmp) / f"{sorter}-{name}-{round_}"
                    run = subprocess.run([sys.executable, args.script, "--sorter", sorter, "--epochs", "1", "--out",
                                          str(out), "--progress", "off", *DEFAULTS, *flags, *extra], cwd=REPO,
                                         stderr=subprocess.PIPE, text=True)
                    if run.returncode:
                        sys.exit(f"{sorter} {name} failed: {run.stderr.strip().splitlines()[-1]}")
                    with open(out / "metrics.csv") as f:
                        epochs.setdefault((sorter, name), []).append(next(csv.DictReader(f)))
    result = {}
    for sorter in args.sorters:
        median = {name: {key: statistics.median(float(row[key]) for row in epochs[sorter, name])
                         for key in ("epoch_seconds", "comm_seconds", "comm_bytes", "syncs")} for name in STRATEGIES}
        base = median["every-step+dense"]["epoch_seconds"]
        result[sorter] = {name: {"epoch_seconds": round(m["epoch_seconds"], 3), "ratio": round(m["epoch_seconds"] / base, 3),
                                 "comm_seconds": round(m["comm_seconds"], 3),
                                 "megabytes_per_epoch": round(m["comm_bytes"] / 1e6, 3),
                                 "syncs_per_epoch": int(m["syncs"])} for name, m in median.items()}
    result["settings"] = {"script": args.script, "args": DEFAULTS + extra, "rounds": args.rounds, "epochs_per_run": 1}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
