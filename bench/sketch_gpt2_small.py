"""GPT-2 small (124M) in the Hugging Face Trainer on the CPU: step time and peak memory of CD-GraB with
sketches built from the layer records (CDGraBTrainer(structured=True)) against the plain Trainer, and
exact CD-GraB (every example's whole gradient formed) beside them. Issue #31's goal: the sketched step at
<= 1.25x the plain Trainer's time and <= 1.1x its peak memory.

    OMP_NUM_THREADS=1 python bench/sketch_gpt2_small.py --dims 1024 --rounds 1 --steps 3  # every variant
    python bench/sketch_gpt2_small.py --dims 1024 4096 --rounds 2 --steps 4 \
        --out bench/results/sketch-gpt2-small-sketch-dims.json      # two sketch dimensions
    python bench/sketch_gpt2_small.py --dims 1024 --min-numels 1048576 4194304 --no-exact \
        --out bench/results/sketch-gpt2-small-threshold.json        # which weights are blocks
    python bench/sketch_gpt2_small.py --no-exact --no-sketched --rounds 2 \
        --out bench/results/sketch-gpt2-small-exact-low-memory-parts.json   # exact_low_memory's parts

bench/results/ keeps one file per measurement, named by what it measures (older runs are in git history).

The model is `GPT2Config()` (124M parameters, the 50,257-token vocabulary tied to the output layer),
randomly initialised (nothing is downloaded), dropout off, sdpa attention (no attention mask, which
torch.func traces too). Every optimizer step is 8 sequences of 128 random tokens (labels = inputs), one
process, one replica, AdamW; gradient accumulation 1. Variants, each in a FRESH child process (this
script with --child) so that its peak resident memory (getrusage ru_maxrss at the end of training) is
its own:

- "plain": `transformers.Trainer`;
- "sketched D=<D>": CDGraBTrainer(sorter="CD-GraB", sketch_dim=D, structured=True) with the default
  sketch_min_numel (2^16): every weight of 2^16 entries or more (all of GPT-2 small's but the biases and
  LayerNorms) is a TensorSketch block, never formed per example;
- "exact": CDGraBTrainer(sorter="CD-GraB") forming the (8, d) per-example gradients with torch.func
  (grad_chunk_size 1: one example's at a time, written into the (8, d) rows), a second pass;
- "exact_low_memory": CDGraBTrainer(cdgrab=CDGraBSettings(exact_low_memory=True)): the same orders from
  the products of the per-example gradients, taken layer by layer from the Trainer's own forward and
  backward (sorters/exact.py), never the (8, d) gradients. `exact_low_memory_orders_equal_exact`: whether
  its next epoch's orders equal "exact"'s after the run (one epoch of `--steps` steps), every round. The
  backward skips the weights' own gradient products (.grad is written from the streamed blocks);
  `part_cpu_seconds` splits the sorter's share of a step: "products" ((a), (b) and .grad from the
  blocks) and "update" (the running sum's update (c)), medians over the steps after the first.

Step time: wall and CPU seconds from the Trainer's step begin to its step end, the median over the steps
after the first (first-call allocations), per variant the median over the rounds; rounds are
interleaved (every variant once per round) so that a change in the machine's load hits each alike.
Single-threaded (torch.set_num_threads(--threads), default 1), CPU seconds barely move with other load.
Writes ONE JSON object to --out (and prints it), then a markdown table.

--device cuda runs every child on one CUDA GPU (the Trainer moves the model there; steps timed after a
torch.cuda.synchronize()): "peak_rss_mb" is then torch.cuda.max_memory_allocated() over training (the
process's RSS kept as "host_peak_rss_mb"), and the default --out is bench/results/sketch-gpt2-small-cuda.json.
"""
import argparse
import json
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

BATCH, BLOCK = 8, 128


def variants(dims, exact: bool, min_numels=(), low_memory: bool = True) -> dict:
    """name -> CDGraBTrainer keyword arguments (None: the plain Trainer)."""
    out = {"plain": None}
    for dim in dims:
        out[f"sketched D={dim}"] = {"sorter": "CD-GraB", "sketch_dim": dim, "structured": True}
        for min_numel in min_numels:  # other thresholds: which weights are blocks, the rest formed per example
            out[f"sketched D={dim} min_numel={min_numel}"] = {"sorter": "CD-GraB", "sketch_dim": dim,
                                                              "structured": True, "sketch_min_numel": min_numel}
    if exact:
        out["exact"] = {"sorter": "CD-GraB", "grad_chunk_size": 1, "exact_low_memory": False}  # the formed path
    if low_memory:
        out["exact_low_memory"] = {"sorter": "CD-GraB", "exact_low_memory": True}
    return out


def gpt2_and_rows(rows: int, config: dict | None = None):
    """(model, examples): GPT2LMHeadModel(GPT2Config(**config)) (default GPT-2 small), seeded random init,
    dropout off, sdpa attention; and `rows` examples {"input_ids", "labels"} of BLOCK random tokens each."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **(config or {}))
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation("sdpa")
    tokens = torch.randint(0, config.vocab_size, (rows, BLOCK), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": r, "labels": r} for r in tokens]


def step_timer(cuda: bool = False):
    """A TrainerCallback timing every optimizer step: .walls and .cpus (seconds from the step's begin to its
    end), and .parts (name -> CPU seconds per step of the functions wrapped by .timed(name, fn)). cuda: a
    torch.cuda.synchronize() before each step's clocks are read."""
    import torch
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.walls, self.cpus, self.started = [], [], None
            self.parts, self.part_cpus = {}, {}  # exact_low_memory: CPU seconds of the sorter's parts per step

        def on_step_begin(self, *_, **__):
            sync()
            self.started = (time.perf_counter(), time.process_time())
            self.part_cpus = {}

        def on_step_end(self, *_, **__):
            sync()
            self.walls.append(time.perf_counter() - self.started[0])
            self.cpus.append(time.process_time() - self.started[1])
            for name, seconds in self.part_cpus.items():
                self.parts.setdefault(name, []).append(seconds)

        def timed(self, name, fn):
            def run(*args, **kwargs):
                started = time.process_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.part_cpus[name] = self.part_cpus.get(name, 0.0) + time.process_time() - started
            return run

    return StepTimer()


def child(settings: dict | None, steps: int, threads: int, batch: int = BATCH, config: dict | None = None,
          device: str = "cpu", **training_args) -> dict:
    """`steps` optimizer steps of GPT-2 small (GPT2Config(**config) if given) in this (fresh) process, on
    BATCH * steps examples, `batch` a device (bench/exact_ddp.py: 4 under torchrun, or 2 replicas' 4 here);
    device "cuda": on the GPU, "peak_rss_mb" the CUDA peak; training_args: more TrainingArguments (ddp_backend).
    Returns the measurements."""
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from sorters.hf import CDGraBTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    model, data = gpt2_and_rows(BATCH * steps, config)
    cuda = device == "cuda"
    timer = step_timer(cuda)
    if settings is not None and settings.get("exact_low_memory"):
        from sorters.exact import UnitGradients
        # products (a), (b) and the weight gradient from the blocks; the running sum's update (c)
        UnitGradients.products = timer.timed("products", UnitGradients.products)
        UnitGradients.add_to = timer.timed("update", UnitGradients.add_to)
    with tempfile.TemporaryDirectory() as out:
        if not cuda:
            training_args["use_cpu"] = True  # on cuda the Trainer moves the model to the GPU
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, num_train_epochs=1,
                                 learning_rate=1e-4, seed=0, report_to=[], disable_tqdm=True, logging_strategy="no",
                                 save_strategy="no", dataloader_drop_last=True, **training_args)
        if settings is None:
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
        else:
            trainer = CDGraBTrainer(model=model, args=args, train_dataset=data, callbacks=[timer], **settings)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    d = sum(p.numel() for p in model.parameters())
    result = {"steps": len(timer.walls), "peak_rss_mb": peak_kb / 1024,
              "step_seconds": statistics.median(timer.walls[1:]), "step_cpu_seconds": statistics.median(timer.cpus[1:]),
              "d": d}
    if cuda:  # the summary's peak is the GPU's; the host's kept beside it
        result.update(peak_rss_mb=torch.cuda.max_memory_allocated() / 2**20, host_peak_rss_mb=peak_kb / 1024)
    if settings is not None and settings.get("sorter") == "CD-GraB" and not settings.get("sketch_dim"):
        sorter = trainer.cdgrab_sampler.sorter  # one epoch done: the orders it chose for the next
        result["next_orders"] = sorter.next_orders.tolist()
        if settings.get("exact_low_memory"):
            result["near_ties"] = sorter.near_ties
            how = trainer.cdgrab_grads.last_how
            result["products_by"] = {kind: sum(1 for v in how.values() if v == kind) for kind in ("stream", "ghost")}
            result["part_cpu_seconds"] = {name: statistics.median(values[1:]) for name, values in timer.parts.items()}
    if settings is not None and settings.get("structured"):
        sketcher = trainer.cdgrab_grads
        result.update(blocks=len(sketcher.sketch.blocks), formed_per_example=sketcher.formed,
                      numel_outside_blocks=sketcher._rest_numel, min_numel=settings.get("sketch_min_numel", 2**16))
    return result


def summarise(rounds: dict) -> dict:
    def median(name, key):
        return statistics.median(r[key] for r in rounds[name])

    base = {key: median("plain", key) for key in ("peak_rss_mb", "step_seconds", "step_cpu_seconds")}
    return {name: {"peak_rss_mb": round(median(name, "peak_rss_mb"), 1),
                   "peak_vs_plain": round(median(name, "peak_rss_mb") / base["peak_rss_mb"], 3),
                   "step_seconds": round(median(name, "step_seconds"), 3),
                   "step_vs_plain": round(median(name, "step_seconds") / base["step_seconds"], 3),
                   "step_cpu_seconds": round(median(name, "step_cpu_seconds"), 3),
                   "step_cpu_vs_plain": round(median(name, "step_cpu_seconds") / base["step_cpu_seconds"], 3),
                   "rounds": rounds[name]} for name in rounds}


def headline(summary: dict, dims: list) -> dict:
    """The issue's figures: "sketched" is the first of --dims (the D the docs recommend for GPT-2),
    every D's in "sketched_by_dim"; "exact" None when it was left out."""
    def pick(key, scale=1.0, digits=3):
        value = {name: round(m[key] * scale, digits) for name, m in summary.items()}
        return {"plain": value["plain"], "sketched": value.get(f"sketched D={dims[0]}"),
                "sketched_by_dim": {str(dim): value.get(f"sketched D={dim}") for dim in dims},
                "exact": value.get("exact"), "exact_low_memory": value.get("exact_low_memory")}

    equal = None
    if "exact" in summary and "exact_low_memory" in summary:
        equal = all(a["next_orders"] == b["next_orders"] for a, b in
                    zip(summary["exact"]["rounds"], summary["exact_low_memory"]["rounds"]))
    return {"sketch_dim": dims[0], "exact_low_memory_orders_equal_exact": equal, "step_seconds": pick("step_seconds"),
            "step_cpu_seconds": pick("step_cpu_seconds"), "peak_memory_gib": pick("peak_rss_mb", 1 / 1024)}


def markdown(result: dict) -> str:
    lines = ["| variant | peak RSS (MB) | vs plain | step s (wall) | vs plain | step s (CPU) | vs plain |",
             "|---|---|---|---|---|---|---|"]
    for name, m in result["variants"].items():
        lines.append(f"| {name} | {m['peak_rss_mb']:.0f} | {m['peak_vs_plain']:.2f} | {m['step_seconds']:.2f} | "
                     f"{m['step_vs_plain']:.2f} | {m['step_cpu_seconds']:.2f} | {m['step_cpu_vs_plain']:.2f} |")
    return "\n".join(lines)


def run_rounds(args) -> tuple[dict, dict]:
    """Every variant in a fresh child, round by round: ({name: [its children's results]}, {name: the end of
    its stderr}). A variant that fails is left out from then on and reported, and the others are still
    measured, so that one variant's failure does not cost a GPU call's other measurements."""
    rounds, failed = {}, {}
    for round_ in range(args.rounds):
        chosen = variants(args.dims, not args.no_exact, args.min_numels, not args.no_low_memory)
        if args.no_sketched:
            chosen = {name: s for name, s in chosen.items() if not name.startswith("sketched")}
        for name, settings in chosen.items():
            if name in failed:
                continue
            command = [sys.executable, __file__, "--child", json.dumps(settings), "--steps", str(args.steps),
                       "--threads", str(args.threads), "--device", args.device]
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
            line = [text for text in done.stdout.splitlines() if text.startswith("RESULT ")]
            if done.returncode or not line:
                failed[name] = done.stderr[-3000:]
                rounds.pop(name, None)  # no variant is summarised over fewer rounds than the others
                print(f"{name} failed:\n{failed[name]}", file=sys.stderr, flush=True)
                continue
            rounds.setdefault(name, []).append(json.loads(line[-1][len("RESULT "):]))
            print(f"round {round_ + 1} {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
    return rounds, failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[4096], help="sketch dimensions D")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every variant")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    parser.add_argument("--no-exact", action="store_true", help="leave out exact CD-GraB (its (8, d) gradients: 4 GB)")
    parser.add_argument("--no-low-memory", action="store_true",
                        help="leave out exact CD-GraB from layer records (CDGraBSettings(exact_low_memory=True))")
    parser.add_argument("--no-sketched", action="store_true", help="leave out the sketched variants (--dims)")
    parser.add_argument("--min-numels", nargs="+", type=int, default=[],
                        help="also run the sketched variants with these sketch_min_numel (default only 2^16)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every child on one GPU, peak = torch.cuda.max_memory_allocated()")
    parser.add_argument("--out", default=None,
                        help="default bench/results/sketch-gpt2-small.json (-cuda.json with --device cuda)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON settings of one variant
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be >= 2 (the first is not timed) and --rounds >= 1")
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child), args.steps, args.threads, device=args.device)),
              flush=True)
        return
    suffix = "-cuda" if args.device == "cuda" else ""
    args.out = args.out or str(REPO / "bench" / "results" / f"sketch-gpt2-small{suffix}.json")
    from engine.runlog import git_commit, write_result

    commit = git_commit()  # when the run starts: the code the children import ("-dirty" if it differs)
    load_before = os.getloadavg()
    rounds, failed = run_rounds(args)
    if "plain" not in rounds:
        sys.exit(f"plain failed:\n{failed['plain']}")
    import torch
    summary = summarise(rounds)
    result = {"git_commit": commit, **headline(summary, args.dims), "variants": summary,
        **({"failed": failed} if failed else {}),
        **({"device": torch.cuda.get_device_name(), "device_flag": "cuda"} if args.device == "cuda" else {}),
        "settings": {"model": "GPT2Config() (124M), random init, sdpa, dropout 0", "batch": BATCH, "block": BLOCK,
                     "steps_per_run": args.steps, "rounds": args.rounds, "threads": args.threads,
                     "statistic": "median over steps (first dropped), then over rounds",
                     "peak": ("torch.cuda.max_memory_allocated() over training (host RSS: host_peak_rss_mb)"
                              if args.device == "cuda" else "ru_maxrss of a fresh process at the end of training"),
                     "torch": torch.__version__,
                     "cpu_count": os.cpu_count(),
                     "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
    }
    write_result(args.out, result)
    print(markdown(result))
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their errors are under \"failed\" in {args.out})")


if __name__ == "__main__":
    main()
