"""Ghost against streaming for one Linear layer's products (sorters/exact_products.py): CPU seconds of
(a) <S, g_u> and (b) the Gram matrix of U units, each way, beside the cost formulas' flops, for shapes
from logistic regression and MLPs (one token per example) to GPT-2 small's layers (128 tokens), and as
ExactCDGraB calls them (the pairs' differences, with and without the units' sum) on GPT-2 small's row blocks
sharded over 2 processes. The
chooser (`ghost_pays`) takes ghost when GHOST_MARGIN * ghost flops < stream flops; this bench says
whether that choice is the faster one on this CPU.

    OMP_NUM_THREADS=1 python bench/exact_products.py          # writes bench/results/exact-products-cpu.json
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (units U, tokens T, rows R (out), columns C (in))
SHAPES = [(16, 1, 1, 26), (16, 1, 512, 784), (64, 1, 512, 512), (16, 8, 256, 256), (8, 32, 768, 768),
          (8, 128, 768, 768), (8, 128, 3072, 768), (8, 128, 50257, 768)]
# ExactCDGraB's calls: (U, T, R, C) with U / 2 pairs, without and with the units' sum (sum_all): GPT-2 small's
# Conv1D and tied-matrix row blocks sharded over 2 processes (bench/fsdp_gpt2_small.py: 4 units of 64 tokens)
PAIRED_SHAPES = [(4, 64, 384, 768), (4, 64, 384, 3072), (4, 64, 1536, 768), (4, 64, 25129, 768)]


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per shape and way (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "exact-products-cpu.json"))
    args = parser.parse_args()
    import torch

    from engine.runlog import git_commit, write_result
    from sorters import exact_products as ep

    torch.set_num_threads(args.threads)
    rows = []
    for U, T, R, C in SHAPES:
        g = torch.randn(U, T, R)
        a = torch.randn(U, T, C)
        S = torch.randn(R, C)
        pieces = [(0, ep.Outer(g, a))]
        stream = seconds(lambda: ep.stream_products(pieces, S, U), args.repeats)
        ghost = seconds(lambda: ep.ghost_products(pieces, S, U), args.repeats) if U * T * R <= 2**22 else None
        row = {"U": U, "T": T, "R": R, "C": C, "stream_seconds": round(stream, 5),
               "ghost_seconds": None if ghost is None else round(ghost, 5),
               "stream_flops": ep.stream_cost(pieces, U, R, C), "ghost_flops": ep.ghost_cost(pieces, R, C),
               "chosen": "ghost" if ep.ghost_pays(pieces, U, R, C) else "stream",
               "faster": None if ghost is None else ("ghost" if ghost < stream else "stream")}
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    for U, T, R, C in PAIRED_SHAPES:
        g, a, S = torch.randn(U, T, R), torch.randn(U, T, C), torch.randn(R, C)
        pieces = [(0, ep.Outer(g, a))]
        pairs = ep.Pairs(list(range(0, U, 2)), list(range(1, U, 2)), torch.ones(U))
        for grad_units in (0, U):
            stream, ghost = (seconds(lambda how=how: ep.parameter_products(pieces, S, U, how, grad_units, pairs),
                                     args.repeats) for how in ("stream", "ghost"))
            row = {"U": U, "T": T, "R": R, "C": C, "pairs": len(pairs.firsts), "units_sum": bool(grad_units),
                   "stream_seconds": round(stream, 5), "ghost_seconds": round(ghost, 5),
                   "stream_flops": ep.stream_cost(pieces, U, R, C, len(pairs.firsts)),
                   "ghost_flops": ep.ghost_cost(pieces, R, C, grad_units),
                   "chosen": "ghost" if ep.ghost_pays(pieces, U, R, C, grad_units, len(pairs.firsts)) else "stream",
                   "faster": "ghost" if ghost < stream else "stream"}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    result = {"git_commit": git_commit(), "ghost_margin": ep.GHOST_MARGIN, "rows": rows,
              "chooser_agrees": all(r["faster"] in (None, r["chosen"]) for r in rows),
              "settings": {"threads": args.threads, "repeats": args.repeats, "statistic": "median CPU seconds",
                           "torch": torch.__version__, "cpu_count": os.cpu_count(),
                           "load_average_1min": round(os.getloadavg()[0], 2)}}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
