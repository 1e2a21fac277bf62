"""The library's tests under another torch (or transformers, accelerate, lightning): one JSON record of what ran.

    python scripts/check_compat.py --python /tmp/venv-torch214/bin/python
    python scripts/check_compat.py --python /tmp/venv-torch214 --tree worktree -- --durations=20

The interpreter given (a virtual environment's python, or the environment's folder) runs pytest over the
tests that exercise the `sorters` package (LIBRARY_TESTS below; the end-to-end runs of the engine's entry
scripts among them are left out: ENGINE_RUNS), with that interpreter's torch and other packages, and this
checkout's code. By default the tests run in a clean clone of the commit HEAD names (a temporary folder,
removed afterwards), so the record says exactly which code ran and no uncommitted edit takes part
(--tree worktree: the files as they are here; the record lists the uncommitted paths).

The record (default reproduction/compatibility/torch-<version>.json; docs/compatibility.md's table quotes
it, and tests/test_compat_record.py checks that the two agree) holds the commit ("unknown commit" without
git), the versions of Python, torch, numpy, numba, transformers, accelerate and lightning, the pytest
command, the passed/failed/skipped counts, the failed tests, and the wall time. It is written by this
script only; never edit it by hand.

Exit status: 0 when every selected test passed, 1 when a test failed (the record is written all the same),
2 for bad input (one line that says what to do).
"""
import ctypes
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.errors import OneLineErrorParser, exit_with_error  # noqa: E402

RECORDS = REPO / "reproduction" / "compatibility"
# The tests that exercise the library: the sorters, the sampler (one process, gloo processes, resume, the
# frameworks' views), sketches, the layer rules, exact CD-GraB from products, per-example gradients of
# transformers models, the HF Trainer, Lightning and Accelerate glue, the library's input checks, saved
# states' formats.
LIBRARY_TESTS = (
    "tests/test_sorters.py",
    "tests/test_reorderers.py",
    "tests/test_sampler.py",
    "tests/test_sampler_resume.py",
    "tests/test_sampler_frameworks.py",
    "tests/test_exchange.py",
    "tests/test_sketch.py",
    "tests/test_sketch_records.py",
    "tests/test_layer_rules.py",
    "tests/test_layer_sketch.py",
    "tests/test_exact_products.py",
    "tests/test_exact_share.py",
    "tests/test_exact_resume.py",
    "tests/test_exact_glue.py",
    "tests/test_per_example_hf.py",
    "tests/test_natural_call.py",
    "tests/test_hf_trainer.py",
    "tests/test_lightning.py",
    "tests/test_accelerate_glue.py",
    "tests/test_library_inputs.py",
    "tests/test_state_format.py",
)
# The selection's end-to-end runs of main-*.py (marked slow: seconds to a minute each, several under
# torchrun). They test the engine's use of the library, which the in-process tests above test directly;
# --with-engine-runs keeps them. The selection's other slow tests run the library's own examples under
# gloo processes, and stay.
ENGINE_RUNS = (
    "tests/test_reorderers.py::test_one_process_equals_torchrun",
    "tests/test_reorderers.py::test_resume_after_a_crash_equals_an_uninterrupted_run",
    "tests/test_sketch.py::test_identity_sketch_is_exact_cd_grab_bit_for_bit",
    "tests/test_sketch.py::test_sketched_orders_are_permutations_and_bytes_scale_with_d",
    "tests/test_sketch.py::test_sketched_one_process_equals_torchrun",
    "tests/test_sketch.py::test_bad_sketch_flags_fail_in_one_line",
    "tests/test_sketch.py::test_sketched_lr_and_lstm_send_sketches_and_one_process_equals_torchrun",
    "tests/test_sketch_records.py::test_gpt2_sketched_from_records_trains_and_one_process_equals_torchrun",
)
UNKNOWN_COMMIT = "unknown commit"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PACKAGES = ("torch", "numpy", "numba", "transformers", "accelerate", "lightning", "pytest")
# Run by the interpreter under test, in the tree the tests run in: its versions, and the `sorters` it imports.
VERSIONS_PROGRAM = """
import importlib.metadata, json, platform, sys
sys.path.insert(0, sys.argv[1])
versions = {"python": platform.python_version()}
for name in sys.argv[2:]:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = None
import torch, sorters
versions["torch_build"] = torch.__version__
versions["torch_cuda"] = torch.version.cuda
versions["cuda_available"] = torch.cuda.is_available()
versions["sorters"] = sorters.__version__
versions["sorters_file"] = sorters.__file__
print(json.dumps(versions))
"""
SUMMARY_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")


def git(*args: str, cwd: Path = REPO) -> str | None:
    """git's stdout (stripped), or None without git or outside a repository."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def interpreter_of(given: str) -> Path:
    """The python of `given`: an interpreter, or a virtual environment's folder (its bin/python)."""
    path = Path(given)
    if path.is_dir():
        path = path / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        exit_with_error(f"--python {given}: no such interpreter; give a python or a virtual environment's folder")
    return path.absolute()  # not resolved: a venv's bin/python is a link to the base interpreter


def versions_of(python: Path, tree: Path) -> dict:
    """The interpreter's Python and package versions, and the `sorters` it imports from `tree`."""
    done = subprocess.run([str(python), "-c", VERSIONS_PROGRAM, str(tree), *PACKAGES],
                          capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        exit_with_error(f"--python {python} cannot import torch and sorters ({last}); install torch and "
                        f"requirements.txt's other pins into it")
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(versions.pop("sorters_file")).resolve().is_relative_to(tree.resolve()):
        exit_with_error(f"--python {python} imports an installed `sorters`, not the tree's; "
                        f"pip uninstall cdgrab-sorters from it")
    return versions


def clean_clone(commit: str, into: Path) -> Path:
    """A clone of this repository at `commit` in `into`/tree (objects shared with the checkout: seconds)."""
    tree = into / "tree"
    for args in (["clone", "--quiet", "--shared", "--no-checkout", str(REPO), str(tree)],
                 ["-C", str(tree), "checkout", "--quiet", "--detach", commit]):
        if git(*args) is None:
            exit_with_error(f"could not clone {REPO} at {commit}; run with --tree worktree")
    return tree


def pytest_command(python: Path, tests: list[str], deselect: list[str], workers: int, extra: list[str]) -> list[str]:
    return [str(python), "-m", "pytest", "-q", "-n", str(workers), "-p", "no:cacheprovider",
            *tests, *[arg for node in deselect for arg in ("--deselect", node)], *extra]


def die_with_parent() -> None:
    """In the child, before it runs pytest: the kernel kills it when this script dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: --timeout and the SIGTERM handler still stop it


def run_pytest(command: list[str], cwd: Path, env: dict, timeout: float, log) -> tuple[int | None, str, float]:
    """Run `command`, echoing its output (and writing it to `log`); its exit status (None: stopped after
    `timeout` seconds), output and wall seconds."""
    lines = []
    start = time.monotonic()
    # pytest in a process group of its own, so that stopping it stops the processes its tests start too
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, preexec_fn=die_with_parent)
    timer = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    timer.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a plain kill of this script stops pytest too
    try:
        for line in process.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
            if log:
                log.write(line)
        process.wait()
    except BaseException:  # interrupted: leave no test running
        os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        timer.cancel()
    timed_out = time.monotonic() - start >= timeout and process.returncode == -signal.SIGKILL
    return (None if timed_out else process.returncode), "".join(lines), time.monotonic() - start


def summarise(output: str) -> dict:
    """pytest -q -ra's counts, failed and errored tests and skip reasons, from its output."""
    counts = {name: 0 for name in ("passed", "failed", "skipped", "errors", "deselected", "xfailed", "xpassed")}
    summary = None
    for line in reversed(output.splitlines()):
        if re.search(r"\bin [0-9.]+s\b", line) and SUMMARY_COUNT.search(line):
            summary = line.strip(" =")
            break
    if summary:
        for number, word in SUMMARY_COUNT.findall(summary):
            word = "errors" if word.startswith("error") else word
            if word in counts:
                counts[word] = int(number)
    short = [line.strip() for line in output.splitlines()]
    return {"summary": summary, "counts": counts if summary else None,
            "failed": [line.removeprefix("FAILED ") for line in short if line.startswith("FAILED ")],
            "errors": [line.removeprefix("ERROR ") for line in short if line.startswith("ERROR ")],
            "skipped": [line.removeprefix("SKIPPED ") for line in short if line.startswith("SKIPPED ")]}


def stale_deselection(tree: Path, deselect: list[str]) -> str | None:
    """The first node id of `deselect` that names no test function of `tree`, or None."""
    for node in deselect:
        file, _, name = node.partition("::")
        if not re.search(rf"^def {re.escape(name)}\(", (tree / file).read_text(), re.M):
            return node
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineErrorParser(prog="scripts/check_compat.py", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` go to pytest as they are (e.g. -- --durations=20).")
    parser.add_argument("--python", required=True, metavar="PYTHON",
                        help="the interpreter to test with (a virtual environment's bin/python, or its folder), "
                             "with torch and requirements.txt's other pins installed")
    parser.add_argument("--out", type=Path, metavar="JSON",
                        help="where the record goes (default: reproduction/compatibility/torch-<version>.json, "
                             "the version without a local label such as +cpu)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing record at --out")
    parser.add_argument("--tree", choices=("head", "worktree"),
                        help="head: a clean clone of the commit HEAD names (the default in a git checkout); "
                             "worktree: the files as they are here (the default without git)")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="test files or node ids to run instead of the library's tests (default: "
                             "LIBRARY_TESTS in this script)")
    parser.add_argument("--with-engine-runs", action="store_true",
                        help="also run the selection's end-to-end runs of the entry scripts (ENGINE_RUNS)")
    parser.add_argument("-n", "--workers", type=int, default=0, metavar="N",
                        help="pytest-xdist test processes (default 0: the tests run in pytest's own process)")
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help="the data folder the tests read (default: $CDGRAB_DATA, else ../shared/data "
                             "next to the checkout)")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="stop pytest after this many seconds; the record says it timed out (default 3600)")
    parser.add_argument("--log", type=Path, metavar="FILE", help="also write pytest's whole output to FILE")
    args = parser.parse_args(argv)
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    python = interpreter_of(args.python)
    data = (args.data or Path(os.environ.get("CDGRAB_DATA") or REPO.parent / "shared" / "data")).absolute()
    if not data.is_dir():
        parser.error(f"no data folder {data}: give --data DIR or set CDGRAB_DATA (scripts/download_data.sh "
                     f"downloads the data sets)")

    commit = git("rev-parse", "HEAD") or UNKNOWN_COMMIT
    tree_kind = args.tree or ("head" if commit != UNKNOWN_COMMIT else "worktree")
    if tree_kind == "head" and commit == UNKNOWN_COMMIT:
        parser.error("--tree head needs a git checkout; this one has no commit: use --tree worktree")
    scratch = Path(tempfile.mkdtemp(prefix="check-compat-"))
    try:
        tree = clean_clone(commit, scratch) if tree_kind == "head" else REPO
        selection = list(args.tests or LIBRARY_TESTS)
        # a library test file this tree does not have (yet): left out, and listed in the record
        absent = [test for test in selection if not (tree / test.split("::")[0]).is_file()]
        if args.tests and absent:
            parser.error(f"--tests {absent[0]}: no such test file in the {tree_kind} tree")
        tests = [test for test in selection if test not in absent]
        files = {test.split("::")[0] for test in tests}
        deselect = [] if args.with_engine_runs else [node for node in ENGINE_RUNS if node.split("::")[0] in files]
        stale = stale_deselection(tree, deselect)
        if stale:
            exit_with_error(f"ENGINE_RUNS names {stale}, which the {tree_kind} tree does not have; update "
                            f"scripts/check_compat.py")
        for test in absent:
            print(f"check_compat: {test} is not in the {tree_kind} tree; left out", file=sys.stderr)
        versions = versions_of(python, tree)
        out = args.out or RECORDS / f"torch-{versions['torch'].split('+')[0]}.json"
        if out.exists() and not args.overwrite:
            exit_with_error(f"{out} exists; give --overwrite to replace it (git keeps the old one), or --out")

        command = pytest_command(python, tests, deselect, args.workers, extra)
        # the interpreter's folder first on PATH, as in its activated environment (a test's `torchrun` is its)
        env = {**os.environ, "CDGRAB_DATA": str(data), "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}
        env.pop("PYTHONPATH", None)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        load_before = os.getloadavg()
        print(f"check_compat: torch {versions['torch_build']} ({python}) at {commit}, {tree_kind}: "
              f"{shlex.join(command)}", file=sys.stderr, flush=True)
        log = args.log.open("w") if args.log else None
        try:
            status, output, wall = run_pytest(command, tree, env, args.timeout, log)
        finally:
            if log:
                log.close()
        results = summarise(output)
        uncommitted = None
        if tree_kind == "worktree" and commit != UNKNOWN_COMMIT:
            uncommitted = [line[3:] for line in (git("status", "--porcelain") or "").splitlines()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    record = {
        "what": "the library's tests (the sorters package) under this interpreter's packages: "
                "scripts/check_compat.py; never edited by hand",
        "commit": commit,
        "tree": tree_kind,
        "uncommitted_paths": uncommitted,
        "started_utc": started,
        "interpreter": str(python),
        "versions": versions,
        "device": "cuda" if versions["cuda_available"] else "cpu",
        "pytest_command": shlex.join(["python" if part == str(python) else part for part in command]),
        "tests": tests,
        "absent_tests": absent,
        "deselected_engine_runs": deselect,
        "timed_out": status is None,
        "pytest_exit_status": status,
        "pytest_summary": results["summary"],
        "counts": results["counts"],
        "failed": results["failed"],
        "errors": results["errors"],
        "skipped": results["skipped"],
        "wall_seconds": round(wall, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    counts = results["counts"] or {}
    print(f"check_compat: {results['summary'] or 'no pytest summary (timed out?)'}; wrote {out}", file=sys.stderr)
    ok = status == 0 and counts.get("failed", 1) == 0 and counts.get("errors", 1) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
