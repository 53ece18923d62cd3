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

The quantizers' scaling kind (recipe/kind*.py) owns the GEMMs and their operands; nothing here asks the
format. One scale per tensor (DelayedScaling, Float8CurrentScaling) runs the tensorwise grouped GEMMs on
the rowwise data. Block scales (Float8BlockScaling, MXFP8BlockScaling, Float8RowwiseScaling, a
CustomRecipe of such) run the block-scaled grouped GEMMs: forward and dgrad on the rowwise data and each
expert's columnwise weight copy, and the weight gradient on *grouped columnwise copies* of the input and
of grad_output (ops.grouped_quantize), whose 1 x B token blocks restart at each group's first token
(scales per (column, group) for rowwise scaling), so no block straddles two experts and nothing is padded
(formats.grouped_scaling). NVFP4 runs ops.grouped_nvfp4, its weight gradient on each expert's compact
columnwise copy of its masked tokens. ``check_grouped_quantization`` (grouped_linear_quantize.py) names
what does not fit.

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
from transformer_linear.modules.grouped_linear_args import (
    GroupedLinearFwdArgs,
    GroupedLinearFwdOutputs,
    GroupedWgradArgs,
)
from transformer_linear.modules.linear_ops import QueuedWgrad, WgradQueue
from transformer_linear.ops.args_op import args_op
from transformer_linear.ops.grouped_high_precision import grouped_mm_dgrad, grouped_mm_wgrad
from transformer_linear.recipe.delayed_scaling import (
    DelayedScalingArgs,
    ForwardScales,
    forward_scales,
    quantize_and_record_grad_output,
    stand_in_forward_scales,
)
from transformer_linear.recipe.quantization import QuantizationSpec, flat

__all__ = ["compute_grouped_wgrad", "group_sums", "grouped_linear_fwd"]


_FwdOutputs = tuple[(Tensor,) * len(GroupedLinearFwdOutputs._fields)]


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
    spec = a.quantization
    weight_2d = a.weight.reshape(-1, a.weight.shape[2]) if a.cached_weight is None else None
    return _fp8_fwd(a, x, forward_scales(a.delayed, x, weight_2d, spec.input.dtype, spec.input.margin))


def _fp8_fwd(a: GroupedLinearFwdArgs, x: Tensor, scales: Optional[ForwardScales]) -> GroupedLinearFwdOutputs:
    """The FP8 / FP4 forward; made of custom ops and metadata-only ops given the scales, so it is its own fake.

    ``scales``: the delayed-scaling state's (forward_scales), None where each quantizer computes its own
    (then each expert's weight gets its own scale). The GEMMs and the weight gradient's operands are the
    quantizers' scaling kind's (ScalingKind.grouped_gemm, grouped_columnwise).
    """
    spec = a.quantization
    kind = spec.weight.scaling_kind
    qx = spec.input.quantize(x, rowwise=True, scale=scales.input if scales else None)
    cached = a.cached_weight
    if cached is None:
        columnwise = a.input_requires_grad and spec.backward_operands == "quantized"
        qw = spec.weight.quantize_experts(a.weight, columnwise, scale=scales.weight if scales else None,
                                          records_amax=spec.weight.records_amax and scales is not None)
        w_outputs = (qw.data, qw.data_t, qw.scale_inv, qw.scale_inv_t)
    else:
        qw = cached.quantized()
        # Outputs may not alias inputs: the cached weight is saved from the inputs (_setup_context).
        no_data = x.new_empty(0, dtype=spec.weight.dtype)
        no_scale = x.new_empty(0, dtype=spec.weight.scale_dtype)
        w_outputs = (no_data, no_data.clone(), no_scale, no_scale.clone())
    bias = a.bias.to(a.out_dtype) if a.bias is not None else None
    out = kind.grouped_gemm(spec.input, qx.data, qx.scale_inv, spec.weight, qw.data, qw.scale_inv, a.offs,
                            a.out_dtype, bias)
    empty_f32 = x.new_empty(0, dtype=torch.float32)
    if spec.backward_operands == "dequantized":
        # What the forward GEMM read, which backward dequantizes.
        inp_fp8, inp_scale_inv = qx.data, flat(qx.scale_inv)
    elif spec.backward_operands == "quantized" and a.weight_requires_grad:
        inp_fp8, inp_scale_inv = kind.grouped_columnwise(spec.input, x, a.offs, qx)
    else:  # backward reads the high-precision input, or computes no weight gradient
        inp_fp8, inp_scale_inv = x.new_empty(0, dtype=spec.input.dtype), x.new_empty(0, dtype=spec.input.scale_dtype)
    records_amax = spec.input.records_amax and spec.weight.records_amax and scales is not None
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


@grouped_linear_fwd.register_fake
def _(*values):
    a = grouped_linear_fwd.unflatten(values)
    x = a.inp.contiguous()
    return tuple(_fp8_fwd(a, x, stand_in_forward_scales(a.delayed, x)))


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
    if a.quantizer is None:
        wgrad = high_precision_grouped_wgrad(a.grad_output, a.inp, a.offs, dtype)
    else:
        wgrad = a.quantizer.scaling_kind.grouped_wgrad(a.quantizer, a.grad_output, a.grad_output_scale_inv, a.inp,
                                                       a.inp_scale_inv, a.offs, dtype)
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
    ctx.full_lists = grouped_linear_fwd.full_lists(inputs)
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
        o.grad_output_scale,  # delayed scaling's (empty otherwise)
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
    else:
        kind = quantizer.scaling_kind
        # grad_output's rowwise copy: what dgrad reads, and the weight gradient too where its columnwise
        # usage is that copy (one scale per tensor).
        qg = None
        if c.input_requires_grad or not quantizer.columnwise_is_copy:
            qg = quantize_and_record_grad_output(c.delayed, g, grad_scale, quantizer, None)
            if qg is None:  # no amax history: the quantizer's own scales
                qg = quantizer.quantize(g, rowwise=True)
        if c.input_requires_grad:
            # Each expert's weight read columnwise (its columnwise copy, or its transpose with the expert's scale).
            dgrad = kind.grouped_gemm(quantizer, qg.data, qg.scale_inv, c.quantization.weight, w_fp8_t, w_scale_inv,
                                      offs, c.input_dtype)
        if c.weight_requires_grad:
            g_t, g_scale_inv_t = kind.grouped_columnwise(quantizer, g, offs, qg)
            wgrad_args = GroupedWgradArgs(g_t, g_scale_inv_t, x_fp8, x_scale_inv, offs, c.weight_dtype, quantizer)
    dbias = group_sums(g, offs, c.bias_dtype) if c.bias_requires_grad else None
    wgrad, dbias = finish_wgrad(c.wgrad_queue, c.main_grad, wgrad_args, dbias)
    return grouped_linear_fwd.input_grads(ctx.full_lists, inp=dgrad, weight=wgrad, bias=dbias)


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
