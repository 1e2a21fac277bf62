"""A tiny least-squares training loop around CDGraBSampler, run the same way with every replica in one
process and with one replica per gloo process under torchrun; tests/test_sampler_resume.py compares the
two, and resumed runs with uninterrupted ones, bit for bit.

Bit for bit across process counts holds by construction: a prediction is a sum over the features, in a
fixed order, of elementwise products (so an example's value never depends on which other rows share its
tensor), each step's update is the mean of every replica's per-example gradients gathered in replica
order (the same (R * b, F) tensor in either mode), and the loss is taken over the whole data set.

Under torchrun (the test runs it):

    python -m torch.distributed.run --nproc_per_node=2 tests/sampler_training.py JOBS OUT

JOBS: a torch.save'd list of jobs, each {"config": ..., and to resume "state", "w", "replay", "skip"};
writes OUT/rank<r>.pt: per job the records of `train`.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as a script: the checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sorters import CDGraBSampler  # noqa: E402

FEATURES, REPLICAS, EPOCHS, LR, SEED = 5, 2, 2, 0.05, 3


def dataset(n_examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (N, FEATURES), y (N,)) float32, the same for a given N in every process."""
    generator = torch.Generator().manual_seed(11)
    return torch.randn(n_examples, FEATURES, generator=generator), torch.randn(n_examples, generator=generator)


def make_sampler(config: dict, distributed: bool = False) -> CDGraBSampler:
    """config: sorter, n_examples, batch_size, drop_last, sketch_dim. Under a process group one replica per
    process (num_replicas, rank from it); else REPLICAS replicas hosted here."""
    return CDGraBSampler(config["n_examples"], batch_size=config["batch_size"], d=FEATURES, sorter=config["sorter"],
                         num_replicas=None if distributed else REPLICAS, seed=SEED, drop_last=config["drop_last"],
                         sketch_dim=config["sketch_dim"], epochs=EPOCHS)


def predict(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (B, F), w (F,) -> (B,): sum_c x[:, c] w[c], column after column (row i's value is independent of
    the other rows; a matrix product may block differently for another B)."""
    out = x[:, 0] * w[0]
    for c in range(1, x.shape[1]):
        out = out + x[:, c] * w[c]
    return out


def per_example_grads(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B, F): the gradient of (x_i . w - y_i)^2 / 2 for each row."""
    return x * (predict(x, w) - y)[:, None]


def every_replica(grads: torch.Tensor) -> torch.Tensor:
    """(b, F) of this process -> (R * b, F) of all replicas, replica 0's rows first (one process: itself)."""
    if not dist.is_initialized():
        return grads
    rows = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, grads.contiguous())
    return torch.cat(rows)


def train(sampler: CDGraBSampler, data: tuple, w: torch.Tensor, epochs: int = EPOCHS, steps: int | None = None,
          skip: int = 0) -> tuple[torch.Tensor, list]:
    """The user's loop, from the epoch the sampler is at: one step() per loader batch, then an SGD step on
    the mean gradient of every replica's examples. Stops after `steps` steps (None: at the end of `epochs`).
    skip: batches of the first epoch to drop without step(), as a loader that replays the epoch does after
    load_state_dict(..., replay_from_epoch_start=True). data: dataset(N); w: (F,) the weights.

    Returns (w, records): per step {"batch": the (R_here * b,) indices this process used, "state": the
    sampler's state_dict after the step, "w": (F,), "loss": () mean loss over the data set}."""
    x, y = data
    records = []
    if steps == 0:
        return w, records
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in torch.tensor(list(sampler)).split(sampler.loader_batch_size)[skip:]:
            grads = per_example_grads(x[batch], y[batch], w)
            sampler.step(grads if sampler.uses_grads else None)
            w = w - LR * every_replica(grads).mean(0)
            loss = ((predict(x, w) - y) ** 2).mean() / 2
            records.append({"batch": batch, "state": sampler.state_dict(), "w": w, "loss": loss})
            if len(records) == steps:
                return w, records
        skip = 0
    return w, records


def main(jobs_path: str, out: str) -> None:
    dist.init_process_group("gloo")
    results = []
    for job in torch.load(jobs_path, weights_only=True):
        sampler = make_sampler(job["config"], distributed=True)
        if "state" in job:
            sampler.load_state_dict(job["state"], replay_from_epoch_start=job["replay"])
        data, w = dataset(job["config"]["n_examples"]), job.get("w", torch.zeros(FEATURES))
        results.append(train(sampler, data, w, skip=job.get("skip", 0))[1])
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")
    dist.barrier()  # every rank has written before the group is torn down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
