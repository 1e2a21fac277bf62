"""Argument and state checks shared by the library's public classes: one clear line per bad input,
raised before anything reaches torch (a TypeError for a wrong type, a ValueError for a bad value)."""
import numbers
from collections.abc import Collection, Iterable
from typing import Literal, overload

import torch


class NonFiniteGradientError(ValueError):
    """A step's gradients hold NaN or inf (sorters with nonfinite="raise"); a ValueError.

    Args:
        message: the one line that names the step.
        epoch: the step's epoch, counted from 1 (the sorter's count).
        position: the step's first epoch position.
        unplaced: the message without its epoch (None: `message`).

    Attributes:
        epoch: as the argument: with `position`, says which step.
        position: as the argument.
        unplaced: the message without its epoch, for a caller that names the epoch in its own count
            (CDGraBSampler: from 0).
    """

    def __init__(self, message: str, epoch: int, position: int, unplaced: str | None = None):
        super().__init__(message)
        self.epoch, self.position = epoch, position
        self.unplaced = message if unplaced is None else unplaced


NONFINITE_MODES = ("raise", "skip")


@overload
def check_int(owner: str, name: str, value: object, minimum: int | None = None, maximum: int | None = None,
              none_ok: Literal[False] = False) -> int: ...


@overload
def check_int(owner: str, name: str, value: object, minimum: int | None = None, maximum: int | None = None,
              none_ok: bool = False) -> int | None: ...


def check_int(owner: str, name: str, value: object, minimum: int | None = None, maximum: int | None = None,
              none_ok: bool = False) -> int | None:
    """`value` as an int (Python, NumPy or 0-dim integer tensor; never a bool or a float such as 10.5)
    within [minimum, maximum]; None passes when none_ok."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) and not (
            torch.is_tensor(value) and value.dim() == 0 and not value.is_floating_point()
            and value.dtype != torch.bool):
        raise TypeError(f"{owner}: {name} must be an integer{' or None' if none_ok else ''}, got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = (f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}") if minimum is not None \
            else f"<= {maximum}"
        raise ValueError(f"{owner}: {name} must be {bounds}, got {value}")
    return value


def check_seed(owner: str, seed: object, name: str = "seed") -> int:
    """A seed torch.Generator.manual_seed takes: an integer in [-2**63, 2**64)."""
    return check_int(owner, name, seed, -2**63, 2**64 - 1)


def check_choice(owner: str, name: str, value: object, choices: Collection[str]) -> str:
    """`value` itself when it is one of the strings `choices`, else one line naming them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_device(owner: str, device: object) -> torch.device:
    """torch.device(device), or one line instead of torch's RuntimeError."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{owner}: device must be a str or torch.device (e.g. 'cpu', 'cuda:0'), got {device!r}")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"{owner}: device {device!r} is not a device name (e.g. 'cpu', 'cuda:0')") from None


def check_module(owner: str, model: object) -> None:
    """Refuse, in one line, a `model` that is not a torch.nn.Module."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{owner}: model must be a torch.nn.Module, got {type(model).__name__}")


def plural(count: int, noun: str) -> str:
    """'1 replica', '2 replicas': a count and its noun, for messages."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def check_no_dropout(owner: str, model: torch.nn.Module, trains: bool = False) -> None:
    """Refuse, in one line, a dropout module with p > 0 in training mode (any, with trains=True: the caller
    puts the model in training mode itself, as the HF Trainer does). Its masks make each example's gradient
    random, and they are drawn per process, so one process and N processes hosting the same replicas would
    balance other gradients and give other orders; per-example gradients formed by torch.func cannot replay
    them at all. The one message of every path (formed gradients, layer records, sketches, the Trainer)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0 and (module.training or trains):
            fix = "" if trains else ", or call model.eval() while computing them"
            raise ValueError(f"{owner}: module {name or 'model'!r} is {type(module).__name__}(p={module.p}) in "
                             "training mode; per-example gradients need a model without randomness (dropout masks "
                             "differ between one process and N, and so would the orders): set its p to 0 "
                             "(transformers: the config's dropout fields, e.g. resid_pdrop, embd_pdrop, attn_pdrop = "
                             f"0.0){fix}")


def check_state_keys(owner: str, state: object, required: Iterable[object], what: str = "state_dict()") -> None:
    """`state` must be a dict holding every key of `required`: else one line naming the missing ones."""
    if not isinstance(state, dict):
        raise TypeError(f"{owner}: load_state_dict takes the dict that {what} returned, got {type(state).__name__}")
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(f"{owner}: not a state saved by {what}: missing {', '.join(map(str, missing))}")
