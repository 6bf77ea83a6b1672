"""Argument checks shared by the public API: each raises naming the argument and what it expects
(as nn.Linear does), so that nonsense input never reaches the C core."""
from __future__ import annotations

import math
import numbers
import os


# the longest wait for a peer the core accepts (axc/comm.h AXC_MAX_TIMEOUT_S): larger values,
# NaN and infinities would overflow its nanosecond deadlines
MAX_TIMEOUT_S = 604800.0


def check_int(name: str, value, lo: int = 1, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]: a bool, float or str is a TypeError, out of range a
    ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_bool(name: str, value, none_ok: bool = False):
    """`value` as a bool (or None, with none_ok): anything else, "False" and 0 too, is a
    TypeError (a truthy string would silently mean True). A numpy bool (a config read into an
    array) is a bool."""
    if isinstance(value, bool) or (none_ok and value is None):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be a bool{' or None' if none_ok else ''}, got {value!r}")


def check_timeout(timeout, name: str = "timeout") -> float:
    """A wait bound in seconds: a finite number in (0, MAX_TIMEOUT_S]."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(timeout).__name__} "
                        f"{timeout!r}")
    t = float(timeout)
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S):
        raise ValueError(f"{name} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:.0f}],"
                         f" got {timeout!r}")
    return t


def timeout_from_env(default: float) -> float:
    """AXONN_C_TIMEOUT, checked as init's timeout is; `default` when unset."""
    raw = os.environ.get("AXONN_C_TIMEOUT")
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable AXONN_C_TIMEOUT={raw!r} is not a number of "
                         "seconds") from None
    return check_timeout(value, f"environment variable AXONN_C_TIMEOUT={raw!r}: the timeout")


def check_tensor(name: str, value, ndim_min: int = 0):
    """A torch.Tensor with at least `ndim_min` dimensions, whose data_ptr() is torch's."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if type(value).data_ptr is not torch.Tensor.data_ptr:  # the core would read that pointer
        raise TypeError(f"{name} is a {type(value).__name__}, a tensor subclass with its own "
                        "data_ptr(); pass x.as_subclass(torch.Tensor)")
    if value.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimension(s), got shape "
                         f"{tuple(value.shape)}")
    return value


def check_module(name: str, value):
    """A torch.nn.Module."""
    import torch

    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def check_number(name: str, value, finite: bool = False, positive: bool = False) -> float:
    """A real number (not a bool); `finite`: no NaN or infinity; `positive`: > 0 (not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_params(name: str, parameters) -> list:
    """A tensor or an iterable of tensors, as a list."""
    import torch

    if isinstance(parameters, torch.Tensor):
        return [parameters]
    try:
        params = list(parameters)
    except TypeError:
        raise TypeError(f"{name} must be a tensor or an iterable of tensors, got "
                        f"{type(parameters).__name__}") from None
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(p).__name__}")
    return params


def check_grad_attr(model, name) -> str:
    """sync_gradients' gradient_attr_name: a str that at least one parameter has as an
    attribute (the same model on every rank, so every rank agrees)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"sync_gradients: gradient_attr_name must be a non-empty str, got "
                        f"{name!r}")
    params = [] if name == "grad" else list(model.parameters())  # (.grad: every tensor has it)
    if params and not any(hasattr(p, name) for p in params):
        raise ValueError(f"sync_gradients: no parameter of the model has the attribute "
                         f"gradient_attr_name={name!r} (expected 'grad' or the attribute that "
                         "holds the gradients, e.g. 'main_grad')")
    return name
