"""Seconds of one LSTM-Wiki2 evaluation (train, valid and test splits, whole) at the entry script's settings.

    OMP_NUM_THREADS=1 python bench/lstm_eval.py [--device cpu] [--out bench/results/lstm-eval-cpu.json] [-- FLAGS]

Builds main-LSTM-Wiki2.py's Task as its run_entry_point does (its defaults: B 16, 4 workers, bptt 35, the
whole training matrix and the whole valid and test matrices; flags after `--` go to the entry script),
in one process with its 4 workers, at the initial parameters (seed 0), and times ONE call of
`task.evaluate` under torch.no_grad (on CUDA between two torch.cuda.synchronize()). One call, because a
call takes minutes on one CPU thread. Writes one JSON object to --out and prints it: device, torch,
threads, git_commit, git_clean (whether `git status --porcelain` lists nothing but --out), entry_args,
tokens per split, the evaluation's seconds and the metrics it returned (the numbers let two versions of
the evaluation be compared at the same parameters).
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from engine.cli import check_args  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from engine.device import set_tf32  # noqa: E402
from engine.runlog import git_state  # noqa: E402


def build_task(device: torch.device, extra: list[str]):
    """(args, Task) of main-LSTM-Wiki2.py with `extra` flags, built as its run_entry_point builds it."""
    spec = importlib.util.spec_from_file_location("main_lstm_wiki2", REPO / "main-LSTM-Wiki2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.make_parser()
    args = parser.parse_args(["--device", device.type, *extra])
    check_args(args, module.BENCHMARK, defaults=vars(parser.parse_args([])))
    set_tf32(args.tf32)
    torch.manual_seed(args.seed)
    return args, module.LSTMWiki2(args, device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=None, help="JSON report (default bench/results/lstm-eval-<device>.json)")
    argv, extra = sys.argv[1:], []
    if "--" in argv:  # everything after -- belongs to the entry script
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    out = Path(args.out or REPO / "bench" / "results" / f"lstm-eval-{args.device}.json")
    device = torch.device(args.device)
    task_args, task = build_task(device, extra)
    comm = LocalCommunicator(task_args.node_cnt, device)
    commit, clean = git_state(out)
    with torch.no_grad():
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = task.evaluate(task.model.flat, comm)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "git_commit": commit, "git_clean": clean,
        "entry_args": extra, "B": task.B, "node_cnt": task.n_workers, "bptt": task.bptt,
        "tokens": {split: chunks * task.bptt * task.B for split, (_, chunks) in task.eval_matrices.items()},
        "evaluate_seconds": round(seconds, 2), "metrics": metrics,
    }
    text = json.dumps(report, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
