"""Wall time of README.md's set-up as a new user runs it: a fresh clone of this checkout's HEAD, a
virtual environment inside it (`python -m venv .venv`), then the set-up block's two commands (pip install,
the test command) as written, with the venv active. Prints one JSON object (and writes it with --out).

    python bench/test_suite.py --out bench/results/test-suite-cpu.json

The clone is made beside this checkout (so that the test command's relative `../shared/data` means what
it means here) and removed afterwards unless --keep. Commit first: the clone is of HEAD.
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_commands(readme: str) -> list[str]:
    """The two commands of README.md's first ```bash block under '## Set-up'."""
    section = readme.split("## Set-up", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    if len(commands) != 2 or not commands[0].startswith("pip install") or "-m pytest" not in commands[1]:
        raise SystemExit(f"error: README.md's set-up block is not 'pip install ...' then the test command: {commands}")
    return commands


def timed(command: str, cwd: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.monotonic()
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
    return time.monotonic() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--keep", action="store_true", help="keep the clone (beside this checkout) afterwards")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from engine.runlog import UNKNOWN_COMMIT, head_commit

    commit = head_commit()
    if commit == UNKNOWN_COMMIT:
        parser.exit(2, "error: the test command is timed in a clone of this checkout's HEAD, and this copy is no "
                       "git checkout (no .git): run it in a git clone\n")
    if subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True).stdout.strip():
        sys.exit("error: the checkout has uncommitted changes; commit them (the clone is of HEAD)")
    install, test = setup_commands((REPO / "README.md").read_text())
    clone = REPO.parent / f"{REPO.name}-suite-clone"
    if clone.exists():
        sys.exit(f"error: {clone} exists (a --keep of an earlier run?); remove it first")
    try:
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True)
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "CDGRAB_DATA")}
        env.update(VIRTUAL_ENV=str(clone / ".venv"), PATH=f"{clone / '.venv' / 'bin'}:{env['PATH']}")
        load_before = os.getloadavg()
        install_seconds, installed = timed(install, clone, env)
        if installed.returncode:
            sys.exit(f"error: {install!r} failed in the clone:\n{installed.stderr[-2000:]}")
        test_seconds, tested = timed(test, clone, env)
        summary = (tested.stdout.strip().splitlines() or [""])[-1]
        counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
        report = {
            "git_commit": commit,
            "commands": ["python -m venv .venv && . .venv/bin/activate", install, test],
            "install_seconds": round(install_seconds, 1),
            "test_seconds": round(test_seconds, 1),
            "test_exit_status": tested.returncode,
            "summary": summary,
            "failed_tests": [line for line in tested.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))],
            "counts": counts,
            "cpu_count": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
    finally:
        if not args.keep:
            shutil.rmtree(clone, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if tested.returncode == 0 else 1)


if __name__ == "__main__":
    main()
