"""The natural call (issue #59, goal 7): ExactGradients and LayerSketch take a Hugging Face model called as users
call it, `model(input_ids=x)`, whose position embedding gets GPT-2's default (1, T) position_ids broadcast over
the batch (no position_ids (B, T) passed). Oracle: each example's gradient from an ordinary backward of the
model's own loss on that example alone, the model in float64; the exact path's products, gradients, orders
and the sketches are checked against it."""
import pytest
import torch
import torch.nn.functional as F

from sorters.balance import CDGraB
from sorters.exact import ExactCDGraB, ExactGradients
from sorters.layer_sketch import LayerSketch

transformers = pytest.importorskip("transformers")

B, T, VOCAB = 4, 6, 32


def gpt2():
    """A two-layer GPT-2 built from a config (nothing downloaded), float64, eager attention, dropout off;
    wte tied to lm_head."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double()
    model.set_attn_implementation("eager")
    return model


IDS = torch.randint(0, VOCAB, (2 * B, T), generator=torch.Generator().manual_seed(1))


def per_example_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B,): each example's mean next-token cross-entropy over its own T - 1 predictions."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def natural_losses(model, ids):
    """The call under test: input_ids only, so GPT-2 gives its position embedding (1, T) position_ids."""
    return per_example_losses(model(input_ids=ids).logits, ids)


def oracle(model, params, ids) -> torch.Tensor:
    """(len(ids), d) float64: example i's gradient of its loss with the model run on it alone (not the model's
    outputs.loss, which transformers computes in float32)."""
    rows = []
    for i in range(len(ids)):
        loss = natural_losses(model, ids[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def model_and_oracle():
    model = gpt2()
    return model, oracle(model, ExactGradients(model).params, IDS)  # every trainable parameter, the tied one once


def test_the_natural_call_gives_the_position_embedding_one_row_for_every_example(model_and_oracle):
    """What the other tests stand on: the position embedding's input is (1, T) for a batch of B."""
    model, _ = model_and_oracle
    seen = []
    handle = model.transformer.wpe.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    try:
        with torch.no_grad():
            model(input_ids=IDS[:B])
    finally:
        handle.remove()
    assert seen == [(1, T)]


@pytest.mark.parametrize("how", ["stream", "ghost"])
def test_exact_gradients_products_and_gradients_are_the_oracles(model_and_oracle, how):
    model, formed = model_and_oracle
    exact = ExactGradients(model, how=how)
    units = exact(lambda: natural_losses(model, IDS[:B]))
    expected = formed[:B]
    torch.testing.assert_close(exact.flat(units), expected, rtol=0, atol=1e-12)
    S = torch.randn(exact.d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a, G = units.products(S)
    torch.testing.assert_close(a, expected @ S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, expected @ expected.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("write_grads", [False, True])
def test_a_recording_of_the_loops_own_backward_gives_the_oracles_gradients(model_and_oracle, write_grads):
    """As the HF Trainer and Lightning record: the loop's forward and its batch-mean backward; with write_grads
    .grad is written from the records (the position embedding's output then starts a fresh leaf)."""
    model, formed = model_and_oracle
    exact = ExactGradients(model)
    model.zero_grad(set_to_none=True)
    with exact.recording(write_grads=write_grads) as recording:
        losses = natural_losses(model, IDS[:B])
        recording.watch(losses)
    losses.mean().backward()
    units = recording.units(from_grad=True)
    torch.testing.assert_close(exact.flat(units), formed[:B], rtol=0, atol=1e-12)
    units.write_grads()
    grad = torch.cat([p.grad.reshape(-1) for p in exact.params])
    torch.testing.assert_close(grad, formed[:B].mean(0), rtol=0, atol=1e-12)
    model.zero_grad(set_to_none=True)


def test_exact_cdgrab_from_the_natural_call_orders_as_cdgrab_fed_the_oracle(model_and_oracle):
    """Two workers, 4 examples each, 3 per step (a pair across steps), two epochs: the orders of CDGraB given
    the oracle's gradients, and the same running sum."""
    model, formed = model_and_oracle
    exact = ExactGradients(model)
    n, m, k = 2, B, 3
    ours = ExactCDGraB(n, m, exact.d, seed=0, dtype=torch.float64)
    reference = CDGraB(n, m, exact.d, seed=0, dtype=torch.float64, sign_loop="gram")  # no numba compile here
    for _ in range(2):
        orders = ours.sort()
        assert torch.equal(orders, reference.sort())
        for start in range(0, m, k):
            positions = range(start, min(start + k, m))
            batch = torch.tensor([j * m + int(orders[j, t]) for j in range(n) for t in positions])  # worker-major
            ours.step(exact(lambda batch=batch: natural_losses(model, IDS[batch])), positions)
            reference.step(formed[batch].view(n, len(positions), -1), positions)
    torch.testing.assert_close(ours.running_sum, reference.running_sum, rtol=0, atol=1e-12)  # sort() zeroes it
    assert torch.equal(ours.sort(), reference.sort()) and ours.near_ties == 0


@pytest.mark.parametrize("dim", [10**6, 24])
def test_layer_sketch_of_the_natural_call_is_the_map_of_the_oracle(model_and_oracle, dim):
    """dim >= d: the identity map, so the sketches are the oracle's gradients; a small dim with every weight a
    TensorSketch block: the map applied to them. Both LayerSketch's own backward and a recording."""
    model, formed = model_and_oracle
    sketcher = LayerSketch(model, dim, seed=3, min_numel=1)
    expected = sketcher.sketch(formed[:B])
    sketches, _ = sketcher(lambda: natural_losses(model, IDS[:B]))
    torch.testing.assert_close(sketches, expected, rtol=0, atol=1e-12)
    with sketcher.recording() as recording:
        losses = natural_losses(model, IDS[:B])
        recording.watch(losses)
    losses.mean().backward()
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(recording.sketches(), expected, rtol=0, atol=1e-12)


def test_the_examples_are_what_most_of_the_calls_tensors_share():
    """The count a broadcast input is spread to: not fooled by position_ids (1, T) given explicitly, nor by a
    tensor argument that is not per example (a (layers, heads) mask)."""
    from sorters.layer_rules import examples_of_call
    ids, positions, mask = torch.zeros(4, T), torch.zeros(1, T), torch.zeros(12, 2)
    assert examples_of_call((), {"input_ids": ids, "position_ids": positions}) == 4
    assert examples_of_call((), {"input_ids": ids, "labels": ids, "head_mask": mask, "position_ids": positions}) == 4
    assert examples_of_call((ids,), {}) == 4 and examples_of_call((), {"use_cache": False}) is None
    assert examples_of_call((torch.zeros(T, 3), torch.zeros(2, 3, 8)), {}, batch_dim=1) == 3  # time-major
