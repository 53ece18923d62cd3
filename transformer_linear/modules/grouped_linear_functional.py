"""The grouped (mixture-of-experts) Linear's entry points: the functional form :func:`grouped_linear`
(``torch._grouped_mm``'s contract), :func:`run_grouped_linear` (the FP8 forward under a quantization spec,
which tl.GroupedLinear and transformers' experts call) and the high-precision path
(:func:`high_precision_grouped_linear`, :class:`HighPrecisionGroupedLinear`). The op and its autograd are
in grouped_linear_ops.py.
"""

# No ``from __future__ import annotations``: consistent with grouped_linear_ops (op schemas from annotations).
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_linear._handles import NO_HANDLE
from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.grouped_linear_args import (
    GroupedLinearFwdArgs,
    GroupedLinearFwdOutputs,
    GroupedWgradArgs,
)
from transformer_linear.modules.grouped_linear_ops import finish_wgrad, grouped_linear_fwd
from transformer_linear.modules.grouped_linear_quantize import check_grouped_quantization
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.ops.grouped_high_precision import group_ends
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import QuantizationSpec

__all__ = [
    "HighPrecisionGroupedLinear",
    "check_grouped_linear_args",
    "grouped_linear",
    "high_precision_grouped_linear",
    "output_dtype",
    "run_grouped_linear",
]



def high_precision_grouped_linear(inp: Tensor, weight: Tensor, offs: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The grouped Linear without FP8: one ``F.linear`` per group, rows past offs[-1] zero.

    Reads ``offs`` on the host (a device sync on a GPU): the group sizes become Python ints.
    """
    ends = group_ends("grouped_linear", offs, inp.shape[0])
    outs = []
    for g in range(weight.shape[0]):
        outs.append(F.linear(inp[ends[g] : ends[g + 1]], weight[g], None if bias is None else bias[g]))
    rest = inp.shape[0] - ends[-1]
    if rest:
        outs.append(inp.new_zeros((rest, weight.shape[1])))
    return torch.cat(outs) if outs else inp.new_zeros((0, weight.shape[1]))


def check_grouped_linear_args(where: str, inp: object, weight: object, offs: object, bias: object) -> None:
    """The shapes, dtypes and devices of a grouped Linear's arguments (no value is read).

    Raises:
        TypeError: a non-tensor, a wrong dtype, or tensors on different devices (meta among CPU included).
        ValueError: a wrong rank or shape.
    """
    for name, t in (("inp", inp), ("weight", weight), ("offs", offs), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.device != inp.device:
            raise TypeError(f"{where}: argument '{name}' is on {t.device}, expected {inp.device} (that of 'inp')")
    for name, t in (("inp", inp), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{where}: argument '{name}' must be float32, bfloat16 or float16, got {t.dtype}")
    if weight.dim() != 3:
        raise ValueError(f"{where}: argument 'weight' must be 3-D (num_gemms, out_features, in_features), "
                         f"got shape {list(weight.shape)}")
    if inp.dim() != 2 or inp.shape[1] != weight.shape[2]:
        raise ValueError(f"{where}: argument 'inp' must have shape (total_tokens, {weight.shape[2]}), "
                         f"got {list(inp.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != weight.shape[0]:
        raise ValueError(f"{where}: argument 'offs' must be a ({weight.shape[0]},) int32 tensor of cumulative row "
                         f"ends, got shape {list(offs.shape)} {offs.dtype}")
    if bias is not None and list(bias.shape) != [weight.shape[0], weight.shape[1]]:
        raise ValueError(f"{where}: argument 'bias' must have shape {[weight.shape[0], weight.shape[1]]}, "
                         f"got {list(bias.shape)}")


def output_dtype(inp: Tensor) -> torch.dtype:
    """The input's dtype, or the enclosing torch.autocast dtype."""
    device_type = inp.device.type
    autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if autocast else inp.dtype


def grouped_linear(
    inp: Tensor,
    weight: Tensor,
    offs: Tensor,
    bias: Optional[Tensor] = None,
    recipe: Optional[Recipe] = None,
) -> Tensor:
    """The grouped (mixture-of-experts) Linear, functional, with ``torch._grouped_mm``'s contract.

    ``out[offs[g-1]:offs[g]] = inp[offs[g-1]:offs[g]] @ weight[g]ᵀ + bias[g]``; rows past ``offs[-1]``
    are 0. With a recipe (this one, else an active ``tl.autocast``'s) the GEMMs run in FP8 (each
    expert's weight with scales of its own) and ``offs`` is never read on the host; without one the
    groups run as ``F.linear`` calls, reading ``offs`` on the host. A recipe whose scales come from an
    amax history (DelayedScaling) needs the state a module keeps: use :class:`tl.GroupedLinear`.

    Args:
        inp: (total_tokens, in_features), the tokens sorted by expert.
        weight: (num_gemms, out_features, in_features).
        offs: (num_gemms,) int32 cumulative row ends (empty groups allowed).
        bias: (num_gemms, out_features) or None.
        recipe: the FP8 recipe, or None (follow ``tl.autocast``).

    Returns:
        (total_tokens, out_features) in inp's dtype (or the torch.autocast dtype).

    Raises:
        TypeError: a non-tensor, a wrong dtype or device, or a recipe that is none.
        ValueError: a wrong shape; a DelayedScaling recipe (it needs a module's state).
        NotImplementedError: quantizers the grouped GEMMs do not take (see check_grouped_quantization).
    """
    check_grouped_linear_args("grouped_linear", inp, weight, offs, bias)
    recipe = layer_recipe(recipe)
    if recipe is None:
        return high_precision_grouped_linear(inp, weight, offs, bias)
    spec = check_grouped_quantization("grouped_linear", recipe)
    if spec.scale_from_history:
        raise ValueError(
            f"grouped_linear: recipe {type(recipe).__name__} takes its scales from an amax history, which the "
            "functional form does not keep: use tl.GroupedLinear (or Float8CurrentScaling)"
        )
    return run_grouped_linear(None, inp, weight, offs, bias, spec).out


def run_grouped_linear(
    owner: Optional[nn.Module], inp: Tensor, weight: Tensor, offs: Tensor, bias: Optional[Tensor],
    spec: QuantizationSpec, cached_weight: Optional[CachedWeight] = None, main_grad: Optional[Tensor] = None,
    wgrad_queue: int = NO_HANDLE,
) -> GroupedLinearFwdOutputs:
    """The FP8 grouped Linear's forward under ``spec`` (checked by check_grouped_quantization), through
    ``owner``'s delayed-scaling state where ``spec`` takes its scales from an amax history.

    Args:
        cached_weight: the experts' FP8 weights to reuse (is_first_microbatch=False), or None.
        main_grad: fuse_wgrad_accumulation's fp32 buffer, or None (the gradient goes to ``weight.grad``).
        wgrad_queue: delay_wgrad_compute's queue handle, or NO_HANDLE.
    """
    grad = torch.is_grad_enabled()
    args = GroupedLinearFwdArgs(
        inp=inp,
        weight=weight,
        bias=bias,
        cached_weight=cached_weight,
        offs=offs,
        input_requires_grad=grad and inp.requires_grad,
        weight_requires_grad=grad and weight.requires_grad,
        bias_requires_grad=grad and bias is not None and bias.requires_grad,
        quantization=spec,
        delayed=owner.delayed_scaling_state.op_args(owner, spec.history) if spec.history is not None else None,
        out_dtype=output_dtype(inp),
        main_grad=main_grad if grad and weight.requires_grad else None,
        wgrad_queue=wgrad_queue,
    )
    if owner is None:  # the functional form: no amax history
        return grouped_linear_fwd(args)
    return owner.delayed_scaling_state.forward(owner, args, grouped_linear_fwd)


class HighPrecisionGroupedLinear(torch.autograd.Function):
    """The grouped Linear without FP8 where the weight gradient is delayed (``wgrad_queue``) or added to
    ``main_grad``: the forward and the input gradient as high_precision_grouped_linear's ``F.linear`` loop,
    the weight gradient through finish_wgrad as the FP8 path's. Reads ``offs`` on the host."""

    @staticmethod
    def forward(ctx, inp, weight, bias, offs, main_grad, wgrad_queue):
        ctx.save_for_backward(inp, weight, offs)
        ctx.has_bias, ctx.main_grad, ctx.wgrad_queue = bias is not None, main_grad, wgrad_queue
        out_dtype = output_dtype(inp)
        return high_precision_grouped_linear(inp.to(out_dtype), weight.to(out_dtype), offs,
                                             None if bias is None else bias.to(out_dtype))

    @staticmethod
    def backward(ctx, grad_out):
        inp, weight, offs = ctx.saved_tensors
        g = grad_out.contiguous()
        dgrad = wgrad_args = dbias = None
        ends = [0, *(int(e) for e in offs.tolist())]
        if ctx.needs_input_grad[0]:
            dgrad = torch.zeros_like(inp)
            for e in range(weight.shape[0]):
                dgrad[ends[e] : ends[e + 1]] = g[ends[e] : ends[e + 1]] @ weight[e].to(g.dtype)
        if ctx.needs_input_grad[1]:
            wgrad_args = GroupedWgradArgs(g, None, inp.to(g.dtype), None, offs, weight.dtype, None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # Each group's rows summed as F.linear's backward sums them.
            dbias = torch.stack([g[ends[e] : ends[e + 1]].sum(0) for e in range(weight.shape[0])]).to(weight.dtype)
        wgrad, dbias = finish_wgrad(ctx.wgrad_queue, ctx.main_grad, wgrad_args, dbias)
        return dgrad, wgrad, dbias, None, None, None
