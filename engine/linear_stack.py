"""Every local worker's gradient at its own parameters in one batched pass, for models of Linear layers.

Under local steps (engine/local_sgd.py) worker j's parameters are row j of an (n, d) matrix. Rather than
a torch.func.vmap or a loop over the workers, the model's own forward runs once on all n * k units with
every nn.Linear call made a batched matmul: the layer's weight is viewed (no copy) from the matrix as an
(n, out, in) stack and its bias as (n, out), and its input (n * k, ..., in), worker-major, is read as
(n, k * ..., in). Worker j's loss depends on row j only, so ONE backward of the sum of the workers'
losses gives every worker's own gradient. It goes to the layers' outputs, as in
FlatModel.outer_unit_gradients; a layer's gradient is then the sum over its tokens of g a^T (weight) and
g (bias), the tokens grouped by worker (each worker's gradient) or by unit (per-unit gradients, for the
balancing sorters).

An nn.Sequential made only of Linear layers and elementwise activations (the MLP's body) runs as one
chain: its input is read as (n, k * ..., in) once, every layer's batched matmul and every activation
work on those blocks, and only its output is viewed back. A module call and a view each cost a Python
call and an autograd node per layer and rollout step; the chain spends them once per Sequential call,
which keeps this pass at the cost of the data-parallel step's one forward and backward
(bench/communication.py).

A task opts in with `linear_stack = True` (engine/task.py); its model must keep every parameter in
nn.Linear layers (LR, the MLP), which may be called any number of times (the MLP's rollout).
"""
import weakref

import torch


class LinearStack:
    """A FlatModel's nn.Linear layers and where their parameters sit in its flat (d,) vector."""

    def __init__(self, model):
        self.model = model
        self.layers = [module for module in model.module.modules() if isinstance(module, torch.nn.Linear)]
        covered = {id(p) for layer in self.layers for p in layer.parameters(recurse=False)}
        if covered != set(model.offsets):
            raise ValueError("linear_stack needs a model whose parameters all belong to nn.Linear layers; "
                             "use the general worker-gradient path (linear_stack = False)")
        # every parameter in the order of the flat vector: the gradient is their pieces side by side
        self.order = sorted((p for layer in self.layers for p in layer.parameters(recurse=False)),
                            key=lambda p: model.offsets[id(p)])
        self._views = (None, None)  # (params (n, d), {layer: (weight^T (n, in, out), bias (n, 1, out))})
        # Sequentials of Linear layers and elementwise activations, without hooks: run as chains
        self.chains = [module for module in model.module.modules() if isinstance(module, torch.nn.Sequential)
                       and all(isinstance(child, (torch.nn.Linear, *ELEMENTWISE)) and not _has_hooks(child)
                               for child in module) and not _has_hooks(module)]

    def views(self, params: torch.Tensor) -> dict:
        """layer -> (weight^T (n, in, out), bias (n, 1, out) or None): views, no copy, of params (n, d);
        made once per parameter matrix (LocalWorkers updates its matrix in place)."""
        cached, views = self._views
        if cached is not params:
            stack = params.detach()  # the layers' outputs need gradients, the parameters do not
            views = {layer: (self._view(stack, layer.weight).transpose(1, 2),
                             None if layer.bias is None else self._view(stack, layer.bias).unsqueeze(1))
                     for layer in self.layers}
            self._views = (params, views)
        return views

    def _view(self, stack: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        offset = self.model.offsets[id(p)]
        return stack[:, offset:offset + p.numel()].view(stack.shape[0], *p.shape)

    def worker_gradients(self, unit_loss_fn, params: torch.Tensor, batch, k: int, per_unit: bool):
        """Each worker's gradient at its own row of params (n, d): one batched forward, one backward.

        batch: the n * k units, worker-major (worker j's are units j*k .. j*k + k - 1); unit_loss_fn(flat,
        batch) -> (U,) each unit's loss exactly as a batch of that unit alone (the task's unit_losses),
        the units on dim 0 of every Linear input. Returns (grads (n, d) each worker's mean gradient over
        its k units, unit_grads (n, k, d) freshly allocated or None unless per_unit, losses (n,) detached).
        """
        n = params.shape[0]
        calls = {layer: ([], []) for layer in self.layers}  # layer -> (inputs, outputs) of its calls, in order
        views = self.views(params)
        # (object's setattr: nn.Module's checks cost more than the call); a layer may also be called
        # outside its chain, so every layer gets the stacked forward
        for layer in self.layers:
            object.__setattr__(layer, "forward", _stacked_forward(*views[layer], *calls[layer]))
        for chain in self.chains:
            object.__setattr__(chain, "forward", _chain_forward(chain, n, views, calls))
        try:
            unit_losses = unit_loss_fn(self.model.flat, batch)
        finally:
            for module in (*self.layers, *self.chains):
                object.__delattr__(module, "forward")  # the class's forward again
        losses = unit_losses.detach().view(n, k).mean(1)
        if not per_unit:  # row j sums worker j's tokens: the gradient of its mean loss
            return self.layer_gradients(unit_losses, 1 / k, calls, n), None, losses
        unit_grads = self.layer_gradients(unit_losses, 1.0, calls, len(unit_losses)).view(n, k, -1)
        return unit_grads.mean(1), unit_grads, losses

    def layer_gradients(self, unit_losses: torch.Tensor, scale: float, calls: dict, rows: int) -> torch.Tensor:
        """(rows, d): one backward of scale * unit_losses.sum() to the outputs of every Linear call (calls:
        layer -> (inputs, outputs)), then for every layer the sum over its tokens of g a^T (weight) and g
        (bias), the tokens grouped into `rows` blocks along dim 0 of the layer inputs: rows = n gives each
        worker's gradient, rows = U each unit's."""
        called = [(layer, inputs, outputs) for layer, (inputs, outputs) in calls.items() if outputs]
        # a scalar to differentiate: a grad_outputs tensor would make torch import sympy (a second) at the first call
        total = unit_losses.sum() if scale == 1 else unit_losses.sum() * scale
        output_grads = iter(torch.autograd.grad(total, [out for _, _, outputs in called for out in outputs]))
        pieces = {}  # id(parameter) -> its (rows, numel) columns of the gradient
        with torch.no_grad():
            for layer, inputs, outputs in called:
                a = _tokens(inputs, rows)                                  # (rows, T, in)
                g = _tokens([next(output_grads) for _ in outputs], rows)  # (rows, T, out)
                pieces[id(layer.weight)] = torch.bmm(g.transpose(1, 2), a).view(rows, -1)  # (rows, out * in)
                if layer.bias is not None:
                    pieces[id(layer.bias)] = g.sum(1)
            # a layer the forward did not call has zero gradient
            return torch.cat([pieces[id(p)] if id(p) in pieces else unit_losses.new_zeros(rows, p.numel())
                              for p in self.order], dim=1)


# activations that act on every entry alone: a chain may apply them to (n, k * ..., features) blocks
ELEMENTWISE = (torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid,
               torch.nn.Identity)


def _has_hooks(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def _block_matmul(blocks, weight_t, bias, inputs_seen: list, outputs_seen: list):
    """blocks (n, r, in) @ weight^T (n, in, out) (+ bias (n, 1, out)) -> (n, r, out), block j with worker
    j's row; appends the call's blocks and output to inputs_seen and outputs_seen."""
    out = torch.bmm(blocks, weight_t) if bias is None else torch.baddbmm(bias, blocks, weight_t)
    if not out.requires_grad:  # no input needs a gradient (the parameters do not): the graph starts here
        out.requires_grad_()
    inputs_seen.append(blocks)
    outputs_seen.append(out)
    return out


def _stacked_forward(weight_t, bias, inputs_seen: list, outputs_seen: list):
    """A Linear layer's forward with its weight^T (n, in, out) and bias (n, 1, out) stacks: inputs
    (n * r, ..., in), worker-major, computed block j with worker j's row. Records each call's
    (n, r * ..., in) blocks and output in inputs_seen and outputs_seen."""
    n, in_features, out_features = weight_t.shape

    def forward(inputs):
        out = _block_matmul(inputs.reshape(n, -1, in_features), weight_t, bias, inputs_seen, outputs_seen)
        return out.view(*inputs.shape[:-1], out_features)

    return forward


def _chain_forward(chain, n: int, views: dict, calls: dict):
    """A Sequential of Linear layers and ELEMENTWISE activations as one chain on (n, r, features) blocks:
    inputs (n * r, ..., in) worker-major, as _stacked_forward, viewed once on the way in and once out."""
    steps = [(*views[module], *calls[module]) if isinstance(module, torch.nn.Linear) else module.forward
             for module in chain]

    def forward(inputs):
        x = inputs.reshape(n, -1, inputs.shape[-1])
        for step in steps:
            x = _block_matmul(x, *step) if type(step) is tuple else step(x)
        return x.view(*inputs.shape[:-1], x.shape[-1])

    return forward


def _tokens(tensors: list, rows: int) -> torch.Tensor:
    """Every call's (n, r, features) blocks (worker j's units, in order, in block j) as one (rows,
    tokens, features): the units grouped into `rows` blocks (worker-major), the calls' tokens side by side."""
    features = tensors[0].shape[-1]
    if len(tensors) == 1:
        return tensors[0].reshape(rows, -1, features)
    try:  # calls of one shape (the MLP's rollout): one stack, each unit's tokens still together
        return torch.stack(tensors, dim=2).view(rows, -1, features)
    except RuntimeError:  # calls of several shapes
        return torch.cat([t.reshape(rows, -1, features) for t in tensors], dim=1)


_STACKS = weakref.WeakKeyDictionary()  # FlatModel -> its LinearStack, built at the first call


def worker_gradients(model, unit_loss_fn, params: torch.Tensor, batch, k: int, per_unit: bool):
    """LinearStack(model).worker_gradients, the layout worked out once per model."""
    if model not in _STACKS:
        _STACKS[model] = LinearStack(model)
    return _STACKS[model].worker_gradients(unit_loss_fn, params, batch, k, per_unit)
