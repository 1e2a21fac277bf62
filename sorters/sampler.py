"""CDGraBSampler: any of our sorters as a torch.utils.data.Sampler for ordinary (DDP) training loops.

    grads_of = PerExampleGrads(model, loss_fn)                       # sorters/per_example.py
    sampler = CDGraBSampler(train_set, batch_size=16, d=grads_of.d)  # num_replicas, rank from torch.distributed
    loader = DataLoader(train_set, batch_size=sampler.loader_batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                                     # optional; checks the count
        for x, y in loader:
            loss = loss_fn(ddp_model(x), y); optimizer.zero_grad(); loss.backward()
            sampler.step(grads_of(x, y))                             # (batch_size, d): this batch's examples
            optimizer.step()

Data split (as the engine's LR-HMDA): replica r owns the contiguous block of m dataset indices
r*m .. (r+1)*m - 1, and each epoch yields them in the order its sorter chose. Every process runs the
same seeded sorter on the same (all-gathered) gradients, so every process holds all replicas' orders.

Where the replicas live:
- torch.distributed initialised (e.g. torchrun): one replica per process, num_replicas = world size,
  rank = this process's rank. Balancing sorters (CD-GraB, KH-SGD, SBW, I-B, I-PB, Greedy, RPB) all-gather the
  per-example gradients inside step(): (world size * batch_size * d) floats per step; MB-GraB, whose unit is
  the replica's whole batch (a fixed micro-batch), takes each replica's batch gradient: world size * d floats.
  D-RR, D-SO, Fold, FlipFlop and SWR ignore gradients and communicate nothing: step(None) just counts the batch.
- no process group (a plain `python` start): this process hosts ALL num_replicas replicas, like the
  engine's one-process mode. Each step's batch is every replica's batch_size examples, replica 0's
  first: a DataLoader with batch_size=loader_batch_size (num_replicas * batch_size) yields exactly
  one step, and step() takes the gradients of that whole batch.

Sketched balancing (sketch_dim=D > 0, balancing sorters only): step() maps each example's gradient to
D numbers with `GradientSketch(d, D, seed)` (sorters/sketch.py) BEFORE the all-gather (sorters/gather.py,
which the engine's exchange uses too), so each step gathers world size * batch_size * D floats and the
sorter balances the sketches (docs/sketching.md).
step() also takes gradients already sketched by `PerExampleGrads(..., sketch_dim=D, sketch_seed=seed)`.

Exact CD-GraB from layer records (exact=True, docs/sampler.md): the sorter is an ExactCDGraB and each batch
goes to step_units(units), the UnitGradients of sorters.exact.ExactGradients (its call, or the recording of
the loop's own forward and backward), never the (B, d) gradients. Under torch.distributed step_units
all-gathers the units (`all_gather_units`: per parameter its layer records or its per-unit gradient,
whichever is smaller), so N processes balance as one process hosting the N replicas. On a model sharded with
FSDP2 (fully_shard; ExactGradients built after it) the first step_units installs sorters.fsdp.ShardedRows: each
process keeps the running sum of its own rows of every parameter and takes the products over them (docs/fsdp.md).

view="global" (for Accelerate's `prepare` and the HF Trainer, which shard a sampler's batches over the
processes themselves): every process yields ALL replicas' indices, each step replica 0's batch_size
examples, then replica 1's, ..., so that batching by batch_size and dealing batch i to process
i % world size (accelerate's BatchSamplerShard, split_batches=False) hands each process its own replica's
batch. step() still takes this process's (batch_size, d) gradients and all-gathers them, so every
process keeps the same state. view="rank" (the default) yields this process's replica only, for a
DataLoader that is not re-sharded (a plain DDP loop).

Frameworks: set_epoch tolerates what they do (the same epoch twice; the previous epoch again before
any step() of the new one); a sorter that ignores gradients (D-RR, D-SO, Fold) may skip step() when
set_epoch is called every epoch. A state_dict saved mid-epoch resumes mid-epoch: the next iteration
yields the rest of the epoch, or, with load_state_dict(state, replay_from_epoch_start=True), the whole
epoch for a loader that skips the batches already used itself (accelerate's skip_first_batches).
"""
import math
import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

if dist.is_available():
    # Imported here, before any training loop initialises a process group. The functions of
    # torch.distributed.nn.functional take `group=group.WORLD` as a default argument, evaluated at import,
    # and DistributedDataParallel's constructor imports that module; imported after init_process_group,
    # the defaults keep the default group alive for good, so destroy_process_group() cannot free it and
    # gloo's worker threads run on into interpreter exit. A worker that frees a finished collective's
    # tensors there needs the GIL, Python ends the thread instead, and the process aborts ("terminate
    # called without an active exception", SIGABRT) after a run that succeeded.
    import torch.distributed.nn  # noqa: F401

from sorters._state_format import FORMAT_KEY, SAMPLER_STATE_FORMAT, saved_format
from sorters.balance import sign_loop_for
from sorters.base import Sorter
from sorters.checks import (
    NONFINITE_MODES,
    NonFiniteGradientError,
    check_choice,
    check_device,
    check_int,
    check_seed,
    check_state_keys,
    plural,
)
from sorters.exact import ExactCDGraB, UnitGradients
from sorters.fsdp import ShardedRows, is_sharded
from sorters.gather import OverlappedExchange, ParameterShare, all_gather_rows, all_gather_units, sketch_then_gather
from sorters.registry import SORTER_NAMES, SORTERS, build_sorter
from sorters.sketch import GradientSketch

_VIEWS = ("rank", "global")


_OWNER = "CDGraBSampler"


def _check_arguments(dataset: object, batch_size: object, d: object, sorter: object, num_replicas: object,
                     rank: object, seed: object, drop_last: object, device: object, epochs: object,
                     sketch_dim: object, view: object, nonfinite: object, exact: object
                     ) -> tuple[int, int | None, int | None, int | None, int, int]:
    """CDGraBSampler's arguments one by one: types, choices and the combinations exact=True allows
    (TypeError / ValueError, one line each). Returns (batch_size, d, num_replicas, rank, seed, sketch_dim) as
    Python ints (NumPy integers and 0-dim integer tensors are accepted)."""
    checked_batch_size = check_int(_OWNER, "batch_size", batch_size)
    checked_sketch_dim = check_int(_OWNER, "sketch_dim", sketch_dim)
    checked_d, checked_num_replicas, checked_rank = (check_int(_OWNER, name, value, none_ok=True) for name, value in
                                                     (("d", d), ("num_replicas", num_replicas), ("rank", rank)))
    checked_seed = check_seed(_OWNER, seed)
    if not (epochs is None or isinstance(epochs, int)):
        raise TypeError(f"{_OWNER}: epochs must be an integer or None, got {epochs!r}")
    check_device(_OWNER, device)
    check_choice(_OWNER, "nonfinite", nonfinite, NONFINITE_MODES)
    for name, flag in (("drop_last", drop_last), ("exact", exact)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_OWNER}: {name} must be True or False, got {flag!r}")
    if exact and (sorter != "CD-GraB" or checked_sketch_dim or nonfinite != "raise"):
        raise ValueError(f"{_OWNER}: exact=True balances CD-GraB's exact gradients from layer records: it needs "
                         f"sorter='CD-GraB', sketch_dim=0 and nonfinite='raise', got sorter={sorter!r}, "
                         f"sketch_dim={checked_sketch_dim}, nonfinite={nonfinite!r}")
    if isinstance(dataset, bool) or not (isinstance(dataset, int) or hasattr(dataset, "__len__")):
        raise TypeError(f"{_OWNER}: dataset must be a sized dataset or its length (an int), got "
                        f"{type(dataset).__name__}")
    if view not in _VIEWS:
        raise ValueError(f"view must be 'rank' (this process's replica; plain DDP loops) or 'global' (every "
                         f"replica's batches, for Accelerate's prepare / the HF Trainer), got {view!r}")
    if not isinstance(sorter, str) or sorter not in SORTER_NAMES:
        raise ValueError(f"unknown sorter {sorter!r}; choose one of {', '.join(SORTER_NAMES)}")
    if checked_sketch_dim < 0 or (checked_sketch_dim and not SORTERS[sorter].uses_grads):
        balancing = ", ".join(name for name, cls in SORTERS.items() if cls.uses_grads)
        raise ValueError(f"sketch_dim must be 0, or > 0 with a sorter that balances gradients "
                         f"({balancing}); got {checked_sketch_dim} with {sorter}")
    return checked_batch_size, checked_d, checked_num_replicas, checked_rank, checked_seed, checked_sketch_dim


def _replicas_of(num_replicas: int | None, rank: int | None, batch_size: int,
                 distributed: bool) -> tuple[int, int | None]:
    """(num_replicas, rank): the process group's where not given (rank None: every replica hosted here)."""
    if num_replicas is None:
        num_replicas = dist.get_world_size() if distributed else 1
    if rank is None and distributed:
        rank = dist.get_rank()
    if num_replicas < 1 or batch_size < 1:
        raise ValueError(f"need num_replicas >= 1 and batch_size >= 1, got {num_replicas} and {batch_size}")
    if rank is not None and not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in 0..{num_replicas - 1}")
    return num_replicas, rank


def _examples_per_replica(n_examples: int, num_replicas: int, batch_size: int, drop_last: bool,
                          view: str) -> int:
    """m, the examples each replica trains on per epoch (drop_last: whole batches only)."""
    if drop_last:
        m = n_examples // (num_replicas * batch_size) * batch_size
    else:
        m = n_examples // num_replicas
        if num_replicas * m != n_examples:
            raise ValueError(f"a dataset of {n_examples} examples does not split over {num_replicas} replicas "
                             f"({n_examples % num_replicas} left over); pass drop_last=True or trim the dataset")
    if m == 0:
        raise ValueError(f"{plural(n_examples, 'example')} {'is' if n_examples == 1 else 'are'} too few for "
                         f"{plural(num_replicas, 'replica')} x batch_size {batch_size}")
    if view == "global" and m % batch_size:
        # a short last step would shift the loader's batch_size chunks off the replica boundaries
        raise ValueError(f"view='global' needs every batch full, but {m} examples per replica leave a last batch "
                         f"of {m % batch_size}: pass drop_last=True (or a batch_size that divides {m})")
    return m


def _check_sorter_needs(sorter: str, d: int | None, num_replicas: int, rank: int | None, distributed: bool,
                        epochs: int | None) -> None:
    """What the sorter needs: gradients' d and every replica's gradients (balancing), the run's length."""
    if SORTERS[sorter].uses_grads:
        if d is None or d < 1:
            raise ValueError(f"{sorter} balances gradients: pass d, the length of one example's gradient "
                             "(e.g. PerExampleGrads(model, loss_fn).d)")
        if rank is not None and not distributed:
            raise ValueError(f"{sorter} needs every replica's gradients: initialise torch.distributed (the "
                             "sampler all-gathers them), or leave rank=None to host all replicas here")
        if distributed and (num_replicas, rank) != (dist.get_world_size(), dist.get_rank()):
            raise ValueError(f"{sorter} all-gathers gradients over the process group, so num_replicas and rank "
                             f"must be its world size {dist.get_world_size()} and rank {dist.get_rank()}, "
                             f"got {num_replicas} and {rank}")
    if SORTERS[sorter].uses_total_epochs and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                              or epochs < 1):
        raise ValueError(f"{sorter}'s threshold depends on the run's length: pass epochs, the total number of "
                         f"epochs (an integer >= 1), got {epochs!r}")


class CDGraBSampler(Sampler[int]):
    """Yields this process's example indices in the order chosen by `sorter` (default CD-GraB).

    Args:
        dataset: a sized dataset (only its length is used) or the length itself, N.
        batch_size: examples per replica per optimizer step (k). step() positions advance by it.
        d: length of one example's gradient as given to step() (PerExampleGrads(...).d); needed by
            the balancing sorters, ignored by the others.
        sorter: one of SORTER_NAMES.
        num_replicas: as DistributedSampler; default from torch.distributed. Without a process group,
            rank=None (the default) hosts all num_replicas replicas in this process; an explicit
            rank yields that replica only and is allowed only for sorters that ignore gradients.
        rank: as num_replicas.
        seed: seeds the sorter; must be the same in every process.
        drop_last: False: N must split evenly, m = N / num_replicas (else a ValueError); the last batch of
            an epoch holds m % batch_size examples when that is not 0. True: m = the largest
            multiple of batch_size with num_replicas * m <= N; the last N - num_replicas * m
            examples are never used, and every batch is full. (DistributedSampler instead pads or
            drops only to a multiple of num_replicas.) Any m works for every sorter: with m odd
            the pair sorters' unpaired last example takes the middle slot of the next order.
        device: where the sorter keeps its state and balances ("cpu": compiled loop, fastest at small d).
        epochs: the run's total number of epochs; required by KH-SGD and SBW, whose thresholds depend on
            it (sorters/randomized.py), ignored by the others.
        sketch_dim: 0 (the default): balance the gradients themselves. D > 0 (balancing sorters only):
            balance their D-dimensional sketches (see above); D >= d is the identity (exact).
        view: "rank" (the default): yield the replicas whose gradients step() takes. "global": yield
            every replica's examples, step by step in replica order, for loaders that Accelerate
            re-shards (see above); every batch must be full (m a multiple of batch_size).
        nonfinite: what step() does with per-example gradients holding NaN or inf: "raise" (the default; a
            NonFiniteGradientError, a ValueError naming the step) or "skip" (the sorter balances the
            step's examples as zero vectors; `skipped_steps` counts them, kept in state_dict). On the
            CPU the check is at each step; on a GPU it adds no host synchronisation, so "raise" raises
            at the next epoch's start (docs/sampler.md).
        exact: True: exact CD-GraB from layer records (sorters/exact.py, docs/exact-cdgrab.md): the sorter is an
            ExactCDGraB (the orders of CD-GraB, a float32 running sum), d = ExactGradients(model).d, and each
            batch is handed over with step_units(units) instead of step(grads). Needs sorter="CD-GraB".
        divide_products: with exact=True under torch.distributed: each process takes the products and the running
            sum's update of its share of the parameters only (sorters.gather.ParameterShare; the same
            orders, bit for bit), about 1 / world size of that work. Then EVERY process must call
            state_dict() together (it sums the running sum's shares), not rank 0 alone.

    Epochs: call step() once for every batch (the sampler counts positions with it); sorters that ignore
    gradients may instead have no step() at all in an epoch, if set_epoch(next epoch) is called before
    the next one (as Accelerate, the HF Trainer and Lightning do). An iteration over the sampler (a
    DataLoader epoch) after a complete epoch starts the next epoch, whose order depends on every earlier
    epoch's gradients, so epochs are never skipped or replayed. An iteration in which step() was never
    called does not count: the next one yields the same epoch again (peeking at a batch with
    next(iter(loader)) changes nothing); for a sorter that balances gradients, an iteration after two that
    went through the same epoch without any step() warns (UserWarning): a loop that forgets step() would
    otherwise train on one fixed order. Ending an epoch part-way is an error, except right after
    load_state_dict of a state saved part-way (the resume, see load_state_dict).
    """

    def __init__(self, dataset: Sized | int, batch_size: int, d: int | None = None, sorter: str = "CD-GraB",
                 num_replicas: int | None = None, rank: int | None = None, seed: int = 0,
                 drop_last: bool = False, device: str | torch.device = "cpu", epochs: int | None = None,
                 sketch_dim: int = 0, view: str = "rank", nonfinite: str = "raise", exact: bool = False,
                 divide_products: bool = False) -> None:
        batch_size, d, num_replicas, rank, seed, sketch_dim = _check_arguments(
            dataset, batch_size, d, sorter, num_replicas, rank, seed, drop_last, device, epochs, sketch_dim, view,
            nonfinite, exact)
        if not isinstance(divide_products, bool) or (divide_products and not exact):
            raise ValueError(f"{_OWNER}: divide_products must be True (with exact=True) or False, "
                             f"got {divide_products!r}")
        distributed = dist.is_available() and dist.is_initialized()
        num_replicas, rank = _replicas_of(num_replicas, rank, batch_size, distributed)
        n_examples = check_int(_OWNER, "the dataset's length", dataset if isinstance(dataset, int) else len(dataset),
                               1)
        m = _examples_per_replica(n_examples, num_replicas, batch_size, drop_last, view)
        _check_sorter_needs(sorter, d, num_replicas, rank, distributed, epochs)
        # one map for every process: it depends on (d, sketch_dim, seed) only; built at its first use (the
        # `sketch` property), since a caller that hands step() sketches already never needs it
        if sketch_dim and not (isinstance(d, int) and d >= 1):
            raise ValueError(f"sketch_dim={sketch_dim} needs the gradients' dimension d (an integer >= 1), "
                             f"got {d!r}")
        self._sketch: GradientSketch | None = None
        self.sketch_dim = sketch_dim
        # D, or d where D >= d (the identity); d is an int >= 1 wherever sketch_dim > 0 (checked above)
        self._sketched_width = min(sketch_dim, d) if sketch_dim and d is not None else None
        sorted_d = self._sketched_width or (d or 1)
        # CD-GraB's sign loop: sketches of a large model skip numba (sorters.balance.sign_loop_for)
        self.sorter: Sorter
        if exact:  # products of layer records (step_units); a float32 running sum, no (d,) float64 one
            assert d is not None  # exact is CD-GraB's, which balances gradients: _check_sorter_needs refused None
            self.sorter = ExactCDGraB(num_replicas, m, d, seed=seed, device=device)
        else:
            self.sorter = build_sorter(sorter, num_replicas, m, sorted_d, seed=seed, device=device, epochs=epochs,
                                       sign_loop=sign_loop_for(device, d or 1, sorted_d), nonfinite=nonfinite,
                                       batch_size=batch_size)
        self.num_replicas, self.rank, self.seed, self.drop_last = num_replicas, rank, seed, drop_last
        self.epochs = epochs if self.sorter.uses_total_epochs else None
        self.batch_size, self.m, self.d = batch_size, m, d
        self.gathers = self.sorter.uses_grads and distributed  # step() all-gathers over the process group
        self.divide_products = divide_products
        self.view = view
        # the replicas whose gradients step() receives (all of them when no process group spreads them)
        self.replicas_here = list(range(num_replicas)) if rank is None else [rank]
        # the replicas whose examples this process yields: global view, all (the loader deals them out)
        self.replicas_yielded = list(range(num_replicas)) if view == "global" else self.replicas_here
        self.position = 0          # examples per replica passed to step() in the current epoch
        self.started = False       # whether the current epoch's orders were drawn (by __iter__)
        self.resume: str | None = None  # after a mid-epoch load_state_dict, until the next step(): "rest" / "replay"
        self._iterated_through = False  # the last iteration yielded every index it had (_yield_all)
        self._unstepped_passes = 0      # whole iterations through the current epoch before its first step()

    # ------------------------------------------------------------------ what a DataLoader sees

    @property
    def uses_grads(self) -> bool:
        """Whether step() needs gradients (CD-GraB, KH-SGD, SBW, I-B, I-PB); the others take step(None)."""
        return self.sorter.uses_grads

    @property
    def loader_batch_size(self) -> int:
        """The DataLoader batch size that makes one batch one replica-step (batch_size per replica hosted
        here with view="rank"; batch_size with view="global", where the loader is dealt out batch by batch)."""
        return self.batch_size if self.view == "global" else len(self.replicas_here) * self.batch_size

    def __len__(self) -> int:
        """Indices the next iteration yields: the whole epoch, or its rest after a mid-epoch resume."""
        first = self.position if self.resume == "rest" else 0
        return len(self.replicas_yielded) * (self.m - first)

    def set_epoch(self, epoch: int) -> None:
        """Checks the epoch a loop is about to run; optional, for DistributedSampler loops.

        The sampler's orders do not depend on it, but it checks `epoch` against the epoch the next iteration
        yields, e, which catches a resume without load_state_dict and an epoch without step() calls.
        Accepted: e (again and again); e - 1 before any step() of epoch e (frameworks that call set_epoch from
        two places, one lagging); e + 1 after an epoch without any step() for sorters that ignore gradients
        (it completes epoch e).

        Args:
            epoch: the epoch, counting from 0 (a Python, NumPy or torch integer).

        Raises:
            TypeError: `epoch` is not an integer (one line).
            ValueError: `epoch` is none of those accepted (one line that says why).
        """
        if isinstance(epoch, bool) or not hasattr(epoch, "__index__"):  # numpy and torch integers are fine
            raise TypeError(f"set_epoch takes the epoch as an int (counting from 0), got {epoch!r}")
        epoch = epoch.__index__()
        if epoch < 0:
            raise ValueError(f"set_epoch({epoch}): epochs count from 0")
        current = self.epoch
        drawn = 0 < self.position < self.m  # step() has seen part of the current epoch
        if epoch == current or (epoch == current - 1 and not drawn):
            return
        if epoch == current + 1 and self.started and self.position == 0 and not self.uses_grads:
            self._complete_epoch_without_steps()
            return
        if epoch == current + 1 and self.started and self.position == 0:
            raise ValueError(f"set_epoch({epoch}): epoch {current} ended without step() calls, but "
                             f"{self.sorter.name} orders by gradients: call sampler.step(per-example grads) after "
                             "every batch")
        raise ValueError(f"set_epoch({epoch}): this sampler's next epoch is {current} (counting from 0; "
                         f"{'part-way, ' if drawn else ''}an epoch counts once step() has seen it); its orders "
                         "depend on every earlier epoch, so to resume, load the state_dict saved with the checkpoint")

    def _complete_epoch_without_steps(self) -> None:
        """Count the started epoch's every position as stepped (sorters that ignore gradients only)."""
        for t in range(0, self.m, self.batch_size):
            self.sorter.step(None, range(t, min(t + self.batch_size, self.m)))
        self.position, self.resume = self.m, None

    @property
    def epoch(self) -> int:
        """Index (from 0) of the epoch the next iteration yields."""
        if self.started and self.position < self.m:
            return self.sorter.epoch - 1  # unfinished: with no step() yet it comes again, part-way iter refuses
        return self.sorter.epoch

    def __iter__(self) -> Iterator[int]:
        """Starts the next epoch and yields the indices of the replicas yielded here, step by step.

        For each step, replica after replica, its next batch_size (or fewer, at the epoch's end) examples.
        After a mid-epoch load_state_dict: the rest of that epoch (or all of it, replay_from_epoch_start=True).

        Raises:
            ValueError: the previous epoch ended part-way (step() did not see all its batches).
            NonFiniteGradientError: off the CPU, a step of the previous epoch held NaN / inf gradients.

        Warns:
            UserWarning: the third iteration through the same epoch without any step() (a gradient sorter).
        """
        if 0 < self.position < self.m and self.resume is None:
            raise ValueError(f"the previous epoch ended after step() saw {self.position} of {self.m} examples "
                             "per replica; call step() for every batch (a DataLoader with drop_last=True skips the "
                             "last, short batch: pass drop_last=True to the sampler instead)")
        if self._iterated_through and self.started and self.position == 0 and self.resume is None:
            self._unstepped_passes += 1
        self._iterated_through = False
        if self._unstepped_passes >= 2 and self.uses_grads:
            # one whole pass without step() may be a look at the data or an evaluation; two in a row, and not one
            # step() since the epoch began, is a loop that forgot step() and trains on one fixed order
            warnings.warn(f"CDGraBSampler: {self._unstepped_passes} iterations went through the same epoch "
                          f"without any step() call, so {self.sorter.name} got no gradients and yields the same "
                          f"order again: a fixed order (as D-SO), not {self.sorter.name}. Call "
                          "sampler.step(per-example gradients) after every batch (exact=True: step_units); an "
                          "iteration without steps does not count as an epoch", UserWarning, stacklevel=2)
        if not self.started or self.position == self.m:  # else no step() yet, or a resume: the same epoch
            try:
                self.sorter.sort()
            except NonFiniteGradientError as error:  # found on the device path at the epoch's end
                raise self._named_step(error) from None
            self._unstepped_passes = 0
            self.position, self.started = 0, True
        first = self.position if self.resume == "rest" else 0
        indices = self.all_indices()[self.replicas_yielded]  # (R, m)
        steps = [indices[:, t:t + self.batch_size].reshape(-1) for t in range(first, self.m, self.batch_size)]
        return self._yield_all(torch.cat(steps).tolist())

    def _yield_all(self, indices: list[int]) -> Iterator[int]:
        """The iteration's indices; once the last is taken, it notes that this iteration went through (so that
        the next one can tell a whole epoch without step() calls from a peek at its first batches)."""
        yield from indices
        self._iterated_through = True

    def all_indices(self) -> torch.Tensor:
        """Every replica's dataset indices in the current epoch's order (every process knows them all).

        Returns:
            A (num_replicas, m) LongTensor on the CPU: row r holds replica r's indices.
        """
        first_index = torch.arange(self.num_replicas)[:, None] * self.m
        return self.sorter.orders.cpu() + first_index

    # ------------------------------------------------------------------ gradients

    def step(self, grads: torch.Tensor | None) -> None:
        """Hands the sorter the per-example gradients of the batch just used.

        Balancing sorters under torch.distributed all-gather them: every process must call step() together.

        Args:
            grads: (R * b, d) or (R, b, d), R = the replicas hosted here (1 under torch.distributed), b =
                batch_size (fewer for the epoch's last batch when m % batch_size != 0), rows in the order the
                sampler yielded the examples. None is accepted for sorters that ignore gradients. With
                sketch_dim = D, the last dimension may also be D: sketches made with the same D and seed.
                MB-GraB also takes (R, d) (or (R, 1, d)): each replica's micro-batch gradient, the mean gradient
                of its b examples, which a data-parallel step computes anyway (no per-example gradient).

        Raises:
            ValueError: a step outside an epoch, a sampler built with exact=True (it takes step_units), or
                gradients of another shape (one line naming the shapes it takes).
            TypeError: `grads` is not a tensor.
            NonFiniteGradientError: `grads` holds NaN or inf (nonfinite="raise"), naming the step and epoch.
        """
        if not self.started:
            raise ValueError("step() before the epoch started: iterate over the sampler (the DataLoader) first")
        if self.position == self.m:
            raise ValueError(f"step() called after the epoch's last batch ({self.m} examples per replica seen); "
                             "iterate over the sampler again to start the next epoch")
        if isinstance(self.sorter, ExactCDGraB):
            raise ValueError("CDGraBSampler: this sampler balances exact gradients from layer records (exact=True): "
                             "hand each batch over with step_units(exact(...)) or step_units(recording.units())")
        b = min(self.batch_size, self.m - self.position)
        R = len(self.replicas_here)
        balanced = None  # what the sorter balances: every replica's (num_replicas, b, D) rows; None if it ignores them
        if grads is not None or self.uses_grads:
            grads = self._check_shape(grads, R, b)
            if self.uses_grads:
                rows = grads.detach()  # (R * b, d or D) or (R, b, d or D): replica after replica
                # the map is built only where it changes something: full-width gradients and D < d (a caller
                # handing sketches never needs it)
                sketch = self.sketch if self.sketch_dim and rows.shape[-1] == self.d != self._sketched_width else None
                every = sketch_then_gather(rows, sketch, all_gather_rows if self.gathers else None)
                # (num_replicas, b, D); MB-GraB's micro-batch gradients: (num_replicas, 1, D)
                balanced = every.reshape(self.num_replicas, -1, every.shape[-1])
        try:
            self.sorter.step(balanced, range(self.position, self.position + b))
        except NonFiniteGradientError as error:
            raise self._named_step(error) from None
        self.position += b
        self.resume = None  # the resumed epoch goes on; from here on a part-way end is an error again

    def step_units(self, units: UnitGradients) -> None:
        """step() for exact CD-GraB from layer records (a sampler built with exact=True).

        Under torch.distributed each process hands over its own b units and they are all-gathered
        (`all_gather_units`: every layer's records), so every process balances every replica's units as one
        process hosting them all does.

        Args:
            units: the UnitGradients of the batch just used (sorters.exact: ExactGradients' call, or a
                recording's units()), R * b units in the order the sampler yielded the examples.

        Raises:
            ValueError: a sampler not built with exact=True, a step outside an epoch, or another number of
                units (one line).
            TypeError: `units` is not a UnitGradients.
            NonFiniteGradientError: the units' gradients hold NaN or inf, naming the step and epoch.
        """
        if not isinstance(self.sorter, ExactCDGraB):
            raise ValueError("CDGraBSampler: step_units() takes layer records, for a sampler built with exact=True "
                             "(CDGraBSettings(exact_low_memory=True).sampler(...)); this one takes step(grads)")
        if not self.started or self.position == self.m:
            raise ValueError("step_units() outside an epoch: iterate over the sampler (the DataLoader) first")
        if not isinstance(units, UnitGradients):
            raise TypeError(f"CDGraBSampler: step_units() takes the UnitGradients of ExactGradients, got "
                            f"{type(units).__name__}")
        b = min(self.batch_size, self.m - self.position)
        if units.units != len(self.replicas_here) * b:
            raise ValueError(f"CDGraBSampler: step_units() got {units.units} units for a step of "
                             f"{plural(len(self.replicas_here), 'replica')} x {plural(b, 'example')} here")
        # with write_grads under torch.distributed: the share whose owners write .grad, and which parameters the
        # step recorded; then what the owners write, id(parameter) -> its gradient
        writers: tuple[ParameterShare, list[bool]] | None = None
        owned_grads: dict[int, torch.Tensor] = {}
        if dist.is_available() and dist.is_initialized():  # also for a sorter installed after construction
            if self.sorter.share is None and is_sharded(units.owner):  # fully_shard: S sharded like the parameters
                self.sorter.use_share(ShardedRows(units.owner))
            share = self.sorter.share
            if isinstance(share, ShardedRows) and share.overlapped and units.owner.overlapped is None:
                units.owner.overlapped = OverlappedExchange(share)  # the next recordings send in their backward
            elif self.divide_products and self.sorter.share is None:  # at the first step: its units bring the model
                self.sorter.use_share(ParameterShare(units.owner))
            if units.writes_grads:
                writers = self._recorded_for_owners(units, self.sorter.share)
                units.writes_grads = False  # the owners write .grad: the caller's units.write_grads() adds nothing
            units = all_gather_units(units, self.sorter.share)  # with a share: each parameter to its owner
            if writers is not None:  # the owners' blocks give the step's gradient of their parameters
                units.step_grads, units.step_units, units.writes_grads = {}, units.units, True
                units.grad_sink = lambda p, grad: owned_grads.__setitem__(id(p), grad)
        try:
            self.sorter.step(units, range(self.position, self.position + b))
        except NonFiniteGradientError as error:
            raise self._named_step(error) from None
        if writers is not None:
            share, recorded = writers
            units.write_grads()  # the owned parameters the products did not reach (a step without pairs)
            share.broadcast_grads(owned_grads, recorded, 1.0 / dist.get_world_size())
        self.position += b
        self.resume = None

    def _recorded_for_owners(self, units: UnitGradients,
                             share: ParameterShare | None) -> tuple[ParameterShare, list[bool]]:
        """Units recorded with write_grads=True under torch.distributed (the backward made no weight gradient
        of the recorded parameters; DDP's all-reduce skipped): each parameter's owner takes its step gradient
        from the blocks its products form, and broadcasts it as the processes' mean (ParameterShare.
        broadcast_grads). Returns the sorter's `share` and which parameters this step recorded (every process
        alike)."""
        if isinstance(share, ShardedRows):
            raise ValueError("CDGraBSampler: units recorded with write_grads=True are not taken on a model sharded "
                             "with fully_shard (FSDP reduce-scatters the gradients itself): record with "
                             "write_grads=False")
        if share is None or units.owner.formed:
            raise ValueError("CDGraBSampler: units recorded with write_grads=True under torch.distributed need "
                             "divide_products=True (each parameter's owner writes its gradient) and a layer rule "
                             "for every selected parameter")
        return share, [bool(units.pieces.get(id(p))) for p in units.owner.params]

    def _named_step(self, error: NonFiniteGradientError) -> NonFiniteGradientError:
        """The sorter's error, prefixed with the step and the epoch as this sampler counts them (from 0, as
        set_epoch): the sorter's own epoch count (from 1) is left out of the line."""
        step, steps = error.position // self.batch_size, math.ceil(self.m / self.batch_size)
        return NonFiniteGradientError(f"CDGraBSampler: step {step} of {steps} in epoch {error.epoch - 1} (counting "
                                      f"from 0): {error.unplaced}", error.epoch, error.position)

    @property
    def skipped_steps(self) -> int:
        """The steps whose gradients held NaN or inf and were balanced as zeros (nonfinite="skip"), in the run."""
        return self.sorter.skipped_steps

    @property
    def sketch(self) -> GradientSketch | None:
        """The map that step() applies to (., d) gradients, GradientSketch(d, sketch_dim, seed), or None without
        sketch_dim. Built at first use (a model's d coordinates cost 5 bytes each)."""
        if self._sketch is None and self.sketch_dim and self.d is not None:  # d is given wherever sketch_dim is
            self._sketch = GradientSketch(self.d, self.sketch_dim, self.seed)
        return self._sketch

    def _check_shape(self, grads: torch.Tensor | None, R: int, b: int) -> torch.Tensor:
        """`grads` itself when it is a tensor of one of the shapes step() takes, else one line that names them."""
        d: int | str = self.d if self.d is not None else "d"
        widths = [d] + ([self._sketched_width] if self.sketch_dim and self._sketched_width != d else [])
        expected: list[tuple[int | str | None, ...]] = [
            shape for w in widths for shape in [(R * b, w)] + ([(R, b, w)] if R > 1 else [])]
        if getattr(self.sorter, "uses_batch_size", False) and b > 1:  # MB-GraB: each replica's micro-batch gradient
            expected += [shape for w in widths for shape in [(R, w)] + ([(R, 1, w)] if R > 1 else [])]
        if grads is not None and not torch.is_tensor(grads):
            raise TypeError(f"{self.sorter.name} sampler: step() takes the per-example gradients as a tensor of "
                            f"shape {' or '.join(map(str, expected))}, got a {type(grads).__name__}")
        shape = None if grads is None else tuple(grads.shape)
        if shape is not None and len(shape) in (2, 3) and self.d is None:
            expected = [e[:-1] + shape[-1:] for e in expected]  # any d for sorters that ignore gradients
        if grads is None or shape not in expected:  # (None is never expected)
            at = f" at step {self.position // self.batch_size} of {math.ceil(self.m / self.batch_size)}"
            raise ValueError(f"{self.sorter.name} sampler: grads must have shape "
                             f"{' or '.join(map(str, expected))}{at}, got {shape}")
        return grads

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same orders: the sorter's state and the position.

        Save it between epochs or mid-epoch (after some step() calls: load_state_dict then resumes at the next
        batch). It holds no rank or view: every process's state is the same (the gradients are all-gathered),
        so rank 0's checkpoint restores every process, in either view.

        Returns:
            A dict of plain tensors and numbers (torch.load(weights_only=True) reads it): "sorter", "position",
            "started", "config" and its "format_version".
        """
        return self._state_around(self.sorter.state_dict())

    def _state_around(self, sorter_state: dict[str, Any]) -> dict[str, Any]:
        """The sampler's state with the sorter's given (sorters.fsdp.sharded_state_dict: each process's part)."""
        return {"sorter": sorter_state, "position": self.position, "started": self.started,
                "config": self._config(), FORMAT_KEY: SAMPLER_STATE_FORMAT}  # sorters/_state_format.py

    def load_state_dict(self, state: dict[str, Any], replay_from_epoch_start: bool = False) -> None:
        """Restores a state that state_dict() returned.

        Saved mid-epoch (after k of its steps), the next iteration yields the rest of that epoch, from step k
        on: for loaders that continue where they stopped (Lightning, or a plain loop). Either way the orders
        are those of an uninterrupted run. Saved between epochs, both give the next epoch.

        Args:
            state: the dict that state_dict() returned (of this format or an older one).
            replay_from_epoch_start: yield the whole epoch again instead, for loaders that replay it and drop
                the first k batches themselves without step() (the HF Trainer, through accelerate's
                skip_first_batches).

        Raises:
            TypeError: `state` is not a dict, or replay_from_epoch_start is not a bool (one line).
            ValueError: a state of a newer format, one that lacks keys or does not hold together, or one
                saved with other settings (one line naming them).
        """
        self._load_around(state, replay_from_epoch_start, self.sorter.load_state_dict)

    def _load_around(self, state: dict[str, Any], replay_from_epoch_start: bool,
                     load_sorter: Callable[[dict[str, Any]], None]) -> None:
        """load_state_dict with the sorter's state restored by `load_sorter` (sorters.fsdp.load_sharded_state_dict:
        each process's part), after the same checks."""
        if not isinstance(replay_from_epoch_start, bool):
            raise TypeError(f"replay_from_epoch_start must be True or False, got {replay_from_epoch_start!r}")
        owner = "CDGraBSampler.load_state_dict"
        saved_format(owner, state, SAMPLER_STATE_FORMAT)  # format 0 (no format key) holds format 1's keys
        check_state_keys(owner, state, ("sorter", "position", "started", "config"), "CDGraBSampler.state_dict()")
        if not isinstance(state["config"], dict) or not isinstance(state["sorter"], dict):
            raise ValueError(f"{owner}: state['config'] and state['sorter'] must be dicts, "
                             "as state_dict() saves them")
        if not isinstance(state["started"], bool):
            raise ValueError(f"{owner}: state['started'] must be True or False, got {state['started']!r}")
        position = check_int(owner, "state['position']", state["position"], 0, self.m)
        stepped = state["sorter"].get("_next_position")
        if stepped != position or (position and not state["started"]):
            raise ValueError(f"{owner}: state['position'] {position} does not match its sorter's state (position "
                             f"{stepped}, started={state['started']}); pass a state that state_dict() returned")
        saved, now = {"sketch_dim": 0, **state["config"]}, self._config()  # states saved before sketch_dim
        if saved != now:
            differ = {key: (saved.get(key), now.get(key)) for key in saved.keys() | now.keys()
                      if saved.get(key) != now.get(key)}
            raise ValueError("sampler state is for other settings: " + ", ".join(
                f"{key} {was} (this sampler: {is_now})" for key, (was, is_now) in sorted(differ.items())))
        load_sorter(state["sorter"])
        self.position, self.started = position, state["started"]
        mid_epoch = self.started and 0 < self.position < self.m
        self.resume = ("replay" if replay_from_epoch_start else "rest") if mid_epoch else None

    def _config(self) -> dict[str, object]:
        """The settings a state is for: the orders differ under any other."""
        config: dict[str, object] = {"sorter": self.sorter.name, "num_replicas": self.num_replicas, "m": self.m,
                  "batch_size": self.batch_size, "d": self.d, "seed": self.seed, "sketch_dim": self.sketch_dim}
        if self.epochs is not None:  # only where it changes the orders (KH-SGD, SBW)
            config["epochs"] = self.epochs
        return config
