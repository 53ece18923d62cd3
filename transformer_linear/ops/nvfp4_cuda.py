"""The CUDA kernels of the NVFP4 ops: Triton, and cuBLASLt's NVFP4 matmul where the GPU and the build have it.

``transformer_linear::quantize_nvfp4`` on CUDA tensors runs the Triton quantize
(``ops.triton.quantize_nvfp4``, bitwise the CPU kernel's result). ``transformer_linear::nvfp4_gemm``
runs cuBLASLt's block-scaled FP4 matmul (csrc/cuda/gemm_nvfp4_cuda.cpp: CUDA_R_4F_E2M1 operands,
VEC16_UE4M3 block scales) when all of these hold, and the Triton GEMM (``ops.triton.gemm_nvfp4``)
otherwise, as the block-scaled FP8 GEMMs decide (``ops.gemm_block_cuda``):

- a CUDA build whose kernels run on this GPU (``torch_cuda.kernel_problem``), of compute capability
  10.x or later (cuBLASLt's FP4 tensor cores: sm_100 and newer), with cuBLAS headers and the loaded
  library at 12.8 or later;
- cuBLASLt's FP4 layout: K a multiple of 32, N a multiple of 16 (the float32 output's rows).

cuBLASLt returns the float32 product of the block-scaled operands; the global scales and the bias are
applied after it in float32, in the reference's order (``acc * (a_global * b_global) + bias``, then the
cast). When cuBLASLt still declines (no algorithm from its heuristic) the Triton kernel runs. Without a
GPU none of this runs; the decision and the scale layout are unit-tested on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear import _C
from transformer_linear.formats.checks import check_hp_dtype
from transformer_linear.formats.nvfp4 import BLOCK
from transformer_linear.ops import gemm_block_cuda, nvfp4_gemm, nvfp4_quantize, torch_cuda, triton_route
from transformer_linear.ops.descriptors import cublas_workspace, desc, stream_for

__all__ = ["cublaslt_nvfp4_applies", "cublaslt_nvfp4_operands_fit", "cublaslt_nvfp4_scale", "nvfp4_gemm_cublaslt"]

_MIN_CUBLAS = 120800
"""CUBLAS_VERSION encoding of cuBLAS 12.8, the first with CUDA_R_4F_E2M1 and VEC16_UE4M3 scales."""


def cublaslt_nvfp4_applies(capability: tuple[int, int], build_info: Optional[dict]) -> bool:
    """Whether this build's cuBLASLt runs NVFP4 matmuls on a GPU of ``capability``.

    Args:
        capability: the GPU's compute capability (major, minor).
        build_info: ``_C.cuda_build_info()`` (None for a CPU-only build).
    """
    if build_info is None or capability[0] < 10 or torch_cuda.kernel_problem(build_info, capability) is not None:
        return False
    version = min(build_info.get("cublas_header_version", 0), build_info.get("cublaslt_version", 0))
    return version >= _MIN_CUBLAS


def cublaslt_nvfp4_operands_fit(m: int, n: int, k: int) -> bool:
    """cuBLASLt's FP4 layout rules on an (M, K) x (N, K) problem (K counted in FP4 elements)."""
    return k > 0 and k % 32 == 0 and n % 16 == 0


def cublaslt_nvfp4_scale(scale: torch.Tensor) -> torch.Tensor:
    """(rows, K/16) E4M3 block scales as cuBLASLt's VEC16_UE4M3 reads them: their uint8 bits in 128x4 tiles,
    rows padded to 128 and K/16 to 4 with zeros, flat (the same tile layout as MXFP8's E8M0 scales)."""
    return gemm_block_cuda.cublaslt_scale(scale.view(torch.uint8), "BlockWise1x32", scale.shape[0])


def nvfp4_gemm_cublaslt(a, a_scale, a_global_scale, b, b_scale, b_global_scale, out_dtype, bias):
    """The NVFP4 GEMM through cuBLASLt, or None where it does not run (the caller runs Triton).

    Arguments as the ``transformer_linear::nvfp4_gemm`` op's, on a CUDA device.
    """
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    capability = torch.cuda.get_device_capability(a.device)
    if not (cublaslt_nvfp4_applies(capability, torch_cuda.build_info()) and cublaslt_nvfp4_operands_fit(m, n, k)):
        return None
    # Named: each tensor must outlive the call (a temporary's memory could go to the next allocation).
    a_data, b_data = a.view(torch.uint8).contiguous(), b.view(torch.uint8).contiguous()
    a_scale_lt, b_scale_lt = cublaslt_nvfp4_scale(a_scale), cublaslt_nvfp4_scale(b_scale)
    workspace = cublas_workspace(a.device)
    acc = torch.empty((m, n), dtype=torch.float32, device=a.device)
    op = "nvfp4_gemm"
    ran = _C.nvfp4_gemm_cublaslt(
        desc(a_data, op, "a"), desc(a_scale_lt, op, "a_scale"), desc(b_data, op, "b"),
        desc(b_scale_lt, op, "b_scale"), desc(acc, op, "d"), desc(workspace, op, "workspace"), stream_for(a),
    )
    if not ran:
        return None
    out = acc * (a_global_scale.float().reshape(()) * b_global_scale.float().reshape(()))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@nvfp4_quantize._quantize_nvfp4_op.register_kernel("cuda")
def _(x, amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, offset):
    nvfp4_quantize._check_quantize_op("quantize_nvfp4", x, amax, amax_t, rowwise, columnwise, scaling_2d, rht)
    return list(triton_route.kernels().quantize_nvfp4(
        x.contiguous(), amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, offset
    ))


@nvfp4_gemm._nvfp4_gemm_op.register_kernel("cuda")
def _(a, a_scale, a_global_scale, b, b_scale, b_global_scale, out_dtype, bias):
    nvfp4_gemm._check_gemm_op("nvfp4_gemm", a, a_scale, a_global_scale, b, b_scale, b_global_scale, bias)
    check_hp_dtype("nvfp4_gemm", "out_dtype", out_dtype)
    if a.shape[1] * 2 % BLOCK == 0 and a.numel() and b.numel():
        out = nvfp4_gemm_cublaslt(a, a_scale, a_global_scale, b, b_scale, b_global_scale, out_dtype, bias)
        if out is not None:
            return out
    return triton_route.kernels().nvfp4_gemm(a, a_scale, a_global_scale, b, b_scale, b_global_scale, out_dtype, bias)
