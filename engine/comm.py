"""How the n logical workers exchange tensors, in one process or across torchrun processes.

Every collective takes the tensor of THIS process's local workers, stacked on dim 0
(shape (n_local, ...)), so the training loop reads the same in both modes:

    total = comm.all_reduce_sum(local)    # (...)       sum over all n workers
    every = comm.all_gather(local)        # (n, ...)    worker j's tensor at row j

`GradientExchange.comm_bytes` counts the gradient payload as if each worker were its own process
(all-reduce of a d-vector: n * d floats; all-gather: n * k * d floats), so the number is the same
in both modes and runs can be compared.
"""
import datetime
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from common.errors import UserFacingError
from sorters.gather import all_gather_rows, gather_parts, records_bytes, sketch_rows, sketch_then_gather


class LocalCommunicator:
    """All n workers live in this process; collectives are plain tensor reductions."""

    world_size, rank = 1, 0

    def __init__(self, n_workers: int, device="cpu"):
        self.n_workers, self.device = n_workers, torch.device(device)
        self.local_workers = list(range(n_workers))

    def all_reduce_sum(self, local: torch.Tensor) -> torch.Tensor:
        return local.sum(dim=0)

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def barrier(self):
        pass

    def close(self, finished: bool = False):
        pass


class DistributedCommunicator:
    """torch.distributed (gloo on CPU, NCCL on CUDA); this process hosts n / world_size workers,
    rank r the contiguous block r * n_local ... (r + 1) * n_local - 1."""

    def __init__(self, n_workers: int, device, backend: str, timeout_seconds: float):
        self.device = torch.device(device)  # where collective buffers live (NCCL needs CUDA)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # NCCL is told this process's GPU, so its communicator (and barrier) never guesses GPU 0
        options = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_seconds), **options)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        if n_workers % self.world_size:
            raise UserFacingError(f"--node_cnt {n_workers} is not a multiple of the {self.world_size} "
                                  "torchrun processes; use --nproc_per_node that divides --node_cnt")
        self.n_workers = n_workers
        n_local = n_workers // self.world_size
        self.local_workers = list(range(self.rank * n_local, (self.rank + 1) * n_local))

    def all_reduce_sum(self, local):
        total = local.sum(dim=0)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def all_gather(self, local):
        return all_gather_rows(local)  # (n_local, ...) -> (n_workers, ...), rank r's workers at its block

    def barrier(self):
        dist.barrier()

    def close(self, finished: bool = False):
        """Leave the process group. After a finished run, wait for every rank first: tearing gloo
        down while a peer still works (rank 0 writing the checkpoint) can abort the process."""
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def make_communicator(n_workers: int, device: torch.device, backend: str | None, timeout_seconds: float):
    """LocalCommunicator for a plain `python` start, DistributedCommunicator under torchrun.
    backend: as engine.device.choose_device resolved it (None: NCCL on CUDA, else gloo)."""
    if not launched_by_torchrun():
        return LocalCommunicator(n_workers, device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    return DistributedCommunicator(n_workers, device, backend, timeout_seconds)


@contextmanager
def node_leader_first():
    """Run the body in local rank 0 first, then in the node's other processes, e.g. to build a
    cache once that the others then read. Outside torchrun it just runs the body.

    Every process of the job must enter it (it holds two barriers). If the leader fails inside,
    it leaves with its error and torchrun stops the waiting peers.
    """
    distributed = dist.is_available() and dist.is_initialized()
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if distributed and not leader:
        dist.barrier()  # wait for the leader's body
    yield
    if distributed and leader:
        dist.barrier()  # release the others


class GradientExchange:
    """The one place that decides what workers send each other per step.

    `exchange(local_unit_grads, local_mean_grad, local_worker_grads=None)` returns `(update, all_unit_grads)`:
      local_unit_grads:   (n_local, k, d) per-unit gradients of this process's workers, or None
      local_mean_grad:    (d,) mean gradient over this process's units (used when no unit grads)
      local_worker_grads: (n_local, d) each worker's own mean gradient: given when the reducer
                          sparsifies (error feedback keeps a residual per worker)
      update:             (d,) the global-batch gradient (mean over all workers' units), or with a
                          sparsifying reducer the mean of what the workers sent; may be
                          local_mean_grad itself, so it is valid as long as that is
      all_unit_grads:     (n, k, d) every worker's unit gradients, or None

    Sorters that balance need every worker's unit gradients in every process (CD-GraB runs its
    identical balancing redundantly on each rank, as the original code does), so they all-gather them dense, also when
    a reducer sparsifies the update; without a sparsifying reducer the update is then the mean of the
    gathered tensor. The others all-reduce one d-vector, as D-RR does in the paper, or hand each
    worker's gradient to the reducer (engine/reducers.py). Local SGD (engine/local_sgd.py) uses
    `gather_unit_grads` alone between its averaging steps.

    With a `sketch` (--sketch-dim D: a sorters.GradientSketch, never the identity) each process maps
    its own (n_local, k, d) unit gradients to (n_local, k, D) before they are gathered or deferred
    (the library's sorters.gather, which CDGraBSampler uses too), so the balancing sorters receive
    (n, k, D) sketches: n * k * D floats per step, and the update (no longer the mean of what was
    gathered) is all-reduced or reduced as without a balancing sorter.
    """

    # deferred unit gradients are gathered at the latest when they reach this many bytes per process
    DEFER_LIMIT_BYTES = 64 * 2**20

    def __init__(self, comm, gather_unit_grads: bool, reducer=None, sketch=None):
        self.comm = comm
        self.sorter_needs_unit_grads = gather_unit_grads
        self.reducer = reducer
        self.sketch = sketch  # None: the unit gradients themselves are gathered
        self.comm_bytes = 0  # the unit-gradient gathers and dense all-reduces; the reducer counts its own
        self._deferred = []  # (local unit gradients (n_local, k, d), positions) not gathered yet
        self._deferred_bytes = 0

    def defer_unit_grads(self, local_unit_grads, positions) -> bool:
        """Keep this step's (n_local, k, d) unit gradients to gather later with others in one collective
        (local SGD: once per round). Returns True when the kept ones reach DEFER_LIMIT_BYTES: the caller
        should flush now."""
        if self.sorter_needs_unit_grads:
            local_unit_grads = sketch_rows(local_unit_grads, self.sketch)  # (n_local, k, D)
            self._deferred.append((local_unit_grads, positions))
            self._deferred_bytes += local_unit_grads.numel() * local_unit_grads.element_size()
        return self._deferred_bytes >= self.DEFER_LIMIT_BYTES

    def flush_unit_grads(self) -> list:
        """Gather every deferred step's unit gradients in one all-gather: [(every (n, k, d), positions), ...]
        in the order they were deferred (the same bytes as one gather per step)."""
        if not self._deferred:
            return []
        steps, self._deferred, self._deferred_bytes = self._deferred, [], 0
        every = self.gather_unit_grads(torch.stack([g for g, _ in steps], dim=1))  # (n, steps, k, d)
        return [(every[:, i], positions) for i, (_, positions) in enumerate(steps)]

    def gather_unit_grads(self, local_unit_grads):
        """(n_local, ..., d) -> (n, ..., D) every worker's unit gradients, sketched first with a sketch (ones
        that come sketched, (n_local, ..., D), as deferred ones do, are only gathered); or None when the
        sorter needs none."""
        if not self.sorter_needs_unit_grads:
            return None
        every = sketch_then_gather(local_unit_grads, self.sketch, self.comm.all_gather)
        self.comm_bytes += every.numel() * every.element_size()
        return every

    def exchange(self, local_unit_grads, local_mean_grad, local_worker_grads=None):
        every = self.gather_unit_grads(local_unit_grads)
        # the gathered unit gradients already hold the dense mean: sending the workers' gradients to a
        # dense reducer as well would move the gradient twice (post-local before its switch); gathered
        # sketches do not hold it
        exact = every is not None and self.sketch is None
        if local_worker_grads is not None and (not exact or self.reducer.name != "dense"):
            return self.reducer.reduce(local_worker_grads), every
        if exact:
            return every.mean(dim=(0, 1)), every
        if local_mean_grad is None:  # sketched: the update comes from this process's own unit gradients
            local_mean_grad = local_unit_grads.mean(dim=(0, 1))
        return self.mean_update(local_mean_grad), every

    def exchange_units(self, local_parts, local_mean_grad, share=None):
        """--exact-low-memory: (update (d,), every worker's units) from this process's units (a list of
        sorters.exact.UnitGradients, the parts its n_local * k units were recorded in, worker-major) and its
        mean gradient (d,). Each part's records (per parameter, or its per-unit gradient where that is
        smaller) are all-gathered (sorters.gather.gather_parts), the update all-reduced as D-RR's is.
        comm_bytes counts what the gathers send as if each worker were its own process (n times one
        process's bytes per worker), plus the update's n * d floats. share: the sorter's ParameterShare under
        torchrun (each parameter's records go to its owner only; counted as the all-gather's bytes)."""
        n, n_local = self.comm.n_workers, len(self.comm.local_workers)
        self.comm_bytes += records_bytes(local_parts) * n // n_local
        every = gather_parts(local_parts, distributed=n_local != n, share=share)
        return self.mean_update(local_mean_grad), every

    def mean_update(self, local_mean_grad):
        """The global mean gradient (d,) from this process's mean over its own units (d,): itself in one
        process, else all-reduced (counted as n * d floats)."""
        n = self.comm.n_workers
        self.comm_bytes += n * local_mean_grad.numel() * local_mean_grad.element_size()
        n_local = len(self.comm.local_workers)
        if n_local == n:  # every worker is in this process: the local mean is the global one
            return local_mean_grad
        # weight by n_local so that the sum over processes is n * (global mean)
        total = self.comm.all_reduce_sum((local_mean_grad * n_local).unsqueeze(0))
        return total / n
