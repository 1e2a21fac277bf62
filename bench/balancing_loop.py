"""Why CD-GraB's sequential sign loop is compiled (numba) on the CPU: both paths timed in one run.

    python bench/balancing_loop.py

For each d, runs CD-GraB's sign loop over the same pair differences with the CPU path (numba) and
with the device path (`signs_by_gram`, the one used on GPUs, here run on the CPU), checks they give
the same signs, and prints one JSON object: microseconds per vector and the torch / CPU ratio. The
differences come in blocks of 8 (one LR-HMDA or M4-figure step: 4 workers x 2 pairs).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
import sorters.balance as balance  # noqa: E402


def main():
    compiled = balance._pair_signs_cpu()
    report = {}
    for d, count in ((16, 20000), (26, 20000), (1024, 10000), (65536, 1000), (1_081_792, 64)):
        rng = np.random.default_rng(0)
        firsts = rng.standard_normal((count, 1, d), dtype=np.float32)
        seconds = rng.standard_normal((count, 1, d), dtype=np.float32)
        plus = np.empty((1, count), dtype=np.bool_)
        compiled(np.zeros(d), firsts[:2], 0, seconds[:2], 0, plus[:, :2], balance._MINUS_PLUS_ONE)
        start = time.perf_counter()
        compiled(np.zeros(d), firsts, 0, seconds, 0, plus, balance._MINUS_PLUS_ONE)
        cpu_seconds = time.perf_counter() - start
        stream = torch.from_numpy(firsts[:, 0] - seconds[:, 0])
        running_sum = torch.zeros(d, dtype=torch.float64)
        start = time.perf_counter()
        torch_plus = torch.cat([balance.signs_by_gram(running_sum, block) for block in stream.split(8)])
        torch_seconds = time.perf_counter() - start
        report[f"d={d}"] = {"vectors": count, "cpu_us_per_vector": round(1e6 * cpu_seconds / count, 3),
                            "torch_us_per_vector": round(1e6 * torch_seconds / count, 3),
                            "torch_over_cpu": round(torch_seconds / cpu_seconds, 2),
                            "signs_agree": float((torch.from_numpy(plus[0]) == torch_plus).float().mean())}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
