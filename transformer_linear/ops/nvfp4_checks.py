"""Argument checks the NVFP4 ops' public functions share (ops.nvfp4_quantize, ops.nvfp4_gemm): a global
amax or scale, the device of a tensor, an integer's range (a stochastic-rounding seed or offset)."""

from __future__ import annotations

import math

import torch

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_scalar(op: str, name: str, t: torch.Tensor, what: str) -> None:
    """A float32 one-element tensor whose value (when it can be read: CPU) is finite and, for amax, >= 0."""
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: argument '{name}' must be a float32 tensor, got {t.dtype}")
    if t.numel() != 1 or t.dim() > 1:
        raise ValueError(
            f"{op}: argument '{name}' must be a one-element tensor of shape [] or [1], got {list(t.shape)}"
        )
    if t.device.type != "cpu" or isinstance(t, torch._subclasses.FakeTensor):
        return
    value = float(t.reshape(()))
    if not math.isfinite(value) or (what == "amax" and value < 0):
        bound = "finite and non-negative" if what == "amax" else "finite"
        raise ValueError(f"{op}: argument '{name}' must be {bound} (a global {what}), got {value}")


def check_device_type(op: str, name: str, t: torch.Tensor) -> None:
    """A tensor on the CPU, a CUDA GPU or 'meta'."""
    # A tensor on 'meta' alone is shape inference (the fake implementation answers it).
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise TypeError(f"{op}: argument '{name}' must be on cpu or cuda (the NVFP4 kernels' devices), got {t.device}")


def check_int(op: str, name: str, value: object, low: int, high: int) -> None:
    """An int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{op}: argument '{name}' must be an integer in [{low}, {high}], got {value!r}")
