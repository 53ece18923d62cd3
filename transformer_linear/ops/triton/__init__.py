"""Triton kernels of the block-scaled recipes and NVFP4, callable directly with the ops' signatures.

``from transformer_linear.ops.triton import quantize_blockwise, fp8_gemm`` works on
CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (set before
triton is first imported), which is how the tests run them without a GPU.
``transformer_linear.ops`` routes CUDA block-scaled calls here.
"""

from transformer_linear.ops.triton.gemm_block import fp8_gemm, fp8_gemm_resolved
from transformer_linear.ops.triton.gemm_grouped import (
    fp8_grouped_gemm,
    fp8_grouped_gemm_resolved,
    fp8_grouped_gemm_wgrad,
    fp8_grouped_gemm_wgrad_blockwise,
)
from transformer_linear.ops.triton.gemm_nvfp4 import nvfp4_gemm
from transformer_linear.ops.triton.quantize_block import quantize_blockwise, quantize_blockwise_fused
from transformer_linear.ops.triton.quantize_nvfp4 import quantize_nvfp4

__all__ = [
    "fp8_gemm",
    "fp8_gemm_resolved",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_resolved",
    "fp8_grouped_gemm_wgrad",
    "fp8_grouped_gemm_wgrad_blockwise",
    "nvfp4_gemm",
    "quantize_blockwise",
    "quantize_blockwise_fused",
    "quantize_nvfp4",
]
