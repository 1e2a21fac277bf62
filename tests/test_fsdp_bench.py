"""bench/fsdp_gpt2_small.py: how it counts a collective's bytes (against hand counts and the conservation of what is
sent and received over the processes), how a run's ratios follow from its per-rank numbers, bad input; and, as a
release check, the report of a run at a tiny size (2 layers, 2 steps, 2 gloo processes) with FSDP's bytes against
the sizes of the sharded parameters. The bench's speed is its own business, not this."""
import importlib.util
import json
import statistics
import sys

import pytest
import torch

from tests.git_checkout import GIT_CHECKOUT, expected_head
from tests.helpers import REPO, check_ok, release_check, run_python

DIM = 64


def load_bench():
    spec = importlib.util.spec_from_file_location("fsdp_gpt2_small", REPO / "bench" / "fsdp_gpt2_small.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def calls_of_two_ranks():
    """(name, [rank 0's arguments, rank 1's]) of one call of each collective over 2 processes, float32 unless
    said: what each process hands to it."""
    f32, f64 = torch.float32, torch.float64
    return [
        ("all_gather_single", [{"output_tensor": torch.empty(6, 3), "input_tensor": torch.empty(3, 3)}] * 2),
        ("reduce_scatter_single", [{"output": torch.empty(5), "input": torch.empty(10)}] * 2),
        ("all_reduce", [{"tensor": torch.empty(7, dtype=f64)}] * 2),
        # rows 3/2: rank 0 sends 3 numbers to itself and 3 to rank 1, receives 3 from each; rank 1 sends 2 and 2
        ("all_to_all_single", [{"output": torch.empty(6, dtype=f32), "input": torch.empty(5, dtype=f32),
                                "output_split_sizes": [3, 3], "input_split_sizes": [3, 2]},
                               {"output": torch.empty(4, dtype=f32), "input": torch.empty(5, dtype=f32),
                                "output_split_sizes": [2, 2], "input_split_sizes": [3, 2]}]),
        ("broadcast", [{"tensor": torch.empty(4), "src": 1}] * 2),
        ("gather", [{"tensor": torch.empty(2, 2), "dst": 0}] * 2),
    ]


def test_a_collectives_bytes_by_hand():
    """Per rank (sent, received), counted by hand from each process's tensors (float32: 4 bytes)."""
    expected = {"all_gather_single": [(36, 36), (36, 36)],      # its 9 numbers to the other, the other's 9
                "reduce_scatter_single": [(20, 20), (20, 20)],  # the other's half of 10, its own half from the other
                "all_reduce": [(56, 56), (56, 56)],             # 2 (P - 1) / P of 7 float64
                "all_to_all_single": [(8, 12), (12, 8)],        # all but the block it keeps
                "broadcast": [(0, 16), (16, 0)],                # from rank 1
                "gather": [(0, 16), (16, 0)]}                   # to rank 0
    for name, ranks in calls_of_two_ranks():
        got = [bench.direct_bytes(name, call, rank, 2) for rank, call in enumerate(ranks)]
        assert got == expected[name], name


def test_what_the_processes_send_is_what_they_receive():
    for name, ranks in calls_of_two_ranks():
        moved = [bench.direct_bytes(name, call, rank, 2) for rank, call in enumerate(ranks)]
        assert sum(sent for sent, _ in moved) == sum(received for _, received in moved), name


def test_traffic_counts_each_call_in_its_phase_and_passes_it_on():
    """A wrapped collective (here a stand-in with all_gather_single's signature) adds its bytes and a call to the
    phase it runs in ("fsdp" outside Traffic.phase), and still runs with the caller's arguments."""
    ran = []

    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        ran.append((output_tensor.shape, input_tensor.shape, async_op))

    traffic = bench.Traffic(rank=0, world=2)
    wrapped = traffic.wrap("all_gather_single", all_gather_single)
    wrapped(torch.empty(8), torch.empty(4), async_op=True)
    with traffic.phase("cdgrab"):
        wrapped(output_tensor=torch.empty(2, dtype=torch.float64), input_tensor=torch.empty(1, dtype=torch.float64))
    assert ran == [((8,), (4,), True), ((2,), (1,), False)]
    assert traffic.counts == {"fsdp": {"sent": 16, "received": 16, "calls": {"all_gather_single": 1}},
                              "cdgrab": {"sent": 8, "received": 8, "calls": {"all_gather_single": 1}}}
    assert traffic.current == "fsdp"


def rank(step, peak, fsdp, cdgrab, orders=((0, 1),)):
    return {"step_seconds": step, "peak_rss_mb": peak, "part_seconds": {"model": step / 2},
            "bytes_per_step": {"fsdp": {"sent": fsdp, "received": fsdp + 1},
                               "cdgrab": {"sent": cdgrab, "received": cdgrab + 1}},
            "next_orders": [list(orders[0])]}


def test_a_run_is_its_slowest_rank_and_the_ratios_are_medians_over_plains():
    plain = [bench.over_ranks([rank(1.0, 100, 10, 0), rank(2.0, 90, 12, 0)]),
             bench.over_ranks([rank(3.0, 110, 10, 0), rank(1.0, 80, 10, 0)]),
             bench.over_ranks([rank(2.2, 120, 10, 0), rank(1.0, 80, 10, 0)])]  # medians 2.2 s, 110 MB
    owners = [bench.over_ranks([rank(2.0, 150, 10, 4), rank(1.0, 100, 10, 5)]) for _ in range(3)]
    assert (plain[0]["step_seconds"], plain[0]["peak_rss_mb"]) == (2.0, 100)
    assert plain[0]["bytes_per_step"]["fsdp"] == {"sent": 12, "received": 13}
    summary = bench.summarise({"plain": plain, "exact records=owners": owners})
    plain_step, plain_peak = statistics.median([2.0, 3.0, 2.2]), statistics.median([100, 110, 120])
    assert summary["plain"]["step_seconds"] == plain_step and summary["plain"]["step_vs_plain"] == 1.0
    entry = summary["exact records=owners"]
    assert entry["step_vs_plain"] == round(2.0 / plain_step, 3) and entry["peak_vs_plain"] == round(150 / plain_peak, 3)
    assert entry["part_seconds"] == {"model": 1.0}
    assert entry["cdgrab_bytes_vs_fsdp"] == {"sent": round(5 / 10, 4), "received": round(6 / 11, 4)}


def test_a_variant_with_the_heap_kept_is_compared_with_plain_with_the_heap_kept():
    """Ratios of '<variant>, heap kept' against 'plain, heap kept' (neither trims between steps), of the others
    against plain (both trim)."""
    runs = {"plain": [bench.over_ranks([rank(2.0, 100, 10, 0)])],
            "plain, heap kept": [bench.over_ranks([rank(4.0, 200, 10, 0)])],
            "exact records=owners": [bench.over_ranks([rank(3.0, 120, 10, 1)])],
            "exact records=owners, heap kept": [bench.over_ranks([rank(5.0, 230, 10, 1)])]}
    summary = bench.summarise(runs)
    assert summary["exact records=owners"]["step_vs_plain"] == 1.5 and summary["exact records=owners"]["peak_vs_plain"] == 1.2
    kept = summary["exact records=owners, heap kept"]
    assert kept["step_vs_plain"] == 1.25 and kept["peak_vs_plain"] == 1.15
    assert summary["plain, heap kept"]["step_vs_plain"] == 1.0
    assert bench.variant_names(8, heap_kept=False)[-1] == "sketch D=8"


def test_the_routes_orders_are_compared_rank_by_rank():
    same = [bench.over_ranks([rank(1, 1, 1, 1), rank(1, 1, 1, 1, ((1, 0),))])]
    other = [bench.over_ranks([rank(1, 1, 1, 1), rank(1, 1, 1, 1)])]
    routes = ["exact records=owners", "exact records=all", "exact records=owners-overlapped"]
    assert bench.orders_equal(dict.fromkeys(routes, same)) is True
    assert bench.orders_equal({**dict.fromkeys(routes, same), "exact records=all": other}) is False
    assert bench.orders_equal({**dict.fromkeys(routes, same), "exact records=owners-overlapped": other}) is False
    assert bench.orders_equal({"exact records=owners": same, "exact records=all": same}) is None


@pytest.mark.parametrize("args, message", [(["--steps", "1"], "--steps must be >= 2"),
                                           (["--block", "1"], "--block must be >= 2"),
                                           (["--out", "bench"], "is a folder")])
def test_bad_input_gets_one_line_and_exit_2(args, message):
    result = run_python([sys.executable, "bench/fsdp_gpt2_small.py", *args], timeout=60)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------- a run at a tiny size

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(report from --out, stdout, HEAD when it started) of one run of every variant at the tiny size."""
    head = expected_head()
    path = tmp_path_factory.mktemp("fsdp-bench") / "report.json"
    result = run_python([sys.executable, "bench/fsdp_gpt2_small.py", "--small-config", "--tokens", "random",
                         "--steps", "3", "--block", "16", "--dim", str(DIM), "--out", path], timeout=600)
    check_ok(result)
    return json.loads(path.read_text()), result.stdout, head


def padded_halves(shapes):
    """Numbers in one process's shard of each parameter, dim 0 padded to a multiple of 2 (FSDP2's all-gather
    and reduce-scatter buffers)."""
    return sum((-(-shape[0] // 2)) * (torch.Size(shape).numel() // shape[0]) for shape in shapes)


@release_check
def test_report_layout_and_fsdps_bytes_from_the_parameters(smoke):
    """Every variant's entry and every rank's steps; FSDP's bytes a step from the sharded parameters' sizes: each
    block all-gathered in the forward and again in the backward, the root once (not resharded after its forward),
    every gradient reduce-scattered; CD-GraB's: the sketch's (batch, D) float32 to the other process, one
    all-reduce a step for exact CD-GraB, fewer bytes by the owners' route (overlapped or not: the same bytes,
    the overlapped route's all-to-alls in its third step's backward), and the same orders by every route."""
    report, stdout, head = smoke
    assert json.loads(stdout[:stdout.rindex("\n}") + 2]) == report  # the printed object is the written one
    assert report["git_commit"] in (head, f"{head}-dirty" if GIT_CHECKOUT else head)
    names = ["plain", "exact records=owners", "exact records=all", "exact records=owners-overlapped", f"sketch D={DIM}",
             "plain, heap kept", "exact records=owners, heap kept"]
    assert list(report["variants"]) == names and "| exact records=owners |" in stdout
    assert report["routes_give_the_same_orders"] is True and report["cheaper_route"]["bytes_received"] == "owners"
    assert set(report["cheaper_route"]) == {"sorter_seconds", "gather_seconds", "bytes_received"}
    assert set(report["targets"]["met"]) == set(names[1:4])
    assert set(report["overlapped_vs_owners"]) == {"step_seconds", "model_seconds", "sorter_seconds",
                                                   "cdgrab_bytes_received"}
    assert report["overlapped_vs_owners"]["cdgrab_bytes_received"] == 1.0
    from models.gpt2 import build_gpt2
    model = build_gpt2(**bench.SMALL)
    blocks = [p.shape for block in model.transformer.h for p in block.parameters()]
    everything = [p.shape for p in model.parameters()]
    fsdp_sent = 4 * (2 * padded_halves(everything) + padded_halves(blocks))
    for name in names:
        (run,) = report["variants"][name]["rounds"]
        assert [(r["rank"], r["steps"]) for r in run["ranks"]] == [(0, 3), (1, 3)], name
        for r in run["ranks"]:
            assert r["bytes_per_step"]["fsdp"] == {"sent": fsdp_sent, "received": fsdp_sent}, name
            assert r["d"] == sum(p.numel() for p in model.parameters())
    batch = report["settings"]["batch_per_process"]
    for r in report["variants"][f"sketch D={DIM}"]["rounds"][0]["ranks"]:
        assert r["bytes_per_step"]["cdgrab"] == {"sent": batch * DIM * 4, "received": batch * DIM * 4}
    sent = {}
    for route in ("owners", "all", "owners-overlapped"):
        for r in report["variants"][f"exact records={route}"]["rounds"][0]["ranks"]:
            assert r["calls_per_step"]["cdgrab"]["all_reduce"] == 1 and r["records"] == route
            assert ("all_to_all_single" in r["calls_per_step"]["cdgrab"]) == (route != "all")
            sent.setdefault(route, []).append(r["bytes_per_step"]["cdgrab"]["sent"])
    assert all(owners < every for owners, every in zip(sent["owners"], sent["all"]))
    assert sent["owners-overlapped"] == sent["owners"]
    overlapped = report["variants"]["exact records=owners-overlapped"]["rounds"][0]["ranks"]
    assert all(r["timed_from_step"] == 2 and r["part_seconds"]["backward_exchange"] > 0 for r in overlapped)


def test_the_docs_quote_the_shipped_json():
    """docs/fsdp.md's cost table is the bench's markdown of bench/results/fsdp-gpt2-small-cpu.json, the commit it
    names is the JSON's, and its verdict on the targets is the JSON's."""
    bench = load_bench()
    result = json.loads((REPO / "bench" / "results" / "fsdp-gpt2-small-cpu.json").read_text())
    docs = (REPO / "docs" / "fsdp.md").read_text()
    for line in bench.markdown(result).splitlines():
        assert line in docs, line
    assert f"clean worktree of {result['git_commit'][:7]} on a quiet machine" in docs
    owners = result["targets"]["met"]["exact records=owners"]
    assert ("targets **not met**" in docs) == (not all(owners.values()))
