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
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from sorters.exact import ExactGradients
from sorters.exact_products import Contribution, Outer, Pieces, Rows, matrix_shape
from sorters.gather import ParameterShare

__all__ = ["ShardedRows", "is_sharded", "owned_rows"]


def is_sharded(exact: ExactGradients) -> bool:
    """Whether any selected parameter of `exact` is a DTensor (the model went through fully_shard)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor  # here: `import sorters` stays without DTensor's modules
    return any(isinstance(p, DTensor) for p in exact.params)


def chunk_rows(R: int, rank: int, world: int) -> tuple[int, int]:
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
    r0, r1 = chunk_rows(R, rank, world)
    if local is not None and local != r1 - r0:  # FSDP2 pads only its all-gather buffer, never the local shard
        raise ValueError(f"ShardedRows: {name}'s local shard has {local} rows where rank {rank} of {world} should "
                         f"hold rows {r0}..{r1 - 1} of {R}")
    return r0, r1


def row_count(x: Contribution) -> int:
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
    - "all": every unit's whole records to every process (all-gathered, as in the data-parallel exact path).

    Both give the same products and orders; "owners" sends up to (P - 1) / P fewer of the row factor's bytes.

    Attributes (besides ParameterShare's): rows, [(r0, r1)] per parameter of exact.params; owned[i]: r1 > r0;
    records; row_splits: with records="owners", per parameter every process's (r0, r1) (rank-major), else None.

    Args:
        exact: the ExactGradients of the sharded model (built after fully_shard).
        rank, world: for parameters that are not DTensors, the split's rank and process count (default: the
            process group's).
        reduce: None (all_reduce over the default group), or the callable that sums a tensor over the
            processes (a test passes its own).
        records: "owners" or "all" (above); None: the class's default `RECORDS`.

    Raises:
        ValueError: records not one of those, or (records="owners") a parameter's rows not split over the default
            process group (the route's all-to-all).
    """

    gathers_to_owners = False
    RECORDS = "owners"  # the default route (bench/fsdp_gpt2_small.py: the cheaper on GPT-2 small)

    def __init__(self, exact: ExactGradients, rank: int | None = None, world: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, records: str | None = None) -> None:
        records = self.RECORDS if records is None else records
        if records not in ("owners", "all"):
            raise ValueError(f"ShardedRows: records must be 'owners' or 'all', got {records!r}")
        self.records = records
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
        if records == "owners":
            if world is None:
                world = dist.get_world_size() if dist.is_initialized() else 1
            self.row_splits = [[chunk_rows(matrix_shape(p)[0], q, world) for q in range(world)] for p in self.params]
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
        return [(first, x if row_count(x) == r1 - r0 else x.rows(r0, r1)) for first, x in pieces]

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
