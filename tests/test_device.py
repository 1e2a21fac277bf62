"""Device choice, the NCCL refusals, and checkpoints that resume on another device, all on the CPU.

The GPU itself is exercised in tests/test_cuda.py (skipped without CUDA); here torch.cuda and
torch.distributed are replaced by recorders where a rule needs them.
"""
import argparse
import json
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from engine import checkpoint as checkpoint_module
from engine import comm as comm_module
from engine import device as device_module
from engine import progress as progress_module
from engine.checkpoint import restore
from engine.cli import check_args, common_parser
from engine.comm import DistributedCommunicator, LocalCommunicator, node_leader_first
from engine.device import choose_device, set_tf32, setup_device, tf32_settings
from common.errors import UserFacingError
from engine.functional import FlatModel
from engine.optim import Optimizer, LRSchedule
from engine.progress import RegionTimer
from engine.task import Task
from engine.train import train
from sorters import build_sorter
from tests.helpers import REPO, check_ok, error_lines, needs_data, run_script

CPU, GPU = torch.device("cpu"), lambda index: torch.device("cuda", index)


# ---------------------------------------------------------------- choose_device: the rules
@pytest.mark.parametrize("choice,backend,local_rank,local_processes,visible,distributed,expected", [
    # one process
    ("auto", None, 0, 1, 0, False, (CPU, None)),
    ("auto", None, 0, 1, 2, False, (GPU(0), None)),
    ("cpu", None, 0, 1, 2, False, (CPU, None)),
    ("cuda", None, 0, 1, 1, False, (GPU(0), None)),
    ("cuda", "nccl", 0, 1, 1, False, (GPU(0), None)),  # no process group: the backend is not used
    # torchrun: every process its own GPU, NCCL by default
    ("auto", None, 0, 4, 4, True, (GPU(0), "nccl")),
    ("auto", None, 3, 4, 4, True, (GPU(3), "nccl")),
    ("cuda", "nccl", 1, 2, 8, True, (GPU(1), "nccl")),
    # gloo may share GPUs between processes
    ("cuda", "gloo", 2, 4, 2, True, (GPU(0), "gloo")),
    ("cuda", "gloo", 3, 4, 2, True, (GPU(1), "gloo")),
    # the CPU under torchrun: gloo
    ("auto", None, 1, 2, 0, True, (CPU, "gloo")),
    ("cpu", None, 1, 2, 4, True, (CPU, "gloo")),
    ("cpu", "gloo", 0, 2, 4, True, (CPU, "gloo")),
])
def test_each_process_gets_its_own_device(choice, backend, local_rank, local_processes, visible, distributed,
                                          expected):
    assert choose_device(choice, backend, local_rank, local_processes, visible, distributed) == expected


@pytest.mark.parametrize("choice,backend,local_processes,visible,distributed,message", [
    ("cuda", None, 1, 0, False, r"--device cuda was asked for but no CUDA device is visible; use --device cpu"),
    ("cuda", None, 2, 0, True, r"no CUDA device is visible"),
    ("cpu", "nccl", 2, 0, True, r"--backend nccl needs CUDA GPUs.*\(--device cpu\); use --backend gloo"),
    ("cpu", "nccl", 1, 4, False, r"--backend nccl needs CUDA GPUs.*\(--device cpu\)"),
    ("auto", "nccl", 2, 0, True, r"--backend nccl needs CUDA GPUs.*\(no CUDA device is visible\)"),
    ("auto", None, 4, 2, True, r"needs one GPU per process.*4 processes.*sees 2 GPU.*--nproc_per_node 2 .*"
                               r"--node_cnt.*--backend gloo"),
    ("cuda", "nccl", 2, 1, True, r"needs one GPU per process.*--nproc_per_node 1 "),
])
def test_impossible_combinations_are_refused_with_what_to_do(choice, backend, local_processes, visible, distributed,
                                                             message):
    with pytest.raises(UserFacingError, match=message):
        choose_device(choice, backend, 0, local_processes, visible, distributed)


def test_setup_device_makes_this_process_gpu_current(monkeypatch):
    """Under torchrun, local rank 1 of 2 on a 2-GPU node computes on cuda:1 and makes it current
    (before: every rank opened a context on GPU 0)."""
    current = []
    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device_module.torch.cuda, "set_device", current.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert setup_device("auto", None) == (GPU(1), "nccl") and current == [GPU(1)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(UserFacingError, match="--nproc_per_node 2"):
        setup_device("auto", None)
    current.clear()
    assert setup_device("cpu", None) == (CPU, "gloo") and current == []


def test_nccl_process_group_is_told_its_device(monkeypatch):
    calls = []
    monkeypatch.setattr(comm_module.dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(comm_module.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(comm_module.dist, "get_rank", lambda: 1)
    nccl = DistributedCommunicator(4, GPU(1), "nccl", 60)
    assert calls[-1]["backend"] == "nccl" and calls[-1]["device_id"] == GPU(1)
    assert nccl.device == GPU(1) and nccl.local_workers == [2, 3]
    DistributedCommunicator(4, CPU, "gloo", 60)
    assert calls[-1]["backend"] == "gloo" and "device_id" not in calls[-1]


def test_cuda_region_timing_reads_the_device_once_per_epoch(monkeypatch):
    """Region boundaries are CUDA events on the process's (current) device; the host waits only when
    the epoch's seconds are read, never per step."""
    ticks, host_waits = iter(range(100)), []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = next(ticks)

        def synchronize(self):
            host_waits.append(self.at)

        def elapsed_time(self, end):  # milliseconds, like CUDA's
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(progress_module.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(progress_module.torch.cuda, "synchronize", lambda *a: host_waits.append("sync"))
    timer = RegionTimer(GPU(3))
    for _ in range(3):  # three steps: compute 1 tick, comm 1, sorter 1, compute 1
        for region in ("compute", "comm", "sorter", "compute"):
            timer.lap(region)
    assert host_waits == []
    assert timer.seconds() == {"sorter": 3.0, "comm": 3.0, "compute": 6.0}
    assert host_waits == [12]  # one wait, on the last boundary
    cpu = RegionTimer(CPU)
    cpu.lap("compute")
    assert cpu.seconds()["compute"] >= 0 and host_waits == [12]


def test_leader_first_is_a_plain_block_outside_torchrun():
    ran = []
    with node_leader_first():
        ran.append(1)
    assert ran == [1]


# ---------------------------------------------------------------- TF32: off unless --tf32
@pytest.fixture
def tf32_restored():
    """Puts the process-wide TF32 flags back as they were."""
    before = tf32_settings()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before["matmul"], before["cudnn"]


def test_set_tf32_sets_both_backends_and_leaves_every_reader_working(tf32_restored):
    """Both the cuBLAS and the cuDNN flag follow the setting; nothing warns, and the flags and the
    matmul precision stay readable (with torch's newer fp32_precision properties they raise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set_tf32(True) == {"matmul": True, "cudnn": True}
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
        assert set_tf32(False) == {"matmul": False, "cudnn": False}
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"


@needs_data("hmda/raw/hmda_train_preprocessed.zip")
@pytest.mark.slow
def test_tf32_is_off_unless_asked_for_and_config_json_records_it(tmp_path):
    """PyTorch's default leaves cuDNN's TF32 on; a run turns both flags off unless --tf32."""
    for flags, allowed in (([], False), (["--tf32"], True)):
        out = tmp_path / f"tf32-{allowed}"
        check_ok(run_script("main-LR-HMDA.py", "--out", out, "--epochs", "1", "--max-train-examples", "64",
                            "--max-eval-examples", "64", *flags))
        config = json.loads((out / "config.json").read_text())
        assert config["tf32"] == {"matmul": allowed, "cudnn": allowed} and config["args"]["tf32"] is allowed


@pytest.mark.parametrize("script", ["main-LR-HMDA.py", "main-LSTM-Wiki2.py", "main-MLP-M4.py", "main-GPT2-Wiki103.py"])
def test_every_entry_script_explains_tf32(script):
    # a fresh interpreter on purpose (not the script server): each entry script imports from scratch
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                            check=True, timeout=120)
    words = " ".join(result.stdout.split())
    assert re.search(r"--tf32 allow TensorFloat-32 in CUDA .{0,200}default off: full float32", words), result.stdout


# ---------------------------------------------------------------- refused end to end, one line, exit 2
@needs_data("hmda/raw/hmda_train_preprocessed.zip")
@pytest.mark.slow
@pytest.mark.parametrize("flags,nproc,message", [
    (["--backend", "nccl", "--device", "cpu"], None, "--backend nccl needs CUDA GPUs"),
    (["--backend", "nccl", "--device", "cpu"], 2, "--backend nccl needs CUDA GPUs"),
    (["--backend", "nccl"], 2, "--backend nccl needs CUDA GPUs"),  # auto on this CPU-only machine
    (["--device", "cuda"], None, "--device cuda was asked for but no CUDA device is visible"),
])
def test_nccl_without_gpus_is_refused_before_anything_starts(tmp_path, flags, nproc, message):
    if torch.cuda.is_available() and "cpu" not in flags:
        pytest.skip("this machine has a GPU (tests/test_cuda.py covers it)")
    result = run_script("main-LR-HMDA.py", "--out", tmp_path / "run", "--epochs", "1", *flags, nproc=nproc,
                        timeout=120)
    assert result.returncode != 0
    lines = error_lines(result)
    # one line per process that got to print it (torchrun stops the others when the first exits)
    assert 1 <= len(lines) <= (nproc or 1) and len(set(lines)) == 1, result.stderr
    assert message in lines[0] and "Traceback" not in lines[0]
    assert "NCCL error" not in result.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- checkpoints across devices
class ToyRegression(Task):
    """2 workers x 4 examples of a 3-feature linear regression; one example per worker per step."""

    name = "toy"

    def __init__(self, device):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(2, 4, 3, generator=generator).to(device)  # (n, m, features)
        self.y = torch.randn(2, 4, generator=generator).to(device)     # (n, m)
        self.n_workers, self.n_units, self.units_per_step, self.global_batch = 2, 4, 1, 2
        self.model = FlatModel(torch.nn.Linear(3, 1)).to(device)
        self.data_info = {}

    def units(self, workers, unit_ids):
        rows = torch.as_tensor(workers)[:, None]
        return self.x[rows, unit_ids].flatten(0, 1), self.y[rows, unit_ids].flatten(0, 1)

    def loss(self, flat, batch):
        x, y = batch
        return F.mse_loss(self.model(flat, x).squeeze(-1), y), None

    def evaluate(self, flat, comm):
        loss, _ = self.loss(flat, (self.x.flatten(0, 1), self.y.flatten(0, 1)))
        return {"train_loss": loss, "test_loss": loss}


def toy_args(out, sorter="CD-GraB") -> argparse.Namespace:
    parser = common_parser("toy", "toy", dict(sorter=sorter, lr=0.1, B=2, node_cnt=2, epochs=1))
    args = parser.parse_args(["--out", str(out), "--progress", "off", "--device", "cpu"])
    check_args(args, "toy")
    return args


def run_objects(args, device):
    """The objects restore() fills, built as train() builds them, on `device`."""
    task = ToyRegression(device)
    flat = task.model.flat
    sorter = build_sorter(args.sorter, task.n_workers, task.n_units, task.model.d, seed=args.seed, device=device)
    optimizer = Optimizer(task.optimizer, flat, LRSchedule(args.lr, 4), args.momentum, args.weight_decay)
    return flat, optimizer, sorter


def test_checkpoint_restores_onto_another_device(tmp_path, monkeypatch):
    """A checkpoint written on the CPU is read onto the CPU and moved, piece by piece, to the device of
    the resuming run; the RNG states stay CPU tensors. The "meta" device stands in for a GPU here: with
    the old torch.load(map_location=device) the CPU RNG state became a meta tensor and
    torch.set_rng_state failed, as it did with a CUDA one (TypeError)."""
    args = toy_args(tmp_path / "run")
    torch.manual_seed(0)
    train(ToyRegression(CPU), args, LocalCommunicator(2), CPU)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)

    locations = []
    real_load = torch.load
    monkeypatch.setattr(checkpoint_module.torch, "load", lambda *a, **k: locations.append(k.get("map_location"))
                        or real_load(*a, **k))
    torch.manual_seed(123)  # something else, to see the restore
    meta = torch.device("meta")
    flat, optimizer, sorter = run_objects(args, meta)
    rows, _, first_epoch = restore(tmp_path / "run" / "checkpoint.pt", dict(vars(args)), flat, optimizer, sorter, meta)
    assert locations == ["cpu"]
    assert first_epoch == 2 and repr(rows) == repr(saved["rows"])  # repr: nan (ExDyna's threshold column) == nan
    assert flat.device == meta
    assert all(leaf.device == meta for leaf in optimizer.state_dict().values() if torch.is_tensor(leaf))
    assert all(value.device == meta for value in vars(sorter).values() if torch.is_tensor(value))
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])


def test_checkpoint_with_a_cuda_rng_state_resumes_on_the_cpu(tmp_path):
    """A checkpoint from a CUDA run also holds the GPU generator's state; a CPU run ignores it and
    continues exactly as from the CPU checkpoint."""
    args = toy_args(tmp_path / "run")
    torch.manual_seed(0)
    train(ToyRegression(CPU), args, LocalCommunicator(2), CPU)
    path = tmp_path / "run" / "checkpoint.pt"
    state = torch.load(path, weights_only=False)
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)  # what a GPU run adds
    torch.save(state, path)
    flat, optimizer, sorter = run_objects(args, CPU)
    restore(path, dict(vars(args)), flat, optimizer, sorter, CPU)
    torch.testing.assert_close(flat, state["flat"], rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])


def test_rng_states_hold_the_gpu_generator_only_on_cuda(monkeypatch):
    assert "cuda" not in checkpoint_module.rng_states(CPU)
    monkeypatch.setattr(checkpoint_module.torch.cuda, "get_rng_state", lambda device: torch.full((4,), device.index,
                                                                                           dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(checkpoint_module.torch.cuda, "set_rng_state", lambda state, device: restored.append(
        (state, device)))
    states = checkpoint_module.rng_states(GPU(1))
    assert states["cuda"].tolist() == [1, 1, 1, 1]
    checkpoint_module.set_rng_states(states, GPU(1))
    assert len(restored) == 1 and restored[0][1] == GPU(1) and restored[0][0] is states["cuda"]
    checkpoint_module.set_rng_states(states, CPU)  # resuming on the CPU: the GPU state is not used
    assert len(restored) == 1


def test_without_cudnn_restores_the_flag_even_after_an_error():
    from models.lstm import without_cudnn

    before = torch.backends.cudnn.enabled
    with pytest.raises(ValueError):
        with without_cudnn():
            assert torch.backends.cudnn.enabled is False
            raise ValueError
    assert torch.backends.cudnn.enabled == before
