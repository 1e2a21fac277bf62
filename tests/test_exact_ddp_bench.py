"""bench/exact_ddp.py at a tiny size (--small-config, 2 steps, 2 gloo processes): what it reports and how
its ratios and bytes follow from its own per-rank numbers; its speed is the bench's business, not this."""
import importlib.util
import json
import statistics
import sys

import pytest

from tests.git_checkout import GIT_CHECKOUT, expected_head
from tests.helpers import REPO, check_ok, run_python

DIM = 64
VARIANT_KEYS = {"peak_rss_mb", "peak_vs_plain", "step_seconds", "step_vs_plain", "step_cpu_seconds",
                "step_cpu_vs_plain", "rounds", "gathered_bytes_per_step", "records_bytes_per_step",
                "received_bytes_per_step"}
RATIOS = {"step_vs_plain": "step_seconds", "step_cpu_vs_plain": "step_cpu_seconds", "peak_vs_plain": "peak_rss_mb"}


def load_bench():
    spec = importlib.util.spec_from_file_location("exact_ddp", REPO / "bench" / "exact_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def head_at_start():
    """HEAD's commit (or "unknown commit") as the bench run starts: in a checkout others commit to meanwhile,
    HEAD at the assertion may be newer than the code the run recorded."""
    return expected_head()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, head_at_start):
    """(report from --out, stdout) of one run: plain, sketched D=64 and exact_low_memory under torchrun."""
    path = tmp_path_factory.mktemp("exact-ddp") / "report.json"
    result = run_python([sys.executable, "bench/exact_ddp.py", "--small-config", "--steps", "2", "--dim", str(DIM),
                         "--no-one-process", "--out", path], timeout=300)
    check_ok(result)
    return json.loads(path.read_text()), result.stdout


def test_report_layout_and_every_rank_ran_every_step(smoke, head_at_start):
    report, stdout = smoke
    assert json.loads(stdout[:stdout.rindex("\n}") + 2]) == report  # the printed object is the written one
    head = head_at_start  # "unknown commit" in a source archive
    assert report["git_commit"] in (head, f"{head}-dirty" if GIT_CHECKOUT else head)
    assert report["sketch_dim"] == DIM and report["exact_low_memory_orders_equal_one_process"] is None
    assert report["processes"] == {"plain": 2, f"sketched D={DIM}": 2, "exact_low_memory": 2}
    assert report["settings"]["batch_per_process"] * 2 == report["settings"]["batch_per_step"] == 8
    assert "| exact_low_memory | 2 |" in stdout  # the markdown table
    for name, entry in report["variants"].items():
        assert set(entry) == VARIANT_KEYS, name
        (run,) = entry["rounds"]
        assert [(r["rank"], r["steps"]) for r in run["ranks"]] == [(0, 2), (1, 2)], name
    # both ranks of the exact run end with the same next-epoch orders: 2 replicas x 8 examples, a permutation each
    orders = [r["next_orders"] for r in report["variants"]["exact_low_memory"]["rounds"][0]["ranks"]]
    assert orders[0] == orders[1] and [sorted(o) for o in orders[0]] == [list(range(8))] * 2


def test_ratios_are_the_slowest_ranks_medians_over_plains(smoke):
    report, _ = smoke
    variants = report["variants"]

    def value(name, key):  # per round the max over ranks, then the median over rounds
        return statistics.median(max(r[key] for r in run["ranks"]) for run in variants[name]["rounds"])

    for name, entry in variants.items():  # the bench rounds MB to 0.1, seconds and ratios to 0.001
        for ratio, key in RATIOS.items():
            rounding = 0.06 if key == "peak_rss_mb" else 1e-3
            assert entry[key] == pytest.approx(value(name, key), abs=rounding), (name, key)
            assert entry[ratio] == pytest.approx(value(name, key) / value("plain", key), abs=1e-3), (name, ratio)
    assert all(entry[ratio] == 1.0 for ratio in RATIOS for entry in [variants["plain"]])


def test_bytes_are_what_each_process_all_gathers(smoke):
    report, _ = smoke
    variants = report["variants"]
    assert variants["plain"]["gathered_bytes_per_step"] == variants["plain"]["records_bytes_per_step"] == 0
    # a process's 4 examples' float32 sketches of D numbers, nothing else
    sketched = variants[f"sketched D={DIM}"]
    assert sketched["gathered_bytes_per_step"] == 4 * DIM * 4 and sketched["records_bytes_per_step"] == 0
    assert sketched["received_bytes_per_step"] == 4 * DIM * 4  # the other process's, all-gathered
    # the records (or per-example gradients) of the 4 examples, plus the loss weights and the shapes' integers
    exact = variants["exact_low_memory"]
    for rank in exact["rounds"][0]["ranks"]:
        assert rank["records_bytes_per_step"] >= 4 * DIM * 4
        assert 4 * 4 < rank["gathered_bytes_per_step"] - rank["records_bytes_per_step"] < 2000
        # each parameter's records go to its owner only (ParameterShare): a process receives the other's
        # records of its own parameters, fewer bytes than it sends (an all-gather of 2 receives as many)
        assert 0 < rank["received_bytes_per_step"] < rank["gathered_bytes_per_step"] - 2000
    sent = sum(rank["gathered_bytes_per_step"] for rank in exact["rounds"][0]["ranks"])
    received = sum(rank["received_bytes_per_step"] for rank in exact["rounds"][0]["ranks"])
    assert 0.2 * sent < received < 0.8 * sent  # about half of what is sent stays with its owner


def test_a_run_counts_its_slowest_rank_and_orders_compare_every_rank_with_one_process():
    bench = load_bench()
    ranks = [{"peak_rss_mb": 5.0, "step_seconds": 1.0, "step_cpu_seconds": 3.0, "gathered_bytes_per_step": 7,
              "records_bytes_per_step": 6, "received_bytes_per_step": 2, "next_orders": [[0, 1]]},
             {"peak_rss_mb": 4.0, "step_seconds": 2.0, "step_cpu_seconds": 1.0, "gathered_bytes_per_step": 7,
              "records_bytes_per_step": 6, "received_bytes_per_step": 3, "next_orders": [[0, 1]]}]
    run = bench.over_ranks(ranks)
    assert (run["peak_rss_mb"], run["step_seconds"], run["step_cpu_seconds"]) == (5.0, 2.0, 3.0)
    alone = {"ranks": [{"next_orders": [[0, 1]]}]}
    assert bench.orders_equal_one_process({"exact_low_memory": [run], bench.ONE_PROCESS: [alone]}) is True
    ranks[1]["next_orders"] = [[1, 0]]
    assert bench.orders_equal_one_process({"exact_low_memory": [run], bench.ONE_PROCESS: [alone]}) is False
    assert bench.orders_equal_one_process({"exact_low_memory": [run]}) is None


@pytest.mark.parametrize("args, message", [(["--steps", "1"], "--steps must be >= 2"),
                                           (["--out", "bench"], "is a folder")])
def test_bad_input_gets_one_line_and_exit_2(args, message, tmp_path):
    result = run_python([sys.executable, "bench/exact_ddp.py", *args], timeout=60)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
