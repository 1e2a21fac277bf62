"""Shared helpers for the end-to-end tests: where things are, and running entry scripts."""
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# $CDGRAB_DATA (relative to the working directory, as the entry scripts read it), else ../shared/data
# beside the checkout
DATA_DIR = Path(os.environ.get("CDGRAB_DATA") or REPO / ".." / "shared" / "data").resolve()


# The heavy release checks (the type checker from a cold cache, the API reference's build, a pip install into
# a fresh venv) run in scripts/release_checks.py, which .ci/run calls after the test command; there they run
# with CDGRAB_RELEASE_CHECKS=1, and so may anyone here. Skipped otherwise, to keep the test command short.
release_check = pytest.mark.skipif(os.environ.get("CDGRAB_RELEASE_CHECKS") != "1",
                                   reason="a release check: scripts/release_checks.py (.ci/run) runs it; "
                                          "CDGRAB_RELEASE_CHECKS=1 runs it here")


def needs_data(*paths: str):
    """Marker for a test that reads these files or folders under DATA_DIR (e.g. "m4/Weekly-train.csv",
    "wikitext-2"; "a|b" when either will do). tests/conftest.py checks them before the test and its
    fixtures run: when any is missing the test is skipped, or fails when $CI is set (require_data)."""
    if not paths:
        raise TypeError("needs_data: name the data files or folders the test reads")
    return pytest.mark.needs_data(*paths)


def require_data(*paths: str) -> None:
    """Skip the running test (fail it under a non-empty $CI, so CI cannot pass by skipping) unless
    every path (or one of its "|" alternatives) exists under DATA_DIR."""
    missing = [path for path in paths if not any((DATA_DIR / alt).exists() for alt in path.split("|"))]
    if not missing:
        return
    message = (f"real data not found: {', '.join(missing)} missing under {DATA_DIR}; fetch it with "
               f"scripts/download_data.sh {DATA_DIR}, or point CDGRAB_DATA at the data folder")
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: missing data is a failure, not a skip)", pytrace=False)
    pytest.skip(message)


def run_script(script: str, *args, nproc: int | None = None, env: dict | None = None, timeout: float = 600,
               cwd=None):
    """Run `<this interpreter> <script> args` (or torchrun with nproc processes, as
    `<this interpreter> -m torch.distributed.run`) from the repo root, or from `cwd` (where a default
    --out's results/ lands).

    Returns the CompletedProcess (text mode). CDGRAB_DATA points at DATA_DIR; the progress
    bar is off unless the caller passes --progress itself. The interpreters are forks of
    tests/script_server.py (torch already imported) unless CDGRAB_TEST_FORK=0.
    """
    full_env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    args = [str(a) for a in args]
    if "--progress" not in args:
        args += ["--progress", "off"]
    script = script if cwd is None else str(REPO / script)
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    else:
        cmd = [sys.executable, script, *args]
    return run_python(cmd, cwd=cwd or REPO, env=full_env, timeout=timeout)


def run_python(cmd: list, cwd=REPO, env: dict | None = None, timeout: float = 600,
               check: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check)
    for cmd = [sys.executable, ...], through the script server where it runs (tests/script_server.py)."""
    env = dict(os.environ if env is None else env)
    cmd = [str(word) for word in cmd]
    cwd = os.getcwd() if cwd is None else cwd
    server = script_server()
    if server is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check)
    result = server.run(cmd, cwd, env, timeout)
    if check and result.returncode:
        raise subprocess.CalledProcessError(result.returncode, cmd, result.stdout, result.stderr)
    return result


class ScriptServer:
    """This test process's tests/script_server.py: started at the first run, ended with the process."""

    def __init__(self):
        import atexit
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="cdgrab-scripts-")
        self.socket_path = os.path.join(self.folder, "socket")
        self.python = os.path.join(self.folder, "python")  # torchrun's PYTHON_EXEC: the shim, started lean
        with open(self.python, "w") as f:
            f.write(f"#!/bin/sh\nexec '{sys.executable}' -I -S '{REPO / 'tests' / 'script_shim.py'}' \"$@\"\n")
        os.chmod(self.python, 0o755)
        env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.script_server", self.socket_path], cwd=REPO,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/script_server.py did not start (exit {self.process.wait()})")
        atexit.register(self.close)

    def run(self, cmd: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        import json
        import socket
        import tempfile
        import time

        env = {**env, "PYTHON_EXEC": self.python, "CDGRAB_SCRIPT_SERVER": self.socket_path}  # torchrun's workers
        request = json.dumps({"argv": [str(word) for word in cmd[1:]], "cwd": str(cwd), "env": env}).encode()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null, \
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(self.socket_path)
            socket.send_fds(conn, [request], [null.fileno(), out.fileno(), err.fileno()])
            deadline = time.monotonic() + timeout
            reply = {}
            try:
                while "returncode" not in reply:
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    message = conn.recv(1 << 16)
                    if not message:
                        raise RuntimeError("tests/script_server.py went away during a run")
                    reply.update(json.loads(message))
            except socket.timeout:
                conn.close()  # the server kills the run
                raise subprocess.TimeoutExpired(cmd, timeout, output=read_back(out), stderr=read_back(err))
            return subprocess.CompletedProcess(cmd, reply["returncode"], read_back(out), read_back(err))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


def read_back(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


_server = []
_server_lock = __import__("threading").Lock()


def python_exec_env() -> dict:
    """Environment variables that make `$PYTHON_EXEC` (tests/script_shim.py) a python that runs in the
    script server; {} where runs are real subprocesses. For shell scripts under test that start python."""
    server = script_server()
    return {} if server is None else {"PYTHON_EXEC": server.python, "CDGRAB_SCRIPT_SERVER": server.socket_path}


def script_server() -> ScriptServer | None:
    """The shared ScriptServer, or None where runs are real subprocesses (CDGRAB_TEST_FORK=0, no fork)."""
    if os.environ.get("CDGRAB_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    with _server_lock:
        if not _server:
            _server.append(ScriptServer())
        return _server[0]


def check_ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def read_metrics(run_dir) -> list[dict]:
    """metrics.csv rows as dicts of floats."""
    with open(Path(run_dir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def metrics_header(run_dir) -> list[str]:
    with open(Path(run_dir) / "metrics.csv") as f:
        return f.readline().strip().split(",")


def error_lines(result) -> list[str]:
    """The non-empty stderr lines that start with 'error:'."""
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def check_run_files(run_dir, epochs: int, m: int) -> list:
    """A finished run: metrics rows for epochs 1..epochs, a checkpoint, and (from --record-orders) one
    (n, m) order per epoch whose rows are permutations of range(m) (SWR's: m unit ids in range(m), drawn with
    replacement). Returns the orders."""
    import json

    import torch

    from sorters import SORTERS

    assert [r["epoch"] for r in read_metrics(run_dir)] == list(range(1, epochs + 1))
    assert (Path(run_dir) / "checkpoint.pt").exists()
    orders = torch.load(Path(run_dir) / "orders.pt")
    assert len(orders) == epochs
    sorter = json.loads((Path(run_dir) / "config.json").read_text())["args"]["sorter"]
    if getattr(SORTERS[sorter], "permutes", True):
        assert all(sorted(row.tolist()) == list(range(m)) for o in orders for row in o)
    else:
        assert all(len(row) == m and 0 <= min(row.tolist()) and max(row.tolist()) < m for o in orders for row in o)
    return orders


def assert_runs_agree(single, multi, columns, rel=1e-5, exact=False, bytes_equal=True):
    """Two runs of one experiment (e.g. one process vs torchrun) have the same orders, exactly, the
    same metric `columns` (to `rel`, or exactly) and (bytes_equal) the same communication volume."""
    import torch

    orders_a, orders_b = torch.load(Path(single) / "orders.pt"), torch.load(Path(multi) / "orders.pt")
    assert len(orders_a) == len(orders_b) and all(torch.equal(a, b) for a, b in zip(orders_a, orders_b))
    rows_a, rows_b = read_metrics(single), read_metrics(multi)
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b):
        for column in columns:
            expected = ra[column] if exact else pytest.approx(ra[column], rel=rel, abs=1e-7)
            assert rb[column] == expected, (column, ra, rb)
        assert ra["comm_bytes"] == rb["comm_bytes"] or not bytes_equal


def checkpoint_roundtrip(state):
    """`state` after torch.save and torch.load(weights_only=True), as a user's checkpoint file gives it back."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same(a, b, where: str = "") -> None:
    """a and b equal bit for bit: nested dicts, lists and tuples of tensors (same dtype, shape and values)
    and plain values. The message names the first key path that differs, after `where`."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a) and torch.is_tensor(b):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


# Orderers whose every engine path another sorter takes (FlipFlop and SWR D-RR's, Greedy and RPB CD-GraB's):
# the end-to-end tests of the large models (LSTM-Wiki2, GPT2-Wiki103) leave them out, since the test command's
# time has no room for four more runs of each; tests/test_lr_hmda.py and tests/test_mlp_m4.py run every sorter.
ENGINE_PATH_TWINS = ("FlipFlop", "SWR", "Greedy", "RPB")


def run_every_sorter(script: str, root: Path, *args, skip: tuple = ()) -> dict:
    """One run of `script` per sorter (but those in `skip`) into root/<sorter>, two at a time (each run is a
    single-threaded process, mostly start-up); fails on any non-zero exit. Returns sorter -> dir."""
    from concurrent.futures import ThreadPoolExecutor

    from sorters import SORTER_NAMES

    names = [sorter for sorter in SORTER_NAMES if sorter not in skip]
    dirs = {sorter: Path(root) / sorter for sorter in names}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(lambda s: run_script(script, "--sorter", s, "--out", dirs[s], *args), names):
            check_ok(result)
    return dirs


def check_trained_two_epochs(run_dir, columns) -> tuple[list[dict], dict]:
    """Epochs 1 and 2 logged, every metric in `columns` finite, train loss falling.
    Returns (metrics rows, config.json)."""
    import json
    import math

    rows = read_metrics(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(math.isfinite(r[c]) for r in rows for c in columns), rows
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    return rows, json.loads((Path(run_dir) / "config.json").read_text())


def check_torchrun_agrees(script: str, single, multi, *args, columns, nproc: int = 2) -> None:
    """Run `script` under torchrun into `multi` and check it agrees with the one-process run `single`."""
    import json

    check_ok(run_script(script, "--out", multi, *args, nproc=nproc))
    assert_runs_agree(single, multi, columns)
    assert json.loads((Path(multi) / "config.json").read_text())["sizes"]["world_size"] == nproc


def entry_task(script: str, device, *argv):
    """(task, args): the Task an entry script builds for this command line (--data-dir DATA_DIR added),
    on `device`, as its run_entry_point builds it (TF32 set from --tf32), and the checked args."""
    import torch

    from engine.cli import check_args
    from engine.device import set_tf32

    benchmark, parser, build = entry_point(script)
    args = parser.parse_args(["--data-dir", str(DATA_DIR), *map(str, argv)])
    check_args(args, benchmark, defaults=vars(parser.parse_args([])))
    set_tf32(args.tf32)
    torch.manual_seed(args.seed)
    return build(args, device), args


def entry_point(script: str):
    """(benchmark, parser, build_task): what an entry script's main() hands run_entry_point."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script[:-3].replace("-", "_"), REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured = []
    module.run_entry_point = lambda *handed: captured.extend(handed)
    module.main()  # builds the parser and hands it to (our) run_entry_point
    return tuple(captured)


def run_forked(fn, args: tuple, nprocs: int, seconds: float = 120) -> None:
    """fn(rank, *args) in `nprocs` forked processes (no re-import: fast), joined with a deadline, so that a
    stuck child (a gloo collective waiting for a rank that died) fails the test instead of hanging the suite."""
    import torch.multiprocessing as mp
    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="fork", join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} forked processes did not finish in {seconds:.0f} s")
