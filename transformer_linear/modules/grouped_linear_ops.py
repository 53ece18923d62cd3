"""The grouped (mixture-of-experts) Linear as a custom op with autograd: ``grouped_linear_fwd`` (the
functional form and the module's entry point are in grouped_linear_functional.py, the op's argument bundles
in grouped_linear_args.py, the recipe check and the experts' quantized copies in grouped_linear_quantize.py).

Forward quantizes the tokens of every expert once (the recipe's input quantizer), each expert's weight
with its own scale (under delayed scaling the state's one weight scale, shared by the experts) into the
rowwise data and the transpose, and runs one grouped FP8 GEMM (ops.grouped). It returns the FP8 copies,
so autograd saves those. Backward quantizes grad_output once; the input gradient is the grouped GEMM of
it with each expert's FP8 weight read columnwise (the transpose forward wrote), the weight
gradient is the grouped weight-gradient GEMM (dY_gᵀ X_g per expert), the bias gradient each group's
column sums. No value of ``offs`` is read on the host: there is no device sync, and a routing change
does not recompile.

Quantizers with one scale per tensor (DelayedScaling, Float8CurrentScaling) run the tensorwise grouped
GEMMs on the rowwise data. Block-scaling quantizers (Float8BlockScaling, MXFP8BlockScaling,
Float8RowwiseScaling, a CustomRecipe of such) run the block-scaled grouped GEMMs: forward and dgrad on
the rowwise data and each expert's columnwise weight copy, and the weight gradient on *grouped
columnwise copies* of the input and of grad_output (ops.grouped_quantize), whose 1 x B token blocks
restart at each group's first token (scales per (column, group) for rowwise scaling), so no block
straddles two experts and nothing is padded (formats.grouped_scaling). ``check_grouped_quantization``
(grouped_linear_quantize.py) names what does not fit.

The recipe's ``backward_override`` (QuantizationSpec.backward_operands) is asked, never the recipe: with
"high_precision" autograd saves the original input and weights, with "dequantized" the rowwise copies the
forward GEMM read (no columnwise copies are made either way), and backward runs dgrad and wgrad per expert
in the gradient's dtype (ops.grouped_high_precision) on them, dequantized expert by expert for the latter;
grad_output is not quantized.
"""

# No ``from __future__ import annotations``: args_op reads the op schema from the field annotations.

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from transformer_linear._handles import NO_HANDLE
from transformer_linear.formats.grouped_scaling import token_scale_cols
from transformer_linear.modules.grouped_linear_args import (
    GroupedLinearFwdArgs,
    GroupedLinearFwdOutputs,
    GroupedWgradArgs,
)
from transformer_linear.modules.grouped_linear_quantize import (
    masked_columnwise_nvfp4,
    quantize_expert_weights,
    token_block,
)
from transformer_linear.modules.linear_args import args_op
from transformer_linear.modules.linear_ops import QueuedWgrad, WgradQueue
from transformer_linear.ops.grouped import (
    fp8_grouped_gemm,
    fp8_grouped_gemm_wgrad,
    fp8_grouped_gemm_wgrad_blockwise,
)
from transformer_linear.ops.grouped_high_precision import grouped_mm_dgrad, grouped_mm_wgrad
from transformer_linear.ops.grouped_nvfp4 import nvfp4_grouped_gemm, nvfp4_grouped_gemm_wgrad
from transformer_linear.ops.grouped_quantize import quantize_grouped_columnwise
from transformer_linear.recipe.delayed_scaling import (
    DelayedScalingArgs,
    ForwardScales,
    forward_scales,
    quantize_and_record_grad_output,
)
from transformer_linear.recipe.quantization import QuantizationSpec, Quantized, TensorQuantizer, flat

__all__ = ["compute_grouped_wgrad", "group_sums", "grouped_linear_fwd"]


_FwdOutputs = tuple[(Tensor,) * len(GroupedLinearFwdOutputs._fields)]


def _grouped_columnwise(q: TensorQuantizer, t: Tensor, offs: Tensor):
    """The grouped columnwise copy of ``t`` that the block-scaled grouped weight gradient reads."""
    return quantize_grouped_columnwise(t, offs, q.dtype, token_block(q), q.power_2_scale, q.e8m0_rounding)


def group_sums(g: Tensor, offs: Tensor, dtype: torch.dtype) -> Tensor:
    """(G, N) column sums of each group's rows of ``g`` (a bias gradient), in ``dtype``, summed in fp32.

    Each row's group is found on the device (searchsorted over offs): no host read. Rows past
    offs[-1] fall in an extra group that is dropped.
    """
    groups = offs.shape[0]
    rows = torch.arange(g.shape[0], device=g.device, dtype=offs.dtype)
    group_of_row = torch.searchsorted(offs, rows, right=True)
    sums = g.new_zeros((groups + 1, g.shape[1]), dtype=torch.float32)
    sums.index_add_(0, group_of_row, g.to(torch.float32))
    return sums[:groups].to(dtype)


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------


@args_op("transformer_linear::grouped_linear_fwd", GroupedLinearFwdArgs, _FwdOutputs, result=GroupedLinearFwdOutputs)
def grouped_linear_fwd(a: GroupedLinearFwdArgs) -> GroupedLinearFwdOutputs:
    """out[rows of g] = x[rows of g] W_gᵀ + b_g with FP8 operands, one grouped GEMM."""
    x = a.inp.contiguous()
    scales = None
    if a.delayed is not None:
        spec = a.quantization
        weight_2d = a.weight.reshape(-1, a.weight.shape[2]) if a.cached_weight is None else None
        scales = forward_scales(a.delayed, x, weight_2d, spec.input.dtype, spec.input.margin)
    return _fp8_fwd(a, x, scales)


def _fp8_fwd(a: GroupedLinearFwdArgs, x: Tensor, scales: Optional[ForwardScales]) -> GroupedLinearFwdOutputs:
    """The FP8 forward; made of custom ops and metadata-only ops given the scales, so it is its own fake.

    ``scales``: the delayed-scaling state's (forward_scales), None where each quantizer computes its own
    (then each expert's weight gets its own scale).
    """
    spec = a.quantization
    if spec.input.is_nvfp4:
        return _nvfp4_fwd(a, x)
    empty_f32 = x.new_empty(0, dtype=torch.float32)
    blockwise = spec.input.blockwise
    quantized_bwd = spec.backward_operands == "quantized"
    if blockwise:
        qx = spec.input.quantize(x, rowwise=True)
    else:
        qx = spec.input.quantize(x, rowwise=True, scale=scales.input if scales else None)
    cached = a.cached_weight
    if cached is None:
        qw = _quantize_experts(a, x, scales, columnwise=a.input_requires_grad and quantized_bwd)
        w_outputs = (qw.data, qw.data_t, qw.scale_inv, qw.scale_inv_t)
    else:
        qw = cached.quantized()
        # Outputs may not alias inputs: the cached weight is saved from the inputs (_setup_context).
        no_fp8 = x.new_empty(0, dtype=spec.weight.dtype)
        w_outputs = (no_fp8, no_fp8.clone(), empty_f32.clone(), empty_f32.clone())
    bias = a.bias.to(a.out_dtype) if a.bias is not None else None
    scalings = (spec.input.gemm_scaling, spec.weight.gemm_scaling) if blockwise else None
    out = fp8_grouped_gemm(qx.data, qx.scale_inv, qw.data, qw.scale_inv, a.offs, a.out_dtype, bias, scalings=scalings)
    if spec.backward_operands == "dequantized":
        # What the forward GEMM read, which backward dequantizes.
        inp_fp8, inp_scale_inv = qx.data, flat(qx.scale_inv)
    elif spec.backward_operands == "high_precision":
        inp_fp8, inp_scale_inv = x.new_empty(0, dtype=spec.input.dtype), empty_f32.clone()  # backward reads inp
    elif not blockwise:
        inp_fp8, inp_scale_inv = qx.data, qx.scale_inv.reshape(1)
    elif a.weight_requires_grad:
        inp_fp8, inp_scale_inv = _grouped_columnwise(spec.input, x, a.offs)
        inp_scale_inv = flat(inp_scale_inv)  # 1-D: no graph guard on a grid size of 1 (quantize_flat)
    else:
        inp_fp8, inp_scale_inv = x.new_empty(0, dtype=spec.input.dtype), empty_f32.clone()
    records_amax = not blockwise and spec.input.records_amax and spec.weight.records_amax and scales is not None
    w_fp8, w_fp8_t, w_scale_inv, w_scale_inv_t = w_outputs
    return GroupedLinearFwdOutputs(
        out,
        inp_fp8=inp_fp8,
        inp_scale_inv=inp_scale_inv,
        weight_fp8=w_fp8,
        weight_fp8_t=w_fp8_t,
        weight_scale_inv=w_scale_inv,
        weight_scale_inv_t=w_scale_inv_t,
        amax=torch.stack([qx.amax.reshape(()), qw.amax.reshape(())]) if records_amax else empty_f32.clone(),
        grad_output_scale=scales.grad_output_for_backward.clone() if scales else empty_f32.clone(),
        fwd_scales=torch.cat([scales.input, scales.weight, scales.grad_output]) if scales else empty_f32.clone(),
    )


def _nvfp4_fwd(a: GroupedLinearFwdArgs, x: Tensor) -> GroupedLinearFwdOutputs:
    """The NVFP4 forward (ops.grouped_nvfp4): the tokens quantized rowwise once, each expert's weight rowwise
    (and columnwise, for dgrad); for wgrad, the experts' compact columnwise copies of their masked tokens."""
    spec = a.quantization
    empty_f32 = x.new_empty(0, dtype=torch.float32)
    qx = spec.input.quantize(x, rowwise=True)
    cached = a.cached_weight
    if cached is None:
        columnwise = a.input_requires_grad and spec.backward_operands == "quantized"
        qw = quantize_expert_weights(spec.weight, a.weight, columnwise)
        w_outputs = (qw.data, qw.data_t, qw.scale_inv, qw.scale_inv_t)
    else:
        qw = cached.quantized()
        no_fp4 = x.new_empty(0, dtype=spec.weight.dtype)
        no_scale = x.new_empty(0, dtype=spec.weight.scale_dtype)
        w_outputs = (no_fp4, no_fp4.clone(), no_scale, no_scale.clone())
    bias = a.bias.to(a.out_dtype) if a.bias is not None else None
    out = nvfp4_grouped_gemm(qx.data, qx.scale_inv, qw.data, qw.scale_inv, a.offs, a.out_dtype, bias)
    if spec.backward_operands == "dequantized":
        inp_fp4, inp_scale_inv = qx.data, qx.scale_inv  # what the forward GEMM read, which backward dequantizes
    elif a.weight_requires_grad and spec.backward_operands == "quantized":
        inp_fp4, inp_scale_inv = masked_columnwise_nvfp4(spec.input, x, a.offs)
    else:
        inp_fp4, inp_scale_inv = x.new_empty(0, dtype=spec.input.dtype), x.new_empty(0, dtype=spec.input.scale_dtype)
    return GroupedLinearFwdOutputs(
        out,
        inp_fp8=inp_fp4,
        inp_scale_inv=inp_scale_inv,
        weight_fp8=w_outputs[0],
        weight_fp8_t=w_outputs[1],
        weight_scale_inv=w_outputs[2],
        weight_scale_inv_t=w_outputs[3],
        amax=empty_f32.clone(),
        grad_output_scale=empty_f32.clone(),
        fwd_scales=empty_f32.clone(),
    )


def _quantize_experts(
    a: GroupedLinearFwdArgs, x: Tensor, scales: Optional[ForwardScales], columnwise: bool
) -> Quantized:
    """Each expert's weight quantized by the weight quantizer, stacked (:func:`quantize_expert_weights`),
    with the delayed-scaling state's weight scale where there is one (its amax then recorded)."""
    w = a.quantization.weight
    return quantize_expert_weights(w, a.weight, columnwise, scale=scales.weight if scales else None,
                                   records_amax=w.records_amax and scales is not None)


@grouped_linear_fwd.register_fake
def _(*values):
    a = grouped_linear_fwd.unflatten(values)
    x = a.inp.contiguous()
    scales = None
    if a.delayed is not None:
        # The delayed-scaling state is read only where the op really runs: stand-ins here.
        scales = ForwardScales(*(x.new_empty(1, dtype=torch.float32) for _ in ForwardScales._fields))
    return tuple(_fp8_fwd(a, x, scales))


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BwdContext:
    """What backward needs from forward besides the saved tensors."""

    input_requires_grad: bool
    weight_requires_grad: bool
    bias_requires_grad: bool
    quantization: QuantizationSpec
    delayed: Optional[DelayedScalingArgs]
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    bias_dtype: Optional[torch.dtype]
    wgrad_queue: int
    main_grad: Optional[Tensor]


def compute_grouped_wgrad(a: GroupedWgradArgs, main_grad: Optional[Tensor]) -> Optional[Tensor]:
    """The (num_gemms, out_features, in_features) weight gradient, or None after adding it (computed in
    fp32) to ``main_grad``."""
    dtype = a.wgrad_dtype if main_grad is None else torch.float32
    if a.nvfp4:
        wgrad = nvfp4_grouped_gemm_wgrad(a.grad_output, a.grad_output_scale_inv, a.inp, a.inp_scale_inv, dtype,
                                         offs=a.offs)
    elif a.grad_output_scale_inv is None:
        wgrad = high_precision_grouped_wgrad(a.grad_output, a.inp, a.offs, dtype)
    elif a.token_block is None:
        wgrad = fp8_grouped_gemm_wgrad(a.grad_output, a.grad_output_scale_inv, a.inp, a.inp_scale_inv, a.offs, dtype)
    else:
        wgrad = fp8_grouped_gemm_wgrad_blockwise(a.grad_output, a.grad_output_scale_inv, a.inp, a.inp_scale_inv,
                                                 a.offs, dtype, a.token_block)
    if main_grad is None:
        return wgrad
    main_grad.add_(wgrad)
    return None


def high_precision_grouped_wgrad(grad: Tensor, inp: Tensor, offs: Tensor, dtype: torch.dtype) -> Tensor:
    """(G, N, K): ``grad[rows of g]ᵀ inp[rows of g]`` per group in ``grad``'s precision
    (ops.grouped_high_precision: reads ``offs`` on the host)."""
    return grouped_mm_wgrad(grad, inp, offs, dtype)


def _setup_context(ctx, inputs, output) -> None:
    a = grouped_linear_fwd.unflatten(inputs)
    o = GroupedLinearFwdOutputs(*output)
    ctx.mark_non_differentiable(*o[1:])
    # Their gradients are never read: not materialized (autograd would fill zeros of each one's shape, a
    # weight-sized FP8 copy among them, every backward).
    ctx.set_materialize_grads(False)
    # What backward reads (QuantizationSpec.backward_operands): each expert's columnwise weight (quantized),
    # its rowwise weight the forward GEMM read (dequantized), or the original input and weight (high
    # precision). Outputs may not alias inputs, so a cached FP8 weight is saved from the inputs.
    cached = a.cached_weight
    operands = a.quantization.backward_operands
    x_saved, x_scale_inv = o.inp_fp8, o.inp_scale_inv
    if operands == "high_precision":
        x_saved, x_scale_inv, w_saved, w_scale_inv = a.inp, None, a.weight, None
    elif operands == "dequantized":
        w_saved, w_scale_inv = (o.weight_fp8, o.weight_scale_inv) if cached is None else (
            cached.weight_fp8, cached.weight_scale_inv)
    else:
        w_saved, w_scale_inv = (o.weight_fp8_t, o.weight_scale_inv_t) if cached is None else (
            cached.weight_fp8_t, cached.weight_scale_inv_t)
    ctx.save_for_backward(
        x_saved if a.weight_requires_grad else None,
        x_scale_inv,
        w_saved if a.input_requires_grad else None,
        w_scale_inv,
        a.offs,
        o.grad_output_scale if a.delayed is not None else None,
    )
    ctx.bwd = _BwdContext(
        input_requires_grad=a.input_requires_grad,
        weight_requires_grad=a.weight_requires_grad,
        bias_requires_grad=a.bias_requires_grad,
        quantization=a.quantization,
        delayed=a.delayed,
        input_dtype=a.inp.dtype,
        weight_dtype=a.weight.dtype,
        bias_dtype=a.bias.dtype if a.bias is not None else None,
        wgrad_queue=a.wgrad_queue,
        main_grad=a.main_grad,
    )


def _backward(ctx, grad_out: Tensor, *_unused: Optional[Tensor]) -> tuple:
    x_fp8, x_scale_inv, w_fp8_t, w_scale_inv, offs, grad_scale = ctx.saved_tensors
    c: _BwdContext = ctx.bwd
    g = grad_out.contiguous()
    quantizer = c.quantization.grad_output
    dgrad = wgrad_args = None
    if c.quantization.backward_operands != "quantized":
        dgrad, wgrad_args = _high_precision_backward(c, g, x_fp8, x_scale_inv, w_fp8_t, w_scale_inv, offs)
    elif quantizer.is_nvfp4:
        if c.input_requires_grad:
            qg = quantizer.quantize(g, rowwise=True)
            dgrad = nvfp4_grouped_gemm(qg.data, qg.scale_inv, w_fp8_t, w_scale_inv, offs, c.input_dtype)
        if c.weight_requires_grad:
            g_t, g_scale_inv_t = masked_columnwise_nvfp4(quantizer, g, offs)
            wgrad_args = GroupedWgradArgs(g_t, g_scale_inv_t, x_fp8, x_scale_inv, offs, c.weight_dtype, None,
                                          nvfp4=True)
    elif quantizer.blockwise:
        # Rowwise for dgrad; the grouped columnwise copy for wgrad (blocks restart at each group).
        if c.input_requires_grad:
            qg = quantizer.quantize(g, rowwise=True)
            dgrad = fp8_grouped_gemm(qg.data, qg.scale_inv, w_fp8_t, w_scale_inv, offs, c.input_dtype,
                                     scalings=(quantizer.gemm_scaling, c.quantization.weight.gemm_scaling))
        if c.weight_requires_grad:
            block = token_block(quantizer)
            x_scale_t = x_scale_inv.reshape(x_fp8.shape[0], token_scale_cols(x_fp8.shape[1], offs.shape[0], block))
            g_t, g_scale_t = _grouped_columnwise(quantizer, g, offs)
            wgrad_args = GroupedWgradArgs(g_t, g_scale_t, x_fp8, x_scale_t, offs, c.weight_dtype, block)
    else:
        if c.delayed is not None:
            qg = quantize_and_record_grad_output(c.delayed, g, grad_scale, quantizer, None)
        else:
            qg = quantizer.quantize(g)
        g_scale_inv = qg.scale_inv.reshape(1)
        if c.input_requires_grad:
            # Each expert's weight read columnwise: its transpose, with the expert's one scale.
            dgrad = fp8_grouped_gemm(qg.data, g_scale_inv, w_fp8_t, w_scale_inv, offs, c.input_dtype)
        if c.weight_requires_grad:
            wgrad_args = GroupedWgradArgs(qg.data, g_scale_inv, x_fp8, x_scale_inv, offs, c.weight_dtype, None)
    dbias = group_sums(g, offs, c.bias_dtype) if c.bias_requires_grad else None
    wgrad, dbias = finish_wgrad(c.wgrad_queue, c.main_grad, wgrad_args, dbias)
    return (dgrad, wgrad, dbias) + (None,) * (len(grouped_linear_fwd.params) - 3)


def _high_precision_backward(
    c: _BwdContext, g: Tensor, x_saved: Optional[Tensor], x_scale_inv: Optional[Tensor],
    w_saved: Optional[Tensor], w_scale_inv: Optional[Tensor], offs: Tensor,
) -> tuple[Optional[Tensor], Optional[GroupedWgradArgs]]:
    """backward_override: dgrad and the weight gradient's operands in the gradient's (the compute) dtype,
    from the original input and weights (high_precision) or from the forward's quantized ones dequantized
    (dequantized: each expert's weight with its own scales); grad_output is not quantized."""
    spec = c.quantization
    if spec.backward_operands == "dequantized":
        if x_saved is not None:
            x_saved = spec.input.dequantize(x_saved, x_scale_inv, g.dtype)
        if w_saved is not None:
            w_saved = torch.stack([spec.weight.dequantize(w_saved[e], w_scale_inv[e].reshape(-1), g.dtype)
                                   for e in range(w_saved.shape[0])])
    dgrad = grouped_mm_dgrad(g, w_saved, offs, c.input_dtype) if c.input_requires_grad else None
    wgrad_args = None
    if c.weight_requires_grad:
        wgrad_args = GroupedWgradArgs(g, None, x_saved, None, offs, c.weight_dtype, None)
    return dgrad, wgrad_args


def finish_wgrad(
    queue_handle: int, main_grad: Optional[Tensor], wgrad_args: Optional[GroupedWgradArgs], dbias: Optional[Tensor]
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The (weight, bias) gradients backward returns: computed now, or (delay_wgrad_compute) queued for
    ``backward_dw()`` with both returned as None; with ``main_grad`` the weight gradient is added to it."""
    if queue_handle != NO_HANDLE:
        queue = WgradQueue.get(queue_handle)  # None: its module is gone, and nothing would drain it
        if queue is not None and (wgrad_args is not None or dbias is not None):
            queue.append(QueuedWgrad(wgrad_args, dbias))
        return None, None
    return (compute_grouped_wgrad(wgrad_args, main_grad) if wgrad_args is not None else None), dbias


grouped_linear_fwd.op.register_autograd(_backward, setup_context=_setup_context)
