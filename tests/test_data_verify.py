"""data/checksums.py: every loader refuses a published file that is not the published one (size or sha256),
in one line naming the file and what to do; the sha256 is cached so a start does not re-hash; the table
agrees with the data READMEs; the real data folder passes."""
import hashlib
import re
import zipfile
from pathlib import Path

import pytest

import data.checksums as checksums
from data.hmda import load_hmda
from data.m4 import load_m4
from data.wikitext2 import load_wikitext2
from data.wikitext103 import load_blocks
from common.errors import UserFacingError
from tests.helpers import DATA_DIR
from tests.test_data_hmda import write_sample


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private sha256 cache (and no entries of this process's earlier tests in memory)."""
    monkeypatch.setenv("CDGRAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CDGRAB_VERIFY_DATA", raising=False)
    monkeypatch.setattr(checksums, "_memory", {})
    return tmp_path / "cache" / "sha256.json"


def publish(monkeypatch, name: str, path: Path) -> None:
    """Make `path`'s bytes the published `name` (sha256 by hashlib here, independently of the cache)."""
    data = path.read_bytes()
    monkeypatch.setitem(checksums.KNOWN, name, (len(data), hashlib.sha256(data).hexdigest()))


def one_line(call) -> str:
    with pytest.raises(UserFacingError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "scripts/download_data.sh" in message, message
    return message


def zip_csv(path: Path, csv: Path, cut: int | None = None) -> Path:
    data = csv.read_bytes()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(csv.name, data if cut is None else data[:cut])
    return path


def test_an_hmda_csv_cut_short_inside_a_valid_zip_is_refused(tmp_path, monkeypatch, cache):
    csv = write_sample(tmp_path / "src" / "hmda_train_preprocessed.csv", n=60)
    published = zip_csv(tmp_path / "published.zip", csv)
    publish(monkeypatch, "hmda/raw/hmda_train_preprocessed.zip", published)
    raw = tmp_path / "data" / "hmda" / "raw"
    raw.mkdir(parents=True)
    zip_csv(raw / "hmda_train_preprocessed.zip", csv)
    assert len(load_hmda(tmp_path / "data").train_y) == 60 * 4 // 5  # the published bytes load
    cut = zip_csv(raw / "hmda_train_preprocessed.zip", csv, cut=len(csv.read_bytes()) // 2)
    with zipfile.ZipFile(cut) as z:
        assert z.testzip() is None  # a valid zip, its csv cut mid-way
    message = one_line(lambda: load_hmda(tmp_path / "data"))
    assert message.startswith(f"{cut} has ") and "hmda/raw/hmda_train_preprocessed.zip" in message


def test_same_size_other_bytes_is_refused_by_sha256_and_each_loader_checks(tmp_path, monkeypatch, cache):
    data = tmp_path / "data"
    files = {"m4/Toy-train.csv": '"V1","V2","V3","V4","V5","V6","V7","V8"\n"T1",1,2,3,4,5,6,7\n',
             "m4/Toy-test.csv": '"V1","V2"\n"T1",8\n',
             "wikitext-2/train.txt": " a b c \n", "wikitext-2/valid.txt": " a b \n", "wikitext-2/test.txt": " c \n",
             "wikitext-103/wiki.valid.tokens": " Hello world \n"}
    for name, text in files.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text(text)
        publish(monkeypatch, name, data / name)
    load_m4(data, freq="Toy", in_len=2, out_len=1, stride=1)
    load_wikitext2(data)
    calls = {"m4/Toy-train.csv": lambda: load_m4(data, freq="Toy", in_len=2, out_len=1, stride=1),
             "wikitext-2/valid.txt": lambda: load_wikitext2(data),
             "wikitext-103/wiki.valid.tokens": lambda: load_blocks(data, "valid", block_size=2,
                                                                   cache_dir=tmp_path / "blocks")}
    for name, call in calls.items():
        path = data / name
        original = path.read_bytes()
        path.write_bytes(original.replace(b"1", b"9") if b"1" in original else original.upper())  # same size
        message = one_line(call)
        assert message.startswith(f"{path} is not the published {name} (its sha256 differs")
        path.write_bytes(original[:-2])
        assert one_line(call).startswith(f"{path} has {len(original) - 2:,} bytes, but {name} has {len(original):,}")
        path.write_bytes(original)


def test_the_sha256_is_cached_by_path_size_mtime_and_inode(tmp_path, monkeypatch, cache):
    path = tmp_path / "m4" / "Weekly-test.csv"
    path.parent.mkdir()
    path.write_text('"V1","V2"\n"W1",3\n')
    publish(monkeypatch, "m4/Weekly-test.csv", path)
    hashed = []
    real_sha256 = hashlib.sha256
    monkeypatch.setattr(checksums.hashlib, "sha256", lambda: hashed.append(1) or real_sha256())
    checksums.verify(path)
    checksums.verify(path)
    assert len(hashed) == 1 and cache.is_file()
    monkeypatch.setattr(checksums, "_memory", {})  # a new process: the cache file answers
    checksums.verify(path)
    assert len(hashed) == 1
    path.write_text('"V1","V2"\n"W1",4\n')  # same size, new bytes and mtime: hashed again, and refused
    with pytest.raises(UserFacingError):
        checksums.verify(path)
    assert len(hashed) == 2
    cache.write_text("{garbled")  # a broken cache only costs a re-hash
    monkeypatch.setattr(checksums, "_memory", {})
    with pytest.raises(UserFacingError):
        checksums.verify(path)


def test_verification_can_be_turned_off_and_unknown_names_are_not_checked(tmp_path, monkeypatch, cache):
    path = tmp_path / "wikitext-2" / "train.txt"
    path.parent.mkdir()
    path.write_text("mine\n")
    with pytest.raises(UserFacingError):
        checksums.verify(path)
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")
    checksums.verify(path)
    monkeypatch.delenv("CDGRAB_VERIFY_DATA")
    checksums.verify(tmp_path / "wikitext-2" / "mine.txt")  # not a published name: nothing to compare with


def readme_of(name: str) -> str:
    return next((DATA_DIR / name.split("/")[0]).glob("README*")).read_text()


@pytest.mark.parametrize("name", sorted(checksums.KNOWN))
def test_the_table_holds_what_the_data_readmes_publish(name):
    """The oracle: each README's own sha256 and byte count for the file (the csv sums of HMDA's zips are in the
    zip row's contents column)."""
    size, sha = checksums.KNOWN[name]
    text = readme_of(name)
    file = Path(name).name
    rows = [line for line in text.splitlines() if file in line and sha in line]
    assert rows, f"{name}: no README line names it with sha256 {sha}"
    assert re.search(rf"\b{size:,}\b", rows[0]), f"{name}: {size:,} bytes not on its README line {rows[0]}"


def test_the_real_data_folder_passes(monkeypatch):
    """Every published file present in $CDGRAB_DATA verifies (through the user's cache: fast after the first
    run, which hashes about 60 MB; docs/data.md gives the time)."""
    present = [name for name in checksums.KNOWN if (DATA_DIR / name).is_file()]
    if not present:
        pytest.skip(f"no published data file in {DATA_DIR}")
    monkeypatch.delenv("CDGRAB_VERIFY_DATA", raising=False)
    for name in present:
        checksums.verify(DATA_DIR / name)
