"""engine/linear_stack.py (every local worker's gradient at its own parameters in one batched pass) and
LR-HMDA's closed form at per-worker parameters, against an independent float64 reference: a loop over
workers and units, each a deep copy of the module holding that worker's parameters, differentiated by
torch.autograd. End to end: local-step runs give the losses and orders of the vmap path."""
import copy

import pytest
import torch
import torch.nn.functional as F

from engine.functional import FlatModel
from engine.linear_stack import LinearStack
from models.mlp import AutoregressiveMLP
from tests.helpers import assert_runs_agree, check_ok, entry_task, needs_data, run_script

N_WORKERS, K = 3, 4
HMDA = "hmda/raw/hmda_train_preprocessed.zip"


class TokensNet(torch.nn.Module):
    """Units of several tokens (inputs (U, T, 4)), a layer called on inputs of two shapes, a Linear
    without bias, and a Linear never called."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 6)
        self.unused = torch.nn.Linear(3, 3)
        self.second = torch.nn.Linear(6, 2, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))) + self.first(x[:, :2]).sum(1, keepdim=True)[..., :2]


class ChainNet(torch.nn.Module):
    """A Sequential of Linear layers and elementwise activations (run as one chain) on units of several
    tokens, its first layer also called outside the chain, and a Sequential that is no chain (Softmax
    mixes the features)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LeakyReLU(0.1), torch.nn.Linear(6, 6),
                                        torch.nn.Tanh(), torch.nn.Linear(6, 3))
        self.head = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Softmax(dim=-1))

    def forward(self, x):
        return self.head(self.body(x)) + self.body[0](x)[..., 1:3] * self.body(x[:, :2]).sum(1, keepdim=True)[..., :1]


def mlp_loss(module, x, y):  # MLP-M4's loss: MSE of the autoregressive rollout, per unit
    return (module(x, y.shape[-1]) - y).square().mean(dim=1)


def logistic_loss(module, x, y):
    return F.binary_cross_entropy_with_logits(module(x).squeeze(-1), y, reduction="none")


def tokens_loss(module, x, y):
    return (module(x) - y).square().sum(dim=(1, 2))


def make_case(name, generator):
    """(module, per-unit loss(module, x, y) -> (U,), x, y) with N_WORKERS * K units, worker-major."""
    U = N_WORKERS * K
    if name == "mlp":  # square hidden layers too: a transposed weight would not fail on shapes
        module, loss = AutoregressiveMLP(in_len=5, hidden=7, n_layers=4), mlp_loss
        x, y = torch.randn(U, 5, generator=generator), torch.randn(U, 3, generator=generator)
    elif name == "logistic":
        module, loss = torch.nn.Linear(6, 1), logistic_loss
        x, y = torch.randn(U, 6, generator=generator), torch.randint(0, 2, (U,), generator=generator).float()
    else:
        module, loss = (TokensNet(), tokens_loss) if name == "tokens" else (ChainNet(), tokens_loss)
        x, y = torch.randn(U, 5, 4, generator=generator), torch.randn(U, 5, 2, generator=generator)
    return module, loss, x, y


def assert_float32_close(actual, expected):
    """float32 against float64: to rounding of sums of terms up to the largest entry's size."""
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def reference(module, loss, params, x, y, k=K):
    """float64, one worker and one unit at a time (worker j's units are j*k .. j*k + k - 1): (worker mean gradients (n, d), unit gradients (n, k, d),
    worker mean losses (n,)), the gradients of a deep copy of the module holding the worker's row."""
    worker_grads, unit_grads, losses = [], [], []
    for j, row in enumerate(params.double()):
        copy_j = copy.deepcopy(module).double()
        torch.nn.utils.vector_to_parameters(row, copy_j.parameters())
        units = range(j * k, (j + 1) * k)
        xj, yj = x[j * k:(j + 1) * k].double(), y[j * k:(j + 1) * k].double()
        mean_loss = loss(copy_j, xj, yj).mean()
        worker_grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(mean_loss, copy_j.parameters(),
                                                                                   allow_unused=True, materialize_grads=True)]))
        losses.append(mean_loss.detach())
        unit_grads.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            loss(copy_j, x[u:u + 1].double(), y[u:u + 1].double()).sum(), copy_j.parameters(), allow_unused=True,
            materialize_grads=True)]) for u in units]))
    return torch.stack(worker_grads), torch.stack(unit_grads), torch.stack(losses)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["mlp", "logistic", "tokens", "chain"])
def test_worker_and_unit_gradients_equal_a_float64_reference(case, dtype):
    generator = torch.Generator().manual_seed(0)
    module, loss, x, y = make_case(case, generator)
    model = FlatModel(copy.deepcopy(module).to(dtype))
    params = model.flat + 0.5 * torch.randn(N_WORKERS, model.d, generator=generator).to(dtype)  # rows differ
    before = params.clone()
    stack = LinearStack(model)
    batch = (x.to(dtype), y.to(dtype))
    expected_grads, expected_units, expected_losses = reference(module, loss, params, x, y)
    if dtype == torch.float64:
        def close(actual, expected):
            torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    else:
        close = assert_float32_close
    unit_loss_fn = lambda flat, b: loss(model.module, *b)  # noqa: E731 (the task's unit_losses)
    grads, none, losses = stack.worker_gradients(unit_loss_fn, params, batch, K, per_unit=False)
    assert none is None and grads.dtype == dtype
    close(grads, expected_grads)
    close(losses, expected_losses)
    grads, unit_grads, losses = stack.worker_gradients(unit_loss_fn, params, batch, K, per_unit=True)
    close(unit_grads, expected_units)
    close(grads, expected_grads)
    close(losses, expected_losses)
    assert torch.equal(params, before)  # read, never written
    assert all("forward" not in layer.__dict__ for layer in stack.layers)  # the modules' own forward again
    assert all("forward" not in chain.__dict__ for chain in stack.chains)
    if case in ("mlp", "chain"):  # the MLP's body and ChainNet's body are chains, ChainNet's head is not
        assert stack.chains == [model.module.net if case == "mlp" else model.module.body]
    if case == "tokens":  # the unused layer's columns are zero, the bias-free layer has no bias columns
        offset = model.offsets[id(model.module.unused.weight)]
        assert torch.all(unit_grads[..., offset:offset + 12] == 0) and torch.any(unit_grads[..., :offset] != 0)


def test_weight_stacks_are_views_of_the_parameter_matrix():
    model = FlatModel(AutoregressiveMLP(in_len=5, hidden=7, n_layers=3))
    params = model.flat.expand(N_WORKERS, -1).clone()
    stack = LinearStack(model)
    first = stack.layers[0]
    weight_t, bias = stack.views(params)[first]
    assert weight_t.shape == (N_WORKERS, 5, 7) and bias.shape == (N_WORKERS, 1, 7)
    params[1, model.offsets[id(first.weight)] + 2 * 5 + 3] = 42.0  # worker 1, weight[2, 3]
    assert weight_t[1, 3, 2] == 42.0 and weight_t.untyped_storage().data_ptr() == params.untyped_storage().data_ptr()
    assert stack.views(params)[first][0] is weight_t  # made once per matrix


def test_forward_is_restored_after_an_error_and_other_layers_are_refused():
    model = FlatModel(torch.nn.Linear(3, 2))
    stack = LinearStack(model)

    def failing(flat, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        stack.worker_gradients(failing, model.flat.expand(2, -1).clone(), None, 1, per_unit=False)
    assert "forward" not in model.module.__dict__
    with pytest.raises(ValueError, match="nn.Linear"):
        LinearStack(FlatModel(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))))


ENTRY_TASKS = {
    "LR-HMDA": ("main-LR-HMDA.py", HMDA, ["--max-train-examples", "1600"]),
    "MLP-M4": ("main-MLP-M4.py", "m4/Weekly-train.csv", ["--max-train-examples", "1600", "--node_cnt", "4", "--B", "16"]),
}


@pytest.mark.parametrize("per_unit", [False, True])
@pytest.mark.parametrize("bench_name", [pytest.param(b, marks=needs_data(ENTRY_TASKS[b][1])) for b in ENTRY_TASKS])
def test_entry_tasks_take_the_batched_path_at_per_worker_parameters(monkeypatch, bench_name, per_unit):
    """The entry scripts' tasks at (n, d) parameters: no vmap, and the float64 reference's gradients
    (LR-HMDA: its closed form; MLP-M4: engine/linear_stack.py through its unit_losses)."""
    script, _, argv = ENTRY_TASKS[bench_name]
    task, _ = entry_task(script, torch.device("cpu"), *argv)

    def no_vmap(*args, **kwargs):
        raise AssertionError("took the vmap path")

    monkeypatch.setattr("engine.task.vmap", no_vmap)
    n, k, d = task.n_workers, task.units_per_step, task.model.d
    generator = torch.Generator().manual_seed(1)
    params = task.model.flat + 0.3 * torch.randn(n, d, generator=generator)
    unit_ids = torch.stack([torch.randperm(task.n_units, generator=generator)[:k] for _ in range(n)])
    grads, unit_grads, losses = task.worker_gradients(params, list(range(n)), unit_ids, per_unit)
    x, y = task.units(list(range(n)), unit_ids)
    if bench_name == "LR-HMDA":
        module, loss = torch.nn.Linear(d - 1, 1), logistic_loss
    else:
        module, loss = task.model.module, mlp_loss
    expected_grads, expected_units, expected_losses = reference(module, loss, params, x, y, k)
    assert_float32_close(grads, expected_grads)
    assert_float32_close(losses, expected_losses)
    if per_unit:
        assert_float32_close(unit_grads, expected_units)
    else:
        assert unit_grads is None


RUNS = {
    "LR-HMDA": ("main-LR-HMDA.py", ["--max-train-examples", "1600", "--max-eval-examples", "2000"],
                ("train_loss", "test_loss", "train_acc", "test_acc"),
                HMDA),
    "MLP-M4": ("main-MLP-M4.py", ["--max-train-examples", "1600", "--max-eval-examples", "200", "--node_cnt", "4",
                                  "--B", "16"], ("train_loss", "test_loss", "valid_loss", "test_smape"),
               "m4/Weekly-train.csv"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bench_name", [pytest.param(b, marks=needs_data(RUNS[b][3])) for b in RUNS])
@pytest.mark.parametrize("sorter", ["D-RR", "CD-GraB"])
def test_local_step_run_equals_the_vmap_path(tmp_path, bench_name, sorter):
    """A whole local-step run (one process): the batched path and --unit-grads vmap (the general
    torch.func path) give the same orders exactly and the same losses to float32 rounding."""
    script, quick, columns, _ = RUNS[bench_name]
    flags = ["--sorter", sorter, "--sync", "constant", "--H", "3", "--epochs", "2", "--record-orders", *quick]
    batched, vmapped = tmp_path / "batched", tmp_path / "vmap"
    check_ok(run_script(script, "--out", batched, *flags))
    check_ok(run_script(script, "--out", vmapped, *flags, "--unit-grads", "vmap"))
    assert_runs_agree(batched, vmapped, columns, rel=1e-6)
