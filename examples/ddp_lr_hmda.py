"""Plain DistributedDataParallel training with CD-GraB example ordering: logistic regression on HMDA.

    torchrun --standalone --nproc_per_node=2 examples/ddp_lr_hmda.py --epochs 3   # one replica per process
    python examples/ddp_lr_hmda.py --replicas 2 --epochs 3                        # both replicas in one process

An ordinary loop (DataLoader, nn.Module, torch.optim, DDP); the only additions are the sampler and one
`sampler.step(per-example gradients)` per batch. Both launches give the same orders and losses (to
rounding): in one process, each batch is every replica's batch side by side, replica 0's first.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `sorters` and `data`
from data.hmda import load_hmda  # noqa: E402
from examples._common import OneLineErrorParser, default_data_dir, exit_with_error, load_or_exit  # noqa: E402
from sorters import SORTER_NAMES, CDGraBSampler, PerExampleGrads  # noqa: E402

parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])  # argparse's, with one-line errors
parser.add_argument("--data-dir", default=default_data_dir(), help="folder holding hmda/ (default $CDGRAB_DATA)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--max-train-examples", type=int, default=None, help="train on the first N examples only")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--batch-size", type=int, default=4, help="examples per replica per step")
parser.add_argument("--replicas", type=int, default=None,
                    help="replicas hosted in this one process (no torchrun; default 1); under torchrun: the world size")
parser.add_argument("--lr", type=float, default=5e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--save-orders", default=None, help="write every epoch's orders and losses here (torch.save)")
args = parser.parse_args()

# ------------------------------------------------------------------------------------------- set-up
distributed = "RANK" in os.environ  # started by torchrun
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
torch.manual_seed(args.seed)  # the same initial model in every process

data = load_or_exit(load_hmda, args.data_dir)  # a missing or unreadable data set: one line, exit 2
train_set = TensorDataset(data.train_x[:args.max_train_examples], data.train_y[:args.max_train_examples])
model = torch.nn.Linear(data.num_features, 1)
ddp_model = DistributedDataParallel(model) if distributed else model


def loss_fn(logits, y):
    """Mean binary cross-entropy; logits (B, 1), y (B,)."""
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), y)


grads_of = PerExampleGrads(model, loss_fn)  # (B, d) per-example gradients; d = 26 here
# drop_last: each replica gets a whole number of batches, the tail of the data set is not used
try:
    sampler = CDGraBSampler(train_set, batch_size=args.batch_size, d=grads_of.d, sorter=args.sorter,
                            num_replicas=None if distributed else args.replicas, seed=args.seed, drop_last=True,
                            epochs=args.epochs)  # KH-SGD's and SBW's thresholds depend on the run's length
except ValueError as error:  # settings the sampler refuses, e.g. too few examples for the batch size
    exit_with_error(str(error))
loader = DataLoader(train_set, batch_size=sampler.loader_batch_size, sampler=sampler)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
if rank == 0:
    print(f"{args.sorter}: {sampler.num_replicas} replicas x {sampler.m} examples, batch {args.batch_size} "
          f"per replica, {'torchrun' if distributed else 'one process'}", flush=True)

# ------------------------------------------------------------------------------------------- training
history = {"orders": [], "train_loss": [], "test_loss": []}
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    loss_sum, start = torch.zeros(()), time.perf_counter()
    for x, y in loader:
        loss = loss_fn(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradient over the processes
        # this batch's per-example gradients, before the update (D-RR, D-SO, Fold need none)
        sampler.step(grads_of(x, y) if sampler.uses_grads else None)
        optimizer.step()
        loss_sum += loss.detach()
    if distributed:  # every process's mean loss -> the mean over all replicas
        dist.all_reduce(loss_sum)
        loss_sum /= dist.get_world_size()
    train_loss, seconds = loss_sum.item() / len(loader), time.perf_counter() - start
    with torch.no_grad():
        test_loss = loss_fn(model(data.test_x), data.test_y).item()
    history["orders"].append(sampler.all_indices())  # (replicas, m): every replica's order this epoch
    history["train_loss"].append(train_loss)
    history["test_loss"].append(test_loss)
    if rank == 0:
        print(f"epoch {epoch + 1}/{args.epochs} | train loss {train_loss:.6f} | test loss {test_loss:.6f} | "
              f"{seconds:.1f} s", flush=True)

if rank == 0 and args.save_orders:
    torch.save(history, args.save_orders)
if distributed:
    dist.barrier()  # let rank 0 finish writing before the group is torn down
    # DDP's reducer holds the process group: drop it first, so that destroy_process_group() frees the group
    # and joins gloo's threads here, while the interpreter is whole (why it matters: sorters/sampler.py)
    del ddp_model
    dist.destroy_process_group()
