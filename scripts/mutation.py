"""Mutation testing of the sorters' core (mutmut; development only, not part of the test command).

    pip install -r requirements-dev.txt
    CDGRAB_DATA=../shared/data python scripts/mutation.py                 # all four files, then the report
    CDGRAB_DATA=../shared/data python scripts/mutation.py --files sketch  # one file's mutants (re-run)
    CDGRAB_DATA=../shared/data python scripts/mutation.py --live          # only those not killed last time
    python scripts/mutation.py --report-only                              # the report from the last run

mutmut (configured in pyproject.toml, [tool.mutmut]) copies sorters/ into mutants/ with every mutant of
sorters/balance.py, base.py, sampler.py and sketch.py built in, and for each mutant runs the fast
in-process tests that reach the mutated function (tests/test_sorters.py, test_sampler.py,
test_sampler_frameworks.py, test_sketch.py, test_sketch_records.py, test_reorderers.py; no end-to-end
runs, no test that starts a subprocess; `-n 0 -x -q`). A mutant is killed when a test fails. The run
is niced (nice -n 19) and resumes where it stopped: without --files, mutants already checked keep their
result; --live runs again only the mutants it did not kill. Survivors that no test can kill (equivalent
mutants) are listed with the reason in scripts/mutation-equivalent.txt; the report
(docs/mutation-report.md) counts them apart.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ("balance", "base", "sampler", "sketch")  # sorters/<name>.py, as [tool.mutmut] only_mutate lists them
EQUIVALENT = REPO / "scripts" / "mutation-equivalent.txt"
REPORT = REPO / "docs" / "mutation-report.md"

# mutmut's exit code of a mutant's test run -> its verdict (mutmut/stats.py status_by_exit_code, 3.8.1)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", None: "not checked",
          2: "interrupted", 37: "caught by type check", -11: "segfault", -9: "segfault"}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser, its errors on one line."""

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def main() -> None:
    parser = OneLineErrorParser(prog="python scripts/mutation.py", description=__doc__.split("\n\n")[0],
                                epilog="See docs/mutation-testing.md.")
    parser.add_argument("--files", nargs="+", choices=FILES, default=None,
                        help="run only these files' mutants (re-checks them); default: all four, resuming")
    parser.add_argument("--live", action="store_true",
                        help="run again only the mutants the last run did not kill (survived, no tests, timeout), "
                             "e.g. after adding tests")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--report-only", action="store_true", help="skip the run; write the report from mutants/")
    parser.add_argument("--report", type=Path, default=REPORT,
                        help=f"where the report goes (default {REPORT.relative_to(REPO)})")
    args = parser.parse_args()

    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if mutmut is None:
        sys.exit("error: mutmut not found: pip install -r requirements-dev.txt")
    if not args.report_only:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per mutant process: --max-children is the load
        names = [f"sorters.{name}.*" for name in args.files or ()]
        if args.live:
            names = [mutant for mutant, verdict in results().items() if verdict not in ("killed", "not checked")
                     and (not args.files or file_of(mutant) in args.files)]
            if not names:
                sys.exit("error: no live mutants in mutants/ (run without --live first)")
        command = ["nice", "-n", "19", mutmut, "run", "--max-children", str(args.max_children), *names]
        print("+", " ".join(command), flush=True)
        # mutmut's progress line is redrawn with carriage returns: keep the last state of each line only
        with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as run:
            for line in run.stdout:
                print(line.decode(errors="replace").rsplit("\r", 1)[-1], end="", flush=True)
        if run.returncode:
            sys.exit(f"error: mutmut run exited with {run.returncode}")
    write_report(args.report, mutmut)


def results() -> dict:
    """mutant name -> verdict, from mutants/sorters/<file>.py.meta."""
    verdicts = {}
    for name in FILES:
        meta = REPO / "mutants" / "sorters" / f"{name}.py.meta"
        if meta.exists():
            for mutant, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                verdicts[mutant] = STATUS.get(code, "suspicious")
    return verdicts


def equivalents() -> dict:
    """mutant name -> why it is equivalent, from scripts/mutation-equivalent.txt (`name  reason`, # comments)."""
    reasons = {}
    for line in EQUIVALENT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, reason = line.split(None, 1)
            reasons[name] = reason.strip()
    return reasons


def diff_lines(mutmut: str, mutant: str) -> str:
    """The mutant's changed lines (`mutmut show`), '-' and '+' lines only."""
    shown = subprocess.run([mutmut, "show", mutant], cwd=REPO, capture_output=True, text=True).stdout
    changed = [line for line in shown.splitlines()
               if re.match(r"[-+]\s", line) and not line.startswith(("---", "+++"))]
    return " / ".join(line[0] + " " + line[1:].strip() for line in changed)


def file_of(mutant: str) -> str:
    return mutant.split(".")[1]


def write_report(path: Path, mutmut: str) -> None:
    verdicts, reasons = results(), equivalents()
    if not verdicts:
        sys.exit("error: no results in mutants/: run without --report-only first")
    survived = sorted(m for m, v in verdicts.items() if v in ("survived", "no tests", "suspicious"))
    equivalent = [m for m in survived if m in reasons]
    stale = sorted(m for m in reasons if verdicts.get(m) not in ("survived", "no tests", "suspicious"))
    rows, total = [], Counter()
    for name in FILES:
        counts = Counter(v for m, v in verdicts.items() if file_of(m) == name)
        counts["equivalent"] = sum(file_of(m) == name for m in equivalent)
        total.update(counts)
        rows.append((f"sorters/{name}.py", counts))
    rows.append(("all four", total))

    def rate(counts: Counter) -> str:
        checked = sum(counts.values()) - counts["equivalent"] - counts["not checked"]  # 'equivalent' is a subset
        tried = checked - counts["equivalent"]
        detected = counts["killed"] + counts["timeout"] + counts["segfault"]
        return f"{100 * detected / tried:.1f} %" if tried else "-"

    lines = ["# Mutation testing report", "",
             "Written by `python scripts/mutation.py` (mutmut, pinned in requirements-dev.txt; how to run it: "
             "[mutation-testing.md](mutation-testing.md)). Killed: a test failed; timeout: the tests ran past "
             "mutmut's limit (counted as detected); survived: every test passed; no tests: no selected test "
             "reaches the function; equivalent: a survivor that behaves as the original for every input "
             "(why: below). Kill rate: (killed + timeout) / (checked - equivalent).", "",
             "| file | mutants | killed | timeout | survived | no tests | equivalent | not checked | kill rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, c in rows:
        lines.append(f"| {label} | {sum(c.values()) - c['equivalent']} | {c['killed']} | {c['timeout']} | "
                     f"{c['survived']} | {c['no tests']} | {c['equivalent']} | {c['not checked']} | {rate(c)} |")
    others = {v for v in verdicts.values()} - {"killed", "timeout", "survived", "no tests", "not checked"}
    for verdict in sorted(others):
        lines.append(f"\n{sum(v == verdict for v in verdicts.values())} mutant(s) '{verdict}'.")
    lines += ["", "Survivors and mutants without tests count as live in the rate; 'equivalent' survivors are "
              "counted among the survivors and left out of the rate.", ""]
    live = [m for m in survived if m not in reasons]
    lines += ["## Equivalent mutants", ""]
    lines += [f"- `{m}`: `{diff_lines(mutmut, m)}`: {reasons[m]}" for m in equivalent] or ["None."]
    lines += ["", "## Live mutants (not killed, not explained)", ""]
    lines += [f"- `{m}` ({verdicts[m]}): `{diff_lines(mutmut, m)}`" for m in live] or ["None."]
    if stale:
        lines += ["", "## Listed as equivalent but not a survivor of this run", ""]
        lines += [f"- `{m}`: {verdicts.get(m, 'no such mutant')}" for m in stale]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}: {len(verdicts)} mutants, {len(live)} live, {len(equivalent)} equivalent")


if __name__ == "__main__":
    main()
