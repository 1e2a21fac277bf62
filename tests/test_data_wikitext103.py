"""GPT-2 tokenizer, WikiText-103 blocks and their cache (docs/benchmarks.md)."""
import os
import stat
from pathlib import Path

import pytest
import torch

import data.wikitext103 as wt
from data.wikitext103 import cache_folder, gpt2_tokenizer, load_blocks
from common.errors import UserFacingError

from tests.helpers import DATA_DIR, require_data  # noqa: E402
from tests.helpers import needs_data as needs  # noqa: E402

TOKENIZER = ("gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt")
needs_tokenizer = needs(*TOKENIZER)  # tests on toy WikiText files
# the counts below are those of the .tokens variant on our machines
needs_data = needs(*TOKENIZER, "wikitext-103/wiki.valid.tokens", "wikitext-103/wiki.test.tokens")


@pytest.fixture(autouse=True)
def no_env_cache(monkeypatch):
    monkeypatch.delenv("CDGRAB_CACHE", raising=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache folder for the module, so every file is tokenized once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer(DATA_DIR)


def _toy_data_dir(root: Path, text: str, name="wiki.valid.tokens") -> Path:
    """A data dir with a small WikiText-103 file and (a link to) the real tokenizer files."""
    (root / "wikitext-103").mkdir(parents=True)
    (root / "wikitext-103" / name).write_text(text, encoding="utf8")
    (root / "gpt2-tokenizer").symlink_to(DATA_DIR / "gpt2-tokenizer")
    return root


@needs_tokenizer
def test_tokenizer_is_gpt2(tok):
    assert tok.encode("Hello world").ids == [15496, 995]
    assert tok.get_vocab_size() == 50_257
    assert tok.token_to_id("<|endoftext|>") == 50_256


@needs_data
def test_valid_blocks_are_full_lines_concatenated(tok, cache):
    blocks = load_blocks(DATA_DIR, "valid", cache_dir=cache)
    lines = (DATA_DIR / "wikitext-103" / "wiki.valid.tokens").read_text(encoding="utf8").splitlines(keepends=True)
    per_line = [tok.encode(line).ids if line.strip() else [] for line in lines]
    ids = [i for line in per_line for i in line]
    assert len(ids) == 247_137
    assert blocks.shape == (len(ids) // 128, 128) == (1_930, 128) and blocks.dtype == torch.long
    assert blocks.flatten().tolist() == ids[: blocks.numel()]
    # no per-line truncation (bug 8): long paragraphs keep all their tokens
    assert max(map(len, per_line)) > 128
    assert blocks.numel() > sum(min(len(p), 128) for p in per_line)
    # a line keeps its newline (198) and a blank line adds nothing: " = Homarus gammarus = \n"
    assert per_line[1][-2:] == [220, 198] and per_line[0] == []
    assert ids[:9] == per_line[1]


@needs_data
def test_test_split_and_block_size(cache):
    assert load_blocks(DATA_DIR, "test", cache_dir=cache).shape == (2_205, 128)  # 282,300 tokens
    b64 = load_blocks(DATA_DIR, "valid", block_size=64, cache_dir=cache)
    b128 = load_blocks(DATA_DIR, "valid", cache_dir=cache)
    assert b64.shape == (3_861, 64)  # 247,137 // 64
    assert torch.equal(b64[: 2 * 1_930].reshape(-1, 128), b128)


@needs_data
def test_train_stand_in_and_missing_train(cache):
    with pytest.raises(UserFacingError) as e:
        load_blocks(DATA_DIR, "train", cache_dir=cache)
    msg = str(e.value)
    assert "\n" not in msg and "pass --train-file" in msg and "wikitext-2/train.txt" in msg
    with pytest.raises(UserFacingError, match="pass --train-file"):
        load_blocks(DATA_DIR, "train", train_file=DATA_DIR / "nope.txt", cache_dir=cache)
    require_data("wikitext-2/train.txt")
    stand_in = DATA_DIR / "wikitext-2" / "train.txt"
    blocks = load_blocks(DATA_DIR, "train", train_file=stand_in, cache_dir=cache)
    assert blocks.shape == (18_925, 128)  # 2,422,480 GPT-2 tokens


@needs_data
def test_cache_round_trip(cache, monkeypatch):
    first = load_blocks(DATA_DIR, "valid", cache_dir=cache)
    files = sorted(p.name for p in cache.glob("wiki.valid-*-b128.pt"))
    assert files == [f"wiki.valid-{wt.file_digest(DATA_DIR / 'wikitext-103' / 'wiki.valid.tokens')}-b128.pt"]
    assert files[0] == "wiki.valid-9aee9f52d6e77de6-b128.pt"  # sha256 from the data README
    assert not list(cache.glob("*.tmp"))  # the atomic write left nothing behind

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(wt, "tokenize_file", no_tokenizing)
    assert torch.equal(load_blocks(DATA_DIR, "valid", cache_dir=cache), first)
    monkeypatch.setenv("CDGRAB_CACHE", str(cache))  # the environment variable is honoured too
    assert torch.equal(load_blocks(DATA_DIR, "valid"), first)


@needs_tokenizer
def test_corrupt_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")  # fabricated files under the published names
    data = _toy_data_dir(tmp_path / "d", "a b c d e f g h\n" * 8)
    first = load_blocks(data, "valid", block_size=4, cache_dir=tmp_path / "c")
    (entry,) = (tmp_path / "c").glob("*.pt")
    entry.write_bytes(b"not a tensor")
    assert torch.equal(load_blocks(data, "valid", block_size=4, cache_dir=tmp_path / "c"), first)


@needs_tokenizer
def test_raw_file_preferred_over_tokens(tmp_path):
    data = _toy_data_dir(tmp_path, " one two three four five six seven eight\n" * 4, name="wiki.test.tokens")
    (data / "wikitext-103" / "wiki.test.raw").write_text(" Hello world\n" * 8)
    blocks = load_blocks(data, "test", block_size=3, cache_dir=tmp_path / "c")
    assert blocks[0].tolist() == [18435, 995, 198]  # " Hello", " world", "\n"
    assert blocks.shape == (8, 3)


@needs_tokenizer
def test_cache_beside_data_when_writable_else_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")  # fabricated files under the published names
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    text = " = Title = \n \n Some words here .\n" * 20
    writable = _toy_data_dir(tmp_path / "w", text)
    load_blocks(writable, "valid", block_size=8)
    assert len(list((writable / "wikitext-103" / "cache").glob("wiki.valid-*-b8.pt"))) == 1

    readonly = _toy_data_dir(tmp_path / "r", text)
    folder = readonly / "wikitext-103"
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)  # r-x: even root must not write here
    try:
        blocks = load_blocks(readonly, "valid", block_size=8)
        assert sorted(os.listdir(folder)) == ["wiki.valid.tokens"]
        assert len(list((tmp_path / "home" / ".cache" / "cdgrab").glob("wiki.valid-*-b8.pt"))) == 1
        assert torch.equal(blocks, load_blocks(writable, "valid", block_size=8))
    finally:
        folder.chmod(0o755)


@needs_data
def test_shared_data_dir_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = DATA_DIR / "wikitext-103" / "wiki.valid.tokens"
    if path.parent.stat().st_mode & 0o222:
        pytest.skip("the shared data dir is writable here")
    assert cache_folder(path) == tmp_path / ".cache" / "cdgrab"


def test_bad_split_and_missing_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")  # fabricated files under the published names
    with pytest.raises(UserFacingError, match="unknown WikiText-103 split"):
        load_blocks(tmp_path, "validation")
    with pytest.raises(UserFacingError) as e:
        load_blocks(tmp_path, "valid", cache_dir=tmp_path / "c")
    msg = str(e.value)
    assert "\n" not in msg and "wiki.valid.raw" in msg and "wiki.valid.tokens" in msg and "download" in msg
    (tmp_path / "wikitext-103").mkdir()
    (tmp_path / "wikitext-103" / "wiki.valid.tokens").write_text("x\n")
    with pytest.raises(UserFacingError) as e:  # the tokenizer files are missing
        load_blocks(tmp_path, "valid", cache_dir=tmp_path / "c")
    assert "\n" not in str(e.value) and "vocab.json" in str(e.value)
