"""The paper's parallel herding bound simulation (its random-vector figure; docs/figures.md).

Per trial: 10^6 * scale vectors ~ N(0, I_16) from numpy RandomState(trial), each normalised to unit
L2 norm, reshaped to (m examples, n workers, d) and centred per worker (each worker's m vectors sum
to 0). Every method reorders its own copy for `rounds` rounds through the ordinary sorter API:

    orders = sorter.sort()                         # round r's order (round 0: the initial order)
    bound  = parallel_herding_bound(z, orders)     # max_k || sum_{t<=k} sum_j z[j, orders[j, t]] ||_inf
    sorter.step(z[j, orders[j, t]] for t in chunk, chunk)   # the whole round, chunk by chunk

Methods: the sorters CD-GraB, I-B, I-PB, D-RR (the paper's figure), any other sorter (e.g. KH-SGD and
SBW, the randomised-threshold pair balancers of docs/reorderers.md; their E is --rounds; issue #60's orderers,
below), and ALL, the centralised
baseline the original scripts also computed: pair balance (CD-GraB with one worker) over all n*m
vectors as one stream, scored by the herding bound of that single sequence (not comparable step for
step with the parallel bound: n*m prefixes instead of m; the paper does not plot it).

Sketched balancing (--sketch-dim D, balancing sorters only): the sorter balances the D-dimensional
CountSketches of the vectors (sorters.GradientSketch(d, D, seed=trial), docs/sketching.md), as sketched
CD-GraB does with gradients, while the bound is still that of the vectors themselves. Such a run's method
is named "<sorter>+sketch<D>" (e.g. CD-GraB+sketch4) in its CSV and file name.

Issue #60's orderers. FlipFlop and SWR read no vectors (step(None, ...)); FlipFlop's odd rounds run the
previous round's permutation backwards, and since every worker's vectors sum to zero a reversed order has
the same prefix sums up to sign, hence the same bound. SWR's rows are i.i.d. draws with repeats, not
permutations: the bound is still the largest prefix sum of the vectors it visits (centred on the worker's
own m vectors, as every method's), only its full sum is not zero, which is the point of comparing it.
MB-GraB's unit is a micro-batch of --batch-size consecutive positions per worker (default 4: LR-HMDA's
paper setting, B 16 over 4 workers); each step hands it whole micro-batches of the units' vectors, which it
averages per micro-batch, and the bound is that of the unit order. Another --batch-size names its runs
"MB-GraB+batch<b>". RPB runs like CD-GraB (its default block of 16). Greedy costs O(m^2 d) per round and
m sequential steps: affordable at paper scale only for the larger n, so run it at a smaller --scale (its
m, in the file name, keeps the scales apart; the tables and figures draw each scale separately).

Output: one tidy CSV per (n_workers, trial, method) in --out, named n{n}-m{m}-trial{t}-{method}.csv,
columns n_workers,m,d,trial,method,round,bound,seconds (seconds: this method's cumulative wall time
when the round's bound was recorded). Files are written atomically; existing ones are skipped
unless --force, so an interrupted run continues where it stopped.

    python scripts/herding_simulation.py                       # paper scale (1e6 vectors, 5 trials)
    python scripts/herding_simulation.py --scale 0.001 --trials 1 --out /tmp/herding   # seconds
"""
import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `sorters`
from common.errors import exit_with_error  # noqa: E402
from sorters import SORTER_NAMES, SORTERS, GradientSketch, build_sorter, parallel_herding_bound  # noqa: E402

PAPER_METHODS = ("CD-GraB", "I-B", "I-PB", "D-RR")  # the paper's figure; the default
METHODS = PAPER_METHODS + ("ALL",)
COLUMNS = ("n_workers", "m", "d", "trial", "method", "round", "bound", "seconds")


def make_vectors(n_total: int, n_workers: int, d: int, trial: int) -> np.ndarray:
    """(n_workers, m, d) float64, m = n_total // n_workers: unit-norm Gaussian vectors, centred so
    that each worker's m vectors sum to zero. Same RandomState(trial) stream for every n_workers."""
    m = n_total // n_workers
    x = np.random.RandomState(trial).randn(n_total, d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    z = x[: m * n_workers].reshape(m, n_workers, d).transpose(1, 0, 2)  # (m, n, d) -> (n, m, d)
    return z - z.mean(axis=1, keepdims=True)


SKETCH_SUFFIX = "+sketch"
BATCH_SUFFIX = "+batch"
# the step's units per worker of the sorters whose unit depends on it (MB-GraB's micro-batch): LR-HMDA's paper
# setting, B 16 over 4 workers
DEFAULT_BATCH_SIZE = 4


def uses_batch_size(method: str) -> bool:
    """Whether the sorter a method name runs takes the step's units per worker (MB-GraB)."""
    name = method.partition(SKETCH_SUFFIX)[0].partition(BATCH_SUFFIX)[0]
    return getattr(SORTERS.get(name), "uses_batch_size", False)


def batch_size_of(method: str) -> int:
    """The micro-batch of a method name: b of "<sorter>+batch<b>", else DEFAULT_BATCH_SIZE."""
    suffix = method.partition(BATCH_SUFFIX)[2]
    return int(suffix) if suffix else DEFAULT_BATCH_SIZE


def simulate(z: np.ndarray, method: str, rounds: int, seed: int, chunk: int = 1000):
    """Yield (round, bound, seconds) for rounds 0..rounds of `method` on z (n, m, d) float64; a method
    "<sorter>+sketch<D>" balances the vectors' D-dimensional sketches, and MB-GraB's micro-batch is b of
    "MB-GraB+batch<b>" (else DEFAULT_BATCH_SIZE), its steps `chunk` rounded down to whole micro-batches."""
    if method == "ALL":  # centralised: one worker holding all n*m vectors (still summing to zero)
        z, method = z.reshape(1, -1, z.shape[2]), "CD-GraB"
    batch_size = batch_size_of(method)
    method, _, sketch_dim = method.partition(BATCH_SUFFIX)[0].partition(SKETCH_SUFFIX)
    if SORTERS[method].uses_grads and getattr(SORTERS[method], "uses_batch_size", False):
        chunk = max(batch_size, chunk - chunk % batch_size)  # a step covers whole micro-batches
    n, m, d = z.shape
    z64 = torch.from_numpy(np.ascontiguousarray(z))
    z32 = z64.float()  # what the sorter sees, like float32 gradients in training
    start = time.perf_counter()
    if sketch_dim:  # the sorter sees P z, the bound stays z's
        z32 = GradientSketch(d, int(sketch_dim), seed=seed)(z32)
    # a round is an epoch; batch_size is ignored by the sorters whose unit does not depend on it
    sorter = build_sorter(method, n_workers=n, m=m, d=z32.shape[2], seed=seed, epochs=rounds, batch_size=batch_size)
    orders = sorter.sort()
    for r in range(rounds + 1):
        # z is centred already (float64), so the bound needs no second centring
        yield r, parallel_herding_bound(z64, orders, center=False), time.perf_counter() - start
        if r == rounds:
            break
        if sorter.uses_grads:
            ordered = torch.gather(z32, 1, orders[:, :, None].expand(n, m, z32.shape[2]))  # (n, m, d or D), round order
            for t in range(0, m, chunk):
                k = min(chunk, m - t)
                sorter.step(ordered[:, t:t + k], torch.arange(t, t + k))
        else:
            sorter.step(None, torch.arange(m))
        orders = sorter.sort()


def write_csv_atomic(path: Path, rows: list) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for row in rows:
            f.write(",".join(f"{v:.10g}" if isinstance(v, float) else str(v) for v in row) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file


def parse_methods(text: str, sketch_dim: int = 0, batch_size: int = DEFAULT_BATCH_SIZE) -> list:
    """The method names; with sketch_dim D, each balancing sorter's name becomes "<sorter>+sketch<D>"; with a
    batch_size b other than DEFAULT_BATCH_SIZE, MB-GraB's gets "+batch<b>" after that."""
    names = list(dict.fromkeys(text.replace(",", " ").split()))  # de-duplicated, order kept
    unknown = [name for name in names if name != "ALL" and name not in SORTER_NAMES]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(SORTER_NAMES)}, ALL")
    if sketch_dim < 0:
        raise SystemExit(f"--sketch-dim must be >= 0 (0: no sketch), got {sketch_dim}")
    if sketch_dim:
        names = [f"{name}{SKETCH_SUFFIX}{sketch_dim}" if name in SORTERS and SORTERS[name].uses_grads else name
                 for name in names]
    if batch_size < 1:
        exit_with_error(f"--batch-size must be >= 1 (MB-GraB's micro-batch, units per worker), got {batch_size}")
    if batch_size != DEFAULT_BATCH_SIZE:
        names = [f"{name}{BATCH_SUFFIX}{batch_size}" if uses_batch_size(name) else name for name in names]
    return names


_VECTORS = {}  # this process's vectors of the (trial, n) it ran last; jobs come grouped by (trial, n)


def run_one(job: dict) -> str:
    """Simulate one (trial, n_workers, method), write its CSV atomically, return a summary line."""
    key = (job["trial"], job["n"], job["n_total"], job["d"])
    if key not in _VECTORS:
        _VECTORS.clear()  # one trial's vectors (n_total x d float64) at a time
        _VECTORS[key] = make_vectors(job["n_total"], job["n"], job["d"], job["trial"])
    steps = simulate(_VECTORS[key], job["method"], job["rounds"], seed=job["trial"], chunk=job["chunk"])
    if job["inner_bar"]:
        steps = tqdm(steps, total=job["rounds"] + 1, desc=f"{job['method']} n={job['n']}", leave=False, unit="round")
    rows = [(job["n"], job["m"], job["d"], job["trial"], job["method"], r, bound, seconds) for r, bound, seconds in steps]
    write_csv_atomic(job["path"], rows)
    return (f"n={job['n']:4d} m={job['m']:7d} trial={job['trial']} {job['method']:8s} "
            f"bound {rows[0][6]:8.3f} -> {rows[-1][6]:8.3f}  ({rows[-1][7]:.1f} s)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0,
                   help="fraction of the paper's 10^6 vectors per trial (default 1; 0.001 for a smoke test)")
    p.add_argument("--workers", type=int, nargs="+", default=[5, 10, 20, 50, 100],
                   help="worker counts n; each worker gets m = vectors // n (default 5 10 20 50 100)")
    p.add_argument("--rounds", type=int, default=15, help="reorder rounds after the initial order (default 15)")
    p.add_argument("--trials", type=int, default=5,
                   help="trials 0..T-1, each with numpy RandomState(trial) vectors and sorter seed trial "
                        "(default 5, as the paper)")
    p.add_argument("--methods", default=" ".join(PAPER_METHODS),
                   help="space/comma separated sorter names (sorters.SORTER_NAMES) and/or ALL, the "
                        f"centralised pair balance over all vectors (default \"{' '.join(PAPER_METHODS)}\")")
    p.add_argument("--d", type=int, default=16, help="vector dimension (default 16)")
    p.add_argument("--sketch-dim", type=int, default=0,
                   help="balancing sorters balance D-dimensional CountSketches of the vectors (default 0: the "
                        "vectors); their runs are named <sorter>+sketch<D>")
    p.add_argument("--chunk", type=int, default=1000,
                   help="positions per sorter.step call (default 1000; MB-GraB's: rounded down to whole micro-batches)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"MB-GraB's micro-batch, units per worker per step; m must be a multiple (default "
                        f"{DEFAULT_BATCH_SIZE}: LR-HMDA's paper setting, B 16 over 4 workers; others name the runs "
                        "MB-GraB+batch<b>)")
    p.add_argument("--out", default="results/herding", help="output folder for the CSVs (default results/herding)")
    p.add_argument("--force", action="store_true", help="recompute runs whose CSV already exists")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs in parallel processes (default 1; each needs ~0.5 GB at full scale)")
    args = p.parse_args(argv)

    n_total = int(round(1e6 * args.scale))
    methods = parse_methods(args.methods, args.sketch_dim, args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the sorters are sequential loops; threads only add overhead here

    jobs = []
    for trial in range(args.trials):
        for n in args.workers:
            m = n_total // n
            if m < 2:
                raise SystemExit(f"--scale {args.scale} leaves m = {m} vectors per worker for n = {n}; need >= 2")
            if m % args.batch_size and any(uses_batch_size(method) for method in methods):
                exit_with_error(f"--scale {args.scale} leaves m = {m} vectors per worker for n = {n}, not a multiple "
                                f"of MB-GraB's micro-batch --batch-size {args.batch_size}; choose a --batch-size that "
                                "divides m, or another --scale")
            for method in methods:
                path = out / f"n{n}-m{m}-trial{trial}-{method}.csv"
                if args.force or not path.exists():  # an existing CSV is a finished run
                    jobs.append(dict(trial=trial, n=n, m=m, method=method, n_total=n_total, d=args.d,
                                     rounds=args.rounds, chunk=args.chunk, path=path, inner_bar=args.jobs == 1))
    bar = tqdm(total=len(jobs), desc="herding", unit="run")
    if args.jobs == 1:
        for job in jobs:
            bar.set_postfix(n=job["n"], trial=job["trial"], method=job["method"])
            tqdm.write(run_one(job))
            bar.update()
    else:  # independent runs in parallel processes; spawn: no forked torch/OpenMP state
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:
            for line in (f.result() for f in as_completed([pool.submit(run_one, job) for job in jobs])):
                tqdm.write(line)
                bar.update()
    bar.close()
    print(f"wrote {out}/")


if __name__ == "__main__":
    main()
