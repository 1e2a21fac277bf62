r"""The one table of per-layer rules for per-unit gradients, used by the library (LayerSketch) and the engine
(engine.functional.FlatModel's outer_unit_gradients and outer_unit_sketches).

A "unit" is what one row of the result belongs to: an example (LayerSketch), or a block of examples (the
engine's units). ONE backward of the summed unit losses gives, at each layer output, every unit's own output
gradient on the units' rows (the units must not interact in the forward). A layer's per-unit parameter
gradient is then a function of the layer's input a and that output gradient g alone, token by token:

| kind      | parameter         | unit u's gradient                                 | written by the rule as |
|-----------|-------------------|---------------------------------------------------|------------------------|
| Linear    | weight (out, in)  | sum_t g_t a_t^T                                   | sink.add_outer(W, g, a)|
| Conv1D    | weight (in, out)  | sum_t a_t g_t^T  (transformers' y = a W + b)      | sink.add_outer(W, a, g)|
| Embedding | weight (rows, C)  | g_t added to row ids_t (none to padding_idx's row)| sink.add_rows(W, ids, g)|
| LayerNorm | weight (n,)       | sum_t g_t * xhat_t (xhat: the normalised input)   | sink.add_token_sum(w, g * xhat)|
| the other 3| bias (width,)    | sum_t g_t                                         | sink.add_token_sum(b, g)|

(A LayerNorm over several last dims: n is their product, its weight and bias keep their shape.)

(Opacus keeps its per-sample-gradient rules in one such registry.) The rules only say WHAT each parameter's
gradient is; a Sink says where it goes and in which form: the engine writes formed gradients into a (U, d)
matrix or scatters them into a sketch's buckets, LayerSketch into its (B, d_rest) buffer, and a BlockSink
sends a large weight's outer products and rows to its TensorSketch block (sorters.sketch.TensorBlock), which
sketches them without ever forming the (U, rows, cols) gradient.

`layer_kind` says which rule a module takes (by isinstance; None: no rule), and `Layout` which parameters come
from these rules, where each sits in the flat (d,) vector of the chosen parameters, and which weights a
structured sketch may make blocks (`Layout.blocks(min_numel)`).
"""
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sorters.sketch import TensorBlock


def layer_kind(module: torch.nn.Module) -> str | None:
    """'Linear', 'Conv1D' (transformers'), 'Embedding', 'LayerNorm', or None for a layer without a rule."""
    if isinstance(module, torch.nn.Linear):
        return "Linear"
    if isinstance(module, torch.nn.Embedding):
        # with scale_grad_by_freq an example's gradient depends on the other examples' ids
        return None if module.scale_grad_by_freq else "Embedding"
    if isinstance(module, torch.nn.LayerNorm):
        return "LayerNorm"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return "Conv1D"
    return None


# ------------------------------------------------------------------------------------------- sinks

class Sink:
    """Where the rules write every unit's gradient of one parameter p. Subclasses define `add`; the others
    fall back on it by forming the gradient (a subclass may override them to avoid that).

    wants(p):               whether p's gradient is wanted at all (a rule skips the work for the others);
    add(p, value):          add value (U, *p.shape) to the units' gradients of p;
    add_outer(p, l, r):     add sum_t l[u, t] r[u, t]^T, l (U, T, rows), r (U, T, cols), p (rows, cols);
    add_rows(p, ids, g):    add g[u, t] (U, T, cols) to row ids[u, t] (U, T) of p (rows, cols) (the tokens
                            may take several dims: ids (U, T...), g (U, T..., cols));
    add_token_sum(p, v):    add sum_t v[u, t], v (U, T, p.numel()) (a bias, a LayerNorm weight).
    """

    def wants(self, p: torch.Tensor) -> bool:
        return True

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        raise NotImplementedError

    def add_outer(self, p: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        self.add(p, torch.bmm(left.transpose(1, 2), right))

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        self.add(p, scatter_rows(g.new_zeros(ids.shape[0], *p.shape), ids, g))

    def add_token_sum(self, p: torch.Tensor, values: torch.Tensor) -> None:
        self.add(p, values.sum(1).view(values.shape[0], *p.shape))


class BlockSink(Sink):
    """Sends the weights that are TensorSketch blocks to their block (never forming their (U, rows, cols)
    gradients: TensorBlock.add_outer / add_rows add their sketches to out (U, D)), and every other parameter
    to the sink `formed`. blocks: id(weight) -> its TensorBlock."""

    def __init__(self, formed: Sink, blocks: "dict[int, TensorBlock]", out: torch.Tensor) -> None:
        self.formed, self.blocks, self.out = formed, blocks, out

    def wants(self, p: torch.Tensor) -> bool:
        return id(p) in self.blocks or self.formed.wants(p)

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        self.formed.add(p, value)

    def add_token_sum(self, p: torch.Tensor, values: torch.Tensor) -> None:
        self.formed.add_token_sum(p, values)

    def add_outer(self, p: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        block = self.blocks.get(id(p))
        if block is None:
            self.formed.add_outer(p, left, right)
        else:
            block.add_outer(left, right, self.out)

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        block = self.blocks.get(id(p))
        if block is None:
            self.formed.add_rows(p, ids, g)
        else:
            block.add_rows(ids, g, self.out)


class AliasSink(Sink):
    """A sink seen through a layer's held copies: the rules write to the tensor the layer holds (under FSDP2,
    a gathered copy of a sharded parameter: `Layout.held_copies`), and `sink` gets the chosen parameter it
    stands for. aliases: {id(held tensor): chosen parameter}."""

    def __init__(self, sink: Sink, aliases: dict[int, torch.Tensor]) -> None:
        self.sink, self.aliases = sink, aliases

    def _chosen(self, p: torch.Tensor) -> torch.Tensor:
        return self.aliases.get(id(p), p)

    def wants(self, p: torch.Tensor) -> bool:
        return self.sink.wants(self._chosen(p))

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        self.sink.add(self._chosen(p), value)

    def add_token_sum(self, p: torch.Tensor, values: torch.Tensor) -> None:
        self.sink.add_token_sum(self._chosen(p), values)

    def add_outer(self, p: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        self.sink.add_outer(self._chosen(p), left, right)

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        self.sink.add_rows(self._chosen(p), ids, g)


class ColumnSink(Sink):
    """Every unit's gradient of a parameter p written into p's columns of a (U, d) matrix `out` (columns
    offsets[id(p)] onward, p.numel() of them in p's layout), without zeroing `out` first: a parameter's first
    contribution is copied in (or, `into_slots`: written there by its product or token sum itself, out=: one
    kernel instead of two), later ones (a tied weight, a layer used twice) are added, and rows are scattered
    onto what is there (onto zeros when nothing came first). `written` holds id(p) of the parameters written."""

    def __init__(self, out: torch.Tensor, offsets: dict[int, int], into_slots: bool) -> None:
        self.out, self.offsets, self.into_slots = out, offsets, into_slots
        self.written: set[int] = set()

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """p's columns of out as (U, *p.shape)."""
        offset = self.offsets[id(p)]
        return self.out[:, offset:offset + p.numel()].view(self.out.shape[0], *p.shape)

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Add value (U, *p.shape) to p's gradients."""
        if id(p) in self.written:
            self.view(p).add_(value)
        else:
            self.view(p).copy_(value)
            self.written.add(id(p))

    def add_outer(self, p: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        """Add sum_t left[u, t] right[u, t]^T (left (U, T, rows), right (U, T, cols)) to p's (rows, cols)."""
        if self.into_slots and id(p) not in self.written:
            torch.bmm(left.transpose(1, 2), right, out=self.view(p))
            self.written.add(id(p))
        else:
            super().add_outer(p, left, right)

    def add_token_sum(self, p: torch.Tensor, values: torch.Tensor) -> None:
        """Add sum_t values[u, t] (values (U, T, p.numel())) to p's gradients."""
        if self.into_slots and id(p) not in self.written:
            torch.sum(values, 1, out=self.view(p).view(values.shape[0], -1))
            self.written.add(id(p))
        else:
            super().add_token_sum(p, values)

    def zeroed(self, p: torch.Tensor) -> torch.Tensor:
        """p's view, zeroed if nothing was written to it yet (for in-place scatter-adds)."""
        view = self.view(p)
        if id(p) not in self.written:
            view.zero_()
            self.written.add(id(p))
        return view

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        """Add g[u, t...] (U, T..., cols) to row ids[u, t...] of unit u's gradient of p (rows, cols): an embedding."""
        scatter_rows(self.zeroed(p), ids, g)


@functools.lru_cache(maxsize=16)
def _unit_numbers(units: int, device: torch.device) -> torch.Tensor:
    """arange(units) on device, made once per size and device (scatter_rows' first index)."""
    return torch.arange(units, device=device)


def scatter_rows(view: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """view (U, rows, cols) += g[u, t...] (U, T..., cols) at row ids[u, t...] (U, T...), in place; returns view.
    The tokens may take several dims (T...), as they lie: one scatter, no copy of g or ids."""
    # (a compiled graph makes its own: dynamo traces the cache's function itself)
    numbers = _unit_numbers.__wrapped__ if torch.compiler.is_compiling() else _unit_numbers
    units = numbers(ids.shape[0], ids.device).view(-1, *[1] * (ids.dim() - 1))
    return view.index_put_((units, ids), g, accumulate=True)


# ------------------------------------------------------------------------------------------- the rules

def _add_bias(module: torch.nn.Module, g: torch.Tensor, sink: Sink) -> None:
    bias = getattr(module, "bias", None)
    if bias is not None and sink.wants(bias):
        sink.add_token_sum(bias, g)


def _linear_rule(module: torch.nn.Linear, a: torch.Tensor, g: torch.Tensor, sink: Sink) -> None:
    """nn.Linear, y = a W^T + b with W (out, in); a (U, T, in), g (U, T, out)."""
    if sink.wants(module.weight):
        sink.add_outer(module.weight, g, a)
    _add_bias(module, g, sink)


def _conv1d_rule(module: torch.nn.Module, a: torch.Tensor, g: torch.Tensor, sink: Sink) -> None:
    """transformers' Conv1D, y = a W + b with W (in, out); a (U, T, in), g (U, T, out)."""
    weight = cast(torch.Tensor, module.weight)  # a Parameter (transformers is not imported here to say so)
    if sink.wants(weight):
        sink.add_outer(weight, a, g)
    _add_bias(module, g, sink)


def _embedding_rule(module: torch.nn.Embedding, ids: torch.Tensor, g: torch.Tensor, sink: Sink) -> None:
    """nn.Embedding; ids (U, T...) the looked-up rows, g (U, T..., C) (the tokens may take several dims)."""
    if module.padding_idx is not None:  # F.embedding gives the padding row no gradient
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    if sink.wants(module.weight):
        sink.add_rows(module.weight, ids, g)


def _layer_norm_rule(module: torch.nn.LayerNorm, a: torch.Tensor, g: torch.Tensor, sink: Sink) -> None:
    """nn.LayerNorm over its last dims, flattened to n entries; a (U, T, n), g (U, T, n)."""
    weight, bias = module.weight, module.bias
    if weight is not None and sink.wants(weight):
        xhat = F.layer_norm(a, (a.shape[-1],), eps=module.eps)
        sink.add_token_sum(weight, g * xhat)
    if bias is not None and sink.wants(bias):
        sink.add_token_sum(bias, g)


# kind -> rule(module, a, g, sink); each rule takes the module of its kind (layer_kind)
RULES: dict[str, Callable[..., None]] = {"Linear": _linear_rule, "Conv1D": _conv1d_rule, "Embedding": _embedding_rule,
                                         "LayerNorm": _layer_norm_rule}
STRUCTURED_KINDS = ("Linear", "Conv1D", "Embedding")  # the layers whose 2-D weight may be a TensorSketch block


def tokens(module: torch.nn.Module, kind: str, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's input a (U, ..., in) (ids (U, ...) for an Embedding) and output gradient g (U, ..., out)
    as the rule's (U, T, in) and (U, T, out) (ids (U, T)): every position of the call a token."""
    U = a.shape[0]
    if kind == "Embedding":
        ids = a.reshape(U, -1)
        return ids, g.reshape(U, ids.shape[1], -1)
    if kind == "LayerNorm":
        n = math.prod(cast(torch.nn.LayerNorm, module).normalized_shape)
        return a.reshape(U, -1, n), g.reshape(U, -1, n)
    return a.reshape(U, -1, a.shape[-1]), g.reshape(U, -1, g.shape[-1])


def calls_as_tokens(module: torch.nn.Module, kind: str, inputs: list[torch.Tensor],
                    grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every call of one layer (a layer used several times) as ONE token batch, the calls' tokens side by
    side on dim 1, so the rule runs once: inputs, grads lists of each call's a and g (as `tokens`)."""
    if len(inputs) > 1 and kind != "Embedding" and all(t.dim() == 2 for t in inputs + grads):
        # (U, features) calls, one token each (the MLP's rollout): one stack each instead of views and a cat
        return torch.stack(inputs, dim=1), torch.stack(grads, dim=1)
    pairs = [tokens(module, kind, a, g) for a, g in zip(inputs, grads)]
    if len(pairs) == 1:
        return pairs[0]
    return torch.cat([a for a, _ in pairs], dim=1), torch.cat([g for _, g in pairs], dim=1)


def apply_rule(module: torch.nn.Module, kind: str, a: torch.Tensor, g: torch.Tensor, sink: Sink) -> None:
    """Add the units' gradients of module's parameters from its tokens a, g (as `tokens` gives them)."""
    RULES[kind](module, a, g, sink)


def check_units(owner: str, module: torch.nn.Module, a: torch.Tensor, g: torch.Tensor, U: int,
                what: str = "units") -> None:
    """A recorded call must have the U units (examples) on dim 0 of its input and output gradient."""
    if a.shape[0] != U or g.shape[0] != U:
        raise ValueError(f"{owner}: {type(module).__name__} got an input of shape {tuple(a.shape)} for {U} {what}: "
                         f"every recorded layer's input needs the {what} on dim 0")


# ------------------------------------------------------------------------------------------- broadcast inputs

def examples_of_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int = 0) -> int | None:
    """The examples in one call of a model: the size on batch_dim that most of its tensor arguments share, the
    larger on a tie (input_ids, labels, attention_mask (B, T) beside position_ids (1, T) or a head_mask
    (layers, heads): B; `model(x)`: x's), None without any tensor argument."""
    sizes = [t.shape[batch_dim] for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() > batch_dim]
    return max(sizes, key=lambda size: (sizes.count(size), size), default=None)


def spread_over_examples(a: torch.Tensor, output: torch.Tensor, examples: int | None,
                         batch_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A recorded call whose input has ONE row on the examples' dim while the model's call has B > 1 examples:
    a layer applied to something shared by the batch, whose output the model broadcasts over it (GPT-2's
    position embedding of its default (1, T) position_ids, added to the (B, T, C) token embeddings).
    Returns (a, output) expanded to B rows on batch_dim (views, no copy), the output so that the model
    continues from it: the broadcast then adds nothing, so the forward is unchanged, and the gradient reaching
    the expanded output is every example's own output gradient, row by row (a broadcast output's would be
    their sum, from which no example's can be recovered). Exact when the model uses the output as a broadcast
    over the examples (row b of the expansion enters example b's computation only), as transformers models
    do. Any other call is returned as it is."""
    if not (examples and examples > 1 and torch.is_tensor(a) and torch.is_tensor(output)
            and a.dim() > batch_dim and a.shape[batch_dim] == 1
            and output.dim() > batch_dim and output.shape[batch_dim] == 1):
        return a, output

    def expanded(t: torch.Tensor) -> torch.Tensor:
        return t.expand(*(examples if i == batch_dim else -1 for i in range(t.dim())))

    return expanded(a), expanded(output)


# ------------------------------------------------------------------------------------------- the layout

class Layout:
    """Which chosen parameter is computed how, for a model and its chosen [(name, parameter)] (the flat (d,)
    vector's order; the engine's FlatModel passes every parameter, LayerSketch the selected ones).

    offsets:  id(parameter) -> its first coordinate in the flat vector; d its length.
    recorded: the ids of the chosen parameters every module holding them has a rule for (their per-unit
              gradients come from the rules; a tied weight counts when every layer sharing it has one).
    layers:   {module: its kind} of every module owning a recorded parameter (the layers to record).
    formed:   [(name, parameter)] of the chosen parameters without a rule.
    """

    def __init__(self, model: torch.nn.Module, chosen: list[tuple[str, torch.Tensor]]) -> None:
        self.offsets: dict[int, int] = {}
        offset = 0
        for _, p in chosen:
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.d = offset
        owners: dict[int, list[str | None]] = {}  # id(parameter) -> the layer kinds of every module that holds it
        for module in model.modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(layer_kind(module))
        self.recorded = {key for key in self.offsets if None not in owners.get(key, [None])}
        # (a module holding a recorded parameter has a kind: the walrus only tells the type checker so)
        self.layers: dict[torch.nn.Module, str] = {
            module: kind for module in model.modules()
            if any(id(p) in self.recorded for p in module.parameters(recurse=False))
            and (kind := layer_kind(module)) is not None}
        self.formed = [(name, p) for name, p in chosen if id(p) not in self.recorded]
        # each recorded layer's own parameters by attribute name: under FSDP2 (fully_shard) a layer holds a
        # gathered copy of its sharded weight during the backward, another object (`held_copies`)
        self.own = {module: list(module.named_parameters(recurse=False)) for module in self.layers}

    def held_copies(self, module: torch.nn.Module) -> dict[int, torch.Tensor]:
        """{id(tensor): chosen parameter} for each parameter of a recorded layer that the layer now holds as
        ANOTHER tensor: FSDP2's gathered (unsharded) copy of a sharded parameter, which the layer holds during
        its backward (a root's layers during the forward too). Empty for a model that was not sharded. The
        rules write to the tensor the layer holds; an `AliasSink` sends that to the chosen parameter."""
        return {id(held): p for name, p in self.own[module] if (held := getattr(module, name)) is not p}

    def blocks(self, min_numel: int) -> list[tuple[int, int, int]]:
        """(offset, rows, cols) of every recorded 2-D weight of a Linear, Conv1D or Embedding with at least
        min_numel entries, a tied one once, in increasing offset: the TensorSketch blocks of a structured map."""
        found: dict[int, tuple[int, int, int]] = {}
        for module, kind in self.layers.items():
            weight = getattr(module, "weight", None)
            if kind in STRUCTURED_KINDS and weight is not None and id(weight) in self.recorded \
                    and weight.dim() == 2 and weight.numel() >= min_numel:
                found[id(weight)] = (self.offsets[id(weight)], *weight.shape)
        return sorted(found.values())
