r"""Sketches of per-example gradients built layer by layer, without forming the per-example gradients of
the large weights (issue #31, item 1).

    sketcher = LayerSketch(model, dim=256, seed=0)                   # the map: fixed by (model, 256, 0)
    s, losses = sketcher(lambda: F.cross_entropy(model(x), y, reduction="none"))   # (B, 256), (B,)
    s, losses = sketcher(per_example_losses, update_scale=1 / B)     # and .grad += the mean loss's gradient

The caller passes a function that runs the ordinary batched forward and returns the (B,) PER-EXAMPLE losses
(no reduction over the batch: loss i must be example i's loss as if it were alone, and depend on no other
example). The module runs ONE backward of their SUM: the gradient reaching each layer output is then, row
by row, that example's own output gradient, so each example's weight gradient is a sum of outer products
of the layer's inputs and output gradients, which the map below sketches without forming it. A training
loop whose loss is the batch MEAN passes the per-example losses here and update_scale=1/B for its update.

The map is sorters.GradientSketch(d, dim, seed, blocks=layer_blocks(...)) over the selected parameters in
`named_parameters()` order (a tied weight once): a CountSketch, with a TensorSketch block for every weight
of a Linear, transformers Conv1D or Embedding of at least `min_numel` entries. So `sketcher.sketch(g)`
applied to explicitly formed per-example gradients g (B, d) gives the same (B, dim) result, up to rounding;
the same (model structure, dim, seed, params, min_numel) gives the same map in every process.

Per layer, from the input a_t and output gradient g_t at each position t of each call (every call of a
layer used several times, and every layer sharing a tied weight, add into the same coordinates), by the
rules of sorters/layer_rules.py (the one table, which the engine uses too):
  - Linear weight (out, in): sum_t g_t a_t^T; Conv1D weight (in, out): sum_t a_t g_t^T. A block: TensorSketch
    of the sum (TensorBlock.add_outer: circular convolution of CountSketches, never the matrix); a smaller
    weight: formed per example (B, out, in) by one bmm and CountSketched.
  - Embedding weight: g_t scattered into row ids_t (padding_idx rows get nothing): a block by
    TensorBlock.add_rows; a smaller one formed per example.
  - biases (sum_t g_t) and LayerNorm (weight: sum_t g_t * xhat_t, bias: sum_t g_t): vectors of the layer's
    width, formed per example (B, width) and CountSketched.
Every other selected parameter (a layer type without a rule here: Conv2d, LSTM, a bare nn.Parameter, an
Embedding with scale_grad_by_freq) is formed per example by a batched vector-Jacobian product of the same
graph (torch.autograd.grad with is_grads_batched) and CountSketched; the constructor warns once which.
"""
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from sorters.checks import check_int, check_module, check_no_dropout, check_seed
from sorters.layer_rules import (
    AliasSink,
    BlockSink,
    Layout,
    Sink,
    apply_rule,
    check_units,
    examples_of_call,
    scatter_rows,
    spread_over_examples,
    tokens,
)
from sorters.sketch import GradientSketch, TensorBlock
from sorters.thresholds import STRUCTURED_MIN_NUMEL, check_min_numel  # the library's row (thresholds.py: why)


def selected_parameters(model: torch.nn.Module, params: str | Sequence[str] | None,
                        owner: str) -> list[tuple[str, torch.Tensor]]:
    """[(name, parameter)] of the trainable parameters whose name `re.search`es one of `params` (None:
    all), in `named_parameters()` order (a tied parameter once)."""
    if not (params is None or isinstance(params, str) or isinstance(params, (list, tuple)) and all(
            isinstance(p, str) for p in params)):
        raise TypeError(f"{owner}: params must be None, a regular expression or a list of them, got {params!r}")
    patterns = [params] if isinstance(params, str) else params
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    chosen: list[tuple[str, torch.Tensor]] = [
        (name, p) for name, p in trainable if patterns is None or any(re.search(pattern, name) for pattern in patterns)]
    if not chosen:
        raise ValueError(f"{owner}: no trainable parameter name matches {params!r}; names are "
                         + ", ".join(name for name, _ in trainable[:12]))
    return chosen


def layer_blocks(model: torch.nn.Module, params: str | Sequence[str] | None = None,
                 min_numel: int = STRUCTURED_MIN_NUMEL) -> list[tuple[int, int, int]]:
    """The TensorSketch blocks of LayerSketch's map for these selected parameters: GradientSketch(d, dim,
    seed, blocks=layer_blocks(model, params, min_numel)) is that map (PerExampleGrads(structured=True))."""
    return Layout(model, selected_parameters(model, params, "layer_blocks")).blocks(min_numel)


class LayerSketch:
    """Callable: per_example_losses_fn -> ((B, dim) sketches of the B per-example gradients, (B,) losses).

    Args:
        model: an nn.Module (a DistributedDataParallel's module is used); its parameters are read at each
            call. Examples must be independent in the forward (no BatchNorm or dropout in training mode:
            refused), and every input of a recorded layer must have the examples on batch_dim, or 1 there
            for an input whose output the model broadcasts over them (a transformers model called as usual,
            `model(input_ids=x)`: its position embedding gets (1, T) position_ids).
        dim: D, the sketches' length (the map's size, `GradientSketch`); dim >= d gives the per-example
            gradients exactly.
        seed: the map's seed (`GradientSketch`): the same in every process gives the same map.
        params: which parameters (as PerExampleGrads: None, or regular expressions searched in the names).
        min_numel: weights of Linear / Conv1D / Embedding layers with at least this many entries are never
            formed per example (TensorSketch blocks of the map).
        batch_dim: the dim of every recorded layer's input (and output) that holds the examples: 0, or 1 for a
            time-major model (an LSTM language model's (T, B) ids and (T, B, width) activations).

    A recorded layer's parameters must be used only through that layer's call (e.g. not nn.MultiheadAttention's
    out_proj, whose weight it reads directly): a layer never called whose parameters still get a gradient is
    refused with a ValueError after the backward.

    On a model sharded with FSDP2 (fully_shard, before or after this is built) each process sketches its own
    examples' whole gradients from their records, as without sharding; the sampler all-gathers the sketches
    (docs/fsdp.md). Parameters of layers without a rule are refused there.

    Attributes:
        names: the selected parameters' names, in ``named_parameters()`` order (a tied one once).
        d: their total number of entries, the length of the gradients the sketches stand for.
        sketch: the `GradientSketch` of the map.
        dim: the sketches' length (d when dim >= d).
        formed: the names of the parameters formed per example by the batched VJP (no layer rule).

    Raises:
        TypeError: model is not an ``nn.Module``, or dim, seed or min_numel is not an integer, or params is
            neither None, a string nor a list of strings.
        ValueError: dim or min_numel below 1, batch_dim not 0 or 1, no trainable parameter selected, or a
            parameter without a layer rule on a model sharded with fully_shard.
    """

    def __init__(self, model: torch.nn.Module, dim: int, seed: int = 0, params: str | Sequence[str] | None = None,
                 min_numel: int = STRUCTURED_MIN_NUMEL, batch_dim: int = 0) -> None:
        check_module("LayerSketch", model)
        dim, seed = check_int("LayerSketch", "dim", dim, 1), check_seed("LayerSketch", seed)
        min_numel = check_min_numel("LayerSketch", min_numel)
        if isinstance(batch_dim, bool) or batch_dim not in (0, 1):
            raise ValueError(f"LayerSketch: batch_dim must be 0 or 1, got {batch_dim}")
        self.batch_dim = batch_dim
        self.model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        chosen = selected_parameters(self.model, params, "LayerSketch")
        self.names = [name for name, _ in chosen]
        self.layout = Layout(self.model, chosen)
        self.d = self.layout.d
        self.sketch = GradientSketch(self.d, dim, seed, blocks=self.layout.blocks(min_numel) if dim < self.d else ())
        self.dim = self.sketch.dim
        self.formed = [name for name, _ in self.layout.formed]
        self._sharded()  # refuses what cannot work on a model already sharded
        if self.formed:
            numel = sum(p.numel() for _, p in self.layout.formed)
            warnings.warn(f"LayerSketch: {len(self.formed)} parameter(s) ({numel} entries) belong to layers without "
                          "a per-layer rule and are formed per example, then CountSketched: "
                          + ", ".join(self.formed[:8]) + (" ..." if len(self.formed) > 8 else ""), stacklevel=2)
        # the parameters outside the blocks: formed per example in a (B, d_rest) buffer, columns increasing
        self._blocks: dict[int, TensorBlock] = {}  # id(weight) -> its TensorBlock
        for _, p in chosen:
            block = None if self.sketch.is_identity else self.sketch.block_at(self.layout.offsets[id(p)])
            if block is not None:
                self._blocks[id(p)] = block
        self._like = chosen[0][1]  # the sketches' dtype and device
        self._rest: dict[int, int] = {}  # id(parameter) -> its column in the (B, d_rest) buffer
        pieces: list[torch.Tensor] = []
        numel = 0
        for _, p in chosen:
            if id(p) not in self._blocks:
                self._rest[id(p)] = numel
                start = self.layout.offsets[id(p)]
                pieces.append(torch.arange(start, start + p.numel()))
                numel += p.numel()
        self._rest_numel = numel
        self._index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        # (device, dtype) -> the buckets and signs of the coordinates outside the blocks there (_finish)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, losses_fn: Callable[[], torch.Tensor],
                 update_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sketch a batch's per-example gradients by ONE backward of the sum of its per-example losses.

        Args:
            losses_fn: runs the batched forward and returns the (B,) per-example losses.
            update_scale: c, or None: also add c * (the gradient of the losses' sum) to every trainable
                parameter's ``.grad`` (c = 1 / B: the batch-mean loss's gradient); None touches no ``.grad``.

        Returns:
            (sketches, losses): sketches (B, dim) in the parameters' dtype and losses (B,), both detached.

        On a model sharded by FSDP2 (its parameters are DTensors: it went through fully_shard) the backward is
        the model's own, ``(update_scale * losses.sum()).backward()``, so ``.grad`` gets FSDP's reduce-scattered
        gradient, the mean over the processes as FSDP's backward always gives it, and update_scale is required;
        a layer used outside its call is not detected there (as in `recording`).

        Raises:
            ValueError: losses that are not a (B,) tensor, a dropout module in training mode, an input without
                the B examples on batch_dim, a recorded layer whose parameters got a gradient outside its
                call, or update_scale None or 0 on a sharded model.
        """
        if self._sharded():
            return self._sharded_call(losses_fn, update_scale)
        state = _Pass()
        handles = self._record_calls(state)
        try:
            losses = losses_fn()
        finally:
            for handle in handles:
                handle.remove()
        self._check_losses(losses)
        self._start(state, losses.shape[0])
        wanted = self._update_params() if update_scale is not None else \
            [p for p in self.model.parameters() if id(p) in self.layout.recorded]
        grads = torch.autograd.grad(losses.sum(), wanted, retain_graph=bool(self.formed), allow_unused=True) \
            if wanted else ()
        state.active = False
        self._check_calls(state, wanted, grads)
        if update_scale is not None:
            self._add_update(wanted, grads, update_scale)
        del grads
        if self.formed:
            self._add_formed(losses, state)
        return self._finish(state), losses.detach()

    def _sharded(self) -> bool:
        """Whether the model's parameters are FSDP2's sharded DTensors now (read at each use: a LayerSketch built
        before fully_shard sees them too). Each process then sketches its own examples' whole gradients from their
        records, and the backward is FSDP's (docs/fsdp.md). Refuses the parameters formed per example there."""
        sharded = _any_dtensor(list(self.model.parameters()))
        if sharded and self.formed:
            raise ValueError(f"LayerSketch: under fully_shard the parameters of layers without a per-layer rule "
                             f"cannot be formed per example (their gradients reach FSDP's gathered copies only): "
                             f"{', '.join(self.formed[:8])}; leave them out with params=")
        return sharded

    def _sharded_call(self, losses_fn: Callable[[], torch.Tensor],
                      update_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """__call__ on a model sharded by FSDP2: FSDP all-gathers a layer's weight for its backward and
        reduce-scatters the gradients it gets, so the gradients come from the model's own backward (a
        torch.autograd.grad of the sharded parameters sees none) and the sketches from a `recording` of it."""
        if update_scale is None or update_scale == 0:
            raise ValueError("LayerSketch: on a model sharded by fully_shard the backward is FSDP's, which writes "
                             f".grad: pass a nonzero update_scale (1 / B for a batch-mean loss), got {update_scale}, "
                             "or use recording() with the loop's own backward")
        with self.recording() as rec:
            losses = losses_fn()
            self._check_losses(losses)
            rec.watch(losses)
        (losses.sum() * update_scale).backward()
        return rec.sketches(), losses.detach()

    def recording(self) -> "Recording":
        """A recording of the sketches for a loop that runs its own backward (the HF Trainer, Lightning, DDP,
        mixed precision).

        Example::

            with sketcher.recording() as rec:
                losses = per_example_losses(model(x))   # (B,): the forward runs inside the block
                rec.watch(losses)
            loss = (losses * weights).sum()             # any loss with a nonzero gradient in each losses[i]
            loss.backward()                             # or accelerator.backward(loss), scaler.scale(loss)...
            sketches = rec.sketches()                   # (B, dim)

        The backward is the loop's own (its .grad, gradient scaling and DDP all-reduce as usual); the layers'
        output gradients it passes through are then, row i, c_i times example i's, with c_i the gradient
        of the loss in losses[i] (read by a hook on `losses`; the sketch is linear, so row i is divided by
        c_i). Parameters without a layer rule are formed per example at watch() (a batched VJP that keeps
        the graph for the loop's backward). Unlike __call__, a layer used outside its forward is not
        detected here.

        Returns:
            The context manager (`sorters.layer_sketch.Recording`): the forward inside it, ``watch(losses)``
            with the (B,) per-example losses, the loop's backward, then ``sketches()``, (B, dim).
        """
        return Recording(self)

    def _record_calls(self, state: "_Pass") -> list[RemovableHandle]:
        """Forward hooks on the recorded layers: each call's input is kept, and its output's gradient,
        when it arrives in the backward, adds the call's contribution (then the input is dropped). A call whose
        input has one row on batch_dim, broadcast by the model over its B examples (GPT-2's default (1, T)
        position_ids), is recorded as B rows: sorters.layer_rules.spread_over_examples. Refuses dropout in
        training mode (sorters.checks.check_no_dropout)."""
        check_no_dropout("LayerSketch", self.model)

        # the model's call: how many examples a broadcast input serves
        def count_examples(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state.examples = examples_of_call(args, kwargs, self.batch_dim)

        def record(module: torch.nn.Module, args: tuple[Any, ...], output: object) -> torch.Tensor | None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                a, output = spread_over_examples(args[0].detach(), output, state.examples, self.batch_dim)
                entry: list[Any] = [module, a, None]  # [the layer, its input (None once counted), unused]
                output.register_hook(lambda g, entry=entry: self._on_grad(entry, g, state))
                return output
            return None

        return [self.model.register_forward_pre_hook(count_examples, with_kwargs=True)] + \
            [module.register_forward_hook(record) for module in self.layout.layers]

    @staticmethod
    def _check_losses(losses: object) -> None:
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(f"LayerSketch: the forward must give the (B,) per-example losses, got {shape}")

    def _start(self, state: "_Pass", B: int) -> None:
        dtype, device = self._like.dtype, self._like.device
        state.B, state.active, state.sketcher = B, True, self
        state.rest = torch.zeros(B, self._rest_numel, dtype=dtype, device=device)
        state.out = state.rest if self.sketch.is_identity else torch.zeros(B, self.dim, dtype=dtype, device=device)
        state.sink = BlockSink(state, self._blocks, state.out)  # the rules write through it (layer_rules.py)

    def _on_grad(self, entry: list[Any], g: torch.Tensor, state: "_Pass") -> None:
        """A recorded call's output gradient arrived: add its contribution, then drop its input."""
        module: torch.nn.Module = entry[0]
        a: torch.Tensor | None = entry[1]
        if not state.active or a is None:  # the batched VJP's second pass, or a call already counted
            return
        entry[1] = None
        state.called.add(module)
        if self.batch_dim:  # time-major: the examples to the front
            a, g = a.movedim(self.batch_dim, 0), g.movedim(self.batch_dim, 0)
        dtype = self._like.dtype  # under autocast a layer's output (and its gradient) may be half precision
        g = g if g.dtype == dtype else g.to(dtype)
        a = a if not a.is_floating_point() or a.dtype == dtype else a.to(dtype)
        with torch.no_grad():
            kind = self.layout.layers[module]
            check_units("LayerSketch", module, a, g, state.B, "examples")
            aliases = self.layout.held_copies(module)  # FSDP2: the layer holds gathered copies of its weights
            sink = AliasSink(state.sink, aliases) if aliases else state.sink
            apply_rule(module, kind, *tokens(module, kind, a, g), sink)

    def _update_params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _check_calls(self, state: "_Pass", wanted: Sequence[torch.Tensor],
                     grads: Sequence[torch.Tensor | None]) -> None:
        """A recorded layer never called whose parameters got a gradient was used some other way."""
        grad_of = {id(p): g for p, g in zip(wanted, grads)}
        for module in self.layout.layers:
            if module in state.called:
                continue
            for p in module.parameters(recurse=False):
                g = grad_of.get(id(p))
                if id(p) in self.layout.recorded and g is not None and bool(g.ne(0).any()):
                    raise ValueError(f"LayerSketch: the {type(module).__name__} holding a parameter of shape "
                                     f"{tuple(p.shape)} was not called, but its parameters got a gradient: they are "
                                     "used outside its forward (as in nn.MultiheadAttention); select other params")

    @staticmethod
    def _add_update(wanted: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], scale: float) -> None:
        for p, g in zip(wanted, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.mul_(scale)
            else:
                p.grad.add_(g, alpha=scale)

    def _add_formed(self, losses: torch.Tensor, state: "_Pass", keep_graph: bool = False) -> None:
        """The parameters without a rule: per-example gradients by one batched VJP (rows of the identity)."""
        params = [p for _, p in self.layout.formed]
        eye = torch.eye(state.B, dtype=losses.dtype, device=losses.device)
        grads = torch.autograd.grad(losses, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True,
                                    retain_graph=keep_graph)
        for p, g in zip(params, grads):
            if g is not None:
                state.add(p, g)

    def _finish(self, state: "_Pass") -> torch.Tensor:
        """out += P(rest): the coordinates outside the blocks, with the map's own buckets and signs."""
        if self.sketch.is_identity or not self._rest_numel:
            return state.out
        key = (state.rest.device, state.rest.dtype)
        if key not in self._tables:
            self._tables[key] = self.sketch.tables_at(self._index, *key)
        buckets, signs = self._tables[key]
        return state.out.index_add_(1, buckets, state.rest.mul_(signs))


def _any_dtensor(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of params is a DTensor (FSDP2's sharded parameters). Without torch.distributed.tensor
    imported none can exist, so `import sorters` does not import it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in params)


class Recording:
    """LayerSketch.recording()'s context: the forward inside, watch(losses), the loop's backward, sketches()."""

    def __init__(self, sketcher: LayerSketch) -> None:
        self.sketcher, self.state = sketcher, _Pass()
        self._handles: list[RemovableHandle] = []
        self._scale: torch.Tensor | None = None  # (B,) the loss's gradient in each watched loss
        self._formed: torch.Tensor | None = None  # (B, d_rest) the parameters without a rule, formed at watch()

    def __enter__(self) -> "Recording":
        self.sketcher._sharded()  # refuses parameters formed per example on a sharded model
        self._handles = self.sketcher._record_calls(self.state)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def watch(self, losses: torch.Tensor) -> None:
        """Start the recording of a batch.

        Args:
            losses: the (B,) per-example losses the loop's loss is built from (still attached to the graph).

        Raises:
            ValueError: losses that are not a (B,) tensor requiring grad.
        """
        sketcher, state = self.sketcher, self.state
        sketcher._check_losses(losses)
        if not losses.requires_grad:
            raise ValueError("LayerSketch.recording: the watched losses do not require grad (a forward under "
                             "torch.no_grad, or frozen parameters only)")
        sketcher._start(state, losses.shape[0])
        if sketcher.formed:  # formed per example now, unscaled: kept apart from the scaled records
            state.active = False
            formed = _Pass()
            sketcher._start(formed, losses.shape[0])
            sketcher._add_formed(losses, formed, keep_graph=True)
            self._formed = formed.rest
            state.active = True

        def read_scale(g: torch.Tensor) -> None:
            self._scale = g.detach()

        losses.register_hook(read_scale)

    def sketches(self) -> torch.Tensor:
        """The sketches of the watched batch, after the loop's backward.

        Returns:
            (B, dim) sketches of the per-example gradients.

        Raises:
            ValueError: no gradient reached the watched losses, or the loss gives an example a zero or
                non-finite weight.
        """
        sketcher, state = self.sketcher, self.state
        if self._scale is None:
            raise ValueError("LayerSketch.recording: no gradient reached the watched losses; call watch(losses) "
                             "inside the block and run the backward of a loss built from them before sketches()")
        scale = self._scale.to(state.out.dtype)
        if not bool(scale.ne(0).all()) or not bool(scale.isfinite().all()):
            bad = (~(scale.ne(0) & scale.isfinite())).nonzero().squeeze(1).tolist()
            raise ValueError(f"LayerSketch.recording: the loss gives example(s) {bad[:8]} a zero or non-finite weight "
                             "(the gradient of the loss in their per-example loss), so their gradients cannot be "
                             "recovered from the backward")
        state.active = False
        state.out.div_(scale[:, None])
        if state.rest is not state.out:
            state.rest.div_(scale[:, None])
        if self._formed is not None:
            state.rest.add_(self._formed)
        self._scale, self._formed = None, None
        return sketcher._finish(state)


class _Pass(Sink):
    """One call's buffers: rest (B, d_rest) per-example gradients outside the blocks, out (B, dim); the rules'
    sink for the parameters outside the blocks (the blocks go to `sink`, a BlockSink over this one)."""

    def __init__(self) -> None:
        self.B, self.active = 0, False
        self.called: set[torch.nn.Module] = set()
        self.examples: int | None = None  # the examples of the model's current call (examples_of_call)
        # set by LayerSketch._start, before anything reads them (nothing does while `active` is False)
        self.rest: torch.Tensor
        self.out: torch.Tensor
        self.sketcher: LayerSketch
        self.sink: Sink

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """p's (B, *p.shape) columns of rest."""
        start = self.sketcher._rest[id(p)]
        return self.rest[:, start:start + p.numel()].view(self.B, *p.shape)

    def wants(self, p: torch.Tensor) -> bool:
        return id(p) in self.sketcher.layout.recorded  # a parameter not selected, or formed by the batched VJP

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        self.view(p).add_(value.reshape(self.B, *p.shape))

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        scatter_rows(self.view(p), ids, g)
