"""`sorter.step` of KH-SGD and SBW against CD-GraB's, at the LR-HMDA and MLP-M4 sizes, in one run.

    OMP_NUM_THREADS=1 python bench/reorderer_step.py [--rounds 5] [--out bench/results/reorderer-step-cpu.json]

The three sorters share everything but the add/subtract rule (sorters/randomized.py), so the ratio
measures what the rule costs: one more running sum (the squared norm) in the compiled pass over d, and
a few scalar operations per pair difference. Per size: the same cycle of 64 random (n, k, d) gradient
blocks for every sorter; each round is one epoch of every sorter, interleaved window by window (25
steps of each, the order rotating from window to window), so that all three see the same machine load.
Reported: microseconds per step, the minimum over all windows (the least disturbed by other
processes), the ratio of those minima, and the median over windows of the per-window ratio.
Also: the once-per-epoch cost of drawing the epoch's random numbers at the full-size P.

Writes ONE JSON object (and prints it).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from sorters import build_sorter  # noqa: E402

SORTERS = ("CD-GraB", "KH-SGD", "SBW")
# label: (n workers, k units per worker per step, d, full-size m per worker: the pair differences per epoch
# P = n * m / 2 of the real runs, for the draw timing)
SIZES = {"LR-HMDA (n=4, k=4, d=26)": (4, 4, 26, 48816),
         "LR-HMDA one worker (n=1, k=16, d=26)": (1, 16, 26, 195264),
         "MLP-M4 figure (n=4, k=4, d=5569)": (4, 4, 5569, 26844),
         "MLP-M4 README (n=32, k=1, d=5569)": (32, 1, 5569, 3354)}
M = 4000  # units per worker in the timed epochs
WINDOW = 25  # steps per timed window; divides M / k for every size


def bench_size(n, k, d, m_full, rounds: int) -> dict:
    """Rounds of one epoch per sorter, interleaved window by window (the sorters see the same load)."""
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(n, k, d, generator=gen) for _ in range(64)]
    sorters = {name: build_sorter(name, n, M, d, seed=0, epochs=50) for name in SORTERS}
    steps = M // k
    assert steps % WINDOW == 0
    best, window_ratios = dict.fromkeys(SORTERS, float("inf")), {name: [] for name in SORTERS[1:]}
    for _ in range(rounds):
        for sorter in sorters.values():
            sorter.sort()
        for window, first in enumerate(range(0, steps, WINDOW)):
            seconds = {}
            for name in SORTERS[window % 3:] + SORTERS[:window % 3]:  # each sorter in each place in turn
                sorter = sorters[name]
                start = time.perf_counter()
                for step in range(first, first + WINDOW):
                    sorter.step(blocks[step % len(blocks)], range(step * k, (step + 1) * k))
                seconds[name] = (time.perf_counter() - start) / WINDOW
                best[name] = min(best[name], seconds[name])
            for name in window_ratios:
                window_ratios[name].append(seconds[name] / seconds["CD-GraB"])
    entry = {f"{name}_us": round(1e6 * best[name], 2) for name in SORTERS}
    for name in SORTERS[1:]:
        entry[f"{name}_over_CD-GraB"] = round(best[name] / best["CD-GraB"], 3)
        entry[f"{name}_over_CD-GraB_median_window"] = round(statistics.median(window_ratios[name]), 3)
    full = build_sorter("KH-SGD", n, m_full, d, seed=0, epochs=50)
    start = time.perf_counter()
    full.epoch_draws(1)
    entry["epoch_draws_ms_full_size"] = round(1e3 * (time.perf_counter() - start), 2)
    entry["pair_differences_per_epoch_full_size"] = full.pairs_per_epoch
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="epochs of 4,000 units per sorter and size")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "reorderer-step-cpu.json"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "units_per_worker_timed": M,
              "window_steps": WINDOW, "rounds": args.rounds,
              "sizes": {label: bench_size(*size, args.rounds) for label, size in SIZES.items()}}
    text = json.dumps(report, indent=1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
