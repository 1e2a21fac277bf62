"""No host synchronisation inside a training step, for D-RR and CD-GraB on every benchmark.

On a GPU a host read (`.item()`, `.cpu()`, a Python `if` on a tensor, an index built from a Python
list) waits for every kernel queued before it, so the CPU can no longer run ahead of the GPU. The
engine reads the loss every LOSS_CHECK_EVERY steps and at the epoch's end, by design; nothing else in
a step may read the device.

- CUDA (skipped without a GPU): steps run under `torch.cuda.set_sync_debug_mode("error")`, which
  raises at any synchronising CUDA call.
- CPU (always): the same steps run under a torch-function mode that records the calls that would
  read a GPU tensor on the host (item, tolist, numpy, cpu, bool/int/float of a tensor) and indexing
  with a Python list. The sorter runs its device path (`signs_by_gram`), as it does on a GPU.
"""
import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

import engine.train as engine_train
import sorters.base as sorters_base
from engine.comm import LocalCommunicator
from tests.helpers import DATA_DIR, entry_task, needs_data

pytestmark = [needs_data("hmda/raw/hmda_train_preprocessed.zip", "m4/Weekly-train.csv", "m4/Weekly-test.csv",
                         "wikitext-2", "wikitext-103/wiki.valid.tokens|wikitext-103/wiki.valid.raw",
                         "gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt"),
              pytest.mark.slow]

# tiny slices with 2 workers; k odd for the LSTM and GPT-2 (pairs across steps), even for LR and MLP
CASES = {
    "LR-HMDA": ("main-LR-HMDA.py", ["--node_cnt", "2", "--B", "4", "--max-train-examples", "64",
                                    "--max-eval-examples", "64"]),
    "MLP-M4": ("main-MLP-M4.py", ["--node_cnt", "2", "--B", "4", "--max-train-examples", "64",
                                  "--max-eval-examples", "64"]),
    "LSTM-Wiki2": ("main-LSTM-Wiki2.py", ["--node_cnt", "2", "--B", "4", "--bptt", "8", "--carry-hidden",
                                          "--max-train-examples", "6", "--max-eval-examples", "2"]),
    "GPT2-Wiki103": ("main-GPT2-Wiki103.py", ["--node_cnt", "2", "--B", "2", "--max-seq-length", "16",
                                              "--max-train-examples", "8", "--max-eval-examples", "2",
                                              "--train-file", str(DATA_DIR / "wikitext-2" / "train.txt")]),
}
# reads of a tensor on the host, and tensors made from host data (which a step would copy to the GPU)
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.tensor, torch.as_tensor, torch.from_numpy}


class HostReads(TorchFunctionMode):
    """Records every tensor call that would read a GPU tensor on the host, and every index made from a
    Python list (a host-to-device copy that waits for the GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(func.__name__)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(part, list) for part in index):
                self.reads.append(f"{func.__name__} with a list")
            if any(isinstance(part, torch.Tensor) and part.dim() == 0 and not part.is_floating_point()
                   for part in index):  # torch reads a 0-d integer index on the host (item) to select with it
                self.reads.append(f"{func.__name__} with a 0-d tensor")
        return func(*args, **(kwargs or {}))


def train_watching_steps(monkeypatch, case, sorter, device, watch):
    """One epoch of `case` with `sorter`, every data_parallel_step inside the context watch()."""
    script, argv = CASES[case]
    task, args = entry_task(script, device, *argv, "--sorter", sorter, "--epochs", "1", "--progress", "off",
                            "--out", "unused")
    step = engine_train.data_parallel_step

    def watched_step(*step_args, **step_kwargs):
        with watch():
            return step(*step_args, **step_kwargs)

    monkeypatch.setattr(engine_train, "data_parallel_step", watched_step)
    monkeypatch.setattr(engine_train.runlog, "write_config", lambda *a, **k: None)
    monkeypatch.setattr(engine_train.runlog, "atomic_torch_save", lambda *a, **k: None)
    monkeypatch.setattr(engine_train.runlog, "write_metrics", lambda *a, **k: None)
    monkeypatch.setattr(engine_train.runlog, "end_segment", lambda *a, **k: None)  # reads the config.json not written
    return engine_train.train(task, args, LocalCommunicator(args.node_cnt, device), device)


@pytest.mark.parametrize("sorter", ["D-RR", "CD-GraB"])
@pytest.mark.parametrize("case", CASES)
def test_no_host_read_inside_a_step_on_the_cpu(monkeypatch, tmp_path, case, sorter):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sorters_base, "array_views", lambda *tensors: (torch, list(tensors)))  # the GPU path
    modes = []

    @contextlib.contextmanager
    def watch():
        with HostReads() as mode:
            modes.append(mode)
            yield

    rows = train_watching_steps(monkeypatch, case, sorter, torch.device("cpu"), watch)
    assert len(rows) == 1 and len(modes) >= 2
    reads = sorted({read for mode in modes for read in mode.reads})
    assert reads == [], f"{case} {sorter}: host reads inside a step: {reads}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible")
@pytest.mark.parametrize("sorter", ["D-RR", "CD-GraB"])
@pytest.mark.parametrize("case", CASES)
def test_no_host_synchronisation_inside_a_step_on_cuda(monkeypatch, tmp_path, case, sorter):
    monkeypatch.chdir(tmp_path)

    @contextlib.contextmanager
    def watch():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    rows = train_watching_steps(monkeypatch, case, sorter, torch.device("cuda", 0), watch)
    assert len(rows) == 1


def test_the_detector_sees_host_reads():
    """The CPU check is only as good as its detector: each kind of read it must catch."""
    x = torch.arange(4.0)
    with HostReads() as mode:
        x.sum().item()
        bool(x[0] > 0)
        x.cpu()
        x[[0, 1]]
        x.tolist()
        x[torch.as_tensor([0, 1])]
        x[x.argmax()]
        x[x.argmax()[None]]  # a 1-element index: an index kernel, no read
    assert mode.reads == ["item", "__bool__", "cpu", "__getitem__ with a list", "tolist", "as_tensor",
                          "__getitem__ with a 0-d tensor"]
