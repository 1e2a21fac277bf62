"""What a benchmark hands the training engine: its units, its loss, its evaluation; and the pieces the
entry scripts share (how many units each worker owns, which evaluation batches a process takes)."""
import math

import torch
from torch.func import vmap
from torch.utils._pytree import tree_map

from common.errors import UserFacingError
from engine import linear_stack
from engine.functional import FlatModel, batch_gradient, unit_gradients


class Task:
    """One benchmark, already split over the n workers.

    Worker j owns `n_units` ordering units (local ids 0..n_units-1); each step it uses
    `units_per_step` of them. Subclasses set the attributes and implement `units`, `loss` and
    `evaluate`; the engine does ordering, gradients, communication, optimizer, logging.
    """

    name = "task"                     # benchmark name, e.g. "LR-HMDA"; also the results sub-folder
    metric_columns: tuple = ()        # benchmark's own metrics.csv columns (after train_loss, test_loss)
    optimizer = "sgd"                 # "sgd" or "adamw"
    lr_decay_every: int | None = None  # epochs between learning-rate decays (None: constant)
    lr_decay_gamma = 1.0
    clip_grad_norm: float | None = None  # clip the global-batch gradient to this L2 norm (None: off)
    unit_grad_path = "auto"           # --unit-grads: "vmap" forces the general path (own unit_grads ignore it)
    per_unit_steps = False            # set by the engine: whether the run's steps form per-unit gradients (the
                                      # sorter's), so that `units` may lay its tensors out for them
    # how many per-unit gradient buffers `_unit_grad_buffer` rotates: the engine raises it when step t's
    # gradients must survive later steps (a sorter running behind the loop, or keeping a reference)
    grad_buffers = 1
    # --sketch-dim with tensor-sketched blocks: sketches straight from the layer records (unit_sketches)
    sketch_records = True
    grad_chunk: int | None = None     # units per records pass in unit_sketches (None: all at once)
    # --compile (engine/compiled.py): the methods making the data-parallel step's gradients that torch.compile
    # may wrap, each a pure tensor function of its arguments and the model's parameters; () = no compiled step
    compiled_methods: tuple = ()
    # worker_gradients: True = one torch.func.vmap over the workers' (parameters, units); False = a loop
    # over the workers, each a batch of one worker (what LSTM and GPT-2 need: see their docstrings)
    vmap_over_workers = False
    # worker_gradients at per-worker (n_local, d) parameters through stacked_gradients, for a model of
    # nn.Linear layers only (LR, MLP) and a task with unit_losses: one batched forward and backward for
    # every worker (engine/linear_stack.py) instead of a vmap or a loop over the workers
    linear_stack = False

    model: FlatModel
    n_workers: int
    n_units: int                      # m, units per worker
    units_per_step: int               # k
    global_batch: int                 # what B means for this benchmark (examples, columns, windows)
    data_info: dict                   # recorded in config.json: data source, files, sizes
    unit_tables: tuple = ()           # (n, m, ...) tensors of every worker's units, for the default `units`

    def units(self, workers: list[int], unit_ids: torch.Tensor):
        """unit_ids: (n_local, k) local ids of the units that `workers` use this step.
        Returns a pytree of tensors whose dim 0 runs over the n_local * k units, worker-major.
        Default: the tuple of those rows of each of `unit_tables` (e.g. the inputs and the targets)."""
        if not self.unit_tables:
            raise NotImplementedError
        return tuple(self.pick_units(table, workers, unit_ids) for table in self.unit_tables)

    def worker_rows(self, workers: list[int], device) -> torch.Tensor:
        """(len(workers), 1) LongTensor of the worker ids on `device`, made on the device and once per
        list of workers: an index built from a Python list would be a copy to the GPU that waits for it."""
        cache = self.__dict__.setdefault("_worker_rows", {})
        key = (tuple(workers), str(device))
        if key not in cache:
            first = workers[0]
            if list(workers) == list(range(first, first + len(workers))):  # a process's workers: always
                cache[key] = torch.arange(first, first + len(workers), device=device)[:, None]
            else:
                cache[key] = torch.tensor(workers, device=device)[:, None]
        return cache[key]

    def pick_units(self, table: torch.Tensor, workers: list[int], unit_ids: torch.Tensor) -> torch.Tensor:
        """table (n, m, ...): every worker's units. Returns (len(workers) * k, ...), row i * k + t
        table[workers[i], unit_ids[i, t]] (worker-major); unit_ids (len(workers), k) on any device."""
        rows = self.worker_rows(workers, table.device)
        return table[rows, unit_ids.to(table.device)].flatten(0, 1)

    def loss(self, flat: torch.Tensor, batch):
        """Mean loss over a batch of units (dim 0) at parameters flat (d,). Returns (loss, aux)."""
        raise NotImplementedError

    def unit_losses(self, flat: torch.Tensor, batch) -> torch.Tensor:
        """Optional: (U,) loss of each unit of the batch, each exactly its loss as a batch of one, in ONE
        forward pass. Tasks that define it (and whose model has only Linear/Conv1D/Embedding/LayerNorm
        parameters) get per-unit gradients from one backward plus outer products instead of vmap."""
        raise NotImplementedError

    def unit_grads(self, flat: torch.Tensor, batch, n_local: int, k: int):
        """Per-unit gradients (n_local, k, d) and losses (n_local, k): outer products where the task and
        model allow it (see unit_losses), else vmap over units. The returned gradients may live in a
        buffer that the next call overwrites (the engine and the sorters copy what they keep)."""
        if self.outer_products_apply(flat):
            grads, losses = self.model.outer_unit_gradients(self.unit_losses, batch, out=self._unit_grad_buffer(
                n_local * k))
        else:
            grads, losses = unit_gradients(self.loss, flat, batch)
        return grads.view(n_local, k, -1), losses.view(n_local, k)

    def sketches_from_records(self, flat: torch.Tensor, sketch) -> bool:
        """True when `unit_sketches` may form the per-unit sketches straight from the layer records: a
        sketch with tensor-sketched blocks (engine/sketching.py), outer products applying at `flat`,
        and `sketch_records` on (the benchmarks of the materialise-then-sketch path turn it off)."""
        return (sketch is not None and bool(sketch.blocks) and self.sketch_records
                and self.outer_products_apply(flat))

    def unit_sketches(self, flat: torch.Tensor, batch, n_local: int, k: int, sketch):
        """Per-unit sketches without the (units, d) per-unit gradients (FlatModel.outer_unit_sketches),
        `grad_chunk` units per pass. Returns (sketches (n_local, k, D), mean gradient (d,) over the
        local units, losses (n_local, k)); the mean gradient is the model's buffer, as batch_grad's:
        valid until the next gradient call."""
        units = n_local * k
        sketches = torch.empty(units, sketch.dim, dtype=flat.dtype, device=flat.device)
        losses = torch.empty(units, dtype=flat.dtype, device=flat.device)
        self.model.grad.zero_()  # each pass's backward adds its units' summed gradient
        for rows, part in self.grad_passes(batch, units):
            sketches[rows], losses[rows] = self.model.outer_unit_sketches(self.unit_losses, part, sketch)
        return sketches.view(n_local, k, -1), self.model.grad.div_(units), losses.view(n_local, k)

    def unit_records(self, exact, batch, n_local: int, k: int):
        """--exact-low-memory: this step's units as layer records, for sorters.ExactCDGraB, from the ordinary
        backward that also gives the update, `grad_chunk` units per pass (sorters/exact.py: ExactGradients'
        recording of `self.model.module`, whose parameters are views of `model.flat`). Returns (parts: the
        UnitGradients of each pass, the n_local * k units worker-major part after part; the mean gradient (d,)
        over them, the model's buffer as batch_grad's; losses (n_local, k))."""
        units = n_local * k
        losses = torch.empty(units, dtype=self.model.flat.dtype, device=self.model.flat.device)
        self.model.grad.zero_()  # each pass's backward adds its units' share of the mean
        parts = []
        for rows, part in self.grad_passes(batch, units):
            with exact.recording() as recording:
                part_losses = self.unit_losses(self.model.flat, part)
                recording.watch(part_losses)
            (part_losses.sum() / units).backward()
            losses[rows] = part_losses.detach()
            parts.append(recording.units())
        return parts, self.model.grad, losses.view(n_local, k)

    def grad_passes(self, batch, units: int):
        """(rows, part) for each gradient pass over the step's `units` units: `grad_chunk` at a time (all at
        once when None), rows a slice of them and part the batch's pytree of those rows."""
        chunk = self.grad_chunk or units
        for start in range(0, units, chunk):
            rows = slice(start, min(start + chunk, units))
            yield rows, tree_map(lambda t: t[rows], batch)

    def outer_products_apply(self, flat: torch.Tensor) -> bool:
        """True when per-unit gradients at `flat` may come from outer products: the model's own
        parameters (not e.g. a vmap tracer), a model made of supported layers, a task with
        unit_losses, and not --unit-grads vmap."""
        return (flat is self.model.flat and self.unit_grad_path != "vmap" and self.model.supports_outer
                and type(self).unit_losses is not Task.unit_losses)

    def _unit_grad_buffer(self, units: int) -> torch.Tensor:
        """A (units, d) buffer reused from step to step, so per-unit gradients are not reallocated;
        `grad_buffers` of them used in turn (the one handed out is the least recently used)."""
        flat = self.model.flat
        buffers = self.__dict__.setdefault("_grad_buffers", [])
        if buffers and (buffers[0].shape != (units, flat.numel()) or buffers[0].device != flat.device):
            buffers.clear()  # free the old ones first
        if len(buffers) < self.grad_buffers:  # a new buffer is the least recently used one
            buffers.append(torch.empty(units, flat.numel(), dtype=flat.dtype, device=flat.device))
        else:
            buffers.append(buffers.pop(0))  # rotate: the one returned now is the least recently used
        return buffers[-1]

    def batch_grad(self, flat: torch.Tensor, batch):
        """Gradient (d,) of the mean loss over all local units, the loss, and the loss's aux output
        (used when the sorter needs no per-unit gradients). One plain backward; the gradient is the
        model's buffer, valid until the next gradient call."""
        if flat is self.model.flat:
            return self.model.batch_gradient(self.loss, batch)
        return batch_gradient(self.loss, flat, batch)  # other parameters: torch.func

    def worker_gradients(self, params: torch.Tensor, workers: list[int], unit_ids: torch.Tensor, per_unit: bool):
        """Each local worker's gradient at its own parameters, for local SGD and sparsified reduction.

        params: (d,) shared by all workers, or (n_local, d) row j worker j's; unit_ids: (n_local, k).
        Returns (grads (n_local, d) each worker's mean gradient over its k units, unit_grads
        (n_local, k, d) or None unless per_unit, losses (n_local,)). Calls end_step itself.
        Shared parameters where outer products apply: one backward plus per-unit outer products (the
        returned unit gradients may then live in the reused buffer of unit_grads). Per-worker
        parameters with linear_stack: one batched pass (engine/linear_stack.py). Else with
        vmap_over_workers one vmapped pass; otherwise one call per worker with `model.flat` holding
        that worker's parameters (so `model.flat` is scratch when params is 2-D).
        """
        n_local, k = unit_ids.shape
        flat = self.model.flat
        if params is flat and self.outer_products_apply(flat):  # shared parameters: the per-unit fast path
            unit_grads, unit_losses = self.unit_grads(flat, self.units(workers, unit_ids), n_local, k)
            self.end_step(None)
            return unit_grads.mean(1), unit_grads if per_unit else None, unit_losses.mean(1)
        if params.dim() == 2 and self.linear_stack and self.unit_grad_path != "vmap":
            result = self.stacked_gradients(params, self.units(workers, unit_ids), k, per_unit)
            self.end_step(None)
            return result
        if self.vmap_over_workers:
            batch = tree_map(lambda t: t.reshape(n_local, k, *t.shape[1:]), self.units(workers, unit_ids))
            in_dims = (0 if params.dim() == 2 else None, 0)
            if per_unit:
                unit_grads, unit_losses = vmap(lambda p, b: unit_gradients(self.loss, p, b), in_dims=in_dims)(
                    params, batch)
                grads, losses = unit_grads.mean(1), unit_losses.mean(1)
            else:
                unit_grads = None
                grads, losses = vmap(lambda p, b: batch_gradient(self.loss, p, b)[:2], in_dims=in_dims)(params, batch)
            self.end_step(None)
            return grads, unit_grads, losses
        grads = torch.empty(n_local, flat.numel(), dtype=flat.dtype, device=flat.device)
        unit_grads = torch.empty(n_local, k, flat.numel(), dtype=flat.dtype, device=flat.device) if per_unit else None
        losses = torch.empty(n_local, dtype=flat.dtype, device=flat.device)
        for j, worker in enumerate(workers):
            batch = self.units([worker], unit_ids[j:j + 1])
            if params.dim() == 2:
                with torch.no_grad():
                    flat.copy_(params[j])
            if per_unit:
                worker_units, worker_losses = self.unit_grads(flat, batch, 1, k)
                unit_grads[j] = worker_units[0]
                torch.mean(worker_units[0], dim=0, out=grads[j])
                losses[j], aux = worker_losses.mean(), None
            else:
                grad, losses[j], aux = self.batch_grad(flat, batch)
                grads[j] = grad
            self.end_step(aux)
        return grads, unit_grads, losses

    def stacked_gradients(self, params: torch.Tensor, batch, k: int, per_unit: bool):
        """worker_gradients' result (grads (n_local, d), unit_grads (n_local, k, d) or None, losses
        (n_local,)) at params (n_local, d) for the worker-major batch of n_local * k units, with
        linear_stack. The batched pass of engine/linear_stack.py; a task with closed-form gradients may
        override it. Unit gradients must be freshly allocated (local steps keep them for a round)."""
        return linear_stack.worker_gradients(self.model, self.unit_losses, params, batch, k, per_unit)

    def evaluate(self, flat: torch.Tensor, comm) -> dict:
        """Metrics after an epoch: train_loss, test_loss and every name in metric_columns.
        Each process may evaluate a shard (see `shard`) and sum with comm.all_reduce_sum."""
        raise NotImplementedError

    def start_epoch(self, epoch: int) -> None:
        """Hook for per-epoch state (e.g. an LSTM hidden state reset)."""

    def end_step(self, aux) -> None:
        """Hook receiving the aux output of the loss after each step (e.g. a carried hidden state)."""


def unit_multiple(k: int, even_steps: bool = True) -> int:
    """What the units per worker m must be a multiple of, with k units per step: k (whole steps) and 2
    (the pair sorters pair a worker's units); with even_steps 2k (an even number of steps: the original
    LR and GPT-2 code's rounding)."""
    return 2 * k if even_steps else math.lcm(k, 2)


def units_per_worker(available: int, n: int, k: int, what: str, even_steps: bool = True) -> int:
    """m, the most units each of n workers can own out of `available`: a multiple of
    unit_multiple(k, even_steps). what: the units in words, for the error when there are too few
    (e.g. "training examples")."""
    multiple = unit_multiple(k, even_steps)
    m = available // n // multiple * multiple
    if m == 0:
        raise UserFacingError(f"{available} {what} are too few for --node_cnt {n} and --B {n * k}: "
                              f"need at least {n * multiple}")
    return m


def shard(n_items: int, comm) -> range:
    """The contiguous share of range(n_items) that this process evaluates."""
    per = -(-n_items // comm.world_size)
    return range(min(comm.rank * per, n_items), min((comm.rank + 1) * per, n_items))


def eval_batches(n_items: int, batch: int, comm) -> list[slice]:
    """This process's evaluation batches of range(n_items): a fixed grid of `batch` items each (the last
    shorter), the batches split over the processes, so every batch, and with it the rounding of its
    sums, is the same whatever the number of processes."""
    return [slice(i * batch, min((i + 1) * batch, n_items)) for i in shard(-(-n_items // batch), comm)]


def sum_over_processes(values: list[float] | torch.Tensor, comm) -> list[float]:
    """Element-wise sum of per-process float64 sums (evaluation metrics): a list of floats, or a (k,)
    tensor on the device, which is read on the host once, after the reduction."""
    if isinstance(values, torch.Tensor):
        local = values.to(device=comm.device, dtype=torch.float64)
    else:
        local = torch.tensor(values, dtype=torch.float64, device=comm.device)
    return comm.all_reduce_sum(local[None]).cpu().tolist()
