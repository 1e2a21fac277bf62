"""What an entry script may do with its run folder (--out), before it writes anything there.

- check_out_path: --out names a folder that can be made and written (not "", not a file, not under a file).
- RunLock: <out>/.lock, one writer per run folder: a second run into the same folder, in this or another
  process or node, is refused in one line that names the holder; a lock left by a dead process on this
  host is taken over.
- check_run_folder: results are never overwritten: a folder whose metrics.csv holds finished epochs but
  no checkpoint.pt (every run shipped in reproduction/, or a run whose checkpoint was deleted) is
  refused, and so are files the suite did not write under the names it writes (RUN_FILES), unless the
  user asks for it with --overwrite (clear_run_folder); --resume of a finished run says so and changes
  nothing.

Plain Python, no torch (python -m analysis uses check_out_path). docs/run-directory.md, docs/reliability.md.
"""
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from common.errors import UserFacingError
from engine.flags import changed_on_resume

RUN_FILES = ("checkpoint.pt", "orders.pt", "metrics.csv", "config.json")  # all an entry script writes in --out
LOCK_NAME = ".lock"
METRICS_HEADER = "epoch,train_loss,test_loss"  # how every metrics.csv of the suite begins (engine/runlog.py)


class RunFinished(Exception):
    """--resume of a run that is finished already: the line that says so (exit status 0, nothing changed)."""


def check_out_path(out, flag: str = "--out") -> Path:
    """`out` as a Path, when it names a folder that exists or can be made, and can be written in; else one line."""
    if not str(out).strip():
        raise UserFacingError(f"{flag} is empty; name a folder (or leave {flag} out for its default)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UserFacingError(f"{flag} {out} is a file, not a folder; choose another {flag}")
    existing = path
    while not existing.exists():  # the nearest folder that exists: where the others will be made
        existing = existing.parent
    if not existing.is_dir():
        raise UserFacingError(f"{flag} {out} lies under {existing}, which is a file; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserFacingError(f"{flag} {out}: cannot write in {existing} (permission denied); choose another {flag}")
    return path


def check_run_folder(args, benchmark: str) -> None:
    """Refuse (one line) to start args.out when that would overwrite a run's results or files the suite did
    not write; raise RunFinished when --resume finds the run finished. A folder with a checkpoint.pt is
    train()'s to resume or refuse; a folder with only the config.json of a run whose first epoch never
    finished is started again (the sweeps' first starts)."""
    out = Path(args.out)
    if not out.is_dir() or (out / "checkpoint.pt").exists():
        return
    foreign = [name for name in ("config.json", "metrics.csv") if (out / name).exists() and not suite_file(out / name)]
    if foreign:
        raise UserFacingError(f"{out} holds {' and '.join(foreign)} that this suite did not write; choose another "
                              "--out, or pass --overwrite to replace them")
    saved = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else None
    if saved and saved["benchmark"] != benchmark:
        raise UserFacingError(f"{out} holds a run of {saved['benchmark']}, not {benchmark}; choose another --out, or "
                              "pass --overwrite to replace it")
    rows = metrics_rows(out / "metrics.csv")
    if not rows and not (out / "orders.pt").exists():
        return
    check_finished_run(args, benchmark, out, rows, saved)


def check_finished_run(args, benchmark: str, out: Path, rows: int, saved: dict | None) -> None:
    """args.out holds `rows` finished epochs in metrics.csv and no checkpoint.pt: refuse, or (--resume of
    a finished run with its settings) raise RunFinished."""
    epochs = saved["args"].get("epochs") if saved else None
    finished = isinstance(epochs, int) and rows >= epochs
    what = f"a finished run ({rows} epochs in metrics.csv)" if finished else \
        f"{rows} finished epoch{'s' * (rows != 1)} in metrics.csv but no checkpoint.pt to continue from"
    if not args.resume:
        raise UserFacingError(f"{out} already holds {what}; choose another --out, or pass --overwrite to replace it")
    changed = changed_on_resume(saved["args"], dict(vars(args)), benchmark) if saved else []
    if not finished or changed or args.epochs > rows:
        why = (f"its settings differ: {', '.join(key for key, _, _ in changed)}" if changed else
               f"it has no checkpoint.pt to continue to --epochs {args.epochs}" if finished else what)
        raise UserFacingError(f"cannot resume {out}: {why}; choose another --out, or pass --overwrite (without "
                              "--resume) to start it over")
    raise RunFinished(f"{benchmark}: {out} is finished: {rows} epochs done (metrics.csv; no checkpoint.pt); "
                      "nothing to resume, nothing changed")


def suite_file(path: Path) -> bool:
    """Whether config.json / metrics.csv at `path` is one an entry script wrote."""
    try:
        if path.name == "metrics.csv":
            with open(path) as file:
                return file.readline().startswith(METRICS_HEADER)
        config = json.loads(path.read_text())
        return isinstance(config, dict) and isinstance(config.get("benchmark"), str) and isinstance(config.get("args"), dict)
    except (OSError, ValueError):
        return False


def metrics_rows(path: Path) -> int:
    """The number of epoch rows in a metrics.csv (0: none, or no file)."""
    try:
        return sum(1 for line in path.read_text().splitlines()[1:] if line.strip())
    except (OSError, ValueError):
        return 0


def clear_run_folder(out) -> None:
    """--overwrite: remove the suite's files (RUN_FILES) from `out`, so nothing of the run replaced is left to
    be resumed or read as this run's; every other file stays."""
    for name in RUN_FILES:
        (Path(out) / name).unlink(missing_ok=True)


class RunLock:
    """<out>/.lock, held from before the run looks at its folder until it ends: an flock on the file (released
    by the kernel when the process dies) and, in it, who holds it: {"host", "pid", "started"}.

    acquire() refuses in one line when another process holds the flock, or when the file names a process on
    another host (which this host cannot see; flock need not reach across nodes), or a live process on this
    host. A lock left by a dead process on this host is taken over. release() removes the file, and the
    folder when acquire() made it and it stayed empty."""

    def __init__(self, out):
        self.out, self.path, self.fd, self.made = Path(out), Path(out) / LOCK_NAME, None, False

    def acquire(self) -> "RunLock":
        self.made = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = self._locked_fd()
            holder = self._holder(fd)
            if holder and self._alive(holder):
                os.close(fd)
                raise UserFacingError(in_use(self.out, holder))
            record = {"host": socket.gethostname(), "pid": os.getpid(),
                      "started": datetime.datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            self.fd = fd
        except OSError as error:
            raise UserFacingError(f"--out {self.out}: cannot write there ({error.strerror or error}); choose another "
                                  "--out") from None
        return self

    def _locked_fd(self) -> int:
        """An fd of the lock file holding its flock; refuses when another process holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise UserFacingError(in_use(self.out, holder)) from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:  # not a file its holder removed meanwhile
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    @staticmethod
    def _holder(fd: int) -> dict | None:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            return None  # empty or garbled: its writer died before writing it
        return holder if isinstance(holder, dict) else None

    @staticmethod
    def _alive(holder: dict) -> bool:
        """Whether the holder may still run: on another host (unknowable here) or a live pid on this one."""
        if holder.get("host") != socket.gethostname():
            return True
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid == os.getpid() or pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        if self.made:
            try:
                self.out.rmdir()  # made for a run that wrote nothing (refused after the lock)
            except OSError:
                pass


def in_use(out: Path, holder: dict | None) -> str:
    """The one line that refuses a second writer of `out`."""
    who = (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('started')}" if holder
           else "a process that is starting")
    return (f"{out} is in use by another run ({who}); wait for it to end, or choose another --out (if that run is "
            f"gone, delete {out / LOCK_NAME})")


def claim_run_folder(args, benchmark: str) -> RunLock | None:
    """Before a run reads its data: the folder is checked (check_run_folder: a refused folder is not touched,
    not even by the lock), rank 0 (the writer; $RANK under torchrun) takes <out>/.lock and, with --overwrite,
    removes the run it replaces; then the folder is checked again, under the lock (another run may have
    written it meanwhile): every rank alike, except under --overwrite, where rank 0 alone decides. Returns
    rank 0's lock, for release at the end."""
    if not args.overwrite:
        check_run_folder(args, benchmark)
    lock = RunLock(args.out).acquire() if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        if lock and args.overwrite:
            clear_run_folder(args.out)
        if lock or not args.overwrite:
            check_run_folder(args, benchmark)
    except BaseException:
        if lock:
            lock.release()
        raise
    return lock
