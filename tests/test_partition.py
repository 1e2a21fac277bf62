"""--partition (data/partition.py) and --log-herding (engine/herding_log.py): unit checks on synthetic
labels and groups, and short end-to-end runs on the real data."""
import argparse
import json

import pytest
import torch

from data.partition import partition_type, split_by_labels, whole_groups
from sorters import parallel_herding_bound
from tests.helpers import DATA_DIR, check_ok, needs_data, read_metrics, run_script

N_WORKERS, M = 8, 250
PARTITIONS = ["contiguous", "random", "label-sorted", "dirichlet:0.1", "dirichlet:1", "dirichlet:100"]


def synthetic_labels(positive_rate=0.1, seed=0):
    """(n*m,) 0/1 labels in random order with about `positive_rate` ones (HMDA has 9.7 %)."""
    return (torch.rand(N_WORKERS * M, generator=torch.Generator().manual_seed(seed)) < positive_rate).float()


def positive_rates(labels, rows):
    return labels[rows].mean(dim=1)  # (n,)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_every_worker_owns_m_distinct_units_and_workers_are_disjoint(partition):
    labels = synthetic_labels()
    rows = split_by_labels(labels, N_WORKERS, partition, seed=3)
    assert rows.shape == (N_WORKERS, M)
    assert sorted(rows.flatten().tolist()) == list(range(N_WORKERS * M))  # a permutation of the pool


def test_contiguous_is_the_original_split_and_random_follows_the_seed():
    labels = synthetic_labels()
    def split(partition, seed):
        return split_by_labels(labels, N_WORKERS, partition, seed)

    assert torch.equal(split("contiguous", 0), torch.arange(N_WORKERS * M).view(N_WORKERS, M))
    assert torch.equal(split("random", 1), split("random", 1))
    assert not torch.equal(split("random", 1), split("random", 2))


def test_label_sorted_makes_all_workers_but_one_single_class():
    labels = synthetic_labels()
    rates = positive_rates(labels, split_by_labels(labels, N_WORKERS, "label-sorted", 0))
    single_class = ((rates == 0) | (rates == 1)).sum().item()
    assert single_class >= N_WORKERS - 1
    assert rates.std() > 2 * positive_rates(labels, split_by_labels(labels, N_WORKERS, "random", 0)).std() + 0.1


def test_small_dirichlet_alpha_skews_more_and_the_seed_decides():
    labels = synthetic_labels(positive_rate=0.3)
    spread = {alpha: sum(positive_rates(labels, split_by_labels(labels, N_WORKERS, f"dirichlet:{alpha}", seed)).std()
                         for seed in range(5)) / 5
              for alpha in (0.1, 1, 100)}
    assert spread[0.1] > spread[1] > spread[100], spread
    assert spread[100] < 0.05  # close to random
    same = [split_by_labels(labels, N_WORKERS, "dirichlet:0.5", 7) for _ in range(2)]
    assert torch.equal(same[0], same[1])
    assert not torch.equal(same[0], split_by_labels(labels, N_WORKERS, "dirichlet:0.5", 8))


def test_whole_groups_gives_every_group_to_one_worker():
    sizes = torch.randint(5, 60, (40,), generator=torch.Generator().manual_seed(0))
    groups = torch.repeat_interleave(torch.arange(40), sizes)
    groups = groups[torch.randperm(len(groups), generator=torch.Generator().manual_seed(1))]
    rows = whole_groups(groups, n=6, multiple=4, m_max=len(groups) // 6)
    n, m = rows.shape
    assert n == 6 and m > 0 and m % 4 == 0
    assert len(set(rows.flatten().tolist())) == n * m  # distinct units
    owned = [set(groups[row].tolist()) for row in rows]
    assert all(not (a & b) for i, a in enumerate(owned) for b in owned[i + 1:])  # disjoint series sets
    # m is the largest that fits: one more multiple of 4 does not
    assert whole_groups(groups, n=6, multiple=4, m_max=m + 4).shape[1] == m
    assert whole_groups(groups, n=60, multiple=4, m_max=100).shape == (60, 0)  # 40 groups cannot feed 60 workers


@pytest.mark.parametrize("text", ["dirichlet", "dirichlet:0", "dirichlet:-1", "dirichlet:abc", "dirichlet:inf",
                                  "sorted", ""])
def test_bad_partition_strings_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        partition_type()(text)


def test_partition_names_are_canonical():
    assert partition_type()("dirichlet:1.0") == "dirichlet:1" and partition_type()("label-sorted") == "label-sorted"
    with pytest.raises(argparse.ArgumentTypeError, match="no class label"):
        partition_type(("random", "contiguous"), why=" (M4 windows have no class label)")("dirichlet:1")


# ------------------------------------------------------------------------------------------ end to end


def only_line(result) -> str:
    """The one stderr line of a refused run (warnings aside)."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  ")]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("script,partition,message", [
    ("main-LR-HMDA.py", "dirichlet:0", "ALPHA > 0"),
    ("main-LR-HMDA.py", "dirichlet:x", "ALPHA > 0"),
    ("main-LR-HMDA.py", "skewed", "contiguous, random, label-sorted, dirichlet:ALPHA"),
    ("main-MLP-M4.py", "label-sorted", "no class label"),
])
def test_bad_partition_fails_with_one_line(tmp_path, script, partition, message):
    line = only_line(run_script(script, "--partition", partition, "--out", tmp_path / "run"))
    assert "--partition" in line and message in line


@pytest.mark.slow
@needs_data("hmda/raw/hmda_train_preprocessed.zip")
@pytest.mark.parametrize("sorter,partition", [("CD-GraB", "contiguous"), ("D-RR", "label-sorted")])
def test_logged_herding_bound_equals_the_bound_of_the_recorded_orders(tmp_path, sorter, partition):
    """With lr 1e-30 the parameters never move, so every step's per-example gradients are those at the
    initial parameters (checkpoint.pt): the logged bound must equal parallel_herding_bound of those
    gradients, recomputed here, under the recorded orders of each epoch."""
    from data.hmda import load_hmda

    out = tmp_path / "run"
    check_ok(run_script("main-LR-HMDA.py", "--sorter", sorter, "--partition", partition, "--epochs", "2",
                        "--lr", "1e-30", "--max-train-examples", "800", "--max-eval-examples", "100",
                        "--record-orders", "--log-herding", "--out", out))
    rows, orders = read_metrics(out), torch.load(out / "orders.pt")
    flat = torch.load(out / "checkpoint.pt", weights_only=False)["flat"].double()  # (F + 1,): weight, bias
    data = load_hmda(DATA_DIR)
    x, y = data.train_x[:800].double(), data.train_y[:800].double()
    worker_rows = split_by_labels(data.train_y[:800], 4, partition, seed=0)  # (4, 200)
    residual = torch.sigmoid(x @ flat[:-1] + flat[-1]) - y  # d loss / d logit per example
    grads = torch.cat([residual[:, None] * x, residual[:, None]], dim=1)[worker_rows]  # (4, 200, F + 1)
    for row, order in zip(rows, orders):
        assert row["herding_bound"] == pytest.approx(parallel_herding_bound(grads, order), rel=1e-4)
    assert orders[0].tolist() != orders[1].tolist()  # two different orders were checked
    config = json.loads((out / "config.json").read_text())
    rates = config["data"]["worker_positive_rates"]
    assert config["args"]["partition"] == partition and len(rates) == 4
    assert (sum(r in (0.0, 1.0) for r in rates) >= 3) == (partition == "label-sorted")


@pytest.mark.slow
@needs_data("m4/Weekly-train.csv", "m4/Weekly-test.csv")
def test_m4_whole_series_partition_and_the_herding_memory_limit(tmp_path):
    out = tmp_path / "series"
    check_ok(run_script("main-MLP-M4.py", "--partition", "contiguous", "--node_cnt", "8", "--B", "32", "--epochs", "1",
                        "--max-train-examples", "4000", "--max-eval-examples", "100", "--out", out))
    info = json.loads((out / "config.json").read_text())["data"]
    assert info["partition"] == "contiguous" and info["series_on_several_workers"] == 0
    assert len(info["worker_series_counts"]) == 8 and min(info["worker_series_counts"]) >= 1
    # the full Weekly training set: 32 workers x 3,352 windows x d 5,569 floats is about 2.4 GB
    line = only_line(run_script("main-MLP-M4.py", "--log-herding", "--epochs", "1", "--out", tmp_path / "big"))
    assert "--log-herding" in line and "512 MB limit" in line and "--max-train-examples" in line
