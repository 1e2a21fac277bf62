"""Cost of sorters.PerExampleGrads against one ordinary backward pass of the same batch.

    OMP_NUM_THREADS=1 python bench/per_example_grads.py      # about a minute; prints one line per case

Cases: logistic regression as LR-HMDA (d = 26, B = 16), an MLP 784-512-512-10 (d = 669,706, B = 64)
with all parameters, with all parameters into a reused `out` buffer, and with the last layer only.
Medians of `--repeats` calls after one warm-up call.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sorters import PerExampleGrads  # noqa: E402


def median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def backward(model, loss_fn, x, y):
    model.zero_grad()
    loss_fn(model(x), y).backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)

    lr = torch.nn.Linear(25, 1)
    x, y = torch.randn(16, 25), (torch.rand(16) > 0.5).float()
    bce = lambda logits, y: F.binary_cross_entropy_with_logits(logits.squeeze(-1), y)  # noqa: E731
    grads_of = PerExampleGrads(lr, bce)
    print(f"LR d={grads_of.d} B=16: per-example {median_ms(lambda: grads_of(x, y), 10 * args.repeats):.3f} ms, "
          f"backward {median_ms(lambda: backward(lr, bce, x, y), 10 * args.repeats):.3f} ms")

    mlp = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 10))
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    full, last = PerExampleGrads(mlp, F.cross_entropy), PerExampleGrads(mlp, F.cross_entropy, params=r"^4\.")
    out = torch.zeros(64, full.d)
    print(f"MLP d={full.d} B=64: per-example {median_ms(lambda: full(x, y), args.repeats):.1f} ms, "
          f"into a reused out buffer {median_ms(lambda: full(x, y, out=out), args.repeats):.1f} ms, "
          f"last layer only (d={last.d}) {median_ms(lambda: last(x, y), args.repeats):.1f} ms, "
          f"backward {median_ms(lambda: backward(mlp, F.cross_entropy, x, y), args.repeats):.1f} ms")


if __name__ == "__main__":
    main()
