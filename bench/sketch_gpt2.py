"""GPT2-Wiki103 on the CPU, one process: bytes per step, peak memory and step time of sketched CD-GraB
(--sketch-dim D) by both gradient paths, against D-RR and exact CD-GraB.

    OMP_NUM_THREADS=1 CDGRAB_DATA=../shared/data python bench/sketch_gpt2.py            # D 1024, 2 rounds
    python bench/sketch_gpt2.py --dims 1024 4096 --rounds 3 --steps 8
    python bench/sketch_gpt2.py --min-numels 1048576 16384 --variants records control  # the thresholds
    python bench/sketch_gpt2.py --profile --out bench/results/profile-sketch-gpt2-cpu.txt   # one chunk, profiled
    python bench/sketch_gpt2.py --variants exact low-memory --out bench/results/exact-low-memory-gpt2-wiki103-cpu.json

Variants: D-RR; exact CD-GraB; exact CD-GraB from the products of the layer records (--exact-low-memory
on, "low-memory": the same orders, no (64, d) per-block gradients); CD-GraB --sketch-dim D by the materialise-then-sketch path (the (64, d)
per-block gradients formed, then the map applied; Task.sketch_records off) and by the records path
(Task.unit_sketches: the TensorSketch blocks' sketches from their layer records, no (64, d) buffer) at each
--sketch-min-numel of --min-numels (the default 2^20 makes the tied wte/lm_head the only block; 2^14 every
Linear/Conv1D/Embedding weight: the smallest, wpe and the attention projections, have 2^14 entries). The sketched paths at one threshold apply the same map. The
records path balances with the sign loop `--sign-loop auto` picks: CD-GraB's Gram loop (sketches of a model of
2^20 parameters or more; numba is never loaded); "records, compiled sign loop" is the same run with
`--sign-loop compiled` (numba's loop, as before that rule). Control: D-RR
with CD-GraB's compiled CPU sign loop loaded (a 1-worker CD-GraB built first: numba, LLVM and the loop, what
every CPU CD-GraB run loads when its sorter is built), so that the sorter's share of the memory is told apart
from the records path's. Paper settings: 64
workers, one 128-token block each per step (B 64), AdamW 5e-4, the WikiText-2 stand-in training file;
--steps steps of one epoch (--max-train-examples 64 * steps).

Each variant runs in a FRESH child process (this script with --child), so that its peak resident memory
(getrusage ru_maxrss, read when the epoch's training ends, before any evaluation; evaluation is skipped)
is its own: the model, the data and the training steps. Step time: per step, wall and CPU seconds between
consecutive ends of steps (the first step is dropped: first-call allocations), median over the steps;
single-threaded, CPU seconds are the wall time of an idle machine and barely move with other load. Also the
mean CPU seconds (`step_cpu_seconds_mean`, `step_cpu_mean_vs_drr`) over the last even number of those steps:
with one block per worker and step a pair spans two steps, so a balancing step alternates with one that only
records, and the mean over as many of each is an epoch's cost per step.
The variants are interleaved (A B C D, A B C D, ...) so that a change in the machine's load hits each
alike; per variant the median over the rounds. Bytes per step: metrics.csv's comm_bytes / steps (the same
in every round). Writes ONE JSON object to --out (and prints it), then a markdown table:
    {"variants": {"<name>": {"bytes_per_step": b, "bytes_vs_drr": r, "peak_rss_mb": m, "peak_vs_drr": r,
        "step_seconds": s, "step_vs_drr": r, "step_cpu_seconds": s, "step_cpu_vs_drr": r,
        "step_cpu_seconds_mean": s, "step_cpu_mean_vs_drr": r,
        "sign_loop": config.json's, "numba_loaded": b, "rounds": [...]}, ...}, "settings": {...}}

--profile instead: in this process, one 16-block gradient pass (GRAD_CHUNK, as a step makes four) of D-RR
(batch_gradient) and of the records path (outer_unit_sketches) at each D and threshold, after a warm-up
pass; their CPU seconds (median of 3) and torch.profiler's operators by self CPU time; then, per D, one
weight block of 2^14 to 2^21 entries sketched from the records (add_outer) and formed then scattered (what
outer_unit_sketches does below formed_block_numel): the text to --out (and stdout).
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from engine.runlog import git_commit, write_result  # noqa: E402
from engine.sketching import STRUCTURED_MIN_NUMEL  # noqa: E402

SCRIPT = "main-GPT2-Wiki103.py"
ARGS = ["--node_cnt", "64", "--B", "64", "--lr", "5e-4", "--epochs", "1", "--progress", "off",
        "--max-eval-examples", "32"]


KINDS = ("exact", "low-memory", "materialise", "records", "compiled", "control")


def power_of_two(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def variants(dims, min_numels=(STRUCTURED_MIN_NUMEL,), kinds=KINDS) -> dict:
    """name -> (sorter flags, records path on, CD-GraB's sign loop loaded first). The records variant at the
    default threshold keeps its old name ("CD-GraB D=1024 records"); others add "min-numel 2^k"."""
    out = {"D-RR": (["--sorter", "D-RR"], True, False)}
    if "control" in kinds:
        out["D-RR, CD-GraB's sign loop loaded"] = (["--sorter", "D-RR"], True, True)
    if "exact" in kinds:
        out["CD-GraB"] = (["--sorter", "CD-GraB"], True, False)
    if "low-memory" in kinds:  # the same orders from products of the layer records (--exact-low-memory on)
        out["CD-GraB exact low memory"] = (["--sorter", "CD-GraB", "--exact-low-memory", "on"], True, False)
    for dim in dims:
        sketched = ["--sorter", "CD-GraB", "--sketch-dim", str(dim)]
        if "materialise" in kinds:
            out[f"CD-GraB D={dim} materialise"] = (sketched, False, False)
        if "compiled" in kinds:  # the records path as it ran before --sign-loop auto took the Gram loop here
            out[f"CD-GraB D={dim} records, compiled sign loop"] = ([*sketched, "--sign-loop", "compiled"], True, False)
        for min_numel in min_numels if "records" in kinds else ():
            if min_numel == STRUCTURED_MIN_NUMEL:
                out[f"CD-GraB D={dim} records"] = (sketched, True, False)
            else:
                out[f"CD-GraB D={dim} records min-numel {power_of_two(min_numel)}"] = (
                    [*sketched, "--sketch-min-numel", str(min_numel)], True, False)
    return out


def child(flags: list, records: bool, sign_loop: bool, steps: int, train_file: str, out_dir: str) -> dict:
    """One epoch of `steps` steps in this (fresh) process; returns the measurements."""
    import torch
    from bench.communication import entry_point
    from engine.cli import check_args
    from engine.comm import LocalCommunicator
    from engine.train import train

    torch.set_num_threads(1)
    if sign_loop:  # what CDGraB.__init__ loads on the CPU: numba, LLVM and the compiled (cached) sign loop
        from sorters import build_sorter
        build_sorter("CD-GraB", 1, 2, 1)
    parser, build_task, benchmark = entry_point(SCRIPT)
    args = parser.parse_args([*ARGS, *flags, "--max-train-examples", str(64 * steps), "--train-file", train_file,
                              "--out", out_dir])
    check_args(args, benchmark, defaults=vars(parser.parse_args([])))
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    task = build_task(args, device)
    task.sketch_records = records
    ends, seen = [], {}
    end_step = task.end_step

    def timed_end_step(aux):
        result = end_step(aux)
        ends.append((time.perf_counter(), time.process_time()))
        return result

    def no_evaluation(flat, comm):  # the peak of the training steps; evaluation is not what is measured
        seen["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {key: math.nan for key in ("train_loss", "test_loss", *task.metric_columns)}

    task.end_step, task.evaluate = timed_end_step, no_evaluation
    row = train(task, args, LocalCommunicator(args.node_cnt, device), device)[-1]
    walls = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
    cpus = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    config = json.loads((Path(out_dir) / "config.json").read_text())
    return {"steps": len(ends), "comm_bytes": int(row["comm_bytes"]), "bytes_per_step": int(row["comm_bytes"]) / len(ends),
            "peak_rss_mb": seen["peak_rss_kb"] / 1024, "step_seconds": statistics.median(walls),
            "step_cpu_seconds": statistics.median(cpus), "step_cpu_seconds_mean": statistics.mean(cpus[len(cpus) % 2:]),
            "sketch": config["sorter"].get("sketch"),
            "sign_loop": config["sorter"].get("sign_loop"), "numba_loaded": "numba" in sys.modules}


def summarise(rounds: dict) -> dict:
    def median(name, key):
        return statistics.median(r[key] for r in rounds[name])

    base = {key: median("D-RR", key) for key in ("bytes_per_step", "peak_rss_mb", "step_seconds", "step_cpu_seconds",
                                                 "step_cpu_seconds_mean")}
    return {name: {"bytes_per_step": median(name, "bytes_per_step"),
                   "bytes_vs_drr": round(median(name, "bytes_per_step") / base["bytes_per_step"], 4),
                   "peak_rss_mb": round(median(name, "peak_rss_mb"), 1),
                   "peak_vs_drr": round(median(name, "peak_rss_mb") / base["peak_rss_mb"], 3),
                   "step_seconds": round(median(name, "step_seconds"), 3),
                   "step_vs_drr": round(median(name, "step_seconds") / base["step_seconds"], 3),
                   "step_cpu_seconds": round(median(name, "step_cpu_seconds"), 3),
                   "step_cpu_vs_drr": round(median(name, "step_cpu_seconds") / base["step_cpu_seconds"], 3),
                   "step_cpu_seconds_mean": round(median(name, "step_cpu_seconds_mean"), 3),
                   "step_cpu_mean_vs_drr": round(median(name, "step_cpu_seconds_mean") / base["step_cpu_seconds_mean"], 3),
                   "sketch": rounds[name][0]["sketch"], "sign_loop": rounds[name][0].get("sign_loop"),
                   "numba_loaded": rounds[name][0].get("numba_loaded"), "rounds": rounds[name]} for name in rounds}


def markdown(result: dict) -> str:
    lines = ["| variant | bytes / step | vs D-RR | peak RSS (MB) | vs D-RR | step s (wall) | vs D-RR | step s (CPU) | vs D-RR |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["variants"].items():
        lines.append(f"| {name} | {m['bytes_per_step'] / 1e6:.2f} MB | {m['bytes_vs_drr']:.3f} | {m['peak_rss_mb']:.0f} | "
                     f"{m['peak_vs_drr']:.2f} | {m['step_seconds']:.2f} | {m['step_vs_drr']:.2f} | "
                     f"{m['step_cpu_seconds']:.2f} | {m['step_cpu_vs_drr']:.2f} |")
    return "\n".join(lines)


def profile_chunk(dims, min_numels, train_file: str, repeats: int = 3) -> str:
    """One GRAD_CHUNK-block gradient pass of D-RR and of the records path per (D, threshold), in this process:
    CPU seconds (median of `repeats`, after a warm-up pass) and torch.profiler's top operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.communication import entry_point
    from engine.sketching import make_sketch

    torch.set_num_threads(1)
    parser, build_task, _ = entry_point(SCRIPT)
    args = parser.parse_args([*ARGS, "--sorter", "CD-GraB", "--max-train-examples", "256", "--train-file", train_file])
    torch.manual_seed(args.seed)
    task = build_task(args, torch.device("cpu"))
    model, chunk = task.model, task.worker_blocks.flatten(0, 1)[:task.grad_chunk]
    passes = {"D-RR (batch_gradient)": lambda: model.batch_gradient(task.loss, chunk)}
    for dim in dims:
        for min_numel in min_numels:
            args.sketch_dim, args.sketch_min_numel = dim, min_numel
            sketch = make_sketch(args, model.d, model)
            passes[f"records D={dim} min-numel {power_of_two(min_numel)} ({len(sketch.blocks)} blocks)"] = \
                lambda sketch=sketch: model.outer_unit_sketches(task.unit_losses, chunk, sketch)
    lines = [f"One {len(chunk)}-block gradient pass of {SCRIPT} (B 64 steps make {64 // len(chunk)}), one thread, "
             f"torch {torch.__version__}, commit {git_commit()}", ""]
    for name, run in passes.items():
        run()  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.process_time()
            run()
            seconds.append(time.process_time() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        lines += [f"== {name}: {statistics.median(seconds):.3f} CPU s (median of {repeats}; "
                  f"{', '.join(f'{s:.3f}' for s in seconds)})",
                  prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), ""]
    return "\n".join(lines + block_costs(dims, len(chunk), chunk.shape[1]))


def block_costs(dims, units: int, tokens: int, repeats: int = 5) -> list:
    """Lines of a table: one (rows, cols) weight block's per-unit sketches over `units` x `tokens` random inputs
    and output gradients, from the records (TensorBlock.add_outer) and formed (the batched product of the
    Linear rule, then index_add_ into the (U, 2D) sums, as outer_unit_sketches does below
    formed_block_numel), CPU seconds, the best of `repeats`."""
    import torch

    from engine.functional import formed_block_numel
    from sorters.sketch import TensorBlock

    def best(run):
        run()
        times = []
        for _ in range(repeats):
            start = time.process_time()
            run()
            times.append(time.process_time() - start)
        return min(times)

    lines = [f"== one weight block, {units} units x {tokens} tokens: CPU s, best of {repeats}",
             "| D | rows x cols | entries | add_outer (records) | formed and scattered | formed by outer_unit_sketches |",
             "|---|---|---|---|---|---|"]
    for dim in dims:
        for rows, cols in ((128, 128), (128, 512), (512, 512), (512, 1024), (1024, 1024), (1024, 2048)):
            block = TensorBlock(0, rows, cols, dim, torch.Generator().manual_seed(0))
            buckets, signs = block.hash_and_sign()
            signed = 2 * buckets + (signs < 0)
            a, g = torch.randn(units, tokens, rows), torch.randn(units, tokens, cols)
            out = torch.zeros(units, dim)

            def formed():
                sums = out.new_zeros(units, 2 * dim).index_add_(1, signed, torch.bmm(a.transpose(1, 2), g).view(units, -1))
                out.add_(sums[:, 0::2] - sums[:, 1::2])

            lines.append(f"| {dim} | {rows} x {cols} | {power_of_two(rows * cols)} | {best(lambda: block.add_outer(a, g, out)):.4f} "
                         f"| {best(formed):.4f} | {'yes' if rows * cols <= formed_block_numel(block) else 'no'} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[1024], help="sketch dimensions D")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every variant")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (B 64 each)")
    parser.add_argument("--train-file", default=None, help="default: $CDGRAB_DATA/wikitext-2/train.txt")
    parser.add_argument("--min-numels", nargs="+", type=int, default=[STRUCTURED_MIN_NUMEL],
                        help="--sketch-min-numel values of the records variants (default: 2^20, the flag's default)")
    parser.add_argument("--variants", nargs="+", choices=KINDS, default=list(KINDS),
                        help="which kinds of variant to run (D-RR always runs: the ratios are to it)")
    parser.add_argument("--profile", action="store_true", help="profile one gradient pass per variant instead")
    parser.add_argument("--out", default=None, help="default: bench/results/sketch-gpt2-cpu.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON [flags, records, sign loop]
    args = parser.parse_args()
    data = Path(os.environ.get("CDGRAB_DATA", REPO / "data"))
    train_file = args.train_file or str(data / "wikitext-2" / "train.txt")
    if args.child:
        flags, records, sign_loop = json.loads(args.child)
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(child(flags, records, sign_loop, args.steps, train_file, tmp)), flush=True)
        return
    if args.profile:
        text = profile_chunk(args.dims, args.min_numels, train_file)
        if args.out:
            Path(args.out).write_text(text)
        print(text)
        return
    args.out = args.out or str(REPO / "bench" / "results" / "sketch-gpt2-cpu.json")
    commit = git_commit()  # the code the children run: read before anything here may change
    load_before = os.getloadavg()
    rounds = {}
    for round_ in range(args.rounds):
        for name, (flags, records, sign_loop) in variants(args.dims, args.min_numels, args.variants).items():
            command = [sys.executable, __file__, "--child", json.dumps([flags, records, sign_loop]),
                       "--steps", str(args.steps), "--train-file", train_file]
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
            line = [text for text in done.stdout.splitlines() if text.startswith("RESULT ")]
            if done.returncode or not line:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            rounds.setdefault(name, []).append(json.loads(line[-1][len("RESULT "):]))
            print(f"round {round_ + 1} {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
    import torch
    result = {"variants": summarise(rounds),
              "settings": {"script": SCRIPT, "args": ARGS, "steps_per_run": args.steps,
                           "max_train_examples": 64 * args.steps, "train_file": "wikitext-2/train.txt",
                           "rounds": args.rounds, "statistic": "median over steps (first dropped), then over rounds",
                           "peak": "ru_maxrss of a fresh process at the end of training (evaluation skipped)",
                           "process": "one (LocalCommunicator, 64 simulated workers)", "torch": torch.__version__,
                           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
                           "git_commit": commit,
                           "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}}
    write_result(args.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
