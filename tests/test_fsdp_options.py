"""Exact CD-GraB under fully_shard's options (issue #61, goal 1 item 1; docs/fsdp.md, "fully_shard options"):
forked gloo processes train a sharded model with CDGraBSampler(exact=True), against tests/test_fsdp.py's oracle,
one unsharded process with sorters.CDGraB fed float64 per-example gradients.

- reshard_after_forward=False on the blocks and the root, CPU offload, every layer under the root's fully_shard
  only, a Linear called twice inside a sharded block with layers of the root's own, a layer left out of
  fully_shard (ignored_params: replicated, its gradient all-reduced by the loop), the blocks sharded and the root
  not (its own layers replicated): the same orders bit for bit, products and running sums within float32
  rounding;
- mixed precision (bf16 forward and backward, float32 reduce): the records are upcast to float32 and the
  products agree with float64 gradients of the function the bf16 forward computes within bf16's rounding; the
  orders match where no sign is that close to a tie (checked);
- a parameter placed Shard(1) (shard_placement_fn), and HSDP's two-dimensional mesh, are refused in one line;
- release checks (scripts/release_checks.py): reshard_after_forward=2 on 4 processes, the tiny GPT-2 with its
  blocks kept unsharded and its root resharded after the forward, and in bf16.
"""
import os
import socket

import pytest
import torch

from sorters.exact import ExactGradients
from tests.helpers import release_check, run_forked
from tests.test_fsdp import EPOCHS, HORIZON, LR, SEED, GPT2Case, K, M, MLPCase, one_process


class SharedBlock(torch.nn.Module):
    """A residual block whose Linear(5, 5) is called twice in one forward (weight sharing inside a block), then a
    LayerNorm(5): h (B, 5) -> (B, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(5, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, h):
        return self.norm(h + torch.tanh(self.mix(torch.tanh(self.mix(h)))))


class SharedNet(torch.nn.Module):
    """Linear(6, 5), two SharedBlocks, Linear(5, 1): x (B, 6) -> (B,). The first and last layers belong to no
    block: they are sharded by the root's fully_shard, or left out of it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 5)
        self.blocks = torch.nn.ModuleList([SharedBlock(), SharedBlock()])
        self.head = torch.nn.Linear(5, 1)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)[:, 0]


class SharedCase(MLPCase):
    """SharedNet on MLPCase's windows, each example's loss the squared error of the first value ahead."""

    @staticmethod
    def model():
        torch.manual_seed(0)
        return SharedNet()

    @staticmethod
    def blocks(model):
        return list(model.blocks)

    @staticmethod
    def losses(model, x, y):
        return (model(x) - y[:, 0]).square()


class GainNet(SharedNet):
    """SharedNet with a bare (5,) gain after the first layer: a parameter without a layer rule, formed per
    example."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        h = torch.tanh(self.embed(x)) * self.gain
        for block in self.blocks:
            h = block(h)
        return self.head(h)[:, 0]


class GainCase(SharedCase):
    """GainNet on SharedCase's windows and losses."""

    @staticmethod
    def model():
        torch.manual_seed(0)
        return GainNet()


class MLP4Case(MLPCase):
    """MLPCase with the windows of 4 replicas."""

    @staticmethod
    def data():
        generator = torch.Generator().manual_seed(2)
        return torch.randn(4 * M, 6, generator=generator), torch.randn(4 * M, HORIZON, generator=generator)


CASES = {"mlp": MLPCase, "mlp4": MLP4Case, "shared": SharedCase, "gain": GainCase, "gpt2": GPT2Case}


def shard(model, case, option):
    """Apply fully_shard to the case's blocks and then to the root, with `option`'s arguments. Returns the
    parameters left out of fully_shard (replicated: the loop all-reduces their gradients)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if option == "hsdp":  # replicated over the 2 processes, sharded over 1: a two-dimensional mesh
        from torch.distributed.device_mesh import init_device_mesh
        hsdp = {"mesh": init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))}
    blocks, root = {
        "default": ({}, {}),
        "no-reshard": ({"reshard_after_forward": False}, {"reshard_after_forward": False}),
        "reshard-2": ({"reshard_after_forward": 2}, {"reshard_after_forward": 2}),
        "blocks-kept-root-resharded": ({"reshard_after_forward": False}, {"reshard_after_forward": True}),
        # (pin_memory=True, the default, needs an accelerator: fully_shard refuses it on a CPU-only machine)
        "offload": ({"offload_policy": CPUOffloadPolicy(pin_memory=False)},) * 2,
        "bf16": ({"mp_policy": bf16},) * 2,
        "root-only": (None, {}),
        "head-replicated": ({}, {"ignored_params": set(model.head.parameters()) if hasattr(model, "head") else None}),
        "gain-replicated": ({}, {"ignored_params": {model.gain} if hasattr(model, "gain") else None}),
        # (FSDP2 itself refuses an uneven split of dim 1: the matrices with an even number of columns)
        "shard-dim-1": ({"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0
                         else Shard(0)}, {}),
        "hsdp": (hsdp, hsdp) if option == "hsdp" else None,
        "blocks-only": ({}, None),
    }[option]
    if blocks is not None:
        for block in case.blocks(model):
            fully_shard(block, **blocks)
    if root is None:  # the root not sharded: its own layers' parameters stay plain, replicated
        inside = {id(p) for block in case.blocks(model) for p in block.parameters()}
        return [p for p in model.parameters() if id(p) not in inside]
    fully_shard(model, **root)
    return list(root.get("ignored_params") or [])


def whole(p):
    """A parameter's whole value, a plain tensor (a DTensor's full_tensor(): every process must call it)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def options_rank(rank, port, path, case_name, option, world):
    """One of `world` forked gloo processes: the model sharded with `option` and trained with
    CDGraBSampler(exact=True) (tests/test_fsdp.py's loop); saved to path.rankR: the orders, losses, products and
    whole running sums per step, the parameters before each step and at the end, and what each recorded layer
    holds after the first forward (`held`: a DTensor's local rows, None for a plain tensor); or, when
    ExactGradients or the first step_units refuses, its message (`refused`)."""
    import torch.distributed as dist

    from sorters import CDGraBSampler
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        case = CASES[case_name]
        model = case.model()
        replicated = shard(model, case, option)
        try:
            exact = ExactGradients(model)  # after fully_shard: the sharded parameters
        except ValueError as refusal:
            torch.save({"refused": str(refusal)}, f"{path}.rank{rank}")
            return
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        sampler = CDGraBSampler(world * M, batch_size=K, d=exact.d, seed=SEED, exact=True)
        x, y = case.data()
        orders, losses, products, sums, weights, held = [], [], [], [], [], None
        for _ in range(EPOCHS):
            indices = list(sampler)
            orders.append(sampler.all_indices())
            for t in range(0, len(indices), K):
                batch = indices[t:t + K]
                weights.append([whole(p) for p in model.parameters()])
                optimizer.zero_grad()
                with exact.recording() as rec:
                    per_example = case.losses(model, x[batch], y[batch])
                    rec.watch(per_example)
                if held is None:  # what the forward left each recorded layer holding
                    held = [layer.weight.to_local().shape[0] if hasattr(layer.weight, "to_local") else None
                            for layer in exact.layers]
                per_example.mean().backward()
                for p in replicated:  # FSDP reduces none of these: the loop's job, as under DDP
                    dist.all_reduce(p.grad)
                    p.grad /= world
                try:
                    sampler.step_units(rec.units())
                except ValueError as refusal:
                    torch.save({"refused": str(refusal)}, f"{path}.rank{rank}")
                    return
                optimizer.step()
                losses.append(per_example.detach().float())
                share = sampler.sorter.share
                products.append(sampler.sorter.last_products)
                sums.append(share.reduce(share.whole(sampler.sorter.running_sum, exact.d)))  # the whole S, here only
        torch.save({"orders": orders, "losses": losses, "products": products, "sums": sums, "weights": weights,
                    "params": [whole(p) for p in model.parameters()], "held": held,
                    "rows": sampler.sorter.share.rows, "names": exact.names}, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run(tmp_path, case_name, option, world=2):
    """The forked run's saved results, rank by rank."""
    pytest.importorskip("torch.distributed.fsdp")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    path = tmp_path / f"{case_name}-{option}"
    run_forked(options_rank, (port, path, case_name, option, world), world)
    return [torch.load(f"{path}.rank{r}") for r in range(world)]


def assert_as_one_process(ranks, oracle, rel):
    """Every rank's orders equal the oracle's bit for bit; every step's products of the pairs' differences agree
    within `rel` times their vectors' norms (Cauchy-Schwarz: the error of a product is relative to the norms, not
    to itself), and so does the whole running sum after each step, within `rel` of its norm."""
    orders, _, _, products, sums = oracle
    assert not torch.equal(orders[1], orders[2])  # the orders follow the gradients
    for rank, got in enumerate(ranks):
        for epoch, (mine, theirs) in enumerate(zip(got["orders"], orders)):
            assert torch.equal(mine, theirs), f"rank {rank} epoch {epoch}"
        for step, ((a, G), (a_ref, G_ref)) in enumerate(zip(got["products"], products)):
            v_norm = float(G_ref.diagonal().max().sqrt())
            s_norm = float(sums[step - 1].norm()) if step else 0.0
            assert float((a - a_ref).abs().max()) <= rel * s_norm * v_norm, f"rank {rank} step {step} <S, v>"
            assert float((G - G_ref).abs().max()) <= rel * v_norm ** 2, f"rank {rank} step {step} <v, v>"
        for step, (mine, theirs) in enumerate(zip(got["sums"], sums)):
            assert float((mine.double() - theirs).norm()) <= rel * float(theirs.norm()), f"rank {rank} step {step} S"


# ------------------------------------------------------------------------------------- float32 options, 2 processes

@pytest.mark.parametrize("case_name, option", [
    ("mlp", "no-reshard"), ("mlp", "offload"), ("mlp", "root-only"),
    ("shared", "default"), ("shared", "head-replicated"), ("shared", "blocks-only"), ("gain", "gain-replicated")])
def test_option_gives_one_process_orders_bit_for_bit(tmp_path, case_name, option):
    """Each option trains as the plain loop does: the orders of one unsharded process bit for bit, products and
    running sums within float32 rounding, and the parameters. `held` shows the option took effect: a sharded
    layer holds its DTensor after the forward, a layer kept unsharded (reshard_after_forward=False, or under the
    root, which keeps its own) the plain gathered tensor, a replicated one its own plain parameter."""
    case = CASES[case_name]
    ranks = run(tmp_path, case_name, option)
    oracle = one_process(case)
    assert_as_one_process(ranks, oracle, rel=1e-5)
    for got in ranks:
        for mine, theirs in zip(got["params"], oracle[2]):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    held = ranks[0]["held"]
    if case_name == "mlp":  # Linear, Linear, Linear: each a block
        assert held == ([3, 3, 1] if option == "offload" else [None, None, None])  # rank 0's rows: 3/2, 3/2, 1/0
    elif option == "blocks-only":  # each block is then an FSDP root of its own, which keeps its parameters
        assert held == [None] * 6
    elif option == "gain-replicated":  # the blocks resharded (the root's own layers too, here)
        assert held[1:5] == [3, 3, 3, 3]
    else:  # embed, (mix, norm) x 2, head: the blocks resharded, the root's own layers kept
        assert held == [None, 3, 3, 3, 3, None]
    if option == "gain-replicated":  # the gain, formed per example, plain and split like the others
        gain = ranks[0]["names"].index("gain")
        assert (ranks[0]["rows"][gain], ranks[1]["rows"][gain]) == ((0, 3), (3, 5))
    if option == "head-replicated":  # split by the same chunk rule as the sharded ones: row 0 of 1 on rank 0
        head = [i for i, name in enumerate(ranks[0]["names"]) if name.startswith("head.")]
        assert [ranks[0]["rows"][i] for i in head] == [(0, 1), (0, 1)]
        assert [ranks[1]["rows"][i] for i in head] == [(1, 1), (1, 1)]


@pytest.mark.parametrize("option", ["shard-dim-1", "hsdp"])
def test_other_placements_are_refused_in_one_line(tmp_path, option):
    """shard_placement_fn placing the matrices Shard(1), and HSDP (a two-dimensional mesh: replicated over 2
    processes, sharded over 1): the first step_units refuses, saying what it takes."""
    for got in run(tmp_path, "mlp", option):
        message = got["refused"]
        assert "\n" not in message and "Shard(0)" in message and "one-dimensional mesh" in message
        assert ("Shard(dim=1)" if option == "shard-dim-1" else "2-D mesh") in message


def test_a_sharded_parameter_without_a_layer_rule_is_refused_in_one_line(tmp_path):
    """GainNet's bare gain, sharded by the root's fully_shard: autograd cannot form its per-example gradients (they
    reach FSDP's gathered copy), so ExactGradients refuses it, naming it and what to do. Left out of fully_shard
    (ignored_params) it is formed as unsharded: test_option_gives_one_process_orders_bit_for_bit[gain-...]."""
    for got in run(tmp_path, "gain", "default"):
        message = got["refused"]
        assert "\n" not in message and ": gain;" in message and "params=" in message and "ignored_params=" in message


# ------------------------------------------------------------------------------------- mixed precision (bf16)

def signed_dots(a, G, s2, signs=None):
    """CD-GraB's sequential rule from products: for r differences in visiting order, a (r,) <S, v_i>, G (r, r)
    <v_i, v_j> and s2 = ||S||^2 at the step's start, <S_i, v_i> = a_i + sum_{j<i} s_j G_ij and
    ||S_i|| ||v_i|| (float64, (r,) each), with the signs given, else the rule's own (+1 where <S_i, v_i> <= 0).
    Returns (dots, scales, signs)."""
    r = len(a)
    a, G = a.double(), G.double()
    chosen = torch.zeros(r, dtype=torch.float64)
    dots, scales = torch.zeros(r, dtype=torch.float64), torch.zeros(r, dtype=torch.float64)
    for i in range(r):
        dots[i] = a[i] + G[i] @ chosen  # chosen[j >= i] still 0
        norm2 = s2 + 2 * (chosen @ a) + chosen @ G @ chosen
        scales[i] = (norm2.clamp(min=0) * G[i, i].clamp(min=0)).sqrt()
        chosen[i] = (1.0 if dots[i] <= 0 else -1.0) if signs is None else signs[i]
    return dots, scales, chosen


BF16_REL = 2 ** -5  # bf16's rounding (2^-8 relative) eight times over, through the layers and the products


@pytest.mark.parametrize("case_name", ["mlp", pytest.param("gpt2", marks=release_check)])
def test_bf16_records_give_float64_products_of_the_bf16_forward(tmp_path, case_name):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32): the layers run and record in bf16, the records
    are upcast (exactly) and the products taken as in float32. The oracle: sorters.CDGraB fed the float64
    per-example gradients of the function the bf16 forward computes (the run's own parameters before each step
    and its input, rounded to bf16, in float64). Products and running sums agree within BF16_REL of the norms.
    The signs: with the oracle's earlier signs, each pair's <S_i, v_i> from the run's products differs from the
    oracle's by less than the oracle's |<S_i, v_i>| (its margin from a tie), so by induction every sign is the
    oracle's and the orders are the same bit for bit (they are). A pair closer to a tie than bf16's rounding may
    take the other sign (docs/fsdp.md); none is here."""
    ranks = run(tmp_path, case_name, "bf16")
    oracle = one_process(CASES[case_name], weights=ranks[0]["weights"], round_to=torch.bfloat16)
    _, _, _, products, sums = oracle
    steps = -(-M // K)
    for got in ranks:
        for step, ((a, G), (a_ref, G_ref)) in enumerate(zip(got["products"], products)):
            s2 = 0.0 if step % steps == 0 else float(sums[step - 1].square().sum())  # S = 0 at an epoch's start
            dots, scales, signs = signed_dots(a_ref, G_ref, s2)
            mine = signed_dots(a, G, s2, signs)[0]
            tie = scales.eq(0) & mine.eq(0) & dots.eq(0)  # S_i = 0 on both sides: the rule's +1 on both
            assert bool((((mine - dots).abs() < dots.abs()) | tie).all()), f"step {step}"
    assert_as_one_process(ranks, oracle, rel=BF16_REL)
    # the forward ran in bf16: its products are off the float32 oracle's by far more than float32 rounding
    a, a_ref = ranks[0]["products"][1][0], one_process(CASES[case_name])[3][1][0]
    assert float((a - a_ref).abs().max()) > 1e-4 * float(a_ref.abs().max())


def test_autocast_records_are_upcast_unsharded():
    """The same upcast without sharding: TiedNet (tied embedding / output Linear, LayerNorm, biases) under CPU
    autocast to bf16, where the output layer's input is float32 and its output gradient bf16. Its products and
    update agree with float64 per-example gradients (one backward each, no autocast) within BF16_REL."""
    import torch.nn.functional as F

    from tests.test_exact_resume import TiedNet, data, each_examples_gradient
    model = TiedNet()
    ids, y = data()
    ids, y = ids[:6], y[:6]
    exact = ExactGradients(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(ids).dtype == torch.bfloat16
        units = exact(lambda: F.cross_entropy(model(ids), y, reduction="none"))
    grads = each_examples_gradient(TiedNet().double(), ids, y)  # (U, d) float64, the same initial weights
    generator = torch.Generator().manual_seed(1)
    S, w = torch.randn(exact.d, generator=generator), torch.randn(len(ids), generator=generator).double()
    a, G = units.products(S)
    norms = grads.norm(dim=1)
    assert float(((a - grads @ S.double()).abs() / (norms * S.norm())).max()) <= BF16_REL
    assert float(((G - grads @ grads.T).abs() / (norms[:, None] * norms[None, :])).max()) <= BF16_REL
    updated = S.clone()
    units.add_to(updated, w)
    assert float((updated.double() - S.double() - w @ grads).norm()) <= BF16_REL * float(w.abs() @ norms)


# ------------------------------------------------------------------------------------- release checks

@release_check
def test_reshard_after_forward_to_a_smaller_mesh(tmp_path):
    """reshard_after_forward=2 on 4 processes (blocks and root): after the forward each layer holds its parameter
    resharded over 2 processes (a DTensor on a mesh of 2), its backward a gathered copy; the orders of one
    unsharded process hosting the 4 replicas bit for bit."""
    ranks = run(tmp_path, "mlp4", "reshard-2", world=4)
    assert ranks[0]["held"] == [3, 3, 1]  # rank 0's rows of 2 processes (3/2, 3/2, 1/0), not of 4 (2/2/1/0)
    assert_as_one_process(ranks, one_process(MLP4Case, n=4), rel=1e-5)


@release_check
def test_gpt2_blocks_kept_and_root_resharded(tmp_path):
    """The tiny GPT-2, its blocks reshard_after_forward=False and its root True: the root's own layers (the tied
    wte / lm_head, wpe, ln_f) hold their sharded DTensors after the forward and gathered copies in the backward,
    the blocks' layers the gathered tensors throughout; the orders of one unsharded process bit for bit."""
    ranks = run(tmp_path, "gpt2", "blocks-kept-root-resharded")
    assert None in ranks[0]["held"] and 6 in ranks[0]["held"]  # the blocks' gathered, the 11-row wte's rows 6/5
    assert_as_one_process(ranks, one_process(GPT2Case), rel=1e-5)
