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
import time
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


def write_result(path, result: dict) -> str:
    """A bench's result: `result` as indented JSON, written atomically to `path` (never a half-written file),
    printed, and returned."""
    text = json.dumps(result, indent=1)
    atomic_write_bytes(Path(path), (text + "\n").encode())
    print(text)
    return text


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


# ---------------------------------------------------------------------------------------------- provenance
# Where the code is no git checkout (a source archive, an sdist, a copy without .git) or git is missing,
# every commit this module reports is UNKNOWN_COMMIT, never an error: the run or bench goes on and says so.
UNKNOWN_COMMIT = "unknown commit"


def run_git(*argv: str, env: dict | None = None, timeout: float = 60,
            **kwargs) -> subprocess.CompletedProcess | None:
    """`git ARGV` in REPO_DIR's own repository (captured output), or None where git is missing or hangs.
    Git never looks above REPO_DIR (GIT_CEILING_DIRECTORIES): a source archive unpacked inside another
    checkout must not report that checkout's commit."""
    env = {**(os.environ if env is None else env), "GIT_CEILING_DIRECTORIES": str(REPO_DIR.parent)}
    try:
        return subprocess.run(["git", "-C", str(REPO_DIR), *argv], env=env, capture_output=True, timeout=timeout,
                              check=False, **kwargs)
    except (OSError, subprocess.SubprocessError):
        return None


def _git_text(*argv: str) -> str | None:
    """git's stdout, stripped, when it succeeded with some; else None."""
    out = run_git(*argv, text=True)
    if out is None or out.returncode:
        return None
    return out.stdout.strip() or None


def git_commit() -> str:
    """`git describe --always --dirty --abbrev=40`: HEAD's commit, "-dirty" when tracked files differ from
    it; UNKNOWN_COMMIT without a git checkout."""
    return _git_text("describe", "--always", "--dirty", "--abbrev=40") or UNKNOWN_COMMIT


def head_commit(short: bool = False) -> str:
    """HEAD's commit (40 hex digits, or git's short form), or UNKNOWN_COMMIT without a git checkout."""
    return _git_text("rev-parse", *(["--short"] if short else []), "HEAD") or UNKNOWN_COMMIT


def git_state(ignored: Path | None = None) -> tuple[str, bool | None]:
    """(HEAD's commit, whether the working tree is clean: `git status --porcelain --untracked-files=all`
    lists nothing but `ignored`, a bench's own report file a previous run may have left); without a git
    checkout (UNKNOWN_COMMIT, None)."""
    head, status = head_commit(), run_git("status", "--porcelain", "--untracked-files=all", text=True)
    if head == UNKNOWN_COMMIT or status is None or status.returncode:
        return UNKNOWN_COMMIT, None
    skip = None if ignored is None else Path(ignored).resolve()
    changed = [line for line in status.stdout.splitlines() if (REPO_DIR / line[3:]).resolve() != skip]
    return head, not changed


def library_versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("numpy", "numba", "pandas", "transformers", "tokenizers"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    return versions


def write_config(path: Path, config: dict) -> None:
    atomic_write_bytes(path, (json.dumps(config, indent=2, default=str) + "\n").encode())


# ---------------------------------------------------------------------------------------------- segments
# config.json's "segments": one record per stretch of epochs a run trained in one process (a start, then
# each --resume), appended and never rewritten, so a run that crossed machines and commits says which
# code trained which epochs. The code is named by its git tree hash without reproduction/ (the results a
# later commit adds there do not change the code), which finds the commit even where the machine's .git
# is older than the tree it ran (code_tree, commit_of_code_tree).
EXCLUDED_FROM_CODE_TREE = "reproduction"
_code_tree_cache = {}


def code_tree() -> str | None:
    """The git tree hash of the repository's files as they are (tracked and unignored; reproduction/
    left out), computed in a throw-away index; None where git or the repository is missing."""
    if "tree" not in _code_tree_cache:
        index = Path(tempfile.gettempdir()) / f"cdgrab-code-tree-{os.getpid()}.index"
        env = {**os.environ, "GIT_INDEX_FILE": str(index)}
        try:
            add = run_git("add", "-A", "--", ".", f":!{EXCLUDED_FROM_CODE_TREE}", env=env, timeout=120)
            tree = run_git("write-tree", env=env, text=True) if add is not None and add.returncode == 0 else None
            written = tree is not None and tree.returncode == 0
            _code_tree_cache["tree"] = (tree.stdout.strip() or None) if written else None
        finally:
            index.unlink(missing_ok=True)
    return _code_tree_cache["tree"]


def tree_without(tree_object: bytes, name: bytes) -> str:
    """The hash of a git tree object (its raw content: "<mode> <name>\\0<20-byte id>" entries) with the
    entry `name` removed."""
    import hashlib

    entries, at = [], 0
    while at < len(tree_object):
        end = tree_object.index(b"\0", at) + 21
        entry = tree_object[at:end]
        if entry.split(b"\0", 1)[0].split(b" ", 1)[1] != name:
            entries.append(entry)
        at = end
    content = b"".join(entries)
    return hashlib.sha1(b"tree %d\0" % len(content) + content).hexdigest()


def commit_of_code_tree(tree: str | None) -> str | None:
    """The newest commit here whose files, reproduction/ left out, are `tree`; None when no commit is (the
    code had uncommitted changes, or is newer than this repository's history); UNKNOWN_COMMIT when the
    tree is unknown (code_tree() outside a git checkout) or this is no git checkout."""
    if not tree:
        return UNKNOWN_COMMIT
    log = run_git("log", "--all", "--format=%H %T", text=True)
    if log is None or log.returncode:
        return UNKNOWN_COMMIT
    pairs = [line.split() for line in log.stdout.splitlines() if len(line.split()) == 2]
    batch = run_git("cat-file", "--batch", input="".join(f"{t}\n" for _, t in pairs).encode(), timeout=120)
    if batch is None or batch.returncode:
        return UNKNOWN_COMMIT
    batch = batch.stdout
    at = 0
    for commit, _ in pairs:  # --batch answers "<id> tree <size>\n<content>\n" for each, in order
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        content = batch[header_end + 1:header_end + 1 + size]
        at = header_end + 2 + size
        if tree_without(content, EXCLUDED_FROM_CODE_TREE.encode()) == tree:
            return commit
    return None


def with_segment(path: Path, config: dict, first_epoch: int) -> dict:
    """`config` with the "segments" of the config.json at `path` (if any) and one more: this process's,
    from first_epoch (last_epoch: None until end_segment; an interrupted segment ends where the next
    begins). Each record: epochs, code tree, the commit it is here, device, torch."""
    try:
        segments = list(json.loads(Path(path).read_text()).get("segments", []))
    except (OSError, ValueError, AttributeError):
        segments = []
    tree = code_tree()
    segments.append({"first_epoch": first_epoch, "last_epoch": None, "code_tree": tree,
                     "commit": commit_of_code_tree(tree), "git_describe": git_commit(),
                     "device": config.get("device"), "device_name": device_name(config.get("device")),
                     "torch": torch.__version__,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    return {**config, "segments": segments}


def end_segment(path: Path, last_epoch: int) -> None:
    """Record the last epoch of config.json's newest segment (the run ended or stopped cleanly)."""
    config = json.loads(Path(path).read_text())
    if config.get("segments"):
        config["segments"][-1]["last_epoch"] = last_epoch
        write_config(path, config)


def device_name(device) -> str | None:
    if device is None or not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device))
