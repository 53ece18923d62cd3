"""The Linear as custom ops: ``linear_fwd``, ``linear_dgrad``, ``linear_wgrad``
(autograd via ``register_autograd``); the mutating ``delayed_scaling_update``
and ``delayed_scaling_flush`` are in scaling.py.

Forward quantizes input and weight (e4m3) and runs one FP8 GEMM; it returns
the FP8 copies so autograd saves those, not the high-precision tensors.
Backward quantizes grad_output once (bias gradient fused into that pass),
then calls dgrad and wgrad as two ops that share no inputs but the gradient,
so a graph pass can split the input- and weight-gradient halves.

How each tensor is quantized comes from the args' ``QuantizationSpec``
(quantization.py), never from the recipe: tensorwise specs take the delayed /
current scaling path, block specs the block path, whose forward also writes
the columnwise copies of the input and weight that wgrad and dgrad read and
whose backward quantizes grad_output in both layouts in one pass.

``register_autograd`` refuses ops that mutate, so the delayed-scaling update
is an op of its own (scaling.py), called by the module after forward and by
backward for grad_output: the same operations run in eager and under
``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from transformer_linear import amax_reduction, layout, ops
from transformer_linear.linear_args import LinearBwdArgs, LinearBwdContext, LinearFwdArgs, LinearFwdOutputs, args_op
from transformer_linear.quantization import BlockQuantized, TensorQuantizer, flat
from transformer_linear.reference import bias_grad, compute_scale, fp8_max
from transformer_linear.scaling import (
    FP8_STATE_COLUMNS,
    delayed_scaling_flush,
    delayed_scaling_update,
    flushed_state,
    no_amax_yet,
)

__all__ = [
    "WGRAD_QUEUES",
    "compute_wgrad",
    "linear_dgrad",
    "linear_fwd",
    "linear_wgrad",
    "quantize_grad_output",
]


# delay_wgrad_compute: per module key, what backward_dw() still has to compute.
WGRAD_QUEUES: dict[int, list[tuple[LinearBwdArgs, Optional[Tensor]]]] = {}


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------

# linear_fwd's schema return type: LinearFwdOutputs as a plain tuple.
_FwdOutputs = tuple[(Tensor,) * len(LinearFwdOutputs._fields)]


def _rows(inp: Tensor) -> int:
    return math.prod(inp.shape[:-1])


def _column(scale: Optional[Tensor], name: str) -> Optional[Tensor]:
    """The 1-element scale of one tensor under delayed scaling; None under current scaling."""
    if scale is None:
        return None
    i = FP8_STATE_COLUMNS[name]
    return scale[i : i + 1]


def _fwd_side_outputs_like(a: LinearFwdArgs) -> tuple[Tensor, ...]:
    """Metadata of linear_fwd's outputs after the first; unused slots are empty."""
    inp, weight = a.inp, a.weight
    n, k, m = weight.shape[0], weight.shape[1], _rows(inp)
    col = layout.needs_columnwise(inp.device)
    quantize_weight = a.fp8 and a.weight_fp8 is None
    fp8 = a.fwd_dtype if a.fp8 else inp.dtype
    f32 = torch.float32
    return (
        inp.new_empty(((k, m) if col else (m, k)) if a.fp8 else (0,), dtype=fp8),
        inp.new_empty((1,) if a.fp8 else (0,), dtype=f32),
        inp.new_empty((n, k) if quantize_weight else (0,), dtype=fp8),
        inp.new_empty((k, n) if quantize_weight and col else (0,), dtype=fp8),
        inp.new_empty((1,) if quantize_weight else (0,), dtype=f32),
        inp.new_empty((0,), dtype=f32),
        inp.new_empty((2,) if a.fp8 else (0,), dtype=f32),
        inp.new_empty((1,) if a.scale is not None else (0,), dtype=f32),
        inp.new_empty((3,) if a.scale is not None else (0,), dtype=f32),
    )


def _quantize(x: Tensor, dtype: torch.dtype, scale: Optional[Tensor], margin: int, **kw) -> ops.QuantizeOutput:
    """quantize_fused with the columnwise copy where layout.py asks for it."""
    return ops.quantize_fused(x, dtype, scale, margin=margin, columnwise=layout.needs_columnwise(x.device), **kw)


def _just_in_time_scale(x: Tensor, dtype: torch.dtype, margin: int, fallback: Tensor, group: int) -> Tensor:
    """Delayed scaling's first step: the scale of ``x``'s own amax, all-reduced over ``group`` first.

    Bitwise the scale the history update computes from that amax afterwards.
    Runs inside an op (eagerly, also under torch.compile): it reads the state.
    """
    amax = amax_reduction.all_reduce_amax(ops.amax(x).reshape(1), group)
    return compute_scale(amax, fp8_max(dtype), margin, fallback=fallback)


@torch.library.custom_op("transformer_linear::quantize_grad_output", mutates_args=())
def _quantize_grad_output_op(
    g: Tensor, scale: Tensor, dtype: torch.dtype, margin: int, dbias_dtype: Optional[torch.dtype], group: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if bool(scale.lt(0).item()):
        # linear_fwd saw no grad_output amax in the history yet: just in time.
        scale = _just_in_time_scale(g, dtype, margin, scale.neg(), group)
    return tuple(_quantize(g, dtype, scale, margin, dbias_dtype=dbias_dtype))


@_quantize_grad_output_op.register_fake
def _(g, scale, dtype, margin, dbias_dtype, group):
    return tuple(_quantize(g, dtype, scale, margin, dbias_dtype=dbias_dtype))


def quantize_grad_output(
    g: Tensor, scale: Tensor, dtype: torch.dtype, margin: int, dbias_dtype: Optional[torch.dtype], group: int
) -> ops.QuantizeOutput:
    """Delayed scaling's grad_output quantize; a negative ``scale`` (from linear_fwd) asks for a just-in-time one."""
    return ops.QuantizeOutput(*_quantize_grad_output_op(g, scale, dtype, margin, dbias_dtype, group))


@args_op("transformer_linear::linear_fwd", LinearFwdArgs, _FwdOutputs, result=LinearFwdOutputs)
def linear_fwd(a: LinearFwdArgs) -> LinearFwdOutputs:
    """y = x Wᵀ + b with FP8 operands (or in high precision when ``a.fp8`` is False).

    ``y`` is returned 2-D, (rows of x, out_features); the caller restores x's
    leading dims. Reshaping in here would make ``y`` a view created inside the
    op, which autograd forbids modifying in place (``y += residual``).
    """
    weight, inp = a.weight, a.inp
    x2d = inp.reshape(_rows(inp), weight.shape[1])
    bias = a.bias.to(a.out_dtype) if a.bias is not None else None
    f32 = torch.float32
    if not a.fp8:
        # Only the wgrad options reach here without FP8; autograd saves the inputs.
        out = torch.nn.functional.linear(x2d.to(a.out_dtype), weight.to(a.out_dtype), bias)
        return LinearFwdOutputs(out, *_fwd_side_outputs_like(a))
    if a.quantization.blockwise:
        return _blockwise_fwd(a, x2d.contiguous(), bias)
    x2d = x2d.contiguous()
    delayed = a.scale is not None
    if delayed:
        # Only backward updates the grad_output state; this reads it as its pending updates will leave it.
        grad_history, grad_state_scale = flushed_state(
            a.grad_amax_history, a.grad_scale, a.amax_reduction_layer_key, "backward"
        )
        used = a.fwd_scale if a.fwd_scale is not None else torch.cat([a.scale, grad_state_scale])
    else:
        used = None
    x_scale, w_scale, grad_scale = (_column(used, name) for name in FP8_STATE_COLUMNS)
    grad_scale_out = grad_scale
    if delayed and a.just_in_time:
        # One read of the state (a device sync on a GPU) for all three tensors.
        x_empty, w_empty, g_empty = torch.cat(
            [no_amax_yet(a.amax_history, used[: a.scale.numel()]), no_amax_yet(grad_history, grad_scale)]
        ).tolist()
        group = a.amax_reduction_group
        if x_empty:
            x_scale = _just_in_time_scale(x2d, a.fwd_dtype, a.margin, x_scale, group)
        if w_empty and a.weight_fp8 is None:
            w_scale = _just_in_time_scale(weight, a.fwd_dtype, a.margin, w_scale, group)
        if g_empty:
            grad_scale_out = grad_scale.neg()  # backward's quantize_grad_output: just in time
    qx = _quantize(x2d, a.fwd_dtype, x_scale, a.margin)
    no_fp8 = inp.new_empty(0, dtype=a.fwd_dtype)
    if a.weight_fp8 is None:
        qw = _quantize(weight.contiguous(), a.fwd_dtype, w_scale, a.margin)
        w_fp8, w_scale_inv, w_amax = qw.data, qw.scale_inv, qw.amax
        w_outputs = (qw.data, qw.data_t if layout.needs_columnwise(weight.device) else no_fp8, qw.scale_inv)
    else:
        # Outputs may not alias inputs: the cached weight is saved from the inputs (_setup_context).
        w_fp8, w_scale_inv, w_amax = a.weight_fp8, a.weight_scale_inv, a.weight_amax
        w_outputs = (no_fp8, no_fp8.clone(), inp.new_empty(0, dtype=f32))
    w_outputs += (inp.new_empty(0, dtype=f32),)  # weight_scale_inv_t: block scaling only
    out = ops.fp8_gemm(qx.data, qx.scale_inv, w_fp8, w_scale_inv, a.out_dtype, bias)
    return LinearFwdOutputs(
        out,
        layout.saved_form(qx.data, qx.data_t),
        qx.scale_inv,
        *w_outputs,
        amax=torch.stack([qx.amax, w_amax.reshape(())]),
        grad_output_scale=grad_scale_out.clone() if delayed else inp.new_empty(0, dtype=f32),
        fwd_scales=torch.cat([x_scale, w_scale, grad_scale]) if delayed else inp.new_empty(0, dtype=f32),
    )


def _blockwise_fwd(a: LinearFwdArgs, x2d: Tensor, bias: Optional[Tensor]) -> LinearFwdOutputs:
    """The block-scaled forward: the input in both layouts (the columnwise copy is what wgrad reads and
    what autograd saves), the weight in both (dgrad reads the columnwise one), one block-scaled GEMM.

    Made of custom ops and views only, so it is its own fake implementation. The input's columnwise
    scales leave it 1-D, as those of TensorQuantizer.quantize_flat (linear_wgrad reshapes them).
    """
    spec = a.quantization
    empty_f32 = x2d.new_empty(0, dtype=torch.float32)
    qx = spec.input.quantize(x2d, rowwise=True, columnwise=a.weight_requires_grad)
    if a.weight_fp8 is None:
        qw = spec.weight.quantize(a.weight.contiguous(), rowwise=True, columnwise=True)
        w_outputs = tuple(qw)
    else:
        qw = BlockQuantized(a.weight_fp8, a.weight_scale_inv, a.weight_fp8_t, a.weight_scale_inv_t)
        # Outputs may not alias inputs: the cached weight is saved from the inputs (_setup_context).
        no_fp8 = x2d.new_empty(0, dtype=spec.weight.dtype)
        w_outputs = (no_fp8, empty_f32.clone(), no_fp8.clone(), empty_f32.clone())
    out = ops.fp8_gemm(qx.data, qx.scale_inv, qw.data, qw.scale_inv, a.out_dtype, bias)
    w_fp8, w_scale_inv, w_fp8_t, w_scale_inv_t = w_outputs
    return LinearFwdOutputs(
        out,
        inp_saved=qx.data_t,
        inp_scale_inv=flat(qx.scale_inv_t),  # 1-D across the graph: TensorQuantizer.quantize_flat
        weight_fp8=w_fp8,
        weight_fp8_t=w_fp8_t,
        weight_scale_inv=w_scale_inv,
        weight_scale_inv_t=w_scale_inv_t,
        amax=empty_f32.clone(),
        grad_output_scale=empty_f32.clone(),
        fwd_scales=empty_f32.clone(),
    )


@linear_fwd.op.register_fake
def _(*values):
    a = linear_fwd.unflatten(values)
    if a.fp8 and a.quantization.blockwise:
        x2d = a.inp.reshape(_rows(a.inp), a.weight.shape[1])
        return tuple(_blockwise_fwd(a, x2d, a.bias.to(a.out_dtype) if a.bias is not None else None))
    return (a.inp.new_empty((_rows(a.inp), a.weight.shape[0]), dtype=a.out_dtype), *_fwd_side_outputs_like(a))


# ---------------------------------------------------------------------------
# backward: dgrad and wgrad
# ---------------------------------------------------------------------------


@args_op(
    "transformer_linear::linear_dgrad",
    LinearBwdArgs,
    Tensor,
    fields=(
        "grad_output",
        "grad_output_scale_inv",
        "operands_transposed",
        "weight",
        "weight_scale_inv",
        "input_shape",
        "dgrad_dtype",
        "quantization",
    ),
)
def linear_dgrad(a: LinearBwdArgs) -> Tensor:
    """dx = grad_output · W, returned in the input's shape and dtype."""
    if a.weight_scale_inv is None:
        dx = torch.mm(a.grad_output, a.weight.to(a.grad_output.dtype)).to(a.dgrad_dtype)
    else:
        w_t = _operand_t(a.weight, a.operands_transposed)
        # Gradients take the split (fp32-promoted) accumulator, as TE does; the
        # forward GEMM keeps the faster default.
        g_scale_inv = _scale_2d(
            a.grad_output_scale_inv, a.quantization.grad_output, a.grad_output, a.operands_transposed
        )
        dx = ops.fp8_gemm(a.grad_output, g_scale_inv, w_t, a.weight_scale_inv, a.dgrad_dtype, use_split_accumulator=True)
    return dx.reshape(a.input_shape)


@linear_dgrad.op.register_fake
def _(*values):
    a = linear_dgrad.unflatten(values)
    return a.grad_output.new_empty(a.input_shape, dtype=a.dgrad_dtype)


@args_op(
    "transformer_linear::linear_wgrad",
    LinearBwdArgs,
    Tensor,
    fields=(
        "grad_output_t",
        "grad_output_t_scale_inv",
        "operands_transposed",
        "inp",
        "inp_scale_inv",
        "wgrad_dtype",
        "quantization",
    ),
)
def linear_wgrad(a: LinearBwdArgs) -> Tensor:
    """dW = grad_outputᵀ · x, (out_features, in_features) in the weight's dtype."""
    if a.inp_scale_inv is None:
        g_t = layout.transposed(a.grad_output_t)
        return torch.mm(g_t, a.inp.to(g_t.dtype)).to(a.wgrad_dtype)
    return ops.fp8_gemm(*_wgrad_operands(a), a.wgrad_dtype, use_split_accumulator=True)


def _operand_t(saved: Tensor, transposed: bool) -> Tensor:
    """The transpose of a saved tensor as a GEMM operand: the saved columnwise copy itself under block
    scaling, else what layout.py says."""
    return saved if transposed else layout.transposed(saved)


def _scale_2d(scale_inv: Tensor, quantizer: TensorQuantizer, operand: Tensor, blockwise: bool) -> Tensor:
    """A block-scaled activation's scale_inv in its 2-D shape (it crosses the graph 1-D); others as they are."""
    return scale_inv.reshape(quantizer.scale_grid(*operand.shape)) if blockwise else scale_inv


def _wgrad_operands(a: LinearBwdArgs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_outputᵀ, its scale_inv, xᵀ, its scale_inv) as FP8 GEMM operands."""
    t = a.operands_transposed
    g_t, x_t = _operand_t(a.grad_output_t, t), _operand_t(a.inp, t)
    spec = a.quantization
    g_t_scale_inv = _scale_2d(a.grad_output_t_scale_inv, spec.grad_output, g_t, t)
    return g_t, g_t_scale_inv, x_t, _scale_2d(a.inp_scale_inv, spec.input, x_t, t)


@linear_wgrad.op.register_fake
def _(*values):
    a = linear_wgrad.unflatten(values)
    g_t = _operand_t(a.grad_output_t, a.operands_transposed)
    k = a.inp.shape[1] if a.inp_scale_inv is None else _operand_t(a.inp, a.operands_transposed).shape[0]
    return g_t.new_empty((g_t.shape[0], k), dtype=a.wgrad_dtype)


def compute_wgrad(a: LinearBwdArgs, main_grad: Optional[Tensor]) -> Optional[Tensor]:
    """The weight gradient, or None after accumulating it into ``main_grad`` (fp32)."""
    if main_grad is None:
        return linear_wgrad(a)
    if a.inp_scale_inv is None:
        # No FP8: an fp32 wgrad, added.
        main_grad.add_(linear_wgrad(dataclasses.replace(a, wgrad_dtype=torch.float32)))
    else:
        ops.fp8_gemm_accumulate_(*_wgrad_operands(a), main_grad)
    return None


# ---------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    a = linear_fwd.unflatten(inputs)
    o = LinearFwdOutputs(*output)
    # Only the first output has a gradient; saying so spares the graphs a detach per saved tensor.
    ctx.mark_non_differentiable(*o[1:])
    x_saved, x_scale_inv, w_scale_inv = o.inp_saved, o.inp_scale_inv, o.weight_scale_inv
    if not a.fp8:
        x_saved, x_scale_inv, w_saved, w_scale_inv = a.inp, None, a.weight, None
    elif a.quantization.blockwise:
        # dgrad reads the columnwise weight (from the cache when one was given: outputs may not alias inputs).
        cached = a.weight_fp8 is not None
        w_saved = a.weight_fp8_t if cached else o.weight_fp8_t
        w_scale_inv = a.weight_scale_inv_t if cached else o.weight_scale_inv_t
    elif a.weight_fp8 is not None:
        # Outputs may not alias inputs, so the cached FP8 weight is saved from the inputs.
        w_saved, w_scale_inv = layout.saved_form(a.weight_fp8, a.weight_fp8_t), a.weight_scale_inv
    else:
        w_saved = layout.saved_form(o.weight_fp8, o.weight_fp8_t)
    bwd = LinearBwdContext.from_fwd_args(a)
    ctx.save_for_backward(
        x_saved if a.weight_requires_grad else None,
        x_scale_inv,
        w_saved if a.input_requires_grad else None,
        w_scale_inv,
        o.grad_output_scale if bwd.scale is not None else None,
    )
    ctx.bwd = bwd


def _backward(ctx, grad_out: Tensor, *_unused: Optional[Tensor]) -> tuple:
    x_saved, x_scale_inv, w_saved, w_scale_inv, grad_scale = ctx.saved_tensors
    c: LinearBwdContext = ctx.bwd
    g2d = grad_out.contiguous()  # linear_fwd's output, hence its gradient, is 2-D
    dbias_dtype = c.bias_dtype if c.bias_requires_grad else None
    transposed = c.fp8 and c.quantization.blockwise
    g_t_scale_inv = None
    if transposed:
        # dgrad reads the rowwise copy, wgrad the columnwise one: only what is needed, in one pass.
        g = g_t = g_scale_inv = None
        if c.input_requires_grad or c.weight_requires_grad:
            g, g_scale_inv, g_t, g_t_scale_inv = c.quantization.grad_output.quantize_flat(
                g2d, rowwise=c.input_requires_grad, columnwise=c.weight_requires_grad
            )
        dbias = bias_grad(g2d, dbias_dtype) if c.bias_requires_grad else None
    elif c.fp8:
        if c.scale is not None and c.amax_reduction_layer_key != -1:
            # The updates this layer's last backward launched, before this one records its own.
            delayed_scaling_flush(c.amax_history, c.scale, c.amax_reduction_layer_key, "backward")
        if c.scale is not None and c.just_in_time:
            qg = quantize_grad_output(g2d, grad_scale, c.bwd_dtype, c.margin, dbias_dtype, c.amax_reduction_group)
        else:
            qg = _quantize(g2d, c.bwd_dtype, grad_scale, c.margin, dbias_dtype=dbias_dtype)
        if c.scale is not None:
            delayed_scaling_update(
                c.amax_history,
                c.scale,
                qg.amax,
                0,  # the backward state's one column
                c.bwd_dtype,
                c.margin,
                c.amax_compute_algo,
                c.amax_reduction_group,
                c.amax_reduction_layer_key,
                "backward",
            )
        g, g_t, g_scale_inv, dbias = qg.data, layout.saved_form(qg.data, qg.data_t), qg.scale_inv, qg.dbias
        g_t_scale_inv = g_scale_inv
    else:
        g, g_t, g_scale_inv = g2d, g2d, None
        dbias = g2d.sum(0).to(dbias_dtype) if c.bias_requires_grad else None
        if x_saved is not None:
            x_saved = x_saved.reshape(-1, x_saved.shape[-1])
    b = LinearBwdArgs(
        grad_output=g,
        grad_output_t=g_t,
        grad_output_scale_inv=g_scale_inv,
        grad_output_t_scale_inv=g_t_scale_inv,
        operands_transposed=transposed,
        inp=x_saved,
        inp_scale_inv=x_scale_inv,
        weight=w_saved,
        weight_scale_inv=w_scale_inv,
        input_shape=c.input_shape,
        dgrad_dtype=c.input_dtype,
        wgrad_dtype=c.weight_dtype,
        quantization=c.quantization,
    )
    dgrad = linear_dgrad(b) if c.input_requires_grad else None
    wgrad = None
    if c.wgrad_queue >= 0:
        if c.weight_requires_grad or c.bias_requires_grad:
            # The queue keeps what wgrad reads, not the weight dgrad needed.
            queued = dataclasses.replace(b, weight=None, weight_scale_inv=None) if c.weight_requires_grad else None
            WGRAD_QUEUES.setdefault(c.wgrad_queue, []).append((queued, dbias))
        dbias = None
    elif c.weight_requires_grad:
        wgrad = compute_wgrad(b, c.main_grad)
    return (dgrad, wgrad, dbias if c.bias_requires_grad else None) + (None,) * (len(linear_fwd.params) - 3)


linear_fwd.op.register_autograd(_backward, setup_context=_setup_context)
