"""bench/scaling_cost.py's byte model against what GradientExchange counts, its shipped measurement, and
docs/scaling.md's table against bench/results/scaling-cost.json."""
import importlib.util
import json
import re

import pytest
import torch

from engine.comm import GradientExchange, LocalCommunicator
from sorters import GradientSketch
from tests.helpers import REPO

RESULT = json.loads((REPO / "bench" / "results" / "scaling-cost.json").read_text())
PAGE_PATH = REPO / "docs" / "scaling.md"


def _bench():
    spec = importlib.util.spec_from_file_location("scaling_cost", REPO / "bench" / "scaling_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exchanged_bytes(n, k, d, D=0, gather=True):
    """comm_bytes of one LocalCommunicator exchange: D-RR (gather False), exact (D 0) or sketched CD-GraB."""
    sketch = GradientSketch(d, D, seed=0) if D else None
    exchange = GradientExchange(LocalCommunicator(n), gather_unit_grads=gather, sketch=sketch)
    grads = torch.randn(n, k, d)
    exchange.exchange(grads, grads.mean(dim=(0, 1)))
    return exchange.comm_bytes


@pytest.mark.parametrize("n,k,d,D", [(4, 4, 26, 8), (8, 1, 100, 16), (16, 3, 50, 7), (2, 2, 1000, 64)])
def test_formula_is_what_the_exchange_counts(n, k, d, D):
    bench = _bench()
    # written out here, not taken from the bench: 4-byte floats; all-reduce n d, all-gather n k d
    assert exchanged_bytes(n, k, d, gather=False) == 4 * n * d == bench.counted_bytes("D-RR", n, k, d)
    assert exchanged_bytes(n, k, d) == 4 * n * k * d == bench.counted_bytes("CD-GraB", n, k, d)
    assert exchanged_bytes(n, k, d, D) == 4 * n * k * D + 4 * n * d == bench.counted_bytes("sketched", n, k, d, D)


def test_ring_model_and_the_shipped_measurement():
    bench = _bench()
    n, k, d, D = 1024, 4, 5569, 128  # a ring moves 2 (n-1)/n d per all-reduce, (n-1) k d per all-gather
    assert bench.ring_bytes("D-RR", n, k, d) == pytest.approx(4 * 2 * (n - 1) / n * d)
    assert bench.ring_bytes("CD-GraB", n, k, d) == 4 * (n - 1) * k * d
    assert bench.ring_bytes("sketched", n, k, d, D) == pytest.approx(4 * ((n - 1) * k * D + 2 * (n - 1) / n * d))
    check = RESULT["check"]
    assert {row["processes"] for row in check} == {2, 4, 8} and len(check) == 9
    for row in check:  # the torchrun runs' metrics.csv comm_bytes, against the formula written out here
        per_step = {"D-RR": row["n"] * row["d"], "CD-GraB": row["n"] * row["k"] * row["d"],
                    "sketched": row["n"] * (row["k"] * row["D"] + row["d"])}[row["method"]]
        assert row["measured_comm_bytes"] == 4 * per_step * row["steps"], row


def _cell(value: float) -> str:
    """A byte count as docs/scaling.md writes it (3 significant digits, SI prefixes)."""
    for factor, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{value:.3g} B"


def test_docs_table_is_the_shipped_result():
    PAGE = PAGE_PATH.read_text()
    rows = re.findall(r"^\| (LR-HMDA|MLP-M4|LSTM-Wiki2|GPT2-Wiki103) \| (\d+) \|(.*)\|$", PAGE, flags=re.M)
    assert len(rows) >= 12, "docs/scaling.md lost its table"
    for benchmark, n, rest in rows:
        entry = RESULT["benchmarks"][benchmark]
        row = next(r for r in entry["rows"] if r["n"] == int(n))
        want = [_cell(row[m][key]) for key in ("counted_bytes", "ring_bytes_per_worker", "sorter_memory_bytes")
                for m in ("D-RR", "CD-GraB", "sketched")]
        if entry["sketch_is_identity"]:
            want = [w if i % 3 != 2 else "= exact" for i, w in enumerate(want)]
        assert [c.strip() for c in rest.split("|")] == want, (benchmark, n)
    for benchmark, entry in RESULT["benchmarks"].items():  # the stated crossover and sketch dimension
        stated = (f"| {benchmark} | d {entry['d']:,}, k {entry['k']} | {entry['crossover_n']:,} | "
                  f"{entry['sketch_dim_within_1.1x_at_1024']:,} |")
        assert stated in PAGE, benchmark


def test_docs_herding_table_is_the_shipped_csvs():
    """docs/scaling.md's round-15 bounds are the means over trials of reproduction/herding-scaling's CSVs."""
    import csv
    from collections import defaultdict

    bounds = defaultdict(list)  # (setting, n, method) -> the trials' bounds in the last round
    for path in (REPO / "reproduction" / "herding-scaling").glob("*/*.csv"):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        bounds[(path.parent.name, int(rows[-1]["n_workers"]), rows[-1]["method"])].append(float(rows[-1]["bound"]))
    mean = {key: sum(v) / len(v) for key, v in bounds.items()}
    assert {len(v) for v in bounds.values()} == {5}
    rows = re.findall(r"^\| (\d+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| 292 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      PAGE_PATH.read_text(), flags=re.M)
    assert len(rows) == 9, "docs/scaling.md lost its herding table"
    columns = [("fixed-total", "CD-GraB"), ("fixed-total", "D-RR"), ("fixed-m", "CD-GraB"), ("fixed-m", "D-RR"),
               ("fixed-m", "CD-GraB+sketch4"), ("fixed-m", "CD-GraB+sketch8")]
    for n, _, *shown in rows:
        n = int(n)
        assert shown == [f"{mean[(setting, n, method)]:.2f}" for setting, method in columns], n
