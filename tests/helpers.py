"""Shared helpers for the end-to-end tests: where things are, and running entry scripts."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = (REPO / ".." / "shared" / "data").resolve()
needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"real data sets not found at {DATA_DIR}")


def run_script(script: str, *args, nproc: int | None = None, env: dict | None = None, timeout: float = 600):
    """Run `python <script> args` (or torchrun with nproc processes) from the repo root.

    Returns the CompletedProcess (text mode). CDGRAB_DATA points at the shared data; the progress
    bar is off unless the caller passes --progress itself.
    """
    full_env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    args = [str(a) for a in args]
    if "--progress" not in args:
        args += ["--progress", "off"]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    else:
        cmd = [sys.executable, script, *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


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
