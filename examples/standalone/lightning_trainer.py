"""PyTorch Lightning with CD-GraB example ordering, on synthetic data: a linear classifier on the CPU.

    python lightning_trainer.py                 # one process
    python lightning_trainer.py --devices 2     # Lightning's DDP: two CPU processes (gloo), one replica each

Needs torch, lightning and the installed package (`pip install "cdgrab-sorters[lightning]"`). The
additions to an ordinary LightningModule and Trainer: a `LightningCDGraBSampler` built in `setup()` (under
DDP the process group exists by then, and the sampler reads the world size and rank from it),
`per_example_grads(batch)`, `CDGraBCallback` and `Trainer(use_distributed_sampler=False)`.
"""
import argparse

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sorters import SORTER_NAMES, CDGraBSettings
from sorters.lightning import CDGraBCallback, LightningCDGraBSampler


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, without argparse's usage block
        self.exit(2, f"{self.prog}: {message}\n")


parser = Parser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--examples", type=int, default=256, help="size of the synthetic training set")
parser.add_argument("--batch-size", type=int, default=16, help="examples per replica per step")
parser.add_argument("--devices", type=int, default=1, help="DDP processes on the CPU, one replica each")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
try:  # checked before anything is built: a bad setting is one line
    cdgrab = CDGraBSettings(sorter=args.sorter, seed=args.seed)
except ValueError as error:
    parser.error(str(error))

torch.manual_seed(args.seed)  # the same data and initial model in every process
features = torch.randn(args.examples, 8)                 # (N, 8)
labels = (features @ torch.randn(8) > 0).long()          # (N,)
train_set = TensorDataset(features, labels)


def loss_fn(logits, y):
    """Mean cross-entropy; logits (B, 2), y (B,)."""
    return F.cross_entropy(logits, y)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.grads_of = cdgrab.gradients(self.net, loss_fn)  # PerExampleGrads: (B, d)

    def setup(self, stage):  # found by CDGraBCallback as self.sampler
        self.sampler = cdgrab.sampler(train_set, args.batch_size, d=self.grads_of.d, cls=LightningCDGraBSampler,
                                      drop_last=True, epochs=args.epochs)

    def train_dataloader(self):
        return DataLoader(train_set, batch_size=self.sampler.loader_batch_size, sampler=self.sampler)

    def per_example_grads(self, batch):  # (B, d): called by the callback before the batch's step
        x, y = batch
        return self.grads_of(x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            first = self.sampler.all_indices()[:, :6].tolist()  # (replicas, m): every replica's order
            loss = self.trainer.callback_metrics["train_loss"].item()
            print(f"epoch {self.current_epoch + 1}/{args.epochs} | train loss {loss:.4f} | "
                  f"first examples per replica {first}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                    strategy="ddp" if args.devices > 1 else "auto",
                    use_distributed_sampler=False,  # the sampler splits the data itself; the callback refuses True
                    callbacks=[CDGraBCallback(settings=cdgrab)], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Classifier())
if torch.distributed.is_available() and torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # Lightning leaves a gloo group up; leave it while the interpreter is whole
