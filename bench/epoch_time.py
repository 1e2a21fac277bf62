"""Seconds per epoch of an entry script for several sorters, measured back to back in one run.

    python bench/epoch_time.py main-LR-HMDA.py --sorters CD-GraB D-RR -- --max-train-examples 32000

Everything after `--` goes to the entry script. Prints each sorter's training seconds per epoch,
its sorter / communication / compute split, and the ratio to the first sorter's epoch time.
"""
import argparse
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="entry script, e.g. main-LR-HMDA.py")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to time")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per sorter (the mean is reported)")
    argv, extra = sys.argv[1:], []
    if "--" in argv:  # everything after -- belongs to the entry script
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sorter in args.sorters:
            out = Path(tmp) / sorter
            subprocess.run([sys.executable, args.script, "--sorter", sorter, "--epochs", str(args.epochs),
                            "--out", str(out), "--progress", "off", *extra], cwd=REPO, check=True)
            with open(out / "metrics.csv") as f:
                epochs = list(csv.DictReader(f))
            rows[sorter] = {key: sum(float(e[key]) for e in epochs) / len(epochs)
                            for key in ("epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds")}
    base = rows[args.sorters[0]]["epoch_seconds"]
    print(f"{'sorter':10} {'epoch s':>9} {'sorter s':>9} {'comm s':>9} {'compute s':>9} {'ratio':>7}")
    for sorter, r in rows.items():
        print(f"{sorter:10} {r['epoch_seconds']:9.2f} {r['sorter_seconds']:9.2f} {r['comm_seconds']:9.2f} "
              f"{r['compute_seconds']:9.2f} {r['epoch_seconds'] / base:7.2f}")


if __name__ == "__main__":
    main()
