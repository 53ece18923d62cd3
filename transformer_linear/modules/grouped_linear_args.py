"""The argument bundles of the grouped (mixture-of-experts) Linear's op: what ``grouped_linear_fwd`` takes
(:class:`GroupedLinearFwdArgs`, its op schema derived from the fields by ``linear_args.args_op``) and returns
(:class:`GroupedLinearFwdOutputs`), and what the grouped weight gradient reads (:class:`GroupedWgradArgs`).
The op and its autograd are in grouped_linear_ops.py.
"""

# No ``from __future__ import annotations``: args_op reads the op schema from the field annotations.

import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.recipe.delayed_scaling import DelayedScalingArgs
from transformer_linear.recipe.quantization import QuantizationSpec, TensorQuantizer

__all__ = ["GroupedLinearFwdArgs", "GroupedLinearFwdOutputs", "GroupedWgradArgs"]


@dataclasses.dataclass(slots=True)
class GroupedLinearFwdArgs:
    """Everything ``grouped_linear_fwd`` needs; one field = one op argument (a config: one per leaf)."""

    inp: Tensor
    """(total_tokens, in_features): the tokens of every expert, expert by expert."""
    weight: Tensor
    """(num_gemms, out_features, in_features): one weight per expert."""
    bias: Optional[Tensor]
    """(num_gemms, out_features) or None."""
    cached_weight: Optional[CachedWeight]
    """is_first_microbatch=False: the experts' FP8 weights to reuse (stacked: (num_gemms, ...) each); None
    quantizes the weight."""
    offs: Tensor
    """(num_gemms,) int32 cumulative row ends (torch._grouped_mm's)."""
    input_requires_grad: bool
    weight_requires_grad: bool
    bias_requires_grad: bool
    quantization: QuantizationSpec
    """The quantizers of input, weight and grad_output (quantization.py)."""
    delayed: Optional[DelayedScalingArgs]
    """The module's delayed-scaling state where the quantizers take their scales from it, else None."""
    out_dtype: torch.dtype
    main_grad: Optional[Tensor]
    """fuse_wgrad_accumulation: the (num_gemms, out_features, in_features) fp32 buffer backward adds wgrad to."""
    wgrad_queue: int
    """delay_wgrad_compute: handle (_handles.py) of the module's WgradQueue, which backward_dw() drains; -1 off."""


class GroupedLinearFwdOutputs(NamedTuple):
    """What ``grouped_linear_fwd`` returns (unused slots are empty tensors); only ``out`` has a gradient."""

    out: Tensor
    """(total_tokens, out_features); rows past offs[-1] are 0."""
    inp_fp8: Tensor
    """What wgrad reads: one scale per tensor, the (total_tokens, in_features) rowwise data (the grouped
    wgrad contracts over rows); block scales, the (in_features, total_tokens) grouped columnwise copy
    (empty when the weight needs no gradient)."""
    inp_scale_inv: Tensor
    """inp_fp8's scales: one element, or the grouped columnwise copy's grid, flat (1-D)."""
    weight_fp8: Tensor
    """(num_gemms, out_features, in_features) FP8: each expert's rowwise weight, what the forward GEMM read
    (empty when a cached weight was given); the module caches it for is_first_microbatch."""
    weight_fp8_t: Tensor
    """(num_gemms, in_features, out_features) FP8: each expert's weight transposed (block scales: its
    columnwise copy), what dgrad reads (empty when the input needs no gradient or a cached weight was given)."""
    weight_scale_inv: Tensor
    """weight_fp8's scales: (num_gemms,), or (num_gemms, ...) block scales of each expert."""
    weight_scale_inv_t: Tensor
    """weight_fp8_t's scales: (num_gemms,) (the rowwise ones), or (num_gemms, ...) block scales of each copy."""
    amax: Tensor
    """(2,) amaxes of [input, weight (over all experts)] for the delayed-scaling update, else empty."""
    grad_output_scale: Tensor
    """Delayed scaling: grad_output's scale as of this forward (negated: backward computes one just in time)."""
    fwd_scales: Tensor
    """Delayed scaling: the scales this forward used for [input, weight, grad_output]."""


@dataclasses.dataclass(frozen=True)
class GroupedWgradArgs:
    """What the grouped weight gradient reads; backward runs it, or queues it for ``backward_dw()``."""

    grad_output: Tensor
    """grad_output as the grouped weight gradient reads it (ScalingKind.grouped_columnwise: the rowwise FP8
    data under one scale per tensor, a grouped columnwise copy under block scales, NVFP4's compact masked
    copies); without FP8 the high-precision gradient."""
    grad_output_scale_inv: Optional[Tensor]
    """Its scales; None without FP8."""
    inp: Tensor
    """As GroupedLinearFwdOutputs.inp_fp8 (without FP8: the high-precision input)."""
    inp_scale_inv: Optional[Tensor]
    """Its scales; None without FP8."""
    offs: Tensor
    wgrad_dtype: torch.dtype
    quantizer: Optional[TensorQuantizer]
    """grad_output's quantizer, whose scaling kind computes the gradient (ScalingKind.grouped_wgrad); None:
    high precision."""
