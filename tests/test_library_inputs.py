"""Bad input to the library's public classes: one line, raised by our own check (never from inside torch),
a TypeError for a wrong type and a ValueError for a bad value; and non-finite gradients stopped at step().

Tables: every constructor argument of CDGraBSampler, every sorter (through build_sorter), PerExampleGrads,
LayerSketch, GradientSketch and CDGraBSettings with wrong types and out-of-range values; load_state_dict of the sampler and
of every sorter with states that are not theirs; step() with a list."""
from pathlib import Path

import numpy as np
import pytest
import torch

import sorters
import sorters.balance as sorters_balance
import sorters.base as sorters_base
from sorters import (SORTER_NAMES, SORTERS, CDGraBSampler, CDGraBSettings, GradientSketch, LayerSketch,
                     NonFiniteGradientError, PerExampleGrads, build_sorter)

SORTERS_DIR = Path(sorters.__file__).parent
BALANCING = [name for name, cls in SORTERS.items() if cls.uses_grads]


def refusal(call, kind=(TypeError, ValueError)) -> tuple[type, str]:
    """(exception type, message) of call(); the message is one line and was raised in sorters/, not torch."""
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert message and "\n" not in message, message
    raised_in = Path(str(info.traceback[-1].path))
    assert SORTERS_DIR in raised_in.parents, f"raised in {raised_in}: {message}"
    return info.type, message


def extra(name):
    return {"epochs": 3} if SORTERS[name].uses_total_epochs else {}


# ------------------------------------------------------------------------------------------ constructors

# (argument, bad value, expected exception, a fragment the message must hold)
SORTER_ARGS = [
    ("n_workers", 2.0, TypeError, "n_workers must be an integer"),
    ("n_workers", 0, ValueError, "need n_workers, m, d >= 1"),
    ("m", "8", TypeError, "m must be an integer"),
    ("m", True, TypeError, "m must be an integer"),
    ("d", 10.5, TypeError, "d must be an integer, got 10.5"),
    ("d", -1, ValueError, "need n_workers, m, d >= 1"),
    ("seed", 1.5, TypeError, "seed must be an integer"),
    ("seed", 2**64, ValueError, "seed must be in"),
    ("device", "gpu7", ValueError, "device 'gpu7' is not a device name"),
    ("device", 3.0, TypeError, "device must be a str or torch.device"),
    ("nonfinite", "ignore", ValueError, "nonfinite must be one of 'raise', 'skip'"),
]


@pytest.mark.parametrize("name", SORTER_NAMES)
@pytest.mark.parametrize("arg,value,kind,fragment", SORTER_ARGS, ids=[f"{a}={v!r}" for a, v, *_ in SORTER_ARGS])
def test_every_sorter_refuses_each_bad_argument_in_one_line(name, arg, value, kind, fragment):
    args = {"n_workers": 2, "m": 8, "d": 3, "seed": 0, "device": "cpu", "nonfinite": "raise", **{arg: value}}
    raised, message = refusal(lambda: build_sorter(name, **args, **extra(name)))
    assert raised is kind and fragment in message and message.startswith(name), message


def test_build_sorter_refuses_an_unknown_name_and_epochs_of_the_wrong_kind():
    assert refusal(lambda: build_sorter(["CD-GraB"], 2, 8, 3))[1].startswith("unknown sorter ['CD-GraB']")
    for name in ("KH-SGD", "SBW"):
        for epochs in (None, 0, 2.5, True):
            assert "needs the run's total number of epochs" in refusal(lambda: build_sorter(name, 2, 8, 3, epochs=epochs))[1]


SAMPLER_ARGS = [
    ("dataset", 24.0, TypeError, "dataset must be a sized dataset or its length"),
    ("dataset", 0, ValueError, "the dataset's length must be >= 1"),
    ("batch_size", 2.5, TypeError, "batch_size must be an integer"),
    ("batch_size", 0, ValueError, "batch_size >= 1"),
    ("d", 10.5, TypeError, "d must be an integer or None, got 10.5"),
    ("d", 0, ValueError, "pass d, the length of one example's gradient"),
    ("sorter", "GraB", ValueError, "unknown sorter 'GraB'"),
    ("sorter", None, ValueError, "unknown sorter None"),
    ("num_replicas", "2", TypeError, "num_replicas must be an integer"),
    ("num_replicas", 0, ValueError, "num_replicas >= 1"),
    ("rank", 1.0, TypeError, "rank must be an integer"),
    ("rank", -1, ValueError, "rank -1 is not in 0..1"),
    ("seed", "0", TypeError, "seed must be an integer"),
    ("seed", -2**63 - 1, ValueError, "seed must be in"),
    ("drop_last", 1, TypeError, "drop_last must be True or False"),
    ("device", "tpu:x", ValueError, "is not a device name"),
    ("epochs", 2.0, TypeError, "epochs must be an integer or None"),
    ("sketch_dim", 1.5, TypeError, "sketch_dim must be an integer"),
    ("sketch_dim", -4, ValueError, "sketch_dim must be 0, or > 0"),
    ("view", "all", ValueError, "view must be 'rank'"),
    ("nonfinite", "zero", ValueError, "nonfinite must be one of 'raise', 'skip'"),
]


@pytest.mark.parametrize("arg,value,kind,fragment", SAMPLER_ARGS, ids=[f"{a}={v!r}" for a, v, *_ in SAMPLER_ARGS])
def test_the_sampler_refuses_each_bad_argument_in_one_line(arg, value, kind, fragment):
    args = {"dataset": 24, "batch_size": 2, "d": 3, "num_replicas": 2, "seed": 0, **{arg: value}}
    raised, message = refusal(lambda: CDGraBSampler(**args))
    assert raised is kind and fragment in message, message


def tiny_model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


MODEL_ARGS = {
    PerExampleGrads: [
        ("model", "net", TypeError, "model must be a torch.nn.Module"),
        ("loss_fn", None, TypeError, "loss_fn must be callable"),
        ("params", 3, TypeError, "params must be None, a regular expression"),
        ("params", "nothing-matches", ValueError, "no trainable parameter name matches"),
        ("chunk_size", 0, ValueError, "chunk_size must be >= 1"),
        ("chunk_size", 2.5, TypeError, "chunk_size must be an integer or None"),
        ("sketch_dim", 10.5, TypeError, "sketch_dim must be an integer"),
        ("sketch_dim", -1, ValueError, "sketch_dim must be >= 0"),
        ("sketch_seed", 0.5, TypeError, "sketch_seed"),
        ("structured", "yes", TypeError, "structured must be True or False"),
        ("structured", True, ValueError, "structured=True needs sketch_dim > 0"),
        ("min_numel", 0, ValueError, "min_numel must be >= 1"),
    ],
    LayerSketch: [
        ("model", None, TypeError, "model must be a torch.nn.Module"),
        ("dim", 0, ValueError, "dim must be >= 1"),
        ("dim", 4.5, TypeError, "dim must be an integer"),
        ("seed", None, TypeError, "seed must be an integer"),
        ("params", ["0.weight", 2], TypeError, "params must be None"),
        ("min_numel", 1.0, TypeError, "min_numel must be an integer"),
        ("min_numel", 0, ValueError, "min_numel must be >= 1"),
        ("batch_dim", 2, ValueError, "batch_dim must be 0 or 1"),
        ("batch_dim", True, ValueError, "batch_dim must be 0 or 1"),
    ],
}


@pytest.mark.parametrize("cls,arg,value,kind,fragment",
                         [(cls, *row) for cls, rows in MODEL_ARGS.items() for row in rows],
                         ids=[f"{cls.__name__}-{row[0]}={row[1]!r}" for cls, rows in MODEL_ARGS.items() for row in rows])
def test_per_example_grads_and_layer_sketch_refuse_each_bad_argument(cls, arg, value, kind, fragment):
    args = ({"model": tiny_model(), "loss_fn": torch.nn.functional.mse_loss} if cls is PerExampleGrads
            else {"model": tiny_model(), "dim": 4})
    args[arg] = value
    raised, message = refusal(lambda: cls(**args))
    assert raised is kind and fragment in message and message.startswith(cls.__name__), message


SETTINGS_ARGS = [
    ("sorter", "GraB", ValueError, "unknown sorter 'GraB'; choose one of CD-GraB"),
    ("sorter", None, ValueError, "unknown sorter None"),
    ("seed", 0.5, TypeError, "seed must be an integer"),
    ("seed", 2**64, ValueError, "seed must be in "),
    ("grad_params", 3, TypeError, "grad_params must be None, a regular expression or a list of them"),
    ("grad_params", [], TypeError, "grad_params must be None"),
    ("grad_params", ["a", 2], TypeError, "grad_params must be None"),
    ("grad_chunk_size", 0, ValueError, "grad_chunk_size must be >= 1"),
    ("grad_chunk_size", 2.5, TypeError, "grad_chunk_size must be an integer or None"),
    ("sketch_dim", -1, ValueError, "sketch_dim must be >= 0"),
    ("sketch_dim", 8.0, TypeError, "sketch_dim must be an integer"),
    ("structured", "yes", TypeError, "structured must be True or False"),
    ("structured", True, ValueError, "it needs sketch_dim > 0 and a balancing sorter"),
    ("min_numel", 0, ValueError, "min_numel must be >= 1"),
    ("min_numel", 2.0**16, TypeError, "min_numel must be an integer"),
    ("num_replicas", 0, ValueError, "num_replicas must be >= 1"),
]


@pytest.mark.parametrize("arg,value,kind,fragment", SETTINGS_ARGS, ids=[f"{a}={v!r}" for a, v, *_ in SETTINGS_ARGS])
def test_the_settings_refuse_each_bad_field_in_one_line(arg, value, kind, fragment):
    raised, message = refusal(lambda: CDGraBSettings(**{arg: value}))
    assert raised is kind and fragment in message and message.startswith("CDGraBSettings: "), message


def test_structured_settings_need_a_balancing_sorter_and_are_frozen():
    raised, message = refusal(lambda: CDGraBSettings(sorter="D-RR", sketch_dim=8, structured=True))
    assert raised is ValueError and "sorter=D-RR" in message
    settings = CDGraBSettings(sketch_dim=8, structured=True, grad_params=["a", "b"])
    assert settings.grad_params == ("a", "b")  # a list, kept as a tuple: the object stays immutable
    with pytest.raises(AttributeError):
        settings.sketch_dim = 0


@pytest.mark.parametrize("args,kind,fragment", [
    ((10.5, 4), TypeError, "d must be an integer, got 10.5"),
    ((10, "4"), TypeError, "dim must be an integer"),
    ((0, 4), ValueError, "need d >= 1 and dim >= 1"),
    ((10, 4, 0.5), TypeError, "seed must be an integer"),
    ((10, 4, 0, [(0, 2.0, 2)]), TypeError, "blocks must be (offset, rows, cols) tuples of ints"),
    ((10, 4, 0, [(8, 2, 2)]), ValueError, "leaves the 10 coordinates"),
])
def test_gradient_sketch_refuses_each_bad_argument(args, kind, fragment):
    raised, message = refusal(lambda: GradientSketch(*args))
    assert raised is kind and fragment in message and message.startswith("GradientSketch"), message


# ------------------------------------------------------------------------------------------ step()

def started_sampler(**kwargs):
    sampler = CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, **kwargs)
    iter(sampler)
    return sampler


def test_step_with_a_list_is_a_type_error_naming_the_shape():
    raised, message = refusal(lambda: started_sampler().step([[0.0] * 3] * 4))
    assert raised is TypeError and message == ("CD-GraB sampler: step() takes the per-example gradients as a "
                                               "tensor of shape (4, 3) or (2, 2, 3), got a list")
    for name in BALANCING:
        sorter = build_sorter(name, 2, 8, 3, **extra(name))
        sorter.sort()
        raised, message = refusal(lambda: sorter.step(np.zeros((2, 2, 3), np.float32), range(2)))
        assert raised is TypeError and message.startswith(f"{name}: grads must be a tensor of shape (n, k, d)")


# ------------------------------------------------------------------------------------------ load_state_dict

def fresh(name):
    return build_sorter(name, 2, 8, 3, seed=1, **extra(name))


def stepped_state(name, steps=1):
    """A sorter's state after `steps` steps of 3 units (a pair left open for the next step)."""
    sorter = fresh(name)
    sorter.sort()
    for t in range(steps):
        sorter.step(torch.randn(2, 3, 3) if sorter.uses_grads else None, range(3 * t, 3 * t + 3))
    return sorter.state_dict()


def edited(state, **changes):
    return {**state, **changes}


@pytest.mark.parametrize("name", SORTER_NAMES)
def test_every_sorter_refuses_a_state_that_is_not_its_own(name):
    state = stepped_state(name)
    kh = "epochs" in extra(name)
    cases = [
        ({"foo": 1}, ValueError, f"{name}.load_state_dict: not a state saved by {name}'s state_dict(): missing "),
        ({"foo": 1}, ValueError, " n, m, d, orders, epoch, _next_position"),
        ([1, 2], TypeError, "load_state_dict takes the dict that"),
        (edited(state, _next_position=9999), ValueError, "state['_next_position'] must be in 0..8, got 9999"),
        (edited(state, epoch=-1), ValueError, "state['epoch'] must be >= 0"),
        (edited(state, epoch=1.5), TypeError, "state['epoch'] must be an integer"),
        (edited(state, m=9), ValueError, "state is for m=9, sorter has 8"),
        (edited(state, orders=torch.full((2, 8), 8)), ValueError, "0..7"),  # SWR's rows need not be permutations
        (edited(state, orders=torch.arange(8).repeat(3, 1)), ValueError, "state['orders'] must be a integer tensor of shape (2, 8)"),
        (edited(state, generator=torch.zeros(3)), ValueError, "state['generator'] must be"),
        ({key: value for key, value in state.items() if key != "orders"}, ValueError, "missing orders"),
    ]
    if getattr(SORTERS[name], "permutes", True):
        cases += [(edited(state, orders=torch.zeros(2, 8, dtype=torch.long)), ValueError,
                   "rows must be permutations of 0..7")]
    if name in BALANCING and "next_orders" in state:  # the online balancers (the others: tests/test_orderers.py)
        sums = "running_sums" if name in ("I-PB", "I-B") else "running_sum"
        cases += [(edited(state, **{sums: torch.zeros(5)}), ValueError, f"state['{sums}'] must be a float tensor"),
                  (edited(state, next_orders=torch.full((2, 8), 99)), ValueError, "holds values outside -1..7")]
    if name not in ("I-B",) and name in BALANCING and "pending" in state:
        cases += [(edited(state, pending=torch.zeros(2, 4)), ValueError, "state['pending'] must be a float tensor of shape (2, 3)"),
                  (edited(state, left=20), ValueError, "state['left'] must be in 0..8")]
    if kh:
        cases += [(edited(state, total_epochs=4), ValueError, "state is for epochs=4")]
    for bad, kind, fragment in cases:
        sorter = fresh(name)
        before = sorter.state_dict()
        raised, message = refusal(lambda: sorter.load_state_dict(bad))
        assert raised is kind and fragment in message, (fragment, message)
        assert_same_state(sorter.state_dict(), before)  # nothing changed
    sorter = fresh(name)
    sorter.load_state_dict(state)  # the state itself loads, and the sorter goes on from it
    assert_same_state(sorter.state_dict(), state)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):  # a part's own state (MB-GraB's micro-batches)
            assert_same_state(a[key], b[key])
        else:
            assert (torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key]), key


def test_an_older_state_without_the_nonfinite_record_loads():
    state = stepped_state("CD-GraB")
    del state["nonfinite_record"]
    sorter = fresh("CD-GraB")
    sorter.load_state_dict(state)
    assert sorter.skipped_steps == 0


def sampler_state(steps=1):
    sampler = started_sampler()
    for _ in range(steps):
        sampler.step(torch.randn(4, 3))
    return sampler.state_dict()


@pytest.mark.parametrize("bad,kind,message", [
    ({"foo": 1}, ValueError, "CDGraBSampler.load_state_dict: not a state saved by CDGraBSampler.state_dict(): "
                             "missing sorter, position, started, config"),
    ("state", TypeError, "CDGraBSampler.load_state_dict: load_state_dict takes the dict that "
                         "CDGraBSampler.state_dict() returned, got str"),
    (lambda s: edited(s, position=9999), ValueError,
     "CDGraBSampler.load_state_dict: state['position'] must be in 0..12, got 9999"),
    (lambda s: edited(s, position=4), ValueError,
     "CDGraBSampler.load_state_dict: state['position'] 4 does not match its sorter's state (position 2, "
     "started=True); pass a state that state_dict() returned"),
    (lambda s: edited(s, position=2.0), TypeError, "CDGraBSampler.load_state_dict: state['position'] must be an integer, got 2.0"),
    (lambda s: edited(s, started="yes"), ValueError, "state['started'] must be True or False"),
    (lambda s: edited(s, config=None), ValueError, "state['config'] and state['sorter'] must be dicts"),
    (lambda s: edited(s, sorter=edited(s["sorter"], _next_position=9999), position=9999), ValueError,
     "state['position'] must be in 0..12, got 9999"),
])
def test_the_sampler_refuses_a_state_that_is_not_its_own(bad, kind, message):
    state = bad(sampler_state()) if callable(bad) else bad
    sampler = started_sampler()
    raised, said = refusal(lambda: sampler.load_state_dict(state))
    assert raised is kind and message in said, said
    assert sampler.position == 0  # nothing changed


# ------------------------------------------------------------------------------------------ non-finite gradients

def feed(sampler, epochs, table, poison=None, after=None):
    """Run `epochs` epochs of a sampler hosting every replica, fed table[indices]; poison = (epoch, step, row,
    value) writes value into that row's gradient at that step. Returns the indices of every epoch."""
    seen = []
    for epoch in range(epochs):
        indices = torch.tensor(list(sampler))
        seen.append(sampler.all_indices().clone())
        for step, batch in enumerate(indices.split(sampler.loader_batch_size)):
            grads = table[batch].clone()
            if poison and (epoch, step) == poison[:2]:
                grads[poison[2], 1] = poison[3]
            if after and (epoch, step) == after[:2]:
                grads = after[2](grads)
            sampler.step(grads)
    return seen


@pytest.mark.parametrize("name", BALANCING)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_is_refused_naming_the_step(name, value):
    table = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))
    sampler = CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, sorter=name, **extra(name))
    with pytest.raises(NonFiniteGradientError) as info:
        feed(sampler, 2, table, poison=(1, 4, 3, value))  # epoch 1, step 4, replica 1's second example
    assert str(info.value) == (
        f"CDGraBSampler: step 4 of 6 in epoch 1 (counting from 0): {name}: non-finite gradient (nan or inf), "
        f"step at positions 8..9 of 12 (worker 1, position 9); lower the learning rate or fix the input, or pass "
        "nonfinite='skip' to skip such steps")
    assert isinstance(info.value, ValueError) and sampler.position == 8  # the step did not count


def zero_step(grads):
    return torch.zeros_like(grads)


@pytest.mark.parametrize("name", BALANCING)
def test_skip_balances_a_non_finite_step_as_zeros_and_counts_it(name):
    """The oracle: the same sampler fed explicit zeros for that step (same orders, same sums); the count
    survives a checkpoint."""
    table = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))

    def run(nonfinite="raise", **how):
        sampler = CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, sorter=name, nonfinite=nonfinite, **extra(name))
        orders = feed(sampler, 3, table, **how)
        state = sampler.sorter.state_dict()
        state.update({f"micro_batches.{k}": v for k, v in state.pop("micro_batches", {}).items()})  # MB-GraB's part
        sums = {k: v for k, v in state.items() if "sum" in k or k in ("stale_mean", "kept")}  # kept: Greedy's
        iter(sampler)  # the order the skipped step helped to make
        return sampler, orders + [sampler.all_indices()], sums

    skipping, orders, sums = run("skip", poison=(2, 1, 0, float("nan")))
    zeros, zero_orders, zero_sums = run(after=(2, 1, zero_step))
    assert all(torch.equal(a, b) for a, b in zip(orders, zero_orders))
    assert sums.keys() == zero_sums.keys() and all(torch.equal(sums[k], zero_sums[k]) for k in sums) and sums
    _, _, untouched_sums = run()
    assert not all(torch.equal(sums[k], untouched_sums[k]) for k in sums)  # the skip changed what the test sees
    assert skipping.skipped_steps == 1 and zeros.skipped_steps == 0
    resumed = CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, sorter=name, nonfinite="skip", **extra(name))
    resumed.load_state_dict(skipping.state_dict())
    assert resumed.skipped_steps == 1


def device_path(monkeypatch):
    """The sorters' device path (torch ops, as on a GPU) on the CPU."""
    for module in (sorters_base, sorters_balance):
        monkeypatch.setattr(module, "array_views", lambda *tensors: (torch, list(tensors)))


@pytest.mark.parametrize("name", ["CD-GraB", "I-B", "I-PB"])  # KH-SGD and SBW read each step's a, G by design
def test_on_the_device_path_the_check_reads_nothing_inside_a_step_and_raises_at_the_epochs_end(monkeypatch, name):
    from tests.test_host_sync import HostReads
    device_path(monkeypatch)
    table = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))
    sampler = CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, sorter=name, **extra(name))
    iter(sampler)
    with HostReads() as mode:
        for step in range(6):
            grads = table[:4].clone()
            if step == 3:
                grads[2, 0] = float("nan")
            sampler.step(grads)
    assert [read for read in mode.reads if read in ("item", "__bool__", "__int__", "cpu", "tolist")] == []
    with pytest.raises(NonFiniteGradientError) as info:
        iter(sampler)  # the next epoch's sort()
    assert str(info.value).startswith(f"CDGraBSampler: step 3 of 6 in epoch 0 (counting from 0): {name}: non-finite "
                                      "gradient (nan or inf), step at position 6 of 12 (on cpu the check "
                                      "runs at the epoch's end)")


def test_on_the_device_path_skip_gives_the_orders_of_the_cpu_path(monkeypatch):
    table = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))

    def run():
        sampler = CDGraBSampler(24, batch_size=2, d=3, num_replicas=2, nonfinite="skip")
        return feed(sampler, 3, table, poison=(0, 5, 1, float("inf"))), sampler.skipped_steps

    cpu_orders, cpu_skipped = run()
    device_path(monkeypatch)
    device_orders, device_skipped = run()
    assert all(torch.equal(a, b) for a, b in zip(cpu_orders, device_orders)) and cpu_skipped == device_skipped == 1


def test_huge_finite_gradients_whose_sum_overflows_are_accepted():
    """The CPU check sums the step first; float32 entries near its maximum overflow that sum but are finite."""
    sampler = started_sampler()
    sampler.step(torch.full((4, 3), 3e38))
    assert sampler.position == 2 and sampler.skipped_steps == 0
