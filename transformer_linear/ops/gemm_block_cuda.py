"""cuBLASLt's own block-scaled FP8 matmul for CUDA block-scaled GEMMs, where the GPU and the build have it.

``ops.fp8_gemm`` on CUDA tensors with block scales runs cuBLASLt's block-scaled
matmul (csrc/cuda/gemm_block_cuda.cpp) when all of these hold, and the Triton
kernel (``transformer_linear.ops.triton.gemm_block``) otherwise:

- cuBLASLt has a block-scaled matmul for the scaling pair (a, b) on this GPU,
  in this build's cuBLAS headers and the loaded library: the table of
  csrc/common/cublaslt_block_pairs.cpp, asked through
  ``_C.cublaslt_block_pair_runs`` (at the time of writing: MXFP8's
  (BlockWise1x32, BlockWise1x32) on sm_100+ from cuBLAS 12.8; (BlockWise1x128,
  BlockWise128x128), reversed, (BlockWise1x128, BlockWise1x128) and (RowWise,
  RowWise) on sm_90 from 12.9);
- the extension's CUDA kernels run on this GPU (``torch_cuda.kernel_problem``);
- FP8 tensor-core layout: both operands K-major (row-major ``a`` (M, K) and
  ``b`` (N, K)), K, N and the leading dimensions multiples of 16, 16-byte
  aligned addresses, not e5m2 x e5m2;
- K a multiple of the block width (32 or 128), and M a multiple of 8 when
  ``a`` has 1x128 blocks (TE's outer-dimension rule).

cuBLASLt reads the scales in its own layouts (csrc/cuda/gemm_block_cuda.h);
:func:`cublaslt_scale` converts the package's row-major scale matrices to them.
When cuBLASLt still declines (no algorithm from its heuristic) the Triton
kernel runs. Without a GPU none of this runs; the decision and the layouts
are unit-tested on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear import _C
from transformer_linear.formats.block_scaling import k_block_width
from transformer_linear.formats.layout import fp8_tensor_cores_take
from transformer_linear.ops import torch_cuda
from transformer_linear.ops.descriptors import cublas_workspace, desc, stream_for

__all__ = [
    "cublaslt_block_applies",
    "cublaslt_operands_fit",
    "cublaslt_scale",
    "cublaslt_takes",
    "fp8_gemm_cublaslt",
]


# The extension's table of the pairs (csrc/common/cublaslt_block_pairs.cpp), in every build.
_pair_runs = _C.cublaslt_block_pair_runs


def cublaslt_block_applies(
    a_scaling: str, b_scaling: str, capability: tuple[int, int], build_info: Optional[dict]
) -> bool:
    """Whether this build's cuBLASLt runs the scaling pair on a GPU of ``capability`` (the extension's table)
    and the extension's CUDA kernels run there.

    Args:
        a_scaling, b_scaling: ScalingType names of a and b.
        capability: the GPU's compute capability (major, minor).
        build_info: ``_C.cuda_build_info()``: None for a CPU-only build; its
            ``cublas_header_version`` and ``cublaslt_version`` are CUBLAS_VERSION
            encodings (major * 10000 + minor * 100 + patch).
    """
    if build_info is None or torch_cuda.kernel_problem(build_info, capability) is not None:
        return False
    version = min(build_info.get("cublas_header_version", 0), build_info.get("cublaslt_version", 0))
    return _pair_runs(a_scaling, b_scaling, capability[0], capability[1], version)


def cublaslt_operands_fit(a: torch.Tensor, b: torch.Tensor, a_scaling: str, b_scaling: str) -> bool:
    """Whether the operands meet cuBLASLt's block-scaled layout rules (the list above)."""
    m, k = a.shape
    blocks_whole = all(k % k_block_width(s) == 0 for s in (a_scaling, b_scaling))
    outer = a_scaling != "BlockWise1x128" or m % 8 == 0
    return fp8_tensor_cores_take(a, b, aligned=True) and k > 0 and blocks_whole and outer


def cublaslt_takes(a: torch.Tensor, b: torch.Tensor, a_scaling: str, b_scaling: str) -> bool:
    """Whether cuBLASLt's block-scaled matmul may run ``a`` x ``b`` (this build, this GPU, these operands);
    False for a build without CUDA (asking no GPU)."""
    build_info = torch_cuda.build_info()
    if build_info is None:
        return False
    capability = torch.cuda.get_device_capability(a.device)
    return cublaslt_block_applies(a_scaling, b_scaling, capability, build_info) and cublaslt_operands_fit(
        a, b, a_scaling, b_scaling
    )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _mx_swizzle(bits: torch.Tensor) -> torch.Tensor:
    """The (rows, cols) uint8 matrix in cuBLAS's 128x4-tile layout, flat.

    Rows padded to 128 and columns to 4 (zeros); tiles in row-major order; in a
    tile, element (r, c) at 16 * (r % 32) + 4 * (r // 32) + c.
    """
    rows, cols = bits.shape
    padded_rows, padded_cols = _round_up(rows, 128), _round_up(cols, 4)
    padded = bits.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = bits
    # [tile row, r // 32, r % 32, tile col, c] -> [tile row, tile col, r % 32, r // 32, c]
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def cublaslt_scale(scale_inv: torch.Tensor, scaling: str, rows: int) -> torch.Tensor:
    """An operand's scales in the layout cuBLASLt's block-scaled matmul reads (gemm_block_cuda.h).

    Args:
        scale_inv: the package's scales of an operand with ``rows`` rows:
            (rows, 1) RowWise, (rows, Kb) BlockWise1x128 or E8M0 BlockWise1x32,
            (ceil(rows / 128), Kb) BlockWise128x128.
        scaling: the ScalingType name.
        rows: the operand's rows (M for a, N for b).

    Returns:
        A new contiguous tensor: RowWise (rows, 1); BlockWise1x128
        (Kb, round_up(rows, 4)), rows fastest; BlockWise128x128
        (ceil(rows / 128), round_up(Kb, 4)); BlockWise1x32 uint8 E8M0 bits
        in 128x4 tiles, flat.
    """
    if scaling == "RowWise":
        return scale_inv.reshape(rows, 1).contiguous()
    if scaling == "BlockWise1x128":
        blocks = scale_inv.shape[1]
        out = scale_inv.new_zeros(blocks, _round_up(rows, 4))
        out[:, :rows] = scale_inv.t()
        return out
    if scaling == "BlockWise128x128":
        out = scale_inv.new_zeros(scale_inv.shape[0], _round_up(scale_inv.shape[1], 4))
        out[:, : scale_inv.shape[1]] = scale_inv
        return out
    if scaling == "BlockWise1x32":
        return _mx_swizzle(scale_inv.view(torch.uint8))
    raise ValueError(f"fp8_gemm: cuBLASLt has no block-scaled matmul for {scaling} scales")


def fp8_gemm_cublaslt(
    a, a_scale_inv, b, b_scale_inv, out_dtype, bias, a_scaling: str, b_scaling: str
) -> Optional[torch.Tensor]:
    """The block-scaled GEMM through cuBLASLt, or None where it does not run (the caller runs Triton).

    Arguments as the ``transformer_linear::fp8_gemm_blockwise`` op's (ops/block.py): CUDA
    tensors, ``a_scaling`` / ``b_scaling`` the ScalingTypes resolve_gemm_scalings found.
    """
    if not cublaslt_takes(a, b, a_scaling, b_scaling):
        return None
    # Named: each tensor must outlive the call (a temporary's memory could go to the next allocation).
    a_scale_lt = cublaslt_scale(a_scale_inv, a_scaling, a.shape[0])
    b_scale_lt = cublaslt_scale(b_scale_inv, b_scaling, b.shape[0])
    workspace = cublas_workspace(a.device)
    out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    op = "fp8_gemm"
    ran = _C.fp8_gemm_blockwise_cublaslt(
        desc(a, op, "a"),
        desc(a_scale_lt, op, "a_scale_inv"),
        a_scaling,
        desc(b, op, "b"),
        desc(b_scale_lt, op, "b_scale_inv"),
        b_scaling,
        desc(bias, op, "bias"),
        desc(out, op, "d"),
        desc(workspace, op, "workspace"),
        stream_for(a),
    )
    return out if ran else None
