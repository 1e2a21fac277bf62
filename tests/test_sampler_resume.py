"""CDGraBSampler, bit for bit: a run resumed at any step boundary equals the uninterrupted run, and two gloo
processes (one replica each) equal one process hosting both replicas, also when one resumes the other's state.

The oracle is the uninterrupted run of tests/sampler_training.py's loop: the examples each step used,
the sampler's state_dict, the weights and the loss after every step. Every sorter, with an odd batch size
(CD-GraB's pairs span two steps): with a short last step, with drop_last (a tail left over), and for the
balancing sorters sketched (sketch_dim < d)."""
import functools
import os
import sys

import pytest
import torch

from sorters import SORTER_NAMES, SORTERS
from tests.helpers import REPO, assert_same, checkpoint_roundtrip, run_python
from tests.sampler_training import FEATURES, REPLICAS, dataset, make_sampler, train


def sampler_configs() -> dict:
    """name -> config (tests/sampler_training.make_sampler), batch size 3 per replica throughout."""
    configs = {}
    for sorter in SORTER_NAMES:
        base = dict(sorter=sorter, batch_size=3, drop_last=False, sketch_dim=0)
        # MB-GraB's unit is a whole batch of 3: m a multiple of 3 (12: m 6, 18: m 9)
        whole = SORTERS[sorter].__dict__.get("uses_batch_size", False)
        configs[sorter] = {**base, "n_examples": 12 if whole else 14}  # m 7: steps of 3, 3, 1 examples
        configs[f"{sorter}-drop_last"] = {**base, "n_examples": 17, "drop_last": True}  # m 6; 5 examples unused
        if SORTERS[sorter].uses_grads:
            configs[f"{sorter}-sketch"] = {**base, "n_examples": 18 if whole else 16,
                                           "sketch_dim": 3}  # m 8: 3, 3, 2; D 3 < d 5
    return configs


CONFIGS = sampler_configs()


@functools.cache
def uninterrupted(name: str) -> list:
    """The records of the uninterrupted run (one process, REPLICAS replicas)."""
    config = CONFIGS[name]
    return train(make_sampler(config), dataset(config["n_examples"]), torch.zeros(FEATURES))[1]


def interrupted(name: str, steps: int, peek: bool = False, replay: bool = False) -> list:
    """The run stopped after `steps` steps (peek: after the next epoch's iter() too, as a loader peeking at
    a batch does), its sampler state and weights through a checkpoint file, a fresh sampler loading them
    (replay: replay_from_epoch_start=True, the loader dropping the epoch's done batches itself), and the
    rest of the run, which must leave the loaded state as it was. Returns the records of both parts."""
    config = CONFIGS[name]
    data = dataset(config["n_examples"])
    first = make_sampler(config)
    w, done = train(first, data, torch.zeros(FEATURES), steps=steps)
    if peek:
        iter(first)
    saved = checkpoint_roundtrip({"sampler": first.state_dict(), "w": w})
    pristine = checkpoint_roundtrip(saved)
    resumed = make_sampler(config)
    resumed.load_state_dict(saved["sampler"], replay_from_epoch_start=replay)
    skip = saved["sampler"]["position"] // config["batch_size"] if replay else 0
    rest = train(resumed, data, saved["w"], skip=skip)[1]
    # a checkpoint dict may be kept and loaded again (a retried resume): the resumed run must not write into it
    assert_same(saved, pristine, f"{name}: the state loaded after {steps} steps, once the resumed run ended")
    return done + rest


def boundaries(records: list) -> list[tuple[int, str]]:
    """(steps done, how) for every step boundary of the run: at an epoch's end (and before the first step)
    "end" and "peek"; inside an epoch "rest" and "replay" (the two ways of resuming mid-epoch)."""
    cuts = []
    for steps in range(len(records) + 1):
        state = records[steps - 1]["state"] if steps else None
        at_end = state is None or state["position"] == state["config"]["m"]
        cuts += [(steps, "end"), (steps, "peek")] if at_end else [(steps, "rest"), (steps, "replay")]
    return cuts


def mid_pair(records: list) -> int:
    """The first boundary of epoch 2 inside a pair: an odd number of the epoch's positions done."""
    return next(steps for steps, record in enumerate(records, 1)
                if record["state"]["sorter"]["epoch"] == 2 and record["state"]["position"] % 2)


@pytest.mark.parametrize("name", CONFIGS)
def test_resuming_at_every_step_boundary_gives_the_uninterrupted_run(name):
    expected = uninterrupted(name)
    assert not torch.equal(expected[0]["w"], expected[-1]["w"])  # the weights move: the losses compare training
    for steps, how in boundaries(expected):
        got = interrupted(name, steps, peek=how == "peek", replay=how == "replay")
        assert_same(got, expected, f"{name}, resumed after {steps} steps ({how})")


# ------------------------------------------------------------------------------------------- two processes


def replica_view(records: list, rank: int) -> list:
    """The records as the process of replica `rank` sees them: its own examples of each step."""
    return [{**record, "batch": record["batch"].view(REPLICAS, -1)[rank]} for record in records]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """Every config run by 2 gloo processes under torchrun in one launch: uninterrupted, and resumed from the
    one-process run's state at its first mid-pair boundary of epoch 2 (both ways of resuming mid-epoch).
    Returns {(name, how): [rank 0's records, rank 1's records]}, how "straight", "rest" or "replay"."""
    folder = tmp_path_factory.mktemp("sampler-ranks")
    keys, jobs = [], []
    for name, config in CONFIGS.items():
        keys.append((name, "straight"))
        jobs.append({"config": config})
        steps = mid_pair(uninterrupted(name))
        record = uninterrupted(name)[steps - 1]
        for how in ("rest", "replay"):
            keys.append((name, how))
            jobs.append({"config": config, "state": record["state"], "w": record["w"], "replay": how == "replay",
                         "skip": record["state"]["position"] // config["batch_size"] if how == "replay" else 0})
    torch.save(jobs, folder / "jobs.pt")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = run_python([*launcher, REPO / "tests" / "sampler_training.py", folder / "jobs.pt", folder],
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(folder / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    return {key: [ranks[0][i], ranks[1][i]] for i, key in enumerate(keys)}


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_two_gloo_processes_equal_one_process_and_resume_its_state(two_processes, name):
    """Each process uses its replica's examples of the one-process run, step by step, and holds its sampler
    state (so the sketch map, drawn in each process, is the same); resumed mid-pair from the one-process
    state they continue that run; and rank 1's state resumes the one-process run."""
    expected = uninterrupted(name)
    steps = mid_pair(expected)
    for rank in range(2):
        assert_same(two_processes[name, "straight"][rank], replica_view(expected, rank), f"{name}, rank {rank}")
        for how in ("rest", "replay"):
            assert_same(two_processes[name, how][rank], replica_view(expected[steps:], rank),
                        f"{name}, rank {rank} resumed after {steps} steps of one process ({how})")
    config = CONFIGS[name]
    record = two_processes[name, "straight"][1][steps - 1]
    resumed = make_sampler(config)
    resumed.load_state_dict(checkpoint_roundtrip(record["state"]))
    assert_same(train(resumed, dataset(config["n_examples"]), record["w"])[1], expected[steps:],
                f"{name}, one process resumed from rank 1's state after {steps} steps")
