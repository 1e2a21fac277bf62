"""WikiText-103 for the tiny GPT-2 (docs/benchmarks.md): GPT-2 BPE ids cut into fixed-length blocks.

Tokenizer: the GPT-2 byte-level BPE, built offline from `<data_dir>/gpt2-tokenizer/{vocab.json,merges.txt}`
(50,257 ids; "Hello world" -> [15496, 995]).

Blocks, like Hugging Face run_clm's `group_texts` but over the whole file at once:
  - every line of the file is one text, kept with its trailing newline, as in the HF raw dataset
    rows; a blank line becomes "" (HF's wikitext script does the same), so it adds no tokens;
  - each line is tokenized in full. The original truncated every line to 128 tokens, which throws
    text away (bug 8 in docs/differences.md); we do not;
  - no EOS is inserted; all ids are concatenated and cut into (N_blocks, block_size), the remainder
    is dropped.

Files: `<data_dir>/wikitext-103/wiki.{split}.raw`, else `wiki.{split}.tokens`. The train split is not
on our machines: pass `train_file` (the stand-in is WikiText-2's train.txt, same format as .tokens).

Cache: the block tensor is saved as `<cache>/<file stem>-<sha256[:16] of the file>-b<block_size>.pt`
in the first usable of: `cache_dir`, `$CDGRAB_CACHE`, `<folder of the data file>/cache`,
`~/.cache/cdgrab`.
"""
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer

from common.errors import UserFacingError
from data.checksums import sha256_of, verify
from data.files import DOWNLOAD_HINT, require_files

SPLITS = ("train", "valid", "test")
LINES_PER_BATCH = 10_000  # encode_batch this many lines at a time: fast, and bounded memory on big files


def gpt2_tokenizer(data_dir) -> ByteLevelBPETokenizer:
    """The GPT-2 byte-level BPE tokenizer from local vocab.json + merges.txt (no download)."""
    vocab, merges = require_files(Path(data_dir) / "gpt2-tokenizer", ["vocab.json", "merges.txt"],
                                  "GPT-2 tokenizer")
    return ByteLevelBPETokenizer(str(vocab), str(merges))


def split_file(data_dir, split: str, train_file=None) -> Path:
    """Path of the text file of `split`; raises UserFacingError when it is missing."""
    if split not in SPLITS:
        raise UserFacingError(f"unknown WikiText-103 split {split!r}; use one of {', '.join(SPLITS)}")
    hint = f"pass --train-file (e.g. {Path(data_dir) / 'wikitext-2' / 'train.txt'})"
    if split == "train" and train_file is not None:
        path = Path(train_file)
        if not path.is_file():
            raise UserFacingError(f"train file {path} not found; {hint}")
        verify(path)  # e.g. the stand-in wikitext-2/train.txt
        return path
    folder = Path(data_dir) / "wikitext-103"
    for name in (f"wiki.{split}.raw", f"wiki.{split}.tokens"):
        if (folder / name).is_file():
            verify(folder / name)
            return folder / name
    if split == "train":  # the ~540 MB train split is not on our machines: point at the stand-in
        raise UserFacingError(f"WikiText-103 train split not found in {folder} "
                              f"(wiki.train.raw or wiki.train.tokens); {hint}")
    raise UserFacingError(f"WikiText-103 {split} split not found: missing {folder / f'wiki.{split}.raw'} "
                          f"or {folder / f'wiki.{split}.tokens'}; {DOWNLOAD_HINT}")


def tokenize_file(path: Path, tokenizer: ByteLevelBPETokenizer) -> torch.Tensor:
    """All GPT-2 ids of the file, line by line, concatenated: (n_tokens,) long."""
    chunks = []

    def flush(lines):
        for enc in tokenizer.encode_batch(lines):
            chunks.append(np.asarray(enc.ids, dtype=np.int32))  # int32 halves peak memory; ids < 50,257

    lines = []
    with open(path, encoding="utf8") as f:
        for line in f:
            lines.append(line if line.strip() else "")  # HF wikitext: blank lines are empty rows
            if len(lines) == LINES_PER_BATCH:
                flush(lines)
                lines = []
    flush(lines)
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return torch.from_numpy(ids).long()


def to_blocks(ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n,) -> (n // block_size, block_size); the remainder is dropped."""
    n = ids.numel() // block_size
    return ids[: n * block_size].view(n, block_size).clone()


def file_digest(path: Path) -> str:
    """First 16 hex digits of the sha256 of the file's bytes (names the cache entry); hashed once per change
    of the file (data/checksums.py caches it)."""
    return sha256_of(path)[:16]


def _writable_dir(folder: Path) -> bool:
    """True when `folder` (or, if absent, its parent) may be written to.

    Besides os.access we also require a write bit in the mode: as root os.access says yes everywhere,
    and we must not drop cache files into a data folder that was deliberately made read-only.
    """
    target = folder if folder.exists() else folder.parent
    return target.is_dir() and os.access(target, os.W_OK) and bool(target.stat().st_mode & 0o222)


def cache_folder(data_file: Path, cache_dir=None) -> Path:
    """Where the block cache of `data_file` lives (see the module docstring for the order)."""
    explicit = cache_dir or os.environ.get("CDGRAB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    beside = data_file.parent / "cache"
    if _writable_dir(beside):
        return beside
    return Path.home() / ".cache" / "cdgrab"


def _save_atomic(tensor: torch.Tensor, path: Path) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tensor, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_blocks(data_dir, split: str, block_size: int = 128, train_file=None, cache_dir=None) -> torch.Tensor:
    """GPT-2 token blocks of one WikiText-103 split: LongTensor (N_blocks, block_size).

    The first call tokenizes the file (saying so on stderr) and caches the result; later calls load the
    cache. Under torchrun, call it inside engine.comm.node_leader_first() so one process per node
    tokenizes while the others wait, then read its cache.
    """
    if block_size < 1:
        raise UserFacingError(f"block size must be positive, got {block_size}")
    path = split_file(data_dir, split, train_file)
    folder = cache_folder(path, cache_dir)
    cache = folder / f"{path.stem}-{file_digest(path)}-b{block_size}.pt"
    if cache.is_file():
        try:
            blocks = torch.load(cache, weights_only=True)
            if blocks.dim() == 2 and blocks.size(1) == block_size:
                return blocks
        except Exception:  # unreadable cache entry: rebuild it below
            pass

    print(f"tokenizing {path} into {block_size}-token blocks (cached in {folder})", file=sys.stderr, flush=True)
    blocks = to_blocks(tokenize_file(path, gpt2_tokenizer(data_dir)), block_size)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _save_atomic(blocks, cache)
    except OSError as e:
        raise UserFacingError(f"cannot write the token cache in {folder} ({e.strerror}); "
                              f"pass a writable --cache-dir or set CDGRAB_CACHE") from None
    return blocks
