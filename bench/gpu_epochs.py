"""Seconds per training epoch of every benchmark on one CUDA device, CD-GraB against D-RR (issue #7/#8).

    python bench/gpu_epochs.py --data-dir DATA --out runs-gpu [--benchmarks LR-HMDA MLP-M4 ...] [--parallel]

Runs each benchmark for one full epoch in one process (`--device cuda`), with the paper's settings
(M4: the figure's 4 workers, B 16; LSTM: carried hidden state; GPT-2: WikiText-2 train as the
stand-in for WikiText-103 train), once per sorter, into <out>/<benchmark>/<sorter>-.../ (resumable
run directories: add epochs with the same command and a larger --epochs). Prints ONE JSON object:
training seconds per epoch (evaluation excluded), the sorter / comm / compute split and the
CD-GraB / D-RR ratio per benchmark. With --parallel the benchmarks run side by side (one process
each, the two sorters of a benchmark one after the other), which shares the GPU: a benchmark's
ratio is then measured under the same load for both sorters, its absolute seconds are not.
"""
import argparse
import csv
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "LR-HMDA": [],
    "MLP-M4": ["--node_cnt", "4", "--B", "16"],
    "LSTM-Wiki2": ["--carry-hidden"],
    "GPT2-Wiki103": ["--train-file", "{data}/wikitext-2/train.txt"],
}


def run_benchmark(benchmark: str, sorters: list[str], args) -> dict:
    result = {}
    for sorter in sorters:
        out = Path(args.out) / benchmark / sorter
        flags = [flag.format(data=args.data_dir) for flag in SETTINGS[benchmark]]
        command = [sys.executable, str(REPO / f"main-{benchmark}.py"), "--sorter", sorter, "--seed", "0",
                   "--device", "cuda", "--epochs", str(args.epochs), "--data-dir", args.data_dir, "--out", str(out),
                   "--resume", "--progress", "off", *flags]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            result[sorter] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:400]}
            continue
        with open(out / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        last = rows[-1]
        result[sorter] = {key: round(float(last[key]), 3) for key in
                          ("epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds", "train_loss")}
        result[sorter]["epochs_done"] = len(rows)
    if all("epoch_seconds" in result.get(s, {}) for s in ("CD-GraB", "D-RR")):
        result["CD-GraB_over_D-RR"] = round(result["CD-GraB"]["epoch_seconds"] / result["D-RR"]["epoch_seconds"], 3)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True, help="folder for the run directories")
    parser.add_argument("--benchmarks", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"])
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (resumes finished epochs)")
    parser.add_argument("--parallel", action="store_true", help="run the benchmarks side by side")
    args = parser.parse_args()
    import torch  # only to describe the device

    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "parallel": args.parallel}
    with ThreadPoolExecutor(max_workers=len(args.benchmarks) if args.parallel else 1) as pool:
        results = pool.map(lambda b: run_benchmark(b, args.sorters, args), args.benchmarks)
        report.update(zip(args.benchmarks, results))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
