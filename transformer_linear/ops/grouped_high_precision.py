"""The grouped GEMMs of a high-precision backward (``backward_override``): dgrad and wgrad per group.

``grouped_mm_dgrad``: ``out[rows of g] = grad[rows of g] @ weight[g]`` (rows past ``offs[-1]`` zero);
``grouped_mm_wgrad``: ``out[g] = grad[rows of g]ᵀ @ inp[rows of g]``. Each runs one ``torch.mm`` per
group in ``grad``'s dtype (the other operand cast to it), as a high-precision Linear's backward does, and
returns ``out_dtype``. They read ``offs`` on the host (a device sync on a GPU: the group sizes become
Python ints); as ``torch.library`` custom ops whose fake implementations take their shapes from the
operands alone, ``torch.compile`` traces them as one node for any routing.
"""

from __future__ import annotations

import torch

from transformer_linear.formats.checks import check_same_device
from transformer_linear.formats.grouped_scaling import check_offs
from transformer_linear.ops import library

__all__ = ["group_ends", "grouped_mm_dgrad", "grouped_mm_wgrad"]


def group_ends(op: str, offs: torch.Tensor, total_tokens: int) -> list[int]:
    """``[0, *offs]`` as Python ints, read on the host and checked as the FP8 grouped GEMMs check them.

    Raises:
        ValueError: ``offs`` decreasing, negative, or past ``total_tokens`` (slices of the operands would
            otherwise run past them, or silently take a negative length).
    """
    ends = [0, *(int(e) for e in offs.tolist())]
    for g in range(1, len(ends)):
        if ends[g] < ends[g - 1]:
            after = f", after offs[{g - 2}] = {ends[g - 1]}" if g > 1 else ""
            raise ValueError(f"{op}: argument 'offs' must be non-decreasing and non-negative, got offs[{g - 1}] = "
                             f"{ends[g]}{after}")
    if ends[-1] > total_tokens:
        raise ValueError(f"{op}: argument 'offs' must not pass the {total_tokens} rows of the tokens, got "
                         f"offs[{len(ends) - 2}] = {ends[-1]}")
    return ends


def _check_args(op: str, grad: torch.Tensor, other_name: str, other: torch.Tensor, offs: torch.Tensor,
                groups: int) -> None:
    """One device (a meta argument would route the call to the fake implementation) and an int32 ``offs``
    of one entry per group; the values of ``offs`` are :func:`group_ends`' to check."""
    check_same_device(op, {"grad": grad, other_name: other, "offs": offs})
    check_offs(op, offs, groups)


@library.custom_op("transformer_linear::grouped_mm_dgrad", mutates_args=())
def grouped_mm_dgrad(
    grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(total_tokens, in_features): ``grad[rows of g] @ weight[g]`` per group, rows past offs[-1] zero.

    Args:
        grad: (total_tokens, out_features).
        weight: (num_gemms, out_features, in_features).
        offs: (num_gemms,) int32 cumulative row ends.
        out_dtype: the result's dtype.
    """
    _check_args("grouped_mm_dgrad", grad, "weight", weight, offs, weight.shape[0])
    ends = group_ends("grouped_mm_dgrad", offs, grad.shape[0])
    out = grad.new_zeros((grad.shape[0], weight.shape[2]), dtype=out_dtype)
    for g in range(weight.shape[0]):
        out[ends[g] : ends[g + 1]] = torch.mm(grad[ends[g] : ends[g + 1]], weight[g].to(grad.dtype)).to(out_dtype)
    return out


@grouped_mm_dgrad.register_fake
def _(grad, weight, offs, out_dtype):
    _check_args("grouped_mm_dgrad", grad, "weight", weight, offs, weight.shape[0])
    return grad.new_empty((grad.shape[0], weight.shape[2]), dtype=out_dtype)


@library.custom_op("transformer_linear::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(
    grad: torch.Tensor, inp: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(num_gemms, out_features, in_features): ``grad[rows of g]ᵀ @ inp[rows of g]`` per group.

    Args:
        grad: (total_tokens, out_features).
        inp: (total_tokens, in_features).
        offs: (num_gemms,) int32 cumulative row ends.
        out_dtype: the result's dtype.
    """
    _check_args("grouped_mm_wgrad", grad, "inp", inp, offs, offs.numel())
    ends = group_ends("grouped_mm_wgrad", offs, grad.shape[0])
    out = grad.new_empty((offs.shape[0], grad.shape[1], inp.shape[1]), dtype=out_dtype)
    for g in range(offs.shape[0]):
        rows = slice(ends[g], ends[g + 1])
        out[g] = torch.mm(grad[rows].t(), inp[rows].to(grad.dtype)).to(out_dtype)
    return out


@grouped_mm_wgrad.register_fake
def _(grad, inp, offs, out_dtype):
    _check_args("grouped_mm_wgrad", grad, "inp", inp, offs, offs.numel())
    return grad.new_empty((offs.shape[0], grad.shape[1], inp.shape[1]), dtype=out_dtype)
