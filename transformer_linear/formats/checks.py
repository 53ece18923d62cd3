"""Argument checks that the public Python entry points make before the kernels run.

The C++ entry points validate what they are handed: dtypes, shapes, layouts,
devices and overlapping outputs (csrc/common/validate.cpp). Three things can
only be checked here:

- Tensor-ness and one device for every argument, before dispatch. The
  dispatcher reports a non-tensor as a RuntimeError, and one 'meta' argument
  among CPU tensors routes the whole call to the fake implementation, which
  returns uninitialized memory (or, for an in-place op, does nothing). So
  each custom op's fake implementation checks the devices too (a call through
  ``torch.ops`` meets no public function first); values read on the host
  (seeds, handles) may be CPU tensors whatever the device (:func:`check_host_tensor`).
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

from transformer_linear.formats.dtypes import E8M0_DTYPE, FP8_DTYPES, HIGH_PRECISION_DTYPES

__all__ = [
    "check_fp8_dtype",
    "check_host_tensor",
    "check_hp_dtype",
    "check_linear_devices",
    "check_margin",
    "check_same_device",
    "check_scale_values",
    "check_tensor",
    "gemm_out_shape",
]

# Below this a float32's reciprocal may round to inf; above it, it never does.
_RECIPROCAL_SAFE = torch.finfo(torch.float32).tiny
# E8M0's one non-number: the all-ones exponent byte.
_E8M0_NAN_BITS = 0xFF


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


def check_host_tensor(op: str, name: str, t: object, like: torch.Tensor, like_name: str) -> None:
    """Raise unless ``t`` is a tensor on the CPU or on ``like``'s device: a value the op reads on the host (a
    stochastic-rounding seed, a handle), made on the CPU whatever the device of the other arguments.

    Raises:
        TypeError: naming the argument and its device (a 'meta' one among CPU tensors included).
    """
    check_tensor(op, name, t)
    if t.device.type != "cpu":
        check_tensor(op, name, t, like=like, like_name=like_name)


def check_scale_values(op: str, scales: Mapping[str, Optional[torch.Tensor]], reciprocal: bool = False) -> None:
    """Raise unless every element of each float32 or E8M0 CPU scale is positive and finite.

    Tensors on other devices (reading them would sync the device), absent
    ones and those of other dtypes (which the kernels reject with their own
    message) pass unchecked. Block scales are checked element by element.
    E8M0 scales are ``torch.float8_e8m0fnu`` tensors, never their uint8 bits
    (the block ops reject uint8 scales by dtype); E8M0's NaN byte 0xFF raises.

    Args:
        op: the operation's name, for the message.
        scales: argument name -> scale tensor (or None).
        reciprocal: also require a finite float32 reciprocal (a scale whose
            ``scale_inv`` the op returns: 1e-45 would give inf).

    Raises:
        ValueError: naming the argument, and the first bad element's index and value.
    """
    for name, t in scales.items():
        if t is None or not t.is_cpu or t.numel() == 0:
            continue
        if t.dtype == E8M0_DTYPE:
            bad = t.view(torch.uint8).eq(_E8M0_NAN_BITS)  # every other E8M0 value is a positive power of two
        elif t.dtype != torch.float32:
            continue
        elif t.numel() == 1:  # the per-tensor common case, without building masks
            value = t.item()
            ok = math.isfinite(value) and value > 0
            if ok and reciprocal and value < _RECIPROCAL_SAFE:
                ok = math.isfinite(torch.reciprocal(t).item())
            bad = None if ok else t.new_ones(t.shape, dtype=torch.bool)
        else:
            bad = ~(torch.isfinite(t) & t.gt(0))
            if reciprocal:
                bad |= ~torch.isfinite(torch.reciprocal(t))
        if bad is not None and bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            value = t[index].float().item() if t.dim() else t.float().item()
            where = f" at index {list(index)}" if t.numel() > 1 else ""
            what = "with a finite reciprocal " if reciprocal else ""
            raise ValueError(
                f"{op}: argument '{name}' must be a positive finite scale {what}({t.dtype}), got {value!r}{where}"
            )


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


def check_fp8_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    """Raise a TypeError unless ``dtype`` is an FP8 format."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def check_hp_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    """Raise a TypeError unless ``dtype`` is float32, bfloat16 or float16."""
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")


def check_margin(op: str, margin: int) -> None:
    """Raise a ValueError unless ``margin`` is an integer in [0, 127)."""
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin < 127:
        raise ValueError(f"{op}: argument 'margin' must be an integer in [0, 127), got {margin!r}")


def gemm_out_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(M, N) of ``a @ b.T``; a ValueError unless both are 2-D."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"fp8_gemm: 'a' and 'b' must be 2-D, got shapes {list(a.shape)} and {list(b.shape)}")
    return (a.shape[0], b.shape[0])
