"""Seconds per epoch of each communication strategy against every-step, back to back in one run.

    OMP_NUM_THREADS=1 CDGRAB_DATA=../shared/data python bench/communication.py    # LR-HMDA and MLP-M4
    python bench/communication.py --scripts main-MLP-M4.py --rounds 5 -- --max-train-examples 32000

For every benchmark, every sorter and every strategy (every-step, constant H = 4, QSR, each with the
dense and the ExDyna reducer, density 0.01, 0.25 for LR-HMDA's d = 26; and constant H = 4 through the
general torch.func path, --unit-grads vmap, the way every local step went before engine/linear_stack.py)
one epoch of the entry script's task, 4 workers, B 16, trained by engine.train.train in this process
(the entry script's own parser, checks and task; one process, as `python main-*.py`). A warm-up round
on a few steps first runs every code path once (numba's compilation, first-call imports: costs of a
process, not of an epoch); then the rounds are interleaved (strategy A, B, ..., then A, B, ... again)
so that a change in the machine's load hits every strategy alike. Per strategy the median over the
rounds of the epoch's CPU seconds (this process's CPU time over the span metrics.csv's epoch_seconds
times: single-threaded, it is the wall time of an idle machine, and other processes on a shared machine
barely move it) and of its wall seconds, each divided by the same of every-step + dense of the same
benchmark and sorter. Writes ONE JSON object to --out (and prints it), then the table in markdown:
    {"<benchmark>": {"<sorter>": {"<sync>+<reducer>": {"epoch_cpu_seconds": s, "ratio": r,
        "epoch_seconds": wall s, "ratio_wall": r, "comm_seconds": c, "megabytes_per_epoch": b,
        "syncs_per_epoch": n}, ...}}, ..., "settings": {...}}
Everything after `--` goes to every run (after the defaults below, so it overrides them).
"""
import argparse
import functools
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from engine.cli import check_args  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from common.errors import UserFacingError  # noqa: E402
from engine.runlog import write_result  # noqa: E402
from engine.train import train  # noqa: E402

STRATEGIES = {  # {density}: ExDyna's target density, per benchmark (below)
    "every-step+dense": [],
    "constant+dense": ["--sync", "constant", "--H", "4"],
    "qsr+dense": ["--sync", "qsr", "--H-base", "4", "--alpha", "0.002"],
    "every-step+exdyna": ["--reducer", "exdyna", "--density", "{density}"],
    "constant+exdyna": ["--sync", "constant", "--H", "4", "--reducer", "exdyna", "--density", "{density}"],
    "qsr+exdyna": ["--sync", "qsr", "--H-base", "4", "--alpha", "0.002", "--reducer", "exdyna", "--density", "{density}"],
    "constant+dense (vmap)": ["--sync", "constant", "--H", "4", "--unit-grads", "vmap"],
}
DEFAULTS = ["--node_cnt", "4", "--B", "16", "--lr", "1e-3", "--lr-schedule", "cosine"]
# per script: enough steps for an epoch of a second or more on one core (LR-HMDA's steps are short), and
# ExDyna's density: LR-HMDA's d = 26 needs at least one coordinate per worker (26 * 0.25 = 6 for 4 workers)
SCRIPTS = {
    "main-MLP-M4.py": (["--max-train-examples", "16000", "--max-eval-examples", "500"], "0.01"),
    "main-LR-HMDA.py": (["--max-train-examples", "64000", "--max-eval-examples", "2000"], "0.25"),
}
WARM_UP_EXAMPLES = "640"  # the warm-up round's --max-train-examples: 40 steps


def entry_point(script: str):
    """(parser, build_task, benchmark) of an entry script, its data loaders cached (every run of a
    benchmark reads the same files; the tasks copy what they keep)."""
    spec = importlib.util.spec_from_file_location(script[:-3].replace("-", "_"), REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("load_m4", "load_hmda"):
        if hasattr(module, name):
            setattr(module, name, functools.lru_cache(getattr(module, name)))
    captured = {}
    module.run_entry_point = lambda benchmark, parser, build: captured.update(benchmark=benchmark, parser=parser,
                                                                             build=build)
    module.main()  # builds the parser and hands it to (our) run_entry_point
    return captured["parser"], captured["build"], captured["benchmark"]


def run_once(entry, script, sorter, flags, extra, tmp, examples=None) -> dict:
    """One epoch of one strategy, as `python <script> ... --epochs 1` trains it: its metrics row, with
    epoch_cpu_seconds, this process's CPU time over the span that epoch_seconds times (from the task's
    start_epoch hook to its evaluate call)."""
    parser, build_task, benchmark = entry
    script_args, density = SCRIPTS[script]
    argv = ["--sorter", sorter, "--epochs", "1", "--progress", "off", "--out", tempfile.mkdtemp(dir=tmp), *DEFAULTS,
            *script_args, *[flag.format(density=density) for flag in flags], *extra]
    args = parser.parse_args(argv + (["--max-train-examples", examples] if examples else []))
    check_args(args, benchmark, defaults=vars(parser.parse_args([])))
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    task = build_task(args, device)  # data loading and the worker split: not timed
    cpu = {}
    start_epoch, evaluate = task.start_epoch, task.evaluate

    def timed_start(epoch):
        cpu["start"] = time.process_time()
        return start_epoch(epoch)

    def timed_evaluate(flat, comm):
        cpu["end"] = time.process_time()
        return evaluate(flat, comm)

    task.start_epoch, task.evaluate = timed_start, timed_evaluate
    row = train(task, args, LocalCommunicator(args.node_cnt, device), device)[-1]
    return {**row, "epoch_cpu_seconds": cpu["end"] - cpu["start"]}


def summarise(rows: dict) -> dict:
    """{strategy: [metrics rows]} of one benchmark and sorter -> median epoch CPU and wall seconds and
    their ratios to every-step+dense's; the communication columns (the same in every round)."""
    def median(name, key):
        return statistics.median(float(row[key]) for row in rows[name])

    base_cpu, base_wall = median("every-step+dense", "epoch_cpu_seconds"), median("every-step+dense", "epoch_seconds")
    return {name: {"epoch_cpu_seconds": round(median(name, "epoch_cpu_seconds"), 3),
                   "ratio": round(median(name, "epoch_cpu_seconds") / base_cpu, 3),
                   "epoch_seconds": round(median(name, "epoch_seconds"), 3),
                   "ratio_wall": round(median(name, "epoch_seconds") / base_wall, 3),
                   "comm_seconds": round(median(name, "comm_seconds"), 3),
                   "megabytes_per_epoch": round(median(name, "comm_bytes") / 1e6, 3),
                   "syncs_per_epoch": int(median(name, "syncs"))} for name in rows}


def markdown(result: dict) -> str:
    lines = ["| benchmark | sorter | strategy | CPU s / epoch | vs every-step dense | wall s / epoch | (wall ratio) | "
             "MB / epoch | averagings / epoch |", "|---|---|---|---|---|---|---|---|---|"]
    for benchmark, sorters in result.items():
        if benchmark == "settings":
            continue
        for sorter, strategies in sorters.items():
            for name, m in strategies.items():
                lines.append(f"| {benchmark} | {sorter} | {name} | {m['epoch_cpu_seconds']:.2f} | {m['ratio']:.2f} | "
                             f"{m['epoch_seconds']:.2f} | {m['ratio_wall']:.2f} | {m['megabytes_per_epoch']:.3f} | "
                             f"{m['syncs_per_epoch']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", choices=tuple(SCRIPTS), default=list(SCRIPTS), help="entry scripts")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to time")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed repetitions of every strategy")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "communication-cpu.json"),
                        help="where the JSON object goes (written whole at the end)")
    argv, extra = sys.argv[1:], []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    entries = {script: entry_point(script) for script in args.scripts}
    load_before = os.getloadavg()
    rows = {}  # (script, sorter, strategy) -> metrics rows of the timed rounds
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(1 + args.rounds):  # round 0: the warm-up, on a few steps, not kept
                for script in args.scripts:
                    for sorter in args.sorters:
                        for name, flags in STRATEGIES.items():
                            row = run_once(entries[script], script, sorter, flags, extra, tmp,
                                           WARM_UP_EXAMPLES if round_ == 0 else None)
                            if round_:
                                rows.setdefault((script, sorter, name), []).append(row)
    except UserFacingError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    result = {entries[script][2]: {sorter: summarise({name: rows[script, sorter, name] for name in STRATEGIES})
                                   for sorter in args.sorters} for script in args.scripts}
    result["settings"] = {"args": DEFAULTS + extra, "per_script_args": {s: SCRIPTS[s][0] for s in args.scripts},
                          "exdyna_density": {s: float(SCRIPTS[s][1]) for s in args.scripts},
                          "rounds": args.rounds, "statistic": "median over rounds", "warm_up_round_examples": int(WARM_UP_EXAMPLES), "epochs_per_run": 1,
                          "process": "one (engine.train.train in this process, 4 simulated workers)",
                          "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
                          "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    write_result(args.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
