"""The model as a pure function of ONE flat parameter vector, and its gradients via torch.func.

Keeping all parameters in a single (d,) tensor makes every gradient a (d,) or (k, d) tensor
(what sorters and collectives consume) with no flatten/concatenate step, and makes the
optimizer state one (d,) tensor per buffer. Tied weights appear once (named_parameters
de-duplicates them, and functional_call re-ties them).
"""
import torch
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map


class FlatModel:
    """Wraps an nn.Module: `flat` (d,) holds its parameters; `params(flat)` gives name -> view.

    The module's own parameter tensors are left alone; the module is only a function here.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.flat = torch.cat([p.detach().reshape(-1) for _, p in named]).clone()
        self.buffers = dict(module.named_buffers())
        self.d = self.flat.numel()

    def params(self, flat: torch.Tensor) -> dict:
        """name -> view of `flat` with the parameter's shape."""
        pieces = torch.split(flat, self.numels)
        return {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes)}

    def __call__(self, flat: torch.Tensor, *args, **kwargs):
        return functional_call(self.module, (self.params(flat), self.buffers), args, kwargs)

    def to(self, device):
        self.module.to(device)
        self.flat = self.flat.to(device)
        self.buffers = dict(self.module.named_buffers())
        return self


def unit_gradients(loss_fn, flat: torch.Tensor, units):
    """Per-unit gradients in one vmapped pass.

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
    """Gradient of the mean loss over a batch. Returns (grad (d,), loss scalar, aux)."""
    def with_aux(flat):
        loss, aux = loss_fn(flat, batch)
        return loss, (loss.detach(), () if aux is None else aux)  # torch.func aux must be tensors

    g, (loss, aux) = grad(with_aux, has_aux=True)(flat)
    return g, loss, None if aux == () else aux
