"""The data files we know byte for byte, and the check every loader runs on them before reading.

KNOWN lists each file that scripts/download_data.sh fetches (or that the data READMEs describe) with its
size and sha256, as those READMEs give them; its row or line count is in the comment (a file of the
right sha256 has it). `verify(path)` refuses, in one line, a file whose path ends with one of these
names but whose size or sha256 differs (a truncated download, an HMDA csv cut inside a valid zip, an
edited file): say what to do, re-download it. Files with other names (your own --hmda-file, a LAR 2017
file, WikiText-103's raw files, --train-file) are not checked. CDGRAB_VERIFY_DATA=0 turns the check off,
for a file of your own under one of these names.

A file's sha256 is computed once and cached with its size, mtime and inode in
`$CDGRAB_CACHE/sha256.json` (default `~/.cache/cdgrab/sha256.json`), so a start re-hashes only a file
that changed; the size is compared before any hashing. docs/data.md has the table and the timings.
"""
import hashlib
import json
import os
import tempfile
from pathlib import Path

from common.errors import UserFacingError

# path under the data folder: (bytes, sha256). Counts from the data READMEs.
KNOWN = {
    # 195,285 train + 48,822 test targets
    "hmda/targets-processed-NY-2017.pt": (977_519, "9e5f8df65ab94dcad7812ab14313c01d127f6786b35ea2750a5904c9cb617d5c"),
    # a zip of hmda_train_preprocessed.csv: 160,338 rows, 23 columns
    "hmda/raw/hmda_train_preprocessed.zip": (4_135_600, "74b1c145b692f7f97814ddab2989b4ade7a5f4c384c3f8c0f84ae482f226add8"),
    "hmda/raw/hmda_train_preprocessed.csv": (29_559_626, "34a31af633361740fc6f6c5a9792f14d7c3b9ab74c538f903e4aac9d1ef5920e"),
    # 19,831 rows, no labels
    "hmda/raw/hmda_test_preprocessed.zip": (506_054, "a4e82a2784ac1e2963dc52620afe710960d18c35e09eb6709a82c81c0746476f"),
    "hmda/raw/hmda_test_preprocessed.csv": (3_598_974, "05a2a467cb17a28b296446df6b2ea0b03c8deb26ff7d631d3c8c4fa86aa7ac0d"),
    # 414 series (+ a header line)
    "m4/Hourly-train.csv": (2_347_115, "ea59b7783573c49077a835ab6465c7d66f1474783360f310988a9a737fbca62f"),
    "m4/Hourly-test.csv": (132_820, "71a57fccb15e534d973626ada4fb87febf789e9317715b7cc6dd3b5f90db6f42"),
    # 359 series (+ a header line)
    "m4/Weekly-train.csv": (4_015_067, "d478d3f6ed673e6ed3c2cb0fbed5425f72eedd51318ebebeb0b5ecfcefc37714"),
    "m4/Weekly-test.csv": (44_247, "3b2bc4be8e636e802260dcd843ca3c5da40536a1fbe1ecb3229a97dae4f44688"),
    # 36,718 / 3,760 / 4,358 lines
    "wikitext-2/train.txt": (10_797_148, "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f"),
    "wikitext-2/valid.txt": (1_121_681, "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
    "wikitext-2/test.txt": (1_256_449, "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"),
    # 3,760 / 4,358 lines
    "wikitext-103/wiki.valid.tokens": (1_142_309, "9aee9f52d6e77de6c7751fc5e7c44287db3ec0eaf15477098acc6b93c1c4250b"),
    "wikitext-103/wiki.test.tokens": (1_281_077, "56db52eb157b1ab5c89646eef70510c1eca6e12a3bfdb99f0d6b05b4eacb75b9"),
    # 50,257 entries; 50,001 lines (the header and 50,000 merges)
    "gpt2-tokenizer/vocab.json": (1_042_301, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "gpt2-tokenizer/merges.txt": (456_318, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}

CACHE_NAME = "sha256.json"
_memory: dict[str, dict] = {}  # this process's cache entries, by resolved path


def known_name(path: Path) -> str | None:
    """The KNOWN name that `path` ends with (its last one or two folders and its name), or None."""
    parts = Path(path).parts
    for name in KNOWN:
        tail = tuple(name.split("/"))
        if parts[-len(tail):] == tail:
            return name
    return None


def verify(path) -> None:
    """Refuse (UserFacingError, one line) a file named in KNOWN whose size or sha256 differs from its entry."""
    name = known_name(Path(path))
    if name is None or os.environ.get("CDGRAB_VERIFY_DATA", "1") == "0":
        return
    size, expected = KNOWN[name]
    fix = ("delete it and re-download it with scripts/download_data.sh DATA_DIR (or, for a file of your own under "
           f"this name, set CDGRAB_VERIFY_DATA=0)")
    actual = Path(path).stat().st_size
    if actual != size:
        raise UserFacingError(f"{path} has {actual:,} bytes, but {name} has {size:,} (truncated or changed); {fix}")
    if sha256_of(path) != expected:
        raise UserFacingError(f"{path} is not the published {name} (its sha256 differs; a changed or corrupted "
                              f"copy); {fix}")


def sha256_of(path) -> str:
    """The sha256 (hex) of the file's bytes, from the cache when its size, mtime and inode are unchanged."""
    path = Path(path).resolve()
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    entry = _memory.get(str(path)) or _read_cache().get(str(path))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items()) and "sha256" in entry:
        _memory[str(path)] = entry
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    entry = {**key, "sha256": digest.hexdigest()}
    _memory[str(path)] = entry
    _write_cache(str(path), entry)
    return entry["sha256"]


def cache_file() -> Path:
    return Path(os.environ.get("CDGRAB_CACHE") or Path.home() / ".cache" / "cdgrab").expanduser() / CACHE_NAME


def _read_cache() -> dict:
    try:
        cache = json.loads(cache_file().read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):  # none yet, unreadable or garbled: hash again
        return {}


def _write_cache(path: str, entry: dict) -> None:
    """Add one entry (atomically: a concurrent reader sees the old or the new file). A cache that cannot be
    written only costs a re-hash at the next start."""
    target = cache_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_cache()
        cache[path] = entry
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=CACHE_NAME + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f, indent=0)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


__all__ = ["KNOWN", "verify", "sha256_of", "known_name"]
