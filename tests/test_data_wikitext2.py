"""WikiText-2 word-level corpus and LSTM batching (docs/benchmarks.md)."""

import pytest
import torch

from data.wikitext2 import batchify, get_chunk, load_wikitext2, n_chunks
from common.errors import UserFacingError

from tests.helpers import DATA_DIR  # noqa: E402
from tests.helpers import needs_data as needs  # noqa: E402

needs_data = needs("wikitext-2/train.txt", "wikitext-2/valid.txt", "wikitext-2/test.txt")


@pytest.fixture(scope="module")
def corpus():
    return load_wikitext2(DATA_DIR)


@needs_data
def test_sizes_match_pytorch_examples(corpus):
    assert corpus.vocab_size == len(corpus.words) == 33_278
    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == (2_088_628, 217_646, 245_569)
    for t in (corpus.train, corpus.valid, corpus.test):
        assert t.dtype == torch.long and t.dim() == 1
        assert 0 <= t.min() and t.max() < corpus.vocab_size


@needs_data
def test_ids_in_first_seen_order_over_train_valid_test(corpus):
    stream = torch.cat([corpus.train, corpus.valid, corpus.test])
    # the first occurrence of id k comes before the first occurrence of id k+1
    first = torch.full((corpus.vocab_size,), len(stream), dtype=torch.long)
    first.scatter_reduce_(0, stream, torch.arange(len(stream)), reduce="amin")
    assert (first[1:] > first[:-1]).all()
    # train.txt starts with a blank line, then " = Valkyria Chronicles III = "
    assert corpus.words[:5] == ["<eos>", "=", "Valkyria", "Chronicles", "III"]
    assert [corpus.words[i] for i in corpus.train[:7]] == ["<eos>", "=", "Valkyria", "Chronicles", "III", "=", "<eos>"]


@needs_data
def test_lines_round_trip(corpus):
    lines = (DATA_DIR / "wikitext-2" / "valid.txt").read_text(encoding="utf8").splitlines()
    expect = [w for line in lines[:50] for w in line.split() + ["<eos>"]]
    assert [corpus.words[i] for i in corpus.valid[: len(expect)]] == expect


def test_batchify_columns_are_contiguous_streams():
    m = batchify(torch.arange(11), 3)  # 11 = 3 * 3 + 2: the last two are dropped
    assert m.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


@needs_data
def test_batchify_train_b16(corpus):
    m = batchify(corpus.train, 16)
    assert m.shape == (130_539, 16)
    assert torch.equal(m[:, 5], corpus.train[5 * 130_539 : 6 * 130_539])
    assert n_chunks(m.size(0), 35) == 3_729


def test_get_chunk_targets_shifted_and_flattened_time_major():
    m = batchify(torch.arange(24), 2)  # (12, 2): column 0 = 0..11, column 1 = 12..23
    assert n_chunks(12, 3) == 3  # (12 - 1) // 3
    inp, tgt = get_chunk(m, 1, 3)
    assert inp.tolist() == [[3, 15], [4, 16], [5, 17]]
    assert tgt.tolist() == [4, 16, 5, 17, 6, 18]  # tgt[t*B + b] follows inp[t, b]
    assert torch.equal(tgt.view(3, 2), inp + 1)
    get_chunk(m, 2, 3)  # the last chunk uses row 9, its target row 11 still exists
    with pytest.raises(IndexError):
        get_chunk(m, 3, 3)


def test_missing_files_one_line_error(tmp_path):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "train.txt").write_text("a b\n")
    with pytest.raises(UserFacingError) as e:
        load_wikitext2(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "valid.txt" in msg and "test.txt" in msg and "download" in msg
