"""The Lightning side of tests/test_lightning.py, imported by its `lit` fixture: importing Lightning takes
seconds, and every pytest-xdist worker collects every test module, so the test module itself does not."""
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sorters import PerExampleGrads
from sorters.layer_sketch import LayerSketch
from sorters.lightning import CDGraBCallback, LightningCDGraBSampler, watch  # noqa: F401 (the tests use them from here)

from tests.test_lightning import BATCH, EPOCHS, FEATURES, N, REPLICAS  # the sizes, in one place


def mse(out, y):
    """out (B, 1), y (B,) -> mean squared error."""
    return F.mse_loss(out.squeeze(-1), y)


class TinyModel(L.LightningModule):
    """Linear regression on a fixed random data set, one process hosting REPLICAS replicas; records
    every step's per-example gradients and loss, and every epoch's orders."""

    def __init__(self, sorter="CD-GraB"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(FEATURES, 1)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(N, FEATURES, generator=generator)
        self.train_set = TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(N, generator=generator))
        self.sorter_name, self.grads_of = sorter, PerExampleGrads(self.net, mse)
        self.grads, self.losses, self.orders = [], [], []
        self.stepped, self.own_grads = [], []  # what sampler.step() got; the oracle at each step's start

    def setup(self, stage):
        self.sampler = LightningCDGraBSampler(self.train_set, batch_size=BATCH, d=self.grads_of.d,
                                              sorter=self.sorter_name, num_replicas=REPLICAS, epochs=EPOCHS)
        step = self.sampler.step
        self.sampler.step = lambda grads: (self.stepped.append(grads), step(grads))[1]

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.sampler.loader_batch_size, sampler=self.sampler)

    def per_example_grads(self, batch):
        x, y = batch
        self.grads.append(self.grads_of(x, y))  # (REPLICAS * BATCH, d)
        return self.grads[-1]

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.own_grads.append(each_examples_gradient(self.net, x, y))  # at the parameters this step starts from
        loss = mse(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_epoch_end(self):
        self.orders.append(self.sampler.all_indices())  # (REPLICAS, m)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def each_examples_gradient(net, x, y) -> torch.Tensor:
    """The oracle: (B, d) gradients, example by example, by an ordinary backward pass (not torch.func), in
    named_parameters() order (PerExampleGrads' layout)."""
    rows = []
    with torch.enable_grad():
        for i in range(len(x)):
            grads = torch.autograd.grad(mse(net(x[i:i + 1]), y[i:i + 1]), list(net.parameters()))
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def trainer(*callbacks, **kwargs):
    settings = dict(max_epochs=EPOCHS, accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(callbacks=[CDGraBCallback(), *callbacks], **{**settings, **kwargs})


class Crash(Exception):
    pass


class CrashAt(L.Callback):
    """Raises when batch `step` (counting from 0 over the run) starts: the run dies after a checkpoint."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Crash()


class TinySketchModel(TinyModel):
    """A two-layer net whose sketches come from the training step's own backward (CDGraBCallback's sketcher,
    every weight a TensorSketch block); records the per-example gradients formed independently at the
    same parameters (the oracle) and every sketch the sampler got."""

    def __init__(self, dim=5):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
        self.grads_of = PerExampleGrads(self.net, mse)
        self.sketcher = LayerSketch(self.net, dim, seed=2, min_numel=1)
        self.sketches = []

    def setup(self, stage):
        self.sampler = LightningCDGraBSampler(self.train_set, batch_size=BATCH, d=self.sketcher.d, seed=2,
                                              sketch_dim=self.sketcher.dim, num_replicas=REPLICAS, epochs=EPOCHS)
        step = self.sampler.step
        self.sampler.step = lambda grads: (self.sketches.append(grads.clone()), step(grads))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.grads.append(self.grads_of(x, y))  # the oracle, before the step's own forward
        losses = watch(self, (self.net(x).squeeze(-1) - y) ** 2)  # (B,)
        loss = losses.mean()
        self.losses.append(loss.item())
        return loss


class TinyExactModel(TinyModel):
    """Linear, LayerNorm, Tanh, Linear, trained under `settings`: with exact_low_memory the callback balances
    from the training step's own forward and backward (self.exact, an ExactGradients); otherwise, the oracle,
    the formed per-example gradients (PerExampleGrads, float64 running sum). batch 3: odd, so pairs span steps."""

    def __init__(self, settings, batch=3):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 6), torch.nn.LayerNorm(6), torch.nn.Tanh(),
                                       torch.nn.Linear(6, 1))
        self.settings, self.batch = settings, batch
        if settings.exact_low_memory:
            self.exact = settings.exact_gradients(self.net)
        else:
            self.grads_of = settings.gradients(self.net, mse)

    def setup(self, stage):
        d = self.exact.d if self.settings.exact_low_memory else self.grads_of.d
        self.sampler = self.settings.sampler(self.train_set, batch_size=self.batch, d=d, cls=LightningCDGraBSampler)

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = watch(self, (self.net(x).squeeze(-1) - y) ** 2)  # (B,): the loss below is built from them
        loss = losses.mean()
        self.losses.append(loss.item())
        return loss
