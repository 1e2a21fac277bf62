r"""Per-example gradients of an ordinary nn.Module, flattened to (batch, d), for the balancing sorters.

    grads_of = PerExampleGrads(model, loss_fn)                   # every trainable parameter
    grads_of = PerExampleGrads(model, loss_fn, params=r"^head\.")  # a cheaper subset: names matching
    g = grads_of(inputs, targets)                                # (B, grads_of.d)
    sketched = PerExampleGrads(model, loss_fn, sketch_dim=256)     # (B, 256): CountSketches of them
    grads_of = PerExampleLossGrads(hf_model, chunk_size=8)         # the model's own loss, a dict batch:
    g = grads_of({"input_ids": ids, "attention_mask": mask, "labels": labels})   # (B, grads_of.d)

One torch.func pass: `vmap(grad(loss of one example))` over the batch, with the module run through
`functional_call` at its current parameters (read at every call, so optimizer steps are seen). It is
computed besides the ordinary backward pass that trains the model; it never touches `.grad`.

Cost. Memory: the (B, d) result, B * d floats per step (plus vmap's per-example intermediates, which
`chunk_size` bounds), where d counts only the selected parameters. Time: `bench/per_example_grads.py`,
this 2-core CPU, one thread, medians (measured while other jobs kept both cores busy, so +-30 %):
  logistic regression as LR-HMDA, d = 26, B = 16:   1.1-1.4 ms   (loss.backward() of the batch: 0.19 ms)
  MLP 784-512-512-10, d = 669,706, B = 64:          390-450 ms   (backward: 8-9 ms); 280 ms with `out`
  the same MLP, last layer only (params, d = 5,130):  8 ms
At small d the cost is torch.func's per-call overhead, at large d writing B * d floats (several copies).
Balancing with CD-GraB then reads each example's d floats a few times (sorters/balance.py). When d is too large,
pass `params` to balance on a subset (e.g. the last layers): the order is then chosen from those
coordinates of the gradients only.

The model must treat examples independently: no BatchNorm in training mode (it mixes the batch;
use GroupNorm / LayerNorm or eval-mode BatchNorm), and no dropout in training mode (vmap refuses
random operations): call it with the model in eval mode, i.e. order by the gradients without dropout.
"""
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.utils._pytree import tree_map

from sorters.checks import check_int, check_module, check_no_dropout, check_seed
from sorters.layer_sketch import STRUCTURED_MIN_NUMEL, LayerSketch, selected_parameters
from sorters.sketch import GradientSketch
from sorters.thresholds import check_min_numel


class PerExampleGrads:
    """Callable: (inputs, targets) -> per-example gradients (B, d) of `loss_fn(model(inputs), targets)`.

    Args:
        model: an nn.Module (a DistributedDataParallel wrapper is unwrapped: its `.module` is used). It must
            be a pure function of its parameters and inputs (vmap replays it per example): dropout in
            training mode with p > 0 is refused with a ValueError, BatchNorm only works in eval mode.
        loss_fn: loss_fn(outputs, targets) -> scalar mean loss over the batch, as used for training; it
            is called on batches of ONE example (outputs and targets keep a batch dim of size 1).
        params: which parameters to differentiate: None (every parameter with requires_grad), a regular
            expression, or a list of them; a parameter is kept when `re.search` finds any of them in
            its name (names as in `model.named_parameters()`).
        chunk_size: examples per vmap chunk (None: the whole batch at once); smaller uses less memory.
        sketch_dim: 0 (the default): return the gradients. D > 0: return their sketches under
            `GradientSketch(d, D, sketch_seed)` (sorters/sketch.py), (B, D); the (B, d) gradients
            are still formed first (the sketch saves communication and balancing, not this). Give
            `CDGraBSampler(..., sketch_dim=D, seed=sketch_seed)` the same D and seed: it then takes
            these sketches as they are.
        sketch_seed: seeds the sketch (the sampler's `seed`).
        structured: with sketch_dim, build the sketches layer by layer from ONE batched forward and backward
            (sorters/layer_sketch.py, LayerSketch), never forming the per-example gradients of the
            Linear / Conv1D / Embedding weights of at least `min_numel` entries; the map is then
            GradientSketch(d, D, sketch_seed, blocks=layer_blocks(model, params, min_numel)), and the
            loss of example i is loss_fn on example i's rows of the batched outputs (a batch of one).
            Every layer input must have the examples on dim 0. Give the sampler these (B, D) sketches:
            its own map (for (B, d) gradients) is the plain CountSketch, not this one.

    Attributes:
        names: the selected parameter names, in `named_parameters()` order.
        d: their total number of elements, in that order.
        sketch: the GradientSketch, or None.
        dim: the number of columns of the result: `sketch.dim`, else d.

    Raises:
        TypeError: a model that is not an nn.Module, a loss_fn that is not callable, or an argument of the
            wrong type (one line).
        ValueError: params that select no parameter, or a value out of range (one line).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 params: str | Sequence[str] | None = None, chunk_size: int | None = None, sketch_dim: int = 0,
                 sketch_seed: int = 0, structured: bool = False, min_numel: int = STRUCTURED_MIN_NUMEL) -> None:
        owner = type(self).__name__
        check_module(owner, model)
        if loss_fn is not None and not callable(loss_fn) or loss_fn is None and owner == "PerExampleGrads":
            raise TypeError(f"{owner}: loss_fn must be callable (outputs, targets) -> scalar loss, got {loss_fn!r}")
        chunk_size = check_int(owner, "chunk_size", chunk_size, 1, none_ok=True)
        sketch_dim = check_int(owner, "sketch_dim", sketch_dim, 0)
        sketch_seed = check_seed(owner, sketch_seed, "sketch_seed")
        min_numel = check_min_numel(owner, min_numel)
        if not isinstance(structured, bool):
            raise TypeError(f"{owner}: structured must be True or False, got {structured!r}")
        model = getattr(model, "module", model) if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else model
        self.model, self.loss_fn, self.chunk_size = model, loss_fn, chunk_size
        chosen = selected_parameters(model, params, "PerExampleGrads")
        self.names = [name for name, _ in chosen]
        self.d = sum(p.numel() for _, p in chosen)
        if sketch_dim < 0:
            raise ValueError(f"PerExampleGrads: sketch_dim must be >= 0 (0: no sketch), got {sketch_dim}")
        self.sketch: GradientSketch | None = GradientSketch(self.d, sketch_dim, sketch_seed) if sketch_dim else None
        self.layers: LayerSketch | None = None  # the LayerSketch of structured=True
        if structured:
            if not sketch_dim:
                raise ValueError(f"{type(self).__name__}: structured=True needs sketch_dim > 0")
            self.layers = LayerSketch(model, sketch_dim, sketch_seed, params, min_numel)
            self.sketch = self.layers.sketch
        self.dim = self.sketch.dim if self.sketch else self.d

    def __call__(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The per-example gradients of a batch.

        Args:
            inputs: a tensor (B, ...) or a tuple of them (positional arguments of the model), dim 0 the examples.
            targets: (B, ...), the examples' targets.
            out: optional (B, dim) buffer to write into and return. Reusing one saves, at large B * d, the page
                faults of a fresh allocation every step.

        Returns:
            The (B, d) gradients (B, dim when sketched), detached, in the parameters' dtype.

        Raises:
            ValueError: the model draws random numbers in its forward (dropout in training mode) (one line).
        """
        self._refuse_dropout()
        loss_fn = self.loss_fn
        assert loss_fn is not None  # __init__ refuses None here; PerExampleLossGrads has a __call__ of its own
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if self.layers is not None:
            sketches, _ = self.layers(lambda: self._batched_losses(inputs, targets))
            return sketches if out is None else out.copy_(sketches)
        selected = set(self.names)
        named = dict(self.model.named_parameters())
        differentiated = {name: named[name].detach() for name in self.names}
        fixed = {name: p.detach() for name, p in named.items() if name not in selected}
        buffers = dict(self.model.named_buffers())

        def one_example_loss(differentiated: dict[str, torch.Tensor], example_inputs: tuple[torch.Tensor, ...],
                             example_target: torch.Tensor) -> torch.Tensor:
            as_batch = tree_map(lambda t: t.unsqueeze(0), (example_inputs, example_target))
            outputs = functional_call(self.model, ({**fixed, **differentiated}, buffers), as_batch[0])
            return loss_fn(outputs, as_batch[1])

        try:
            grads = vmap(grad(one_example_loss), in_dims=(None, 0, 0), chunk_size=self.chunk_size)(
                differentiated, inputs, targets)
        except RuntimeError as error:  # random ops the module check cannot see (F.dropout in a forward)
            if "randomness" not in str(error):
                raise
            raise _randomness_error(type(self).__name__, error) from None
        batch = targets.shape[0]
        if self.sketch is None or self.sketch.is_identity:
            return torch.cat([grads[name].reshape(batch, -1) for name in self.names], dim=1, out=out)
        sketches = self.sketch(torch.cat([grads[name].reshape(batch, -1) for name in self.names], dim=1))
        return sketches if out is None else out.copy_(sketches)

    def _batched_losses(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
        """(B,) per-example losses from ONE batched forward: loss_fn on each example's rows of the outputs,
        as a batch of one (vmap over the examples: the graph stays the batched forward's)."""
        loss_fn = self.loss_fn
        assert loss_fn is not None  # structured=True is PerExampleGrads', whose loss_fn __init__ checked

        def one_example_loss(example_outputs: object, example_target: torch.Tensor) -> torch.Tensor:
            as_batch = tree_map(lambda t: t.unsqueeze(0), (example_outputs, example_target))
            return loss_fn(*as_batch)

        return vmap(one_example_loss)(self.model(*inputs), targets)

    def _refuse_dropout(self) -> None:
        """Dropout in training mode makes each example's loss random, which vmap refuses with a message
        about 'randomness' that does not say what to do; name the module and the fix instead (the layer
        records' line: sorters.checks.check_no_dropout)."""
        check_no_dropout(type(self).__name__, self.model)


def _randomness_error(owner: str, error: RuntimeError) -> ValueError:
    """torch.func's refusal of a random op, as one line that says what to change."""
    return ValueError(f"{owner}: the model draws random numbers in its forward ({error}); "
                      "per-example gradients need a model that is a pure function of its parameters: "
                      "turn the random op off (e.g. dropout p = 0, or model.eval()) while computing them")


def per_example_grads(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
                      inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor,
                      params: str | Sequence[str] | None = None) -> torch.Tensor:
    """One-off form of PerExampleGrads(model, loss_fn, params)(inputs, targets).

    Args:
        model: as for PerExampleGrads.
        loss_fn: loss_fn(outputs, targets) -> the scalar mean loss of a batch, as for PerExampleGrads.
        inputs: a tensor (B, ...) or a tuple of them, dim 0 the examples.
        targets: (B, ...), the examples' targets.
        params: which parameters to differentiate, as for PerExampleGrads.

    Returns:
        The (B, d) per-example gradients, detached.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> grads = per_example_grads(model, torch.nn.functional.cross_entropy, torch.randn(4, 3),
        ...                           torch.tensor([0, 1, 1, 0]))
        >>> tuple(grads.shape)
        (4, 8)
    """
    return PerExampleGrads(model, loss_fn, params)(inputs, targets)


class PerExampleLossGrads(PerExampleGrads):
    r"""Callable: a dict batch -> per-example gradients (B, d) of the loss the model computes itself,
    `model(**example).loss`, as a `transformers` model does when called with `labels`:

        grads_of = PerExampleLossGrads(model, params=r"\.h\.11\.", chunk_size=8)
        g = grads_of({"input_ids": ids, "attention_mask": mask, "labels": labels})  # (B, grads_of.d)
        g, losses = grads_of(batch, return_losses=True)                             # and (B,)

    Each example is run as a batch of one (its row of every tensor, at the padded length T), so its loss
    is exactly what `model(**{k: v[i:i+1]}).loss` gives: for a causal LM with labels = -100 at the pads,
    the mean over that example's own labelled tokens (an example with none has loss nan and gradient nan).

    Args:
        model: as for PerExampleGrads (there is no loss_fn).
        params: as for PerExampleGrads.
        chunk_size: the examples per vmap call (None: the whole batch); the chunks are written straight into
            the result's rows, so the result equals the unchunked one and peak memory is the (B, d) result plus
            one chunk's per-example intermediates.
        sketch_dim: as for PerExampleGrads.
        sketch_seed: as for PerExampleGrads.

    The model must be traceable by torch.func; with transformers that means (each refused with a one-line
    ValueError, before any work where the model's attributes tell, else when torch.func fails):

      - `attn_implementation="eager"` when the batch has an `attention_mask`: sdpa reads the mask's
        values in Python (to skip an all-ones mask), which vmap cannot do (`model.set_attn_implementation
        ("eager")` switches a loaded model); sdpa without a mask is traced fine;
      - no gradient checkpointing (`model.activation_checkpointing_disable()`, before transformers 5
        `gradient_checkpointing_disable()`): its hook on the input embeddings calls `requires_grad_` inside
        the transform, in eval mode too;
      - no dropout in training mode (p > 0), as for PerExampleGrads.
    """

    def __init__(self, model: torch.nn.Module, params: str | Sequence[str] | None = None,
                 chunk_size: int | None = None, sketch_dim: int = 0, sketch_seed: int = 0) -> None:
        super().__init__(model, None, params, chunk_size, sketch_dim, sketch_seed)
        # structured=True is not offered here: the model's own loss is the batch's token mean, from which
        # the per-example losses LayerSketch needs are not recoverable in general
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"PerExampleLossGrads: chunk_size must be >= 1 (None: the whole batch), "
                             f"got {chunk_size}")

    # A dict batch instead of PerExampleGrads' (inputs, targets): the subclass shares the constructor's
    # parameter selection and sketch, not the call (hence the override mypy would refuse)
    @overload  # type: ignore[override]
    def __call__(self, batch: Mapping[str, Any], out: torch.Tensor | None = None,
                 return_losses: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def __call__(self, batch: Mapping[str, Any], out: torch.Tensor | None = None, *,
                 return_losses: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def __call__(self, batch: Mapping[str, Any], out: torch.Tensor | None = None,
                 return_losses: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def __call__(self, batch: Mapping[str, Any], out: torch.Tensor | None = None,
                 return_losses: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The per-example gradients of a dict batch, of the model's own loss.

        Args:
            batch: keyword arguments of the model; every tensor's dim 0 is the examples (B, ...), e.g.
                input_ids, attention_mask, labels (B, T); other values are passed unchanged to every example.
            out: optional (B, dim) buffer to write into and return (see PerExampleGrads).
            return_losses: also return the per-example losses.

        Returns:
            The (B, d) gradients (B, dim when sketched), detached, in the parameters' dtype; with return_losses
            the pair (gradients, the (B,) per-example losses, detached, in the loss's dtype: transformers
            computes a causal LM's loss in float32 even for a float64 model).

        Raises:
            ValueError: tensors without one common dim 0, an `out` of another shape, a model that returns no
                scalar loss, or one torch.func cannot trace (one line that says what to change).
        """
        tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
        constants = {key: value for key, value in batch.items() if key not in tensors}
        sizes = {key: value.shape[0] if value.dim() else None for key, value in tensors.items()}
        if not tensors or len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError("PerExampleLossGrads: the batch needs tensors with one common dim 0 (the examples); "
                             f"got dim 0 sizes {sizes}")
        self._refuse_untraceable("attention_mask" in tensors)
        size = next(size for size in sizes.values() if size is not None)  # B: every tensor's (checked above)
        selected = set(self.names)
        named = dict(self.model.named_parameters())
        differentiated = {name: named[name].detach() for name in self.names}
        fixed = {name: p.detach() for name, p in named.items() if name not in selected}
        buffers = dict(self.model.named_buffers())
        dtype, device = differentiated[self.names[0]].dtype, differentiated[self.names[0]].device
        if out is None:
            out = torch.empty(size, self.dim, dtype=dtype, device=device)
        elif out.shape != (size, self.dim):
            raise ValueError(f"PerExampleLossGrads: out must have shape ({size}, {self.dim}), "
                             f"got {tuple(out.shape)}")
        losses: list[torch.Tensor] = []

        def one_example_loss(differentiated: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
            as_batch = {key: value.unsqueeze(0) for key, value in example.items()}
            outputs = functional_call(self.model, ({**fixed, **differentiated}, buffers), (),
                                      {**as_batch, **constants})
            return _loss_of(outputs)

        per_example = vmap(grad_and_value(one_example_loss), in_dims=(None, 0))
        step = self.chunk_size or size
        for start in range(0, size, step):
            stop = min(start + step, size)
            chunk = {key: value[start:stop] for key, value in tensors.items()}
            try:
                grads, chunk_losses = per_example(differentiated, chunk)
            except RuntimeError as error:
                raise self._untraceable_error(error) from None
            rows = [grads[name].reshape(stop - start, -1) for name in self.names]
            if self.sketch is None or self.sketch.is_identity:
                torch.cat(rows, dim=1, out=out[start:stop])  # straight into the rows: no (B, d) copy
            else:
                out[start:stop] = self.sketch(torch.cat(rows, dim=1))
            losses.append(chunk_losses.detach())
            del grads, rows  # one chunk's gradients alive at a time
        return (out, torch.cat(losses)) if return_losses else out

    def _refuse_untraceable(self, has_attention_mask: bool) -> None:
        """The failures the model's attributes predict, refused before any work (each observed with
        transformers 5.23's GPT-2 under torch 2.13: see the class docstring)."""
        self._refuse_dropout()
        # transformers 5 names it activation checkpointing; the older name is deprecated there (it warns)
        checkpointing = getattr(self.model, "is_activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = getattr(self.model, "is_gradient_checkpointing", False)
        if checkpointing:
            raise ValueError("PerExampleLossGrads: the model has gradient checkpointing on, which torch.func "
                             "cannot trace; call model.gradient_checkpointing_disable() (transformers 5: "
                             "model.activation_checkpointing_disable()) while computing them")
        attention = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if has_attention_mask and attention == "sdpa":
            raise ValueError("PerExampleLossGrads: sdpa attention with an attention_mask cannot be traced by "
                             "torch.func (it reads the mask's values); load the model with "
                             "attn_implementation=\"eager\" or call model.set_attn_implementation(\"eager\")")

    def _untraceable_error(self, error: RuntimeError) -> Exception:
        """torch.func's error for what the up-front checks could not see, as one line that says what to change."""
        message = str(error)
        if "randomness" in message:
            return _randomness_error("PerExampleLossGrads", error)
        if "requires_grad_" in message:
            return ValueError("PerExampleLossGrads: the model calls requires_grad_ in its forward (gradient "
                              "checkpointing does), which torch.func cannot trace; turn it off "
                              "(model.gradient_checkpointing_disable(), transformers 5: "
                              "model.activation_checkpointing_disable()) while computing them")
        if "data-dependent control flow" in message or ".item()" in message:
            return ValueError("PerExampleLossGrads: the model's forward branches on tensor values, which "
                              "torch.func cannot trace; with transformers, use attn_implementation=\"eager\" "
                              "(model.set_attn_implementation(\"eager\")): sdpa does with an attention_mask")
        return error


def _loss_of(outputs: object) -> torch.Tensor:
    """The scalar loss of a model's outputs: `outputs.loss` (a transformers ModelOutput, or any mapping
    with "loss"), or the first element of a tuple (transformers with return_dict=False)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else (
        outputs[0] if isinstance(outputs, tuple) else getattr(outputs, "loss", None))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("PerExampleLossGrads: the model must return its scalar loss (`outputs.loss`): "
                         "pass the labels in the batch")
    return loss


class BackwardGradient:
    """The gradient that one ordinary backward pass adds to the selected parameters' ``.grad``, flattened.

    For MB-GraB (sorters/microbatch.py), whose unit is a replica's whole micro-batch: its gradient is the
    training step's own, so the glue reads it from the step's backward instead of forming per-example
    gradients (no extra forward or backward; one copy of d floats, two where ``.grad`` already holds an earlier
    micro-batch's under gradient accumulation). Call ``start()`` right before the backward and ``delta()``
    after it. Under DistributedDataParallel the backward averages ``.grad`` over the processes, so the
    difference is no longer this process's own: the glue uses it in one process hosting one replica only.

    Args:
        model: an nn.Module (a DistributedDataParallel wrapper is unwrapped).
        params: which parameters: None (every one with requires_grad), a regular expression or a list of them
            (as PerExampleGrads' `params`).

    Attributes:
        names: the selected parameter names, in `named_parameters()` order.
        d: their total number of elements, the length of ``delta()``.
    """

    def __init__(self, model: torch.nn.Module, params: str | Sequence[str] | None = None) -> None:
        check_module("BackwardGradient", model)
        model = getattr(model, "module", model) if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else model
        chosen = selected_parameters(model, params, "BackwardGradient")
        self.names = [name for name, _ in chosen]
        self.params = [p for _, p in chosen]
        self.d = sum(p.numel() for p in self.params)
        self._before: torch.Tensor | None = None  # (d,) the .grad before the backward; None: none held yet

    def _flat(self) -> torch.Tensor:
        """(d,) float32: the parameters' .grad end to end, zeros where a parameter has none."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                          for p in self.params])

    def start(self) -> None:
        """Note what ``.grad`` holds before the backward (nothing is copied when every ``.grad`` is None)."""
        self._before = None if all(p.grad is None for p in self.params) else self._flat()

    def delta(self) -> torch.Tensor:
        """(d,) float32: what the backward since ``start()`` added to ``.grad``: the micro-batch's gradient of the
        loss as the training loop scaled it for its backward (e.g. divided by the accumulation steps)."""
        after = self._flat()
        return after if self._before is None else after - self._before
