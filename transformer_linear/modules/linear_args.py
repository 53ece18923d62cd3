"""The argument bundles of the Linear forward and backward.

``LinearFwdArgs`` / ``LinearBwdArgs`` are what the module and the autograd
rule pass around; ``ops.args_op`` registers the Linear's custom ops on them (a
field is a parameter, a config's tensors one list, the plain values one
options string), so adding a field is the only edit a new argument needs.
"""

# No ``from __future__ import annotations``: ops.args_op reads the field
# annotations, which must be real types.

import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear.recipe.delayed_scaling import DelayedScalingArgs
from transformer_linear.recipe.quantization import NO_QUANTIZATION, QuantizationSpec, Quantized

__all__ = [
    "CachedWeight",
    "LinearBwdArgs",
    "LinearBwdContext",
    "LinearFwdArgs",
    "LinearFwdOutputs",
]


@dataclasses.dataclass(frozen=True)
class CachedWeight:
    """The FP8 weight of the current microbatch group (``is_first_microbatch=False`` reuses it)."""

    weight_fp8: Tensor
    """Row-major (out_features, in_features)."""
    weight_fp8_t: Optional[Tensor]
    """The columnwise copy where layout.py needs one (and under block scaling), else None."""
    weight_scale_inv: Tensor
    weight_scale_inv_t: Optional[Tensor]
    """Block scaling: the scales of ``weight_fp8_t``, else None."""
    weight_amax: Optional[Tensor]
    """Tensorwise scaling: the weight's amax, which delayed scaling records (block scaling records none)."""

    def quantized(self) -> Quantized:
        """The cached weight as its quantizer returned it (absent usages empty)."""
        empty_fp8 = self.weight_fp8.new_empty(0)
        empty_scale = self.weight_scale_inv.new_empty(0)
        return Quantized(
            self.weight_fp8,
            self.weight_scale_inv,
            self.weight_fp8_t if self.weight_fp8_t is not None else empty_fp8,
            self.weight_scale_inv_t if self.weight_scale_inv_t is not None else empty_scale,
            self.weight_amax,
        )


@dataclasses.dataclass(slots=True)
class LinearFwdArgs:
    """Everything ``linear_fwd`` needs; one field = one op argument (a config: one per leaf)."""

    # --- tensors ---
    inp: Tensor
    """(..., in_features) activation."""
    weight: Tensor
    """(out_features, in_features)."""
    bias: Optional[Tensor]
    cached_weight: Optional[CachedWeight]
    """is_first_microbatch=False: the FP8 weight to reuse; None quantizes the weight."""
    # --- requires-grad flags ---
    input_requires_grad: bool
    weight_requires_grad: bool
    bias_requires_grad: bool
    # --- FP8 formats and scaling state ---
    fp8: bool
    """False: high-precision GEMMs (used only for the wgrad options without FP8)."""
    quantization: QuantizationSpec
    """The quantizers of input, weight and grad_output (quantization.py): their dtypes, scales and
    layouts; without FP8 only their dtypes are read."""
    delayed: Optional[DelayedScalingArgs]
    """The delayed-scaling state, given where the quantizers take their scales from it
    (``quantization.scale_from_history``); else None."""
    # --- options ---
    out_dtype: torch.dtype
    """The output dtype: the input's, or the enclosing torch.autocast dtype."""
    main_grad: Optional[Tensor]
    """fuse_wgrad_accumulation: fp32 buffer backward accumulates wgrad into."""
    wgrad_queue: int
    """delay_wgrad_compute: handle (_handles.py) of the layer's queue backward_dw() drains; -1 when off."""


@dataclasses.dataclass(slots=True)
class LinearBwdArgs:
    """What ``linear_dgrad`` / ``linear_wgrad`` need; each op takes a subset
    (so a graph pass can split them: dgrad never sees the input, wgrad never the weight)."""

    # --- grad_output, quantized (or high precision without FP8) ---
    grad_output: Tensor
    """(M, out_features) row-major."""
    grad_output_t: Optional[Tensor]
    """For wgrad: the columnwise usage of grad_output (TensorQuantizer.columnwise_usage): layout.saved_form
    of grad_output (the same tensor on the CPU), or its columnwise copy (out_features, M)."""
    grad_output_scale_inv: Optional[Tensor]
    grad_output_t_scale_inv: Optional[Tensor]
    """The scales of ``grad_output_t`` (tensorwise: ``grad_output_scale_inv`` itself)."""
    # --- tensors saved by forward: their quantizers' columnwise usage (TensorQuantizer.columnwise_usage;
    # each quantizer's columnwise_operand makes the GEMM operand of it) ---
    inp: Tensor
    inp_scale_inv: Optional[Tensor]
    weight: Tensor
    weight_scale_inv: Optional[Tensor]
    # --- results ---
    input_shape: list[int]
    """The shape dgrad is returned in."""
    dgrad_dtype: torch.dtype
    wgrad_dtype: torch.dtype
    # --- how the operands were quantized ---
    quantization: QuantizationSpec = NO_QUANTIZATION
    """The quantizers, which say how a GEMM reads the saved operands and their scales (block scales
    of activations cross the graph 1-D, see TensorQuantizer.quantize_flat)."""


class LinearFwdOutputs(NamedTuple):
    """What ``linear_fwd`` returns (unused slots are empty tensors); only ``out`` has a gradient."""

    out: Tensor
    """(rows of the input, out_features): the caller restores the input's leading dims."""
    inp_saved: Tensor
    """The FP8 input in layout.saved_form (what wgrad reads)."""
    inp_scale_inv: Tensor
    weight_fp8: Tensor
    """Row-major FP8 weight (empty when a cached one was given)."""
    weight_fp8_t: Tensor
    """Its columnwise copy where layout.py needs one, else empty."""
    weight_scale_inv: Tensor
    weight_scale_inv_t: Tensor
    """Block scaling: the scales of ``weight_fp8_t``, else empty."""
    amax: Tensor
    """(2,) amaxes of [input, weight], for the delayed-scaling update."""
    grad_output_scale: Tensor
    """Delayed scaling: the grad_output scale as of this forward (negated: backward computes a just-in-time
    one), so a second backward through a retained graph quantizes like the first."""
    fwd_scales: Tensor
    """Delayed scaling: the scales this forward used for [input, weight, grad_output]; the module records
    them as ``fp8_fwd_scale`` for activation checkpointing's recompute."""


@dataclasses.dataclass(frozen=True)
class LinearBwdContext:
    """What backward needs from forward besides the saved tensors (kept on the autograd ctx)."""

    input_requires_grad: bool
    weight_requires_grad: bool
    bias_requires_grad: bool
    fp8: bool
    quantization: QuantizationSpec
    delayed: Optional[DelayedScalingArgs]
    """Delayed scaling: the state backward updates (grad_output's history and scale), by reference (not
    saved: its updates would trip the saved-tensor version check); None otherwise."""
    input_shape: list[int]
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    bias_dtype: Optional[torch.dtype]
    wgrad_queue: int
    main_grad: Optional[Tensor]

    @classmethod
    def from_fwd_args(cls, a: LinearFwdArgs) -> "LinearBwdContext":
        return cls(
            input_requires_grad=a.input_requires_grad,
            weight_requires_grad=a.weight_requires_grad,
            bias_requires_grad=a.bias_requires_grad,
            fp8=a.fp8,
            quantization=a.quantization,
            delayed=a.delayed if a.fp8 else None,
            input_shape=list(a.inp.shape),
            input_dtype=a.inp.dtype,
            weight_dtype=a.weight.dtype,
            bias_dtype=a.bias.dtype if a.bias is not None else None,
            wgrad_queue=a.wgrad_queue,
            main_grad=a.main_grad,
        )
