"""The Linear as custom ops: ``linear_fwd``, ``linear_dgrad``, ``linear_wgrad``
(autograd via ``register_autograd``); the mutating ``delayed_scaling_update``
and ``delayed_scaling_flush`` are in delayed_scaling.py.

Forward quantizes the weight, then asks the input's quantizer for the input's
quantize and the FP8 GEMM (one op where its kind casts the input inside the
GEMM: one scale per tensor, ops/quantize_gemm.py); it returns the FP8 copies
so autograd saves those, not the high-precision tensors.
Backward quantizes grad_output once (bias gradient fused into that pass),
then calls dgrad and wgrad as two ops that share no inputs but the gradient,
so a graph pass can split the input- and weight-gradient halves.

How each tensor is quantized comes from the args' ``QuantizationSpec``
(quantization.py), never from the recipe: each tensor's quantizer quantizes it
into the usages the GEMMs read (rowwise for the forward GEMM and dgrad's
grad_output, columnwise for wgrad and dgrad's weight) and says how a GEMM
reads them; the delayed-scaling state (delayed_scaling.py) supplies the scales
where the quantizers take them from it.

``register_autograd`` refuses ops that mutate, so the delayed-scaling update
is an op of its own (delayed_scaling.py), run by the layer's state after
forward and by backward for grad_output: the same operations run in eager and
under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear import ops
from transformer_linear._handles import NO_HANDLE, HandleTable
from transformer_linear.formats import layout
from transformer_linear.modules.linear_args import (
    LinearBwdArgs,
    LinearBwdContext,
    LinearFwdArgs,
    LinearFwdOutputs,
)
from transformer_linear.ops.args_op import args_op
from transformer_linear.recipe.delayed_scaling import (
    ForwardScales,
    forward_scales,
    quantize_and_record_grad_output,
    stand_in_forward_scales,
)
from transformer_linear.recipe.quantization import Quantized, flat

__all__ = ["QueuedWgrad", "WgradQueue", "compute_wgrad", "linear_dgrad", "linear_fwd", "linear_wgrad"]


class QueuedWgrad(NamedTuple):
    """What one backward left for ``backward_dw()``."""

    wgrad_args: Optional[Any]
    """What the layer's wgrad function reads: a LinearBwdArgs for ``tl.Linear``, a GroupedWgradArgs for
    ``tl.GroupedLinear`` (the queue passes it back to the function its owner gives :meth:`WgradQueue.apply`
    unread); None: the weight needs no gradient."""
    dbias: Optional[Tensor]


class WgradQueue:
    """delay_wgrad_compute: the weight gradients a layer's backwards left for its ``backward_dw()``.

    The layer owns its queue; backward reaches it through :attr:`handle`
    (_handles.py), which ``linear_fwd`` takes as ``wgrad_queue``. A copy
    (``deepcopy``, ``pickle``) is a new, empty queue.
    """

    def __init__(self) -> None:
        self._queued: list[QueuedWgrad] = []
        self.handle = _WGRAD_QUEUES.add(self)

    def __reduce__(self) -> tuple:
        return (WgradQueue, ())

    @staticmethod
    def get(handle: int) -> Optional["WgradQueue"]:
        """The queue of ``handle``, or None once its owner is gone."""
        return _WGRAD_QUEUES.get(handle)

    def append(self, queued: QueuedWgrad) -> None:
        self._queued.append(queued)

    def drain(self) -> list[QueuedWgrad]:
        """What was queued, in order; the queue is left empty."""
        queued, self._queued = self._queued, []
        return queued

    def apply(
        self,
        weight: Tensor,
        bias: Optional[Tensor],
        fuse_wgrad_accumulation: bool,
        compute: Callable[[Any, Optional[Tensor]], Optional[Tensor]],
    ) -> None:
        """``backward_dw()``: drain the queue, computing each weight gradient as ``compute(wgrad_args,
        main_grad)`` (added into ``weight.main_grad`` with fuse_wgrad_accumulation, where it returns None)
        and adding it and each queued bias gradient to the parameters' ``.grad``."""
        for queued in self.drain():
            if queued.wgrad_args is not None:
                main_grad = weight.main_grad if fuse_wgrad_accumulation else None
                _accumulate_grad(weight, compute(queued.wgrad_args, main_grad))
            if queued.dbias is not None:
                _accumulate_grad(bias, queued.dbias)


def _accumulate_grad(param: Tensor, grad: Optional[Tensor]) -> None:
    if grad is None:
        return
    grad = grad.detach()
    param.grad = grad if param.grad is None else param.grad + grad


_WGRAD_QUEUES: HandleTable[WgradQueue] = HandleTable()


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------

# linear_fwd's schema return type: LinearFwdOutputs as a plain tuple.
_FwdOutputs = tuple[(Tensor,) * len(LinearFwdOutputs._fields)]


def _rows(inp: Tensor) -> int:
    return math.prod(inp.shape[:-1])


def _hp_outputs(out: Tensor) -> LinearFwdOutputs:
    """linear_fwd's outputs without FP8: ``out``, every other slot empty (autograd saves the inputs)."""
    empty = out.new_empty(0, dtype=torch.float32)
    return LinearFwdOutputs(out, *(empty.clone() for _ in LinearFwdOutputs._fields[1:]))


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
    if not a.fp8:
        # Only the wgrad options reach here without FP8; autograd saves the inputs.
        out = torch.nn.functional.linear(x2d.to(a.out_dtype), weight.to(a.out_dtype), bias)
        return _hp_outputs(out)
    x2d = x2d.contiguous()
    weight_to_quantize = a.weight if a.cached_weight is None else None
    spec = a.quantization
    scales = forward_scales(a.delayed, x2d, weight_to_quantize, spec.input.dtype, spec.input.margin)
    return _fp8_fwd(a, x2d, bias, scales)


def _fp8_fwd(
    a: LinearFwdArgs, x2d: Tensor, bias: Optional[Tensor], scales: Optional[ForwardScales]
) -> LinearFwdOutputs:
    """The FP8 forward: the input and weight quantized by their quantizers in the usages backward reads
    (what autograd saves of the input is its columnwise usage), one scaled GEMM.

    ``scales``: what the delayed-scaling state gave (forward_scales), None where the quantizers compute
    their own. Given the scales it is made of custom ops, views and metadata-only ops, so it is its own
    fake implementation, each output shaped by the quantizer of its tensor. The input's saved scales
    leave it 1-D, as those of TensorQuantizer.quantize_flat (linear_wgrad reshapes them).
    """
    spec, cached = a.quantization, a.cached_weight
    empty_f32 = x2d.new_empty(0, dtype=torch.float32)
    # The columnwise usages are for quantized backward GEMMs only (backward_override: none).
    quantized_bwd = spec.backward_operands == "quantized"
    if cached is None:
        qw = spec.weight.quantize(a.weight.contiguous(), rowwise=True, columnwise=quantized_bwd,
                                  scale=scales.weight if scales else None)
        w_outputs = (qw.data, qw.data_t, qw.scale_inv, qw.scale_inv_t)
    else:
        qw = cached.quantized()
        # Outputs may not alias inputs: the cached weight is saved from the inputs (_setup_context).
        no_fp8 = x2d.new_empty(0, dtype=spec.weight.dtype)
        w_outputs = (no_fp8, no_fp8.clone(), empty_f32.clone(), empty_f32.clone())
    # The weight's scales in the form its quantizer's kind gives the GEMM (TensorQuantizer.scale_2d); the
    # input's quantizer runs the GEMM with its own (where its kind can, casting the input inside it).
    w_scale_inv = spec.weight.scale_2d(qw.scale_inv, qw.data)
    qx, out = spec.input.quantize_gemm(x2d, columnwise=a.weight_requires_grad and quantized_bwd,
                                       scale=scales.input if scales else None, other=qw.data,
                                       other_scale_inv=w_scale_inv, out_dtype=a.out_dtype, bias=bias)
    x_saved, x_saved_scale_inv = _saved_usage(spec.backward_operands, spec.input, qx)
    # The amaxes delayed scaling records (and a cached weight keeps): where both quantizers measure one.
    records_amax = spec.input.records_amax and spec.weight.records_amax
    w_fp8, w_fp8_t, w_scale_inv, w_scale_inv_t = w_outputs
    return LinearFwdOutputs(
        out,
        inp_saved=x_saved,
        inp_scale_inv=flat(x_saved_scale_inv),  # 1-D across the graph: TensorQuantizer.quantize_flat
        weight_fp8=w_fp8,
        weight_fp8_t=w_fp8_t,
        weight_scale_inv=w_scale_inv,
        weight_scale_inv_t=w_scale_inv_t,
        amax=torch.stack([qx.amax, qw.amax.reshape(())]) if records_amax else empty_f32.clone(),
        grad_output_scale=scales.grad_output_for_backward.clone() if scales else empty_f32.clone(),
        fwd_scales=torch.cat([scales.input, scales.weight, scales.grad_output]) if scales else empty_f32.clone(),
    )


def _saved_usage(backward_operands: str, quantizer, q: Quantized) -> tuple[Tensor, Tensor]:
    """(data, scale_inv) forward keeps of ``q`` for backward: the columnwise usage the quantized backward
    GEMM reads, the rowwise usage the forward GEMM read (backward dequantizes it), or nothing (empty: the
    high-precision backward reads the original tensor)."""
    if backward_operands == "quantized":
        return quantizer.columnwise_usage(q)
    if backward_operands == "dequantized":
        return q.data, q.scale_inv
    return q.data.new_empty(0), q.scale_inv.new_empty(0)


@linear_fwd.register_fake
def _(*values):
    a = linear_fwd.unflatten(values)
    x2d = a.inp.reshape(_rows(a.inp), a.weight.shape[1])
    bias = a.bias.to(a.out_dtype) if a.bias is not None else None
    if not a.fp8:
        return tuple(_hp_outputs(x2d.new_empty((x2d.shape[0], a.weight.shape[0]), dtype=a.out_dtype)))
    return tuple(_fp8_fwd(a, x2d, bias, stand_in_forward_scales(a.delayed, x2d)))


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
        w_t = a.quantization.weight.columnwise_operand(a.weight)
        # Gradients take the split (fp32-promoted) accumulator, as TE does; the
        # forward GEMM keeps the faster default.
        g_scale_inv = a.quantization.grad_output.scale_2d(a.grad_output_scale_inv, a.grad_output)
        w_t_scale_inv = a.quantization.weight.scale_2d(a.weight_scale_inv, w_t)
        dx = ops.fp8_gemm(a.grad_output, g_scale_inv, w_t, w_t_scale_inv, a.dgrad_dtype, use_split_accumulator=True)
    return dx.reshape(a.input_shape)


@linear_dgrad.register_fake
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


def _wgrad_operands(a: LinearBwdArgs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_outputᵀ, its scale_inv, xᵀ, its scale_inv) as FP8 GEMM operands, each from what its own
    quantizer's columnwise usage is (a copy read as it is, or the rowwise data transposed)."""
    spec = a.quantization
    g_t = spec.grad_output.columnwise_operand(a.grad_output_t)
    x_t = spec.input.columnwise_operand(a.inp)
    g_t_scale_inv = spec.grad_output.scale_2d(a.grad_output_t_scale_inv, g_t)
    return g_t, g_t_scale_inv, x_t, spec.input.scale_2d(a.inp_scale_inv, x_t)


@linear_wgrad.register_fake
def _(*values):
    a = linear_wgrad.unflatten(values)
    if a.inp_scale_inv is None:
        g_t, k = layout.transposed(a.grad_output_t), a.inp.shape[1]
    else:
        spec = a.quantization
        g_t, k = spec.grad_output.columnwise_operand(a.grad_output_t), spec.input.columnwise_operand(a.inp).shape[0]
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
    ctx.full_lists = linear_fwd.full_lists(inputs)
    # Only the first output has a gradient; saying so spares the graphs a detach per saved tensor.
    ctx.mark_non_differentiable(*o[1:])
    # Their gradients are never read: not materialized (autograd would fill zeros of each one's shape, a
    # weight-sized FP8 copy among them, every backward).
    ctx.set_materialize_grads(False)
    x_saved, x_scale_inv = o.inp_saved, o.inp_scale_inv
    if not a.fp8 or a.quantization.backward_operands == "high_precision":
        x_saved, x_scale_inv, w_saved, w_scale_inv = a.inp, None, a.weight, None
    else:
        # dgrad reads the weight's columnwise usage; outputs may not alias inputs, so a cached FP8 weight
        # is saved from the inputs.
        cached = a.cached_weight
        qw = cached.quantized() if cached is not None else Quantized(
            o.weight_fp8, o.weight_scale_inv, o.weight_fp8_t, o.weight_scale_inv_t
        )
        w_saved, w_scale_inv = _saved_usage(a.quantization.backward_operands, a.quantization.weight, qw)
    bwd = LinearBwdContext.from_fwd_args(a)
    ctx.save_for_backward(
        x_saved if a.weight_requires_grad else None,
        x_scale_inv,
        w_saved if a.input_requires_grad else None,
        w_scale_inv,
        o.grad_output_scale,  # delayed scaling's (empty otherwise)
    )
    ctx.bwd = bwd


def _backward(ctx, grad_out: Tensor, *_unused: Optional[Tensor]) -> tuple:
    x_saved, x_scale_inv, w_saved, w_scale_inv, grad_scale = ctx.saved_tensors
    c: LinearBwdContext = ctx.bwd
    g2d = grad_out.contiguous()  # linear_fwd's output, hence its gradient, is 2-D
    dbias_dtype = c.bias_dtype if c.bias_requires_grad else None
    quantizer = c.quantization.grad_output
    g_t_scale_inv = None
    if c.fp8 and c.quantization.backward_operands == "dequantized":
        # The forward's quantized operands in the gradient's (the compute) dtype; the GEMMs below then run
        # in high precision, as without FP8.
        spec = c.quantization
        x_saved = spec.input.dequantize(x_saved, x_scale_inv, g2d.dtype) if x_saved is not None else None
        w_saved = spec.weight.dequantize(w_saved, w_scale_inv, g2d.dtype) if w_saved is not None else None
        x_scale_inv = w_scale_inv = None
    if c.fp8 and c.quantization.backward_operands == "quantized":
        # dgrad reads the rowwise usage, wgrad the columnwise one, in one pass (the bias gradient fused in
        # where the quantizer fuses it).
        qg = quantize_and_record_grad_output(c.delayed, g2d, grad_scale, quantizer, dbias_dtype)
        if qg is None:  # no amax history: the quantizer's own scales
            qg = quantizer.quantize_flat(
                g2d, rowwise=c.input_requires_grad, columnwise=c.weight_requires_grad, dbias_dtype=dbias_dtype
            )
        g, g_scale_inv = qg.data, qg.scale_inv
        g_t, g_t_scale_inv = quantizer.columnwise_usage(qg)
        dbias = qg.dbias
        if dbias is None:
            dbias = ops.bias_grad(g2d, dbias_dtype) if c.bias_requires_grad else None
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
    if c.wgrad_queue != NO_HANDLE:
        queue = _WGRAD_QUEUES.get(c.wgrad_queue)  # None: its layer is gone, and nothing would drain it
        if queue is not None and (c.weight_requires_grad or c.bias_requires_grad):
            # The queue keeps what wgrad reads, not the weight dgrad needed.
            queued = dataclasses.replace(b, weight=None, weight_scale_inv=None) if c.weight_requires_grad else None
            queue.append(QueuedWgrad(queued, dbias))
        dbias = None
    elif c.weight_requires_grad:
        wgrad = compute_wgrad(b, c.main_grad)
    return linear_fwd.input_grads(ctx.full_lists, inp=dgrad, weight=wgrad, bias=dbias if c.bias_requires_grad else None)


linear_fwd.op.register_autograd(_backward, setup_context=_setup_context)
