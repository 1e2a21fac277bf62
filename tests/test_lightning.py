"""CDGraBCallback (sorters/lightning.py): CD-GraB orders from a PyTorch Lightning Trainer."""
import runpy
import sys

import pytest
import torch

from sorters import build_sorter
from tests.helpers import DATA_DIR, REPO, check_ok, needs_data, run_script

REPLICAS, BATCH, N, FEATURES, EPOCHS = 2, 2, 24, 3, 3  # m = 12 per replica: 6 steps per epoch
STEPS = N // (REPLICAS * BATCH)
EXAMPLE = "examples/lightning_mlp.py"


@pytest.fixture(scope="module")
def lit():
    """tests/lightning_tiny.py (the test is skipped where Lightning is not installed)."""
    return pytest.importorskip("tests.lightning_tiny")


@pytest.fixture(scope="module")
def uninterrupted(lit):
    model = lit.TinyModel()
    lit.trainer().fit(model)
    return model


def test_orders_equal_the_library_sorter_fed_the_same_gradients(uninterrupted):
    model = uninterrupted
    assert len(model.orders) == EPOCHS and len(model.grads) == EPOCHS * STEPS
    sorter = build_sorter("CD-GraB", REPLICAS, N // REPLICAS, model.grads_of.d, seed=0)
    grads = iter(model.grads)
    for epoch in range(EPOCHS):
        orders = sorter.sort()  # (REPLICAS, m)
        assert torch.equal(orders + torch.arange(REPLICAS)[:, None] * (N // REPLICAS), model.orders[epoch])
        for t in range(0, N // REPLICAS, BATCH):
            sorter.step(next(grads).reshape(REPLICAS, BATCH, -1), range(t, t + BATCH))
    # the orders change from epoch to epoch (so the comparison above compares something)
    assert not torch.equal(model.orders[1], model.orders[2])


def test_the_sampler_gets_each_examples_gradient_at_the_parameters_its_step_starts_from(uninterrupted):
    """Against an ordinary backward pass per example, taken in training_step (before the optimizer step): a
    callback that handed over gradients taken after the update (or of other examples) would differ."""
    model = uninterrupted
    assert len(model.stepped) == len(model.own_grads) == EPOCHS * STEPS
    for step, (got, own) in enumerate(zip(model.stepped, model.own_grads)):
        torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-7, msg=lambda text: f"step {step}: {text}")


# epoch 1 after its 2nd of STEPS batches (Lightning restarts mid-epoch); after epoch 0's last batch
@pytest.mark.parametrize("crash_step", [STEPS + 2, STEPS])
def test_resume_mid_epoch_or_at_epoch_end_gives_the_uninterrupted_orders_and_losses(lit, uninterrupted, crash_step, tmp_path):
    saver = lit.L.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=crash_step, save_top_k=-1,
                                        save_last=False, filename="mid")
    first = lit.TinyModel()
    with pytest.raises(lit.Crash):
        lit.trainer(lit.CrashAt(crash_step), saver, enable_checkpointing=True).fit(first)
    checkpoint = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("CDGraBCallback"))["sampler"]
    assert state["position"] == ((crash_step - 1) % STEPS + 1) * BATCH  # examples per replica stepped this epoch

    resumed = lit.TinyModel()
    lit.trainer().fit(resumed, ckpt_path=tmp_path / "mid.ckpt")
    assert len(resumed.losses) == EPOCHS * STEPS - crash_step  # no batch replayed or skipped
    assert first.losses[:crash_step] + resumed.losses == pytest.approx(uninterrupted.losses, rel=1e-6)
    assert [o.tolist() for o in first.orders + resumed.orders] == [o.tolist() for o in uninterrupted.orders]


def test_sketches_from_the_steps_own_backward_are_the_map_of_each_examples_gradient(lit):
    """CDGraBCallback(settings=CDGraBSettings(structured=True, ...)), the sketcher found as the module's: one
    sampler step per batch with the map of the examples' own gradients (formed independently at the same
    parameters), the orders the library sorter gives for those sketches; a checkpoint of it is refused by a
    callback with another map, or none."""
    from sorters import CDGraBSettings

    model = lit.TinySketchModel()
    callback = lit.CDGraBCallback(settings=CDGraBSettings(sketch_dim=5, seed=2, structured=True, min_numel=1))
    settings = dict(max_epochs=EPOCHS, accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    lit.L.Trainer(callbacks=[callback], **settings).fit(model)
    assert len(model.sketches) == len(model.grads) == EPOCHS * STEPS and len(model.sketcher.sketch.blocks) == 2
    for sketch, grads in zip(model.sketches, model.grads):
        expected = model.sketcher.sketch(grads)
        torch.testing.assert_close(sketch, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    sorter = build_sorter("CD-GraB", REPLICAS, N // REPLICAS, model.sketcher.dim, seed=2)
    sketches = iter(model.sketches)
    for epoch in range(EPOCHS):
        assert torch.equal(sorter.sort() + torch.arange(REPLICAS)[:, None] * (N // REPLICAS), model.orders[epoch])
        for t in range(0, N // REPLICAS, BATCH):
            sorter.step(next(sketches).reshape(REPLICAS, BATCH, -1), range(t, t + BATCH))
    state = callback.state_dict()
    assert state["sketch_map"]["blocks"] == [[0, 6, 3], [24, 1, 6]]
    for other in (None, lit.LayerSketch(model.net, 5, seed=3, min_numel=1)):
        resumed = lit.CDGraBCallback(sampler=model.sampler, sketcher=other)
        with pytest.raises(ValueError, match="resume with the same sketcher"):
            resumed.load_state_dict(state)


def test_settings_refuse_a_sampler_or_sketcher_built_otherwise(lit):
    """CDGraBCallback(settings=...) checks at on_fit_start that the sampler (and, structured, the module's
    sketcher) are what the settings build; each mismatch is one line naming the field."""
    from types import SimpleNamespace

    from sorters import CDGraBSettings

    trainer = SimpleNamespace(datamodule=None)
    model = lit.TinySketchModel()
    model.setup("fit")  # its sampler: CD-GraB, seed 2, sketch_dim 5, REPLICAS replicas

    def refusal(settings, **module):
        with pytest.raises(ValueError) as refused:
            lit.CDGraBCallback(settings=settings).on_fit_start(trainer, SimpleNamespace(sampler=model.sampler, **module))
        assert "\n" not in str(refused.value)
        return str(refused.value)
    right = dict(sketch_dim=5, seed=2, structured=True, min_numel=1)
    lit.CDGraBCallback(settings=CDGraBSettings(**right)).on_fit_start(trainer, model)  # accepted
    assert "sorter='CD-GraB' (settings: 'I-PB')" in refusal(CDGraBSettings(**right, sorter="I-PB"), sketcher=model.sketcher)
    assert "seed=2 (settings: 3)" in refusal(CDGraBSettings(**{**right, "seed": 3}), sketcher=model.sketcher)
    assert "num_replicas=2 (settings: 4)" in refusal(CDGraBSettings(**right, num_replicas=4), sketcher=model.sketcher)
    assert "needs a sketcher" in refusal(CDGraBSettings(**right))
    other = lit.LayerSketch(model.net, 4, seed=2, min_numel=1)
    assert "dim=4, seed=2" in refusal(CDGraBSettings(**right), sketcher=other)
    with pytest.raises(ValueError, match="structured=True"):
        lit.CDGraBCallback(sketcher=model.sketcher, settings=CDGraBSettings(sketch_dim=5))
    with pytest.raises(TypeError, match="CDGraBSettings"):
        lit.CDGraBCallback(settings={"sorter": "CD-GraB"})


def test_a_sketcher_without_watched_losses_is_refused_in_one_line(lit):
    model = lit.TinySketchModel()
    model.training_step = lambda batch, batch_idx: ((model.net(batch[0]).squeeze(-1) - batch[1]) ** 2).mean()
    with pytest.raises(ValueError, match="watch\\(self, per_example_losses\\)") as refused:
        lit.L.Trainer(callbacks=[lit.CDGraBCallback(sketcher=model.sketcher)], max_epochs=1, accelerator="cpu",
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False).fit(model)
    assert "\n" not in str(refused.value)


def test_use_distributed_sampler_is_refused_before_the_first_step(lit):
    model = lit.TinyModel()
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        lit.trainer(use_distributed_sampler=True).fit(model)
    assert model.grads == [] and model.losses == []


def test_a_mid_epoch_state_needs_the_lightning_sampler(lit):
    """Loaded through the callback, a mid-epoch state makes the next iteration the rest of that epoch while
    len() stays the whole epoch's (Lightning subtracts the batches done itself); a plain CDGraBSampler,
    whose len() is the rest, is refused in one line that names the class to use."""
    from sorters import CDGraBSampler

    interrupted = CDGraBSampler(N, batch_size=BATCH, sorter="D-RR", num_replicas=REPLICAS)
    epoch = list(interrupted)  # step by step: each step is REPLICAS x BATCH indices
    interrupted.step(None)
    resumed = lit.LightningCDGraBSampler(N, batch_size=BATCH, sorter="D-RR", num_replicas=REPLICAS)
    lit.CDGraBCallback(sampler=resumed).load_state_dict({"sampler": interrupted.state_dict()})
    assert len(resumed) == len(epoch) and list(resumed) == epoch[REPLICAS * BATCH:]
    plain = lit.CDGraBCallback(sampler=CDGraBSampler(N, batch_size=BATCH, sorter="D-RR", num_replicas=REPLICAS))
    with pytest.raises(ValueError, match="LightningCDGraBSampler"):
        plain.load_state_dict({"sampler": interrupted.state_dict()})


@needs_data("m4/Weekly-train.csv", "m4/Weekly-test.csv")
@pytest.mark.parametrize("exact", ["off", "on"])
def test_two_gloo_processes_equal_one_process_and_hold_the_same_state(lit, tmp_path, monkeypatch, exact):
    """examples/lightning_mlp.py under torchrun (Lightning joins the 2 processes: DDP over gloo) against
    the same run with both replicas in one process: the same orders, losses to rounding, and both ranks
    end with the same sampler state. The one-process run runs here (runpy): Lightning is imported in this
    process already, and each fresh process spends seconds importing it. --exact-low-memory on: the
    callback has the sampler divide the products over the 2 ranks (each its own parameters'), and the
    state each rank saves puts the running sum's parts together."""
    tiny = ["--max-train-examples", "64", "--batch-size", "8", "--epochs", "2", "--progress", "off",
            "--exact-low-memory", exact]
    multi = run_script(EXAMPLE, *tiny, "--save-orders", tmp_path / "ddp.pt", nproc=2)
    check_ok(multi)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [EXAMPLE, *tiny, "--replicas", "2", "--save-orders", str(tmp_path / "one.pt"),
                                    "--data-dir", str(DATA_DIR)])
        patch.setattr(sys, "path", list(sys.path))  # the example adds the repo root
        one = runpy.run_path(str(REPO / EXAMPLE), run_name="__main__")
    a, b = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "one.pt")
    assert len(a["orders"]) == 2 and all(torch.equal(x, y) for x, y in zip(a["orders"], b["orders"]))
    assert not torch.equal(a["orders"][0], a["orders"][1])
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    states = [torch.load(tmp_path / f"ddp.pt.rank{r}") for r in (0, 1)]
    assert states[0]["position"] == states[0]["config"]["m"] == 32  # the whole last epoch stepped
    assert_same(states[0], states[1])
    if exact == "on":  # the whole running sum: the ranks' parts put together are the one process's
        torch.testing.assert_close(states[0]["sorter"]["running_sum"],
                                   one["model"].sampler.state_dict()["sorter"]["running_sum"], rtol=1e-4, atol=1e-6)


def test_under_ddp_the_callback_has_an_exact_sampler_divide_the_products(lit):
    """With exact records and more than one process (Lightning takes every callback's state on every rank,
    as a divided sampler's state_dict() needs) the callback sets divide_products; in one process it does not."""
    from types import SimpleNamespace

    from sorters import CDGraBSettings

    settings = CDGraBSettings(num_replicas=REPLICAS, exact_low_memory=True)
    for world, divided in ((1, False), (2, True)):
        model = lit.TinyExactModel(settings)
        model.setup("fit")
        lit.CDGraBCallback(settings=settings).on_fit_start(SimpleNamespace(datamodule=None, world_size=world), model)
        assert model.sampler.divide_products is divided
    formed = lit.TinyExactModel(CDGraBSettings(num_replicas=REPLICAS))
    formed.setup("fit")
    lit.CDGraBCallback(settings=CDGraBSettings(num_replicas=REPLICAS)).on_fit_start(
        SimpleNamespace(datamodule=None, world_size=2), formed)
    assert formed.sampler.divide_products is False  # not an exact sampler


def assert_same(a, b, where="state"):
    """Nested dicts / lists of tensors and plain values are equal, tensors exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_exact_low_memory_from_the_steps_own_backward_gives_the_formed_gradients_orders_and_losses(lit):
    """CDGraBCallback(settings=CDGraBSettings(exact_low_memory=True)): the sampler (an ExactCDGraB, built by
    settings.sampler) is stepped with the layer records of the training step's own forward and backward; the
    orders and losses are those of the same run balancing the formed per-example gradients (PerExampleGrads,
    CD-GraB's float64 running sum), with an odd batch (pairs across steps) and a LayerNorm."""
    from sorters import CDGraBSettings
    from sorters.exact import ExactCDGraB

    runs = {}
    for exact in (False, True):
        settings = CDGraBSettings(seed=3, num_replicas=REPLICAS, exact_low_memory=exact)
        model = runs[exact] = lit.TinyExactModel(settings)
        lit.L.Trainer(callbacks=[lit.CDGraBCallback(settings=settings)], max_epochs=EPOCHS, accelerator="cpu",
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False).fit(model)
    formed, exact = runs[False], runs[True]
    assert isinstance(exact.sampler.sorter, ExactCDGraB) and not isinstance(formed.sampler.sorter, ExactCDGraB)
    assert len(exact.losses) == EPOCHS * N // (REPLICAS * 3) and exact.sampler.sorter.near_ties == 0
    assert [o.tolist() for o in exact.orders] == [o.tolist() for o in formed.orders]
    assert not torch.equal(formed.orders[1], formed.orders[2])  # the orders depend on the gradients
    assert exact.losses == pytest.approx(formed.losses, rel=1e-5)


def test_exact_needs_its_records_and_an_exact_sampler(lit):
    """Each mismatch between the exact sampler and the layer records is one line that says what to build."""
    from types import SimpleNamespace

    from sorters import CDGraBSettings

    trainer = SimpleNamespace(datamodule=None)
    settings = CDGraBSettings(num_replicas=REPLICAS, exact_low_memory=True)
    model = lit.TinyExactModel(settings)
    model.setup("fit")
    lit.CDGraBCallback(settings=settings).on_fit_start(trainer, model)  # accepted: finds model.exact

    def refusal(callback, module):
        with pytest.raises(ValueError) as refused:
            callback.on_fit_start(trainer, module)
        assert "\n" not in str(refused.value)
        return str(refused.value)
    assert "self.exact = settings.exact_gradients" in refusal(lit.CDGraBCallback(settings=settings),
                                                              SimpleNamespace(sampler=model.sampler))
    formed = lit.TinyExactModel(CDGraBSettings(num_replicas=REPLICAS))
    formed.setup("fit")
    assert "sampler built with exact=True" in refusal(lit.CDGraBCallback(exact=model.exact), formed)
    narrower = CDGraBSettings(num_replicas=REPLICAS, exact_low_memory=True, grad_params=r"^3\.")
    assert "build the sampler with d=exact.d" in refusal(
        lit.CDGraBCallback(settings=settings, exact=narrower.exact_gradients(model.net)), model)
    with pytest.raises(ValueError, match="drop grads_fn"):
        lit.CDGraBCallback(settings=settings, grads_fn=lambda module, batch: None)
    with pytest.raises(ValueError, match="exact_low_memory=True"):
        lit.CDGraBCallback(settings=CDGraBSettings(), exact=model.exact)
