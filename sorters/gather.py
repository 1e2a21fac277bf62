"""Sketch, then gather: how the balancing sorters' per-unit gradients reach every process.

    every = sketch_then_gather(local, sketch)   # (r, ..., d) here -> (world_size * r, ..., D) everywhere

Each process maps its OWN rows to D-dimensional sketches (a `GradientSketch`, sorters/sketch.py) and only
then all-gathers them, so every process receives world_size * r * D floats instead of world_size * r * d
(docs/sketching.md). A sketch is a function of one row at a time, so sketching here and gathering
afterwards gives the same tensor as gathering first and sketching everything, which is what lets one
process hosting all n workers (no gather) reproduce n processes bit for bit.

Both users call it: `CDGraBSampler.step` (rows = this replica's examples of the step) and the engine's
gradient exchange (rows = this process's workers, each (k, d) per-unit gradients).

Exact CD-GraB from layer records (sorters/exact.py) gathers records instead: `all_gather_units`
(`CDGraBSampler.step_units`, the engine's `GradientExchange.exchange_units`), per parameter the smaller of
its records and its per-unit gradient (`exchange_bytes`); `gather_parts` does it for a step recorded in
parts (the engine's chunks), part by part. With a `ParameterShare` (ExactCDGraB dividing the products over
the processes: the HF Trainer under torchrun, `CDGraBSampler(divide_products=True)`) each parameter's
records go to its owning process only (`Exchange.to_owner`). `OverlappedExchange` starts the owners' route of a
sharded model (sorters.fsdp.ShardedRows) inside the backward, parameter by parameter; all_gather_units
finishes it.
"""
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

from sorters.exact import ExactGradients, UnitGradients
from sorters.exact_products import Contribution, Formed, Outer, Pieces, Rows, matrix_shape
from sorters.sketch import GradientSketch

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; GPU images may be older
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sketch_rows(rows: torch.Tensor, sketch: GradientSketch | None = None) -> torch.Tensor:
    """rows (..., d) -> (..., D): `sketch(rows)` when a sketch is given and the rows are its d wide; else
    `rows` unchanged (no sketch, or rows that are sketches already, (..., D), as a caller may hand them).
    `sketch`: a GradientSketch (at run time anything with `.d` and a (..., d) -> (..., D) call)."""
    if sketch is None or rows.shape[-1] != sketch.d:
        return rows
    return sketch(rows)


def all_gather_rows(local: torch.Tensor, works: list[tuple[dist.Work, torch.Tensor]] | None = None) -> torch.Tensor:
    """local (r, ...) in each process of the default process group -> (world_size * r, ...) in every
    process: process p's rows at p * r ... (p + 1) * r - 1. Every process must call it at the same time
    with the same shape and dtype; the result is made on local's device, in its dtype (NCCL gathers GPU
    tensors). works: None (the result is there on return), or a list the started collective goes to (async_op):
    its handle and the tensor sent, kept until it is waited on, when the result is there."""
    out = torch.empty((dist.get_world_size() * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    local = local.contiguous()
    if works is None:
        _all_gather_single(out, local)
    else:
        works.append((_all_gather_single(out, local, async_op=True), local))
    return out


def sketch_then_gather(local: torch.Tensor, sketch: GradientSketch | None = None,
                       gather: Callable[[torch.Tensor], torch.Tensor] | None = all_gather_rows) -> torch.Tensor:
    """local (r, ..., d) or, already sketched, (r, ..., D) -> (n * r, ..., D): this process's rows sketched
    (`sketch_rows`), then gathered with every other process's by `gather` (r, ..., D) -> (n * r, ..., D)
    (default: `all_gather_rows` over the default process group). gather=None: every row lives in this
    process (no process group), the sketched rows themselves are returned (n = 1)."""
    sketched = sketch_rows(local, sketch)
    return sketched if gather is None else gather(sketched)


def _all_to_all(out: torch.Tensor, send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
                works: list[tuple[dist.Work, torch.Tensor]] | None = None) -> None:
    """out (sum(receive_sizes),) <- receive_sizes[q] numbers from each process q; send (sum(send_sizes),):
    send_sizes[q] numbers to each q, rank-major. works: as all_gather_rows'."""
    if works is None:
        dist.all_to_all_single(out, send, receive_sizes, send_sizes)
    else:
        works.append((dist.all_to_all_single(out, send, receive_sizes, send_sizes, async_op=True), send))


def all_gather_units(units: UnitGradients, share: "ParameterShare | None" = None) -> UnitGradients:
    """This process's U units (records fresh from one backward: each contribution covers all U) -> the
    world_size * U units of every process, rank-major, in every process, with the loss weights (U,).
    share: None, or the ParameterShare of an ExactCDGraB that divides the products: each parameter's records go
    to its owner only (Exchange.to_owner), so a process holds every unit of its own parameters and nothing of
    the others' (its own records of them are sent, then dropped); or a share with row_splits
    (sorters.fsdp.ShardedRows(records="owners")): each process receives the rows it owns of each parameter's
    row factor (Outer's left, Formed's rows) and the rest whole, so the units' Outer and Formed contributions
    have r1 - r0 rows there.
    Per parameter, whichever is smaller per unit (`exchange_bytes`, weighed on the route's own bytes) is
    sent: its contributions' records (Outer's left (U, T, R) and right (U, T, C), Rows' int64 ids (U, T) and
    values (U, T, C), Formed's (U, R, C)), or its gradient formed per unit (U, R, C) (a wide output layer over
    many tokens, several Formed contributions). Tokens are padded with zeros to the longest process's T, which adds
    nothing to any product. Every parameter's tensors go together (`Exchange`: in buckets, one collective a
    bucket, not one or two per parameter).
    The result holds no backward gradient (step_grads): under DDP .grad is the
    processes' mean, so the running sum's update reads every unit's records."""
    def ints(values: list[int]) -> list[list[int]]:  # one process's integers -> (world_size, n), every process's
        rows: list[list[int]] = all_gather_rows(torch.tensor([values], dtype=torch.long)).tolist()
        return rows

    owner, U = units.owner, units.units
    parts = [(p, x) for p in owner.params for first, x in units.pieces.get(id(p), [])
             if first == 0 and x.units == U]
    shapes = ints([len(parts)] + [len(units.pieces.get(id(p), [])) for p in owner.params])
    if len(parts) != sum(shapes[0][1:]) or any(row != shapes[0] for row in shapes):
        raise ValueError("CDGraBSampler: the processes recorded different layers for this step (every process "
                         "must run the same model through the same layers, and hand over fresh records)")
    # the parameters whose exchange the backward started (ShardedRows(records="owners-overlapped"))
    started = {} if units.in_flight is None else units.in_flight.finish(units.pieces)
    units.in_flight = None
    rest = [(p, x) for p, x in parts if id(p) not in started]
    longest = _longest_tokens(_token_table([x for _, x in rest]))
    exchange = Exchange()
    built: dict[int, Callable[[], list[Contribution]]] = {}
    for i, p in enumerate(owner.params):
        mine: list[tuple[Contribution, int]] = [(x, T) for (q, x), T in zip(rest, longest) if q is p]
        if mine and id(p) not in started:
            built[id(p)] = _exchange_parameter(p, i, mine, U, share, units.scale.device, exchange)
    scale = exchange.gather(units.scale.reshape(-1))
    exchange.start()
    pieces: dict[int, Pieces] = {}
    for p in owner.params:  # in the parameters' order
        contributions = started[id(p)] if id(p) in started else built[id(p)]() if id(p) in built else []
        if contributions:
            pieces[id(p)] = [(0, x) for x in contributions]
    every_scale = exchange.result(scale)
    assert every_scale is not None  # (gathered to every process)
    return UnitGradients(owner, dist.get_world_size() * U, pieces, every_scale)


class Exchange:
    """The tensors of one exchange of records, sent together in buckets: per dtype, an all-gather of each
    bucket of those every process receives whole (`gather`), and an all-to-all of each bucket of those whose
    rows go to the rows' owners (`to_owners`) or that go whole to one owner (`to_owner`: a ParameterShare's
    records), not one collective per tensor, whose fixed cost and wait for the
    slowest process add up over a model's hundreds of parameters. A bucket receives at most BUCKET_BYTES (a
    tensor that receives more goes alone, with no copy where it can), so the packed copies alive at once stay
    small beside the records (DDP buckets its gradients' all-reduce the same way). Every process registers the
    same tensors (shapes and dtypes) in the same order; `start` sends them, or starts the collectives
    asynchronously; `result` gives one tensor's every-process result (once the started collectives are waited
    on).
    """

    BUCKET_BYTES = 32 * 2**20  # received by one collective at most

    def __init__(self) -> None:
        # registered: (kind "whole", "owned" or "owner", the tensor, its rows' dim (owned) or its owner's rank
        # (owner), every process's (r0, r1) (owned))
        self.items: list[tuple[str, torch.Tensor, int, list[tuple[int, int]] | None]] = []
        self.results: dict[int, torch.Tensor | None] = {}
        # started asynchronously, unpacked at the first result(): (received (world, n), [(item, at, n, shape)])
        self.unpack: list[tuple[torch.Tensor, list[tuple[int, int, int, tuple[int, ...]]]]] = []

    def gather(self, x: torch.Tensor) -> int:
        """Register x (U, ...): every process's, (world_size * U, ...) rank-major, in every process."""
        self.items.append(("whole", x, 0, None))
        return len(self.items) - 1

    def to_owner(self, x: torch.Tensor, dst: int) -> int:
        """Register x (U, ...): every process's, (world_size * U, ...) rank-major, in process `dst` only (its
        result None in the others)."""
        self.items.append(("owner", x, dst, None))
        return len(self.items) - 1

    def to_owners(self, x: torch.Tensor, dim: int, splits: list[tuple[int, int]]) -> int:
        """Register x (U, ..., R, ...), R on `dim`: every process's U units of this process's rows
        r0..r1-1 = splits[rank], (world_size * U, ..., r1 - r0, ...) rank-major (splits: every process's
        (r0, r1), rank-major, the same in every process)."""
        self.items.append(("owned", x, dim, splits))
        return len(self.items) - 1

    def start(self, works: list[tuple[dist.Work, torch.Tensor]] | None = None) -> None:
        """Send everything registered, bucket by bucket. works: None (done on return, each bucket unpacked
        before the next is sent), or the list the started collectives go to (as all_gather_rows')."""
        world, rank = dist.get_world_size(), dist.get_rank()
        for kind, bucket in self._buckets(world, rank):
            if kind == "whole" and len(bucket) == 1:  # gathered straight into its result
                i = bucket[0]
                self.results[i] = all_gather_rows(self.items[i][1], works)
                continue
            mine = [i for i in bucket if self._sent_to(i, rank) is not None]  # the items received here
            places, at = [], 0
            for i in mine:
                shape = self._received_shape(i, rank)
                places.append((i, at, math.prod(shape), shape))
                at += math.prod(shape)
            if kind == "whole":
                send = _packed([self.items[i][1] for i in bucket], self.items[bucket[0]][1].device)
                received = all_gather_rows(send[None], works)
            else:  # rank-major: what goes to process 0, then to process 1, ...
                parts = [[part for i in bucket if (part := self._sent_to(i, q)) is not None] for q in range(world)]
                device = self.items[bucket[0]][1].device
                send = _packed([part for q_parts in parts for part in q_parts], device, self.items[bucket[0]][1].dtype)
                received = torch.empty(world, at, dtype=send.dtype, device=send.device)
                _all_to_all(received.view(-1), send, [sum(part.numel() for part in q_parts) for q_parts in parts],
                            [at] * world, works)
            for i in bucket:
                if i not in mine:  # sent to its owner, not kept here
                    self.results[i] = None
            if works is None:
                self._unpacked(received, places)
            else:
                self.unpack.append((received, places))

    def result(self, handle: int) -> torch.Tensor | None:
        """A registered tensor's every-process result (after start, and after its collectives' works are
        waited on); None for a tensor sent to another process's ownership (`to_owner`)."""
        for received, places in self.unpack:
            self._unpacked(received, places)
        self.unpack = []
        return self.results[handle]

    def _unpacked(self, received: torch.Tensor, places: list[tuple[int, int, int, tuple[int, ...]]]) -> None:
        """Each item of a received bucket (world, n) into its result, (world * U, ...): a view when the bucket
        holds it alone, else a copy into one buffer of the bucket's size that holds all its items' results
        (the received bucket is then dropped). A step's exchange thus keeps a few large blocks, which the
        allocator hands back whole when the step drops them (glibc maps large blocks apart), not many small
        ones that would stay in the heap between the holes of the next forward's tensors."""
        world = received.shape[0]
        if len(places) == 1:
            i, at, n, shape = places[0]
            self.results[i] = received.view((world * shape[0],) + shape[1:])
            return
        results = torch.empty(received.numel(), dtype=received.dtype, device=received.device)
        for i, at, n, shape in places:
            result = results[world * at:world * (at + n)]
            result.view(world, n).copy_(received[:, at:at + n])
            self.results[i] = result.view((world * shape[0],) + shape[1:])

    def _sent_to(self, i: int, q: int) -> torch.Tensor | None:
        """What item i sends process q: a whole tensor all of it, an owned one q's rows of it (a view), one to
        an owner all of it if q owns it, else None."""
        kind, x, dim, splits = self.items[i]
        if kind == "owned" and splits is not None:
            return _rows(x, dim, splits[q])
        return x if kind == "whole" or dim == q else None  # (an owner item's dim holds its owner's rank)

    def _received_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """The shape item i arrives in from one process: whole, or this process's rows on its dim."""
        kind, x, dim, splits = self.items[i]
        if kind != "owned" or splits is None:
            return tuple(x.shape)
        r0, r1 = splits[rank]
        return tuple(r1 - r0 if k == dim else size for k, size in enumerate(x.shape))

    def _buckets(self, world: int, rank: int) -> list[tuple[str, list[int]]]:
        """The registered items in buckets of one kind and dtype, in the order of registration, each receiving
        at most BUCKET_BYTES (an item that receives more: a bucket of its own)."""
        open_buckets: dict[tuple[str, torch.dtype], tuple[list[int], int]] = {}
        buckets: list[tuple[str, list[int]]] = []
        for i, (kind, x, _, _) in enumerate(self.items):
            size = world * math.prod(self._received_shape(i, rank)) * x.element_size()  # (as its owner gets it)
            key = (kind, x.dtype)
            bucket, filled = open_buckets.get(key, ([], 0))
            if bucket and filled + size > self.BUCKET_BYTES:
                buckets.append((kind, bucket))
                bucket, filled = [], 0
            open_buckets[key] = (bucket + [i], filled + size)
        buckets.extend((kind, bucket) for (kind, _), (bucket, _) in open_buckets.items())
        return buckets


def _rows(x: torch.Tensor, dim: int, span: tuple[int, int]) -> torch.Tensor:
    """x's rows span = (r0, r1) on dim, r0..r1-1 (a view)."""
    return x.narrow(dim, span[0], span[1] - span[0])


def _packed(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The parts one after the other in one flat tensor (one copy of each; dtype: theirs, given when there may
    be none)."""
    send = torch.empty(sum(part.numel() for part in parts), dtype=dtype or parts[0].dtype, device=device)
    at = 0
    for part in parts:
        send[at:at + part.numel()].view(part.shape).copy_(part)
        at += part.numel()
    return send


def _token_table(contributions: list[Contribution],
                 works: list[tuple[dist.Work, torch.Tensor]] | None = None) -> torch.Tensor:
    """(world_size, 2 n) long: every process's kind and token count T of each of its n contributions (every
    process hands over the same kinds in the same order), one small all-gather (works: as all_gather_rows')."""
    kinds = [(0 if isinstance(x, Outer) else 1 if isinstance(x, Rows) else 2, x.tokens) for x in contributions]
    return all_gather_rows(torch.tensor([[value for kind in kinds for value in kind]], dtype=torch.long), works)


def _longest_tokens(table: torch.Tensor, work: dist.Work | None = None) -> list[int]:
    """Per contribution of a `_token_table` (waited for first: its started collective's `work`), the longest
    process's T; contributions of different kinds in the processes are refused."""
    if work is not None:
        work.wait()
    every = table.tolist()
    if any(row[0::2] != every[0][0::2] for row in every):
        raise ValueError("CDGraBSampler: the processes' layer records are of different kinds for this step")
    return [max(row[2 * i + 1] for row in every) for i in range(len(every[0]) // 2)]


def _exchange_parameter(p: torch.Tensor, i: int, mine: list[tuple[Contribution, int]], U: int,
                        share: "ParameterShare | None", device: torch.device,
                        exchange: Exchange) -> Callable[[], list[Contribution]]:
    """Parameter p's (exact.params[i]) contributions of this process's U units, each with the longest process's
    token count [(contribution, T)] -> a callable that returns its contributions of every process's
    world_size * U units here (none in a process a ParameterShare does not send p to), by the route of
    all_gather_units: its tensors registered in `exchange` (call it once the exchange is done), or, to the
    owner of p alone (a ParameterShare that gathers to owners), sent now."""
    dst = None if share is None or not share.gathers_to_owners else share.owners[i]
    splits = None if share is None or share.row_splits is None else share.row_splits[i]

    # on the owners route the choice weighs what that route sends: a formed gradient's rows go to their owners
    rows = None if splits is None else max(r1 - r0 for r0, r1 in splits)
    records, formed = exchange_bytes(p, [x for x, _ in mine], [T for _, T in mine], rows)
    if formed < records:  # the same choice in every process: it depends on the longest T only
        out = torch.zeros((U,) + matrix_shape(p), dtype=p.dtype, device=device)
        for x, _ in mine:
            x.add_rows(out, 0, out.shape[1])
        mine = [(Formed(out), 1)]
    def whole(x: torch.Tensor) -> int:  # to every process, or to p's owner alone
        return exchange.gather(x) if dst is None else exchange.to_owner(x, dst)

    def rows_of(x: torch.Tensor, dim: int) -> int:
        return exchange.to_owners(x, dim, splits) if splits is not None else whole(x)

    # per contribution its kind, the handles of its tensors in the exchange, and an embedding's row count;
    # tokens padded with zeros to the longest process's T before they are sent
    plan: list[tuple[type, list[int], int]] = []
    for x, T in mine:
        if isinstance(x, Outer):  # left (U, T, R): the rows are its columns
            plan.append((Outer, [rows_of(padded(x.left, T), 2), whole(padded(x.right, T))], 0))
        elif isinstance(x, Rows):
            plan.append((Rows, [whole(padded(x.ids, T)), whole(padded(x.values, T))], x.num_rows))
        else:  # (U, R, C)
            plan.append((Formed, [rows_of(x.values, 1)], 0))

    def build() -> list[Contribution]:  # (none in a process that does not own p: it keeps nothing of it)
        built: list[Contribution] = []
        for kind, handles, num_rows in plan:
            got = [exchange.result(handle) for handle in handles]
            if any(x is None for x in got):
                continue
            tensors = cast(list[torch.Tensor], got)
            built.append(Outer(tensors[0], tensors[1]) if kind is Outer
                         else Rows(tensors[0], tensors[1], num_rows) if kind is Rows else Formed(tensors[0]))
        return built
    return build


class OverlappedExchange:
    """The owners' route (sorters.fsdp.ShardedRows) started inside the backward (records="owners-overlapped"):
    ExactRecording tells it of every recorded layer call (`forward_call`) and of every output gradient taken
    (`layer_done`); as soon as the last call that records a parameter has had its output gradient, that
    parameter's records go to the rows' owners by asynchronous collectives (`_exchange_parameter`), which run
    while the backward goes on (FSDP reduce-scatters the layer's gradient then too). Their token counts are
    agreed with the other processes first (`_token_table`), asynchronously too: a layer call's parameters are
    sent at the next call's output gradient, when the other processes' counts have had a layer's backward to
    arrive (not a wait for the slowest process at every parameter). all_gather_units waits for
    them (`finish`) and exchanges the rest as the owners' route does: the same records, so the same products
    and orders.

    Which parameters a layer's call records is learned from the steps before (the first step starts nothing in
    the backward, nor a step whose forward calls a recorded layer no step called before); a parameter that got
    more records after its start (a layer calls it otherwise than before) is exchanged again after the
    backward. Every process runs the same model through the same layers, so they start the same collectives in
    the same order.

    Args:
        share: the ShardedRows share (row_splits set) the records are routed by.
    """

    def __init__(self, share: "ParameterShare") -> None:
        self.share = share
        self.index = {id(p): i for i, p in enumerate(share.params)}
        self.records_of: dict[torch.nn.Module, dict[int, int]] = {}  # a layer -> {id(p): records a call adds}
        self.begin()

    def begin(self) -> None:
        """A new recording: no call counted, nothing started."""
        self.calls: dict[torch.nn.Module, int] = {}  # the forward's calls of each recorded layer
        self.expected: dict[int, int] | None = None  # id(p) -> the records the step will give it (learned)
        self.arrived: dict[int, int] = {}
        # id(p) -> (its records' list, their number then, its contributions exchanged: once the works are done)
        self.started: dict[int, tuple[Pieces, int, Callable[[], list[Contribution]]]] = {}
        self.works: list[tuple[dist.Work, torch.Tensor]] = []
        # the parameters whose token counts are being agreed: (id(p), its records' list, their contributions, the
        # _token_table, its collective), sent at the next layer_done or at finish
        self.agreeing: list[tuple[int, Pieces, list[Contribution], torch.Tensor, tuple[dist.Work, torch.Tensor]]] = []
        self.units = 0

    def forward_call(self, module: torch.nn.Module) -> None:
        """A recorded layer's call in the forward (its output gradient will come)."""
        self.calls[module] = self.calls.get(module, 0) + 1

    def layer_done(self, module: torch.nn.Module, added: dict[int, int], pieces: dict[int, Pieces], U: int) -> None:
        """A layer call's records taken: added {id(p): records it added}; pieces the recording's so far, of U
        units. Starts the exchange of every parameter whose records are all in."""
        if self.expected is None:  # the backward's first output gradient: the forward's calls are all counted
            self.expected = {}
            if all(m in self.records_of for m in self.calls):
                for m, n in self.calls.items():
                    for key, per_call in self.records_of[m].items():
                        self.expected[key] = self.expected.get(key, 0) + n * per_call
        self.records_of[module] = added
        self._send_agreed()  # the previous call's parameters
        self.units = U
        for key, count in added.items():
            self.arrived[key] = self.arrived.get(key, 0) + count
            if key not in self.started and key in self.index and self.arrived[key] == self.expected.get(key):
                records = pieces[key]
                fresh = [x for first, x in records if first == 0 and x.units == U]
                if len(fresh) == len(records):  # (else left to all_gather_units, which checks the records)
                    works: list[tuple[dist.Work, torch.Tensor]] = []
                    table = _token_table(fresh, works)
                    self.agreeing.append((key, records, fresh, table, works[0]))
                    self.started[key] = (records, len(records), list)  # (its contributions once sent)

    def _send_agreed(self) -> None:
        """Start the exchange of the parameters whose token counts were being agreed, in the order they came."""
        for key, records, fresh, table, (work, _sent) in self.agreeing:
            i = self.index[key]
            mine = list(zip(fresh, _longest_tokens(table, work)))
            device = (fresh[0].left if isinstance(fresh[0], Outer) else fresh[0].values).device
            exchange = Exchange()  # the parameter's tensors: one all-gather and one all-to-all per dtype
            built = _exchange_parameter(self.share.params[i], i, mine, self.units, self.share, device, exchange)
            exchange.start(self.works)
            self.started[key] = (records, len(fresh), built)
        self.agreeing = []

    def finish(self, pieces: dict[int, Pieces]) -> dict[int, list[Contribution]]:
        """Wait for the started collectives: {id(p): p's contributions of every process's units} of the
        parameters whose records (pieces: the units handed over) are the ones sent, the same records (not
        another recording's) and no more; then a new recording."""
        self._send_agreed()
        for work, _sent in self.works:
            work.wait()
        done = {key: built() for key, (records, count, built) in self.started.items()
                if pieces.get(key) is records and len(records) == count}
        self.begin()
        return done


class ParameterShare:
    """Which selected parameters of an ExactGradients this process takes the products and the running sum's
    update of, when every process holds every unit (all-gathered) under torch.distributed (ExactCDGraB(share=)).

    Each parameter has one owner: the parameters, largest first (numel: the products' work grows with R x C),
    go one by one to the process with the least work so far (the lowest rank among equals), so every process
    makes the same split from the same model. owned: [bool] per parameter of exact.params; work: numel per
    process; size: the owned numel, the length of this process's part of a flat (d,) vector (the running sum:
    view, part, whole). reduce(x): x summed over the processes in place (all_reduce) and returned; a test
    passes its own. gathers_to_owners: all_gather_units sends each parameter's records to its owner only (a
    share whose processes each own rows of every parameter, sorters.fsdp.ShardedRows, gathers them to all).
    keeps_unit_sums: ExactCDGraB keeps each owned parameter's sum over the step's units for the update (sum_all).
    row_splits: None here (ShardedRows(records="owners"): per parameter every process's rows, which
    all_gather_units sends each process only)."""

    gathers_to_owners = True
    row_splits: list[list[tuple[int, int]]] | None = None
    # ExactCDGraB's sum_all under this share: each owned parameter's sum over the step's units, kept from the
    # products' blocks for the update (d / P floats more during a step, about half the update's products fewer)
    keeps_unit_sums = True

    def __init__(self, exact: ExactGradients, rank: int | None = None, world: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        rank = dist.get_rank() if rank is None else rank
        world = dist.get_world_size() if world is None else world
        if not 0 <= rank < world:
            raise ValueError(f"ParameterShare: rank {rank} is not one of world size {world}'s")
        sizes = [p.numel() for p in exact.params]
        self.offsets, self.params = exact.offsets, exact.params
        self.work, owners = [0] * world, [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            owners[i] = min(range(world), key=lambda q: (self.work[q], q))
            self.work[owners[i]] += sizes[i]
        self.owners, self.rank = owners, rank
        self.owned = [owner == rank for owner in owners]
        self._reduce = reduce
        # the owned parameters, one after the other, make this process's part of a flat (d,) vector
        self.part_offsets: dict[int, int] = {}
        self.size = 0
        for p, owned in zip(self.params, self.owned):
            if owned:
                self.part_offsets[id(p)], self.size = self.size, self.size + p.numel()

    def broadcast_grads(self, grads: dict[int, torch.Tensor], recorded: list[bool], factor: float) -> None:
        """Every recorded parameter's step gradient from its owner to every process, added to p.grad times
        `factor` (1 / world size: the processes' mean, as DDP's all-reduce makes it). grads: {id(p): (R, C)}, this
        process's owned parameters' gradients (UnitGradients.grad_sink); recorded: per parameter, whether the
        step has records of it (every process alike)."""
        for p, owner, has in zip(self.params, self.owners, recorded):
            if not has:
                continue
            if owner == self.rank:
                grad = (grads[id(p)] * factor).to(p.dtype).reshape(p.shape).contiguous()
            else:
                grad = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            dist.broadcast(grad, src=owner)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the processes, in place (all_reduce, or the `reduce` given), and returned."""
        if self._reduce is not None:
            return self._reduce(x)
        dist.all_reduce(x)
        return x

    def restrict(self, p: torch.Tensor, pieces: Pieces) -> Pieces:
        """An owned parameter's contributions as this process takes their products: all of them (it owns every
        row; sorters.fsdp.ShardedRows keeps its rows' part of each)."""
        return pieces

    def restrict_grad(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """An owned parameter's step gradient as this process adds it: all of it (ShardedRows: its rows)."""
        return grad

    def view(self, part: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """An owned parameter p's (R, C) slice of this process's part (size,) (ExactGradients.view's)."""
        start = self.part_offsets[id(p)]
        return part[start:start + p.numel()].view(matrix_shape(p))

    def part(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat (..., d) tensor's entries of the owned parameters, (..., size), a copy."""
        return torch.cat([flat[..., self.offsets[id(p)]:self.offsets[id(p)] + p.numel()]
                          for p, owned in zip(self.params, self.owned) if owned] or [flat[..., :0]], -1)

    def whole(self, part: torch.Tensor, d: int) -> torch.Tensor:
        """This process's part (..., size) placed in a flat (..., d) tensor of zeros (part()'s inverse)."""
        flat = part.new_zeros(part.shape[:-1] + (d,))
        for p, owned in zip(self.params, self.owned):
            if owned:
                start = self.part_offsets[id(p)]
                flat[..., self.offsets[id(p)]:self.offsets[id(p)] + p.numel()] = part[..., start:start + p.numel()]
        return flat


def gather_parts(parts: list[UnitGradients], distributed: bool, share: ParameterShare | None = None) -> UnitGradients:
    """This process's units, recorded in parts (each a fresh recording of the same layers: the engine's
    chunks of a step), -> every process's units, rank-major and within a rank part after part, as one
    UnitGradients: each part is all-gathered on its own (`all_gather_units`) when `distributed`, and every
    process's share of it placed at its units (views, no concatenation: the records are not copied in one
    process). With a ParameterShare each parameter's records go to its owner only. Every process hands over
    parts of the same sizes. One process hosting all ranks' units in these
    parts gets the same contributions over the same ranges of units, so the same products."""
    world = dist.get_world_size() if distributed else 1
    local = sum(part.units for part in parts)
    owner = parts[0].owner
    pieces: dict[int, Pieces] = {}
    scale = torch.empty(world * local, dtype=parts[0].scale.dtype, device=parts[0].scale.device)
    offset = 0
    for part in parts:
        every = all_gather_units(part, share) if distributed else part
        size = part.units
        for key, contributions in every.pieces.items():
            for _first, x in contributions:  # fresh: first 0, every unit of the (gathered) part
                for rank in range(world):
                    ranks_units = x if world == 1 else x.units_slice(rank * size, (rank + 1) * size)
                    pieces.setdefault(key, []).append((rank * local + offset, ranks_units))
        for rank in range(world):
            scale[rank * local + offset:rank * local + offset + size] = every.scale[rank * size:(rank + 1) * size]
        offset += size
    return UnitGradients(owner, world * local, pieces, scale)


def padded(x: torch.Tensor, T: int) -> torch.Tensor:
    """x (U, t, ...) with zero tokens appended up to T (an id of 0 pointing at a zero value adds nothing)."""
    if x.dim() < 2 or x.shape[1] >= T:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], T - x.shape[1]) + tuple(x.shape[2:]))], 1)


def records_bytes(parts: list[UnitGradients]) -> int:
    """Bytes `all_gather_units` sends for these fresh parts' units from ONE process: per part and parameter
    the smaller of its records and its per-unit gradient (`exchange_bytes`), times the part's units."""
    total = 0
    for part in parts:
        for p in part.owner.params:
            xs = [x for _, x in part.pieces.get(id(p), [])]
            if xs:
                total += min(exchange_bytes(p, xs, [x.tokens for x in xs])) * part.units
    return total


def exchange_bytes(p: torch.Tensor, contributions: list[Contribution], tokens: list[int],
                   rows: int | None = None) -> tuple[int, int]:
    """(records, formed): bytes PER UNIT that one process receives from another when parameter p's contributions
    (sorters/exact_products.py) with these token counts go as records, or as p's gradient formed. Outer: T (R + C)
    entries; Rows: T int64 ids and T x C entries; Formed: R x C entries; formed: R x C entries. rows: None (every
    process receives whole records), or the rows of p's dim 0 a process receives on ShardedRows' "owners" route
    (ceil(R / P)): an Outer's row factor (its left) and a formed gradient count that many rows instead of R, an
    embedding's Rows stay whole (which rows a token touches depends on its id)."""
    size = p.element_size()
    R, C = matrix_shape(p)
    R_received = R if rows is None else rows
    records = 0
    for x, T in zip(contributions, tokens):
        if isinstance(x, Outer):
            records += T * ((x.left.shape[2] if rows is None else rows) + x.right.shape[2]) * size
        elif isinstance(x, Rows):
            records += T * (8 + x.values.shape[2] * size)
        else:
            records += R_received * C * size
    return records, R_received * C * size
