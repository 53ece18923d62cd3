"""The grouped (mixture-of-experts) Linear as a custom op with autograd: ``grouped_linear_fwd`` (the
functional form and the module's entry point are in grouped_linear_functional.py).

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
straddles two experts and nothing is padded (formats.grouped_scaling). :func:`check_grouped_quantization`
names what does not fit.

The recipe's ``backward_override`` (QuantizationSpec.backward_operands) is asked, never the recipe: with
"high_precision" autograd saves the original input and weights, with "dequantized" the rowwise copies the
forward GEMM read (no columnwise copies are made either way), and backward runs dgrad and wgrad per expert
in the gradient's dtype (ops.grouped_high_precision) on them, dequantized expert by expert for the latter;
grad_output is not quantized.
"""

# No ``from __future__ import annotations``: args_op reads the op schema from the field annotations.

import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear import ops
from transformer_linear._handles import NO_HANDLE
from transformer_linear.formats.dtypes import FP8_DTYPES
from transformer_linear.formats.grouped_scaling import (
    GROUPED_GEMM_SCALINGS,
    TOKEN_BLOCKS,
    WHOLE,
    token_scale_cols,
)
from transformer_linear.formats.nvfp4 import BLOCK as NVFP4_BLOCK
from transformer_linear.modules.linear_args import CachedWeight, args_op
from transformer_linear.modules.linear_ops import QueuedWgrad, WgradQueue
from transformer_linear.ops.grouped import (
    fp8_grouped_gemm,
    fp8_grouped_gemm_wgrad,
    fp8_grouped_gemm_wgrad_blockwise,
)
from transformer_linear.ops.grouped_high_precision import grouped_mm_dgrad, grouped_mm_wgrad
from transformer_linear.ops.grouped_nvfp4 import (
    compact_columnwise,
    group_of_rows,
    nvfp4_grouped_gemm,
    nvfp4_grouped_gemm_wgrad,
    quantize_nvfp4_grouped_columnwise,
)
from transformer_linear.ops.grouped_quantize import quantize_grouped_columnwise
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.delayed_scaling import (
    DelayedScalingArgs,
    ForwardScales,
    forward_scales,
    quantize_and_record_grad_output,
)
from transformer_linear.recipe.quantization import (
    QuantizationSpec,
    Quantized,
    TensorQuantizer,
    check_recipe,
    flat,
    quantization_spec,
    tensorwise_result,
)

__all__ = [
    "GroupedLinearFwdArgs",
    "GroupedLinearFwdOutputs",
    "GroupedWgradArgs",
    "check_grouped_quantization",
    "compute_grouped_wgrad",
    "group_sums",
    "grouped_linear_fwd",
    "quantize_expert_weights",
]


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


_FwdOutputs = tuple[(Tensor,) * len(GroupedLinearFwdOutputs._fields)]


def token_block(q: TensorQuantizer) -> int:
    """The token block of a block-scaling quantizer's grouped columnwise copy: its block along the row
    of the transposed tensor (WHOLE for rowwise scaling: one scale per column and group)."""
    return WHOLE if q.block_shape[1] == 0 else q.block_shape[1]


def check_grouped_quantization(where: str, recipe: Recipe) -> QuantizationSpec:
    """The quantizers of ``recipe``, checked to be ones the grouped GEMMs take: FP8 with one scale per
    tensor for every role, or block scales for every role, with 1 x B blocks (B 128, 32 or the whole row)
    of the input and grad_output alike, and weight scales that pair with them
    (grouped_scaling.GROUPED_GEMM_SCALINGS).

    Raises:
        TypeError: not a recipe (check_recipe).
        NotImplementedError: quantizers outside those (the message names the recipe and the role).
    """
    check_recipe(where, recipe)
    spec = quantization_spec(recipe)
    name = type(recipe).__name__

    def refuse(why: str) -> NotImplementedError:
        return NotImplementedError(
            f"{where}: recipe {name} {why}; the grouped GEMMs take FP8 with one scale per tensor for every role "
            "(DelayedScaling, Float8CurrentScaling), block scales for every role (Float8BlockScaling, "
            "MXFP8BlockScaling, Float8RowwiseScaling), or NVFP4 for every role (NVFP4BlockScaling)"
        )

    roles = {role: getattr(spec, role) for role in ("input", "weight", "grad_output")}
    nvfp4_roles = [q.is_nvfp4 for q in roles.values()]
    if all(nvfp4_roles):
        return spec  # the NVFP4 path (ops.grouped_nvfp4)
    if any(nvfp4_roles):
        raise refuse("mixes NVFP4 with other formats")
    for role, q in roles.items():
        if q.dtype not in FP8_DTYPES:
            raise refuse(f"quantizes the {role} to {q.dtype}")
    if len({q.blockwise for q in roles.values()}) > 1:
        raise refuse("mixes one scale per tensor with block scales")
    if not spec.input.blockwise:
        return spec
    for role in ("input", "grad_output"):
        q = roles[role]
        if q.block_shape[0] != 1 or token_block(q) not in TOKEN_BLOCKS or TOKEN_BLOCKS[token_block(q)] != q.scale_dtype:
            raise refuse(f"quantizes the {role} in {list(q.block_shape)} blocks of {q.scale_dtype} scales (the "
                         "grouped weight gradient takes 1x128 / 1x0 float32 or 1x32 E8M0 blocks)")
        if (q.gemm_scaling, spec.weight.gemm_scaling) not in GROUPED_GEMM_SCALINGS:
            raise refuse(f"pairs {q.gemm_scaling} {role} scales with {spec.weight.gemm_scaling} weight scales")
    if spec.input.block_shape != spec.grad_output.block_shape:
        raise refuse(f"quantizes the input in {list(spec.input.block_shape)} blocks and grad_output in "
                     f"{list(spec.grad_output.block_shape)} blocks (the grouped weight gradient takes one token block)")
    return spec


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


def masked_to_groups(t: Tensor, offs: Tensor) -> list[Tensor]:
    """One copy of ``t`` per group, its other rows zero (the group of a row found on the device)."""
    group = group_of_rows(t.shape[0], offs).unsqueeze(1)
    return [torch.where(group == g, t, torch.zeros((), dtype=t.dtype, device=t.device)) for g in range(offs.shape[0])]


def masked_columnwise_nvfp4(q: TensorQuantizer, t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Each group's columnwise copy of ``t`` masked to its group (its other rows zero) by the NVFP4 quantizer
    ``q``, compact (ops.grouped_nvfp4: each group's 16-token bands only, about ``t``'s FP4 size, not G times
    it): (data_t (K, C/2), scales (8 G + K * C/16)). 1x16 blocks: one grouped quantize (on the CPU only the
    bands holding each group's tokens are quantized), with one stochastic-rounding seed per group drawn as
    quantizing each masked copy would; 16x16 tiles: each masked copy quantized by ``q``, its bands kept."""
    if q.block_shape != [1, NVFP4_BLOCK]:
        qt = _stacked_nvfp4(q, masked_to_groups(t, offs), rowwise=False, columnwise=True)
        return compact_columnwise(qt.data_t, qt.scale_inv_t, offs)
    seeds = None
    if q.stochastic_rounding:
        # One draw per group, in group order; each draw depends on its own tensor so that none is merged.
        draws = [ops.nvfp4.sr_seed(offs[g]) for g in range(offs.shape[0])]
        seeds = torch.stack(draws) if draws else torch.zeros(0, dtype=torch.int64)
    return quantize_nvfp4_grouped_columnwise(t, offs, q.rht, q.stochastic_rounding, seeds)


def _stacked_nvfp4(q: TensorQuantizer, tensors: list[Tensor], rowwise: bool, columnwise: bool) -> Quantized:
    """Each tensor quantized by the NVFP4 quantizer ``q`` in the usages asked for, the copies stacked
    (data (G, ...), packed scales (G, S)); an absent usage is empty."""
    qs = [q.quantize(t, rowwise=rowwise, columnwise=columnwise) for t in tensors]

    def stacked(field: str, present: bool) -> Tensor:
        if not present:
            return getattr(qs[0], field).new_empty(0)
        # Copied into one tensor rather than stacked: torch.autocast's stack rejects FP8 scales.
        parts = [getattr(qt, field) for qt in qs]
        out = parts[0].new_empty((len(parts), *parts[0].shape))
        for g, part in enumerate(parts):
            out[g].copy_(part)
        return out

    return Quantized(stacked("data", rowwise), stacked("scale_inv", rowwise), stacked("data_t", columnwise),
                     stacked("scale_inv_t", columnwise))


def _quantize_experts(
    a: GroupedLinearFwdArgs, x: Tensor, scales: Optional[ForwardScales], columnwise: bool
) -> Quantized:
    """Each expert's weight quantized by the weight quantizer, stacked (:func:`quantize_expert_weights`),
    with the delayed-scaling state's weight scale where there is one (its amax then recorded)."""
    w = a.quantization.weight
    return quantize_expert_weights(w, a.weight, columnwise, scale=scales.weight if scales else None,
                                   records_amax=w.records_amax and scales is not None)


def quantize_expert_weights(
    w: TensorQuantizer, weight: Tensor, columnwise: bool, scale: Optional[Tensor] = None, records_amax: bool = False
) -> Quantized:
    """Each expert's weight of the (num_gemms, out_features, in_features) ``weight`` quantized by ``w``, stacked:
    rowwise for the forward GEMM and (``columnwise``: the input needs a quantized gradient) columnwise for
    dgrad. One scale per tensor: each expert's own (or ``scale``, the delayed-scaling state's, for all),
    scales (num_gemms,), and ``amax`` over all experts where ``records_amax``. Also what
    ``tl.quantized_model_init`` stores of a GroupedLinear's weight."""
    weight = weight.contiguous()
    groups, n, k = weight.shape
    if w.is_nvfp4:
        return _stacked_nvfp4(w, list(weight), rowwise=True, columnwise=columnwise)
    empty_f32 = weight.new_empty(0, dtype=torch.float32)
    if w.blockwise:
        qws = [w.quantize(weight[g], rowwise=True, columnwise=columnwise) for g in range(groups)]
        weight_scale_inv = torch.stack([q.scale_inv for q in qws])
        weight_scale_inv_t = torch.stack([q.scale_inv_t for q in qws]) if columnwise else empty_f32.clone()
        amax = None
    else:
        # One quantize pass per expert: the grouped GEMM takes one scale per expert. The quantizers are
        # tensorwise (check_grouped_quantization), so the pass also writes the transpose dgrad reads (the
        # fused cast + transpose costs next to nothing; a strided FP8 copy afterwards costs as much as a GEMM).
        qws = [
            tensorwise_result(ops.quantize_fused(weight[g], w.dtype, scale, margin=w.margin, columnwise=columnwise))
            for g in range(groups)
        ]
        weight_scale_inv = torch.cat([q.scale_inv.reshape(1) for q in qws])
        weight_scale_inv_t = weight_scale_inv.clone() if columnwise else empty_f32.clone()
        amax = torch.stack([q.amax.reshape(()) for q in qws]).amax() if records_amax else None
    weight_fp8, weight_fp8_t = _stacked_weights(weight, qws, (groups, n, k), w.dtype, columnwise)
    return Quantized(weight_fp8, weight_scale_inv, weight_fp8_t, weight_scale_inv_t, amax)


def _stacked_weights(x: Tensor, qws, shape, dtype, with_t: bool) -> tuple[Tensor, Tensor]:
    """Each expert's rowwise data and (``with_t``) columnwise data, copied into one tensor each rather than
    stacked: torch.autocast's stack rejects FP8."""
    groups, n, k = shape
    weight_fp8 = x.new_empty((groups, n, k), dtype=dtype)
    weight_fp8_t = x.new_empty((groups, k, n) if with_t else (0,), dtype=dtype)
    for g, q in enumerate(qws):
        weight_fp8[g].copy_(q.data)
        if with_t:
            weight_fp8_t[g].copy_(q.data_t)
    return weight_fp8, weight_fp8_t


@grouped_linear_fwd.op.register_fake
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


@dataclasses.dataclass(frozen=True)
class GroupedWgradArgs:
    """What the grouped weight gradient reads; backward runs it, or queues it for ``backward_dw()``."""

    grad_output: Tensor
    """One scale per tensor: the (total_tokens, out_features) rowwise FP8 data; block scales: its grouped
    columnwise copy (out_features, total_tokens); no recipe: the high-precision gradient."""
    grad_output_scale_inv: Optional[Tensor]
    """Its scales ((1,), or the grouped copy's 2-D grid); None without FP8."""
    inp: Tensor
    """As GroupedLinearFwdOutputs.inp_fp8 (no recipe: the high-precision input)."""
    inp_scale_inv: Optional[Tensor]
    """Its scales, 2-D for block scales; None without FP8."""
    offs: Tensor
    wgrad_dtype: torch.dtype
    token_block: Optional[int]
    """The block scales' token block (grouped_scaling.TOKEN_BLOCKS); None for one scale per tensor."""
    nvfp4: bool = False
    """NVFP4: ``grad_output`` / ``inp`` are the experts' compact columnwise copies of their masked tokens,
    (N, C/2) / (K, C/2), with their 1-D scales (ops.grouped_nvfp4)."""


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
