"""What CDGraBTrainer (sorters/hf.py) costs over a plain transformers Trainer, measured in one run.

    OMP_NUM_THREADS=2 python bench/hf_trainer_overhead.py [--steps 12] [--rounds 3] [--out FILE]

One process, the CPU, the GPT2-Wiki103 benchmark's tiny GPT-2 (models/gpt2.py: 2 layers of width 128,
the full 50,257-token vocabulary) on the same random token blocks (8 blocks of 64 tokens per step). Every
variant trains the same number of optimizer steps from the same initial weights:

- "plain": `transformers.Trainer`, its own random sampler;
- "D-RR": CDGraBTrainer with a sorter that ignores gradients: the sampler's bookkeeping alone;
- "CD-GraB (blocks)": CD-GraB balancing the transformer blocks' per-example gradients (d = 396,544; the
  default of examples/hf_trainer_gpt2.py);
- "CD-GraB (all)": every parameter's (d = 6,846,080, most of it the tied embedding matrix);
- "CD-GraB (all, sketch 4096)": the same, balanced as 4,096-dimensional sketches;
- "CD-GraB (all, structured sketch 4096)": the same sketches' size, built from the Trainer's own backward
  layer by layer (structured=True): no per-example pass.

Each variant's time is the median over its steps after the first two (warm-up) of the wall time from
the Trainer's step begin to its step end, taken in the round with the median; rounds are interleaved
(every variant once per round) so that a slow spell of the machine hits all of them. Prints one JSON object
(and writes it to --out).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from engine.runlog import head_commit  # noqa: E402
from models.gpt2 import build_gpt2  # noqa: E402
from sorters.hf import CDGraBTrainer  # noqa: E402

BATCH, BLOCK = 8, 64
VARIANTS = {  # name -> (trainer class, its extra keyword arguments)
    "plain": (Trainer, {}),
    "D-RR": (CDGraBTrainer, {"sorter": "D-RR"}),
    "CD-GraB (blocks)": (CDGraBTrainer, {"grad_params": r"\.h\.\d+\."}),
    "CD-GraB (all)": (CDGraBTrainer, {}),
    "CD-GraB (all, sketch 4096)": (CDGraBTrainer, {"sketch_dim": 4096}),
    "CD-GraB (all, structured sketch 4096)": (CDGraBTrainer, {"sketch_dim": 4096, "structured": True}),
}


class StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step (forward, backward, the sampler's work, optimizer)."""

    def __init__(self):
        self.seconds, self.started = [], None

    def on_step_begin(self, *_, **__):
        self.started = time.perf_counter()

    def on_step_end(self, *_, **__):
        self.seconds.append(time.perf_counter() - self.started)


def seconds_per_step(variant: str, steps: int, data: list[dict], out: str) -> float:
    cls, extra = VARIANTS[variant]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=BATCH, max_steps=steps,
                             dataloader_drop_last=True, report_to=[], disable_tqdm=True, logging_strategy="no",
                             save_strategy="no", seed=0)
    timer = StepTimer()
    trainer = cls(model=build_gpt2(n_positions=BLOCK), args=args, train_dataset=data, callbacks=[timer], **extra)
    trainer.train()
    return statistics.median(timer.seconds[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant per round (first 2 not timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "hf-trainer-overhead-cpu.json"))
    args = parser.parse_args()
    if args.steps < 3 or args.rounds < 1:
        parser.error("need --steps >= 3 (two warm-up steps) and --rounds >= 1")
    hf_logging.set_verbosity_error()
    blocks = torch.randint(0, 50257, (BATCH * args.steps, BLOCK), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in blocks]
    rounds = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant in VARIANTS:
                rounds[variant].append(seconds_per_step(variant, args.steps, data, tmp))
    median = {variant: statistics.median(times) for variant, times in rounds.items()}
    commit = head_commit(short=True)  # "unknown commit" without a git checkout
    result = {
        "git_commit": commit, "device": "cpu", "torch_threads": torch.get_num_threads(),
        "setting": f"tiny GPT-2 (models/gpt2.py), {BATCH} blocks of {BLOCK} tokens per step, one process, "
                   f"{args.steps} steps x {args.rounds} rounds",
        "step_seconds": {variant: round(seconds, 4) for variant, seconds in median.items()},
        "over_plain": {variant: round(seconds / median["plain"], 3) for variant, seconds in median.items()},
        "rounds_seconds": {variant: [round(s, 4) for s in times] for variant, times in rounds.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
