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

The sorter's settings are a sorters.CDGraBSettings (the object the HF Trainer's and Lightning's glue take
too), checked before any data is loaded; `train_epoch` is the loop (tests/test_accelerate_glue.py checks
that the gradients it hands the sampler are taken at each step's starting parameters).
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `sorters` and `data`
from data.hmda import load_hmda  # noqa: E402
from examples._common import (OneLineErrorParser, default_data_dir, exit_with_error, load_or_exit,  # noqa: E402
                              settings_or_exit)
from sorters import SORTER_NAMES, CDGraBSettings  # noqa: E402


def parse_args(argv=None):
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])  # argparse's, with one-line errors
    parser.add_argument("--data-dir", default=default_data_dir(), help="folder holding hmda/ (default $CDGRAB_DATA)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs in all (a resumed run continues to this)")
    parser.add_argument("--max-train-examples", type=int, default=None, help="train on the first N examples only")
    parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES, help="the example-order sorter")
    parser.add_argument("--batch-size", type=int, default=4, help="examples per process per step")
    parser.add_argument("--lr", type=float, default=5e-3, help="SGD's learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model and the sorter")
    parser.add_argument("--checkpoint", default=None, help="accelerator.save_state here after every epoch")
    parser.add_argument("--resume", default=None, help="accelerator.load_state from here first (a --checkpoint folder)")
    parser.add_argument("--save-orders", default=None, help="write every epoch's orders, batches and states here")
    return parser.parse_args(argv)


def loss_fn(logits, y):
    """Mean binary cross-entropy; logits (B, 1), y (B,)."""
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), y)


def train_epoch(accelerator, model, optimizer, loader, sampler, grads_of) -> tuple[torch.Tensor, list]:
    """One epoch of the prepared `model` over the prepared `loader`; each step hands the sampler this
    process's (B, d) per-example gradients, taken after the backward and BEFORE optimizer.step(): at the
    parameters the step starts from. Returns (this process's loss sum, the example indices it used)."""
    loss_sum, seen = torch.zeros(()), []
    for x, y, index in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        sampler.step(grads_of(x, y) if sampler.uses_grads else None)  # all-gathered: every process, every step
        optimizer.step()
        loss_sum += loss.detach()
        seen.append(index)
    return loss_sum, seen


def main(argv=None):
    args = parse_args(argv)
    cdgrab = settings_or_exit(CDGraBSettings, sorter=args.sorter, seed=args.seed)  # before any data is loaded
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(args.seed)  # the same initial model in every process
    data = load_or_exit(load_hmda, args.data_dir)  # a missing or unreadable data set: one line, exit 2
    x_train, y_train = data.train_x[:args.max_train_examples], data.train_y[:args.max_train_examples]
    train_set = TensorDataset(x_train, y_train, torch.arange(len(y_train)))  # with each example's index, to record
    model = torch.nn.Linear(data.num_features, 1)
    grads_of = cdgrab.gradients(model, loss_fn)  # (B, d) per-example gradients of the unwrapped model
    try:  # view="global": accelerate re-shards the loader; every batch full (drop_last) so it deals whole steps
        sampler = cdgrab.sampler(train_set, args.batch_size, d=grads_of.d, drop_last=True, epochs=args.epochs,
                                 view="global")
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
        loss_sum, seen = train_epoch(accelerator, ddp_model, optimizer, loader, sampler, grads_of)
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
    # reducer holds the process group, so only then does end_training's destroy_process_group() free the
    # group and join gloo's threads, while the interpreter is whole (why it matters: sorters/sampler.py)
    accelerator.free_memory(ddp_model, optimizer, loader)
    del ddp_model, optimizer, loader
    accelerator.end_training()


if __name__ == "__main__":
    main()
