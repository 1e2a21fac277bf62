r"""Exact CD-GraB without holding the per-example gradients: each step's units are kept as the layer
records of one batched forward and backward, and the sorter takes only their products (issue #47).

    exact = ExactGradients(model)                               # every trainable parameter
    sorter = ExactCDGraB(n_workers=1, m=len(data), d=exact.d)    # the orders of sorters.CDGraB
    orders = sorter.sort()
    for positions, (x, y) in batches:                           # k examples per worker and step
        units = exact(lambda: F.cross_entropy(model(x), y, reduction="none"))   # (B,) per-example losses
        sorter.step(units, positions)                            # the signs, then S += sum_u w_u g_u

    with exact.recording() as rec:                               # a loop with its own backward (HF Trainer)
        losses = per_example_losses(model(x)); rec.watch(losses)
    loss.backward(); sorter.step(rec.units(), positions)

Why products are enough. Within an epoch CD-GraB signs the pair difference v_i = g_first - g_second by
<S_i, v_i>, S_i = S + sum_{j<i} sign_j v_j the signed sum of the earlier differences, S the sum at the
step's start. So <S_i, v_i> = <S, v_i> + sum_{j<i} sign_j <v_j, v_i>, and the step needs only
(a) <S, g_u> and (b) <g_u, g_v> for its units, then (c) S += sum_u w_u g_u with w = the signs spread on
the pairs' units (+sign on the first, -sign on the second). sorters/exact_products.py gets (a), (b)
and (c) parameter by parameter, streaming or by the ghost formulas; ExactCDGraB asks for the products of
the pairs' differences directly (exact_products.Pairs: their Gram from each streamed block).

The pending unit. With k odd a pair spans two steps: its first unit's gradient is needed in the next
step. Instead of its (d,) gradient the sorter keeps that unit's records (one example's layer inputs and
output gradients, with its loss weight; with k = 1 the step's records themselves, no copy), and the next
step's products include it as one more unit.
A checkpoint stores it formed, (n, d) as CDGraB does; a resumed sorter hands those rows to its next step
as one Formed contribution per parameter (ExactGradients.formed_units), so it resumes at any position.

The running sum S is (d,) in `dtype` (float32 by default: float64 for a 124M model is ~1 GiB, more than
the memory the issue allows). Its products are accumulated in float64. Where rounding may decide a
sign, |<S_i, v_i>| <= NEAR_TIE * ||S_i|| * (||g_first|| + ||g_second||), the step counts a near-tie
(`near_ties`, over the run); everywhere else the signs are those of CDGraB fed the formed gradients.
"""
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.hooks import RemovableHandle

from sorters.balance import gram_signs
from sorters.base import PairBalancer
from sorters.checks import NonFiniteGradientError, check_module, check_no_dropout
from sorters.exact_products import (
    ContributionSink,
    Formed,
    Pairs,
    Pieces,
    add_weighted,
    matrix_shape,
    parameter_products,
    summed,
)
from sorters.layer_rules import AliasSink, Layout, apply_rule, examples_of_call, spread_over_examples, tokens
from sorters.layer_sketch import selected_parameters

if TYPE_CHECKING:  # sorters.gather imports this module (named in full: the reference shows the annotations)
    import sorters.gather

__all__ = ["ExactGradients", "ExactRecording", "UnitGradients", "ExactCDGraB", "NEAR_TIE"]

NEAR_TIE = 1e-5


class UnitGradients:
    """The gradients of U units, never formed whole: per selected parameter (by id), a list of
    (first unit, contribution) whose sum is the units' gradients; `scale` (U,): each unit's records hold
    scale_u times its gradient (the loss weight of a training loop's own backward).

    step_grads: None, or {id(p): this backward's gradient of p (R, C)}, the sum of the records of units
    0..step_units-1: add_to() then takes sum_u w_u g_u as lam * that gradient plus the records of the units
    whose w_u / scale_u differs from lam (the most common ratio; with equal loss weights, one unit of each
    pair), half the products of the records.
    writes_grads: the backward skipped the selected parameters' weight gradients (ExactGradients.recording
    (write_grads=True)): products() takes them from the blocks it forms anyway, stores them in step_grads and
    adds them to p.grad; write_grads() does it for the parameters products() did not reach.
    grad_sink: None, or a callable (p, grad (R, C)) that receives those gradients instead of p.grad (units
    gathered from several processes: sorters.sampler hands them to their owners' broadcast).

    Args:
        owner: the `ExactGradients` whose parameters the records are of.
        units: U, the number of units.
        pieces: id(parameter) -> its contributions, [(first unit, contribution)] (sorters/exact_products.py).
        scale: (U,) each unit's loss weight, the factor of its gradient in its records.
        step_grads: None, or id(parameter) -> this backward's (R, C) gradient of it (above).
        step_units: the units 0..step_units-1 whose records sum to step_grads.
        writes_grads: the backward skipped the selected parameters' weight gradients (above).
        grad_sink: None, or the callable that receives them instead of ``p.grad`` (above).
    """

    def __init__(self, owner: "ExactGradients", units: int, pieces: dict[int, Pieces], scale: torch.Tensor,
                 step_grads: dict[int, torch.Tensor | None] | None = None, step_units: int = 0,
                 writes_grads: bool = False,
                 grad_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.owner, self.units, self.pieces, self.scale = owner, units, pieces, scale
        self.step_grads, self.step_units, self.writes_grads = step_grads, step_units, writes_grads
        self.sum_all, self.grad_sink = False, grad_sink
        # the exchange the backward started of these (fresh) units' records, which all_gather_units finishes
        self.in_flight: sorters.gather.OverlappedExchange | None = None

    def products(self, running_sum: torch.Tensor, how: str | None = None, pairs: Pairs | None = None,
                 share: "sorters.gather.ParameterShare | None" = None,
                 riders: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The units' inner products with the running sum and with each other, summed over the parameters on
        the running sum's device, then copied to the host once (not a synchronisation per parameter).

        sum_all: units that come without the backward's gradient (step_grads None) keep, from the blocks
        streaming forms anyway, the sum of every unit's records per parameter, for add_to's shortcut.
        Either way the parameters' products are added in their order, so every process and one process
        without a share get the same bits.

        Args:
            running_sum: S, flat (d,) (with a share: (share.size,), this process's parameters).
            how: ``"stream"``, ``"ghost"``, or None: per parameter the cheaper (sorters/exact_products.py).
            pairs: None, or the pairs (``sorters.exact_products.Pairs``) whose differences g_first - g_second
                the products are taken of.
            share: None (every parameter here), or a ``sorters.gather.ParameterShare``: this process takes the
                products of the parameters it owns only; each parameter's products, from its one owner, are
                summed over the processes (share.reduce, exact: the others add zeros).
            riders: None, or a float64 (k,) tensor of this process's partial sums that ride in the same
                collective as the products (with a share): replaced in place by their sums over the processes
                (ExactCDGraB: ||S||^2 of its parts, one all-reduce a step instead of two).

        Returns:
            float64 tensors on the CPU: without pairs (a, G), a (U,) <S, g_u> and G (U, U) <g_u, g_v>; with
            pairs (a, G, norms), a (r,) and G (r, r) of the r differences and norms (U,) the units' squared
            norms ||g_u||^2.
        """
        U, r = self.units, self.units if pairs is None else len(pairs.firsts)
        width = r + r * r + (U if pairs is not None else 0)
        rows = torch.zeros(len(self.owner.params), width, dtype=torch.float64,
                           device=running_sum.device)  # per parameter: its a, G (and norms), flattened
        sums: dict[int, torch.Tensor | None] | None = None  # sum_all's per-parameter sums, being taken
        if self.sum_all and self.step_grads is None:
            sums = self.step_grads = {}
            self.step_units = U
        step_grads = self.step_grads
        self.owner.last_how = {}
        for i, p in enumerate(self.owner.params):
            pieces = self.pieces.get(id(p), [])
            if not pieces or (share is not None and not share.owned[i]):
                continue
            if share is not None:  # sorters.fsdp.ShardedRows: the rows of p this process owns
                pieces = share.restrict(p, pieces)
            # (writes_grads: units() gave step_grads, empty)
            writes = self.writes_grads and step_grads is not None and id(p) not in step_grads \
                and id(p) not in self.owner.formed_ids
            wanted = U if sums is not None else self.step_units if writes else 0
            *products, chosen, grad = parameter_products(pieces, (share or self.owner).view(running_sum, p), U, how,
                                                         wanted, pairs)
            if sums is not None:
                sums[id(p)] = grad
            elif grad is not None:
                self._keep_grad(p, grad)
            rows[i] = torch.cat([x.reshape(-1) for x in products])
            self.owner.last_how[id(p)] = chosen
        if share is not None:  # one collective: the partials, the riders after them
            flat = rows.reshape(-1) if riders is None else torch.cat([rows.reshape(-1), riders.to(rows.device)])
            flat = share.reduce(flat)
            rows = flat[:rows.numel()].view_as(rows)
            if riders is not None:
                riders.copy_(flat[rows.numel():])
        total = torch.zeros(width, dtype=torch.float64, device=running_sum.device)
        for row in rows:  # in the parameters' order
            total += row
        a, G, norms = total[:r], total[r:r + r * r].view(r, r), total[r + r * r:]
        if pairs is not None:  # in gradients already (Pairs divides by the scale)
            return tuple(x.cpu() for x in (a, G, norms))
        scale = self.scale.to(a.device, torch.float64)
        both = torch.cat([(a / scale)[:, None], G / scale[:, None] / scale[None, :]], 1).cpu()  # (U, 1 + U)
        return both[:, 0].contiguous(), both[:, 1:].contiguous()

    def write_grads(self) -> None:
        """With ``writes_grads``, add this backward's gradient to ``p.grad`` for every parameter ``products``
        did not reach (a step without pairs), one product per contribution; else nothing."""
        if not self.writes_grads:
            return
        step_grads = self.step_grads
        assert step_grads is not None, "writes_grads comes with step_grads (ExactRecording.units)"
        for p in self.owner.params:  # a formed parameter's .grad is autograd's (it kept requiring grad)
            if id(p) not in step_grads and id(p) not in self.owner.formed_ids and self.pieces.get(id(p)):
                R, C = matrix_shape(p)
                self._keep_grad(p, summed(self.pieces[id(p)], R, C, self.step_units, p.dtype, p.device))

    def _keep_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """grad (R, C), this backward's gradient of p: into step_grads and p.grad (which it becomes when None)."""
        grad = grad.to(p.dtype)
        assert self.step_grads is not None, "a gradient is kept only with step_grads (writes_grads)"
        self.step_grads[id(p)] = grad
        if self.grad_sink is not None:
            self.grad_sink(p, grad)
        elif p.grad is None:
            p.grad = grad.view(p.shape)
        else:
            p.grad.add_(grad.view(p.shape))

    def add_to(self, running_sum: torch.Tensor, w: torch.Tensor,
               share: "sorters.gather.ParameterShare | None" = None) -> None:
        """Add a weighted sum of the units' gradients to a running sum, in place.

        Args:
            running_sum: (d,) S, which becomes S + sum_u w_u g_u; with a share (``products``), (share.size,), its
                owned parameters only.
            w: (U,) the units' weights.
            share: None, or the ``sorters.gather.ParameterShare`` of ``products``.
        """
        ratio = w.to(self.scale.device, torch.float64) / self.scale.double()  # weights of the records
        lam = 0.0
        step_grads = self.step_grads
        if step_grads is not None and self.step_units:
            values, counts = ratio[:self.step_units].unique(return_counts=True)
            lam = float(values[counts.argmax()])
            ratio[:self.step_units] -= lam  # exactly 0 for the units of that ratio: their records are skipped
        ratio = ratio.to(running_sum.dtype)
        self.write_grads()  # every parameter's step gradient at hand (a no-op after products())
        for i, p in enumerate(self.owner.params):
            if share is not None and not share.owned[i]:
                continue
            view = (share or self.owner).view(running_sum, p)
            pieces = self.pieces.get(id(p))
            if pieces and share is not None:
                pieces = share.restrict(p, pieces)
            if lam and pieces and step_grads is not None:  # (lam is 0 without step_grads)
                grad = step_grads.get(id(p))
                if grad is None:  # the backward's gradient not given: lam * the records' sum
                    R, C = view.shape
                    grad = summed(pieces, R, C, self.step_units, view.dtype, view.device)
                elif share is not None:  # the backward's whole gradient: this process's rows of it (ShardedRows)
                    grad = share.restrict_grad(p, grad)
                view.add_(grad.reshape(view.shape), alpha=lam)
            if pieces:
                add_weighted(pieces, view, ratio)

    def select(self, units: list[int]) -> "UnitGradients":
        """Some of the units, with their scale: per contribution, the kept units it covers in one piece (the
        records themselves when it covers exactly them, in order; else a copy of their rows).

        Args:
            units: the indices of the units kept, in the order they take.

        Returns:
            The ``len(units)`` units' `UnitGradients`.
        """
        index = torch.tensor(units, dtype=torch.long, device=self.scale.device)
        pieces: dict[int, Pieces] = {}
        for key, parts in self.pieces.items():
            for first, x in parts:
                kept = [(i, u - first) for i, u in enumerate(units) if first <= u < first + x.units]
                runs: list[tuple[int, list[int]]] = []  # (start in the result, rows of x): consecutive in both
                for i, row in kept:
                    if runs and runs[-1][0] + len(runs[-1][1]) == i and runs[-1][1][-1] + 1 == row:
                        runs[-1][1].append(row)
                    else:
                        runs.append((i, [row]))
                for start, rows in runs:
                    whole = rows == list(range(x.units))
                    taken = x if whole else x.select(torch.tensor(rows, dtype=torch.long, device=index.device))
                    pieces.setdefault(key, []).append((start, taken))
        return UnitGradients(self.owner, len(units), pieces, self.scale[index])

    def join(self, other: "UnitGradients") -> "UnitGradients":
        """These units, then another's (a step's, then the pending ones).

        Args:
            other: the units that follow, of the same `ExactGradients`.

        Returns:
            The U + U' units' `UnitGradients` (the records are not copied).
        """
        pieces = {key: list(parts) for key, parts in self.pieces.items()}
        for key, parts in other.pieces.items():
            pieces.setdefault(key, []).extend((first + self.units, x) for first, x in parts)
        return UnitGradients(self.owner, self.units + other.units, pieces, torch.cat([self.scale, other.scale]),
                             self.step_grads, self.step_units, self.writes_grads, self.grad_sink)


class ExactGradients:
    """The selected parameters of `model` and their layer rules (sorters/exact_products.py).

    Args:
        model: an nn.Module; the selected parameters of Linear, transformers Conv1D, Embedding (without
            scale_grad_by_freq) and LayerNorm layers, each used through its own forward, are recorded (every
            recorded layer's input has the examples on dim 0, or 1 there for an input the model's output
            broadcasts over its B examples: GPT-2's default (1, T) position_ids, layer_rules.spread_over_examples;
            the model is called as usual, `model(input_ids=x)`); any other
            selected parameter (Conv2d, LSTM, a bare nn.Parameter) is formed per example by a batched
            vector-Jacobian product at watch() (`formed`; the constructor warns which), as LayerSketch does.
            A BatchNorm or a dropout module (p > 0) in training mode is refused when a recording starts: each
            example's gradient must not depend on the other examples or on random masks.
        params: None (every trainable parameter) or regular expressions searched in the names.
        how: "stream", "ghost" or None (per parameter, the cheaper by the cost formula).

    Attributes:
        names: the selected parameters' names, in ``named_parameters()`` order (a tied one once).
        params: those parameters.
        d: their total number of entries, the length of the gradients the products stand for.
        offsets: each parameter's (by ``id``) first coordinate in that flat (d,) vector.
        record_dtypes: each recorded layer's (by module) dtype of its records, its parameters' dtype: records in
            another (bf16 under a mixed-precision policy or autocast) are upcast to it.
        overlapped: None, or the ``sorters.gather.OverlappedExchange`` a recording tells of its layers' calls and
            output gradients (CDGraBSampler installs it with a ShardedRows share of records="owners-overlapped").

    Raises:
        TypeError: model is not an ``nn.Module``.
        ValueError: an unknown ``how``, no parameter selected, or under fully_shard a selected parameter sharded
            by it that has no layer rule (autograd cannot form its per-example gradients there).
    """

    def __init__(self, model: torch.nn.Module, params: str | Sequence[str] | None = None,
                 how: str | None = None) -> None:
        check_module("ExactGradients", model)
        if how not in (None, "stream", "ghost"):
            raise ValueError(f"ExactGradients: how must be 'stream', 'ghost' or None, got {how!r}")
        self.model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        chosen = selected_parameters(self.model, params, "ExactGradients")
        layout = Layout(self.model, chosen)
        self.formed = [p for _, p in layout.formed]  # no layer rule: formed per example (ExactRecording.watch)
        self.formed_ids = {id(p) for p in self.formed}
        # a BatchNorm in training mode mixes the batch: an example's loss then depends on the others' inputs
        self.batch_norms = [m for m in self.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        sharded_formed = [name for name, p in layout.formed if _is_dtensor(p)]
        if sharded_formed:  # autograd.grad of a sharded parameter gets None: FSDP's forward used its gathered copy
            raise ValueError(f"ExactGradients: under fully_shard the parameters of layers without a per-layer rule "
                             f"cannot be formed per example (their gradients reach FSDP's gathered copies only): "
                             f"{', '.join(sharded_formed[:8])}; leave them out with params=, or out of fully_shard "
                             "with its ignored_params=")
        if self.formed:
            names = ", ".join(name for name, _ in layout.formed[:8])
            warnings.warn(f"ExactGradients: {len(self.formed)} selected parameter(s) "
                          f"({sum(p.numel() for p in self.formed)} entries) belong to layers without a per-layer rule "
                          f"and are formed per example: {names}" + (" ..." if len(self.formed) > 8 else ""),
                          stacklevel=2)
        self.names = [name for name, _ in chosen]
        self.params = [p for _, p in chosen]
        self.offsets, self.d, self.layers = layout.offsets, layout.d, layout.layers
        # under FSDP2 (fully_shard) a layer holds a gathered copy of its weight during the backward, not the
        # sharded parameter selected here: {id(copy): parameter} for a layer (Layout.held_copies)
        self.held_copies = layout.held_copies
        # the dtype each recorded layer's records are kept in, its parameters': under a mixed-precision policy
        # (FSDP2's MixedPrecisionPolicy, autocast) the layer runs in bf16 and its records are upcast, exactly, so
        # that the products and the running sum's update never mix dtypes (docs/fsdp.md, "fully_shard options")
        self.record_dtypes = {module: next(module.parameters(recurse=False)).dtype for module in self.layers}
        self.how = how
        self.last_how: dict[int, str] = {}  # id(parameter) -> how the last products took it
        self.overlapped: sorters.gather.OverlappedExchange | None = None

    def view(self, running_sum: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A parameter's slice of a flat vector.

        Args:
            running_sum: a flat (d,) vector.
            p: one of the selected parameters.

        Returns:
            The (R, C) view of p's entries (a vector parameter: (n, 1)).
        """
        start = self.offsets[id(p)]
        return running_sum[start:start + p.numel()].view(matrix_shape(p))

    def recording(self, write_grads: bool = False) -> "ExactRecording":
        """A recording of a loop's own forward and backward (`ExactRecording`).

        Args:
            write_grads: the backward of the forward recorded inside skips the selected parameters' weight
                gradients (they do not require grad during that forward), and UnitGradients writes them into
                .grad from its streamed blocks: about one weight-gradient pass less (see ExactRecording).

        Returns:
            The context manager: the forward inside it, ``watch(losses)``, the loop's backward, ``units()``.
        """
        return ExactRecording(self, write_grads)

    def __call__(self, losses_fn: Callable[[], torch.Tensor]) -> UnitGradients:
        """The records of a batch's examples, by one backward of the sum of their losses
        (torch.autograd.grad: no .grad is touched).

        Args:
            losses_fn: runs the batched forward and returns the (B,) per-example losses.

        Returns:
            The B units' gradients as records (`UnitGradients`).

        Raises:
            ValueError: losses that are not a (B,) tensor attached to the graph, a BatchNorm or a dropout module
                in training mode, or an input without the B examples on dim 0.
        """
        with self.recording() as rec:
            losses = losses_fn()
            rec.watch(losses)
        grads = torch.autograd.grad(losses.sum(), self.params, allow_unused=True)
        units = rec.units()
        units.step_grads = {id(p): g for p, g in zip(self.params, grads)}
        units.step_units = units.units
        return units

    def formed_units(self, rows: torch.Tensor) -> UnitGradients:
        """The units whose gradients are the rows of a formed tensor (``flat``'s inverse): per parameter one
        Formed contribution, its (U, R, C) slice of the rows in the parameter's dtype and device, scale 1. A
        parameter whose slice is all zero (no gradient) gets none, as records give none.

        Args:
            rows: (U, d) the units' gradients.

        Returns:
            The U units' `UnitGradients`.

        Raises:
            ValueError: rows of another shape.
        """
        if rows.dim() != 2 or rows.shape[1] != self.d:
            raise ValueError(f"ExactGradients: formed_units() takes (U, d={self.d}) gradients, got {tuple(rows.shape)}")
        pieces: dict[int, Pieces] = {}
        for p in self.params:
            start = self.offsets[id(p)]
            values = rows[:, start:start + p.numel()].to(p.device, p.dtype)
            if bool(values.ne(0).any()):
                pieces[id(p)] = [(0, Formed(values.reshape(len(rows), *matrix_shape(p))))]
        first = self.params[0]
        return UnitGradients(self, len(rows), pieces, torch.ones(len(rows), dtype=first.dtype, device=first.device))

    def flat(self, units: UnitGradients) -> torch.Tensor:
        """The units' gradients formed (for tests and small models).

        Args:
            units: U units of this `ExactGradients`.

        Returns:
            (U, d) their gradients, in the parameters' dtype, on the CPU.
        """
        out = torch.zeros(units.units, self.d, dtype=self.params[0].dtype)
        for u in range(units.units):
            w = torch.zeros(units.units, dtype=torch.float64)
            w[u] = 1.0
            units.add_to(out[u], w)
        return out


class ExactRecording:
    """ExactGradients.recording(): the forward inside the block, watch(losses), the loop's backward,
    then units(). A call's contributions are taken when its output gradient arrives; its input is
    kept until then (autograd keeps it too).

    write_grads: inside the block the selected parameters do not require grad, so autograd builds no
    weight-gradient products for them (the layers' input gradients only); a recorded layer whose output
    then needs no gradient (a first layer: an embedding of ids) gives a fresh leaf that does, so that its
    output gradient still arrives. The sum of the units' records is the parameters' gradient:
    UnitGradients.products() and write_grads() put it into .grad (added to what is there).

    Args:
        owner: the `ExactGradients` whose layers are recorded.
        write_grads: as above.
    """

    def __init__(self, owner: ExactGradients, write_grads: bool = False) -> None:
        self.owner, self.fresh = owner, False
        self.handles: list[RemovableHandle] = []
        self.pieces: dict[int, Pieces] = {}
        self.scale: torch.Tensor | None = None  # (B,) the loss's gradient in each watched loss
        self.B: int | None = None
        self.selected = {id(p) for p in owner.params}
        self.write_grads, self.active = write_grads, True
        self.turned_off: list[torch.Tensor] = []
        self.formed_grads: dict[int, torch.Tensor] = {}
        self.examples: int | None = None  # the examples of the model's current call (examples_of_call), at its forward
        self.exchange: sorters.gather.OverlappedExchange | None = None  # owner.overlapped, while recording

    def __enter__(self) -> "ExactRecording":
        if any(m.training for m in self.owner.batch_norms):
            raise ValueError("ExactGradients: a BatchNorm in training mode mixes the examples of a batch, so their "
                             "own gradients are not what one backward records; put it in eval mode (model.eval() "
                             "for its statistics) or use GroupNorm / LayerNorm")
        check_no_dropout("ExactGradients", self.owner.model)

        # the model's call: how many examples a broadcast input serves
        def count_examples(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.examples = examples_of_call(args, kwargs)

        def record(module: torch.nn.Module, args: tuple[Any, ...], output: object) -> torch.Tensor | None:
            if not isinstance(output, torch.Tensor):
                return None
            if self.turned_off and not output.requires_grad and torch.is_grad_enabled():
                output = output.detach().requires_grad_()
            if output.requires_grad:
                if self.exchange is not None:
                    self.exchange.forward_call(module)
                a, output = spread_over_examples(args[0].detach(), output, self.examples)  # (1, T) ids: (B, T)
                entry: list[Any] = [module, a]  # [the layer, its input (None once taken)]
                output.register_hook(lambda g, entry=entry: self._on_grad(entry, g))
            return output

        self.exchange = self.owner.overlapped  # the records' exchange started in the backward, or None
        if self.exchange is not None:
            self.exchange.begin()
        self.handles = [self.owner.model.register_forward_pre_hook(count_examples, with_kwargs=True)]
        self.handles += [module.register_forward_hook(record) for module in self.owner.layers]
        if self.write_grads:  # a formed parameter keeps autograd's gradient: no layer rule gives it from records
            self.turned_off = [p for p in self.owner.params if p.requires_grad and id(p) not in self.owner.formed_ids]
            for p in self.turned_off:
                p.requires_grad_(False)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        for p in self.turned_off:
            p.requires_grad_(True)
        self.handles = []

    def _on_grad(self, entry: list[Any], g: torch.Tensor) -> None:
        module, a = entry
        if a is None or not self.active:  # a call already taken, or the batched pass of watch()
            return
        entry[1] = None
        if self.B is not None and (a.shape[0] != self.B or g.shape[0] != self.B):
            raise ValueError(f"ExactGradients: {type(module).__name__} got an input of shape {tuple(a.shape)} for "
                             f"{self.B} examples: every recorded layer's input needs the examples on dim 0 "
                             "(or 1 there, for an input the model broadcasts over them)")
        with torch.no_grad():
            kind = self.owner.layers[module]
            a, g = tokens(module, kind, a, g.detach())
            dtype = self.owner.record_dtypes[module]
            a, g = (a.to(dtype) if a.is_floating_point() else a), g.to(dtype)  # bf16 (mixed precision): upcast
            before = None if self.exchange is None else {key: len(xs) for key, xs in self.pieces.items()}
            apply_rule(module, kind, a, g,
                       AliasSink(ContributionSink(self.pieces, self.selected), self.owner.held_copies(module)))
            if self.exchange is not None and before is not None:
                added = {key: len(xs) - before.get(key, 0) for key, xs in self.pieces.items()
                         if len(xs) > before.get(key, 0)}
                self.exchange.layer_done(module, added, self.pieces, self.B or 0)

    def watch(self, losses: torch.Tensor) -> None:
        """Start the recording of a batch (inside the ``with`` block, after the forward).

        Args:
            losses: (B,) the per-example losses the loop's loss is built from (attached to the graph).

        Raises:
            ValueError: losses that are not a (B,) tensor attached to the graph.
        """
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or not losses.requires_grad:
            raise ValueError("ExactGradients: watch() takes the (B,) per-example losses, attached to the graph")
        self.B = losses.shape[0]
        self.fresh = all(p.grad is None for p in self.owner.params)  # .grad will be this backward's alone
        if self.owner.formed:  # one batched vector-Jacobian product (rows of the identity), the graph kept
            eye = torch.eye(self.B, dtype=losses.dtype, device=losses.device)
            self.active = False  # the recorded layers' hooks fire in this pass too: not the loop's backward
            try:
                grads = torch.autograd.grad(losses, self.owner.formed, grad_outputs=eye, is_grads_batched=True,
                                            retain_graph=True, allow_unused=True)
            finally:
                self.active = True
            self.formed_grads = {id(p): g.detach() for p, g in zip(self.owner.formed, grads) if g is not None}

        def read_scale(g: torch.Tensor) -> None:
            self.scale = g.detach()

        losses.register_hook(read_scale)

    def units(self, from_grad: bool = False) -> UnitGradients:
        """The watched batch's units, after the loop's backward; the recording's records are handed over.

        Args:
            from_grad: the parameters' .grad hold this backward's gradient alone (they were None at watch();
                the units go to the sorter before anything changes .grad: clipping, an optimizer step), which
                spares half of the running sum's update (UnitGradients.step_grads). With write_grads the units
                compute that gradient themselves (and write it to .grad): from_grad is not needed.

        Returns:
            The B units' gradients as records (`UnitGradients`).

        Raises:
            ValueError: no gradient reached the watched losses, or the loss gives an example a zero or
                non-finite weight.
        """
        B = self.B
        if self.scale is None or B is None:  # (B is set when the losses are watched, before any scale)
            raise ValueError("ExactGradients: no gradient reached the watched losses; run the backward of a loss "
                             "built from them before units()")
        if not bool((self.scale.ne(0) & self.scale.isfinite()).all()):
            raise ValueError("ExactGradients: the loss gives an example a zero or non-finite weight, so its gradient "
                             "cannot be recovered from the backward")
        scale = self.scale.to(self.owner.params[0].dtype)
        for p in self.owner.formed:  # each unit's own gradient, times its weight as records are
            g = self.formed_grads.get(id(p))
            if g is not None:
                formed = g.reshape(B, *matrix_shape(p)).to(p.dtype) * scale.to(p.dtype).view(-1, 1, 1)
                self.pieces[id(p)] = [(0, Formed(formed))]
        units = UnitGradients(self.owner, B, self.pieces, scale)
        units.in_flight = self.exchange
        if self.turned_off:
            units.step_grads, units.step_units, units.writes_grads = {}, B, True
        elif from_grad and self.fresh:
            units.step_grads = {id(p): p.grad for p in self.owner.params}
            units.step_units = B
        self.pieces, self.scale, self.formed_grads = {}, None, {}
        return units


class ExactCDGraB(PairBalancer):
    """CD-GraB (sorters.balance.CDGraB: the same visiting order, tie rule, pending unit and orders) taking
    each step's units as UnitGradients instead of an (n, k, d) tensor: step(units, positions), units
    holding the n * k units replica-major (unit j * k + i is worker j's i-th).

    dtype: the running sum's (d,) dtype (float32: see the module docstring). `near_ties` counts the
    signs that rounding may have decided (NEAR_TIE), over the run; `last_products` keeps the last
    step's (a, G) of the differences, for inspection. `pending`: None, the n units waiting for their
    pair (UnitGradients), or, loaded from a checkpoint and until the next step(), their (n, d) gradients.
    sum_all: for units that come without their backward's gradient (UnitGradients.step_grads None: the engine's,
    or gathered from several processes), the products keep each parameter's sum over all units from the
    blocks they form, so that the running sum's update reads the records of about half the units (d floats
    more during a step).
    share: None, or under torch.distributed a sorters.gather.ParameterShare (every process has every unit, all-
    gathered): each process takes the products and the running sum's update of its share of the parameters
    only, and the products are summed over the processes (UnitGradients.products), so the products' work is
    divided by the processes and the signs are every process's alike. The running sum then holds this
    process's parameters only ((share.size,), share.view); state_dict() puts the processes' parts together
    into the whole (d,) sum, so EVERY process must call state_dict() together (rank 0's checkpoint still
    restores every process).

    Args:
        n_workers: n, the number of workers.
        m: the units each worker visits per epoch.
        d: the length of one unit's gradient (`ExactGradients.d`).
        seed: the seed of every random draw (the first epoch's orders).
        device: where the orders live (the running sum follows the records: the model's device).
        dtype: the running sum's dtype.
        nonfinite: ``"raise"`` only.
        sum_all: as above.
        share: None, or a ``sorters.gather.ParameterShare`` (above).

    Raises:
        ValueError: nonfinite other than ``"raise"`` (and `Sorter`'s checks).
    """

    name = "CD-GraB"
    OPTIONAL_STATE = PairBalancer.OPTIONAL_STATE + ("near_ties",)
    NOT_IN_STATE = PairBalancer.NOT_IN_STATE + ("last_products", "sum_all", "share")
    # between steps the n pending units' records; loaded from a checkpoint, their (n, d) gradients (a tensor, as
    # PairBalancer keeps them) until the next step
    pending: "UnitGradients | torch.Tensor | None"  # type: ignore[assignment]
    # S, (d,) in `dtype`; with a share (share.size,), this process's parameters. Until the first step (or a load)
    # a tensor on the meta device: its shape, no memory (a sharded model's process never holds d numbers)
    running_sum: torch.Tensor

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, nonfinite: str = "raise", sum_all: bool = False,
                 share: "sorters.gather.ParameterShare | None" = None) -> None:
        if nonfinite != "raise":
            raise ValueError("ExactCDGraB: only nonfinite='raise' is supported")
        self.near_ties, self.sum_all, self.share = 0, sum_all, share
        self.last_products: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(n_workers, m, d, seed, device, dtype, nonfinite)

    def use_share(self, share: "sorters.gather.ParameterShare") -> None:
        """Divide the products from now on (see the class docstring): the running sum, whole until now (loaded,
        or this process's alone), keeps this process's parameters only.

        Args:
            share: the ``sorters.gather.ParameterShare`` of this process.
        """
        if self.running_sum.is_meta:  # never stepped nor loaded: still no memory, now of the share's size
            self.running_sum = torch.empty(share.size, dtype=self.dtype, device="meta")
        else:
            self.running_sum = share.part(self.running_sum)
        self.share, self.sum_all = share, share.keeps_unit_sums

    def _reset_running_sums(self) -> None:
        size = self.d if self.share is None else self.share.size
        current = getattr(self, "running_sum", None)
        if current is not None and current.dtype == self.dtype and current.numel() == size:
            if not current.is_meta:
                current.zero_()  # no fresh (d,) allocation every epoch
        else:  # allocated by the first step, where the records are and at the share's size by then
            self.running_sum = torch.empty(size, dtype=self.dtype, device="meta")

    def _keep_sum_beside(self, units: UnitGradients) -> None:
        """The running sum lives where the records are (the model's device), whatever `device` keeps the
        orders: the products and the update stream every record against it, and no record crosses devices
        (a sampler built on the CPU, its default, beside a model on a GPU). Not allocated yet (the meta
        device): zeros there now, of the share's size when the sampler installed one (never d on a sharded
        model)."""
        if self.running_sum.is_meta:
            self.running_sum = torch.zeros(self.running_sum.shape, dtype=self.dtype, device=units.scale.device)
        elif self.running_sum.device != units.scale.device:
            self.running_sum = self.running_sum.to(units.scale.device)

    def _allocated_sum(self) -> torch.Tensor:
        """The running sum, zeros on `device` in place of a never-allocated one (the meta device)."""
        if self.running_sum.is_meta:
            return torch.zeros(self.running_sum.shape, dtype=self.dtype, device=self.device)
        return self.running_sum

    def state_dict(self, sharded: bool = False) -> dict[str, Any]:
        """The sorter's whole state, for a checkpoint: as sorters.CDGraB's, every tensor on `device` (a checkpoint
        loads where the sorter was built). With a share, every process must call it together.

        Args:
            sharded: with a share, keep each process's part instead: the running sum (share.size,) and the
                pending units' gradients (n, share.size), never put together (sorters.fsdp.sharded_state_dict
                saves them with torch.distributed.checkpoint); no collective.

        Returns:
            A dict of tensors (copies) and numbers, with its format version; the pending units as their (n, d)
            gradients ((n, share.size) with `sharded`).

        Raises:
            ValueError: `sharded` without a share (one line).
        """
        if sharded and self.share is None:
            raise ValueError(f"{self.name}: state_dict(sharded=True) keeps a share's parts, and this sorter has no "
                             "share (call state_dict())")
        state = super().state_dict()
        state["running_sum"] = self._allocated_sum().clone() if self.running_sum.is_meta else state["running_sum"]
        pending = state.get("pending")
        if self.share is not None and torch.is_tensor(pending):  # loaded whole and not stepped since
            pending = self.share.part(pending)
        elif isinstance(pending, UnitGradients):  # formed: the (n, d) gradients CDGraB saves (or the share's part)
            pending = pending.owner.flat(pending) if self.share is None else _formed_part(pending, self.share)
            pending = pending.to(self.dtype)
        if self.share is not None and not sharded:  # the processes' parts put together: the whole (d,) tensors
            state["running_sum"] = self.share.reduce(self.share.whole(state["running_sum"], self.d))
            pending = None if pending is None else self.share.reduce(self.share.whole(pending, self.d))
        state["pending"] = pending
        return {key: value.to(self.device) if torch.is_tensor(value) else value for key, value in state.items()}

    def load_state_dict(self, state: dict[str, Any], sharded: bool = False) -> None:
        """Restore a state_dict() of ExactCDGraB, or of sorters.CDGraB of the same n, m, d (the keys are the
        same). A pending unit comes as its formed (n, d) gradients: kept so, and turned into units (one
        Formed contribution per parameter) by the next step(), which brings the ExactGradients they need.

        Args:
            state: what ``state_dict()`` returned.
            sharded: the state's running sum is this process's part, (share.size,) of the share installed
                (use_share), and its pending units None or already that part's `UnitGradients`
                (sorters.fsdp.load_sharded_state_dict).

        Raises:
            ValueError: a state that is not one (`Sorter.load_state_dict`), refused in one line.
        """
        if sharded:
            pending = state.get("pending")
            if self.share is None or not (pending is None or isinstance(pending, UnitGradients)):
                raise ValueError(f"{self.name}: load_state_dict(sharded=True) takes a share's part (use_share first) "
                                 "and the pending units as UnitGradients (sorters.fsdp.load_sharded_state_dict)")
            super().load_state_dict({**state, "pending": None})  # the running sum checked as (share.size,)
            self.running_sum, self.pending = self.running_sum.to(self.dtype), pending
            return
        share, self.share = self.share, None
        if share is not None:  # the saved sum is whole: checked and loaded as (d,), then this process's part kept
            self.running_sum = torch.empty(self.d, dtype=self.dtype, device="meta")
        super().load_state_dict(state)
        self.running_sum = self.running_sum.to(self.dtype)
        if share is not None:
            self.use_share(share)

    # the records of a step instead of PairBalancer's (n, k, d) tensor: the same role, another type
    def step(self, units: UnitGradients,  # type: ignore[override]
             positions: torch.Tensor | list[int] | range) -> None:
        """Record a step's units: their signs, their places in the next orders, and the running sum's update.

        Args:
            units: the n * k units of the step replica-major (unit j * k + i is worker j's i-th, at epoch
                position ``positions[i]``), as records (`UnitGradients`).
            positions: (k,) the epoch positions of the step, consecutive and continuing the epoch.

        Raises:
            ValueError: positions that do not continue the epoch, or units that are not the step's n * k.
            NonFiniteGradientError: NaN / inf in the step's products.
        """
        start, k = self._check_positions(positions)
        n = self.n
        if not isinstance(units, UnitGradients) or units.units != n * k:
            raise ValueError(f"{self.name}: step() takes the UnitGradients of the {n} x {k} units of the step")
        if torch.is_tensor(self.pending):  # loaded from a checkpoint: worker j's pending gradient is row j
            self.pending = units.owner.formed_units(self.pending)
        self._keep_sum_beside(units)
        self._next_position += k
        pending = self.pending is not None
        everything = units.join(self.pending) if isinstance(self.pending, UnitGradients) else units
        firsts, seconds = self._visiting_order(n, k, pending)
        r = len(firsts)
        if r:
            everything.sum_all = self.sum_all
            pairs = Pairs(firsts, seconds, 1.0 / everything.scale)
            # ||S||^2 for the near-tie count: with a share, its parts summed in the products' collective
            s_norm2 = torch.tensor([_squared_norm(self.running_sum)], dtype=torch.float64)
            diff_a, diff_G, norms = everything.products(self.running_sum, pairs=pairs, share=self.share,
                                                        riders=None if self.share is None else s_norm2)
            if not bool(diff_a.isfinite().all() and diff_G.isfinite().all() and norms.isfinite().all()):
                where = f"step at positions {start}..{start + k - 1} of {self.m}; lower the learning rate or fix " \
                        "the input"
                what = f"{self.name}: non-finite gradient (nan or inf)"
                raise NonFiniteGradientError(f"{what} in epoch {self.epoch}, {where}", self.epoch, start,
                                             f"{what}, {where}")
            signs = gram_signs(diff_a, diff_G)
            self.near_ties += self._count_near_ties(diff_a, diff_G, signs, norms, firsts, seconds, float(s_norm2[0]))
            self.last_products = (diff_a, diff_G)
            w = torch.zeros(everything.units, dtype=torch.float64)
            w[firsts], w[seconds] = signs, -signs  # each unit is in one pair
            everything.add_to(self.running_sum, w, share=self.share)
            plus = (signs > 0).numpy()
            self._place(plus, n, k, pending)
        self.pending = None
        if (k - pending) % 2:
            self.pending = units.select([j * k + k - 1 for j in range(n)])
            self.pending_position = start + k - 1
        if self._next_position == self.m and self.pending is not None:
            assert self.left == self.right
            self.next_orders[:, self.left] = self.orders[:, self.pending_position]
            self.pending, self.left, self.right = None, self.left + 1, self.right - 1

    @staticmethod
    def _visiting_order(n: int, k: int, pending: bool) -> tuple[list[int], list[int]]:
        """(firsts, seconds): unit indices of the step's differences, in CDGraB's visiting order: the pairs
        completing the pending units (worker by worker), then pair-major, worker-minor."""
        firsts: list[int] = []
        seconds: list[int] = []
        if pending:
            for j in range(n):
                firsts.append(n * k + j)
                seconds.append(j * k)
        begin = int(pending)
        for p in range((k - begin) // 2):
            for j in range(n):
                firsts.append(j * k + begin + 2 * p)
                seconds.append(j * k + begin + 2 * p + 1)
        return firsts, seconds

    def _place(self, plus: NDArray[np.bool_], n: int, k: int, pending: bool) -> None:
        """Place the step's pairs by their signs, plus (r,) in the visiting order (True: the first unit left)."""
        at = 0
        if pending:
            self._place_pairs(np, plus[:n].reshape(n, 1), self.pending_position)
            at = n
        pairs = (k - pending) // 2
        if pairs:
            first = self._next_position - k + int(pending)
            self._place_pairs(np, np.ascontiguousarray(plus[at:].reshape(pairs, n).T), first)

    def _count_near_ties(self, diff_a: torch.Tensor, diff_G: torch.Tensor, signs: torch.Tensor, norms: torch.Tensor,
                         firsts: list[int], seconds: list[int], s_norm2_start: float) -> int:
        """Signs where |<S_i, v_i>| <= NEAR_TIE ||S_i|| (||g_first|| + ||g_second||), for every pair i at once:
        <S_i, v_i> = a_i + sum_{j<i} s_j G_ij and
        ||S_i||^2 = ||S||^2 + 2 sum_{j<i} s_j a_j + sum_{j,l<i} s_j s_l G_jl (prefix sums over the pairs; float64),
        ||S||^2 = s_norm2_start, the whole running sum's at the step's start."""
        signs = signs.to(torch.float64)
        dots = diff_a + torch.tril(diff_G, -1) @ signs
        quadratic = (signs[:, None] * diff_G * signs[None, :]).cumsum(0).cumsum(1).diagonal()  # sum_{j,l<=i}
        before = torch.cat([torch.zeros(1, dtype=torch.float64), quadratic[:-1]])            # sum_{j,l<i}
        linear = torch.cat([torch.zeros(1, dtype=torch.float64), (signs * diff_a).cumsum(0)[:-1]])
        s_norm2 = s_norm2_start + 2 * linear + before
        g_norms = norms.to(torch.float64).clamp(min=0).sqrt()
        scale = s_norm2.clamp(min=0).sqrt() * (g_norms[firsts] + g_norms[seconds])
        return int(((scale > 0) & (dots.abs() <= NEAR_TIE * scale)).sum())  # S_i = 0 exactly: a true tie, +1


def _formed_part(units: UnitGradients, share: "sorters.gather.ParameterShare") -> torch.Tensor:
    """The units' gradients formed on a share's part only, (U, share.size) on the records' device: what each
    process holds of them (with ShardedRows its rows of every parameter), never (U, d)."""
    first = units.owner.params[0]
    out = torch.zeros(units.units, share.size, dtype=first.dtype, device=units.scale.device)
    for u in range(units.units):
        w = torch.zeros(units.units, dtype=torch.float64)
        w[u] = 1.0
        units.add_to(out[u], w, share=share)
    return out


def _is_dtensor(p: torch.Tensor) -> bool:
    """Whether p is a DTensor (FSDP2's sharded parameter); torch.distributed.tensor is imported only when asked."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(p, DTensor)


def _squared_norm(x: torch.Tensor, chunk: int = 2**20) -> float:
    """||x||^2 of a flat x, accumulated in float64 a chunk at a time (never a float64 copy of x whole). With a
    share, x is this process's part: ExactCDGraB.step sums the parts in the products' collective (riders)."""
    return sum(float(part.double().square().sum()) for part in x.split(chunk))
