"""CD-GraB in your own training loop, on synthetic data: a linear classifier, no launcher.

    python own_loop.py                  # one replica
    python own_loop.py --replicas 2     # two data-parallel replicas simulated in this one process

Needs only torch and the installed `sorters` package (`pip install cdgrab-sorters`): no data set, no
download, nothing else of the repository. The additions to an ordinary loop are the sampler,
`sampler.set_epoch(epoch)` and one `sampler.step(per-example gradients)` per batch, before
`optimizer.step()`. With --replicas R each batch is every replica's batch side by side, replica 0's
first, and the orders are those of R torchrun processes (torchrun_ddp.py).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sorters import SORTER_NAMES, CDGraBSampler, PerExampleGrads


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, without argparse's usage block
        self.exit(2, f"{self.prog}: {message}\n")


parser = Parser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--examples", type=int, default=256, help="size of the synthetic training set")
parser.add_argument("--batch-size", type=int, default=16, help="examples per replica per step")
parser.add_argument("--replicas", type=int, default=1, help="data-parallel replicas hosted in this process")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
features = torch.randn(args.examples, 8)                 # (N, 8)
labels = (features @ torch.randn(8) > 0).long()          # (N,): two classes a linear model can separate
train_set = TensorDataset(features, labels)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def loss_fn(logits, y):
    """Mean cross-entropy; logits (B, 2), y (B,)."""
    return F.cross_entropy(logits, y)


grads_of = PerExampleGrads(model, loss_fn)               # grads_of(x, y): (B, d), d = 18 parameters here
try:  # drop_last: every replica a whole number of batches
    sampler = CDGraBSampler(train_set, batch_size=args.batch_size, d=grads_of.d, sorter=args.sorter,
                            num_replicas=args.replicas, seed=args.seed, drop_last=True, epochs=args.epochs)
except ValueError as error:  # e.g. too few examples for the batch size and replicas
    parser.error(str(error))
loader = DataLoader(train_set, batch_size=sampler.loader_batch_size, sampler=sampler)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    loss_sum = 0.0
    for x, y in loader:                                  # x (R * B, 8): every replica's batch, replica 0's first
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        sampler.step(grads_of(x, y) if sampler.uses_grads else None)  # D-RR, D-SO, Fold need no gradients
        optimizer.step()
        loss_sum += loss.item()
    first = sampler.all_indices()[:, :6].tolist()        # (replicas, m): each replica's order this epoch
    print(f"epoch {epoch + 1}/{args.epochs} | train loss {loss_sum / len(loader):.4f} | "
          f"first examples per replica {first}", flush=True)
