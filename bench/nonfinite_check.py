"""What the sorters' NaN / inf check costs per step on the CPU: CD-GraB steps with and without it, one run.

    python bench/nonfinite_check.py [--out bench/results/nonfinite-check-cpu.json]

For each (n, k, d), times CD-GraB's step() on the same (n, k, d) gradients with the check (the library as
is) and with `_screen_nonfinite` replaced by a pass-through, interleaved (A, B, A, B, ...) so that load
on the machine hits both alike, and writes one JSON object (with the commit it ran at): microseconds per
step, the difference and the ratio. The check is one `np.isfinite(grads).all()` pass over the n * k * d
entries; the sorter itself makes about two passes over them (pair differences, running sum).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere
from engine.runlog import head_commit  # noqa: E402
from sorters import build_sorter  # noqa: E402
from sorters.base import Sorter  # noqa: E402

SHAPES = [(4, 16, 26), (4, 16, 1024), (4, 16, 65536), (4, 2, 1_081_792)]  # LR-HMDA's shape first


def time_epochs(sorter, grads, repeats: int) -> float:
    """Seconds per step over `repeats` epochs of m // k steps."""
    n, k, _ = grads.shape
    steps = 0
    start = time.perf_counter()
    for _ in range(repeats):
        sorter.sort()
        for t in range(0, sorter.m, k):
            sorter.step(grads, range(t, t + k))
            steps += 1
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON object to this file")
    args = parser.parse_args()
    commit = head_commit()  # "unknown commit" without a git checkout
    checked = Sorter._screen_nonfinite
    report = {"commit": commit, "torch": torch.__version__, "per_step": {}}
    for n, k, d in SHAPES:
        grads = torch.randn(n, k, d, generator=torch.Generator().manual_seed(0))
        m = k * max(2, 4096 // (k * max(1, d // 256)))
        sorter = build_sorter("CD-GraB", n, m, d)
        times = {"with_check": [], "without_check": []}
        for _ in range(5):
            for label in times:
                Sorter._screen_nonfinite = checked if label == "with_check" else (lambda self, xp, g, start: g)
                times[label].append(time_epochs(sorter, grads, repeats=2))
        Sorter._screen_nonfinite = checked
        best = {label: min(values) for label, values in times.items()}
        report["per_step"][f"n={n} k={k} d={d}"] = {
            "with_check_us": round(1e6 * best["with_check"], 2), "without_check_us": round(1e6 * best["without_check"], 2),
            "check_us": round(1e6 * (best["with_check"] - best["without_check"]), 2),
            "ratio": round(best["with_check"] / best["without_check"], 3)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
