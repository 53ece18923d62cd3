"""The ``"nvfp4"`` scaling kind: FP4 (E2M1) data, an E4M3 scale per 1x16 or 16x16 block and a float32 global
scale from the tensor's amax (ops/nvfp4.py, reference/nvfp4.py).

Each usage is a copy of its own (uint8 data, two codes a byte; 1-D packed scales: the global decode scale,
then the block scales), so every op of the Linear passes one scale tensor per usage along unchanged. With
16x16 tiles (TE's weight blocks) the columnwise copy is exactly the rowwise one transposed: each byte's two
codes transposed as a grid of nibbles, one scale per tile transposed. A weight's shards agree on the global
scale through an all-reduce of their amaxes, as Transformer Engine's NVFP4Tensor does under FSDP2; they
are then gathered as FP4 data and block scales, and the global decode scale travels as metadata.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from transformer_linear import ops, reference
from transformer_linear.formats.nvfp4 import BLOCK
from transformer_linear.ops.grouped_nvfp4 import (
    compact_columnwise,
    group_of_rows,
    nvfp4_grouped_gemm,
    nvfp4_grouped_gemm_wgrad,
    quantize_nvfp4_grouped_columnwise,
)
from transformer_linear.recipe.kind import (
    GatheredShard,
    Quantized,
    QuantizerFields,
    ScalingKind,
    no_usages,
    register_scaling_kind,
    stack_experts,
    stacked,
)
from transformer_linear.reference import nvfp4 as nvfp4_reference

__all__ = ["NVFP4Kind", "columnwise_of_2d", "masked_columnwise", "masked_to_groups", "nvfp4_range_stats"]

FP4_STORAGE_DTYPE = torch.uint8
_BLOCKS = ([1, BLOCK], [BLOCK, BLOCK])


def columnwise_of_2d(data: Tensor, block_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The columnwise copy (data_t (K, N/2) uint8, block scales (K, N/16)) of a 16x16-block copy
    (data (N, K/2) uint8, block scales (N, K/16), one value per row of each tile): the codes and the tile
    scales transposed, bitwise what the quantizer's columnwise copy is (N a multiple of 16)."""
    rows, cols = data.shape[0], 2 * data.shape[1]
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, cols)
    codes_t = codes.t()
    data_t = (codes_t[:, 0::2] | (codes_t[:, 1::2] << 4)).contiguous()
    tiles = block_scale.view(torch.uint8)[::BLOCK]  # one row of scales per 16-row band
    scale_t = tiles.t().repeat_interleave(BLOCK, dim=0).contiguous().view(torch.float8_e4m3fn)
    return data_t, scale_t


def masked_to_groups(t: Tensor, offs: Tensor) -> list[Tensor]:
    """One copy of ``t`` per group, its other rows zero (the group of a row found on the device)."""
    group = group_of_rows(t.shape[0], offs).unsqueeze(1)
    return [torch.where(group == g, t, torch.zeros((), dtype=t.dtype, device=t.device)) for g in range(offs.shape[0])]


def masked_columnwise(q: QuantizerFields, t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Each group's columnwise copy of ``t`` masked to its group (its other rows zero) by the NVFP4 quantizer
    ``q``, compact (ops.grouped_nvfp4: each group's 16-token bands only, about ``t``'s FP4 size, not G times
    it): (data_t (K, C/2), scales (8 G + K * C/16)). 1x16 blocks: one grouped quantize (on the CPU only the
    bands holding each group's tokens are quantized), with one stochastic-rounding seed per group drawn as
    quantizing each masked copy would; 16x16 tiles: each masked copy quantized by ``q``, its bands kept."""
    if q.block_shape != [1, BLOCK]:
        copies = [NVFP4.quantize(q, masked, rowwise=False, columnwise=True) for masked in masked_to_groups(t, offs)]
        masked = stack_experts(copies, rowwise=False, columnwise=True)
        return compact_columnwise(masked.data_t, masked.scale_inv_t, offs)
    seeds = None
    if q.stochastic_rounding:
        # One draw per group, in group order; each draw depends on its own tensor so that none is merged.
        draws = [ops.nvfp4.sr_seed(offs[g]) for g in range(offs.shape[0])]
        seeds = torch.stack(draws) if draws else torch.zeros(0, dtype=torch.int64)
    return quantize_nvfp4_grouped_columnwise(t, offs, q.rht, q.stochastic_rounding, seeds)


def nvfp4_range_stats(x: Tensor, scaling_2d: bool) -> dict[str, float]:
    """numerics' range statistics of a 2-D tensor quantized to NVFP4, rowwise (reference.nvfp4.quantize_nvfp4).

    ``scale`` is the smallest effective scale, 1 / (largest block decode scale x global decode scale); nothing
    saturates (the global scale maps the amax onto E4M3's and E2M1's maxima); underflow counts the elements
    rounded to zero within their block.
    """
    x = x.detach().float().reshape(-1, x.shape[-1])
    n = x.numel()
    if n == 0:
        return {"amax": 0.0, "scale": 1.0, "underflow": 0.0, "saturation": 0.0}
    amax = reference.amax(x)
    q = nvfp4_reference.quantize_nvfp4(x, amax, scaling_2d=scaling_2d)
    codes = nvfp4_reference.unpack_e2m1(q.data)
    underflow = (((codes & 7) == 0) & (x != 0)).sum().item() / n
    return {
        "amax": float(amax),
        "scale": float(1 / (q.scale.float().max() * q.global_scale)),
        "underflow": underflow,
        "saturation": 0.0,
    }


class NVFP4Kind(ScalingKind):
    """NVFP4 (see the module docstring)."""

    name = "nvfp4"

    def check(self, q: QuantizerFields) -> None:
        if q.dtype != FP4_STORAGE_DTYPE or list(q.block_shape) not in _BLOCKS or q.scale_dtype != torch.float8_e4m3fn:
            raise ValueError(
                "TensorQuantizer: FP4 data takes float8_e4m3fn scales of [1, 16] or [16, 16] blocks (NVFP4), "
                f"got {q.scale_dtype} scales of {q.block_shape} blocks"
            )
        if q.rht and q.block_shape != [1, BLOCK]:
            raise ValueError("TensorQuantizer: 'rht' applies to [1, 16] blocks only (a 16x16 tile's copies are "
                             "each other's transpose)")

    def gemm_scaling(self, q: QuantizerFields) -> str:
        return "NVFP4"  # ops.fp8_gemm's NVFP4 path (1x16 and 16x16 scales are both read per 1x16 block)

    def values_per_element(self, q: QuantizerFields) -> int:
        return 2

    def quantize(
        self, q: QuantizerFields, x: Tensor, rowwise: bool, columnwise: bool, scale: Optional[Tensor] = None,
        dbias_dtype: Optional[torch.dtype] = None, global_amax: Optional[Tensor] = None,
    ) -> Quantized:
        """The copies asked for (the packed form), one pass; the global scale from ``global_amax`` where given
        (a shard quantized as part of a whole tensor), else from ``x``'s amax."""
        if not (rowwise or columnwise):
            return no_usages(q, x)
        seed = ops.nvfp4.sr_seed(x) if q.stochastic_rounding else None
        scaling_2d = q.block_shape == [BLOCK, BLOCK]
        out = ops.nvfp4.quantize_nvfp4_packed(
            x, rowwise, columnwise, scaling_2d, q.rht and columnwise, q.stochastic_rounding, seed, global_amax
        )
        return Quantized(*out)

    def dequantize(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
        block_scale, global_scale = ops.nvfp4.unpack_scales(scale_inv, data.shape[0], 2 * data.shape[1])
        return nvfp4_reference.dequantize_nvfp4(data, block_scale, global_scale, dtype)

    def gemm_scale(self, q: QuantizerFields, scale_inv: Tensor, operand: Tensor) -> Tensor:
        return scale_inv  # packed with the global scale; the NVFP4 GEMM unpacks it

    def columnwise_is_transpose(self, q: QuantizerFields) -> bool:
        return q.block_shape == [BLOCK, BLOCK]

    def transpose_copy(self, q: QuantizerFields, data: Tensor, scale_inv: Tensor) -> tuple[Tensor, Tensor]:
        if not self.columnwise_is_transpose(q):
            return super().transpose_copy(q, data, scale_inv)
        if data.dim() == 3:
            copies = [self.transpose_copy(q, d, s) for d, s in zip(data, scale_inv)]
            return stacked([c[0] for c in copies]), stacked([c[1] for c in copies])
        rows, cols = data.shape[0], 2 * data.shape[1]
        block_scale, global_scale = ops.nvfp4.unpack_scales(scale_inv, rows, cols)
        data_t, scale_t = columnwise_of_2d(data, block_scale)
        return data_t, ops.nvfp4.pack_scales(scale_t, global_scale)

    def grouped_problem(self, input: QuantizerFields, weight: QuantizerFields,
                        grad_output: QuantizerFields) -> Optional[str]:
        return None  # ops.grouped_nvfp4

    def grouped_gemm(
        self, q_a: QuantizerFields, a: Tensor, a_scale_inv: Tensor, q_b: QuantizerFields, b: Tensor,
        b_scale_inv: Tensor, offs: Tensor, out_dtype: torch.dtype, bias: Optional[Tensor] = None,
    ) -> Tensor:
        return nvfp4_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)

    def grouped_columnwise(
        self, q: QuantizerFields, t: Tensor, offs: Tensor, rowwise: Optional[Quantized]
    ) -> tuple[Tensor, Tensor]:
        return masked_columnwise(q, t, offs)

    def grouped_wgrad(
        self, q: QuantizerFields, grad: Tensor, grad_scale_inv: Tensor, x: Tensor, x_scale_inv: Tensor,
        offs: Tensor, out_dtype: torch.dtype,
    ) -> Tensor:
        return nvfp4_grouped_gemm_wgrad(grad, grad_scale_inv, x, x_scale_inv, out_dtype, offs=offs)

    def shard_problem(self, q: QuantizerFields, rows: int, world_size: int) -> Optional[str]:
        if list(q.block_shape) != [BLOCK, BLOCK]:
            return (f"NVFP4 {list(q.block_shape)} blocks: only 16x16 weight blocks are gathered in FP4 (their "
                    "columnwise copy is the rowwise one transposed); a 1x16 block's columnwise copy has blocks of "
                    "its own (and with RHT its own global scale), which is not gathered")
        if q.stochastic_rounding:
            return ("NVFP4 stochastic rounding of the weight: each shard would round with other random bits than "
                    "the whole weight (the weight is rounded to nearest in Transformer Engine's NVFP4 recipe)")
        return super().shard_problem(q, rows, world_size)

    def experts_gather_problem(self, q: QuantizerFields) -> Optional[str]:
        # Each rank quantizes whole experts (each its own global scale, packed with its block scales): the
        # stacked packed form gathers as it is, and a 16x16 weight's columnwise copy is made after the gather.
        # A 1x16 weight's columnwise copy has blocks of its own (and with RHT its own global scale), whose
        # packed scales FSDP2's fixed buffers would have to hold beside the rowwise ones: not gathered.
        if list(q.block_shape) != [BLOCK, BLOCK]:
            return (f"NVFP4 {list(q.block_shape)} weight blocks: only 16x16 ones are gathered in FP4 (their "
                    "columnwise copy is the rowwise one transposed)")
        return None

    def whole_tensor_amax(self, q: QuantizerFields, shard: Tensor) -> Optional[Tensor]:
        return ops.nvfp4.nvfp4_amax(shard).reshape(1)

    def gather_form(self, q: QuantizerFields, shard: Quantized, padded_rows: int) -> GatheredShard:
        # The block scales unpacked, rows first as FSDP2 concatenates them; the global scale is the whole
        # weight's (the amax all-reduced), the same on every rank: metadata.
        rows, cols = shard.data.shape[0], 2 * shard.data.shape[1]
        block_scale, global_scale = ops.nvfp4.unpack_scales(shard.scale_inv, rows, cols)
        return GatheredShard((shard.data, block_scale), global_scale)

    def from_gathered(
        self, q: QuantizerFields, tensors: Sequence[Tensor], rows: int, scale_inv: Optional[Tensor]
    ) -> tuple[Tensor, Tensor]:
        return tensors[0][:rows], ops.nvfp4.pack_scales(tensors[1], scale_inv)

    def range_stats(self, q: QuantizerFields, x: Tensor, scale: Optional[Tensor]) -> dict[str, float]:
        return nvfp4_range_stats(x, q.block_shape == [BLOCK, BLOCK])


NVFP4 = register_scaling_kind(NVFP4Kind())
