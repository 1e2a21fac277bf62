"""Seconds per epoch of each communication strategy against every-step, back to back in one run.

    OMP_NUM_THREADS=1 CDGRAB_DATA=../shared/data python bench/communication.py    # LR-HMDA and MLP-M4
    python bench/communication.py --scripts main-MLP-M4.py --rounds 3 -- --max-train-examples 32000

For every benchmark, every sorter and every strategy (every-step, constant H = 4, QSR, each with the
dense and the ExDyna reducer, density 0.01, 0.25 for LR-HMDA's d = 26; and constant H = 4 through the
general torch.func path, --unit-grads vmap, the way every local step went before engine/linear_stack.py)
one short run of the entry script, 4 workers, B 16; the rounds are interleaved (strategy A, B, ..., then A, B, ... again) so that a change in
the machine's load hits every strategy alike, and the median epoch time per strategy is divided by the
median of every-step + dense of the same benchmark and sorter. Writes ONE JSON object to --out (and
prints it), then the table in markdown:
    {"<benchmark>": {"<sorter>": {"<sync>+<reducer>": {"epoch_seconds": s, "ratio": r, "comm_seconds": c,
                                                      "megabytes_per_epoch": b, "syncs_per_epoch": n}, ...}},
     ..., "settings": {...}}
Everything after `--` goes to every run (after the defaults below, so it overrides them).
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


def run_once(script, sorter, flags, extra, out) -> dict:
    """One 1-epoch run; its metrics.csv row. Exits (status 2) with the run's last error line if it fails."""
    script_args, density = SCRIPTS[script]
    flags = [flag.format(density=density) for flag in flags]
    run = subprocess.run([sys.executable, script, "--sorter", sorter, "--epochs", "1", "--out", str(out), "--progress",
                          "off", *DEFAULTS, *script_args, *flags, *extra], cwd=REPO, stderr=subprocess.PIPE, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"error: {script} {sorter} {' '.join(flags)} failed: {last}", file=sys.stderr)
        sys.exit(2)
    with open(Path(out) / "metrics.csv") as f:
        return next(csv.DictReader(f))


def summarise(rows: dict) -> dict:
    """{strategy: [metrics rows]} of one benchmark and sorter -> medians and ratios to every-step+dense."""
    median = {name: {key: statistics.median(float(row[key]) for row in runs)
                     for key in ("epoch_seconds", "comm_seconds", "comm_bytes", "syncs")} for name, runs in rows.items()}
    base = median["every-step+dense"]["epoch_seconds"]
    return {name: {"epoch_seconds": round(m["epoch_seconds"], 3), "ratio": round(m["epoch_seconds"] / base, 3),
                   "comm_seconds": round(m["comm_seconds"], 3), "megabytes_per_epoch": round(m["comm_bytes"] / 1e6, 3),
                   "syncs_per_epoch": int(m["syncs"])} for name, m in median.items()}


def markdown(result: dict) -> str:
    lines = ["| benchmark | sorter | strategy | s / epoch | vs every-step dense | comm s | MB / epoch | averagings / epoch |",
             "|---|---|---|---|---|---|---|---|"]
    for benchmark, sorters in result.items():
        if benchmark == "settings":
            continue
        for sorter, strategies in sorters.items():
            for name, m in strategies.items():
                lines.append(f"| {benchmark} | {sorter} | {name} | {m['epoch_seconds']:.2f} | {m['ratio']:.2f} | "
                             f"{m['comm_seconds']:.3f} | {m['megabytes_per_epoch']:.3f} | {m['syncs_per_epoch']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", choices=tuple(SCRIPTS), default=list(SCRIPTS), help="entry scripts")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to time")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every strategy")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "communication-cpu.json"),
                        help="where the JSON object goes (written whole at the end)")
    argv, extra = sys.argv[1:], []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    load_before = os.getloadavg()
    rows = {}  # (script, sorter, strategy) -> metrics rows
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for script in args.scripts:
                for sorter in args.sorters:
                    for name, flags in STRATEGIES.items():
                        out = Path(tmp) / f"{script}-{sorter}-{name}-{round_}".replace(" ", "_")
                        rows.setdefault((script, sorter, name), []).append(run_once(script, sorter, flags, extra, out))
    result = {script[len("main-"):-len(".py")]: {sorter: summarise({name: rows[script, sorter, name]
                                                                     for name in STRATEGIES})
                                                  for sorter in args.sorters} for script in args.scripts}
    result["settings"] = {"args": DEFAULTS + extra, "per_script_args": {s: SCRIPTS[s][0] for s in args.scripts},
                          "exdyna_density": {s: float(SCRIPTS[s][1]) for s in args.scripts},
                          "rounds": args.rounds, "epochs_per_run": 1, "statistic": "median over rounds",
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
                          "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    text = json.dumps(result, indent=1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text + "\n")
    partial.replace(out)  # never a half-written result file
    print(text)
    print(markdown(result))


if __name__ == "__main__":
    main()
