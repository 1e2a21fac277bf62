"""--log-herding: the parallel herding bound of each epoch's per-unit gradients under the epoch's order.

    bound = max over prefixes k of || sum_{t <= k} sum_j (g[j, t] - mean_t' g[j, t']) ||_inf

where g[j, t] (d,) is the gradient of the unit that worker j used at epoch position t, as computed in
training (at that step's parameters), and positions run step by step (all workers' k units of step
1, then step 2, ...): sorters.herding.parallel_herding_bound of the (n, m, d) gradients under the
epoch's orders (the metric of the paper's herding-bound simulation, which the original code also logged
in its LeNet script).

It keeps all n * m * d gradients of the epoch as float32 (every process keeps every worker's), so runs
whose buffer would pass MAX_BYTES are refused up front. Sorters that balance hand over the gradients
they gathered anyway; for the others (D-RR, D-SO, Fold) the per-unit gradients are computed on the side
(task.unit_grads), which costs about one CD-GraB gradient computation per step.
"""
import torch

from common.errors import UserFacingError

MAX_BYTES = 512 * 2**20
COLUMN_CHUNK = 4096  # coordinates per pass of the bound: the float64 working copy stays n * m * 4096 * 8 bytes


class HerdingLog:
    """Collects the epoch's (n, m, d) per-unit gradients by position; `bound()` at the epoch's end."""

    def __init__(self, n: int, m: int, d: int, comm, model, device):
        size = n * m * d * 4
        if size > MAX_BYTES:
            most = MAX_BYTES // (d * 4)
            raise UserFacingError(f"--log-herding keeps the epoch's n*m*d = {n} x {m} x {d} per-unit gradients "
                                  f"({size / 2**20:,.0f} MB as float32), more than its {MAX_BYTES // 2**20} MB limit; "
                                  f"use at most {most:,} training units (--max-train-examples) or drop --log-herding")
        self.comm, self.model = comm, model
        self.grads = torch.zeros(n, m, d, dtype=torch.float32, device=device)  # [j, t]: worker j, position t

    def record(self, step: int, every_unit_grad, local_unit_grads_fn) -> None:
        """Keep step `step`'s gradients: every_unit_grad (n, k, d) when the sorter gathered them, else
        None, and then local_unit_grads_fn() -> (n_local, k, d) computes this process's, gathered here."""
        if every_unit_grad is None:
            # the task's per-unit path may use the model's gradient buffer, which can hold this step's update
            update = self.model.grad.clone()
            every_unit_grad = self.comm.all_gather(local_unit_grads_fn())
            self.model.grad.copy_(update)
        k = every_unit_grad.shape[1]
        self.grads[:, step * k:(step + 1) * k] = every_unit_grad

    def bound(self) -> float:
        """The parallel herding bound of the recorded epoch (float64 arithmetic, as parallel_herding_bound)."""
        n, m, d = self.grads.shape
        running_max = 0.0
        for start in range(0, d, COLUMN_CHUNK):  # the max over coordinates splits over column chunks
            z = self.grads[:, :, start:start + COLUMN_CHUNK].double()
            z -= z.mean(dim=1, keepdim=True)
            running_max = max(running_max, z.sum(dim=0).cumsum(dim=0).abs().max().item())
        return running_max
