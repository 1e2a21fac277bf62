"""Where a training step's time goes: a torch.profiler summary of one epoch of our engine, per sorter.

    OMP_NUM_THREADS=1 python bench/profile_steps.py main-MLP-M4.py --sorters D-RR CD-GraB -- --max-train-examples 8000

Everything after `--` goes to the entry script. For each sorter: one warm-up epoch, then one profiled
epoch (`engine.train.train` in this process, one process for all workers, --device from the flags,
CPU by default). Prints per sorter the profiler's table of the operators with the most self time
(CPU, and CUDA when the run is on a GPU), and the engine's own sorter / comm / compute split.
"""
import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from engine.cli import check_args  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from engine.device import set_tf32  # noqa: E402
from engine.train import train  # noqa: E402


def entry_task(script: str, device, *argv):
    """(task, args): the Task the entry script builds for this command line (--data-dir $CDGRAB_DATA unless
    given), on `device`, as its main() hands it to run_entry_point, with TF32 set from --tf32."""
    spec = importlib.util.spec_from_file_location(Path(script).stem.replace("-", "_"), REPO / Path(script).name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured = []
    module.run_entry_point = lambda *handed: captured.extend(handed)
    module.main()  # builds the parser and hands it to (our) run_entry_point
    benchmark, parser, build = captured
    data_dir = ["--data-dir", os.environ.get("CDGRAB_DATA") or "./datasets"] if "--data-dir" not in argv else []
    args = parser.parse_args([*data_dir, *argv])
    check_args(args, benchmark, defaults=vars(parser.parse_args([])))
    set_tf32(args.tf32)
    torch.manual_seed(args.seed)
    return build(args, device), args


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="entry script, e.g. main-MLP-M4.py")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="sorters to profile")
    parser.add_argument("--rows", type=int, default=15, help="operators shown per table")
    argv, extra = sys.argv[1:], []
    if "--" in argv:  # everything after -- belongs to the entry script
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    device = torch.device("cuda" if "cuda" in extra else "cpu")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for sorter in args.sorters:
        with tempfile.TemporaryDirectory() as tmp:
            task, run_args = entry_task(args.script, device, "--sorter", sorter, "--epochs", "2", "--progress",
                                        "off", "--out", tmp + "/run", *extra)
            comm = LocalCommunicator(run_args.node_cnt, device)
            run_args.epochs = 1
            train(task, run_args, comm, device)  # warm-up epoch (compilation, allocations)
            run_args.epochs, run_args.resume = 2, True
            with profile(activities=activities) as prof:
                rows = train(task, run_args, comm, device)
        row = rows[-1]
        steps = task.n_units // task.units_per_step
        print(f"== {sorter}: {steps} steps, {row['epoch_seconds']:.3f} s training (sorter {row['sorter_seconds']:.3f}, "
              f"comm {row['comm_seconds']:.3f}, compute {row['compute_seconds']:.3f}); the table includes the "
              "epoch's evaluation and checkpoint")
        sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows))


if __name__ == "__main__":
    main()
