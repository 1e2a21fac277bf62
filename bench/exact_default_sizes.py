"""Is exact_low_memory the right default for CD-GraB at small sizes too? Step time of CDGraBTrainer with the
formed per-example gradients (exact_low_memory=False: torch.func, a second pass) against the layer records
(exact_low_memory=True), beside the plain Trainer, for GPT-2s far smaller than GPT-2 small
(bench/sketch_gpt2_small.py measures that one).

    OMP_NUM_THREADS=1 python bench/exact_default_sizes.py --out bench/results/exact-default-sizes.json

Sizes: "tests" is tests/hf_trainer_tiny.py's GPT-2 (1 layer, width 16, vocabulary 64, 8 tokens);
"mini" 2 layers of width 64, vocabulary 1,024, 32 tokens; "small-ish" 4 layers of width 256, vocabulary
8,192, 64 tokens. Random init, dropout off, eager attention, 8 sequences a step, one process, one
replica, AdamW, one thread. Each variant trains --steps steps in this process, rounds interleaved
(plain, formed, records, plain, ...) so that a change in the machine's load hits each alike; step
seconds (wall and CPU) are the median over the steps after the first of every round. Also whether the two
CD-GraB variants' next orders agree after the run (one epoch). Writes ONE JSON object to --out (with the
commit it ran), then prints a markdown table.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

BATCH = 8
SIZES = {  # name -> (n_layer, n_embd, n_head, vocab_size, tokens)
    "tests": (1, 16, 2, 64, 8),
    "mini": (2, 64, 4, 1024, 32),
    "small-ish": (4, 256, 4, 8192, 64),
}
VARIANTS = {"plain": None, "formed": False, "exact_low_memory": True}  # name -> exact_low_memory (None: plain)


def train(size: str, exact: bool | None, steps: int) -> dict:
    """`steps` optimizer steps of the `size` GPT-2; step wall and CPU seconds, and CD-GraB's next orders."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from sorters import CDGraBSettings
    from sorters.hf import CDGraBTrainer

    n_layer, n_embd, n_head, vocab, tokens = SIZES[size]
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=tokens, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation("eager")
    rows = torch.randint(0, vocab, (BATCH * steps, tokens), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in rows]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.walls, self.cpus, self.started = [], [], None

        def on_step_begin(self, *_, **__):
            self.started = (time.perf_counter(), time.process_time())

        def on_step_end(self, *_, **__):
            self.walls.append(time.perf_counter() - self.started[0])
            self.cpus.append(time.process_time() - self.started[1])

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=BATCH, num_train_epochs=1,
                                 learning_rate=1e-3, seed=0, report_to=[], disable_tqdm=True, logging_strategy="no",
                                 save_strategy="no", dataloader_drop_last=True)
        if exact is None:
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
        else:
            trainer = CDGraBTrainer(model=model, args=args, train_dataset=data, callbacks=[timer],
                                    cdgrab=CDGraBSettings(exact_low_memory=exact))
        trainer.train()
    result = {"walls": timer.walls[1:], "cpus": timer.cpus[1:], "d": sum(p.numel() for p in model.parameters())}
    if exact is not None:
        result["next_orders"] = trainer.cdgrab_sampler.sorter.next_orders.tolist()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="which GPT-2 sizes")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every variant")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "exact-default-sizes.json"))
    args = parser.parse_args()
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    from engine.runlog import git_commit, write_result
    torch.set_num_threads(1)
    result = {"bench": "exact_default_sizes", "git_commit": git_commit(), "threads": 1, "batch": BATCH,
              "steps": args.steps,
              "rounds": args.rounds, "sizes": {}}
    for size in args.sizes:
        runs = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, exact in VARIANTS.items():
                runs[name].append(train(size, exact, args.steps))
        entry = {"config": dict(zip(("n_layer", "n_embd", "n_head", "vocab_size", "tokens"), SIZES[size])),
                 "d": runs["plain"][0]["d"], "step_seconds": {}, "step_cpu_seconds": {}}
        for name, rounds in runs.items():
            entry["step_seconds"][name] = statistics.median(w for r in rounds for w in r["walls"])
            entry["step_cpu_seconds"][name] = statistics.median(c for r in rounds for c in r["cpus"])
        cpu = entry["step_cpu_seconds"]
        entry["cpu_vs_plain"] = {name: cpu[name] / cpu["plain"] for name in VARIANTS}
        entry["exact_low_memory_vs_formed_cpu"] = cpu["exact_low_memory"] / cpu["formed"]
        entry["orders_equal"] = all(a["next_orders"] == b["next_orders"]
                                    for a, b in zip(runs["formed"], runs["exact_low_memory"]))
        result["sizes"][size] = entry
        print(size, json.dumps(entry), flush=True)
    write_result(args.out, result)
    print("| size | d | plain s | formed s | exact_low_memory s | formed / plain | exact_low_memory / plain | "
          "exact_low_memory / formed | orders equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, e in result["sizes"].items():
        c = e["step_cpu_seconds"]
        print(f"| {size} | {e['d']:,} | {c['plain']:.4f} | {c['formed']:.4f} | {c['exact_low_memory']:.4f} | "
              f"{e['cpu_vs_plain']['formed']:.2f} | {e['cpu_vs_plain']['exact_low_memory']:.2f} | "
              f"{e['exact_low_memory_vs_formed_cpu']:.2f} | {e['orders_equal']} |")


if __name__ == "__main__":
    main()
