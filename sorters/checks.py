"""Argument and state checks shared by the library's public classes: one clear line per bad input,
raised before anything reaches torch (a TypeError for a wrong type, a ValueError for a bad value)."""
import numbers

import torch


class NonFiniteGradientError(ValueError):
    """A step's gradients hold NaN or inf (sorters with nonfinite="raise"). `epoch` (1-based, the
    sorter's count) and `position` (the step's first epoch position) say which step."""

    def __init__(self, message: str, epoch: int, position: int):
        super().__init__(message)
        self.epoch, self.position = epoch, position


NONFINITE_MODES = ("raise", "skip")


def check_int(owner: str, name: str, value, minimum: int | None = None, maximum: int | None = None,
              none_ok: bool = False):
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


def check_seed(owner: str, seed, name: str = "seed") -> int:
    """A seed torch.Generator.manual_seed takes: an integer in [-2**63, 2**64)."""
    return check_int(owner, name, seed, -2**63, 2**64 - 1)


def check_choice(owner: str, name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_device(owner: str, device) -> torch.device:
    """torch.device(device), or one line instead of torch's RuntimeError."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{owner}: device must be a str or torch.device (e.g. 'cpu', 'cuda:0'), got {device!r}")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"{owner}: device {device!r} is not a device name (e.g. 'cpu', 'cuda:0')") from None


def check_module(owner: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{owner}: model must be a torch.nn.Module, got {type(model).__name__}")


def check_state_keys(owner: str, state, required, what: str = "state_dict()") -> None:
    """`state` must be a dict holding every key of `required`: else one line naming the missing ones."""
    if not isinstance(state, dict):
        raise TypeError(f"{owner}: load_state_dict takes the dict that {what} returned, got {type(state).__name__}")
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(f"{owner}: not a state saved by {what}: missing {', '.join(map(str, missing))}")
