"""The orderers of issue #60 (FlipFlop, SWR, Greedy, MB-GraB, RPB) through the framework glue: CDGraBSampler, the
HF Trainer (CDGraBTrainer, CDGraBSettings(sorter=...)) and Lightning's CDGraBCallback take each by name and train
on the orders of the registry sorter driven by hand (FlipFlop and SWR: their rule written out here); the
gradient-free ones (and D-RR) never form a per-example gradient, nor does MB-GraB where the glue reads its
micro-batch gradient from the step's own backward (one process hosting one replica)."""
import numpy as np
import pytest
import torch

from sorters import CDGraBSampler, PerExampleGrads, PerExampleLossGrads, build_sorter
from tests.test_lightning import BATCH as LIT_BATCH
from tests.test_lightning import EPOCHS as LIT_EPOCHS
from tests.test_lightning import N as LIT_N

NEW = ["FlipFlop", "SWR", "Greedy", "MB-GraB", "RPB"]
GRADIENT_FREE = ["FlipFlop", "SWR", "D-RR"]


def seeded_rule(name, seed, epoch, rank, m) -> torch.Tensor:
    """The oracle of the gradient-free orderers, from their definitions: FlipFlop draws a uniform permutation
    from (seed, even epoch, rank, stream 1) and runs it backwards on the odd epoch after; SWR draws m units with
    replacement from (seed, epoch, rank, stream 2). Returns worker `rank`'s (m,) order of `epoch` (from 0)."""
    stream = 1 if name == "FlipFlop" else 2
    drawn_in = epoch - epoch % 2 if name == "FlipFlop" else epoch
    words = np.random.SeedSequence([seed, drawn_in, rank, stream]).generate_state(1, np.uint64)
    generator = torch.Generator().manual_seed(int(words[0]))
    if name == "SWR":
        return torch.randint(m, (m,), generator=generator)
    order = torch.randperm(m, generator=generator)
    return order.flip(0) if epoch % 2 else order


def expected_orders(name, replicas, m, d, grads, batch, epochs, seed=0) -> list[torch.Tensor]:
    """Each epoch's (replicas, m) dataset indices: FlipFlop and SWR by their rule, the others by the registry sorter
    stepped by hand with `grads`, an iterator of each step's (replicas, k, d) gradients (k = batch, or 1: MB-GraB's
    micro-batch gradients)."""
    first = torch.arange(replicas)[:, None] * m
    if name in ("FlipFlop", "SWR"):
        return [torch.stack([seeded_rule(name, seed, e, r, m) for r in range(replicas)]) + first for e in range(epochs)]
    sorter = build_sorter(name, replicas, m, d, seed=seed, batch_size=batch)
    orders = []
    for _ in range(epochs):
        orders.append(sorter.sort() + first)
        for t in range(0, m, batch):
            sorter.step(next(grads) if sorter.uses_grads else None, range(t, t + batch))
    return orders


def by_epoch(batches, replicas, m, batch) -> list[torch.Tensor]:
    """Micro-batches of dataset indices (replica 0's `batch`, then replica 1's, ...) -> each epoch's (replicas, m)."""
    steps = m // batch
    out = []
    for e in range(0, len(batches), steps):
        chunk = torch.tensor(batches[e:e + steps]).view(steps, replicas, batch)
        out.append(chunk.permute(1, 0, 2).reshape(replicas, m))
    return out


def no_per_example_grads(monkeypatch):
    """The per-example gradients' entry points raise: a glue that forms one fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a per-example gradient was formed")
    monkeypatch.setattr(PerExampleGrads, "__call__", refuse)
    monkeypatch.setattr(PerExampleLossGrads, "__call__", refuse)


# ----------------------------------------------------------------------------------------------- the sampler


@pytest.mark.parametrize("name", NEW)
def test_the_sampler_gives_the_registry_sorters_orders(name):
    """Replicas in one process, a table of per-example gradients; MB-GraB also fed each replica's batch mean."""
    replicas, m, batch, d, epochs = 2, 12, 3, 4, 3
    table = torch.randn(replicas * m, d, generator=torch.Generator().manual_seed(4))
    sampler = CDGraBSampler(replicas * m, batch_size=batch, d=d, sorter=name, num_replicas=replicas, seed=7)
    fed, got = [], []
    for _ in range(epochs):
        indices = torch.tensor(list(sampler))
        for step in indices.split(sampler.loader_batch_size):
            rows = table[step].view(replicas, batch, d)
            fed.append(rows)
            sampler.step(rows.mean(1) if name == "MB-GraB" else rows.reshape(-1, d))  # MB-GraB: (R, d)
        got.append(sampler.all_indices())
    want = expected_orders(name, replicas, m, d, iter(fed), batch, epochs, seed=7)
    for epoch in range(epochs):
        assert torch.equal(got[epoch], want[epoch]), f"{name}, epoch {epoch}"
    # the orders move, so the comparison compares something (Greedy's, fed fixed gradients, settle at once)
    assert not torch.equal(got[0], got[1])


# ------------------------------------------------------------------------------------------- the HF Trainer


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tests.hf_trainer_tiny as tiny
    return tiny


def micro_batch_gradient(model, inputs, names) -> torch.Tensor:
    """The oracle of MB-GraB's unit gradient: (d,), the micro-batch's mean loss by an ordinary backward pass."""
    named = dict(model.named_parameters())
    grads = torch.autograd.grad(model(**inputs).loss, [named[name] for name in names])
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("name,replicas", [(name, 2) for name in NEW + ["D-RR"]] + [("MB-GraB", 1)])
def test_the_hf_trainer_takes_each_orderer_by_name(hf, name, replicas, tmp_path, monkeypatch):
    """2 epochs; the gradient-free ones and MB-GraB in one process hosting one replica with the per-example
    gradients' entry points raising; MB-GraB there steps with its micro-batch's gradient from the Trainer's own
    backward: a constant multiple of its mean gradient, (T - 1) / (ACCUM T), as transformers divides the
    micro-batch's B (T - 1) token losses by num_items_in_batch, the ACCUM B T labels of the accumulated
    micro-batches (counted before the shift)."""
    from_backward = name == "MB-GraB" and replicas == 1
    if name in GRADIENT_FREE or from_backward:
        no_per_example_grads(monkeypatch)
    oracle = []

    class Trainer(hf.RecordingTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            if from_backward:
                oracle.append(micro_batch_gradient(self.model, inputs, self.cdgrab_grads.names))
            return super().training_step(model, inputs, *args, **kwargs)

    from sorters import CDGraBSettings
    trainer = Trainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path, num_train_epochs=2),
                      train_dataset=hf.examples(hf.token_rows()),
                      cdgrab=CDGraBSettings(sorter=name, num_replicas=replicas, exact_low_memory=False))
    trainer.train()
    m = hf.N // replicas
    got = by_epoch(trainer.batches, replicas, m, hf.BATCH)
    if from_backward:
        assert len(oracle) == len(trainer.grads) == 2 * m // hf.BATCH
        for step, (stepped, own) in enumerate(zip(trainer.grads, oracle)):
            scale = (hf.T - 1) / (hf.ACCUM * hf.T)
            torch.testing.assert_close(stepped[0], own * scale, rtol=1e-4, atol=1e-6, msg=f"step {step}")
        fed = iter(g.view(1, 1, -1) for g in oracle)
    else:
        fed = iter(g.view(replicas, hf.BATCH, -1) for g in trainer.grads if g is not None)
    d = trainer.cdgrab_grads.d if trainer.cdgrab_grads is not None else 1
    want = expected_orders(name, replicas, m, d, fed, hf.BATCH, 2)
    for epoch in range(2):
        assert torch.equal(got[epoch], want[epoch]), f"{name}, epoch {epoch}"
    assert all(g is None for g in trainer.grads) == (name in GRADIENT_FREE)


# --------------------------------------------------------------------------------------------- Lightning


@pytest.fixture(scope="module")
def lit():
    return pytest.importorskip("tests.lightning_tiny")


@pytest.mark.parametrize("name,replicas", [(name, 2) for name in NEW + ["D-RR"]] + [("MB-GraB", 1)])
def test_the_lightning_callback_takes_each_orderer_by_name(lit, name, replicas, monkeypatch):
    """As the HF test: the gradient-free ones and MB-GraB with one replica never call per_example_grads (nor
    PerExampleGrads); MB-GraB there gets each batch's mean gradient from the step's own backward."""
    from_backward = name == "MB-GraB" and replicas == 1
    silent = name in GRADIENT_FREE or from_backward
    if silent:
        no_per_example_grads(monkeypatch)
    oracle = []

    class Model(lit.TinyModel):
        def setup(self, stage):
            self.sampler = lit.LightningCDGraBSampler(self.train_set, batch_size=LIT_BATCH, d=self.grads_of.d,
                                                      sorter=self.sorter_name, num_replicas=replicas)
            step = self.sampler.step
            self.sampler.step = lambda grads: (self.stepped.append(grads), step(grads))[1]

        def training_step(self, batch, batch_idx):
            if from_backward:
                oracle.append(lit.each_examples_gradient(self.net, *batch).mean(0))
            return super().training_step(batch, batch_idx)

        def per_example_grads(self, batch):
            assert not silent, "per_example_grads called"
            return super().per_example_grads(batch)

    model = Model(name)
    lit.trainer().fit(model)
    m = LIT_N // replicas
    assert len(model.orders) == LIT_EPOCHS
    if from_backward:
        assert len(oracle) == len(model.stepped) == LIT_EPOCHS * m // LIT_BATCH
        for step, (stepped, own) in enumerate(zip(model.stepped, oracle)):
            torch.testing.assert_close(stepped[0], own, rtol=1e-5, atol=1e-7, msg=f"step {step}")
        fed = iter(g.view(1, 1, -1) for g in oracle)
    else:
        fed = iter(g.view(replicas, LIT_BATCH, -1) for g in model.grads)
    want = expected_orders(name, replicas, m, model.grads_of.d, fed, LIT_BATCH, LIT_EPOCHS)
    for epoch in range(LIT_EPOCHS):
        assert torch.equal(model.orders[epoch], want[epoch]), f"{name}, epoch {epoch}"
    assert all(g is None for g in model.stepped) == (name in GRADIENT_FREE)


def test_lightning_refuses_a_sampler_of_another_d_for_mb_grab_from_the_backward(lit):
    class Model(lit.TinyModel):
        def setup(self, stage):
            self.sampler = lit.LightningCDGraBSampler(self.train_set, batch_size=LIT_BATCH, d=3, sorter="MB-GraB",
                                                      num_replicas=1)

    with pytest.raises(ValueError) as info:
        lit.trainer().fit(Model("MB-GraB"))
    message = str(info.value)
    assert "\n" not in message and "sampler was built with d=3" in message and "4 numbers" in message
