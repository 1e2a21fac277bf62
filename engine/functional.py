"""The model as a function of ONE flat parameter vector, and its gradients.

Keeping all parameters in a single (d,) tensor makes every gradient a (d,) or (k, d) tensor
(what sorters and collectives consume) with no flatten/concatenate step, and makes the
optimizer state one (d,) tensor per buffer. Tied weights appear once (named_parameters
de-duplicates them).

The module's own parameters are views into that vector (`FlatModel.flat`), and their `.grad`
views into one (d,) gradient buffer, so the plain path is the textbook one: call the module,
`backward()`, read the buffer. Three gradient routines build on it:

- `FlatModel.batch_gradient`: mean gradient of a batch, one ordinary backward;
- `FlatModel.outer_unit_gradients`: per-unit gradients from ONE batched backward to the outputs of
  the Linear / Conv1D / Embedding / LayerNorm layers, then the library's per-layer rules
  (sorters/layer_rules.py, the same table LayerSketch uses) for models made only of those layers
  (LR, MLP, GPT-2); `outer_unit_sketches` applies the same rules to sketch instead;
- `unit_gradients`: per-unit gradients by torch.func.vmap over grad, the general path.
"""
import torch
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from sorters.layer_rules import STRUCTURED_KINDS, BlockSink, ColumnSink, Layout, Sink, apply_rule, calls_as_tokens, \
    check_units


class FlatModel:
    """Wraps an nn.Module whose parameters become views of `flat` (d,), gradients views of `grad` (d,).

    `model(flat, *args)` runs the module at parameters `flat`: directly when `flat` is `self.flat`
    (the fast path: no re-parametrisation), through torch.func.functional_call otherwise (e.g. under
    vmap, where `flat` is a batched tracer).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._bind(torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone())

    def _bind(self, flat: torch.Tensor) -> None:
        """Make the module's parameters views of `flat` and their gradients views of a zeroed buffer."""
        named = list(self.module.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.flat, self.grad, self.d = flat, torch.zeros_like(flat), flat.numel()
        self.offsets = {}  # id(parameter) -> offset in flat
        offset = 0
        for (_, p), numel in zip(named, self.numels):
            p.data = flat[offset:offset + numel].view(p.shape)
            p.grad = self.grad[offset:offset + numel].view(p.shape)  # backward accumulates in place
            self.offsets[id(p)] = offset
            offset += numel
        # batch_gradient's targets: the parameters autograd differentiates, and their views of `grad`
        self._trained = [p for _, p in named if p.requires_grad]
        self._trained_grads = [p.grad for p in self._trained]
        self._frozen = len(self._trained) < len(named)  # parameters whose gradient batch_gradient leaves at 0
        self.buffers = dict(self.module.named_buffers())
        # the library's view of the flat vector (sorters/layer_rules.py): which layers have a per-unit rule
        self.layout = Layout(self.module, named)
        self.layers = self.layout.layers  # module -> its rule's kind, for every layer holding a parameter
        # every parameter must belong to layers with a rule, else only vmap is exact
        self.supports_outer = not self.layout.formed

    def params(self, flat: torch.Tensor) -> dict:
        """name -> view of `flat` with the parameter's shape."""
        pieces = torch.split(flat, self.numels)
        return {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes)}

    def __call__(self, flat: torch.Tensor, *args, **kwargs):
        if flat is self.flat:
            return self.module(*args, **kwargs)
        return functional_call(self.module, (self.params(flat), self.buffers), args, kwargs)

    def to(self, device):
        if self.flat.device != torch.device(device):
            flat = self.flat.to(device)
            self.module.to(device)
            self._bind(flat)
        return self

    def batch_gradient(self, loss_fn, batch, scale: float = 1.0, accumulate: bool = False):
        """Gradient of scale * loss_fn(self.flat, batch)[0] by one backward into `self.grad`.

        Returns (self.grad (d,), loss scalar (detached, unscaled), aux). The returned tensor is the
        model's buffer: valid until the next call. `accumulate` adds to it instead of overwriting it.

        The parameters' gradients come from torch.autograd.grad and reach the buffer in ONE multi-tensor
        copy (or add): `backward()` into the `.grad` views would zero the buffer and then add each
        parameter's gradient on its own, one kernel per parameter (bench/dispatch_count.py). The values
        are the same: autograd sums a parameter's uses (tied weights) before either path writes it.
        """
        loss, aux = loss_fn(self.flat, batch)
        grads = torch.autograd.grad(loss * scale if scale != 1.0 else loss, self._trained, materialize_grads=True)
        with torch.no_grad():
            if self._frozen and not accumulate:
                self.grad.zero_()
            if accumulate:
                torch._foreach_add_(self._trained_grads, grads)
            else:
                torch._foreach_copy_(self._trained_grads, grads)
        return self.grad, loss.detach(), aux

    def outer_unit_gradients(self, unit_loss_fn, batch, out: torch.Tensor | None = None):
        """Per-unit gradients without vmap: one forward that records every layer's input and output,
        ONE backward of the summed unit losses to those outputs, then per-unit outer products.

        unit_loss_fn(flat, batch) -> (U,) losses, unit i's loss exactly as for a batch of that unit
        alone (units must not interact in the forward pass). Every layer input must have the units on
        dim 0 (e.g. GPT-2 needs position_ids of shape (U, T), not a broadcast (1, T)).
        out: optional (U, d) buffer to write into. Returns (grads (U, d), losses (U,) detached).
        """
        U, calls, losses = self._record_calls(unit_loss_fn, batch)
        grads = out if out is not None else torch.empty(U, self.d, dtype=self.flat.dtype, device=self.flat.device)
        with torch.no_grad():  # the products below need no autograd bookkeeping
            slots = _Slots(self, grads)
            # embeddings last: a tied weight's dense product (GPT-2's lm_head) is then copied into its slot
            # first and the embedding's few rows are scattered onto it, instead of zeroing the slot, scattering,
            # and adding the dense product (two more passes over a (U, V, C) slot)
            in_order = sorted(calls.items(), key=lambda call: self.layers[call[0]] == "Embedding")
            for module, (ins, outs) in in_order:  # a layer used several times (the MLP's rollout): one call
                kind = self.layers[module]
                apply_rule(module, kind, *calls_as_tokens(module, kind, ins, outs), slots)
            if len(slots.written) < len(self.offsets):
                slots.zero_untouched()  # parameters the forward did not use have zero gradient
        return grads, losses.detach()

    def _record_calls(self, unit_loss_fn, batch):
        """One recording forward and ONE backward of the summed unit losses to the layer outputs.
        Returns (U, {module: ([inputs], [output grads]) one entry per call}, losses (U,) with graph)."""
        if not self.supports_outer:
            raise ValueError("outer_unit_gradients needs a model made only of Linear, Conv1D, Embedding "
                             "and LayerNorm layers; use unit_gradients (vmap)")
        losses, records = self._recorded_forward(unit_loss_fn, batch, keep_grad=False)
        output_grads = torch.autograd.grad(losses.sum(), [output for _, _, output in records])
        return losses.shape[0], self._calls(records, output_grads, losses.shape[0], "outer_unit_gradients"), losses

    def _recorded_forward(self, unit_loss_fn, batch, keep_grad: bool):
        """unit_loss_fn(self.flat, batch) -> losses (U,), with every call of a layer with a rule recorded in
        call order as (module, input, output) (keep_grad: (module, input, [output gradient]), filled by the
        backward). Returns (losses, records)."""
        records = []
        for module in self.layers:  # record through the forward itself: cheaper than a forward hook per call
            module.forward = _recording_forward(module, records, keep_grad)
        try:
            losses = unit_loss_fn(self.flat, batch)
        finally:
            for module in self.layers:
                del module.forward  # the class's forward again
        return losses, records

    @staticmethod
    def _calls(records: list, output_grads: list, U: int, owner: str) -> dict:
        """{module: ([inputs], [output grads])}, one entry per call that got an output gradient (None: none)."""
        calls = {}
        for (module, inputs, _), output_grad in zip(records, output_grads):
            if output_grad is None:  # the output got no gradient: this call adds nothing
                continue
            check_units(owner, module, inputs, output_grad, U)
            ins, outs = calls.setdefault(module, ([], []))
            ins.append(inputs)
            outs.append(output_grad)
        return calls

    def sketch_blocks(self, min_numel: int) -> list:
        """(offset, rows, cols) of every 2-D weight of a Linear, Conv1D or Embedding layer with at least
        min_numel entries (a tied weight once; sorters.layer_rules.Layout.blocks): the matrices a GradientSketch
        may tensor-sketch so that `outer_unit_sketches` never forms them per unit. Empty unless outer
        products apply to the model."""
        return self.layout.blocks(min_numel) if self.supports_outer else []

    def outer_unit_sketches(self, unit_loss_fn, batch, sketch):
        """Per-unit sketches P g_u (U, D) from the layer records, without the (U, d) per-unit gradients.

        One recording forward, then ONE ordinary backward of the summed unit losses: it ADDS their
        gradient to `self.grad` (the update's share, as batch_gradient(accumulate=True) would), and hooks
        on the layer outputs keep the output gradients (the outputs themselves are not kept, unlike
        outer_unit_gradients: GPT-2's 50,257-way logits are freed as in a plain backward). Then, per layer,
        the layer's rule (sorters.layer_rules) writes into a BlockSink:

        - a weight that is a large TensorSketch block of `sketch` (a sorters.GradientSketch; more than
          formed_block_numel(block) entries) gets its per-unit sketches from the layer's inputs and output
          gradients, never formed (TensorBlock.add_outer; an Embedding's lookups: add_rows);
        - every other parameter (the coordinates outside the blocks, and small blocks) gets its per-unit
          gradients formed, one layer at a time, and they are scattered at once into the map's buckets
          (_SketchSlots): no (U, d_rest) buffer is made.

        So the result is `sketch` applied to the per-unit gradients, up to rounding.
        Returns (sketches (U, D), losses (U,) detached).
        """
        if not self.supports_outer:
            raise ValueError("outer_unit_sketches needs a model made only of Linear, Conv1D, Embedding and LayerNorm layers")
        losses, records = self._recorded_forward(unit_loss_fn, batch, keep_grad=True)
        U = losses.shape[0]
        losses.sum().backward()
        layout = self._sketch_layout(sketch)
        with torch.no_grad():
            calls = self._calls(records, [grad[0] if grad else None for _, _, grad in records], U,
                                "outer_unit_sketches")
            del records
            out = torch.zeros(U, sketch.dim, dtype=self.flat.dtype, device=self.flat.device)
            slots = _SketchSlots(out, layout["signed"](out.device))
            sink = BlockSink(slots, layout["records"], out)
            for module, (ins, outs) in calls.items():
                kind = self.layers[module]
                apply_rule(module, kind, *calls_as_tokens(module, kind, ins, outs), sink)
            slots.finish()
        return out, losses.detach()

    def _sketch_layout(self, sketch) -> dict:
        """For outer_unit_sketches: "records", {id(weight): its TensorBlock} for the weights that are blocks of
        `sketch` sketched from the records; "signed"(device), {id(p): (p.numel(),) int64 signed buckets
        2 h + (s < 0) of p's coordinates} for every other parameter; "numel", how many coordinates that is."""
        cache = self.__dict__.setdefault("_layouts", {})
        if id(sketch) in cache and cache[id(sketch)]["sketch"] is sketch:
            return cache[id(sketch)]
        blocks = {block.offset: block for block in sketch.blocks}
        records = {}  # the weights whose block is too large to form per unit
        for module, kind in self.layers.items():
            weight = getattr(module, "weight", None)
            block = blocks.get(self.offsets[id(weight)]) if kind in STRUCTURED_KINDS and weight is not None else None
            if block is not None and block.rows * block.cols > formed_block_numel(block):
                records[id(weight)] = block
        params = {id(p): p for module in self.layers for p in module.parameters(recurse=False) if id(p) not in records}
        params = sorted(params.values(), key=lambda p: self.offsets[id(p)])  # increasing coordinates
        formed, outside = {}, []  # the blocks formed per unit; the parameters outside every block
        for p in params:
            start, end = self.offsets[id(p)], self.offsets[id(p)] + p.numel()
            block = blocks.get(start)
            if block is not None and block.rows * block.cols == p.numel():
                formed[id(p)] = block
            elif any(b.offset < end and start < b.offset + b.rows * b.cols for b in sketch.blocks):
                raise ValueError(f"outer_unit_sketches: a block of the sketch covers part of the parameter at "
                                 f"coordinates {start}..{end - 1}; blocks must be whole weights (sketch_blocks)")
            else:
                outside.append(p)
        # their coordinates, increasing: the sketch's own `outside` when it has blocks (its kept tables)
        index = torch.cat([torch.arange(self.offsets[id(p)], self.offsets[id(p)] + p.numel()) for p in outside]) \
            if outside else torch.zeros(0, dtype=torch.long)
        moved = {}

        def signed(device):
            if device not in moved:
                tables = {}
                if outside:
                    buckets, signs = sketch.tables_at(index, device, torch.float32)
                    pieces = torch.split(2 * buckets + (signs < 0), [p.numel() for p in outside])
                    tables = {id(p): piece for p, piece in zip(outside, pieces)}
                for key, block in formed.items():
                    buckets, signs = block.hash_and_sign()
                    tables[key] = (2 * buckets + (signs < 0)).to(device)
                moved[device] = tables
            return moved[device]

        cache[id(sketch)] = {"sketch": sketch, "records": records, "signed": signed,
                             "numel": sum(p.numel() for p in params)}
        return cache[id(sketch)]


# a TensorSketch block of at most this many entries per bucket of the map is cheaper to form per unit (one
# batched product per layer) and scatter with the block's buckets than to sketch from the records (two FFTs
# of D per token; bench/sketch_gpt2.py --profile): 256 D, and at most 2^20 entries (the formed (U, rows,
# cols) gradients: 4 MB per unit in float32)
FORMED_BLOCK_PER_BUCKET = 256
FORMED_BLOCK_MAX_NUMEL = 2**20


def formed_block_numel(block) -> int:
    """The most entries a block may have and still be formed per unit by outer_unit_sketches."""
    return min(FORMED_BLOCK_PER_BUCKET * block.dim, FORMED_BLOCK_MAX_NUMEL)


def _recording_forward(module, records: list, keep_grad: bool = False):
    """module's own forward, appending (module, input, output) to records at each call; with keep_grad
    (module, input, a list that a hook on the output fills with the output's gradient) instead."""
    forward = type(module).forward

    def recording(inputs, *args, **kwargs):
        output = forward(module, inputs, *args, **kwargs)
        if keep_grad:
            grad = []
            output.register_hook(grad.append)
            records.append((module, inputs, grad))
        else:
            records.append((module, inputs, output))
        return output

    return recording


# whether outer_unit_gradients writes a parameter's first product or token sum straight into its columns of the
# (U, d) gradients (one kernel, out=) instead of forming it and copying it in (two); None: off the CPU only.
# cuBLAS writes a strided batch of matrices as they lie; the CPU's bmm into strided views loops over the units
# and costs several times a contiguous product plus one copy. bench/dispatch_count.py counts the GPU's way.
PRODUCTS_INTO_SLOTS: bool | None = None


class _Slots(ColumnSink):
    """outer_unit_gradients' sink (sorters.layer_rules.ColumnSink): the (U, *p.shape) views of each parameter's
    columns of a (U, d) gradient matrix, a parameter's products or token sums written straight into them where
    PRODUCTS_INTO_SLOTS says so (by default off the CPU)."""

    def __init__(self, model: FlatModel, grads: torch.Tensor):
        super().__init__(grads, model.offsets, products_into_slots(grads.device))
        self.model = model

    def zero_untouched(self) -> None:
        for module in self.model.layers:
            for p in module.parameters(recurse=False):
                if id(p) in self.offsets:
                    self.zeroed(p)


def products_into_slots(device: torch.device) -> bool:
    """Whether per-unit products and token sums go straight into their gradient columns on `device`
    (PRODUCTS_INTO_SLOTS, or by default: off the CPU)."""
    return device.type != "cpu" if PRODUCTS_INTO_SLOTS is None else PRODUCTS_INTO_SLOTS


class _SketchSlots(Sink):
    """outer_unit_sketches' sink for the parameters formed per unit: their per-unit gradients are not kept
    but scattered into sums (U, 2 D) at once, coordinate i into column 2 h_i + (s_i < 0) (the sign folded
    into the index: no signed copy of the gradients), and finish() adds the sums' even columns less their
    odd ones to out (U, D). signed: id(p) -> (p.numel(),) int64 2 h + (s < 0) of p's coordinates."""

    def __init__(self, out: torch.Tensor, signed: dict):
        self.out, self.signed = out, signed
        self.sums = out.new_zeros(out.shape[0], 2 * out.shape[1])

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Add the map of value (U, *p.shape), p's per-unit gradients or a part of them."""
        self.sums.index_add_(1, self.signed[id(p)], value.reshape(value.shape[0], -1))

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        """As _Slots.add_rows: g[u, t] (U, T, cols) into row ids[u, t] of p (rows, cols), without forming
        the (U, rows, cols) gradients: each value goes straight to its coordinate's column."""
        index = self.signed[id(p)].view(p.shape)[ids]  # (U, T, cols)
        self.sums.scatter_add_(1, index.reshape(ids.shape[0], -1), g.reshape(ids.shape[0], -1))

    def finish(self) -> None:
        self.out += self.sums[:, 0::2] - self.sums[:, 1::2]


def unit_gradients(loss_fn, flat: torch.Tensor, units):
    """Per-unit gradients in one vmapped pass (the general path: any model torch.func supports).

    loss_fn(flat, batch) -> (scalar mean loss over the batch, aux); units: a pytree of tensors
    whose dim 0 indexes U units. Each unit is passed as a batch of one.
    Returns (grads (U, d), losses (U,)).
    """
    def one_unit(flat, unit):
        loss, _ = loss_fn(flat, tree_map(lambda t: t.unsqueeze(0), unit))
        return loss, loss

    grads, losses = vmap(grad(one_unit, has_aux=True), in_dims=(None, 0))(flat, units)
    return grads, losses


def batch_gradient(loss_fn, flat: torch.Tensor, batch):
    """Gradient of the mean loss over a batch by torch.func. Returns (grad (d,), loss scalar, aux)."""
    def with_aux(flat):
        loss, aux = loss_fn(flat, batch)
        return loss, (loss.detach(), () if aux is None else aux)  # torch.func aux must be tensors

    g, (loss, aux) = grad(with_aux, has_aux=True)(flat)
    return g, loss, None if aux == () else aux
