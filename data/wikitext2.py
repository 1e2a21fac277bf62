"""WikiText-2, word level, as in pytorch/examples word_language_model (docs/benchmarks.md).

Each line is split on whitespace and gets an `<eos>` appended. One dictionary is built over
train + valid + test, in that order, with ids in first-seen order: 33,278 words. Token counts:
train 2,088,628, valid 217,646, test 245,569.

Batching for the LSTM:
    batchify(tokens, B)        -> (rows, B): column c is the c-th contiguous slice of the corpus
    n_chunks(rows, bptt)       -> (rows - 1) // bptt chunks
    get_chunk(matrix, i, bptt) -> input rows [i*bptt, (i+1)*bptt), target = the next rows, flattened
"""
from dataclasses import dataclass
from pathlib import Path

import torch

from data.files import require_files

SPLITS = ("train", "valid", "test")


@dataclass
class Corpus:
    """Token ids of the three splits (1-D LongTensors) and the shared id -> word list."""
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    words: list[str]

    @property
    def vocab_size(self) -> int:
        return len(self.words)


def _tokenize(path: Path, word2idx: dict[str, int], words: list[str]) -> torch.Tensor:
    """Ids of every word of `path` (+ `<eos>` per line), adding unseen words to the dictionary."""
    ids = []
    with open(path, encoding="utf8") as f:
        for line in f:
            for w in line.split() + ["<eos>"]:
                i = word2idx.get(w)
                if i is None:  # first time seen: the next free id
                    i = word2idx[w] = len(words)
                    words.append(w)
                ids.append(i)
    return torch.tensor(ids, dtype=torch.long)


def load_wikitext2(data_dir) -> Corpus:
    """Read `<data_dir>/wikitext-2/{train,valid,test}.txt` into a Corpus (one shared dictionary)."""
    paths = require_files(Path(data_dir) / "wikitext-2", [f"{s}.txt" for s in SPLITS], "WikiText-2")
    word2idx: dict[str, int] = {}
    words: list[str] = []
    # the order matters: ids are assigned in first-seen order over train, then valid, then test
    train, valid, test = (_tokenize(p, word2idx, words) for p in paths)
    return Corpus(train=train, valid=valid, test=test, words=words)


def batchify(tokens: torch.Tensor, n_streams: int) -> torch.Tensor:
    """(N,) -> (N // n_streams, n_streams). The tail that does not fill a row is dropped.

    Column c holds the c-th contiguous slice tokens[c*rows : (c+1)*rows], so each column is one
    independent stream read top to bottom.
    """
    rows = tokens.size(0) // n_streams
    return tokens[: rows * n_streams].view(n_streams, rows).t().contiguous()


def n_chunks(rows: int, bptt: int) -> int:
    """Number of full bptt-row chunks that still have a next-token target for their last row."""
    return (rows - 1) // bptt


def get_chunk(matrix: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk i of a (rows, B) matrix: input (bptt, B) = rows [i*bptt, i*bptt+bptt),
    target (bptt*B,) = the same rows shifted down by one, flattened row-major (time-major)
    so that target[t*B + b] is the token after input[t, b], matching the LSTM's (T*B, V) output."""
    start = i * bptt
    if i < 0 or start + bptt + 1 > matrix.size(0):
        raise IndexError(f"chunk {i} out of range: {n_chunks(matrix.size(0), bptt)} chunks of {bptt} rows")
    inp = matrix[start : start + bptt]
    target = matrix[start + 1 : start + 1 + bptt].reshape(-1)
    return inp, target
