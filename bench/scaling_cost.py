"""What D-RR, exact CD-GraB and sketched CD-GraB cost per step from 4 to 1,024 workers (docs/scaling.md).

A cost MODEL, evaluated for the four benchmarks' d (parameters) and k (units per worker per step, kept
fixed as n grows: the same batch per worker), read from the shipped runs' config.json "sizes", plus a
CHECK of its byte counts against `comm_bytes` in metrics.csv of tiny real LR-HMDA runs under torchrun
(gloo, 8 workers on 2, 4 and 8 processes).

Floats are float32 (4 bytes). Per step, with n workers:

  counted (engine/comm.py GradientExchange.comm_bytes: every worker counted as its own process)
    D-RR              all-reduce of the d-vector          4 n d
    exact CD-GraB     all-gather of (n, k, d)             4 n k d       (the mean comes from the gather)
    sketched CD-GraB  all-gather of (n, k, D) + all-reduce 4 n (k D + d)
  moved per worker by a ring collective (bandwidth term; what the network carries)
    all-reduce of d floats: 4 * 2 (n - 1) / n * d;  all-gather of k d floats per worker: 4 (n - 1) k d
  sorter memory per process (every rank runs the sorter on all n workers' data, as the engine does)
    D-RR              orders (n, m) int64                                 8 N            (N = n m units)
    exact CD-GraB     gathered (n, k, d) float32 + the unpaired unit of the previous step when k is
                      odd (n, d) float32 + running sum (d,) float64 + orders and next_orders (n, m) int64
                      = 4 n k d + [k odd] 4 n d + 8 d + 16 N
    sketched CD-GraB  the same with D for d, plus the CountSketch tables (int32 bucket + int8 sign stored,
                      int64 bucket + float32 sign cached for use: 17 d bytes)

Step time (bandwidth only, no latency term): compute + ring bytes / bandwidth, compute per worker measured
(see COMPUTE_SOURCES). These are estimates from the model, not measurements at that scale.

    python bench/scaling_cost.py                 # model + the torchrun check (a few minutes on 2 cores)
    python bench/scaling_cost.py --no-measure    # the model only; keeps the JSON's last measurement
    python bench/scaling_cost.py --no-measure --figure reproduction/figures/worker-scaling.png
                                                 # and docs/scaling.md's figure (with the herding CSVs)
"""
import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "scaling-cost.json"
sys.path.insert(0, str(REPO))  # run from anywhere (the figure imports analysis)
HERDING = REPO / "reproduction" / "herding-scaling"  # scripts/herding_simulation.py's CSVs for the figure
HERDING_SETTINGS = {"fixed-total": "N = 300,000 (m = N / n)", "fixed-m": "m = 292 (N = 292 n)"}
BENCHMARKS = ("LR-HMDA", "MLP-M4", "LSTM-Wiki2", "GPT2-Wiki103")
WORKERS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
SKETCH_DIM = 128  # the D of the bytes / memory table (the docs' example --sketch-dim)
BANDWIDTH_BYTES = 100e9 / 8  # a 100 Gb/s network
SLOWDOWN = 1.1  # "worth it": a step at most 10 % slower than D-RR's
FLOAT, INDEX, WIDE = 4, 8, 8  # bytes of a float32, an int64 order entry, a float64 running-sum entry
# CD-GraB's per-process compute and memory of the sign loop grow as n k d too; the step-time model counts
# communication only (docs/scaling.md says so), so it is not a term here.
COMPUTE_SOURCES = {  # where each benchmark's per-step compute seconds come from
    "LR-HMDA": "reproduction/LR-HMDA/D-RR-node4-B16-lr0.005-seed0/metrics.csv",
    "MLP-M4": "reproduction/MLP-M4/D-RR-node4-B16-lr0.001-seed0/metrics.csv",
    "LSTM-Wiki2": "bench/results/gpu-epochs.json",
    "GPT2-Wiki103": "bench/results/gpu-epochs.json",
}


def sizes(benchmark: str) -> dict:
    """The shipped CD-GraB seed-0 run's config.json sizes: d, units_per_step k, n_workers, units_per_worker."""
    run = sorted((REPO / "reproduction" / benchmark).glob("CD-GraB-*seed0"))[0]
    return json.loads((run / "config.json").read_text())["sizes"]


def counted_bytes(method: str, n: int, k: int, d: int, D: int = 0) -> int:
    """Bytes per step as GradientExchange.comm_bytes counts them. A D >= d sketch is the identity map:
    exact CD-GraB."""
    if method == "D-RR":
        return FLOAT * n * d
    if method == "CD-GraB" or D >= d:
        return FLOAT * n * k * d
    return FLOAT * n * (k * D + d)


def ring_bytes(method: str, n: int, k: int, d: int, D: int = 0) -> float:
    """Bytes one worker sends (= receives) per step in ring collectives: all-reduce 2 (n-1)/n d floats,
    all-gather (n-1) k d floats."""
    all_reduce = FLOAT * 2 * (n - 1) / n * d
    if method == "D-RR":
        return all_reduce
    if method == "CD-GraB" or D >= d:
        return FLOAT * (n - 1) * k * d
    return FLOAT * (n - 1) * k * D + all_reduce


def sorter_memory(method: str, n: int, k: int, d: int, units: int, D: int = 0) -> int:
    """Bytes the sorter holds per process (units: N = n m, the training set's units)."""
    if method == "D-RR":
        return INDEX * units
    width, tables = (d, 0) if method == "CD-GraB" or D >= d else (D, 17 * d)
    return FLOAT * n * k * width + (k % 2) * FLOAT * n * width + WIDE * width + 2 * INDEX * units + tables


def compute_seconds_per_worker(benchmark: str) -> dict:
    """Measured seconds of one step's gradient computation for ONE worker: D-RR's compute seconds per step
    divided by the run's n workers (all n were computed in one process, so each worker's share is 1/n)."""
    source = COMPUTE_SOURCES[benchmark]
    if source.endswith(".json"):
        entry = json.loads((REPO / source).read_text())["benchmarks"][benchmark]
        per_step = entry["split_seconds_per_epoch"]["D-RR"]["compute"] / entry["steps_per_epoch"]
        device = json.loads((REPO / source).read_text())["device"]
    else:
        with open(REPO / source) as f:
            rows = list(csv.DictReader(f))
        per_step = sum(float(r["compute_seconds"]) for r in rows) / len(rows) / sizes(benchmark)["steps_per_epoch"]
        device = "this CPU (2 cores)"
    n = sizes(benchmark)["n_workers"]
    return {"seconds": per_step / n, "step_seconds_all_workers": per_step, "n_workers": n,
            "source": source, "device": device}


def step_seconds(method: str, n: int, k: int, d: int, compute: float, D: int = 0) -> float:
    return compute + ring_bytes(method, n, k, d, D) / BANDWIDTH_BYTES


def crossover_n(k: int, d: int, compute: float, limit: int = 2**22):
    """The smallest n at which exact CD-GraB's modelled step exceeds SLOWDOWN x D-RR's (None: not below limit)."""
    for n in range(2, limit + 1):
        if step_seconds("CD-GraB", n, k, d, compute) > SLOWDOWN * step_seconds("D-RR", n, k, d, compute):
            return n
    return None


def largest_sketch_dim(n: int, k: int, d: int, compute: float) -> int:
    """The largest D < d with sketched CD-GraB's modelled step <= SLOWDOWN x D-RR's at n workers (0: none)."""
    room = (SLOWDOWN - 1) * step_seconds("D-RR", n, k, d, compute) * BANDWIDTH_BYTES  # bytes the sketch may add
    return max(0, min(d - 1, int(room // (FLOAT * (n - 1) * k))))


def model() -> dict:
    out = {}
    for benchmark in BENCHMARKS:
        s = sizes(benchmark)
        k, d, units = s["units_per_step"], s["d"], s["n_workers"] * s["units_per_worker"]
        compute = compute_seconds_per_worker(benchmark)
        rows = []
        for n in WORKERS:
            row = {"n": n}
            for method, D in (("D-RR", 0), ("CD-GraB", 0), ("sketched", SKETCH_DIM)):
                row[method] = {"counted_bytes": counted_bytes(method, n, k, d, D),
                               "ring_bytes_per_worker": ring_bytes(method, n, k, d, D),
                               "sorter_memory_bytes": sorter_memory(method, n, k, d, units, D),
                               "step_seconds": step_seconds(method, n, k, d, compute["seconds"], D)}
            rows.append(row)
        D_max = largest_sketch_dim(1024, k, d, compute["seconds"])
        out[benchmark] = {"d": d, "k": k, "units": units, "sketch_dim": SKETCH_DIM,
                          "sketch_is_identity": SKETCH_DIM >= d, "compute": compute, "rows": rows,
                          "crossover_n": crossover_n(k, d, compute["seconds"]),
                          "sketch_dim_within_1.1x_at_1024": D_max,
                          "sketch_dim_within_1.1x_at_1024_pow2": 2 ** (D_max.bit_length() - 1) if D_max else 0}
    return out


MEASURE_ARGS = ["--node_cnt", "8", "--B", "32", "--epochs", "1", "--max-train-examples", "640",
                "--max-eval-examples", "64", "--progress", "off"]
MEASURE_SKETCH_DIM = 8  # below LR-HMDA's d = 26, so the sketch is a real map


def measure(procs=(2, 4, 8)) -> list:
    """Run LR-HMDA under torchrun (gloo) with P processes for 8 workers and compare metrics.csv's
    comm_bytes with the formula times the run's steps."""
    rows = []
    for p in procs:
        for method, extra in (("D-RR", []), ("CD-GraB", []),
                              ("sketched", ["--sketch-dim", str(MEASURE_SKETCH_DIM)])):
            with tempfile.TemporaryDirectory() as tmp:
                sorter = "D-RR" if method == "D-RR" else "CD-GraB"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p}",
                       str(REPO / "main-LR-HMDA.py"), *MEASURE_ARGS, "--sorter", sorter, *extra, "--out", tmp]
                subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                s = json.loads((Path(tmp) / "config.json").read_text())["sizes"]
                with open(Path(tmp) / "metrics.csv") as f:
                    measured = int(float(next(csv.DictReader(f))["comm_bytes"]))
            n, k, d, steps = s["n_workers"], s["units_per_step"], s["d"], s["steps_per_epoch"]
            D = MEASURE_SKETCH_DIM if method == "sketched" else 0
            formula = counted_bytes(method, n, k, d, D) * steps
            rows.append({"processes": p, "world_size": s["world_size"], "method": method, "n": n, "k": k,
                         "d": d, "D": D, "steps": steps, "measured_comm_bytes": measured,
                         "formula_comm_bytes": formula, "equal": measured == formula,
                         "ring_bytes_per_process_per_step": ring_bytes(method, p, k * n // p, d, D)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-measure", action="store_true",
                   help="skip the torchrun runs; keep the check already in the JSON")
    p.add_argument("--json", default=str(RESULTS), help=f"where to write the result (default {RESULTS.relative_to(REPO)})")
    p.add_argument("--figure", default=None,
                   help="also draw analysis.plots.plot_worker_scaling to this PNG (needs the CSVs in --herding-dir's "
                        "fixed-total/ and fixed-m/)")
    p.add_argument("--herding-dir", default=str(HERDING), help=f"default {HERDING.relative_to(REPO)}")
    args = p.parse_args(argv)
    path = Path(args.json)
    previous = json.loads(path.read_text()) if path.exists() else {}
    result = {
        "note": "model estimates (bandwidth-only ring, 100 Gb/s), not measurements at that scale; "
                "check: LR-HMDA comm_bytes under torchrun gloo",
        "bandwidth_bytes_per_second": BANDWIDTH_BYTES, "slowdown": SLOWDOWN, "workers": list(WORKERS),
        "benchmarks": model(),
        "check": previous.get("check", []) if args.no_measure else measure(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        from analysis import load_herding
        from analysis.plots import plot_worker_scaling
        herding = {label: load_herding(Path(args.herding_dir) / folder) for folder, label in HERDING_SETTINGS.items()}
        fig = plot_worker_scaling(result, herding)
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.figure, dpi=100, bbox_inches="tight")  # dpi 100: a small PNG for the docs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
