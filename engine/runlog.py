"""The run directory: config.json, metrics.csv, checkpoint.pt (and orders.pt), all written atomically.

A crash never leaves a partial file: each write goes to a temporary file that then replaces
the old one. Only rank 0 writes.
"""
import csv
import math
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

TIMING_COLUMNS = ("epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds", "comm_bytes")
# how the workers communicated (engine.train.communication_stats)
COMMUNICATION_COLUMNS = ("syncs", "mean_H", "density", "threshold", "load_imbalance")
REPO_DIR = Path(__file__).resolve().parents[1]


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write `payload` to a temporary file beside `path`, then replace `path` with it; readable as the
    umask says (mkstemp's own mode, 0600, would hide results from colleagues on a shared cluster)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask, from /proc (Linux), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def signals_deferred(signums=(signal.SIGTERM, signal.SIGINT)):
    """Hold these signals' Python handlers until the block ends, then run them (at most once each, in
    arrival order): a run stopped while it writes an epoch's files (checkpoint.pt, then orders.pt and
    metrics.csv) stops after the last one, so the files always describe the same finished epoch. In the
    main thread only (where Python runs signal handlers); elsewhere the block runs as it is."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived, previous = [], {}

    def remember(signum, frame):
        if signum not in arrived:
            arrived.append(signum)

    for signum in signums:
        previous[signum] = signal.signal(signum, remember)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in arrived:
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def atomic_torch_save(obj, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def metrics_header(metric_columns) -> list[str]:
    return ["epoch", "train_loss", "test_loss", *metric_columns, *TIMING_COLUMNS, *COMMUNICATION_COLUMNS]


def write_metrics(path: Path, rows: list[dict], metric_columns) -> None:
    """metrics.csv: one row per finished epoch (floats with full precision, so resumed and
    uninterrupted runs can be compared exactly). Keys of the rows beyond the standard columns (the
    optional herding_bound of --log-herding) follow them, in the first row's order."""
    header = metrics_header(metric_columns)
    header += [key for key in (rows[0] if rows else {}) if key not in header]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _format(row.get(key, math.nan)) for key in header})  # nan: an older run's row
    atomic_write_bytes(path, text.getvalue().encode())


def _format(value):
    return repr(float(value)) if isinstance(value, float) else value


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_DIR), "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def library_versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("numpy", "numba", "pandas", "transformers", "tokenizers"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    return versions


def write_config(path: Path, config: dict) -> None:
    atomic_write_bytes(path, (json.dumps(config, indent=2, default=str) + "\n").encode())
