"""--exact-low-memory on: the engine's CD-GraB balancing the layer records of each step's own backward
(sorters.ExactCDGraB) gives the orders of CD-GraB fed the formed per-unit gradients (the default path:
engine/functional.py's outer products, or MLP-M4's hand-written rollout backward, then sorters.CDGraB) and
its losses to float32 rounding, with an odd number of units per step (a pair spans two steps: the pending
unit), and one process equals torchrun."""
import pytest
import torch

from tests.helpers import (DATA_DIR, assert_runs_agree, check_ok, check_torchrun_agrees, error_lines, needs_data,
                           read_metrics, run_script)

M4 = ["--B", "6", "--node_cnt", "2", "--lr", "5e-4", "--max-train-examples", "72", "--max-eval-examples", "64",
      "--epochs", "2", "--record-orders", "--sorter", "CD-GraB"]  # k = 3: pending units; 6 steps an epoch
GPT2 = ["--max-seq-length", "16", "--max-train-examples", "12", "--max-eval-examples", "2", "--node_cnt", "2",
        "--B", "2", "--epochs", "2", "--lr", "3e-3", "--record-orders", "--sorter", "CD-GraB",
        "--train-file", DATA_DIR / "wikitext-2" / "train.txt"]  # k = 1: every other step completes the pairs
M4_COLUMNS = ("train_loss", "test_loss", "valid_loss", "test_smape")
GPT2_COLUMNS = ("train_loss", "test_loss", "valid_loss")


@pytest.fixture(scope="module")
def m4_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("m4-exact")
    for mode in ("off", "on"):
        check_ok(run_script("main-MLP-M4.py", "--out", root / mode, "--exact-low-memory", mode, *M4))
    return root


@needs_data("m4/Weekly-train.csv", "m4/Weekly-test.csv")
def test_mlp_m4_records_give_the_formed_gradients_orders(m4_runs):
    # the rollout calls each hidden layer 6 times a window: one record per call, summed per unit
    assert_runs_agree(m4_runs / "off", m4_runs / "on", M4_COLUMNS, bytes_equal=False)
    on, off = read_metrics(m4_runs / "on"), read_metrics(m4_runs / "off")
    assert all(a["comm_bytes"] < b["comm_bytes"] for a, b in zip(on, off))  # records: fewer bytes than (n, k, d)


@pytest.mark.slow
@needs_data("m4/Weekly-train.csv", "m4/Weekly-test.csv")
def test_mlp_m4_exact_low_memory_one_process_equals_torchrun(m4_runs, tmp_path):
    check_torchrun_agrees("main-MLP-M4.py", m4_runs / "on", tmp_path / "nproc2", "--exact-low-memory", "on", *M4,
                          columns=M4_COLUMNS)


@pytest.mark.slow
@needs_data("gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt", "wikitext-2/train.txt",
            "wikitext-103/wiki.valid.raw|wikitext-103/wiki.valid.tokens",
            "wikitext-103/wiki.test.raw|wikitext-103/wiki.test.tokens")
def test_gpt2_records_give_the_formed_gradients_orders(tmp_path):
    # the tied wte / lm_head: an embedding's rows and the head's outer products in one parameter
    for mode in ("off", "on"):
        check_ok(run_script("main-GPT2-Wiki103.py", "--out", tmp_path / mode, "--exact-low-memory", mode, *GPT2))
    assert_runs_agree(tmp_path / "off", tmp_path / "on", GPT2_COLUMNS, bytes_equal=False)


@pytest.mark.parametrize("script, flags, says", [
    ("main-MLP-M4.py", ["--sorter", "D-RR"], "--sorter D-RR"),
    ("main-MLP-M4.py", ["--sketch-dim", "64"], "--sketch-dim"),
    ("main-MLP-M4.py", ["--sync", "constant", "--H", "2"], "--sync constant"),
])
def test_exact_low_memory_refuses_what_it_does_not_do(tmp_path, script, flags, says):
    result = run_script(script, "--exact-low-memory", "on", *flags, "--out", tmp_path / "run", "--epochs", "1")
    lines = error_lines(result)
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0] and "--exact-low-memory" in lines[0], lines
    assert not (tmp_path / "run").exists()


@needs_data("wikitext-2/train.txt", "wikitext-2/valid.txt", "wikitext-2/test.txt")
def test_exact_low_memory_refuses_a_model_without_layer_rules(tmp_path):
    result = run_script("main-LSTM-Wiki2.py", "--exact-low-memory", "on", "--sorter", "CD-GraB", "--B", "4",
                        "--node_cnt", "2", "--bptt", "10", "--max-train-examples", "12", "--max-eval-examples", "2",
                        "--epochs", "1", "--out", tmp_path / "run")
    lines = error_lines(result)
    assert result.returncode == 2 and len(lines) == 1 and "LSTM-Wiki2" in lines[0], lines


class Tied(torch.nn.Module):
    """An embedding tied to the output layer (one parameter, two layers), a hidden Linear, a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.embed, self.hidden = torch.nn.Embedding(11, 5), torch.nn.Linear(5, 5)
        self.norm, self.head = torch.nn.LayerNorm(5), torch.nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):  # (B, T) -> (B,) per-example losses
        h = self.norm(torch.tanh(self.hidden(self.embed(ids))))
        return torch.nn.functional.cross_entropy(self.head(h).transpose(1, 2), ids.roll(1, 1), reduction="none").mean(1)


def tied_model():
    torch.manual_seed(0)
    return Tied().double()


def chunk_ids(rank: int) -> list:
    """A process's step in two chunks of 2 and 3 units; rank 1's with more tokens (padded when gathered)."""
    generator = torch.Generator().manual_seed(10 + rank)
    return [torch.randint(0, 11, (2, 4 + 2 * rank), generator=generator),
            torch.randint(0, 11, (3, 6), generator=generator)]


def record_parts(model, exact, chunks) -> list:
    parts = []
    for ids in chunks:
        with exact.recording() as recording:
            losses = model(ids)
            recording.watch(losses)
        (losses.sum() / 7).backward()
        parts.append(recording.units())
    return parts


def autograd_rows(model, exact, chunks) -> torch.Tensor:
    rows = []
    for ids in chunks:
        for row in ids:
            grads = torch.autograd.grad(model(row[None]).sum(), exact.params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_a_step_recorded_in_chunks_gives_every_units_gradient():
    """The engine records a step in chunks and places them side by side (sorters.gather.gather_parts): each
    unit's gradient formed from the placed records equals its own autograd gradient (float64), also when the
    chunks' token counts differ and a weight is used twice (an embedding tied to the output layer)."""
    from sorters.exact import ExactGradients
    from sorters.gather import gather_parts

    model = tied_model()
    exact = ExactGradients(model)
    chunks = chunk_ids(0) + chunk_ids(1)[:1]
    joined = gather_parts(record_parts(model, exact, chunks), distributed=False)
    assert joined.units == 7 and sorted({(first, x.units) for pieces in joined.pieces.values()
                                         for first, x in pieces}) == [(0, 2), (2, 3), (5, 2)]
    torch.testing.assert_close(exact.flat(joined), autograd_rows(model, exact, chunks), rtol=1e-10, atol=1e-12)


def gather_rank(rank, store, out):
    from sorters.exact import ExactGradients
    from sorters.gather import gather_parts

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = tied_model()
        exact = ExactGradients(model)
        every = gather_parts(record_parts(model, exact, chunk_ids(rank)), distributed=True)
        torch.save({"flat": exact.flat(every), "products": every.products(running_sum(exact.d))}, f"{out}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


def running_sum(d: int) -> torch.Tensor:
    return torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def test_two_gloo_processes_recording_in_chunks_give_every_units_gradient_in_rank_order(tmp_path):
    """Under torchrun each chunk is all-gathered on its own (rank 0's first chunk padded to rank 1's tokens) and
    every process's share placed at its units: rank-major, chunk after chunk within a rank, as one process
    hosting both ranks' units, whose products they equal bit for bit."""
    from sorters.exact import ExactGradients
    from sorters.gather import gather_parts
    from tests.helpers import run_forked

    run_forked(gather_rank, (tmp_path / "store", tmp_path / "run"), 2)
    model = tied_model()
    exact = ExactGradients(model)
    chunks = chunk_ids(0) + chunk_ids(1)
    expected = autograd_rows(model, exact, chunks)
    one = gather_parts(record_parts(model, exact, chunks), distributed=False).products(running_sum(exact.d))
    # the same units in other chunks (2 and 8 units, as one process with a larger step would cut them)
    regrouped = gather_parts(record_parts(model, exact, [chunks[0], torch.cat(chunks[1:])]), distributed=False)
    for rank in range(2):
        run = torch.load(tmp_path / f"run.rank{rank}")
        torch.testing.assert_close(run["flat"], expected, rtol=1e-10, atol=1e-12)
        assert all(torch.equal(x, y) for x, y in zip(run["products"], one)), rank
    assert all(torch.equal(x, y) for x, y in zip(regrouped.products(running_sum(exact.d)), one))
