"""Local SGD: each worker steps on its own parameters and averages with the others every H steps.

`--sync` picks H (the Quadratic Synchronization Rule of Gu et al., ICLR 2024, and their reference code):

    constant    H = --H every round
    qsr         H = max(H_base, floor((alpha / lr) ** power)), power 2 (H_init during warm-up)
    linear      the same with power 1
    post-local  data-parallel (a gradient average every step) until --switch-epoch, then constant H

A round's H is computed once, at its first step, from that step's learning rate: right after the
averaging that ended the previous round, as the reference does; it is never re-evaluated mid-round.
Rounds run across epoch ends: H is capped only by the steps left in the run, so late in training a
round may last several epochs (and an epoch may have no averaging at all). At an epoch's end the
model that is evaluated and checkpointed is the mean of the workers' parameters, computed without
changing them: training goes on from the unaveraged workers, and a checkpoint holds every worker's
parameters and the round's position, so a resume continues mid-round exactly.

Between averagings worker j updates its own row of the (n_local, d) parameter matrix with its own
gradient and its own optimizer state (engine.optim.Optimizer applied to the matrix: every rule is
element-wise, so each row keeps its own momentum or AdamW moments). An averaging step replaces every
row by the mean over all n workers, through one flattened all-reduce per process; optimizer state
stays local unless --avg-m / --avg-v ask to average AdamW's first / second moment (SGD momentum is never
averaged, as in the reference code of Gu et al. 2024). With a sparsifying reducer (--reducer topk/exdyna) what is
averaged is each worker's change since the last averaging, compressed with error feedback.
"""
import math

import torch

from common.errors import UserFacingError
from engine.optim import Optimizer

SYNC_RULES = ("every-step", "constant", "qsr", "linear", "post-local")


def qsr_period(lr: float, step: int, *, warmup_steps: int, total_steps: int, h_init: int, h_base: int,
               alpha: float, power: float = 2.0) -> int:
    """Length of the round that starts at 0-based global `step`, whose first step uses learning rate `lr`.

    The rule of Gu et al. 2024 exactly: H_init during warm-up or when alpha is 0, else
    max(H_base, floor((alpha / lr) ** power)); then capped so the round ends at the run's last step
    (total_steps), and at least 1. A learning rate of 0 makes the round last to the end of the run.
    """
    if step < warmup_steps or alpha == 0:
        period = h_init
    else:
        try:
            grown = int((alpha / lr) ** power) if lr > 0 else total_steps
        except OverflowError:  # a tiny lr: the round lasts to the end of the run
            grown = total_steps
        period = max(h_base, grown)
    return max(1, min(period, total_steps - step))


class SyncSchedule:
    """When the workers average. `round_length(step, lr)` at a round's first step (0-based global step
    and that step's learning rate); every round ends by the run's last step (`total_steps`)."""

    def __init__(self, rule: str, *, total_steps: int, H: int = 1, h_base: int = 1, h_init: int | None = None,
                 alpha: float = 0.0, power: float = 2.0, switch_step: int = 0, warmup_steps: int = 0):
        if rule not in SYNC_RULES:
            raise ValueError(f"unknown --sync {rule!r}; choose one of {', '.join(SYNC_RULES)}")
        self.rule, self.H, self.h_base, self.alpha = rule, H, h_base, alpha
        self.h_init = h_base if h_init is None else h_init
        self.power = {"qsr": power, "linear": 1.0}.get(rule, power)
        self.switch_step, self.warmup_steps, self.total_steps = switch_step, warmup_steps, total_steps

    def data_parallel(self, step: int) -> bool:
        """True for the steps that average gradients instead of stepping locally (post-local before
        its switch, and every step of every-step)."""
        return self.rule == "every-step" or (self.rule == "post-local" and step < self.switch_step)

    def round_length(self, step: int, lr: float) -> int:
        if self.data_parallel(step):
            return 1
        if self.rule in ("constant", "post-local"):
            return max(1, min(self.H, self.total_steps - step))
        return qsr_period(lr, step, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                          h_init=self.h_init, h_base=self.h_base, alpha=self.alpha, power=self.power)


class LocalWorkers:
    """This process's n_local workers, each with its own parameters and optimizer state.

    params:  (n_local, d) row j = local worker j's parameters (what its gradients are taken at)
    anchor:  (d,) the parameters of the last averaging step, the same on every rank
    averaged_state: names of the optimizer buffers averaged with the parameters ("exp_avg", "exp_avg_sq";
    AdamW only). `step(worker_grads, global_step)` applies one step: worker_grads (n_local, d) each
    worker's mean gradient over its own units at its own parameters. `end_epoch()` writes the mean of
    the workers' parameters into `flat` (the model's, for evaluation and checkpoints) and leaves the
    workers as they are.
    """

    def __init__(self, flat: torch.Tensor, comm, optimizer_name: str, lr_schedule, sync: SyncSchedule,
                 reducer, momentum: float = 0.0, weight_decay: float = 0.0, averaged_state: tuple = ()):
        self.flat, self.comm, self.sync, self.reducer = flat, comm, sync, reducer
        self.lr_schedule = lr_schedule
        n_local = len(comm.local_workers)
        self.anchor = flat.detach().clone()
        self.params = self.anchor.expand(n_local, -1).clone()
        self.optimizer = Optimizer(optimizer_name, self.params, lr_schedule, momentum, weight_decay)
        # only AdamW's moments may be averaged: the reference never averages SGD momentum
        unknown = set(averaged_state) - ({"exp_avg", "exp_avg_sq"} & set(self.optimizer.buffers))
        if unknown:
            raise UserFacingError(f"--avg-m / --avg-v average AdamW's moments; {optimizer_name} has no "
                                  f"{', '.join(sorted(unknown))} to average")
        self.averaged_state = tuple(averaged_state)  # names of optimizer buffers averaged with the parameters
        self.round_left = 0      # steps left in the current round (0: the next step starts a round)
        self.round_length = 0
        self.comm_bytes = 0      # summed over the n workers, as GradientExchange counts
        self._rounds, self._round_steps = 0, 0  # this epoch's averaging steps and the steps they closed

    @property
    def n(self) -> int:
        return self.comm.n_workers

    def step(self, gradients: torch.Tensor, global_step: int) -> bool:
        """One optimizer step of every local worker. gradients: (n_local, d) each worker's own gradient,
        or (d,) one averaged gradient for all (a data-parallel step); not modified.
        Returns True when the round is over: the caller then calls `average()`."""
        if self.round_left == 0:
            self.round_length = self.sync.round_length(global_step, self.lr_schedule(global_step))
            self.round_left = self.round_length
        self.optimizer.step(gradients)
        self.round_left -= 1
        if gradients.dim() == 1:  # every worker applied the same update: the rows are still equal
            self.anchor.copy_(self.params[0])
            self._rounds, self._round_steps = self._rounds + 1, self._round_steps + 1
            return False
        return self.round_left == 0

    def data_parallel(self, global_step: int) -> bool:
        """True when this step averages gradients (post-local before its switch) instead of stepping locally."""
        return self.sync.data_parallel(global_step)

    def average(self) -> None:
        """Replace every worker's parameters by the average over all n workers (one collective per
        process for the dense reducer; the reducer's collectives otherwise)."""
        buffers = [self.optimizer.buffers[name] for name in self.averaged_state]
        d = self.anchor.numel()
        if self.reducer.name == "dense":  # parameters and requested states in one flattened all-reduce
            stacked = torch.cat([self.params, *buffers], dim=1) if buffers else self.params
            mean = self.comm.all_reduce_sum(stacked) / self.n
            self.comm_bytes += self.n * stacked.shape[1] * stacked.element_size()
            self.anchor.copy_(mean[:d])
            buffer_means = mean[d:]
        else:  # each worker's change since the last averaging, sparsified with error feedback
            self.anchor += self.reducer.reduce(self.params - self.anchor)
            buffer_means = self.comm.all_reduce_sum(torch.cat(buffers, dim=1)) / self.n if buffers else None
            self.comm_bytes += self.n * len(buffers) * d * self.anchor.element_size()
        self.params.copy_(self.anchor.expand_as(self.params))
        for buffer, buffer_mean in zip(buffers, buffer_means.split(d) if buffers else ()):
            buffer.copy_(buffer_mean.expand_as(buffer))
        self._rounds += 1
        self._round_steps += self.round_length
        self.round_left = 0

    def end_epoch(self) -> None:
        """Put the mean of the n workers' parameters into `flat` for evaluation and the checkpoint,
        without averaging the workers: a round in progress goes on into the next epoch. The mean of a
        round in progress is one all-reduce of the parameters that is not training traffic, so it is
        not counted in comm_bytes."""
        if self.round_left == 0:  # the last step averaged: every row is the anchor already
            self.flat.copy_(self.anchor)
        else:
            self.flat.copy_(self.comm.all_reduce_sum(self.params) / self.n)

    def epoch_stats(self) -> dict:
        """This epoch's averaging count and the mean length of the rounds they closed, counting a
        round's steps in earlier epochs too (so over a whole run syncs x mean_H sums to its steps);
        mean_H is NaN in an epoch without an averaging. Resets both."""
        stats = {"syncs": self._rounds, "mean_H": self._round_steps / self._rounds if self._rounds else math.nan}
        self._rounds, self._round_steps = 0, 0
        return stats

    def state_dict(self) -> dict:
        """COLLECTIVE (every rank calls it): every worker's optimizer state, gathered to (n, d) rows."""
        optimizer = self.optimizer.state_dict()
        for key, buffer in self.optimizer.buffers.items():
            optimizer[key] = self.comm.all_gather(buffer).cpu()
        return {"optimizer": optimizer, "round_left": self.round_left, "round_length": self.round_length,
                "params": self.comm.all_gather(self.params).cpu(), "anchor": self.anchor.cpu()}

    def load_state_dict(self, state: dict) -> None:
        rows = self.comm.local_workers
        optimizer = dict(state["optimizer"])
        for key in self.optimizer.buffers:
            if key not in optimizer or optimizer[key].shape[0] != self.n:
                raise ValueError("the checkpoint's per-worker optimizer state does not match --node_cnt")
            optimizer[key] = optimizer[key][rows]
        self.optimizer.load_state_dict(optimizer)
        self.round_left, self.round_length = int(state["round_left"]), int(state["round_length"])
        if "params" in state:  # every worker's parameters: the round may be in progress
            if state["params"].shape != (self.n, self.anchor.numel()):
                raise ValueError("the checkpoint's per-worker parameters do not match --node_cnt")
            self.params.copy_(state["params"][rows])
            self.anchor.copy_(state["anchor"])
        else:  # written by a version that averaged at every epoch's end: `flat` is every worker's model
            self.anchor.copy_(self.flat)
            self.params.copy_(self.anchor.expand_as(self.params))


def check_sync_args(args) -> None:
    """One-line errors for the --sync flags."""
    if args.sync in ("constant", "post-local") and args.H < 1:
        raise UserFacingError(f"--H must be >= 1, got {args.H}")
    if args.sync in ("qsr", "linear"):
        if args.alpha is None or not math.isfinite(args.alpha) or args.alpha < 0:
            raise UserFacingError(f"--sync {args.sync} needs --alpha >= 0, got {args.alpha}")
        if args.H_base < 1 or (args.H_init is not None and args.H_init < 1):
            raise UserFacingError(f"--H-base and --H-init must be >= 1, got {args.H_base} and {args.H_init}")
        if args.sync == "qsr" and not (math.isfinite(args.power) and args.power > 0):
            raise UserFacingError(f"--power must be a positive number, got {args.power}")
    if getattr(args, "average_opt_state", False):
        raise UserFacingError("--average-opt-state is replaced by --avg-m and --avg-v (AdamW's first and second "
                              "moments); SGD momentum is never averaged under local steps")
    if (getattr(args, "avg_m", False) or getattr(args, "avg_v", False)) and args.sync == "every-step":
        raise UserFacingError("--avg-m / --avg-v average the workers' AdamW moments; they need local steps (--sync)")
    if args.sync == "post-local" and args.switch_epoch is None:
        raise UserFacingError("--sync post-local needs --switch-epoch E (data-parallel before epoch E)")
    if args.switch_epoch is not None and args.switch_epoch < 1:
        raise UserFacingError(f"--switch-epoch must be >= 1, got {args.switch_epoch}")
