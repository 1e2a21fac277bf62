"""CD-GraB in a DistributedDataParallel loop under torchrun, on synthetic data (CPU, gloo).

    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py

Needs only torch and the installed `sorters` package. One replica per process: each process builds the
same data and model (one seed), the sampler reads the world size and rank from the process group and
hands every process its own batches, and `sampler.step()` all-gathers every process's per-example
gradients, so that every process computes the same next orders. The orders are those of
`python own_loop.py --replicas 2` (the replicas simulated in one process).
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from sorters import SORTER_NAMES, CDGraBSampler, PerExampleGrads


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, without argparse's usage block
        self.exit(2, f"{self.prog}: {message}\n")


parser = Parser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--examples", type=int, default=256, help="size of the synthetic training set")
parser.add_argument("--batch-size", type=int, default=16, help="examples per process per step")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")  # torchrun gives the rank, world size and rendezvous address
rank = dist.get_rank()
torch.manual_seed(args.seed)     # the same data and initial model in every process
features = torch.randn(args.examples, 8)                 # (N, 8)
labels = (features @ torch.randn(8) > 0).long()          # (N,)
train_set = TensorDataset(features, labels)
model = torch.nn.Linear(8, 2)
ddp_model = DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def loss_fn(logits, y):
    """Mean cross-entropy; logits (B, 2), y (B,)."""
    return F.cross_entropy(logits, y)


grads_of = PerExampleGrads(model, loss_fn)               # of the plain module: (B, d) for this process's batch
try:
    sampler = CDGraBSampler(train_set, batch_size=args.batch_size, d=grads_of.d, sorter=args.sorter,
                            seed=args.seed, drop_last=True, epochs=args.epochs)
except ValueError as error:
    parser.error(str(error))
loader = DataLoader(train_set, batch_size=sampler.loader_batch_size, sampler=sampler)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    loss_sum = torch.zeros(())
    for x, y in loader:                                  # this process's batch (B, 8)
        loss = loss_fn(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()                                  # DDP averages the gradient over the processes
        sampler.step(grads_of(x, y) if sampler.uses_grads else None)  # every process, every batch
        optimizer.step()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)                            # the mean over all processes' batches
    first = sampler.all_indices()[:, :6].tolist()        # (processes, m): every process's order this epoch
    if rank == 0:
        print(f"epoch {epoch + 1}/{args.epochs} | train loss {loss_sum.item() / dist.get_world_size() / len(loader):.4f} | "
              f"first examples per replica {first}", flush=True)

del ddp_model                    # DDP holds the process group; free it before the group is torn down
dist.destroy_process_group()
