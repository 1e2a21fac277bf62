"""Which device each process computes on, and which torch.distributed backend it uses.

`choose_device` is a pure function of the command line and of what the machine shows, so every
rule can be tested without a GPU; `setup_device` reads the environment, applies it and makes the
chosen GPU this process's current device.

    --device cpu, or auto with no visible GPU   -> the CPU (under torchrun: gloo)
    --device cuda, or auto with a visible GPU   -> one GPU per process: local rank r uses cuda:r
                                                   (under torchrun: NCCL unless --backend gloo)

NCCL needs a GPU of its own for every process: with more processes on a node than visible GPUs it
fails deep inside its set-up ("invalid usage"), so that is refused up front, as is NCCL on the CPU.
gloo can share a GPU between processes (local rank r uses cuda:r mod the GPU count).

`set_tf32` applies --tf32: float32 matrix products, convolutions and RNNs run in full float32 on
the GPU unless TensorFloat-32 is asked for.
"""
import os

import torch

from common.errors import UserFacingError
from engine.comm import launched_by_torchrun


def choose_device(choice: str, backend: str | None, local_rank: int, local_processes: int, visible_gpus: int,
                  distributed: bool) -> tuple[torch.device, str | None]:
    """-> (device, backend): the device of the process with `local_rank` among the `local_processes`
    torchrun started on this node, and the process-group backend (None when not `distributed`).

    choice: --device (auto, cpu, cuda); backend: --backend (None, gloo, nccl); visible_gpus: what
    torch.cuda.device_count() says. Raises UserFacingError for a combination that cannot run.
    """
    if choice == "cuda" and visible_gpus == 0:
        raise UserFacingError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    on_gpu = choice == "cuda" or (choice == "auto" and visible_gpus > 0)
    if not on_gpu:
        if backend == "nccl":
            reason = "--device cpu" if choice == "cpu" else "no CUDA device is visible"
            raise UserFacingError(f"--backend nccl needs CUDA GPUs, but this run computes on the CPU ({reason}); "
                                  "use --backend gloo")
        return torch.device("cpu"), ("gloo" if distributed else None)
    if not distributed:
        return torch.device("cuda", 0), None
    backend = backend or "nccl"
    if backend == "nccl" and local_processes > visible_gpus:
        raise UserFacingError(f"--backend nccl needs one GPU per process, but torchrun started {local_processes} "
                              f"processes on this node, which sees {visible_gpus} GPU(s); use --nproc_per_node "
                              f"{visible_gpus} (each process then hosts more of the --node_cnt workers), "
                              "or --backend gloo (processes then share the GPUs)")
    return torch.device("cuda", local_rank % visible_gpus), backend


def set_tf32(allowed: bool) -> dict:
    """Allow TensorFloat-32 in CUDA matrix products (cuBLAS) and in cuDNN convolutions and RNNs, or
    keep them full float32 (PyTorch's own default leaves cuDNN's TF32 on). Process-wide; harmless
    without CUDA. Returns tf32_settings()."""
    # the allow_tf32 flags rather than torch 2.13's fp32_precision properties: once those are set,
    # reading these flags or torch.get_float32_matmul_precision() raises ("mix of the legacy and new
    # APIs"), for any library that does
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed
    return tf32_settings()


def tf32_settings() -> dict:
    """Whether TF32 is allowed now, as config.json records it: {"matmul": bool, "cudnn": bool}."""
    return {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}


def setup_device(choice: str, backend: str | None) -> tuple[torch.device, str | None]:
    """choose_device for this process (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE), then make the GPU
    current, so kernels, NCCL and torch.cuda.synchronize() of this process use its own GPU, not GPU 0."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, backend = choose_device(choice, backend, local_rank, local_processes, visible, launched_by_torchrun())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, backend
