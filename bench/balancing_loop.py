"""Why CD-GraB's sequential sign loop uses NumPy on the CPU: both loops timed in one run.

    python bench/balancing_loop.py

For each d, runs CD-GraB's sign loop over the same stream of vectors with the NumPy path and with
the torch path (the one used on GPUs), checks they give the same signs, and prints microseconds
per vector and the torch / NumPy ratio.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
import sorters.balance as balance  # noqa: E402


def time_loop(signs_fn, stream):
    running_sum = torch.zeros(stream.shape[1])
    start = time.perf_counter()
    signs = signs_fn(running_sum, stream)
    return time.perf_counter() - start, signs


def main():
    print(f"{'d':>8} {'vectors':>8} {'numpy us':>9} {'torch us':>9} {'ratio':>6}")
    for d, count in ((16, 20000), (26, 20000), (1024, 10000), (65536, 1000), (1_081_792, 100)):
        stream = torch.randn(count, d, generator=torch.Generator().manual_seed(0))
        numpy_s, numpy_signs = time_loop(balance.signs_numpy, stream)
        torch_s, torch_signs = time_loop(balance.signs_torch, stream)
        agree = (numpy_signs == torch_signs).float().mean().item()
        print(f"{d:8d} {count:8d} {1e6 * numpy_s / count:9.2f} {1e6 * torch_s / count:9.2f} "
              f"{torch_s / numpy_s:6.2f}   signs agree: {agree:.4f}")


if __name__ == "__main__":
    main()
