"""Exact CD-GraB on a model sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`): the running sum
sharded like the parameters (issue #61; docs/fsdp.md).

    for layer in model.layers: fully_shard(layer)
    fully_shard(model)
    exact = ExactGradients(model)                    # AFTER fully_shard: its parameters are the sharded ones
    sampler = CDGraBSampler(train_set, batch_size, d=exact.d, exact=True)
    ...                                              # the loop of docs/sampler.md, unchanged:
    with exact.recording() as rec:                   # its forward and backward on the sharded model
        losses = per_example_losses(model(x)); rec.watch(losses)
    losses.mean().backward(); sampler.step_units(rec.units()); optimizer.step()

Under fully_shard each process holds rows r0..r1-1 (dim 0) of every parameter, a DTensor placed Shard(0)
whose `to_local()` is those rows (torch.chunk's split: ceil(R / P) rows a process, the last ones fewer or
none). `ShardedRows` makes the running sum S follow the same split: each process keeps S's entries of its
own rows of every parameter ((size,), about d / P), and per step, once every process holds every unit's
layer records (all-gathered as in the data-parallel exact path, sorters.gather.all_gather_units),

- (a) <S, g_u> and (b) <g_u, g_v> are sums over the rows of every parameter: each process takes them over
  its own rows only, from its rows' part of each contribution (`Outer.rows`, `Rows.rows`, `Formed.rows` in
  sorters/exact_products.py: a Linear's g_u[rows] = sum_t delta_ut[rows] a_ut^T needs delta's rows only),
  and the (parameters, products) partials are all-reduced (`reduce`): every process gets the same sums, so
  the same signs and orders;
- (c) S[rows] += sum_u w_u g_u[rows] is local.

A parameter that is not a DTensor (a layer left out of fully_shard: replicated) is split the same way.
Only FSDP2's Shard(0) on a one-dimensional mesh is taken (HSDP's two-dimensional mesh is refused).
"""
import io
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sorters.exact import ExactCDGraB, ExactGradients, UnitGradients
from sorters.exact_products import Contribution, Formed, Outer, Pieces, Rows, matrix_shape
from sorters.gather import ParameterShare
from sorters.layer_sketch import LayerSketch

if TYPE_CHECKING:  # sorters.sampler imports this module
    from sorters.sampler import CDGraBSampler

__all__ = ["ShardedRows", "is_sharded", "owned_rows", "sharded_state_dict", "load_sharded_state_dict"]


def is_sharded(exact: ExactGradients) -> bool:
    """Whether any selected parameter of `exact` is a DTensor (the model went through fully_shard)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor  # here: `import sorters` stays without DTensor's modules
    return any(isinstance(p, DTensor) for p in exact.params)


def _chunk_rows(R: int, rank: int, world: int) -> tuple[int, int]:
    """(r0, r1): the rows r0..r1-1 of R that process `rank` of `world` holds under torch.chunk's split (FSDP2's
    Shard(0)): ceil(R / world) rows a process, the last ones fewer or none."""
    chunk = math.ceil(R / world)
    r0 = min(rank * chunk, R)
    return r0, min(r0 + chunk, R)


def owned_rows(p: torch.Tensor, name: str = "a parameter", rank: int | None = None,
               world: int | None = None) -> tuple[int, int]:
    """(r0, r1): the rows r0..r1-1 of dim 0 of p this process owns: a DTensor's local shard (FSDP2's Shard(0)
    on a one-dimensional mesh: torch.chunk's split, ceil(R / P) rows a process, checked against the local
    shard's length), or, for a plain (replicated) tensor, the same split of its R rows over `world` processes
    at `rank` (default: the process group's).

    Raises:
        ValueError: a DTensor placed otherwise than Shard(0) on a one-dimensional mesh, or a local shard that
            is not the chunk this rank should hold.
    """
    R = matrix_shape(p)[0]
    local: int | None = None  # the rows of a DTensor's local shard
    if dist.is_available():
        from torch.distributed.tensor import DTensor, Shard
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if mesh.ndim != 1 or len(p.placements) != 1 or p.placements[0] != Shard(0):
                raise ValueError(f"ShardedRows: {name} is placed {tuple(p.placements)} on a {mesh.ndim}-D mesh; "
                                 "exact CD-GraB under sharding takes FSDP2's Shard(0) on a one-dimensional mesh "
                                 "(fully_shard without HSDP)")
            rank, world = mesh.get_local_rank(), mesh.size()
            local = p.to_local().shape[0] if p.dim() else 1
    if local is None:
        rank = dist.get_rank() if rank is None else rank
        world = dist.get_world_size() if world is None else world
    assert rank is not None and world is not None  # (for mypy: set on both paths)
    r0, r1 = _chunk_rows(R, rank, world)
    if local is not None and local != r1 - r0:  # FSDP2 pads only its all-gather buffer, never the local shard
        raise ValueError(f"ShardedRows: {name}'s local shard has {local} rows where rank {rank} of {world} should "
                         f"hold rows {r0}..{r1 - 1} of {R}")
    return r0, r1


def _row_count(x: Contribution) -> int:
    """The rows of the (R, C) matrix a contribution holds: Outer's left (U, T, R), Rows' num_rows, Formed's
    values (U, R, C)."""
    return x.left.shape[2] if isinstance(x, Outer) else x.num_rows if isinstance(x, Rows) else x.values.shape[1]


class ShardedRows(ParameterShare):
    """The rows of every selected parameter this process owns (`owned_rows`), as ExactCDGraB's share
    (ExactCDGraB(share=) or use_share; CDGraBSampler installs it at its first step_units on a sharded model):
    the running sum holds those rows of each parameter one after the other ((size,), about d / P), each
    parameter's products are taken over them (`restrict`), and the (parameters, products) partials are summed
    over the processes (`reduce`). Every process owns part of most parameters, so the records go to every
    process (gathers_to_owners False), in one of two ways (`records`):

    - "owners": each process receives the row factor's rows it owns only (a Linear's output gradients delta
      (U, T, r1 - r0), a Conv1D's inputs, a formed gradient's rows: an all-to-all, `row_splits`) and the column
      factor whole (an all-gather); an embedding's records whole (which rows a token touches depends on its id);
    - "all": every unit's whole records to every process (all-gathered, as in the data-parallel exact path);
    - "owners-overlapped": "owners", each parameter's records sent inside the backward as soon as its layers'
      output gradients are in, by asynchronous collectives that run while the backward goes on
      (sorters.gather.OverlappedExchange, which CDGraBSampler installs on the model's ExactGradients at its
      first step; the second step's backward learns which layer records which parameter, and the third's
      sends; docs/fsdp.md).

    All give the same products and orders; "owners" sends up to (P - 1) / P fewer of the row factor's bytes.

    Attributes (besides ParameterShare's): rows, [(r0, r1)] per parameter of exact.params; owned[i]: r1 > r0;
    records; row_splits: with records="owners" or "owners-overlapped", per parameter every process's (r0, r1)
    (rank-major), else None; overlapped: records="owners-overlapped".

    Args:
        exact: the ExactGradients of the sharded model (built after fully_shard).
        rank, world: for parameters that are not DTensors, the split's rank and process count (default: the
            process group's).
        reduce: None (all_reduce over the default group), or the callable that sums a tensor over the
            processes (a test passes its own).
        records: "owners", "all" or "owners-overlapped" (above); None: the class's default `RECORDS`.

    Raises:
        ValueError: records not one of those, or (an owners' route) a parameter's rows not split over the default
            process group (the route's all-to-all).
    """

    gathers_to_owners = False
    # no sum of the units per parameter for the update (ExactCDGraB's sum_all): it would double the running sum's
    # memory (d / P floats) under a sharding chosen for memory; the update takes every unit's records instead
    keeps_unit_sums = False
    RECORDS = "owners"  # the default route (bench/fsdp_gpt2_small.py: the cheaper on GPT-2 small)

    def __init__(self, exact: ExactGradients, rank: int | None = None, world: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, records: str | None = None) -> None:
        records = self.RECORDS if records is None else records
        if records not in ("owners", "all", "owners-overlapped"):
            raise ValueError(f"ShardedRows: records must be 'owners', 'all' or 'owners-overlapped', got {records!r}")
        self.records, self.overlapped = records, records == "owners-overlapped"
        # (ParameterShare's __init__ splits whole parameters; the attributes its users read are set here)
        self.offsets, self.params, self._reduce = exact.offsets, exact.params, reduce
        self.rows = [owned_rows(p, name, rank, world) for name, p in zip(exact.names, exact.params)]
        self.owned = [r1 > r0 for r0, r1 in self.rows]
        self.rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        self.owners = [self.rank if owned else -1 for owned in self.owned]  # (not used to route records)
        self.part_offsets: dict[int, int] = {}
        self.size = 0
        for p, (r0, r1) in zip(self.params, self.rows):
            self.part_offsets[id(p)] = self.size
            self.size += (r1 - r0) * matrix_shape(p)[1]
        self.work = [self.size]
        self._rows_of = {id(p): rows for p, rows in zip(self.params, self.rows)}
        self.row_splits: list[list[tuple[int, int]]] | None = None
        if records != "all":
            if world is None:
                world = dist.get_world_size() if dist.is_initialized() else 1
            self.row_splits = [[_chunk_rows(matrix_shape(p)[0], q, world) for q in range(world)] for p in self.params]
            for name, splits, rows in zip(exact.names, self.row_splits, self.rows):
                if splits[self.rank] != rows:
                    raise ValueError(f"ShardedRows: {name}'s rows {rows} are not rank {self.rank}'s of the default "
                                     f"process group of {world}; pass records='all'")

    def restrict(self, p: torch.Tensor, pieces: Pieces) -> Pieces:
        """p's contributions cut to its owned rows (each (first unit, contribution.rows(r0, r1))); one that has
        r1 - r0 rows already (routed to the owners: records="owners") is kept as it is."""
        r0, r1 = self._rows_of[id(p)]
        R = matrix_shape(p)[0]
        if r0 == 0 and r1 == R:
            return pieces
        return [(first, x if _row_count(x) == r1 - r0 else x.rows(r0, r1)) for first, x in pieces]

    def restrict_grad(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A step gradient of p, (R, C) whole (a backward's) or (r1 - r0, C) already (summed from restricted
        records): its owned rows, (r1 - r0, C)."""
        r0, r1 = self._rows_of[id(p)]
        R, C = matrix_shape(p)
        grad = grad.reshape(-1, C)
        return grad[r0:r1] if grad.shape[0] == R != r1 - r0 else grad

    def view(self, part: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """p's owned rows in this process's part (size,), an (r1 - r0, C) view."""
        r0, r1 = self._rows_of[id(p)]
        C = matrix_shape(p)[1]
        start = self.part_offsets[id(p)]
        return part[start:start + (r1 - r0) * C].view(r1 - r0, C)

    def part(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat (..., d) tensor's entries of the owned rows, (..., size), a copy."""
        slices = []
        for p, (r0, r1) in zip(self.params, self.rows):
            C, start = matrix_shape(p)[1], self.offsets[id(p)]
            slices.append(flat[..., start + r0 * C:start + r1 * C])
        return torch.cat(slices, -1)

    def whole(self, part: torch.Tensor, d: int) -> torch.Tensor:
        """This process's part (..., size) placed in a flat (..., d) tensor of zeros (part()'s inverse)."""
        flat = part.new_zeros(part.shape[:-1] + (d,))
        for p, (r0, r1) in zip(self.params, self.rows):
            C, start, mine = matrix_shape(p)[1], self.offsets[id(p)], self.part_offsets[id(p)]
            flat[..., start + r0 * C:start + r1 * C] = part[..., mine:mine + (r1 - r0) * C]
        return flat


# ---------------------------------------------------------------------------------- checkpoints (DCP)

def _sharded_sorter(owner: "CDGraBSampler | ExactCDGraB", exact: ExactGradients,
                    what: str) -> tuple[ExactCDGraB, "CDGraBSampler | None", ShardedRows]:
    """(the ExactCDGraB, the sampler or None, its ShardedRows share: installed here on a sorter that has none
    yet, as the sampler's first step_units would), or one line saying what to pass."""
    sampler = None if isinstance(owner, ExactCDGraB) else owner
    sorter = owner if sampler is None else getattr(sampler, "sorter", None)
    if not isinstance(sorter, ExactCDGraB) or not isinstance(exact, ExactGradients):
        raise TypeError(f"{what} takes a CDGraBSampler built with exact=True (or its ExactCDGraB) and the model's "
                        f"ExactGradients, got {type(owner).__name__} and {type(exact).__name__}")
    if sorter.d != exact.d:
        raise ValueError(f"{what}: the sorter is for d={sorter.d}, the ExactGradients select d={exact.d}")
    if not (dist.is_available() and dist.is_initialized()) or not is_sharded(exact):
        raise ValueError(f"{what} is for a model sharded with fully_shard under torch.distributed (ExactGradients "
                         "built after fully_shard); otherwise save sampler.state_dict()")
    if sorter.share is None:
        sorter.use_share(ShardedRows(exact))
    share = sorter.share
    if not isinstance(share, ShardedRows) or share.params != exact.params:
        raise ValueError(f"{what}: the sorter divides its running sum otherwise than this model's rows (a share of "
                         "another ExactGradients, or divide_products=True)")
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, p, rows in zip(exact.names, exact.params, share.rows):
        if rows != _chunk_rows(matrix_shape(p)[0], rank, world):  # the checkpoint's DTensors are split over the group
            raise ValueError(f"{what}: {name}'s rows {rows} are not rank {rank}'s share of the default process group "
                             f"of {world} (a model sharded over part of the processes is not supported)")
    return sorter, sampler, share


def _rows_dtensor(local: torch.Tensor, shape: tuple[int, ...], dim: int, mesh: Any) -> Any:
    """local, this process's rows (dim `dim`) of a tensor of `shape`, as a DTensor placed Shard(dim) on `mesh`
    (the chunk rule: torch.distributed.checkpoint then re-splits it for another process count)."""
    from torch.distributed.tensor import DTensor, Shard
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride)


def _world_mesh(exact: ExactGradients) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    group = dist.group.WORLD
    assert group is not None  # (initialised: _sharded_sorter checked it)
    return DeviceMesh.from_group(group, exact.params[0].device.type)


def sharded_state_dict(owner: "CDGraBSampler | ExactCDGraB", exact: ExactGradients) -> dict[str, Any]:
    """The state of exact CD-GraB on a model sharded with fully_shard, for torch.distributed.checkpoint (DCP),
    without d numbers on any process: each process's rows of the running sum (and of the pending units'
    gradients, when a unit waits for its pair across steps) as DTensors placed Shard on the process group,
    and the rest (the orders, the position, the settings; the same in every process) as one bytes object.

        dcp.save({"model": model.state_dict(), "sampler": sharded_state_dict(sampler, exact)}, checkpoint_id=path)
        ...  # the same or another number of processes, the model fully_shard-ed again:
        load_sharded_state_dict(sampler, exact, path)

    Every process calls it (no collective).

    Args:
        owner: a CDGraBSampler built with exact=True, or its ExactCDGraB (the sorter's state alone).
        exact: the ExactGradients of the sharded model (built after fully_shard).

    Returns:
        {"state": bytes, "running_sum": {name: (R, C) DTensor}, and "pending": {name: (n, R, C) DTensor} when
        units wait}: per selected parameter (by name) its (R, C) matrix shape (a vector: (R, 1)), this
        process's rows r0..r1-1 local (copies).

    Raises:
        TypeError: not an exact sampler or sorter and the ExactGradients of its model (one line).
        ValueError: a model not sharded with fully_shard over the default process group (one line).
    """
    sorter, sampler, share = _sharded_sorter(owner, exact, "sharded_state_dict")
    sorter_state = sorter.state_dict(sharded=True)
    part, pending = sorter_state.pop("running_sum"), sorter_state.pop("pending")
    rest = {"kind": "sampler" if sampler is not None else "sorter",
            "state": sampler._state_around(sorter_state) if sampler is not None else sorter_state}
    blob = io.BytesIO()
    torch.save(rest, blob)
    mesh = _world_mesh(exact)
    device = exact.params[0].device
    state: dict[str, Any] = {"state": blob.getvalue(), "running_sum": {}}
    if pending is not None:
        state["pending"] = {}
    for name, p, (r0, r1) in zip(exact.names, exact.params, share.rows):
        R, C = matrix_shape(p)
        start = share.part_offsets[id(p)]
        rows = part[start:start + (r1 - r0) * C].view(r1 - r0, C)
        state["running_sum"][name] = _rows_dtensor(rows.to(device, copy=True), (R, C), 0, mesh)
        if pending is not None:
            units = pending[:, start:start + (r1 - r0) * C].reshape(len(pending), r1 - r0, C)
            state["pending"][name] = _rows_dtensor(units.to(device, copy=True), (len(units), R, C), 1, mesh)
    return state


def load_sharded_state_dict(owner: "CDGraBSampler | ExactCDGraB", exact: ExactGradients, checkpoint_id: Any = None,
                            key: str = "sampler", storage_reader: Any = None,
                            replay_from_epoch_start: bool = False) -> None:
    """Restore what sharded_state_dict saved under `key` of a torch.distributed.checkpoint checkpoint, onto the
    same or another number of processes (each process reads its rows only: torch.chunk's split of the new
    process count, as fully_shard splits the parameters). The run goes on with the orders of an uninterrupted
    one. Every process calls it (DCP's collectives).

    Args:
        owner: a CDGraBSampler built with exact=True, or an ExactCDGraB (as saved), of the same settings.
        exact: the ExactGradients of the model sharded with fully_shard (built after it).
        checkpoint_id, storage_reader: DCP's (a checkpoint's path, or a StorageReader).
        key: where the state was put in the checkpoint's state dict.
        replay_from_epoch_start: as CDGraBSampler.load_state_dict.

    Raises:
        ValueError: a checkpoint without that state, of another model (parameter names or shapes) or other
            settings, refused in one line before anything changes (the sampler's own checks after).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sorter, sampler, share = _sharded_sorter(owner, exact, "load_sharded_state_dict")
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("load_sharded_state_dict: pass the checkpoint's path (checkpoint_id) or a storage_reader")
    reader = storage_reader if storage_reader is not None else dcp.FileSystemReader(checkpoint_id)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"load_sharded_state_dict: cannot read checkpoint {checkpoint_id!r}: {error}") from None
    if f"{key}.state" not in saved:
        raise ValueError(f"load_sharded_state_dict: checkpoint {checkpoint_id!r} holds no state of "
                         f"sharded_state_dict under key {key!r}")
    sums = {name[len(key) + 13:]: meta for name, meta in saved.items() if name.startswith(f"{key}.running_sum.")}
    units = {name[len(key) + 9:]: meta for name, meta in saved.items() if name.startswith(f"{key}.pending.")}
    if sums.keys() != set(exact.names):
        missing, extra = set(exact.names) - sums.keys(), sums.keys() - set(exact.names)
        raise ValueError(f"load_sharded_state_dict: the checkpoint is of another model: its parameters differ "
                         f"(missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
    for name, p in zip(exact.names, exact.params):
        meta = sums[name]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != matrix_shape(p):
            got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
            raise ValueError(f"load_sharded_state_dict: the checkpoint is of another model: {name}'s running sum is "
                             f"{got} there, {matrix_shape(p)} here")
    mesh = _world_mesh(exact)
    device = exact.params[0].device
    template: dict[str, Any] = {"state": b"", "running_sum": {}}
    if units:
        template["pending"] = {}
    n = sorter.n
    for name, p, (r0, r1) in zip(exact.names, exact.params, share.rows):
        R, C = matrix_shape(p)
        template["running_sum"][name] = _rows_dtensor(torch.empty(r1 - r0, C, device=device), (R, C), 0, mesh)
        if units:
            if tuple(getattr(units.get(name), "size", ())) != (n, R, C):
                raise ValueError(f"load_sharded_state_dict: the checkpoint's pending units of {name} are not "
                                 f"({n}, {R}, {C}) (another model or number of workers)")
            template["pending"][name] = _rows_dtensor(torch.empty(n, r1 - r0, C, device=device), (n, R, C), 1, mesh)
    dcp.load({key: template}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    rest = torch.load(io.BytesIO(template["state"]), weights_only=True)
    if sampler is not None and rest["kind"] != "sampler":
        raise ValueError("load_sharded_state_dict: the checkpoint holds an ExactCDGraB's state, not a sampler's; "
                         "load it into the sampler's sorter")
    sorter_state = rest["state"]["sorter"] if rest["kind"] == "sampler" else rest["state"]
    part = torch.cat([template["running_sum"][name].to_local().reshape(-1) for name in exact.names])
    pending = None
    if units:
        rows = torch.cat([template["pending"][name].to_local().reshape(n, -1) for name in exact.names], 1)
        pending = _formed_units(exact, share, rows)

    def load_sorter(state: dict[str, Any]) -> None:
        sorter.load_state_dict({**state, "running_sum": part.to(sorter.dtype), "pending": pending}, sharded=True)

    if sampler is None:  # a sampler's checkpoint too: its sorter's state (on another number of processes)
        load_sorter(sorter_state)
    else:
        sampler._load_around(rest["state"], replay_from_epoch_start, load_sorter)


def _formed_units(exact: ExactGradients, share: ShardedRows, rows: torch.Tensor) -> UnitGradients:
    """Units whose gradients, on this process's rows, are given formed (ExactGradients.formed_units of a share's
    part): per parameter one Formed contribution of its owned rows, (U, r1 - r0, C), scale 1.

    Args:
        exact: the ExactGradients the share is of.
        share: this process's ShardedRows.
        rows: (U, share.size) the units' gradients on the owned rows, parameter after parameter.

    Returns:
        The U units' UnitGradients (a parameter whose rows are all zero, or owned by none here, gets none).

    Raises:
        ValueError: rows of another shape.
    """
    if rows.dim() != 2 or rows.shape[1] != share.size:
        raise ValueError(f"_formed_units: takes (U, share.size={share.size}) rows, got {tuple(rows.shape)}")
    pieces: dict[int, Pieces] = {}
    U = len(rows)
    for p, (r0, r1) in zip(exact.params, share.rows):
        C, start = matrix_shape(p)[1], share.part_offsets[id(p)]
        values = rows[:, start:start + (r1 - r0) * C]
        if r1 > r0 and bool(values.ne(0).any()):
            # r1 - r0 rows: ShardedRows.restrict keeps them as they are (as records routed to the row owners)
            pieces[id(p)] = [(0, Formed(values.reshape(U, r1 - r0, C).to(p.device, p.dtype)))]
    first = exact.params[0]
    return UnitGradients(exact, U, pieces, torch.ones(U, dtype=first.dtype, device=first.device))


def _exact_over_current_parameters(exact: ExactGradients) -> ExactGradients:
    """`exact` while its parameters are still its model's; else, when fully_shard replaced them (Lightning's
    configure_model runs after the module's setup(), where `exact` was built), the ExactGradients of the same
    parameters, by name, as the model holds them now: the sharded DTensors that the sampler's running sum
    follows (sorters.fsdp.ShardedRows), and no reference left to the unsharded ones."""
    current = dict(exact.model.named_parameters())
    if all(current.get(name) is p for name, p in zip(exact.names, exact.params)):
        return exact
    return ExactGradients(exact.model, params=[f"^{re.escape(name)}$" for name in exact.names], how=exact.how)


def _sketch_over_current_parameters(sketcher: LayerSketch) -> LayerSketch:
    """`sketcher` while its parameters are still its model's; else (fully_shard replaced them after it was
    built) the LayerSketch of the same parameters, by name, over the model as it is now, with the same map: the
    same dim and seed, and a min_numel that blocks the same weights (the smallest block's entries; above d
    without blocks), checked against the old map's blocks."""
    current = dict(sketcher.model.named_parameters())
    if all(id(current.get(name)) in sketcher.layout.offsets for name in sketcher.names):  # (offsets: by id)
        return sketcher
    blocks = [(block.offset, block.rows, block.cols) for block in sketcher.sketch.blocks]
    min_numel = min((rows * cols for _, rows, cols in blocks), default=sketcher.d + 1)
    rebuilt = LayerSketch(sketcher.model, sketcher.dim, sketcher.sketch.seed, min_numel=min_numel,
                          params=[f"^{re.escape(name)}$" for name in sketcher.names], batch_dim=sketcher.batch_dim)
    assert [(block.offset, block.rows, block.cols) for block in rebuilt.sketch.blocks] == blocks, "another map"
    return rebuilt
