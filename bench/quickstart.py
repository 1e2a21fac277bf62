"""Wall and CPU seconds of README.md's set-up and quick-start commands, as the README gives them.

    CDGRAB_DATA=../shared/data python bench/quickstart.py --full --torchrun-epochs 2 > bench/results/quickstart-cpu.json

Runs, one after another, from the checkout (each run's --out in a temporary folder, so results/ is left
alone): `python -m pip install -q -r requirements.txt` (everything already installed: what a rerun of
the set-up costs), the smoke run with OMP_NUM_THREADS=1 and again with torch's default threads (the
README's reason for the export), with --full the paper's 50-epoch one-process run, with
--torchrun-epochs E the torchrun command cut to E epochs (a 50-epoch torchrun run is an estimate from
it), then `python -m analysis` over the runs made. Prints ONE JSON object: per command its argv, wall
seconds, CPU seconds (its processes' user + system time) and the metrics.csv epoch_seconds, with the
machine's cores and its load average before and after.
"""
import argparse
import csv
import datetime
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["main-LR-HMDA.py", "--sorter", "D-RR", "--epochs", "2", "--max-train-examples", "8000"]
FULL = ["main-LR-HMDA.py", "--sorter", "CD-GraB", "--seed", "0"]


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input: one line on stderr and exit status 2."""

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def timed_in(argv: list[str], env: dict, out: Path | None = None, tmp: str = "") -> dict:
    """Run argv from the checkout; its wall and CPU seconds, and its run's epoch_seconds when out is given
    (argv is reported with `python` for this interpreter and TMP for the temporary folder `tmp`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    shown = ["python", *(word.replace(tmp, "TMP") if tmp else word for word in argv[1:])]
    result = {"argv": " ".join(shown), "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2)}
    if out is not None:
        with open(out / "metrics.csv") as f:
            epochs = [float(row["epoch_seconds"]) for row in csv.DictReader(f)]
        result["epoch_seconds"] = [round(seconds, 3) for seconds in epochs]
        result["median_epoch_seconds"] = round(statistics.median(epochs), 3)
    return result


def main():
    parser = OneLineErrorParser(prog="python bench/quickstart.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="also the paper's 50-epoch one-process run (minutes)")
    parser.add_argument("--torchrun-epochs", type=int, default=0, metavar="E",
                        help="also the torchrun command (4 processes), cut to E epochs (default 0: not run)")
    args = parser.parse_args()
    if args.torchrun_epochs < 0:
        parser.error(f"--torchrun-epochs must be 0 or more, got {args.torchrun_epochs}")
    if not (Path(os.environ.get("CDGRAB_DATA", REPO / "datasets")) / "hmda").is_dir():
        parser.error("no hmda/ under $CDGRAB_DATA (else ./datasets): set CDGRAB_DATA (README's set-up)")
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    default_threads = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    python = sys.executable
    sys.path.insert(0, str(REPO))
    from engine.runlog import head_commit

    report = {
        "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), "
                   f"torch {__import__('torch').__version__}",
        "date": datetime.date.today().isoformat(),
        "git_commit": head_commit(short=True),  # "unknown commit" without a git checkout
        "command": "python bench/quickstart.py " + " ".join(sys.argv[1:]),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "results" / "LR-HMDA"
        timed = functools.partial(timed_in, tmp=tmp)
        report["pip_install_requirements"] = timed(
            [python, "-m", "pip", "install", "-q", "-r", "requirements.txt"], one_thread)
        report["smoke_run"] = timed([python, *SMOKE, "--out", str(runs / "smoke")], one_thread, runs / "smoke")
        report["smoke_run_default_threads"] = timed([python, *SMOKE, "--out", str(runs / "smoke-threads")],
                                                    default_threads, runs / "smoke-threads")
        if args.full:
            report["full_run"] = timed([python, *FULL, "--out", str(runs / "full")], one_thread, runs / "full")
        if args.torchrun_epochs:
            report["torchrun"] = timed([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                                        *FULL, "--epochs", str(args.torchrun_epochs), "--out",
                                        str(runs / "torchrun")], one_thread, runs / "torchrun")
            # the full 50 epochs, estimated: the cut run's wall time per epoch, start-up included
            report["torchrun"]["estimated_50_epoch_wall_seconds"] = round(
                report["torchrun"]["wall_seconds"] * 50 / args.torchrun_epochs)
        report["analysis"] = timed([python, "-m", "analysis", str(runs.parent), "--out", str(Path(tmp) / "figures")],
                                   one_thread)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
