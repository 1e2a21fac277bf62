"""PyTorch Lightning training with CD-GraB example ordering: the MLP-M4 forecaster on M4 Weekly windows.

    python examples/lightning_mlp.py --epochs 3                  # one process, one replica
    python examples/lightning_mlp.py --epochs 3 --devices 2      # Lightning DDP: 2 CPU processes (gloo)
    python examples/lightning_mlp.py --epochs 3 --replicas 2     # both replicas in one process
    python examples/lightning_mlp.py --exact-low-memory on       # exact CD-GraB from the step's own backward

An ordinary LightningModule and Trainer; the additions are CDGraBCallback, a LightningCDGraBSampler built
in setup(), `per_example_grads(batch)` and `Trainer(use_distributed_sampler=False)` (sorters/lightning.py).
The data and model are the MLP-M4 benchmark's (main-MLP-M4.py): windows of 20 standardised values of the
M4 Weekly series (data/m4.py), a 3-layer MLP that forecasts the next 6 values autoregressively, MSE loss;
by default on the first 4096 training windows, so a run takes seconds. `--devices 2` and `--replicas 2`
give the same orders and losses (to rounding).
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `sorters` and `data`
from data.m4 import load_m4  # noqa: E402
from examples._common import (OneLineErrorParser, default_data_dir, exit_with_error, load_or_exit,  # noqa: E402
                              settings_or_exit)
from models.mlp import AutoregressiveMLP  # noqa: E402
from sorters import SORTER_NAMES, CDGraBSettings  # noqa: E402

try:
    import lightning.pytorch as L
    from sorters.lightning import CDGraBCallback, LightningCDGraBSampler, watch
except ImportError as error:  # lightning is an optional dependency of the package
    exit_with_error(str(error))

OUT_LEN = 6  # values forecast per training window, as main-MLP-M4.py

parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])  # argparse's, with one-line errors
parser.add_argument("--data-dir", default=default_data_dir(), help="folder holding m4/ (default $CDGRAB_DATA)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--max-train-examples", type=int, default=4096, help="train on the first N windows only")
parser.add_argument("--sorter", default="CD-GraB", choices=SORTER_NAMES)
parser.add_argument("--batch-size", type=int, default=16, help="examples per replica per step")
parser.add_argument("--devices", type=int, default=1, help="Lightning DDP processes on the CPU (gloo), one replica each")
parser.add_argument("--replicas", type=int, default=1, help="replicas hosted in one process (with --devices 1)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint-dir", default=None,
                    help="save last.ckpt there after every epoch, and resume from it when it exists")
parser.add_argument("--save-orders", default=None,
                    help="write every epoch's orders and losses here (torch.save); under DDP each rank also "
                         "writes its sampler's state to <file>.rank<r>")
parser.add_argument("--progress", choices=("on", "off"), default="on", help="Lightning's progress bar")
parser.add_argument("--exact-low-memory", choices=("off", "on"), default="off",
                    help="on: CD-GraB's exact gradients from the training step's own forward and backward, never "
                         "formed (docs/exact-cdgrab.md); off: the per-example gradients formed (torch.func)")
args = parser.parse_args()
# under torchrun the processes exist already: Lightning joins them, with one device per process
devices = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else args.devices
if devices > 1 and args.replicas != 1:
    exit_with_error("--replicas hosts several replicas in ONE process: use it with --devices 1")
# the sorter's settings (the same object the HF Trainer's glue takes), checked before any data is loaded
cdgrab = settings_or_exit(CDGraBSettings, sorter=args.sorter, seed=args.seed,
                          num_replicas=None if devices > 1 else args.replicas,
                          exact_low_memory=args.exact_low_memory == "on")
data = load_or_exit(load_m4, args.data_dir)  # a missing or unreadable data set: one line, exit 2
train_set = TensorDataset(data.train_x[:args.max_train_examples], data.train_y[:args.max_train_examples])


def loss_fn(predictions, y):
    """Mean squared error; predictions and y (B, OUT_LEN)."""
    return F.mse_loss(predictions, y)


class Forecaster(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(args.seed)  # the same initial model in every process
        self.mlp = AutoregressiveMLP(in_len=data.train_x.shape[1], hidden=64, n_layers=3)
        if cdgrab.exact_low_memory:  # the layer records of training_step's own forward and backward
            self.exact = cdgrab.exact_gradients(self)
        else:  # (B, d) per-example gradients of the training loss, through forward() (which gives the horizon)
            self.grads_of = cdgrab.gradients(self, loss_fn)
        self.history = {"orders": [], "train_loss": [], "valid_loss": []}
        self.loss_sum = torch.zeros(())

    def setup(self, stage):
        # here, not in __init__: under DDP Lightning has started the process group by now, and the sampler
        # takes its world size and rank from it (CDGraBCallback finds it as self.sampler)
        try:
            # drop_last: each replica gets a whole number of batches, the tail of the data set is not used
            d = self.exact.d if cdgrab.exact_low_memory else self.grads_of.d
            self.sampler = cdgrab.sampler(train_set, args.batch_size, d=d, cls=LightningCDGraBSampler,
                                          drop_last=True, epochs=args.epochs)  # KH-SGD's, SBW's thresholds: the run's length
        except ValueError as error:  # settings the sampler refuses, e.g. too few examples for the batch size
            exit_with_error(str(error))

    def train_dataloader(self):
        return DataLoader(train_set, batch_size=self.sampler.loader_batch_size, sampler=self.sampler)

    def forward(self, x):
        return self.mlp(x, OUT_LEN)  # (B, in_len) -> (B, OUT_LEN)

    def per_example_grads(self, batch):
        """(B, d): each example's gradient at the parameters this batch's optimizer step starts from."""
        x, y = batch
        return self.grads_of(x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if cdgrab.exact_low_memory:  # (B,) each window's loss, handed to the recording; their mean is loss_fn's
            loss = watch(self, (self(x) - y).square().mean(1)).mean()
        else:
            loss = loss_fn(self(x), y)
        self.loss_sum += loss.detach()
        return loss

    def on_train_epoch_end(self):
        # every process's mean loss -> the mean over all replicas
        train_loss = self.trainer.strategy.reduce(self.loss_sum, reduce_op="mean").item() / self.trainer.num_training_batches
        self.loss_sum = torch.zeros(())
        with torch.no_grad():
            valid_loss = loss_fn(self(data.valid_x), data.valid_y).item()
        self.history["orders"].append(self.sampler.all_indices())  # (replicas, m): every replica's order
        self.history["train_loss"].append(train_loss)
        self.history["valid_loss"].append(valid_loss)
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch + 1}/{args.epochs} | train loss {train_loss:.6f} | "
                  f"valid loss {valid_loss:.6f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)


callbacks = [CDGraBCallback(settings=cdgrab)]
if args.checkpoint_dir:
    callbacks.append(L.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0))
last = Path(args.checkpoint_dir or ".") / "last.ckpt"
trainer = L.Trainer(
    max_epochs=args.epochs, callbacks=callbacks, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
    use_distributed_sampler=False,  # the CDGraBSampler splits the data itself; the callback refuses True
    logger=False, enable_checkpointing=bool(args.checkpoint_dir), enable_model_summary=False,
    enable_progress_bar=args.progress == "on", num_sanity_val_steps=0)
model = Forecaster()
if trainer.global_rank == 0:
    print(f"{args.sorter}: {len(train_set)} M4 Weekly windows, batch {args.batch_size} per replica, "
          f"{f'{devices} DDP processes' if devices > 1 else f'{args.replicas} replica(s) in one process'}", flush=True)
trainer.fit(model, ckpt_path=last if args.checkpoint_dir and last.exists() else None)

if args.save_orders:
    if trainer.global_rank == 0:
        torch.save(model.history, args.save_orders)
    if devices > 1:
        torch.save(model.sampler.state_dict(), f"{args.save_orders}.rank{trainer.global_rank}")
if torch.distributed.is_available() and torch.distributed.is_initialized():
    # Lightning leaves a gloo group up (it destroys NCCL groups only, at exit): leave it here, while the
    # interpreter is whole, so that gloo's threads are joined before exit (why it matters: sorters/sampler.py)
    torch.distributed.barrier()  # every rank past its saves
    torch.distributed.destroy_process_group()
