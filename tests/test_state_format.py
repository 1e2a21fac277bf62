"""The format versions of the states the library saves into a user's checkpoint (sorters/_state_format.py,
docs/sorters.md "Saved states"): a sorter's, CDGraBSampler's, the HF Trainer's cdgrab_sampler.pt
and CDGraBCallback's.

For each kind: (a) a state of the previous format (format 0: no format key, the layout every checkpoint
had before the formats were recorded), written out here key by key rather than produced by the library,
loads, and gives the orders of small independent implementations (the pair balance and the mean balance
written from their definitions, the fold, the generator's permutations) and of the same state in the
current format; (b) a state of a newer format is refused in one line that says to upgrade, before anything
changes; (c) state_dict() holds the format key."""
import pytest
import torch

from sorters import CDGraBSampler, build_sorter
from sorters._state_format import (
    FORMAT_KEY,
    LIGHTNING_STATE_FORMAT,
    SAMPLER_STATE_FORMAT,
    SORTER_STATE_FORMAT,
    TRAINER_STATE_FORMAT,
    saved_format,
)
from sorters.exact import ExactCDGraB
from sorters.registry import SORTER_NAMES
from tests.helpers import REPO, assert_same, checkpoint_roundtrip

N, M, D = 2, 6, 3  # workers (replicas), units per worker, gradient dimension
EPOCHS = 3  # KH-SGD's and SBW's total epochs
ORDERS = [[3, 0, 2, 1, 5, 4], [1, 4, 0, 5, 2, 3]]  # epoch 1's orders, row j worker j's
# epoch 1 after its first two positions: the pair balancers placed the first pair of each worker (3 left,
# 0 right; 4 left, 1 right); I-B placed worker 0's two units left, worker 1's first left, its second right
PAIR_NEXT = [[3, -1, -1, -1, -1, 0], [4, -1, -1, -1, -1, 1]]
MEAN_NEXT = [[3, 0, -1, -1, -1, -1], [1, -1, -1, -1, -1, 4]]
NEXT = [[2, 5, 0, 4, 1, 3], [0, 3, 4, 1, 5, 2]]  # a complete next order (the end-of-epoch state)
RUNNING_SUM = [0.5, -1.0, 2.0]
SEED = 11  # the saved generator's seed; the sorters that load the states are built with another
OTHER_SEED = 5


def long(rows):
    return torch.tensor(rows, dtype=torch.long)


def units(seed):
    """(N, M, D) small integers as float32: every sum and product below is exact, so the oracles'
    float64 arithmetic decides every sign as the sorters do."""
    return torch.randint(-3, 4, (N, M, D), generator=torch.Generator().manual_seed(seed)).float()


# the gradients' seeds: with these, the saved sums decide the orders (test_the_saved_sums_decide_the_orders)
SORTER_SEED, SAMPLER_SEEDS = 2, (5, 7, 8)


def format0_sorter_state(name: str) -> dict:
    """The state_dict() of sorter `name` (n=2, m=6, d=3) in epoch 1 after its first two positions, as the
    library wrote it before the formats were recorded: no format key. ExactCDGraB (name "exact"): at the
    end of epoch 1 (its steps need layer records)."""
    state = {"n": N, "m": M, "d": D, "nonfinite_record": long([-1, 0]), "orders": long(ORDERS), "epoch": 1,
             "_next_position": 2, "generator": torch.Generator().manual_seed(SEED).get_state()}
    if name in ("D-RR", "D-SO", "Fold"):
        return state
    state["dtype"] = torch.float32
    if name == "I-B":
        return {**state, "next_orders": long(MEAN_NEXT), "left": long([2, 1]), "right": long([5, 4]),
                "grad_sum": torch.tensor([[6.0, -12.0, 0.0], [18.0, 6.0, -6.0]]),
                "running_sums": torch.tensor([[1.0, 0.0, -2.0], [0.5, 1.5, 0.0]]),
                "stale_mean": torch.tensor([[1.0, -1.0, 0.0], [0.0, 2.0, 1.0]])}
    state.update({"next_orders": long(PAIR_NEXT), "left": 1, "right": M - 2, "pending": None, "pending_position": -1})
    if name == "I-PB":
        return {**state, "running_sums": torch.tensor([RUNNING_SUM, [-1.0, 0.0, 1.5]])}
    if name == "exact":
        return {**state, "_next_position": M, "next_orders": long(NEXT), "left": M // 2, "right": M // 2 - 1,
                "running_sum": torch.tensor(RUNNING_SUM), "near_ties": 0}
    state["running_sum"] = torch.tensor(RUNNING_SUM, dtype=torch.float64)
    if name in ("KH-SGD", "SBW"):  # rule_state: pair index, KH's v, SBW's b_max, the epoch's constants
        state.update({"total_epochs": EPOCHS, "seed": 3, "pairs_per_epoch": N * (M // 2),
                      "rule_state": torch.tensor([2.0, 0.5, 4.0, 0.0, 0.0], dtype=torch.float64)})
    return state


def fresh_sorter(name: str):
    if name == "exact":
        return ExactCDGraB(N, M, D, seed=OTHER_SEED)
    return build_sorter(name, N, M, D, seed=OTHER_SEED, epochs=EPOCHS)


def current(state: dict, version: int) -> dict:
    return {**state, FORMAT_KEY: version}


# ------------------------------------------------------------------ oracles, from the algorithms' definitions

def pair_balance_rest(z, orders, next_orders, sums, left, right, start, shared):
    """The next orders after pair balancing positions start.. of an epoch: pairs (t, t+1), each worker in
    turn; the first unit goes left iff <s, first - second> <= 0 (s += difference), else right (s -= it).
    shared: one running sum for every worker (CD-GraB), else one per worker (I-PB)."""
    orders, nxt = torch.tensor(orders), torch.tensor(next_orders)
    sums = torch.tensor(sums, dtype=torch.float64)
    for t in range(start, M - 1, 2):
        for j in range(N):
            a, b = int(orders[j, t]), int(orders[j, t + 1])
            diff = (z[j, a] - z[j, b]).double()
            s = sums if shared else sums[j]
            if torch.dot(s, diff) <= 0:
                nxt[j, left], nxt[j, right] = a, b
                s += diff
            else:
                nxt[j, left], nxt[j, right] = b, a
                s -= diff
        left, right = left + 1, right - 1
    return nxt


def mean_balance_rest(z, orders, next_orders, sums, left, right, stale, start):
    """I-B's next orders after positions start.. of an epoch: each unit centred by its worker's stale mean;
    + (<s, c> <= 0) to the left end, else to the right end."""
    nxt, sums = torch.tensor(next_orders), torch.tensor(sums, dtype=torch.float64)
    stale = torch.tensor(stale, dtype=torch.float64)
    for j in range(N):
        lo, hi = left[j], right[j]
        for t in range(start, M):
            unit = orders[j][t]
            c = z[j, unit].double() - stale[j]
            if torch.dot(sums[j], c) <= 0:
                nxt[j, lo], lo, sums[j] = unit, lo + 1, sums[j] + c
            else:
                nxt[j, hi], hi, sums[j] = unit, hi - 1, sums[j] - c
    return nxt


def fold(rows):
    return torch.tensor([row[0::2] + row[1::2][::-1] for row in rows])


def fresh_draws(seed, epochs):
    """D-RR: each later epoch's orders, n permutations drawn in turn from the generator."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(M, generator=generator) for _ in range(N)]) for _ in range(epochs)]


def expected_next_orders(name, z):
    """The orders sort() gives after the rest of epoch 1 of format0_sorter_state(name) (None: no oracle
    here: KH-SGD's and SBW's random thresholds)."""
    state = format0_sorter_state(name)
    if name == "D-SO":
        return long(ORDERS)
    if name == "Fold":
        return fold(ORDERS)
    if name == "D-RR":
        return fresh_draws(SEED, 1)[0]
    if name == "exact":
        return long(NEXT)
    if name == "I-B":
        return mean_balance_rest(z, ORDERS, MEAN_NEXT, state["running_sums"].tolist(), [2, 1], [5, 4],
                                 state["stale_mean"].tolist(), 2)
    if name in ("CD-GraB", "I-PB"):
        sums = RUNNING_SUM if name == "CD-GraB" else state["running_sums"].tolist()
        return pair_balance_rest(z, ORDERS, PAIR_NEXT, sums, 1, M - 2, 2, shared=name == "CD-GraB")
    return None


def expected_orders_after(name, z, first):
    """The orders of the epoch after `first` (that epoch balanced on z from scratch)."""
    if name == "D-SO":
        return first
    if name == "Fold":
        return fold(first.tolist())
    if name == "D-RR":
        return fresh_draws(SEED, 2)[1]
    if name == "I-B":  # centred by epoch 1's mean: grad_sum / m plus the rest of epoch 1's units
        total = format0_sorter_state("I-B")["grad_sum"].double()
        for j in range(N):
            total[j] += sum(z[j, ORDERS[j][t]].double() for t in range(2, M))
        return mean_balance_rest(z, first.tolist(), [[-1] * M] * N, [[0.0] * D] * N, [0] * N, [M - 1] * N,
                                 (total / M).tolist(), 0)
    if name in ("CD-GraB", "I-PB"):
        sums = [0.0] * D if name == "CD-GraB" else [[0.0] * D] * N
        return pair_balance_rest(z, first.tolist(), [[-1] * M] * N, sums, 0, M - 1, 0, shared=name == "CD-GraB")
    return None


def step_rest(sorter, orders, z, start):
    """step() over positions start.. of the epoch, two at a time: worker j's units of `orders`."""
    for t in range(start, M, 2):
        positions = torch.arange(t, t + 2)
        grads = torch.stack([z[j, orders[j, positions]] for j in range(N)]) if sorter.uses_grads else None
        sorter.step(grads, positions)


def run_on(name, state, z):
    """A fresh sorter loaded with `state`: the orders of epochs 2 and 3 (epoch 3 only where the sorter can be
    stepped here) and its state_dict after the load."""
    sorter = fresh_sorter(name)
    sorter.load_state_dict(state)
    loaded = sorter.state_dict()
    if name != "exact":
        step_rest(sorter, long(ORDERS), z, 2)
    second = sorter.sort()
    if name == "exact":
        return loaded, [second]
    step_rest(sorter, second, z, 0)
    return loaded, [second, sorter.sort()]


# ------------------------------------------------------------------ a sorter's state

SORTER_KINDS = [*SORTER_NAMES, "exact"]
# the kinds whose states were saved without a format key (format 0) before the formats were recorded: the sorters
# added since (FlipFlop, SWR, Greedy, MB-GraB, RPB) have only ever written format 1
FORMAT_0_KINDS = ["CD-GraB", "D-RR", "D-SO", "I-B", "I-PB", "Fold", "KH-SGD", "SBW", "exact"]


def test_the_hand_written_states_are_every_key_the_sorters_save():
    """So that the format-0 states below are states as the library wrote them: the same keys as a state
    saved now, less the format key (a sorter that saves a new key must give format 0 a migration)."""
    for name in FORMAT_0_KINDS:
        assert fresh_sorter(name).state_dict().keys() - {FORMAT_KEY} == format0_sorter_state(name).keys(), name


@pytest.mark.parametrize("name", FORMAT_0_KINDS)
def test_a_format_0_sorter_state_loads_with_the_orders_of_the_algorithm_and_of_format_1(name):
    z = units(SORTER_SEED)
    old = format0_sorter_state(name)
    loaded_old, orders_old = run_on(name, checkpoint_roundtrip(old), z)
    loaded_now, orders_now = run_on(name, current(old, SORTER_STATE_FORMAT), z)
    assert loaded_old[FORMAT_KEY] == SORTER_STATE_FORMAT  # saved again, it is the current format
    assert_same(loaded_old, loaded_now)
    assert all(torch.equal(a, b) for a, b in zip(orders_old, orders_now, strict=True))
    expected = expected_next_orders(name, z)
    if expected is not None:
        assert torch.equal(orders_old[0], expected)
    if len(orders_old) > 1 and expected is not None:
        assert torch.equal(orders_old[1], expected_orders_after(name, z, expected))
    assert not torch.equal(orders_old[0], long(ORDERS)) or name == "D-SO"  # the orders move on


def assert_refused_in_one_line(load, before, after, *words):
    with pytest.raises(ValueError) as refused:
        load()
    message = str(refused.value)
    assert "\n" not in message and all(word in message for word in words), message
    assert_same(after(), before)  # nothing changed


@pytest.mark.parametrize("name", SORTER_KINDS)
def test_a_sorter_state_of_a_newer_format_or_not_a_format_is_refused_in_one_line(name):
    sorter = fresh_sorter(name)
    before = sorter.state_dict()
    newer = current(format0_sorter_state(name), SORTER_STATE_FORMAT + 1)
    assert_refused_in_one_line(lambda: sorter.load_state_dict(newer), before, sorter.state_dict,
                               f"{sorter.name}.load_state_dict: ", "saved by a newer cdgrab-sorters",
                               f"state format {SORTER_STATE_FORMAT + 1}", "upgrade cdgrab-sorters")
    for bad in ("1", 1.0, -1, True):
        assert_refused_in_one_line(lambda bad=bad: sorter.load_state_dict(current(format0_sorter_state(name), bad)),
                                   before, sorter.state_dict, f"state['{FORMAT_KEY}'] must be a state format")


@pytest.mark.parametrize("name", SORTER_KINDS)
def test_a_sorter_state_holds_its_format(name):
    assert fresh_sorter(name).state_dict()[FORMAT_KEY] == SORTER_STATE_FORMAT == 1


def test_a_state_of_another_kind_keeps_its_own_refusal():
    sorter, sampler = build_sorter("CD-GraB", N, M, D), CDGraBSampler(N * M, 2, d=D, num_replicas=N)
    with pytest.raises(ValueError, match="not a state saved by CD-GraB's state_dict\\(\\): missing n, m, d"):
        sorter.load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="not a state saved by CDGraBSampler.state_dict\\(\\): missing sorter"):
        sampler.load_state_dict(sorter.state_dict())


# ------------------------------------------------------------------ CDGraBSampler's state (and the frameworks')

def format0_sampler_state() -> dict:
    """CD-GraB's sampler over 12 examples, 2 replicas of 6, batches of 2, one step into epoch 1 (epochs
    counted from 1, the sorter's count), as the library wrote it before the formats were recorded."""
    return {"sorter": format0_sorter_state("CD-GraB"), "position": 2, "started": True,
            "config": {"sorter": "CD-GraB", "num_replicas": N, "m": M, "batch_size": 2, "d": D, "seed": 0,
                       "sketch_dim": 0}}


def fresh_sampler(cls=CDGraBSampler):
    return cls(N * M, 2, d=D, sorter="CD-GraB", num_replicas=N, seed=0)


def dataset_index(replica, unit):
    return replica * M + unit


def epoch_indices(orders, start):
    """What the sampler yields from position `start`: each step, replica after replica, its next 2 units."""
    return [dataset_index(r, int(orders[r][t + i])) for t in range(start, M, 2) for r in range(N) for i in range(2)]


def drive(sampler, z, skip_steps=0):
    """The sampler's rest of the epoch (handing step() the examples' rows of z; the first `skip_steps` batches
    without step(), as the HF Trainer's replay skips them) and the next epoch's indices."""
    rows = z.reshape(N * M, D)
    yielded = list(iter(sampler))
    for s, t in enumerate(range(0, len(yielded), 2 * N)):
        if s >= skip_steps:
            sampler.step(rows[yielded[t:t + 2 * N]])
    return yielded, list(iter(sampler))


def expected_sampler_epochs(z, start):
    nxt = pair_balance_rest(z, ORDERS, PAIR_NEXT, RUNNING_SUM, 1, M - 2, 2, shared=True)
    return epoch_indices(ORDERS, start), epoch_indices(nxt.tolist(), 0)


def test_a_format_0_sampler_state_loads_with_the_orders_of_the_algorithm_and_of_format_1():
    z = units(SAMPLER_SEEDS[0])
    runs = []
    for state in (format0_sampler_state(), current(format0_sampler_state(), SAMPLER_STATE_FORMAT)):
        sampler = fresh_sampler()
        sampler.load_state_dict(checkpoint_roundtrip(state))
        runs.append(drive(sampler, z))
    assert runs[0] == runs[1] == expected_sampler_epochs(z, start=2)  # the rest of epoch 1, then epoch 2


def test_a_sampler_state_of_a_newer_format_is_refused_in_one_line():
    sampler = fresh_sampler()
    before = sampler.state_dict()
    newer = current(format0_sampler_state(), SAMPLER_STATE_FORMAT + 1)
    assert_refused_in_one_line(lambda: sampler.load_state_dict(newer), before, sampler.state_dict,
                               "CDGraBSampler.load_state_dict: ", "saved by a newer cdgrab-sorters", "upgrade")
    inner = {**format0_sampler_state(), "sorter": current(format0_sorter_state("CD-GraB"), SORTER_STATE_FORMAT + 1)}
    assert_refused_in_one_line(lambda: sampler.load_state_dict(inner), before, sampler.state_dict,
                               "CD-GraB.load_state_dict: ", "saved by a newer cdgrab-sorters")


def test_a_sampler_state_holds_its_format_and_its_sorters():
    state = fresh_sampler().state_dict()
    assert state[FORMAT_KEY] == SAMPLER_STATE_FORMAT == 1 and state["sorter"][FORMAT_KEY] == SORTER_STATE_FORMAT
    assert state.keys() - {FORMAT_KEY} == format0_sampler_state().keys()


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("sorters.hf")


def trainer_glue(hf, folder):
    """The HF Trainer glue alone, on a stand-in for the Trainer: only what the glue reads and writes when it
    saves and resumes (the checkpoint folder, the settings, the sampler); the Trainer's own checkpoint files
    are not needed here."""
    from types import SimpleNamespace

    from sorters import CDGraBSettings

    class TrainersPart:
        def _save_checkpoint(self, model, trial):
            pass

    class Glue(hf.CDGraBTrainerMixin, TrainersPart):
        def __init__(self):
            self._cdgrab_resume_from, self.cdgrab_sampler, self.cdgrab_grads = str(folder), None, None
            self.is_fsdp_enabled = False  # (the Trainer's; the glue saves the sharded state under FSDP)
            self.cdgrab_settings = CDGraBSettings(sorter="CD-GraB", seed=0, exact_low_memory=False)
            self.args, self.state = SimpleNamespace(should_save=True), SimpleNamespace(global_step=4)

        def _get_output_dir(self, trial):  # the folder that holds the checkpoint-N folders
            return str(folder.parent)
    return Glue()


# the two layouts of cdgrab_sampler.pt before the formats were recorded
FORMAT0_TRAINER_FILES = {
    "with the gradient settings": lambda: {"sampler": format0_sampler_state(), "gradients": {
        "structured": False, "grad_params": None, "sketch_min_numel": None, "exact_low_memory": False}},
    "the sampler's state alone": format0_sampler_state,
}


@pytest.mark.parametrize("layout", FORMAT0_TRAINER_FILES)
def test_a_format_0_trainer_file_loads_with_the_orders_of_the_algorithm_and_of_format_1(hf, layout, tmp_path):
    z = units(SAMPLER_SEEDS[1])
    old = FORMAT0_TRAINER_FILES[layout]()
    runs = []
    for name, saved in (("old", old), ("now", current(old, TRAINER_STATE_FORMAT))):
        (tmp_path / name).mkdir()
        torch.save(saved, tmp_path / name / hf.SAMPLER_FILE)
        sampler = fresh_sampler()
        sampler.load_state_dict(trainer_glue(hf, tmp_path / name)._saved_sampler_state(),
                                replay_from_epoch_start=True)  # as the Trainer resumes
        runs.append(drive(sampler, z, skip_steps=1))
    assert runs[0] == runs[1] == expected_sampler_epochs(z, start=0)  # all of epoch 1 replayed, then epoch 2


def test_a_trainer_file_of_a_newer_format_is_refused_in_one_line(hf, tmp_path):
    saved = current(FORMAT0_TRAINER_FILES["with the gradient settings"](), TRAINER_STATE_FORMAT + 1)
    torch.save(saved, tmp_path / hf.SAMPLER_FILE)
    with pytest.raises(ValueError) as refused:
        trainer_glue(hf, tmp_path)._saved_sampler_state()
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path / hf.SAMPLER_FILE) in message, message
    assert "saved by a newer cdgrab-sorters" in message and "upgrade" in message, message


def test_the_trainer_file_holds_its_format_and_resumes(hf, tmp_path):
    glue = trainer_glue(hf, tmp_path / "checkpoint-4")
    glue.cdgrab_sampler = fresh_sampler()
    (tmp_path / "checkpoint-4").mkdir()
    glue._save_checkpoint(None, None)
    saved = torch.load(tmp_path / "checkpoint-4" / hf.SAMPLER_FILE, weights_only=True)
    assert saved[FORMAT_KEY] == TRAINER_STATE_FORMAT == 1 and saved["sampler"][FORMAT_KEY] == SAMPLER_STATE_FORMAT
    assert saved.keys() - {FORMAT_KEY} == FORMAT0_TRAINER_FILES["with the gradient settings"]().keys()
    assert_same(glue._saved_sampler_state(), glue.cdgrab_sampler.state_dict())


@pytest.fixture(scope="module")
def lightning():
    return pytest.importorskip("sorters.lightning")


def test_a_format_0_lightning_state_loads_with_the_orders_of_the_algorithm_and_of_format_1(lightning):
    z = units(SAMPLER_SEEDS[2])
    old = {"sampler": format0_sampler_state(), "sketch_map": None}
    runs = []
    for state in (old, current(old, LIGHTNING_STATE_FORMAT)):
        sampler = fresh_sampler(lightning.LightningCDGraBSampler)
        lightning.CDGraBCallback(sampler=sampler).load_state_dict(checkpoint_roundtrip(state))
        runs.append(drive(sampler, z))
    assert runs[0] == runs[1] == expected_sampler_epochs(z, start=2)


def test_a_lightning_state_of_a_newer_format_is_refused_in_one_line_even_before_the_sampler_is_known(lightning):
    newer = current({"sampler": format0_sampler_state(), "sketch_map": None}, LIGHTNING_STATE_FORMAT + 1)
    for callback in (lightning.CDGraBCallback(sampler=fresh_sampler(lightning.LightningCDGraBSampler)),
                     lightning.CDGraBCallback()):  # Lightning loads callbacks before the fit's start
        before = callback.state_dict()
        assert_refused_in_one_line(lambda callback=callback: callback.load_state_dict(newer), before,
                                   callback.state_dict, "CDGraBCallback.load_state_dict: ",
                                   "saved by a newer cdgrab-sorters", "upgrade")


def test_a_lightning_state_holds_its_format(lightning):
    with_sampler = lightning.CDGraBCallback(sampler=fresh_sampler(lightning.LightningCDGraBSampler)).state_dict()
    assert with_sampler[FORMAT_KEY] == LIGHTNING_STATE_FORMAT == 1
    assert with_sampler["sampler"][FORMAT_KEY] == SAMPLER_STATE_FORMAT
    assert lightning.CDGraBCallback().state_dict() == {FORMAT_KEY: LIGHTNING_STATE_FORMAT}


def test_a_format_older_than_the_oldest_read_is_refused_in_one_line():
    """The refusal a later format will use for the formats before the previous one (docs/stability.md)."""
    with pytest.raises(ValueError) as refused:
        saved_format("CD-GraB.load_state_dict", {"n": 2}, current=3, oldest=2)
    assert str(refused.value) == ("CD-GraB.load_state_dict: the state is of state format 0, which this cdgrab-sorters "
                                  "no longer reads (it reads formats 2..3): load it with the release before this "
                                  "one and save it again, or start a new run")
    assert saved_format("CD-GraB.load_state_dict", {FORMAT_KEY: 2}, current=3, oldest=2) == 2


def test_the_saved_sums_decide_the_orders():
    """The tests above would see a running sum, a stale mean that the load dropped: with their gradients the
    oracles' orders from the saved sums differ from those from zeros."""
    def cd_grab(z, sums):
        return pair_balance_rest(z, ORDERS, PAIR_NEXT, sums, 1, M - 2, 2, shared=True)

    zeros = [[0.0] * D] * N
    for seed in (SORTER_SEED, *SAMPLER_SEEDS):
        assert not torch.equal(cd_grab(units(seed), RUNNING_SUM), cd_grab(units(seed), zeros[0])), seed
    z, mean = units(SORTER_SEED), format0_sorter_state("I-B")
    sums, stale = mean["running_sums"].tolist(), mean["stale_mean"].tolist()
    pairs = format0_sorter_state("I-PB")["running_sums"].tolist()
    assert not torch.equal(pair_balance_rest(z, ORDERS, PAIR_NEXT, pairs, 1, M - 2, 2, shared=False),
                           pair_balance_rest(z, ORDERS, PAIR_NEXT, zeros, 1, M - 2, 2, shared=False))
    by_mean = mean_balance_rest(z, ORDERS, MEAN_NEXT, sums, [2, 1], [5, 4], stale, 2)
    assert not torch.equal(by_mean, mean_balance_rest(z, ORDERS, MEAN_NEXT, zeros, [2, 1], [5, 4], stale, 2))
    assert not torch.equal(by_mean, mean_balance_rest(z, ORDERS, MEAN_NEXT, sums, [2, 1], [5, 4], zeros, 2))


# ------------------------------------------------------------------ the documentation

def test_the_docs_table_gives_every_kinds_format():
    text = (REPO / "docs" / "sorters.md").read_text()
    section = text[text.index("## Saved states"):]
    section = section.split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| state")]
    formats = [int(row.rstrip(" |").rsplit("|", 1)[1]) for row in rows]
    assert formats == [SORTER_STATE_FORMAT, SAMPLER_STATE_FORMAT, TRAINER_STATE_FORMAT, LIGHTNING_STATE_FORMAT]
