"""The packed NVFP4 scales the Linear carries: an NVFP4 copy's float32 global decode scale and its E4M3 block
scales in one 1-D tensor (:func:`pack_scales`, :func:`unpack_scales`, :func:`packed_scale_numel`).

A quantizer's result (recipe.quantization.Quantized) carries one scale tensor per usage, and the Linear's
ops pass that tensor along untouched. An NVFP4 copy has two scales, the E4M3 block scales and the float32
global decode scale, so its scale tensor packs both, 1-D (as every activation's block scales cross a
traced graph, see TensorQuantizer.quantize_flat): the global scale's 32 bits as 8 elements of 4 bits each
(least significant first, each element's byte 0x00-0x0F: a finite E4M3 value, never NaN, so the packed
tensor compares and prints like any scale tensor), then the block scales row-major. ``nvfp4_gemm_packed``
unpacks them; the data stays uint8 (two E2M1 codes a byte), which torch.export can save (it cannot save
float4 dtypes).
"""

from __future__ import annotations

import torch

from transformer_linear.formats.nvfp4 import BLOCK

__all__ = ["GLOBAL_SCALE_ELEMENTS", "pack_scales", "packed_scale_numel", "unpack_scales"]

GLOBAL_SCALE_ELEMENTS = 8
"""Elements at the front of a packed scale tensor holding the float32 global decode scale, 4 bits each."""
_NIBBLE_SHIFTS = tuple(range(0, 32, 4))


def packed_scale_numel(rows: int, cols: int) -> int:
    """Elements of the packed scales of a (rows, cols) copy: the global scale's 8 + one per 16 columns."""
    return GLOBAL_SCALE_ELEMENTS + rows * (cols // BLOCK)


def _global_scale_head(global_scale: torch.Tensor) -> torch.Tensor:
    """The packed head of a () float32 global scale: its 32 bits as 8 nibbles, one a uint8 (no host read)."""
    bits = global_scale.reshape(1).view(torch.int32).to(torch.int64)
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int64, device=global_scale.device)
    return ((bits >> shifts) & 0xF).to(torch.uint8)


def pack_scales(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """(rows, cols/16) E4M3 block scales and a () float32 global scale as one 1-D float8_e4m3fn tensor."""
    head = _global_scale_head(global_scale).to(scale.device)
    return torch.cat([head, scale.reshape(-1).view(torch.uint8)]).view(torch.float8_e4m3fn)


def unpack_scales(packed: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales (rows, cols/16), global scale ()) of the packed scales of a (rows, cols) copy."""
    raw = packed.view(torch.uint8)
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int64, device=packed.device)
    bits = (raw[:GLOBAL_SCALE_ELEMENTS].to(torch.int64) << shifts).sum()
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # the int32 of those 32 bits
    global_scale = bits.to(torch.int32).reshape(1).view(torch.float32).reshape(())
    return raw[GLOBAL_SCALE_ELEMENTS:].view(torch.float8_e4m3fn).reshape(rows, cols // BLOCK), global_scale


def write_packed_global_scale(packed: torch.Tensor, global_scale: torch.Tensor) -> None:
    """The head of packed scales (see :func:`pack_scales`) from a () float32 global scale."""
    packed[:GLOBAL_SCALE_ELEMENTS].view(torch.uint8).copy_(_global_scale_head(global_scale))
