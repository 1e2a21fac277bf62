"""GPT2-Wiki103 end to end on a tiny slice of the real data: every sorter trains, modes agree.

The slice: 8 training blocks of 32 tokens (2 workers x 4 blocks, one block per worker per step, so
4 steps per epoch), 4 validation and 4 test blocks, 2 epochs. The full 50,257-word GPT-2 embedding
is kept, so each step still handles 6.8M-parameter per-block gradients. Every run shares one token
cache, so WikiText-2's train.txt is tokenized once per module: by the module's first run, D-RR under
torchrun into the empty cache, whose stderr shows that one process tokenized while the other waited.
"""
import json
import math

import pytest
import torch

from sorters import SORTER_NAMES
from tests.helpers import (DATA_DIR, ENGINE_PATH_TWINS, assert_runs_agree, check_ok, check_run_files, entry_task,
                           error_lines, metrics_header, needs_data, read_metrics, run_script)

SCRIPT = "main-GPT2-Wiki103.py"
TRAIN_FILE = DATA_DIR / "wikitext-2" / "train.txt"
pytestmark = [
    pytest.mark.slow,
    needs_data("gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt", "wikitext-2/train.txt",
               "wikitext-103/wiki.valid.raw|wikitext-103/wiki.valid.tokens",
               "wikitext-103/wiki.test.raw|wikitext-103/wiki.test.tokens"),
]
QUICK = ["--max-seq-length", "32", "--max-train-examples", "8", "--max-eval-examples", "4",
         "--node_cnt", "2", "--B", "2", "--epochs", "2", "--lr", "3e-3", "--record-orders"]
HEADER = ["epoch", "train_loss", "test_loss", "valid_loss", "train_ppl", "valid_ppl", "test_ppl", "epoch_seconds",
          "sorter_seconds", "comm_seconds", "compute_seconds", "comm_bytes",
          "syncs", "mean_H", "density", "threshold", "load_imbalance"]
RESULT_COLUMNS = ("train_loss", "test_loss", "valid_loss", "train_ppl", "valid_ppl", "test_ppl")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(run directory, stderr, token cache) of the module's first run: D-RR under torchrun (2 processes)
    into an empty token cache, so it tokenizes every file; every later run reads that cache."""
    cache, out = tmp_path_factory.mktemp("token-cache"), tmp_path_factory.mktemp("first") / "D-RR-nproc2"
    result = run_script(SCRIPT, "--sorter", "D-RR", "--out", out, "--train-file", TRAIN_FILE, "--cache-dir", cache,
                        *QUICK, nproc=2)
    check_ok(result)
    return out, result.stderr, cache


@pytest.fixture(scope="module")
def cache_dir(first_run):
    """The module's token cache, filled by its first run."""
    return first_run[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir, first_run):
    """run(sorter, nproc=None) -> run directory; each configuration is trained once per module."""
    root, done = tmp_path_factory.mktemp("runs"), {("D-RR", 2): first_run[0]}

    def run(sorter, nproc=None):
        if (sorter, nproc) not in done:
            out = root / f"{sorter}-nproc{nproc or 1}"
            check_ok(run_script(SCRIPT, "--sorter", sorter, "--out", out, "--train-file", TRAIN_FILE,
                                "--cache-dir", cache_dir, *QUICK, nproc=nproc))
            done[sorter, nproc] = out
        return done[sorter, nproc]

    return run


# MB-GraB's step here is MLP-M4's (per-worker gradients from the per-unit outer products): tests/test_mlp_m4.py
@pytest.mark.parametrize("sorter", [name for name in SORTER_NAMES if name not in (*ENGINE_PATH_TWINS, "MB-GraB")])
def test_every_sorter_trains_and_writes_the_run_directory(runs, sorter):
    out = runs(sorter)
    assert metrics_header(out) == HEADER
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(math.isfinite(r[c]) for r in rows for c in RESULT_COLUMNS)
    assert rows[1]["train_loss"] < rows[0]["train_loss"] < 10.9  # ln(50,257) = 10.8 at a uniform guess
    for r in rows:
        for split in ("train", "valid", "test"):
            assert r[f"{split}_ppl"] == pytest.approx(math.exp(r[f"{split}_loss"]), rel=1e-12)
    config = json.loads((out / "config.json").read_text())
    assert config["sizes"] == {"n_workers": 2, "world_size": 1, "workers_per_process": 2, "units_per_worker": 4,
                               "units_per_step": 1, "steps_per_epoch": 4, "d": 6_846_080 - 96 * 128,
                               "global_batch": 2}
    assert config["data"]["train_blocks_used"] == 8 and config["data"]["block_size"] == 32
    assert config["data"]["valid_blocks"] == config["data"]["test_blocks"] == 4
    assert config["optimizer"]["name"] == "adamw" and config["args"]["sorter"] == sorter
    check_run_files(out, epochs=2, m=4)


@pytest.mark.parametrize("sorter", ["CD-GraB", "D-RR"])
def test_one_process_and_torchrun_give_the_same_orders_and_losses(runs, sorter):
    single, multi = runs(sorter), runs(sorter, nproc=2)
    assert json.loads((multi / "config.json").read_text())["sizes"]["world_size"] == 2
    assert_runs_agree(single, multi, RESULT_COLUMNS)


def test_the_tasks_precomputed_mask_gives_the_models_causal_logits(tmp_path, cache_dir):
    """The task passes its causal mask (1, 1, T, T) (models.gpt2.causal_mask) with the positions: its logits
    equal those of the model called on the ids alone (transformers makes its own causal mask), for whole
    blocks and for shorter ones (the mask's corner), and position t does not see tokens after t."""
    task, _ = entry_task(SCRIPT, torch.device("cpu"), "--train-file", TRAIN_FILE, "--cache-dir", cache_dir,
                         "--out", tmp_path / "unused", *QUICK)
    ids, flat = task.worker_blocks.flatten(0, 1)[:3], task.model.flat  # (3, 32)
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 50_257  # other tokens from position 20 on
    with torch.no_grad():
        for T in (32, 9):
            torch.testing.assert_close(task.logits(flat, ids[:, :T]),
                                       task.model.module(input_ids=ids[:, :T], use_cache=False).logits)
        logits, logits_changed = task.logits(flat, ids), task.logits(flat, changed)
    torch.testing.assert_close(logits_changed[:, :20], logits[:, :20])
    assert not torch.allclose(logits_changed[:, 20:], logits[:, 20:])


def test_one_gradient_pass_equals_the_chunked_passes_in_fewer_kernel_ops(tmp_path, cache_dir):
    """--grad-chunk all (a step's blocks in one forward and backward: what auto takes on a GPU) gives the
    chunked passes' mean gradient, loss and per-block gradients (--grad-chunk 1 here: the CPU's chunks of 16
    on a step of 64), to float32 rounding; its mean gradient is also the mean of its per-block ones (outer
    products, another path); and a D-RR step's pass dispatches fewer kernel ops than the chunked ones."""
    from bench.dispatch_count import OpCounter

    task, _ = entry_task(SCRIPT, torch.device("cpu"), "--train-file", TRAIN_FILE, "--cache-dir", cache_dir,
                         "--out", tmp_path / "unused", *QUICK, "--grad-chunk", "1")
    grad_chunk, default_chunk = (type(task).__init__.__globals__[name] for name in ("grad_chunk", "GRAD_CHUNK"))
    assert grad_chunk("auto", "cpu") == default_chunk and grad_chunk("auto", "cuda") is None
    flat, batch = task.model.flat, task.units([0, 1], torch.tensor([[2], [1]]))  # (2, 32): two blocks
    results, kernel_ops = {}, {}
    for chunk in ("1", "all"):
        task.grad_chunk = grad_chunk(chunk, "cpu")
        with OpCounter() as counter:
            grad, loss, _ = task.batch_grad(flat, batch)
        kernel_ops[chunk] = counter.kernel_ops
        unit_grads, unit_losses = task.unit_grads(flat, batch, 2, 1)
        results[chunk] = grad.clone(), loss, unit_grads.clone(), unit_losses.clone()
    for chunked, one_pass in zip(results["1"], results["all"]):
        torch.testing.assert_close(one_pass, chunked)
    torch.testing.assert_close(results["all"][0], results["all"][2].mean((0, 1)))
    torch.testing.assert_close(results["all"][1], results["all"][3].mean())
    assert kernel_ops["all"] < 0.6 * kernel_ops["1"]


def test_missing_train_file_is_one_line_and_exit_2(tmp_path, cache_dir):
    result = run_script(SCRIPT, "--train-file", tmp_path / "absent.txt", "--out", tmp_path / "run",
                        "--cache-dir", cache_dir, *QUICK)
    assert result.returncode == 2
    lines = error_lines(result)
    assert len(lines) == 1 and "absent.txt" in lines[0] and "--train-file" in lines[0]
    assert "Traceback" not in result.stderr


def test_torchrun_tokenizes_each_file_once(first_run, cache_dir):
    """Under torchrun local rank 0 builds the token cache while the other process waits, then both read it
    (before, every process tokenized every file): the module's first run found the cache empty."""
    out, stderr, _ = first_run
    tokenized = [line for line in stderr.splitlines() if line.startswith("tokenizing ")]
    assert len(tokenized) == 3, stderr
    files = {str(TRAIN_FILE), *(str(DATA_DIR / "wikitext-103" / f"wiki.{split}.tokens") for split in ("valid", "test"))}
    assert {line.split()[1] for line in tokenized} == files
    assert len(list(cache_dir.glob("*.pt"))) == 3
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2]
