"""The Accelerate glue (examples/accelerate_loop.py's train_epoch, built from a CDGraBSettings): the
per-example gradients it hands the sampler are those at each step's STARTING parameters, checked against
an independent computation: an ordinary backward pass per example at the parameters the optimizer step
started from (recorded by a hook on the optimizer, outside the loop under test). A loop that takes them
after optimizer.step() is caught (issue #45, defect 11; the Lightning and HF Trainer glue have the same
check in tests/test_lightning.py and tests/test_hf_trainer.py)."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from sorters import CDGraBSettings

accelerate = pytest.importorskip("accelerate")
from examples.accelerate_loop import loss_fn, train_epoch  # noqa: E402

N, FEATURES, BATCH = 24, 5, 4


def run_loop(loop):
    """Two epochs of `loop` (train_epoch's signature) through accelerator.prepare on a tiny logistic
    regression. Returns per step: the parameters its optimizer step started from (weight, bias), the
    example indices of its batch, what sampler.step() got; and the data (x, y)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, FEATURES, generator=generator), (torch.rand(N, generator=generator) > 0.5).float()
    train_set = TensorDataset(x, y, torch.arange(N))
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    settings = CDGraBSettings(sorter="CD-GraB", seed=0)
    grads_of = settings.gradients(model, loss_fn)
    sampler = settings.sampler(train_set, BATCH, d=grads_of.d, drop_last=True, epochs=2, view="global")
    loader = DataLoader(train_set, batch_size=sampler.loader_batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    accelerator = accelerate.Accelerator(cpu=True)
    prepared_model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    starts, stepped, seen = [], [], []
    optimizer.optimizer.register_step_pre_hook(  # the parameters each optimizer step starts from
        lambda *_: starts.append([p.detach().clone() for p in model.parameters()]))
    step = sampler.step
    sampler.step = lambda grads: (stepped.append(grads.detach().clone()), step(grads))[1]
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen += loop(accelerator, prepared_model, optimizer, loader, sampler, grads_of)[1]
    accelerator.free_memory(prepared_model, optimizer, loader)
    return starts, seen, stepped, (x, y)


def ordinary_backward(params, x, y) -> torch.Tensor:
    """The oracle: (B, d) per-example gradients at `params`, one ordinary backward per example (no
    torch.func), in named_parameters() order (weight, then bias)."""
    net = torch.nn.Linear(FEATURES, 1)
    with torch.no_grad():
        for p, value in zip(net.parameters(), params):
            p.copy_(value)
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss_fn(net(x[i:i + 1]), y[i:i + 1]), list(net.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def worst_error(loop) -> float:
    """The largest difference between what the sampler got and the oracle at the step's start."""
    starts, seen, stepped, (x, y) = run_loop(loop)
    assert len(starts) == len(seen) == len(stepped) == 2 * N // BATCH
    assert not torch.equal(starts[0][0], starts[1][0])  # the parameters move: the check can tell steps apart
    return max((got - ordinary_backward(params, x[index], y[index])).abs().max().item()
               for params, index, got in zip(starts, seen, stepped))


def gradients_after_the_step(accelerator, model, optimizer, loader, sampler, grads_of):
    """A broken loop: the per-example gradients taken after optimizer.step() (the next step's parameters)."""
    seen = []
    for x, y, index in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()
        sampler.step(grads_of(x, y))
        seen.append(index)
    return torch.zeros(()), seen


def test_the_loop_hands_the_sampler_gradients_at_each_steps_starting_parameters():
    assert worst_error(train_epoch) < 1e-6


def test_a_loop_taking_them_after_the_optimizer_step_is_caught():
    assert worst_error(gradients_after_the_step) > 1e-3
