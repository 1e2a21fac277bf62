"""The Hugging Face Trainer with CD-GraB example ordering: a tiny GPT-2 (built from a config, nothing is
downloaded) learning synthetic token sequences, on the CPU.

    python hf_trainer.py                                         # one process
    torchrun --standalone --nproc_per_node=2 hf_trainer.py       # two processes (the Trainer's DDP, gloo)

Needs torch, transformers and accelerate, and the installed package (`pip install "cdgrab-sorters[hf]"`).
The one change to an ordinary Trainer script is `CDGraBTrainer` in place of `Trainer`, with
`dataloader_drop_last=True` (every replica a whole number of batches). By default a causal LM's exact
CD-GraB takes its gradients' inner products from the records of the Trainer's own forward and backward.
"""
import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from sorters import SORTER_NAMES, CDGraBSettings
from sorters.hf import CDGraBTrainer


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, without argparse's usage block
        self.exit(2, f"{self.prog}: {message}\n")


parser = Parser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--examples", type=int, default=64, help="synthetic sequences to train on")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
try:  # checked before anything is built: a bad setting is one line
    cdgrab = CDGraBSettings(sorter=args.sorter, seed=args.seed)
except ValueError as error:
    parser.error(str(error))

# sequences of 16 tokens counting up from a random start (mod 64): a pattern the model can learn
torch.manual_seed(args.seed)
starts = torch.randint(0, 64, (args.examples, 1))
sequences = (starts + torch.arange(16)) % 64             # (N, 16) token ids
train_set = [{"input_ids": row, "labels": row} for row in sequences]  # a causal LM's labels are its inputs

# dropout 0: the per-example gradients CD-GraB balances are then those of the step's own (deterministic) model
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)

hf_logging.set_verbosity_error()  # the Trainer's info lines; the example prints its own
with tempfile.TemporaryDirectory() as out:
    training_args = TrainingArguments(
        output_dir=out, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3, seed=args.seed, dataloader_drop_last=True, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="epoch", disable_tqdm=True)
    trainer = CDGraBTrainer(model=model, args=training_args, train_dataset=train_set, cdgrab=cdgrab)
    trainer.remove_callback(PrinterCallback)  # its line per log; the losses are printed below
    try:
        trainer.train()
    except ValueError as error:  # what the glue refuses, before the first step (one line)
        parser.error(str(error))

if training_args.process_index == 0:
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"epoch {entry['epoch']:.0f}/{args.epochs} | train loss {entry['loss']:.4f}", flush=True)
    order = trainer.cdgrab_sampler.all_indices()[:, :6].tolist()  # (replicas, m): the last epoch's orders
    print(f"last epoch's first examples per replica {order}", flush=True)
