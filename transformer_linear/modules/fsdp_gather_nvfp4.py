"""NVFP4 weights all-gathered in FP4 under FSDP2 (the NVFP4 case of :mod:`transformer_linear.modules.fp8_all_gather`).

An NVFP4 weight is E2M1 data (two codes a byte), one E4M3 scale per block and one float32 global scale
from the whole weight's amax (``reference/nvfp4.py``). A shard quantized on its own would get its own
global scale, so, as Transformer Engine's NVFP4Tensor does under FSDP2, each rank measures its shard's
amax (:func:`ops.nvfp4.nvfp4_amax`), the amaxes are all-reduced (MAX) over the shard group, and each
shard is quantized with that whole-weight amax (``TensorQuantizer.quantize(global_amax=...)``): the
gathered data and block scales are then bitwise the whole weight's quantized copy.

What is gathered: the uint8 data (rows, K/2) and the E4M3 block scales (rows, K/16), both rows first so
that FSDP2's dim-0 concatenation is the whole weight's; the global decode scale travels as metadata.
After the gather the packed scales the Linear reads (``ops.nvfp4.pack_scales``: global scale, then block
scales) are built, and the columnwise copy with them: with 16x16 blocks (TE's default weight blocks) it
is exactly the rowwise copy transposed (each byte's two codes transposed as a (K, N) grid of nibbles,
one scale per 16x16 tile transposed), so only the rowwise copy is gathered.

Not gathered in FP4 (:func:`check_nvfp4_shardable` raises at wrap time): 1x16 weight blocks (their
columnwise copy has blocks of its own along the weight's rows, and with RHT a global amax of its own),
and stochastic rounding of the weight (each shard would round with other random bits than the whole
weight; Transformer Engine rounds weights to nearest).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from transformer_linear import ops
from transformer_linear.formats.nvfp4 import BLOCK
from transformer_linear.modules.linear_args import CachedWeight
from transformer_linear.recipe.quantization import TensorQuantizer

__all__ = [
    "NVFP4Shard",
    "check_nvfp4_shardable",
    "nvfp4_cached_weight",
    "nvfp4_columnwise_of_2d",
    "quantize_nvfp4_shard",
    "refill_nvfp4_cached_weight",
]

_SQUARE_BLOCK = [BLOCK, BLOCK]


def check_nvfp4_shardable(quantizer: TensorQuantizer, rows: int, world_size: int, where: str) -> None:
    """Raise unless an NVFP4 weight quantizer's copies can be gathered in FP4 (see the module doc).

    Raises:
        ValueError: 1x16 weight blocks or stochastic rounding, naming why.
    """
    what = f"{where}: fp8_all_gather cannot shard a weight of {rows} rows over {world_size} ranks with NVFP4"
    fallback = "use fp8_all_gather=False for this layer (its weight is then gathered in high precision)"
    if list(quantizer.block_shape) != _SQUARE_BLOCK:
        raise ValueError(
            f"{what} {list(quantizer.block_shape)} blocks: only 16x16 weight blocks are gathered in FP4 (their "
            "columnwise copy is the rowwise one transposed); a 1x16 block's columnwise copy has blocks of its own "
            f"(and with RHT its own global scale), which is not gathered; {fallback}"
        )
    if quantizer.stochastic_rounding:
        raise ValueError(
            f"{what} stochastic rounding of the weight: each shard would round with other random bits than the "
            f"whole weight (the weight is rounded to nearest in Transformer Engine's NVFP4 recipe); {fallback}"
        )


class NVFP4Shard(NamedTuple):
    """A shard quantized with the whole weight's global amax: what is gathered, and the global scale."""

    data: Tensor
    """(shard rows, K/2) uint8, two E2M1 codes a byte."""
    block_scale: Tensor
    """(shard rows, K/16) float8_e4m3fn."""
    global_scale: Tensor
    """() float32 global decode scale (the whole weight's)."""
    amax: Tensor
    """() float32: the whole weight's amax."""


def _whole_weight_amax(shard: Tensor, module: nn.Module, group: Any, in_backward: bool) -> Tensor:
    """The whole weight's NVFP4 global amax: the MAX over the shard group of each shard's amax. Backward's
    gather (the weight has not changed since the forward) reuses the forward's, saving the all-reduce."""
    if in_backward:
        used: Optional[Tensor] = getattr(module, "_nvfp4_all_gather_amax", None)
        if used is not None:
            return used
    amax = ops.nvfp4.nvfp4_amax(shard).reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    amax = amax.reshape(())
    module._nvfp4_all_gather_amax = amax
    return amax


def quantize_nvfp4_shard(
    quantizer: TensorQuantizer, shard: Tensor, module: nn.Module, group: Any, in_backward: bool
) -> NVFP4Shard:
    """Quantize a contiguous 2-D ``shard`` (its rows a multiple of 16) rowwise with the whole weight's global
    amax; its block scales unpacked (rows first, as FSDP2 concatenates them)."""
    amax = _whole_weight_amax(shard, module, group, in_backward)
    q = quantizer.quantize(shard, rowwise=True, columnwise=False, global_amax=amax)
    rows, cols = shard.shape
    block_scale, global_scale = ops.nvfp4.unpack_scales(q.scale_inv, rows, cols)
    return NVFP4Shard(q.data, block_scale, global_scale, amax)


def nvfp4_columnwise_of_2d(data: Tensor, block_scale: Tensor) -> tuple[Tensor, Tensor]:
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


def _copies(data: Tensor, block_scale: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(packed scales, data_t, packed scales_t) of the gathered weight, as the quantizer returns them."""
    data_t, scale_t = nvfp4_columnwise_of_2d(data, block_scale)
    return ops.nvfp4.pack_scales(block_scale, global_scale), data_t, ops.nvfp4.pack_scales(scale_t, global_scale)


def nvfp4_cached_weight(data: Tensor, block_scale: Tensor, global_scale: Tensor) -> CachedWeight:
    """The weight the Linear reads, from the gathered data (N, K/2) and block scales (N, K/16) and the global
    decode scale: ``data`` as it is (a view of FSDP2's buffer), the rest tensors of its own."""
    packed, data_t, packed_t = _copies(data, block_scale, global_scale)
    return CachedWeight(data, data_t, packed, packed_t, None)


def refill_nvfp4_cached_weight(
    cached: CachedWeight, data: Tensor, block_scale: Tensor, global_scale: Tensor, refill: Any
) -> None:
    """Refill ``cached``'s own tensors (which FSDP2 reallocated before this gather) from this gather, in place
    with ``refill(dst, src)`` (backward's saved tensors are these)."""
    for dst, src in zip((cached.weight_scale_inv, cached.weight_fp8_t, cached.weight_scale_inv_t),
                        _copies(data, block_scale, global_scale)):
        refill(dst, src)
