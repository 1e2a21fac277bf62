"""What every step of the kit shares: where the checkout is, what the device tool brings back, its log
line and its one-line error."""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MIB = 1 << 20
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * MIB, 64 * MIB  # what the device tool brings back


def log(message: str) -> None:
    print(f"[gpu_session {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def write_atomically(path: Path, data: bytes) -> None:
    """Into $OUT under a temporary name, then renamed: a call cut mid-write leaves the previous file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
