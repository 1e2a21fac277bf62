"""Where a training step's time goes on this machine: a torch.profiler summary per benchmark and sorter,
written as one text file (the GPU session kit's first call on a lent GPU writes it; see docs/gpus.md).

    python bench/gpu_profile.py [--data-dir DIR] [--benchmarks NAME ...] [--sorters NAME ...] [--steps N] --out PATH

For each benchmark (its paper settings, as bench/gpu_epochs.py builds them, cut to --steps steps per
epoch) and sorter: one warm-up epoch, then one epoch whose training steps are profiled (the profiler
starts at the epoch's start and stops before its evaluation). Per run the file gives: the engine's
training seconds; kernel launches and host synchronisations per step (the CUDA runtime calls the
profiler saw: cudaLaunchKernel and its variants; cudaStreamSynchronize, cudaDeviceSynchronize and
cudaEventSynchronize); and the operators and kernels with the most self time on the device (CUDA) or
on the host (CPU: --device cpu profiles CPU activity, the dry run's path). The commit it measured is
found from the code tree hash in its first line (engine.runlog.commit_of_code_tree).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from bench.gpu_epochs import SETTINGS, build_task  # noqa: E402
from common.paths import default_data_dir  # noqa: E402
from engine import runlog  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from engine.device import setup_device  # noqa: E402
from engine.train import train  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
DEFAULT_STEPS = {"LR-HMDA": 100, "MLP-M4": 100, "LSTM-Wiki2": 50, "GPT2-Wiki103": 20}
# The benchmarks the GPU reproduction waits on come first: the kit gives the profile a fixed budget, and
# the first run also pays CUDA's start-up, so a cut profile still covers the LSTM and GPT-2.
DEFAULT_ORDER = ["LSTM-Wiki2", "GPT2-Wiki103", "MLP-M4", "LR-HMDA"]


def profiled_epoch(task, device: torch.device):
    """A profiler that records the training steps of the task's second epoch (hooks on the two Task
    calls the engine makes around an epoch's training, as bench/gpu_epochs.EpochProbe)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler, state = profile(activities=activities), {}
    start_epoch, evaluate = task.start_epoch, task.evaluate

    def start(epoch):
        state["epoch"] = epoch
        start_epoch(epoch)
        if epoch == 2:
            profiler.start()

    def evaluate_after_training(flat, comm):
        if state["epoch"] == 2:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            profiler.stop()
        return evaluate(flat, comm)

    task.start_epoch, task.evaluate = start, evaluate_after_training
    return profiler


def profile_run(benchmark: str, sorter: str, steps: int, data_dir: str, device: torch.device, rows: int) -> str:
    """One benchmark and sorter: its section of the summary."""
    with tempfile.TemporaryDirectory() as out:
        args, task = build_task(benchmark, steps, data_dir, device,
                                ["--sorter", sorter, "--epochs", "2", "--out", out, "--progress", "off"])
        profiler = profiled_epoch(task, device)
        metrics = train(task, args, LocalCommunicator(args.node_cnt, device), device)
    events = profiler.key_averages()
    counts = {event.key: event.count for event in events}
    per_step = lambda names: sum(counts.get(name, 0) for name in names) / steps
    cuda = device.type == "cuda"
    head = (f"== {benchmark} {sorter}: {steps} steps profiled, {metrics[-1]['epoch_seconds']:.3f} s of training "
            f"(sorter {metrics[-1]['sorter_seconds']:.3f}, comm {metrics[-1]['comm_seconds']:.3f}, compute "
            f"{metrics[-1]['compute_seconds']:.3f}); per step: ")
    head += (f"{per_step(LAUNCHES):.1f} kernel launches, {per_step(SYNCS):.2f} host synchronisations" if cuda else
             "kernel launches and host synchronisations: none on the CPU")
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    return f"{head}\n{table}\n"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--data-dir", default=default_data_dir(), help="data folder (default $CDGRAB_DATA, else ./datasets)")
    parser.add_argument("--benchmarks", nargs="+", default=DEFAULT_ORDER, choices=list(SETTINGS), metavar="NAME",
                        help=f"which benchmarks, in this order (default all: {' '.join(DEFAULT_ORDER)})")
    parser.add_argument("--sorters", nargs="+", default=["D-RR", "CD-GraB"], help="which sorters (default D-RR CD-GraB)")
    parser.add_argument("--steps", type=int, help="profiled steps per run, even (default: "
                        + ", ".join(f"{name}={n}" for name, n in DEFAULT_STEPS.items()) + ")")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--rows", type=int, default=20, help="operators and kernels listed per run (default 20)")
    parser.add_argument("--out", required=True, help="the summary's text file")
    return parser


def main(argv: list[str] | None = None):
    args = make_parser().parse_args(argv)
    device, _ = setup_device(args.device, None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# bench/gpu_profile.py on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
            f"code tree {runlog.code_tree()} (git describe: {runlog.git_commit()})\n\n")
    for benchmark in args.benchmarks:
        for sorter in args.sorters:
            text += profile_run(benchmark, sorter, args.steps or DEFAULT_STEPS[benchmark], args.data_dir, device,
                                args.rows)
            out.write_text(text)  # each run's section as soon as it is measured
    print(f"{out}: {len(args.benchmarks) * len(args.sorters)} runs profiled", file=sys.stderr)


if __name__ == "__main__":
    main()
