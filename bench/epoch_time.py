"""Seconds per epoch and peak memory of an entry script for several sorters, measured back to back in one run.

    OMP_NUM_THREADS=1 python bench/epoch_time.py main-LR-HMDA.py --sorters D-RR CD-GraB -- --max-train-examples 64000

Everything after `--` goes to the entry script. Each round runs every sorter once (a fresh run of
--epochs epochs, in a process of its own), so sorters take turns and a slow patch of a shared machine
hits them alike; each number is the median over the rounds of the training seconds of epoch --epoch
(evaluation excluded; epoch 1 also pays one-off costs such as compiling the sign loop, and Greedy builds
its first order at the start of epoch 2, so compare sorters at epoch 2 or later). Peak memory is each
run's own peak resident set size (its ru_maxrss, read when the bench reaps it): the whole process over
its whole run (start-up, data, every epoch and evaluation), median over the rounds. Prints ONE JSON
object: per sorter the epoch's seconds and its sorter / comm / compute split and the peak memory, and
each sorter's seconds and peak memory over the first sorter's, with the commit measured and the load
average before and after.

A sorter given as NAME:ARGS runs with ARGS (split as a shell would) after the entry script's arguments,
e.g. Greedy on MLP-M4 as its runs are made: `--sorters D-RR Greedy:--sketch-dim=64 -- ...`; the JSON
keys it by the whole spec.

    ... --record bench/results/cpu-epochs.json --label "MLP-M4 --max-train-examples 32000 (32 workers, B 32)"

also writes the run into that file's "runs" under the label (replacing a run of the same label, keeping
the others; the other runs keep the commit they were measured on). The leaderboard (analysis/aggregate.py)
takes its seconds and memory ratios from bench/results/leaderboard-cpu.json's run labelled by the
benchmark's name (e.g. "LR-HMDA"), recorded with the benchmark's paper settings.
"""
import argparse
import csv
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds")


# ru_maxrss's unit: KiB on Linux, bytes on macOS
RSS_UNIT_BYTES = 1 if sys.platform == "darwin" else 1024


class BenchError(Exception):
    """A run of the entry script failed; the message is one line that says which and why."""


def sorter_spec(spec: str) -> tuple[str, list[str]]:
    """A --sorters entry, NAME or NAME:ARGS, as (NAME, ARGS split as a shell would)."""
    name, _, args = spec.partition(":")
    return name, shlex.split(args)


def run_child(command: list[str], log: Path) -> int:
    """Run `command` from the checkout, its output into `log`; the child's peak resident set size in KiB
    (os.wait4 reaps it and returns that child's rusage, not this process's or the other children's; its
    ru_maxrss counts from what this process held when the child started: checkout_facts). A failed
    command raises BenchError with the last line it printed."""
    with open(log, "w+") as output:
        child = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        if child.returncode:
            output.seek(0)
            last = ([line.strip() for line in output if line.strip()] or ["(no output)"])[-1]
            raise BenchError(f"{shlex.join(command[1:])} exited with {child.returncode}: {last}")
    return usage.ru_maxrss * RSS_UNIT_BYTES // 1024


def own_peak_rss_kib() -> int | None:
    """This process's own memory's peak resident set size in KiB (VmHWM: not its ru_maxrss, which starts
    at what the process that started this one held); None where /proc/self/status lacks it (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in lines if line.startswith("VmHWM:")), None)


def one_run(script: str, spec: str, epochs: int, extra: list[str], out: Path) -> tuple[dict, int]:
    """Train sorter_spec(spec) for `epochs` epochs; (the metrics rows as {epoch: {column: seconds}}, the
    run's peak resident set size in KiB)."""
    name, sorter_args = sorter_spec(spec)
    peak_kib = run_child([sys.executable, script, "--sorter", name, "--epochs", str(epochs), "--out", str(out),
                          "--progress", "off", *extra, *sorter_args], out.parent / f"{out.name}.log")
    with open(out / "metrics.csv") as f:
        rows = {int(row["epoch"]): {key: float(row[key]) for key in COLUMNS} for row in csv.DictReader(f)}
    return rows, peak_kib


def checkout_facts() -> dict:
    """{"sorters": the library's sorter names, "commit": measured_commit()}, read in a child process. Both
    import torch, and this process must stay small: a child's ru_maxrss starts at what the mm it is exec'd
    from held (this process's peak, when started with vfork), so this process's peak is a floor under
    every run's measured peak (recorded as bench_process_peak_rss_mib: own_peak_rss_kib)."""
    code = ("import importlib.util, json, sys; "
            "spec = importlib.util.spec_from_file_location('epoch_time', sys.argv[1]); "
            "bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench); "
            "from sorters.registry import SORTER_NAMES; "
            "print(json.dumps({'sorters': list(SORTER_NAMES), 'commit': bench.measured_commit()}))")
    out = subprocess.run([sys.executable, "-c", code, __file__], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def check_sorters(parser: argparse.ArgumentParser, specs: list[str], names: list[str]) -> None:
    """One line (exit 2) for a spec whose name is not in `names` (the library's sorters), or a spec given
    twice."""
    for spec in specs:
        if sorter_spec(spec)[0] not in names:
            parser.error(f"--sorters: {spec!r} names no sorter; give NAME or NAME:ARGS with NAME one of "
                         f"{', '.join(names)}")
    if len(set(specs)) < len(specs):
        parser.error(f"--sorters: a sorter is given twice in {' '.join(specs)}; give each once")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="entry script, e.g. main-LR-HMDA.py")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to time; the first "
                        "is the reference of the ratios. NAME:ARGS gives that sorter's runs ARGS too (after the "
                        "entry script's, split as a shell would), e.g. Greedy:--sketch-dim=64")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run")
    parser.add_argument("--epoch", type=int, default=None, help="the epoch reported (default: the last); 2 or "
                        "later to include Greedy's sort, which starts at epoch 2")
    parser.add_argument("--rounds", type=int, default=3, help="runs per sorter, interleaved; medians reported")
    parser.add_argument("--record", type=Path, default=None, help="also write the result into this JSON file's "
                        "\"runs\" (e.g. bench/results/cpu-epochs.json), under --label")
    parser.add_argument("--label", default=None, help="the run's key in --record's file (required with --record); "
                        "in bench/results/leaderboard-cpu.json the benchmark's name, e.g. LR-HMDA")
    argv, extra = sys.argv[1:], []
    if "--" in argv:  # everything after -- belongs to the entry script
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    epoch = args.epoch or args.epochs
    if not 1 <= epoch <= args.epochs or args.rounds < 1:
        parser.error(f"need 1 <= --epoch <= --epochs and --rounds >= 1, got {epoch}, {args.epochs}, {args.rounds}")
    if args.record is not None and not args.label:
        parser.error("--record needs --label (the run's key in the file)")
    facts = checkout_facts()
    check_sorters(parser, args.sorters, facts["sorters"])
    samples = {sorter: [] for sorter in args.sorters}
    peaks = {sorter: [] for sorter in args.sorters}
    load_before, commit = os.getloadavg(), facts["commit"]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for number, sorter in enumerate(args.sorters):
                try:
                    rows, peak_kib = one_run(args.script, sorter, args.epochs, extra, Path(tmp) / f"{number}-{round_}")
                except BenchError as error:
                    print(f"epoch_time: sorter {sorter}: {error} (run that command alone to see all of its output)",
                          file=sys.stderr)
                    sys.exit(2)
                samples[sorter].append(rows[epoch])
                peaks[sorter].append(peak_kib)
    medians = {sorter: {key: round(statistics.median(row[key] for row in rows), 4) for key in COLUMNS}
               for sorter, rows in samples.items()}
    peak_mib = {sorter: round(statistics.median(values) / 1024, 1) for sorter, values in peaks.items()}
    own_kib = own_peak_rss_kib()
    base, base_mib = medians[args.sorters[0]]["epoch_seconds"], peak_mib[args.sorters[0]]
    result = {
        "script": args.script, "entry_args": extra, "epochs": args.epochs, "epoch_reported": epoch,
        "rounds": args.rounds, "seconds": medians,
        "ratio_to_first": {sorter: round(m["epoch_seconds"] / base, 3) for sorter, m in medians.items()},
        "sorter_args": {sorter: sorter_spec(sorter)[1] for sorter in args.sorters},
        "peak_rss_mib": peak_mib,
        "peak_rss_ratio_to_first": {sorter: round(mib / base_mib, 3) for sorter, mib in peak_mib.items()},
        "peak_rss_is": "each run's own peak resident set size (ru_maxrss from os.wait4): the whole process over its "
                       "whole run, start-up and evaluation included; MiB, median over the rounds",
        "bench_process_peak_rss_mib": None if own_kib is None else round(own_kib / 1024, 1),  # under each peak
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
