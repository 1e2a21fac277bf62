"""The structured sketch (sorters.LayerSketch) on a model sharded with FSDP2 (fully_shard), issue #61 goal 1:
each process sketches its own examples' whole gradients from their layer records (a layer's input and output
gradient do not depend on the weight's shard), and CDGraBSampler all-gathers the (B, D) sketches, as in the
data-parallel sketched path (docs/fsdp.md).

Under 2 forked gloo processes, MLP-M4's model (each Linear fully_shard-ed, then the root; the output layer's one
row owned by process 0 alone) and the tiny tied GPT-2 of tests/test_fsdp.py (each block, then the root: wte,
wpe, ln_f and the tied lm_head held by the root) are trained with CDGraBSampler(d=D) fed LayerSketch's sketches,
through recording() and the loop's own backward (LayerSketch built after fully_shard), and through LayerSketch's
call with update_scale (built before fully_shard: it sees the sharding at each call). The oracle is
one unsharded process hosting both replicas: the map as a dense (D, d) matrix applied to float64 per-example
gradients from one ordinary backward per example, fed to sorters.CDGraB in float64. Every step's sketches equal
the oracle's and the unsharded LayerSketch's of the same examples within float32 rounding, the orders equal the
oracle's bit for bit, and losses and parameters agree within float32 rounding. The same holds under fully_shard's
reshard_after_forward=False and CPU offload (MLP-M4). Under MixedPrecisionPolicy (bf16 forward and backward:
the tiny GPT-2) the first step's sketches are the oracle's within bf16's rounding.
"""
import functools
import os
import socket

import pytest
import torch

from sorters import CDGraBSampler, LayerSketch
from sorters.balance import CDGraB
from sorters.layer_sketch import layer_blocks
from sorters.sketch import GradientSketch
from tests.helpers import run_forked
from tests.test_fsdp import CASES, EPOCHS, LR, SEED, K, M, N, float64

SKETCH_SEED, MIN_NUMEL = 5, 16  # every weight of at least 16 entries a TensorSketch block (MLP: 2 of 3; GPT-2: all)
DIMS = {"mlp": 16, "gpt2": 48}  # D below d (MLP-M4's 71, the tiny GPT-2's 1,146)


class WithBareParameter(torch.nn.Module):
    """A Linear and a bare parameter (no layer rule: LayerSketch would form its gradient per example)."""

    def __init__(self):
        super().__init__()
        self.linear, self.scale = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.linear(x) * self.scale


def fully_shard_options(option):
    """fully_shard's keyword arguments for an option of the test: "default", "no-reshard" (the gathered weights
    kept from the forward to the backward), "offload" (the shards on the CPU, pin_memory off), "bf16" (the
    forward and backward in bf16, the gradients reduced in float32)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    return {"default": {}, "no-reshard": {"reshard_after_forward": False},
            "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
            "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}}[option]


def sharded_rank(rank, port, path, case_name, how, option):
    """One of 2 forked gloo processes: the model sharded with fully_shard's option, trained with
    CDGraBSampler(d=D) fed LayerSketch's sketches of this process's examples (how: "recording", the loop's
    backward of the mean loss; or "call", LayerSketch's call with update_scale=1/K); orders, sketches, losses and
    final parameters (whole) saved to path.rankR, with the one-line errors of the refused uses."""
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        case = CASES[case_name]
        model = case.model()
        if how == "call":  # built before fully_shard: it reads whether the model is sharded at each call
            sketcher = LayerSketch(model, DIMS[case_name], seed=SKETCH_SEED, min_numel=MIN_NUMEL)
        for block in case.blocks(model):
            fully_shard(block, **fully_shard_options(option))
        fully_shard(model, **fully_shard_options(option))
        if how == "recording":  # after fully_shard, as the exact path's ExactGradients
            sketcher = LayerSketch(model, DIMS[case_name], seed=SKETCH_SEED, min_numel=MIN_NUMEL)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        sampler = CDGraBSampler(N * M, batch_size=K, d=sketcher.dim, seed=SEED)
        x, y = case.data()
        errors = []
        try:  # a sharded model's backward is FSDP's, which writes .grad
            sketcher(lambda: case.losses(model, x[:K], y[:K]))
        except ValueError as error:
            errors.append(str(error))
        try:  # a parameter without a layer rule: its gradient reaches FSDP's gathered copy only
            LayerSketch(fully_shard(WithBareParameter()), 4)
        except ValueError as error:
            errors.append(str(error))
        orders, losses, sketches = [], [], []
        for _ in range(EPOCHS):
            indices = list(sampler)
            orders.append(sampler.all_indices())
            for t in range(0, len(indices), K):
                batch = indices[t:t + K]
                optimizer.zero_grad()
                if how == "recording":
                    with sketcher.recording() as rec:
                        per_example = case.losses(model, x[batch], y[batch])
                        rec.watch(per_example)
                    per_example.mean().backward()      # FSDP's all-gathers and reduce-scatter, unchanged
                    step_sketches = rec.sketches()
                else:
                    step_sketches, per_example = sketcher(lambda batch=batch: case.losses(model, x[batch], y[batch]),
                                                          update_scale=1 / len(batch))
                sampler.step(step_sketches)            # (K, D): all-gathered, nothing of size d
                optimizer.step()
                losses.append(per_example.detach())
                sketches.append(step_sketches)
        torch.save({"orders": orders, "losses": losses, "sketches": sketches, "errors": errors,
                    "params": [p.full_tensor() for p in model.parameters()]}, f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@functools.cache  # once per case for the module's two ways of sketching
def one_process(case_name):
    """Both replicas in one unsharded process. Per step, each example's float64 gradient (one ordinary backward
    per example) times the map as a dense (D, d) matrix: the oracle's sketches, fed to sorters.CDGraB in float64;
    beside them the unsharded LayerSketch's sketches of the same examples; then SGD on the mean loss of the
    step's 2 K examples. Returns orders, and per replica the losses, oracle sketches and LayerSketch's sketches
    of every step, and the final parameters."""
    case, dim = CASES[case_name], DIMS[case_name]
    model = case.model()
    twin = case.model().double()
    unsharded = LayerSketch(model, dim, seed=SKETCH_SEED, min_numel=MIN_NUMEL)
    d = sum(p.numel() for p in model.parameters())
    P = GradientSketch(d, dim, SKETCH_SEED, blocks=layer_blocks(model, None, MIN_NUMEL)).matrix(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sorter = CDGraB(N, M, dim, seed=SEED, dtype=torch.float64)
    x, y = case.data()
    orders = []
    losses, oracle, layer = ([[] for _ in range(N)] for _ in range(3))
    for _ in range(EPOCHS):
        indices = sorter.sort() + torch.arange(N)[:, None] * M
        orders.append(indices.clone())
        for t in range(0, M, K):
            positions = range(t, min(t + K, M))
            batch = indices[:, list(positions)].reshape(-1)  # replica 0's examples, then replica 1's
            with torch.no_grad():
                for p64, p in zip(twin.parameters(), model.parameters()):
                    p64.copy_(p)
            grads = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                case.losses(twin, *(float64(t[i:i + 1]) for t in (x, y))).sum(), list(twin.parameters()))])
                for i in batch.tolist()])
            sketches = (grads @ P.T).view(N, len(positions), dim)
            sorter.step(sketches, positions)
            optimizer.zero_grad()
            with unsharded.recording() as rec:
                per_example = case.losses(model, x[batch], y[batch])
                rec.watch(per_example)
            per_example.mean().backward()
            optimizer.step()
            mine = rec.sketches().view(N, -1, dim)
            for j in range(N):
                losses[j].append(per_example.detach().view(N, -1)[j])
                oracle[j].append(sketches[j])
                layer[j].append(mine[j])
    return orders, losses, oracle, layer, [p.detach() for p in model.parameters()]


def run_ranks(tmp_path_factory, case_name, how, option):
    """sharded_rank in 2 forked processes: (case_name, what each rank saved)."""
    pytest.importorskip("torch.distributed.fsdp")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    path = tmp_path_factory.mktemp("fsdp_sketch") / "run"
    run_forked(sharded_rank, (port, path, case_name, how, option), 2)
    return case_name, [torch.load(f"{path}.rank{r}") for r in range(2)]


@pytest.fixture(scope="module", params=[("mlp", "recording", "default"), ("mlp", "call", "default"),
                                        ("gpt2", "recording", "default"), ("gpt2", "call", "default"),
                                        ("mlp", "recording", "no-reshard"), ("mlp", "call", "offload")],
                ids=lambda param: "-".join(param))
def ranks(request, tmp_path_factory):
    return run_ranks(tmp_path_factory, *request.param)


@pytest.fixture(scope="module")
def bf16_ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory, "gpt2", "recording", "bf16")


def assert_sketches_close(mine, theirs, reference, what):
    """float32 rounding of a sketch: each entry sums signed gradient entries (and, in a block, products of two
    CountSketches through an FFT), so its error is relative to the reference row's size, not to the entry."""
    for step, (a, b, ref) in enumerate(zip(mine, theirs, reference)):
        scale = ref.abs().max(dim=1, keepdim=True).values.clamp_min(1e-12)
        error = ((a.double() - b.double()).abs() / scale).max()
        assert float(error) <= 1e-5, f"{what}, step {step}: {float(error):.2e} of the row's largest entry"


def test_sharded_sketches_orders_and_training_equal_one_unsharded_process(ranks):
    """The sketches each process makes under fully_shard equal the unsharded LayerSketch's of the same examples
    and the dense map applied to float64 per-example gradients (within float32 rounding); both processes' orders
    of every epoch equal the float64 oracle's bit for bit; losses and parameters agree within float32 rounding."""
    case_name, ranks = ranks
    orders, losses, oracle, layer, params = one_process(case_name)
    assert not torch.equal(orders[1], orders[2])  # the orders follow the sketches
    for rank, got in enumerate(ranks):
        assert_sketches_close(layer[rank], oracle[rank], oracle[rank], f"unsharded LayerSketch, replica {rank}")
        assert_sketches_close(got["sketches"], layer[rank], oracle[rank], f"rank {rank} against unsharded")
        assert_sketches_close(got["sketches"], oracle[rank], oracle[rank], f"rank {rank} against the oracle")
        for epoch, (mine, theirs) in enumerate(zip(got["orders"], orders)):
            assert torch.equal(mine, theirs), f"rank {rank} epoch {epoch}"
        torch.testing.assert_close(torch.cat(got["losses"]), torch.cat(losses[rank]), rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(got["params"], params):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_what_cannot_work_sharded_is_refused_in_one_line(ranks):
    """On a sharded model LayerSketch's call needs update_scale (its backward is FSDP's, which writes .grad), and
    a parameter without a layer rule is refused (FSDP's gathered copy alone gets its gradient)."""
    _, ranks = ranks
    for got in ranks:
        no_scale, bare = got["errors"]
        assert "update_scale" in no_scale and "recording()" in no_scale and "\n" not in no_scale
        assert "scale" in bare and "params=" in bare and "\n" not in bare


def test_bf16_sketches_are_the_oracles_within_bf16_rounding(bf16_ranks):
    """MixedPrecisionPolicy(param_dtype=bf16): the records come in bf16 and are widened to the parameters' float32.
    The first step (the same parameters as the oracle's) gives the oracle's sketches within bf16's rounding, 2^-5
    of the row's largest entry, and not within float32's (the records were bf16)."""
    case_name, ranks = bf16_ranks
    _, _, oracle, _, _ = one_process(case_name)
    for rank, got in enumerate(ranks):
        mine, theirs = got["sketches"][0].double(), oracle[rank][0]
        error = float(((mine - theirs).abs() / theirs.abs().max(dim=1, keepdim=True).values).max())
        assert 1e-5 < error <= 2 ** -5, f"rank {rank}: {error:.2e} of the row's largest entry"
