"""What a new user tripped on (issue #59, goal 9): a loop that never calls step() (a fixed order, silently),
dropout (refused on one path, taken on the other, so one process and two gave other orders), and messages
that counted epochs two ways, said "1 replicas" and read the user's data without saying so."""
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sorters import SORTERS, CDGraBSampler, LayerSketch, NonFiniteGradientError, PerExampleGrads, build_sorter
from sorters.exact import ExactGradients

N, REPLICAS, BATCH, D = 24, 2, 2, 3
TABLE = torch.randn(N, D, generator=torch.Generator().manual_seed(0))  # example i's gradient: row i


def extra(name):
    return {"epochs": 4} if SORTERS[name].uses_total_epochs else {}


def loader_of(sampler):
    return DataLoader(TensorDataset(torch.arange(N)), batch_size=sampler.loader_batch_size, sampler=sampler)


def step_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "step()" in str(w.message)]


# ------------------------------------------------------------------ a loop that never calls step()


@pytest.mark.parametrize("name", ["CD-GraB", "I-B", "KH-SGD"])
def test_a_loop_that_forgets_step_is_warned_that_its_order_is_fixed(name):
    """The trip: without step() (and without the optional set_epoch) every epoch repeats the first order.
    Two whole iterations without a step() may still be a look at the data and an evaluation; the third warns."""
    sampler = CDGraBSampler(N, batch_size=BATCH, d=D, num_replicas=REPLICAS, sorter=name, **extra(name))
    loader, orders = loader_of(sampler), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            before = len(step_warnings(caught))
            orders.append(torch.cat([indices for (indices,) in loader]))
            assert len(step_warnings(caught)) - before == (epoch == 2), epoch
    assert all(torch.equal(o, orders[0]) for o in orders)  # what the warning is about: one fixed order
    message = step_warnings(caught)[0]
    assert message.startswith("CDGraBSampler: 2 iterations went through the same epoch without any step() call, "
                              f"so {name} got no gradients") and "Call sampler.step(per-example gradients)" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["CD-GraB", "I-B", "D-RR"])
def test_a_proper_loop_with_a_peek_and_an_evaluation_pass_gets_no_warning(name):
    """step() after every batch; between epochs a peek at a batch and a whole pass that evaluates (no step)."""
    sampler = CDGraBSampler(N, batch_size=BATCH, d=D, num_replicas=REPLICAS, sorter=name, **extra(name))
    loader, orders = loader_of(sampler), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            next(iter(loader))
            seen = torch.cat([indices for (indices,) in loader])  # an evaluation over the training loader
            for (indices,) in loader:
                sampler.step(TABLE[indices] if sampler.uses_grads else None)
            orders.append(seen)
    assert step_warnings(caught) == []
    if name != "D-RR":
        assert not torch.equal(orders[1], orders[2])  # the gradients reached the sorter


def test_a_sampler_that_ignores_gradients_never_warns_without_steps():
    sampler = CDGraBSampler(N, batch_size=BATCH, num_replicas=REPLICAS, sorter="D-SO")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            list(loader_of(sampler))
    assert step_warnings(caught) == []


def test_with_set_epoch_a_forgotten_step_is_refused_in_one_line():
    sampler = CDGraBSampler(N, batch_size=BATCH, d=D, num_replicas=REPLICAS)
    sampler.set_epoch(0)
    list(loader_of(sampler))
    with pytest.raises(ValueError, match=r"epoch 0 ended without step\(\) calls.*call sampler.step"):
        sampler.set_epoch(1)


@pytest.mark.parametrize("name", ["CD-GraB", "I-PB", "SBW", "Greedy", "RPB"])
def test_a_sorter_sorted_again_without_steps_warns_and_a_stepped_one_does_not(name):
    sorter = build_sorter(name, REPLICAS, 4, D, **extra(name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = sorter.sort()
        for t in range(4):
            sorter.step(TABLE[t * REPLICAS:(t + 1) * REPLICAS, None], [t])
        sorter.sort()
        assert step_warnings(caught) == []  # the first sort() and a stepped epoch
        again = sorter.sort()
    assert len(step_warnings(caught)) == 1 and step_warnings(caught)[0].startswith(
        f"{name}: sort() after an epoch without any step(), so the next epoch repeats this one's order")
    assert first.shape == again.shape


# ------------------------------------------------------------------ dropout: one line on every path


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))

    def forward(self, x):
        return self.body(x)


def test_every_library_path_refuses_dropout_in_training_mode_in_the_same_line():
    """Formed gradients (torch.func), exact products from layer records (own backward and the loop's) and
    sketches from records (own backward and the loop's): the same line after the class name, saying what to do."""
    model, x, y = Net().train(), torch.randn(4, 3), torch.tensor([0, 1, 1, 0])

    def losses():
        return F.cross_entropy(model(x), y, reduction="none")

    def recorded(recorder):
        with recorder.recording() as recording:
            recording.watch(losses())

    calls = {"PerExampleGrads": lambda: PerExampleGrads(model, F.cross_entropy)(x, y),
             "ExactGradients": lambda: ExactGradients(model)(losses),
             "ExactGradients.recording": lambda: recorded(ExactGradients(model)),
             "LayerSketch": lambda: LayerSketch(model, 4)(losses),
             "LayerSketch.recording": lambda: recorded(LayerSketch(model, 4))}
    lines = {}
    for path, call in calls.items():
        with pytest.raises(ValueError) as refused:
            call()
        owner = path.split(".")[0]
        assert str(refused.value).startswith(f"{owner}: module 'body.1' is Dropout(p=0.5) in training mode; "), path
        lines[path] = str(refused.value)[len(owner):]
    assert len(set(lines.values())) == 1 and "\n" not in lines["ExactGradients"]
    assert "set its p to 0" in lines["ExactGradients"] and "model.eval()" in lines["ExactGradients"]
    model.eval()  # the fix the line gives: every path works
    assert PerExampleGrads(model, F.cross_entropy)(x, y).shape == (4, 26)
    assert ExactGradients(model).flat(ExactGradients(model)(losses)).shape == (4, 26)
    assert LayerSketch(model, 4)(losses)[0].shape == (4, 4)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tests.hf_trainer_tiny as tiny
    return tiny


@pytest.mark.parametrize("path", [dict(exact_low_memory=False), dict(), dict(exact_low_memory=True),
                                  dict(structured=True, sketch_dim=8)], ids=["formed", "auto", "records", "sketches"])
def test_the_trainer_refuses_dropout_on_every_path_in_the_same_line(hf, path, tmp_path):
    """GPT-2's default dropout (0.1 here): refused before the first step whichever path the settings take (the
    records path, the default, once took it silently, so one process and two processes gave other orders)."""
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(dropout=0.1), args=hf.training_args(tmp_path),
                                  train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS, **path)
    with pytest.raises(ValueError) as refused:
        trainer.train()
    assert str(refused.value) == (
        "RecordingTrainer: module 'transformer.drop' is Dropout(p=0.1) in training mode; per-example gradients need "
        "a model without randomness (dropout masks differ between one process and N, and so would the orders): set "
        "its p to 0 (transformers: the config's dropout fields, e.g. resid_pdrop, embd_pdrop, attn_pdrop = 0.0)")
    assert trainer.batches == []


# ------------------------------------------------------------------ messages


def test_the_sampler_names_a_non_finite_step_with_one_epoch_count():
    """Exact CD-GraB from records, a NaN input from epoch 1 on: the line counts epochs from 0 only."""
    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1)
    exact = ExactGradients(model)
    sampler = CDGraBSampler(8, batch_size=2, d=exact.d, num_replicas=1, exact=True)
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, sampler=sampler)
    x = torch.randn(8, D)

    def epoch():
        for (indices,) in loader:
            sampler.step_units(exact(lambda indices=indices: model(x[indices]).squeeze(1) ** 2))

    epoch()
    x[5, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError) as refused:
        epoch()
    message = str(refused.value)
    assert message.startswith("CDGraBSampler: step ") and " of 4 in epoch 1 (counting from 0): CD-GraB: non-finite " \
        "gradient (nan or inf), step at positions " in message, message
    assert message.count("epoch") == 1, message


def test_one_replica_and_one_example_are_singular(hf, tmp_path):
    rows = hf.token_rows(25)
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path), rows=rows,
                                  train_dataset=hf.examples(rows), exact_low_memory=False)
    with pytest.raises(ValueError) as refused:
        trainer.train()
    assert str(refused.value) == (
        "RecordingTrainer: a dataset of 25 examples does not split into full batches of 1 replica x 2; pass "
        "dataloader_drop_last=True (the last 1 example would never be used) or trim the dataset")
    with pytest.raises(ValueError, match=r"^1 example is too few for 1 replica x batch_size 2$"):
        CDGraBSampler(1, batch_size=2, sorter="D-RR", drop_last=True)


def test_the_trainer_says_when_it_reads_the_first_two_items_before_training(hf, tmp_path, caplog):
    trainer = hf.RecordingTrainer(model=hf.tiny_gpt2(), args=hf.training_args(tmp_path, max_steps=1),
                                  train_dataset=hf.examples(hf.token_rows()), num_replicas=hf.REPLICAS)
    with caplog.at_level(logging.INFO, logger="sorters.hf"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if r.name == "sorters.hf"]
    assert said and said[0].startswith("RecordingTrainer: reading train_dataset[0] and [1] before training")
    assert trainer.cdgrab_settings.exact_low_memory  # the records path, the default
