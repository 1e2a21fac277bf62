"""GPT-2 small in the Hugging Face Trainer UNDER TORCHRUN on the CPU: 2 gloo processes, one DDP replica each.
Step time, peak memory and the bytes each process all-gathers per step, of the plain Trainer, CD-GraB from
D = 1024 sketches of the layer records, and exact CD-GraB from the layer records (exact_low_memory).

    OMP_NUM_THREADS=1 python bench/exact_ddp.py --rounds 3     # bench/results/exact-ddp-gpt2-small-cpu.json
    python bench/exact_ddp.py --small-config --steps 2 --out /tmp/ddp.json      # a quick smoke run

The model, data and measurements are bench/sketch_gpt2_small.py's (its child() runs in every process):
GPT2Config() (124M) randomly initialised, dropout off, sdpa; every optimizer step is 8 sequences of 128
random tokens, here 4 a process (per_device_train_batch_size 4), AdamW, gradient accumulation 1. Each
variant is a fresh `python -m torch.distributed.run --standalone --nproc_per_node 2` of this script's
child mode (torch.set_num_threads(--threads) a process); the Trainer wraps the model in DDP over gloo:

- "plain": `transformers.Trainer`;
- "sketched D=<D>": CDGraBTrainer(sorter="CD-GraB", sketch_dim=D, structured=True): each process sketches
  its 4 examples from its own layer records and all-gathers the (4, D) sketches (sorters/gather.py);
- "exact_low_memory": CDGraBTrainer(sorter="CD-GraB", exact_low_memory=True): each process all-gathers its
  4 examples' layer records (`all_gather_units`: per parameter its records or its per-example gradient,
  whichever is smaller), so every process holds all 8 examples' records; each takes the products and the
  running sum's update of its share of the parameters (sorters.gather.ParameterShare) and the per-parameter
  products are summed over the processes; its backward keeps the weights' gradient products for DDP's
  all-reduce (sorters/hf.py, training_step);
- "exact" (only with --exact): the (4, d) per-example gradients formed with torch.func and all-gathered
  ((8, d) float32 a process: 8 x 124M x 4 bytes at GPT-2 small);
- "exact_low_memory, 1 process x 2 replicas" (unless --no-one-process): the same Trainer WITHOUT torchrun,
  num_replicas=2 (one process, micro-batch 8): the reference for the orders.
  `exact_low_memory_orders_equal_one_process`: whether every rank's next-epoch orders equal that
  process's, every round.

Per process: the median over the steps after the first of the wall and CPU seconds from the Trainer's
step begin to its step end, ru_maxrss at the end of training, and per step the bytes it hands to the
sorter's gathers (`gathered_bytes_per_step`: counted in sorters.gather's all-gather and gather-to-owner,
so the sorter's exchange only), the bytes other processes send it there (`received_bytes_per_step`), and
`records_bytes_per_step`: sorters.gather.records_bytes of the units it hands over. Per round a variant
counts its slowest rank's step and its largest peak (every rank's own numbers are kept); per variant the
median over the interleaved rounds. DDP's all-reduce of .grad (d floats, every variant alike) is not
counted. Writes ONE JSON object to --out (and prints it), then a markdown table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # run from anywhere; the one-process bench's pieces

import sketch_gpt2_small as one  # noqa: E402

WORLD = 2  # processes, one replica each
PER_PROCESS = one.BATCH // WORLD  # sequences a process per step: 8 an optimizer step in all, as one.BATCH
SMALL = {"n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 1000}  # --small-config
ONE_PROCESS = f"exact_low_memory, 1 process x {WORLD} replicas"


def variants(dim: int, exact: bool, one_process: bool) -> dict:
    """name -> (CDGraBTrainer keyword arguments or None for the plain Trainer, processes)."""
    out = {name: (settings, WORLD) for name, settings in one.variants([dim], exact).items()}
    if one_process:
        out[ONE_PROCESS] = ({**out["exact_low_memory"][0], "num_replicas": WORLD}, 1)
    return out


def rank_child(settings: dict | None, steps: int, threads: int, config: dict | None, folder: Path) -> None:
    """One process of a variant (a torchrun rank, or the one process): one.child() with 4 sequences a
    replica, counting what the sorter all-gathers; writes its measurements to folder/rank<R>.json."""
    import torch.distributed as torch_distributed

    import sorters.gather as gather
    import sorters.sampler as sampler

    counted = {"gathered": 0, "records": 0, "received": 0}
    all_gather, all_to_all, all_gather_units = gather._all_gather_single, gather._all_to_all, sampler.all_gather_units

    def gather_counted(out, local):  # every all-gather of sorters/gather.py: sketches, records, their sizes
        counted["gathered"] += local.numel() * local.element_size()
        counted["received"] += out.numel() * out.element_size() - local.numel() * local.element_size()
        return all_gather(out, local)

    def all_to_all_counted(out, send, send_sizes, receive_sizes, works=None):  # records to their owners only
        # (a ParameterShare: each parameter's records to the process owning it)
        counted["gathered"] += send.numel() * send.element_size()
        counted["received"] += (sum(receive_sizes) - receive_sizes[torch_distributed.get_rank()]) * out.element_size()
        return all_to_all(out, send, send_sizes, receive_sizes, works)

    def units_counted(units, share=None):
        counted["records"] += gather.records_bytes([units])
        return all_gather_units(units, share)

    gather._all_gather_single, gather._all_to_all, sampler.all_gather_units = gather_counted, all_to_all_counted, \
        units_counted
    distributed = "LOCAL_RANK" in os.environ
    ddp = {"ddp_backend": "gloo"} if distributed else {}
    result = one.child(settings, steps, threads, PER_PROCESS, config, **ddp)
    if distributed:
        import torch.distributed as dist
        dist.destroy_process_group()
    rank = int(os.environ.get("RANK", 0))
    result.update(rank=rank, gathered_bytes_per_step=counted["gathered"] / result["steps"],
                  records_bytes_per_step=counted["records"] / result["steps"],
                  received_bytes_per_step=counted["received"] / result["steps"])
    (folder / f"rank{rank}.json").write_text(json.dumps(result))


def run_variant(name: str, settings: dict | None, processes: int, args) -> list[dict]:
    """Every process's measurements of one run of a variant, rank 0's first; exits with the child's error."""
    with tempfile.TemporaryDirectory() as folder:
        child = [__file__, "--child", json.dumps(settings), "--child-out", folder, "--steps", str(args.steps),
                 "--threads", str(args.threads)] + (["--small-config"] if args.small_config else [])
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] * (processes > 1)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run([sys.executable, *launch, *child], capture_output=True, text=True, cwd=REPO, env=env)
        files = [Path(folder) / f"rank{rank}.json" for rank in range(processes)]
        if done.returncode or not all(f.is_file() for f in files):
            sys.exit(f"{name} failed:\n{(done.stderr + done.stdout)[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def over_ranks(ranks: list[dict]) -> dict:
    """One run of a variant: its slowest rank's step (the others wait for it at DDP's all-reduce), its
    largest peak and bytes; every rank's own numbers in "ranks"."""
    keys = ("peak_rss_mb", "step_seconds", "step_cpu_seconds", "gathered_bytes_per_step", "records_bytes_per_step",
            "received_bytes_per_step")
    return {**{key: max(r[key] for r in ranks) for key in keys}, "ranks": ranks}


def orders_equal_one_process(rounds: dict) -> bool | None:
    """Whether every rank of every exact_low_memory run ends with the next-epoch orders of the one process
    hosting both replicas in the same round; None when either was left out."""
    if "exact_low_memory" not in rounds or ONE_PROCESS not in rounds:
        return None
    return all(rank["next_orders"] == alone["ranks"][0]["next_orders"]
               for ddp, alone in zip(rounds["exact_low_memory"], rounds[ONE_PROCESS]) for rank in ddp["ranks"])


def summarise(rounds: dict) -> dict:
    """one.summarise (medians over rounds, ratios to plain) plus the bytes a process all-gathers per step."""
    summary = one.summarise(rounds)
    for name, entry in summary.items():
        for key in ("gathered_bytes_per_step", "records_bytes_per_step", "received_bytes_per_step"):
            entry[key] = statistics.median(r[key] for r in rounds[name])
    return summary


def markdown(result: dict) -> str:
    lines = ["| variant | processes | step s (wall) | vs plain | step s (CPU) | vs plain | peak RSS (MB) | vs plain "
             "| gathered MB / step | received MB / step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["variants"].items():
        lines.append(f"| {name} | {result['processes'][name]} | {m['step_seconds']:.2f} | {m['step_vs_plain']:.2f} | "
                     f"{m['step_cpu_seconds']:.2f} | {m['step_cpu_vs_plain']:.2f} | {m['peak_rss_mb']:.0f} | "
                     f"{m['peak_vs_plain']:.2f} | {m['gathered_bytes_per_step'] / 1e6:.4g} | "
                     f"{m['received_bytes_per_step'] / 1e6:.4g} |")
    return "\n".join(lines)


def measure(args) -> dict:
    """Every variant once per round, interleaved; the result object (without the commit)."""
    import torch
    load_before = os.getloadavg()
    chosen = variants(args.dim, args.exact, not args.no_one_process)
    rounds = {}
    for round_ in range(args.rounds):
        for name, (settings, processes) in chosen.items():
            rounds.setdefault(name, []).append(over_ranks(run_variant(name, settings, processes, args)))
            print(f"round {round_ + 1} {name}: {json.dumps(rounds[name][-1])[:400]}", file=sys.stderr, flush=True)
    summary = summarise(rounds)
    d = summary["plain"]["rounds"][0]["ranks"][0]["d"]
    return {"sketch_dim": args.dim, "exact_low_memory_orders_equal_one_process": orders_equal_one_process(rounds),
            "processes": {name: processes for name, (_, processes) in chosen.items()}, "variants": summary,
            "settings": {"model": f"GPT2Config({SMALL if args.small_config else ''}), random init, sdpa, dropout 0",
                         "d": d, "launch": f"torch.distributed.run --standalone --nproc_per_node {WORLD}, gloo, DDP",
                         "batch_per_process": PER_PROCESS, "batch_per_step": one.BATCH, "block": one.BLOCK,
                         "steps_per_run": args.steps, "rounds": args.rounds, "threads_per_process": args.threads,
                         "statistic": "per rank the median over steps (first dropped); per run the max over ranks; "
                                      "then the median over rounds",
                         "peak": "ru_maxrss of each fresh process at the end of training",
                         "not_counted": f"DDP's all-reduce of .grad, {d * 4} bytes a step in every variant",
                         "torch": torch.__version__, "cpu_count": os.cpu_count(),
                         "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024, help="sketch dimension D of the sketched variant")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of every variant")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--exact", action="store_true", help="also the formed per-example gradients ((8, d) a process)")
    parser.add_argument("--no-one-process", action="store_true",
                        help="leave out exact_low_memory in one process hosting both replicas (the orders' reference)")
    parser.add_argument("--small-config", action="store_true", help=f"GPT2Config(**{SMALL}) instead of GPT-2 small")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "exact-ddp-gpt2-small-cpu.json"),
                        help="the JSON file to write")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON settings of one variant
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)  # the folder its ranks write to
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1 or args.threads < 1 or args.dim < 1:
        parser.error("--steps must be >= 2 (the first is not timed), --rounds, --threads and --dim >= 1")
    if args.child:
        rank_child(json.loads(args.child), args.steps, args.threads, SMALL if args.small_config else None,
                   Path(args.child_out))
        return
    if Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a folder; give the JSON file's path")
    from engine.runlog import git_commit, write_result

    commit = git_commit()  # when the run starts: the code the children import ("-dirty" if it differs)
    result = {"git_commit": commit, **measure(args)}
    write_result(args.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
