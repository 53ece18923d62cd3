"""Argument checks that the public Python entry points make before the kernels run.

The C++ entry points validate what they are handed: dtypes, shapes, layouts,
devices and overlapping outputs (csrc/common/validate.cpp). Three things can
only be checked here:

- Tensor-ness and one device for every argument, before dispatch. The
  dispatcher reports a non-tensor as a RuntimeError, and one 'meta' argument
  among CPU tensors routes the whole call to the fake implementation, which
  returns uninitialized memory (or, for an in-place op, does nothing).
- Scale values. A scale of 0, inf or NaN (or one whose reciprocal overflows)
  is defined by the kernels' math but turns every output into NaN or inf.
  Reading the value of a CUDA tensor is a device-to-host sync, so values are
  checked only on the CPU, inside the ops' implementations: eager calls,
  ``torch.compile`` graphs and ``torch.export`` programs raise the same
  error, without a graph break.
- The devices of a Linear layer's parameters and ``weight.main_grad``
  against its input (:func:`check_linear_devices`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch

__all__ = ["check_linear_devices", "check_same_device", "check_scale_values", "check_tensor"]

# Below this a float32's reciprocal may round to inf; above it, it never does.
_RECIPROCAL_SAFE = torch.finfo(torch.float32).tiny


def check_tensor(op: str, name: str, t: object, like: Optional[torch.Tensor] = None, like_name: str = "input") -> None:
    """Raise unless ``t`` is a tensor (on ``like``'s device when given).

    Raises:
        TypeError: naming the argument and what was expected.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if like is not None and t.device != like.device:
        raise TypeError(f"{op}: argument '{name}' must be on {like.device} like '{like_name}', got {t.device}")


def check_same_device(op: str, tensors: Mapping[str, Optional[torch.Tensor]], optional: tuple[str, ...] = ()) -> None:
    """Raise unless every tensor is a tensor on the device of the first one.

    Args:
        op: the operation's name, for the message.
        tensors: argument name -> value, the reference first.
        optional: names whose value may be None (an absent optional argument).

    Raises:
        TypeError: a value is not a tensor, or is on another device.
    """
    first_name, first = next(iter(tensors.items()))
    check_tensor(op, first_name, first)
    for name, t in tensors.items():
        if t is None and name in optional:
            continue
        check_tensor(op, name, t, like=first, like_name=first_name)


def check_scale_values(op: str, scales: Mapping[str, Optional[torch.Tensor]], reciprocal: bool = False) -> None:
    """Raise unless each one-element float32 CPU scale is positive and finite.

    Tensors on other devices, absent ones and malformed ones (another dtype or
    size, which the kernels reject with their own message) pass unchecked.

    Args:
        op: the operation's name, for the message.
        scales: argument name -> scale tensor (or None).
        reciprocal: also require a finite float32 reciprocal (a scale whose
            ``scale_inv`` the op returns: 1e-45 would give inf).

    Raises:
        ValueError: naming the argument and its value.
    """
    for name, t in scales.items():
        if t is None or not t.is_cpu or t.dtype != torch.float32 or t.numel() != 1:
            continue
        value = t.item()
        ok = math.isfinite(value) and value > 0
        if ok and reciprocal and value < _RECIPROCAL_SAFE:
            ok = math.isfinite(torch.reciprocal(t).item())
        if not ok:
            what = "with a finite reciprocal " if reciprocal else ""
            raise ValueError(f"{op}: argument '{name}' must be a positive finite scale {what}(float32), got {value!r}")


def check_linear_devices(
    inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], main_grad: Optional[torch.Tensor]
) -> None:
    """Raise unless a Linear layer's parameters and ``main_grad`` are on its input's device.

    Raises:
        TypeError: naming the parameter and both devices.
    """
    check_same_device(
        "Linear",
        {"inp": inp, "weight": weight, "bias": bias, "weight.main_grad": main_grad},
        optional=("bias", "weight.main_grad"),
    )
