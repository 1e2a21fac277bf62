"""Device choice and the NCCL refusals, on the CPU.

The GPU itself is exercised in tests/test_cuda.py (skipped without CUDA); here torch.cuda and
torch.distributed are replaced by recorders where a rule needs them.
"""
import pytest
import torch

from engine import comm as comm_module
from engine import device as device_module
from engine import train as train_module
from engine.comm import DistributedCommunicator, node_leader_first
from engine.device import choose_device, setup_device
from engine.errors import UserFacingError
from engine.train import Timers
from tests.helpers import error_lines, needs_data, run_script

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


def test_timers_synchronise_the_process_gpu(monkeypatch):
    synchronised = []
    monkeypatch.setattr(train_module.torch.cuda, "synchronize", synchronised.append)
    timers = Timers(GPU(3))
    with timers("compute"):
        pass
    assert synchronised == [GPU(3), GPU(3)]
    with Timers(CPU)("compute"):
        pass
    assert len(synchronised) == 2


def test_leader_first_is_a_plain_block_outside_torchrun():
    ran = []
    with node_leader_first():
        ran.append(1)
    assert ran == [1]


# ---------------------------------------------------------------- refused end to end, one line, exit 2
@needs_data
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
    assert len(lines) == (nproc or 1) and len(set(lines)) == 1, result.stderr  # one line per process
    assert message in lines[0] and "Traceback" not in lines[0]
    assert "NCCL error" not in result.stderr
    assert not (tmp_path / "run").exists()
