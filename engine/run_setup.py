"""What a run is made of, built once from the task and the flags (build_run): the sorter (in a
background thread with --overlap), the reducer and the gradient exchange, the learning-rate schedule,
the optimizer or the local workers, the herding log, and the test hook FaultInjection; and config.json's
description of them (run_config), which must name what build_run chose.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import UserFacingError
from engine import runlog
from engine.comm import GradientExchange
from engine.compiled import compile_step
from engine.device import tf32_settings
from engine.herding_log import HerdingLog
from engine.local_sgd import LocalWorkers, SyncSchedule
from engine.optim import LRSchedule, Optimizer
from engine.overlap import BackgroundSorter
from engine.reducers import make_reducer
from engine.sketching import make_sketch, sketch_config
from sorters import build_sorter
from sorters.balance import sign_loop_for
from sorters.exact import ExactCDGraB, ExactGradients
from sorters.gather import ParameterShare

# --overlap auto: below OVERLAP_MIN_D the thread hand-off costs about what the sorter does; above
# OVERLAP_MAX_BUFFER the second per-unit gradient buffer costs more memory than it saves time (GPT-2:
# 1.75 GB for 8% of a step)
OVERLAP_MIN_D, OVERLAP_MAX_BUFFER = 65_536, 256 * 2**20


@dataclass
class Run:
    """What train() builds once, from the task and the args, and hands to the steps, the checkpoint and
    the progress lines.
    optimizer: what steps and is checkpointed (LocalWorkers with local steps, `local`; else an
    Optimizer and local None)."""
    task: object
    args: object
    comm: object
    device: torch.device
    sorter: object
    reducer: object
    exchange: GradientExchange
    lr_schedule: LRSchedule
    optimizer: object
    local: LocalWorkers | None
    herding_log: HerdingLog | None
    steps_per_epoch: int
    per_worker_grads: bool  # each worker's own gradient: needed by local steps and by error feedback
    fault: "FaultInjection"
    exact: ExactGradients | None = None  # --exact-low-memory on: the model's layer records for ExactCDGraB

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    @property
    def writer(self) -> bool:  # rank 0 writes the run directory
        return self.comm.rank == 0

    def comm_bytes(self) -> int:
        """Bytes sent so far by the gradient exchange, the reducer and the local-SGD averaging."""
        return self.exchange.comm_bytes + self.reducer.comm_bytes + (self.local.comm_bytes if self.local else 0)


def build_run(task, args, comm, device) -> Run:
    """The sorter (with --overlap in a background thread), the reducer and exchange, the learning-rate
    schedule, and the optimizer or LocalWorkers; sizes checked."""
    n, m, k, d = task.n_workers, task.n_units, task.units_per_step, task.model.d
    if m % k:
        raise UserFacingError(f"{task.name}: {m} units per worker is not a multiple of {k} units per step")
    steps_per_epoch = m // k
    task.unit_grad_path = args.unit_grads
    compile_step(task, getattr(args, "compile", "off"))  # --compile: the step's gradient methods, torch.compile'd
    sketch = make_sketch(args, d, task.model)  # --sketch-dim: the sorter balances (n, k, D) sketches (engine/sketching.py)
    sorted_d = sketch.dim if sketch else d
    exact = exact_gradients(task, args)
    if exact is not None:  # the same orders as CD-GraB's, from products of the layer records
        # under torchrun each process takes its own parameters' products (the orders alike, bit for bit)
        share = ParameterShare(exact) if len(comm.local_workers) != n else None
        sorter = ExactCDGraB(n, m, d, seed=args.seed, device=device, sum_all=True, share=share)
    else:
        sorter = build_sorter(args.sorter, n, m, sorted_d, seed=args.seed, device=device, epochs=args.epochs,
                              sign_loop=resolve_sign_loop(args, device, d, sorted_d), batch_size=k)
        if getattr(args, "compile", "off") != "off" and getattr(sorter, "sign_loop", None) == "gram":
            sorter.compile_sign_step(args.compile)  # --compile: CD-GraB's Gram sign step too
    task.per_unit_steps = sorter.uses_grads and not getattr(sorter, "uses_batch_size", False)
    reducer = make_reducer(args.reducer, comm, d, device, args.density)
    exchange = GradientExchange(comm, gather_unit_grads=sorter.uses_grads, reducer=reducer, sketch=sketch)
    if exact is None:  # the records of a step are the sorter's input only while it steps: no background thread
        sorter = with_overlap(sorter, task, args.overlap, len(comm.local_workers), device, sketch)
    lr_schedule = LRSchedule(args.lr, steps_per_epoch, task.lr_decay_every, task.lr_decay_gamma, kind=args.lr_schedule,
                             total_epochs=args.epochs, warmup_epochs=args.warmup_epochs, min_lr=args.min_lr)
    local = build_local_workers(task, args, comm, reducer, lr_schedule, steps_per_epoch)
    optimizer = Optimizer(task.optimizer, task.model.flat, lr_schedule, args.momentum, args.weight_decay) \
        if local is None else local
    herding_log = HerdingLog(n, m, d, comm, task.model, device) if args.log_herding else None
    return Run(task, args, comm, device, sorter, reducer, exchange, lr_schedule, optimizer, local, herding_log,
               steps_per_epoch, per_worker_grads=local is not None or args.reducer != "dense",
               fault=FaultInjection.from_environment(comm.rank), exact=exact)


def exact_gradients(task, args) -> ExactGradients | None:
    """--exact-low-memory on: an ExactGradients of the task's module (its parameters are views of model.flat,
    in the same order, so the sorter's running sum lines up with the flat gradient); None when off."""
    if getattr(args, "exact_low_memory", "off") == "off":
        return None
    if not task.outer_products_apply(task.model.flat):
        raise UserFacingError(f"--exact-low-memory on needs a model made only of Linear, Conv1D, Embedding and "
                              f"LayerNorm layers and per-unit losses in one pass (LR-HMDA, MLP-M4, GPT2-Wiki103); "
                              f"{task.name} is not such a benchmark: drop --exact-low-memory")
    exact = ExactGradients(task.model.module)
    assert exact.d == task.model.d and all(exact.offsets[id(p)] == task.model.offsets[id(p)] for p in exact.params)
    return exact


def resolve_sign_loop(args, device, d: int, sorted_d: int) -> str | None:
    """CD-GraB's sign loop: --sign-loop, or for auto the one sorters.balance.sign_loop_for picks."""
    if args.sorter != "CD-GraB":
        return None
    chosen = getattr(args, "sign_loop", "auto")
    if chosen == "compiled" and torch.device(device).type != "cpu":
        raise UserFacingError(f"--sign-loop compiled runs on the CPU only; on {device} use gram or auto")
    return sign_loop_for(device, d, sorted_d) if chosen == "auto" else chosen


def with_overlap(sorter, task, overlap: str, n_local: int, device, sketch=None):
    """The sorter, run in a background thread when --overlap asks for it (auto: when the sorted vectors
    (d, or the sketch's D) are long enough and the second per-unit gradient buffer small enough); sets how
    many buffers the task rotates."""
    k, d, flat = task.units_per_step, task.model.d, task.model.flat
    sorted_d = sketch.dim if sketch else d
    second_buffer_bytes = n_local * k * d * flat.element_size()
    overlapping = sorter.uses_grads and (overlap == "on" or (overlap == "auto" and sorted_d >= OVERLAP_MIN_D
                                                             and second_buffer_bytes <= OVERLAP_MAX_BUFFER))
    # with k odd a pair's first unit comes a step before its second: rather than copy it, the sorter keeps
    # a reference, and the task rotates one more gradient buffer so that it stays intact
    sorter.grads_stay_valid = sorter.uses_grads and k % 2 == 1
    # sketches are fresh tensors every step: the sorter never holds the task's buffer
    task.grad_buffers = 1 if sketch else 1 + overlapping + sorter.grads_stay_valid
    return BackgroundSorter(sorter, device) if overlapping else sorter  # balances step t during step t + 1


def build_local_workers(task, args, comm, reducer, lr_schedule, steps_per_epoch: int) -> LocalWorkers | None:
    """LocalWorkers for --sync other than every-step (each worker's own parameters and optimizer state,
    averaged every H steps); None for the paper's data-parallel training."""
    if args.sync == "every-step":
        return None
    sync = SyncSchedule(args.sync, H=args.H, h_base=args.H_base, h_init=args.H_init, alpha=args.alpha or 0.0,
                        power=args.power, switch_step=((args.switch_epoch or 1) - 1) * steps_per_epoch,
                        warmup_steps=lr_schedule.warmup_steps, total_steps=args.epochs * steps_per_epoch)
    return LocalWorkers(task.model.flat, comm, task.optimizer, lr_schedule, sync, reducer, args.momentum,
                        args.weight_decay, averaged_state(args))


def averaged_state(args) -> tuple:
    """The optimizer buffers --avg-m / --avg-v ask LocalWorkers to average (AdamW's moments)."""
    return tuple(name for name, on in (("exp_avg", args.avg_m), ("exp_avg_sq", args.avg_v)) if on)


def run_config(run: Run) -> dict:
    """config.json: the benchmark, its args, sizes, data, strategies, device and versions."""
    task, args, comm, sorter = run.task, run.args, run.comm, run.sorter
    return {
        "benchmark": task.name,
        "args": dict(vars(args)),
        "sizes": {"n_workers": task.n_workers, "world_size": comm.world_size,
                  "workers_per_process": len(comm.local_workers), "units_per_worker": task.n_units,
                  "units_per_step": task.units_per_step, "steps_per_epoch": run.steps_per_epoch,
                  "d": task.model.d, "global_batch": task.global_batch},
        "data": task.data_info,
        "sorter": {"name": sorter.name, "uses_grads": sorter.uses_grads,
                   "sign_loop": getattr(sorter, "sign_loop", None), "exact_low_memory": run.exact is not None,
                   "sketch": sketch_config(args, run.exchange.sketch)},
        "optimizer": {"name": task.optimizer, "lr_decay_every": task.lr_decay_every,
                      "lr_decay_gamma": task.lr_decay_gamma, "lr_schedule": args.lr_schedule,
                      "warmup_steps": run.lr_schedule.warmup_steps},
        "communication": {"sync": args.sync, "reducer": args.reducer, "per_worker_grads": run.per_worker_grads,
                          "worker_gradients": ("vmap" if task.vmap_over_workers else "loop")
                          if run.per_worker_grads else None},
        "device": str(run.device),
        "tf32": tf32_settings(),  # what the run computed with (set from --tf32 by run_entry_point)
        "versions": runlog.library_versions(),
        "git_commit": runlog.git_commit(),
    }


class FaultInjection:
    """Test hook. CDGRAB_FAULT=exit:RANK:STEP makes that rank exit abruptly before global step STEP
    (0-based, counted over the whole run); CDGRAB_FAULT=nan:STEP makes every rank see a NaN loss there;
    CDGRAB_FAULT=nan-params:STEP turns the parameters NaN before that step (NaN gradients, as a divergence)."""

    def __init__(self, kind: str | None = None, step: int = -1):
        self.kind, self.step = kind, step

    @classmethod
    def from_environment(cls, rank: int) -> "FaultInjection":
        spec = os.environ.get("CDGRAB_FAULT", "")
        kind, *numbers = spec.split(":") if spec else (None,)
        if kind == "exit" and int(numbers[0]) == rank:
            return cls("exit", int(numbers[1]))
        if kind in ("nan", "nan-params"):
            return cls(kind, int(numbers[0]))
        return cls()

    def before_step(self, global_step: int, flat: torch.Tensor) -> None:
        if self.kind == "exit" and global_step == self.step:
            os._exit(3)
        if self.kind == "nan-params" and global_step == self.step:
            with torch.no_grad():
                flat.fill_(float("nan"))

    def poison(self, local_loss: torch.Tensor, global_step: int) -> torch.Tensor:
        return local_loss + float("nan") if self.kind == "nan" and global_step == self.step else local_loss

