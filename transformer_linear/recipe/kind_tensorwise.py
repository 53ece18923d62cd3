"""The ``"tensorwise"`` scaling kind: one float32 scale for the whole tensor (delayed and current scaling).

The scale comes from the tensor's amax (current scaling), from a whole weight's amax all-reduced over its
shards, or is handed in (delayed scaling's history, ``TensorQuantizer.scale_from_history``). The columnwise
usage is the rowwise data transposed with the same scale: materialized only where the backend's GEMM wants
it (layout.needs_columnwise), and for stacked experts, whose grouped dgrad reads each expert's transpose.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from transformer_linear import ops, reference
from transformer_linear.formats import layout
from transformer_linear.formats.dtypes import FP8_DTYPES
from transformer_linear.ops.grouped import fp8_grouped_gemm, fp8_grouped_gemm_wgrad
from transformer_linear.recipe.kind import GatheredShard, Quantized, QuantizerFields, ScalingKind, register_scaling_kind

__all__ = ["TensorwiseKind", "quantize_tensorwise", "range_stats", "tensorwise_result", "transposed"]


def tensorwise_result(q: ops.QuantizeOutput) -> Quantized:
    """A per-tensor quantize pass's output as a :class:`Quantized` (its columnwise usage shares scale_inv)."""
    return Quantized(q.data, q.scale_inv, q.data_t, q.scale_inv.new_empty(0), q.amax, q.dbias)


def quantize_tensorwise(
    x: Tensor, dtype: torch.dtype, scale: Optional[Tensor], margin: int, **kwargs: Any
) -> ops.QuantizeOutput:
    """``ops.quantize_fused`` (``scale`` None: current scaling) with the transposed copy where the backend
    needs it (``layout.needs_columnwise``)."""
    return ops.quantize_fused(x, dtype, scale, margin=margin, columnwise=layout.needs_columnwise(x.device), **kwargs)


def transposed(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` with its last two dimensions swapped (as a quantizer makes a columnwise copy:
    standard strides, also for a dimension of size 1); each expert's of a stacked 3-D one. FP8 data goes
    through ``ops.transpose`` (a DTensor's local shards are transposed by its own rules, as torch's)."""
    if t.dtype in FP8_DTYPES and t.dim() in (2, 3) and not isinstance(t, DTensor):
        return ops.transpose(t)
    return layout.transposed_copy(t)


def range_stats(x: Tensor, dtype: torch.dtype, scale: Tensor | float) -> dict[str, float]:
    """How a high-precision tensor fares when cast to ``dtype`` with ``scale``.

    Returns:
        ``{"amax", "scale", "underflow", "saturation"}``: underflow is the fraction of non-zero elements that
        the cast flushes to zero; saturation the fraction whose scaled magnitude exceeds the format's max
        (they are clamped there).
    """
    x = x.detach().float()
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    n = x.numel()
    if n == 0:
        return {"amax": 0.0, "scale": float(scale_t), "underflow": 0.0, "saturation": 0.0}
    q, _ = reference.quantize(x, scale_t, dtype)
    nonzero = x != 0
    underflow = ((q.float() == 0) & nonzero).sum().item() / n
    # Strictly beyond (with a float32 rounding's slack): under current scaling
    # the amax element itself lands on max, give or take an ulp.
    saturation = ((x * scale_t).abs() > reference.fp8_max(dtype) * (1 + 2**-20)).sum().item() / n
    return {
        "amax": float(reference.amax(x)),
        "scale": float(scale_t),
        "underflow": underflow,
        "saturation": saturation,
    }


class TensorwiseKind(ScalingKind):
    """One scale per tensor (see the module docstring)."""

    name = "tensorwise"

    def check(self, q: QuantizerFields) -> None:
        super().check(q)
        if q.block_shape:
            raise ValueError(f"TensorQuantizer: the 'tensorwise' kind takes block_shape [], got {q.block_shape}")

    def per_tensor_scale(self, q: QuantizerFields) -> bool:
        return True

    def gemm_scaling(self, q: QuantizerFields) -> str:
        return "TensorWise"

    def scale_grid(self, q: QuantizerFields, rows: int, cols: int) -> tuple[int, int]:
        return 1, 1

    def quantize(
        self, q: QuantizerFields, x: Tensor, rowwise: bool, columnwise: bool, scale: Optional[Tensor] = None,
        dbias_dtype: Optional[torch.dtype] = None, global_amax: Optional[Tensor] = None,
    ) -> Quantized:
        # The rowwise data always, its transpose where the backend needs it: the usages asked for do not
        # change the pass. A whole tensor's amax (a shard's all-reduced) gives the scale the whole one gets.
        if scale is None and global_amax is not None:
            scale = reference.compute_scale(global_amax.float().reshape(1), reference.fp8_max(q.dtype), q.margin)
        return tensorwise_result(quantize_tensorwise(x, q.dtype, scale, q.margin, dbias_dtype=dbias_dtype))

    def quantize_gemm(
        self, q: QuantizerFields, x: Tensor, columnwise: bool, scale: Optional[Tensor], other: Tensor,
        other_scale_inv: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor] = None,
    ) -> tuple[Quantized, Tensor]:
        # One op (ops.quantize_fp8_gemm: the CPU casts x inside the GEMM) where the pass writes no transpose
        # and the weight has one scale too; otherwise the quantize pass, then the GEMM.
        if layout.needs_columnwise(x.device) or other.dtype not in FP8_DTYPES or other_scale_inv.numel() != 1:
            return super().quantize_gemm(q, x, columnwise, scale, other, other_scale_inv, out_dtype, bias)
        fused = ops.quantize_fp8_gemm(x, q.dtype, scale, other, other_scale_inv, out_dtype, bias, margin=q.margin)
        no_data_t, no_dbias = fused.data.new_empty(0), x.new_empty(0, dtype=torch.float32)
        return tensorwise_result(ops.QuantizeOutput(fused.data, no_data_t, fused.scale_inv, fused.amax, no_dbias)), fused.out

    def dequantize(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
        return ops.dequantize(data, scale_inv, dtype)

    def gemm_scale(self, q: QuantizerFields, scale_inv: Tensor, operand: Tensor) -> Tensor:
        return scale_inv

    def columnwise_is_copy(self, q: QuantizerFields) -> bool:
        return False

    def columnwise_is_transpose(self, q: QuantizerFields) -> bool:
        return True

    def transpose_copy(
        self, q: QuantizerFields, data: Tensor, scale_inv: Tensor
    ) -> tuple[Optional[Tensor], Optional[Tensor]]:
        if data.dim() == 3:
            # The grouped dgrad reads each expert's transpose, with the expert's one scale.
            return transposed(data), scale_inv.clone()
        return (transposed(data) if layout.needs_columnwise(data.device) else None), None

    def quantize_experts(
        self, q: QuantizerFields, weight: Tensor, columnwise: bool, scale: Optional[Tensor] = None,
        records_amax: bool = False,
    ) -> Quantized:
        # One quantize pass per expert: the grouped GEMM takes one scale per expert (or ``scale``, the
        # delayed-scaling state's, for all). The pass also writes the transpose dgrad reads (the fused
        # cast + transpose costs next to nothing; a strided FP8 copy afterwards costs as much as a GEMM).
        groups, n, k = weight.shape
        qws = [tensorwise_result(ops.quantize_fused(weight[g], q.dtype, scale, margin=q.margin, columnwise=columnwise))
               for g in range(groups)]
        empty_f32 = weight.new_empty(0, dtype=torch.float32)
        weight_scale_inv = torch.cat([e.scale_inv.reshape(1) for e in qws]) if qws else empty_f32.clone()
        weight_scale_inv_t = weight_scale_inv.clone() if columnwise else empty_f32.clone()
        amax = None
        if records_amax:
            amax = torch.stack([e.amax.reshape(()) for e in qws]).amax() if qws else empty_f32.new_zeros(())
        # Copied into one tensor rather than stacked: torch.autocast's stack rejects FP8.
        weight_fp8 = weight.new_empty((groups, n, k), dtype=q.dtype)
        weight_fp8_t = weight.new_empty((groups, k, n) if columnwise else (0,), dtype=q.dtype)
        for g, e in enumerate(qws):
            weight_fp8[g].copy_(e.data)
            if columnwise:
                weight_fp8_t[g].copy_(e.data_t)
        return Quantized(weight_fp8, weight_scale_inv, weight_fp8_t, weight_scale_inv_t, amax)

    def grouped_problem(self, input: QuantizerFields, weight: QuantizerFields,
                        grad_output: QuantizerFields) -> Optional[str]:
        return None

    def grouped_gemm(
        self, q_a: QuantizerFields, a: Tensor, a_scale_inv: Tensor, q_b: QuantizerFields, b: Tensor,
        b_scale_inv: Tensor, offs: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor] = None,
    ) -> Tensor:
        # One scale for a's tokens, one per expert for b (its experts each quantized on their own).
        return fp8_grouped_gemm(a, a_scale_inv.reshape(1), b, b_scale_inv, offs, out_dtype, bias)

    def grouped_columnwise(
        self, q: QuantizerFields, t: Tensor, offs: Tensor, rowwise: Optional[Quantized]
    ) -> tuple[Tensor, Tensor]:
        # One scale for all tokens: the rowwise copy, read transposed by the grouped wgrad.
        return rowwise.data, rowwise.scale_inv.reshape(1)

    def grouped_wgrad(
        self, q: QuantizerFields, grad: Tensor, grad_scale_inv: Tensor, x: Tensor, x_scale_inv: Tensor,
        offs: Tensor, out_dtype: torch.dtype,
    ) -> Tensor:
        return fp8_grouped_gemm_wgrad(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)

    def shard_problem(self, q: QuantizerFields, rows: int, world_size: int) -> Optional[str]:
        return None  # the scale is made whole-tensor by the amax all-reduce; any rows shard

    def whole_tensor_amax(self, q: QuantizerFields, shard: Tensor) -> Optional[Tensor]:
        return ops.amax(shard).reshape(1).float()

    def gather_form(self, q: QuantizerFields, shard: Quantized, padded_rows: int) -> GatheredShard:
        data = shard.data
        if data.shape[0] != padded_rows:
            # An uneven shard is padded to the first shard's rows, as FSDP2 pads the high-precision one.
            data = torch.cat([data, data.new_zeros(padded_rows - data.shape[0], data.shape[1])])
        # As bytes: FSDP2 all-gathers a group whose tensors share one dtype in that dtype (here the FP8 data
        # alone, when the layer has no bias), and gloo takes no 8-bit float; a byte copy is one on NCCL too.
        # Only the data is gathered; the scale, the same on all ranks, travels as metadata.
        return GatheredShard((data.view(torch.uint8),), shard.scale_inv.reshape(1))

    def from_gathered(
        self, q: QuantizerFields, tensors: Sequence[Tensor], rows: int, scale_inv: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        return tensors[0][:rows].view(q.dtype), scale_inv.clone()

    def range_stats(self, q: QuantizerFields, x: Tensor, scale: Optional[Tensor]) -> dict[str, float]:
        if scale is None:
            scale = reference.compute_scale(reference.amax(x.detach().float()), reference.fp8_max(q.dtype), q.margin)
        return range_stats(x, q.dtype, scale)


TENSORWISE = register_scaling_kind(TensorwiseKind())
