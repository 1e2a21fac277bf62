"""Hugging Face Accelerate with CD-GraB example ordering: logistic regression on HMDA.

    python examples/accelerate_loop.py --epochs 2                                  # one process
    torchrun --standalone --nproc_per_node=2 examples/accelerate_loop.py --epochs 2  # two gloo processes

(`accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py` starts the same two processes
through torchrun; Accelerator(cpu=True) below keeps them on the CPU with gloo. `accelerate launch --cpu
--num_processes 2` starts one process: accelerate 1.15 launches several CPU processes through mpirun only.)
The sampler yields every process's batch of each step, process 0's first (view="global"); the loader
that accelerator.prepare makes deals process r its own batches. step() all-gathers the per-example
gradients, so every process holds the same sampler state, and accelerator.save_state (rank 0 writes it)
restores all of them: --checkpoint DIR saves after every epoch, --resume DIR continues from it.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `sorters` and `data`
from data.common import default_data_dir  # noqa: E402
from data.hmda import load_hmda  # noqa: E402
from engine.cli import OneLineErrorParser  # noqa: E402
from engine.errors import UserFacingError, exit_with_error  # noqa: E402
from sorters import SORTER_NAMES, CDGraBSampler, PerExampleGrads  # noqa: E402

parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])  # argparse's, with one-line errors
parser.add_argument("--data-dir", default=default_data_dir(), help="folder holding hmda/ (default $CDGRAB_DATA)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--max-train-examples", type=int, default=None, help="train on the first N examples only")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--batch-size", type=int, default=4, help="examples per process per step")
parser.add_argument("--lr", type=float, default=5e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint", default=None, help="accelerator.save_state here after every epoch")
parser.add_argument("--resume", default=None, help="accelerator.load_state from here first (a --checkpoint folder)")
parser.add_argument("--save-orders", default=None, help="write every epoch's orders, batches and states here")
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
torch.manual_seed(args.seed)  # the same initial model in every process
try:
    data = load_hmda(args.data_dir)
except UserFacingError as error:  # a missing or unreadable data set: say what to do in one line, exit 2
    exit_with_error(str(error))
x_train, y_train = data.train_x[:args.max_train_examples], data.train_y[:args.max_train_examples]
train_set = TensorDataset(x_train, y_train, torch.arange(len(y_train)))  # with each example's index, to record
model = torch.nn.Linear(data.num_features, 1)


def loss_fn(logits, y):
    """Mean binary cross-entropy; logits (B, 1), y (B,)."""
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), y)


grads_of = PerExampleGrads(model, loss_fn)  # (B, d) per-example gradients of the unwrapped model
try:  # view="global": accelerate re-shards the loader; every batch full (drop_last) so it deals whole steps
    sampler = CDGraBSampler(train_set, batch_size=args.batch_size, d=grads_of.d, sorter=args.sorter, seed=args.seed,
                            drop_last=True, epochs=args.epochs, view="global")
except ValueError as error:  # settings the sampler refuses, e.g. too few examples for the batch size
    exit_with_error(str(error))
loader = DataLoader(train_set, batch_size=sampler.loader_batch_size, sampler=sampler)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
ddp_model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
accelerator.register_for_checkpointing(sampler)  # its state_dict goes into save_state / load_state
first_epoch = 0
if args.resume:
    accelerator.load_state(args.resume)
    first_epoch = sampler.epoch  # the sampler knows where the run stopped
accelerator.print(f"{args.sorter}: {sampler.num_replicas} processes x {sampler.m} examples, batch {args.batch_size}")

history = {"orders": [], "batches": [], "states": [], "train_loss": []}
for epoch in range(first_epoch, args.epochs):
    loader.set_epoch(epoch)  # as the HF Trainer does; the sampler checks it
    loss_sum, seen = torch.zeros(()), []
    for x, y, index in loader:
        loss = loss_fn(ddp_model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        sampler.step(grads_of(x, y) if sampler.uses_grads else None)  # this process's (B, d), before the update
        optimizer.step()
        loss_sum += loss.detach()
        seen.append(index)
    train_loss = accelerator.gather(loss_sum[None]).mean().item() / len(loader)
    history["orders"].append(sampler.all_indices())  # (processes, m): every process's order this epoch
    history["batches"].append(gather_object([torch.cat(seen)]))  # the example indices each process used
    history["states"].append(gather_object([sampler.state_dict()]))  # every process's sampler state
    history["train_loss"].append(train_loss)
    accelerator.print(f"epoch {epoch + 1}/{args.epochs} | train loss {train_loss:.6f}")
    if args.checkpoint:
        accelerator.save_state(args.checkpoint)

if accelerator.is_main_process and args.save_orders:
    torch.save(history, args.save_orders)
accelerator.wait_for_everyone()
# release the prepared model, optimizer and loader (the accelerator's references too): the DDP wrapper's
# reducer holds the process group, so only then does end_training's destroy_process_group() free the group
# and join gloo's threads, while the interpreter is whole (why it matters: sorters/sampler.py)
accelerator.free_memory(ddp_model, optimizer, loader)
del ddp_model, optimizer, loader
accelerator.end_training()
