"""The Hugging Face Trainer with CD-GraB example ordering: a tiny GPT-2 on WikiText-103 blocks.

    python examples/hf_trainer_gpt2.py                                           # one process
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer_gpt2.py          # two gloo processes
    python examples/hf_trainer_gpt2.py --replicas 2                               # both replicas in one process

An ordinary transformers Trainer script; the one change is `CDGraBTrainer` (sorters/hf.py) in place of
`Trainer`, with `dataloader_drop_last=True` (every replica a whole number of batches). The model is the
GPT2-Wiki103 benchmark's tiny GPT-2 (models/gpt2.py, built from a config: nothing is downloaded), the
data the first --max-train-examples blocks of --block-size GPT-2 tokens of WikiText-103's validation
split, evaluated on blocks of its test split (data/wikitext103.py: the tokenizer is read from the data
folder). The sorter balances the gradients of the transformer blocks' parameters (--grad-params; the
tied embedding matrix holds most of the model and would cost most of the time). The two-process run and
the --replicas 2 run give the same orders and, to rounding, the same losses.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `sorters` and `data`
from examples._common import (OneLineErrorParser, default_data_dir, exit_with_error, load_or_exit,  # noqa: E402
                              settings_or_exit)
from sorters import SORTER_NAMES, CDGraBSettings  # noqa: E402

try:
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from data.wikitext103 import load_blocks
    from models.gpt2 import build_gpt2
    from sorters.hf import CDGraBTrainer
except ImportError as error:  # transformers is an optional dependency of the package
    exit_with_error(str(error))

parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])  # argparse's, with one-line errors
parser.add_argument("--data-dir", default=default_data_dir(),
                    help="folder holding wikitext-103/ and gpt2-tokenizer/ (default $CDGRAB_DATA)")
parser.add_argument("--out", default="results/hf_trainer_gpt2", help="the Trainer's output_dir (checkpoints)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--max-train-examples", type=int, default=256, help="train on the first N blocks only")
parser.add_argument("--block-size", type=int, default=32, help="tokens per example")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--batch-size", type=int, default=8, help="examples per replica per micro-batch")
parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument("--replicas", type=int, default=None, help="replicas hosted in one process (not under torchrun)")
parser.add_argument("--grad-params", default=r"\.h\.\d+\.",
                    help="regular expression: the parameters whose per-example gradients are balanced")
parser.add_argument("--sketch-dim", type=int, default=0, help="balance D-dimensional sketches (0: the gradients)")
parser.add_argument("--structured", action="store_true",
                    help="with --sketch-dim: build the sketches from the Trainer's own backward, layer by layer "
                         "(no per-example pass; docs/sketching.md)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--save-steps", type=int, default=0, help="write checkpoint-N/ every N optimizer steps (0: never)")
parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint-N/ in --out")
parser.add_argument("--save-orders", default=None,
                    help="write every epoch's orders and the per-step losses here (torch.save); each process "
                         "also writes its sampler's state to <file>.rank<r>")
parser.add_argument("--progress", choices=("on", "off"), default="on", help="the Trainer's progress bar")
args = parser.parse_args()
if args.replicas is not None and args.replicas < 1:
    exit_with_error(f"--replicas must be at least 1, got {args.replicas}")
# the sorter's settings, checked before any data is loaded: bad ones are one line and nothing else
cdgrab = settings_or_exit(CDGraBSettings, sorter=args.sorter, seed=args.seed, grad_params=args.grad_params,
                          sketch_dim=args.sketch_dim, structured=args.structured, num_replicas=args.replicas)

hf_logging.set_verbosity_error()  # the Trainer's info lines; the example prints its own
training_args = TrainingArguments(
    output_dir=args.out, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, seed=args.seed,
    dataloader_drop_last=True,  # each replica a whole number of batches: the tail of the data is not used
    use_cpu=True, report_to=[], disable_tqdm=args.progress == "off", logging_steps=1, eval_strategy="epoch",
    ddp_find_unused_parameters=False,  # every parameter gets a gradient (DDP would search the graph each step)
    save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
    per_device_eval_batch_size=32)
with training_args.main_process_first():  # one process tokenizes (and caches), the others read the cache
    train_blocks = load_or_exit(load_blocks, args.data_dir, "valid", args.block_size)[:args.max_train_examples]
    eval_blocks = load_or_exit(load_blocks, args.data_dir, "test", args.block_size)[:64]


def as_examples(blocks: torch.Tensor) -> list[dict]:
    """(N, T) token ids -> N examples a causal LM trains on: its labels are its input ids (the model shifts)."""
    return [{"input_ids": row, "labels": row} for row in blocks]


torch.manual_seed(args.seed)  # the same initial model in every process
model = build_gpt2(n_positions=args.block_size)
try:
    trainer = CDGraBTrainer(model=model, args=training_args, train_dataset=as_examples(train_blocks),
                            eval_dataset=as_examples(eval_blocks), cdgrab=cdgrab)
except ValueError as error:  # what the Trainer's own arguments refuse
    exit_with_error(str(error))


class EpochOrders(TrainerCallback):
    """Every epoch's orders (replicas, m), read from the sampler when the epoch ends."""

    def __init__(self):
        self.orders = []

    def on_epoch_end(self, *_, **__):
        self.orders.append(trainer.cdgrab_sampler.all_indices())


orders = EpochOrders()
trainer.add_callback(orders)


class ProgressBar(ProgressCallback):
    """The Trainer's bar without its line per log (a log per step, for the losses --save-orders writes)."""

    def on_log(self, *_, **__):
        pass


trainer.remove_callback(PrinterCallback)
trainer.remove_callback(ProgressCallback)
if args.progress == "on":
    trainer.add_callback(ProgressBar())
world = training_args.world_size
if training_args.process_index == 0:
    where = f"{world} processes" if world > 1 else f"{args.replicas or 1} replica(s) in one process"
    print(f"{args.sorter}: {len(train_blocks)} blocks of {args.block_size} tokens, batch {args.batch_size} per "
          f"replica, {where}", flush=True)
try:
    trainer.train(resume_from_checkpoint=True if args.resume else None)
except ValueError as error:  # settings the trainer refuses (one line), before the first step
    exit_with_error(str(error))

history = trainer.state.log_history
if training_args.process_index == 0:
    for entry in history:
        if "eval_loss" in entry:
            print(f"epoch {entry['epoch']:.0f}/{args.epochs} | eval loss {entry['eval_loss']:.4f} | "
                  f"perplexity {torch.tensor(entry['eval_loss']).exp():.1f}", flush=True)
if args.save_orders:
    if training_args.process_index == 0:
        torch.save({"orders": orders.orders, "losses": [e["loss"] for e in history if "loss" in e]}, args.save_orders)
    torch.save(trainer.cdgrab_sampler.state_dict(), f"{args.save_orders}.rank{training_args.process_index}")
