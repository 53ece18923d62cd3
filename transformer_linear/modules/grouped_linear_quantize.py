"""How the grouped (mixture-of-experts) Linear's operands are quantized: which recipes' quantizers the grouped
GEMMs take (:func:`check_grouped_quantization`), the experts' weights quantized and stacked
(:func:`quantize_expert_weights`, also what ``tl.quantized_model_init`` stores of a GroupedLinear's weight),
and NVFP4's per-group masked columnwise copies for the weight gradient (:func:`masked_columnwise_nvfp4`).
The op that runs them is in grouped_linear_ops.py.
"""

from typing import Optional

import torch
from torch import Tensor

from transformer_linear import ops
from transformer_linear.formats.dtypes import FP8_DTYPES
from transformer_linear.formats.grouped_scaling import GROUPED_GEMM_SCALINGS, TOKEN_BLOCKS, WHOLE
from transformer_linear.formats.nvfp4 import BLOCK as NVFP4_BLOCK
from transformer_linear.ops.grouped_nvfp4 import compact_columnwise, group_of_rows, quantize_nvfp4_grouped_columnwise
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import (
    QuantizationSpec,
    Quantized,
    TensorQuantizer,
    check_recipe,
    quantization_spec,
    tensorwise_result,
)

__all__ = [
    "check_grouped_quantization",
    "masked_columnwise_nvfp4",
    "masked_to_groups",
    "quantize_expert_weights",
    "token_block",
]


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
