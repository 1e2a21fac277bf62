"""What the gradient-free orderers cost in the framework glue over a plain sampler, measured in one run.

    nice -n 10 python bench/glue_gradient_free.py [--examples 512] [--epochs 3] [--rounds 3] [--out FILE]

One process, the CPU, one torch thread, a small MLP (32 -> 64 -> 1, tanh; regression on a fixed random data
set), batches of 16. Each loop trains the same epochs from the same initial weights with each sampler:

- "plain": torch's DistributedSampler (num_replicas=1, rank=0, shuffle=True): a fresh permutation per epoch;
- "D-RR", "FlipFlop", "SWR": CDGraBSampler with that sorter (no gradient read: step(None) counts the batch);
- "MB-GraB (backward)": MB-GraB fed each batch's gradient from the step's own backward (BackwardGradient): no
  per-example gradient, a pair balance of d = 2,177 numbers per step.

Three loops: "own" (a plain PyTorch loop: sampler.step after the backward), "hf" (sorters.hf.CDGraBTrainer,
against a plain transformers.Trainer for "plain") and "lightning" (sorters.lightning.CDGraBCallback with a
LightningCDGraBSampler, against a DataLoader over the DistributedSampler). Each variant's number is the
seconds per step of an epoch (the epoch's wall time, the sampler's sort and the loader included, over its
steps), the median over the epochs after the first (warm-up), taken in the round with the median; rounds are
interleaved (every loop and variant once per round) so that a slow spell of the machine hits all of them.
Prints one JSON object (and writes it to --out).
"""
import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from engine.runlog import head_commit  # noqa: E402
from sorters import CDGraBSampler, CDGraBSettings  # noqa: E402
from sorters.per_example import BackwardGradient  # noqa: E402

BATCH, FEATURES, HIDDEN = 16, 32, 64
VARIANTS = ("plain", "D-RR", "FlipFlop", "SWR", "MB-GraB (backward)")
SORTER = {"D-RR": "D-RR", "FlipFlop": "FlipFlop", "SWR": "SWR", "MB-GraB (backward)": "MB-GraB"}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, FEATURES) inputs and (n,) targets, fixed."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=generator)
    return x, x[:, 0] - 0.5 * x[:, 1] + 0.1 * torch.randn(n, generator=generator)


def sampler_of(variant: str, n: int, d: int, cls: type = CDGraBSampler) -> torch.utils.data.Sampler:
    if variant == "plain":
        return DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0)
    return cls(n, batch_size=BATCH, d=d, sorter=SORTER[variant], num_replicas=1, seed=0, drop_last=True)


def own_loop(variant: str, n: int, epochs: int) -> list[float]:
    """Seconds per step of each epoch of a plain PyTorch loop."""
    x, y = data(n)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    backward = BackwardGradient(model) if variant.startswith("MB-GraB") else None
    sampler = sampler_of(variant, n, sum(p.numel() for p in model.parameters()))
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler, drop_last=True)
    per_step = []
    for epoch in range(epochs):
        started, steps = time.perf_counter(), 0
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.mse_loss(model(xb).squeeze(-1), yb)
            optimizer.zero_grad()
            if backward is not None:
                backward.start()
            loss.backward()
            if isinstance(sampler, CDGraBSampler):
                sampler.step(backward.delta()[None] if backward is not None else None)
            optimizer.step()
            steps += 1
        per_step.append((time.perf_counter() - started) / steps)
    return per_step


def hf_loop(variant: str, n: int, epochs: int, out: str) -> list[float]:
    """Seconds per step of each epoch of a transformers Trainer (CDGraBTrainer, or the plain Trainer)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from sorters.hf import CDGraBTrainer

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x, labels=None):
            out = self.net(x).squeeze(-1)
            return {"loss": F.mse_loss(out, labels), "logits": out}

    class EpochTimer(TrainerCallback):
        def __init__(self):
            self.per_step, self.started = [], 0.0

        def on_epoch_begin(self, args, state, *_, **__):
            self.started, self.first_step = time.perf_counter(), state.global_step

        def on_epoch_end(self, args, state, *_, **__):
            self.per_step.append((time.perf_counter() - self.started) / (state.global_step - self.first_step))

    x, y = data(n)
    examples = [{"x": xi, "labels": yi} for xi, yi in zip(x, y)]
    args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=BATCH, num_train_epochs=epochs,
                             dataloader_drop_last=True, report_to=[], disable_tqdm=True, logging_strategy="no",
                             save_strategy="no", seed=0, learning_rate=0.01)
    timer = EpochTimer()
    extra = {} if variant == "plain" else {"cdgrab": CDGraBSettings(sorter=SORTER[variant], num_replicas=1)}
    cls = Trainer if variant == "plain" else CDGraBTrainer
    cls(model=Regression(), args=args, train_dataset=examples, callbacks=[timer], **extra).train()
    return timer.per_step


def lightning_loop(variant: str, n: int, epochs: int) -> list[float]:
    """Seconds per step of each epoch of a Lightning Trainer (with CDGraBCallback, or none for "plain")."""
    import lightning.pytorch as L

    from sorters.lightning import CDGraBCallback, LightningCDGraBSampler

    x, y = data(n)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.sampler = sampler_of(variant, n, sum(p.numel() for p in self.net.parameters()),
                                      LightningCDGraBSampler)

        def train_dataloader(self):
            return DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=self.sampler, drop_last=True)

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return F.mse_loss(self.net(xb).squeeze(-1), yb)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class EpochTimer(L.Callback):
        def __init__(self):
            self.per_step, self.started, self.batches = [], 0.0, 0

        def on_train_epoch_start(self, *_):
            self.started, self.batches = time.perf_counter(), 0

        def on_train_batch_end(self, *_):
            self.batches += 1

        def on_train_epoch_end(self, *_):
            self.per_step.append((time.perf_counter() - self.started) / self.batches)

    timer = EpochTimer()
    callbacks = [timer] + ([] if variant == "plain" else [CDGraBCallback()])
    L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=callbacks).fit(Module())
    return timer.per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=512, help="training examples (steps per epoch: / 16)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (the first not counted)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loops", default="own,hf,lightning", help="comma-separated: own, hf, lightning")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "glue-gradient-free-cpu.json"))
    args = parser.parse_args()
    loops = args.loops.split(",")
    if args.examples < 2 * BATCH or args.epochs < 2 or args.rounds < 1 or not set(loops) <= {"own", "hf", "lightning"}:
        parser.error("need --examples >= 32, --epochs >= 2 (one warm-up), --rounds >= 1, --loops from own,hf,lightning")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if "hf" in loops:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    rounds = {loop: {variant: [] for variant in VARIANTS} for loop in loops}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for loop in loops:
                for variant in VARIANTS:
                    if loop == "own":
                        per_step = own_loop(variant, args.examples, args.epochs)
                    elif loop == "hf":
                        per_step = hf_loop(variant, args.examples, args.epochs, tmp)
                    else:
                        per_step = lightning_loop(variant, args.examples, args.epochs)
                    rounds[loop][variant].append(statistics.median(per_step[1:]))
    median = {loop: {variant: statistics.median(times) for variant, times in by.items()} for loop, by in rounds.items()}
    result = {
        "git_commit": head_commit(short=True),  # "unknown commit" without a git checkout
        "device": "cpu", "torch_threads": torch.get_num_threads(),
        "setting": f"MLP {FEATURES}-{HIDDEN}-1 (d = {FEATURES * HIDDEN + HIDDEN + HIDDEN + 1}), batch {BATCH}, one "
                   f"process, {args.examples} examples ({args.examples // BATCH} steps per epoch), {args.epochs} "
                   f"epochs (first not counted) x {args.rounds} rounds, interleaved; plain = DistributedSampler "
                   "(num_replicas=1, shuffle=True), the plain transformers.Trainer for hf",
        "step_seconds": {loop: {v: round(s, 6) for v, s in by.items()} for loop, by in median.items()},
        "over_plain": {loop: {v: round(s / by["plain"], 3) for v, s in by.items()} for loop, by in median.items()},
        "rounds_seconds": {loop: {v: [round(s, 6) for s in times] for v, times in by.items()}
                           for loop, by in rounds.items()},
        "wall_seconds": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
