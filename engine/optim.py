"""SGD (with momentum) and AdamW on the flat parameter vector, with ONE state for the whole run.

The original code rebuilt parts of the optimizer state every epoch (bug 3 in docs/differences.md: Adam's
bias-correction count restarted at 1 each epoch); here the state lives as long as the run and
is saved in checkpoints. The updates are torch.optim's SGD and AdamW (single-tensor) rules written
out on one (d,) tensor: a couple of in-place ops per step instead of a per-parameter framework
loop, and a learning rate and step count kept on the host, so a step never waits for the device.
"""
import math

import torch


class LRSchedule:
    """Learning rate of each 0-based global step, from a host-side step count (no device read).

    kind "step": the benchmark's paper schedule, lr * gamma ** (completed_epochs // every_epochs)
    (every_epochs None: constant). "cosine": from lr down to min_lr along half a cosine over the
    steps after warm-up. "linear": from lr down to min_lr linearly. Every kind first warms up
    linearly from min_lr over `warmup_epochs` (may be fractional): warm-up step s uses
    min_lr + (lr - min_lr) * s / warmup_steps, the rule of the QSR reference scheduler (Gu et al.
    2024), so step 0 uses min_lr and the first step after warm-up uses lr. cosine and
    linear reach min_lr at the run's last step (total_epochs), so they depend on --epochs.
    A resumed run gets the same learning rates: they depend on the step count alone.
    """

    KINDS = ("step", "cosine", "linear")

    def __init__(self, lr: float, steps_per_epoch: int, every_epochs: int | None = None, gamma: float = 1.0,
                 kind: str = "step", total_epochs: int | None = None, warmup_epochs: float = 0.0,
                 min_lr: float = 0.0):
        if kind not in self.KINDS:
            raise ValueError(f"unknown learning-rate schedule {kind!r}; choose one of {', '.join(self.KINDS)}")
        if kind != "step" and not total_epochs:
            raise ValueError(f"the {kind} schedule needs total_epochs")
        self.lr, self.steps_per_epoch = lr, steps_per_epoch
        self.every_epochs, self.gamma = every_epochs, gamma
        self.kind, self.min_lr = kind, min_lr
        self.warmup_steps = round(warmup_epochs * steps_per_epoch)
        self.total_steps = (total_epochs or 0) * steps_per_epoch

    def at_epoch(self, epoch: int) -> float:
        """The step schedule's learning rate during 1-based `epoch` (warm-up aside)."""
        if not self.every_epochs:
            return self.lr
        return self.lr * self.gamma ** ((epoch - 1) // self.every_epochs)

    def __call__(self, step: int) -> float:
        """Learning rate of 0-based global step `step` (a host int)."""
        step = int(step)
        if step < self.warmup_steps:
            return self.min_lr + (self.lr - self.min_lr) * step / self.warmup_steps
        if self.kind == "step":
            return self.at_epoch(step // self.steps_per_epoch + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.kind == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2
        return self.min_lr + (self.lr - self.min_lr) * (1 - progress)


class Optimizer:
    """SGD (momentum, weight decay; torch.optim.SGD's rule) or AdamW (torch.optim.AdamW's rule, betas
    0.9/0.999, eps 1e-8) on a flat (d,) parameter tensor, updated in place.

    `step(gradient)` uses the learning rate `schedule(count)` of its own host-side step count.
    """

    def __init__(self, name: str, flat: torch.Tensor, schedule: LRSchedule, momentum: float = 0.0,
                 weight_decay: float = 0.0, betas: tuple = (0.9, 0.999), eps: float = 1e-8):
        if name not in ("sgd", "adamw"):
            raise ValueError(f"unknown optimizer {name!r}")
        self.name, self.flat, self.schedule = name, flat, schedule
        self.momentum, self.weight_decay, self.betas, self.eps = momentum, weight_decay, betas, eps
        self.count = 0  # steps taken over the whole run
        if name == "sgd":
            self.buffers = {"momentum": torch.zeros_like(flat)} if momentum else {}
        else:
            self.buffers = {"exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}

    def step(self, gradient: torch.Tensor) -> None:
        """gradient: (d,) the global-batch gradient (not modified)."""
        lr = self.schedule(self.count)
        self.count += 1
        if self.name == "sgd":
            self._sgd(gradient, lr)
        else:
            self._adamw(gradient, lr)

    def _sgd(self, g, lr):
        if self.weight_decay:
            g = g.add(self.flat, alpha=self.weight_decay)
        if self.momentum:
            # torch initialises the buffer with the first gradient; 0.9 * 0 + g is the same number
            g = self.buffers["momentum"].mul_(self.momentum).add_(g)
        self.flat.add_(g, alpha=-lr)

    def _adamw(self, g, lr):
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = self.buffers["exp_avg"], self.buffers["exp_avg_sq"]
        self.flat.mul_(1 - lr * self.weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** self.count
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** self.count)
        denominator = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        self.flat.addcdiv_(exp_avg, denominator, value=-lr / bias_correction1)

    def state_dict(self) -> dict:
        return {"name": self.name, "count": self.count, **{k: v.clone() for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("name") != self.name or set(state) - {"name", "count"} != set(
                self.buffers):
            raise ValueError("optimizer state in the checkpoint does not match this optimizer")
        self.count = int(state["count"])
        for key, buffer in self.buffers.items():
            buffer.copy_(state[key])
