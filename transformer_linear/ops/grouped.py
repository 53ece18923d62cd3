"""Grouped FP8 GEMMs (mixture-of-experts): the forward GEMM and its weight gradient, as torch ops.

Modelled on ``torch._grouped_mm`` (2-D tokens x 3-D weights with ``offs``) and Transformer Engine's
grouped GEMM; the layouts and scalings are described in ``transformer_linear.formats.grouped_scaling``.
Each op is a ``torch.library`` custom op whose fake implementation takes its output shape from the
operands alone, so ``torch.compile`` traces one graph for any routing. CPU tensors run the
extension's kernel, which reads and checks ``offs`` itself; CUDA tensors run the Triton kernels of
``transformer_linear.ops.triton``, and the tensorwise forward / dgrad GEMM cuBLASLt's grouped matmul where
the build, the loaded cuBLASLt (13.10+) and the GPU (sm_89+) have it. No path copies
``offs`` to the host: there is no device sync, and ``offs`` can change between calls without
recompiling. On CUDA, ``offs`` values are not checked (that would sync); out-of-range values are
clamped by the kernels so that they never access memory outside the operands.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear import _C
from transformer_linear.formats.checks import check_scale_values
from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.formats.grouped_scaling import (
    GROUPED_GEMM_SCALINGS,
    WHOLE,
    check_grouped_gemm_args,
    check_grouped_wgrad_args,
    check_grouped_wgrad_blockwise_args,
    resolve_grouped_scalings,
)
from transformer_linear.ops import library, torch_cuda, triton_route
from transformer_linear.ops.descriptors import cublas_workspace, desc, stream_for

__all__ = ["fp8_grouped_gemm", "fp8_grouped_gemm_wgrad", "fp8_grouped_gemm_wgrad_blockwise"]


def _kernel_scale(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales cross into the kernels as their uint8 bits."""
    return t.view(torch.uint8) if t.dtype == E8M0_DTYPE else t


def _scale_grids(a_scale_inv, b_scale_inv, a_block, b_block, groups):
    """The scales as the kernels index them: a's as one 2-D grid, b's as G grids (one element each
    where a block spans the whole weight, TensorWise)."""
    sa = a_scale_inv.reshape(1, 1) if a_block[0] == WHOLE else a_scale_inv
    sb = b_scale_inv.reshape(groups, 1, 1) if b_block[0] == WHOLE else b_scale_inv
    return _kernel_scale(sa), _kernel_scale(sb)


@library.custom_op("transformer_linear::fp8_grouped_gemm", mutates_args=(), device_types="cpu")
def _fp8_grouped_gemm_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    a_block: list[int],
    b_block: list[int],
) -> torch.Tensor:
    op = "fp8_grouped_gemm"
    check_grouped_gemm_args(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    check_scale_values(op, {"a_scale_inv": a_scale_inv, "b_scale_inv": b_scale_inv})
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    sa, sb = _scale_grids(a_scale_inv, b_scale_inv, a_block, b_block, b.shape[0])
    _C.fp8_grouped_gemm(
        desc(a, op, "a"), desc(sa, op, "a_scale_inv"), desc(b, op, "b"), desc(sb, op, "b_scale_inv"),
        desc(offs, op, "offs"), a_block[0], a_block[1], b_block[0], b_block[1], desc(bias, op, "bias"),
        desc(out, op, "d"), stream_for(a),
    )
    return out


def _cublaslt_may_take(a_block: list[int], b_block: list[int]) -> bool:
    """Whether cuBLASLt's grouped matmul may take the problem: tensorwise scales, a build with CUDA (the
    rest, cuBLAS's version, the GPU and the shapes, is for it to decide at run time)."""
    return tuple(a_block) == tuple(b_block) == (WHOLE, WHOLE) and torch_cuda.build_info() is not None


@_fp8_grouped_gemm_op.register_kernel("cuda")
def _(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, a_block, b_block):
    check_grouped_gemm_args(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    if _cublaslt_may_take(a_block, b_block):
        out = _cublaslt_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
        if out is not None:
            return out
    return triton_route.kernels().fp8_grouped_gemm_resolved(
        a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, tuple(a_block), tuple(b_block)
    )


def _cublaslt_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias) -> Optional[torch.Tensor]:
    """The tensorwise grouped GEMM through cuBLASLt's grouped matmul (csrc/cuda/gemm_grouped_cuda.h: cuBLAS
    13.10+, sm_89+, N and K multiples of 16), or None where it declines (the Triton kernel runs). The bias is
    added per row from its group, found on the device."""
    op = "fp8_grouped_gemm"
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    workspace = cublas_workspace(a.device)
    ran = _C.fp8_grouped_gemm_cublaslt(
        desc(a, op, "a"), desc(a_scale_inv.reshape(1), op, "a_scale_inv"), desc(b, op, "b"),
        desc(b_scale_inv.reshape(-1), op, "b_scale_inv"), desc(offs, op, "offs"), desc(out, op, "d"),
        desc(workspace, op, "workspace"), stream_for(a),
    )
    if not ran:
        return None
    if bias is not None:
        groups = offs.shape[0]
        group = torch.searchsorted(offs, torch.arange(a.shape[0], device=a.device, dtype=offs.dtype), right=True)
        in_a_group = (group < groups).unsqueeze(1)
        out += torch.where(in_a_group, bias[group.clamp(max=groups - 1)], torch.zeros((), dtype=out_dtype,
                                                                                         device=a.device))
    return out


@_fp8_grouped_gemm_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, a_block, b_block):
    check_grouped_gemm_args(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    scalings: Optional[tuple[str, str]] = None,
) -> torch.Tensor:
    """One FP8 GEMM per group: out[rows of g] = a[rows of g] @ b[g]ᵀ, scaled [+ bias[g]].

    Numerics: reference.grouped.fp8_grouped_gemm (per-K-block fp32 promotion, as ops.fp8_gemm).

    Args:
        a: contiguous FP8 (total_tokens, K): the tokens of every group, quantized once.
        a_scale_inv: a's scales: 1 element (TensorWise), (total, 1) (RowWise), (total, ceil(K/128))
            (BlockWise1x128) or (total, ceil(K/32)) float8_e8m0fnu (MX).
        b: contiguous FP8 (G, N, K): one weight per group (expert).
        b_scale_inv: (G,), (G, N, 1), (G, ceil(N/128), ceil(K/128)) or (G, N, ceil(K/32)) E8M0,
            paired with a_scale_inv as in formats.grouped_scaling.GROUPED_GEMM_SCALINGS.
        offs: contiguous int32 (G,) cumulative row ends (torch._grouped_mm's): group g is rows
            offs[g-1]:offs[g]; empty groups are allowed; rows past offs[-1] come out as 0.
        out_dtype: torch.float32, torch.bfloat16 or torch.float16.
        bias: (G, N) of out_dtype, or None.
        scalings: the (a, b) ScalingTypes (a key of GROUPED_GEMM_SCALINGS) where the caller knows them
            (a Linear's quantizers do); None reads them from the scales' shapes, which symbolic sizes
            (torch.compile with dynamic weight shapes) can leave undecided.

    Returns:
        (total_tokens, N) of out_dtype.

    Raises:
        TypeError: a non-tensor argument, one on another device (meta included) or of a wrong dtype.
        ValueError: a wrong shape, an unsupported scaling, a bad scale value (CPU) or bad offs
            values (CPU: the kernel checks them where it reads them).
    """
    check_grouped_gemm_args(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    if scalings is None:
        resolved = resolve_grouped_scalings(a, a_scale_inv, b, b_scale_inv)
        a_block, b_block = resolved.a_block, resolved.b_block
    elif tuple(scalings) in GROUPED_GEMM_SCALINGS:
        a_block, b_block = GROUPED_GEMM_SCALINGS[tuple(scalings)]
    else:
        raise ValueError(f"fp8_grouped_gemm: argument 'scalings' must be one of {list(GROUPED_GEMM_SCALINGS)}, "
                         f"got {scalings!r}")
    if triton_route.routes(a) and not _cublaslt_may_take(a_block, b_block):
        return triton_route.kernels().fp8_grouped_gemm_resolved(
            a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, tuple(a_block), tuple(b_block)
        )
    return _fp8_grouped_gemm_op(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias, list(a_block), list(b_block))


@library.custom_op("transformer_linear::fp8_grouped_gemm_wgrad", mutates_args=(), device_types="cpu")
def _fp8_grouped_gemm_wgrad_op(
    grad: torch.Tensor,
    grad_scale_inv: torch.Tensor,
    x: torch.Tensor,
    x_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    op = "fp8_grouped_gemm_wgrad"
    check_grouped_wgrad_args(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)
    check_scale_values(op, {"grad_scale_inv": grad_scale_inv, "x_scale_inv": x_scale_inv})
    out = torch.empty((offs.shape[0], grad.shape[1], x.shape[1]), dtype=out_dtype, device=x.device)
    _C.fp8_grouped_gemm_wgrad(
        desc(grad, op, "grad"), desc(grad_scale_inv.reshape(1), op, "grad_scale_inv"), desc(x, op, "x"),
        desc(x_scale_inv.reshape(1), op, "x_scale_inv"), desc(offs, op, "offs"), desc(out, op, "d"),
        stream_for(x),
    )
    return out


@_fp8_grouped_gemm_wgrad_op.register_kernel("cuda")
def _(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype):
    check_grouped_wgrad_args(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)
    return triton_route.kernels().fp8_grouped_gemm_wgrad(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)


@_fp8_grouped_gemm_wgrad_op.register_fake
def _(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype):
    check_grouped_wgrad_args(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)
    return x.new_empty((offs.shape[0], grad.shape[1], x.shape[1]), dtype=out_dtype)


def fp8_grouped_gemm_wgrad(
    grad: torch.Tensor,
    grad_scale_inv: torch.Tensor,
    x: torch.Tensor,
    x_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The weight gradient of a grouped GEMM: out[g] = grad[rows of g]ᵀ @ x[rows of g], scaled.

    A "k-grouped" GEMM: the groups split the contraction (token) dimension; an empty group's
    gradient is 0. Tensorwise scales only (block scales are a ValueError). Numerics:
    reference.grouped.fp8_grouped_gemm_wgrad.

    Args:
        grad: contiguous FP8 (total_tokens, N), the output gradient.
        grad_scale_inv: one float32 element.
        x: contiguous FP8 (total_tokens, K), the input.
        x_scale_inv: one float32 element.
        offs: contiguous int32 (G,) cumulative row ends, as for :func:`fp8_grouped_gemm`.
        out_dtype: torch.float32, torch.bfloat16 or torch.float16.

    Returns:
        (G, N, K) of out_dtype.
    """
    check_grouped_wgrad_args(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)
    if triton_route.routes(x):
        return triton_route.kernels().fp8_grouped_gemm_wgrad(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)
    return _fp8_grouped_gemm_wgrad_op(grad, grad_scale_inv, x, x_scale_inv, offs, out_dtype)


@library.custom_op("transformer_linear::fp8_grouped_gemm_wgrad_blockwise", mutates_args=(), device_types="cpu")
def _fp8_grouped_gemm_wgrad_blockwise_op(
    grad_t: torch.Tensor,
    grad_t_scale_inv: torch.Tensor,
    x_t: torch.Tensor,
    x_t_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    token_block: int,
) -> torch.Tensor:
    op = "fp8_grouped_gemm_wgrad_blockwise"
    check_grouped_wgrad_blockwise_args(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block)
    check_scale_values(op, {"grad_t_scale_inv": grad_t_scale_inv, "x_t_scale_inv": x_t_scale_inv})
    out = torch.empty((offs.shape[0], grad_t.shape[0], x_t.shape[0]), dtype=out_dtype, device=x_t.device)
    _C.fp8_grouped_gemm_wgrad_blockwise(
        desc(grad_t, op, "grad_t"), desc(_kernel_scale(grad_t_scale_inv), op, "grad_t_scale_inv"),
        desc(x_t, op, "x_t"), desc(_kernel_scale(x_t_scale_inv), op, "x_t_scale_inv"), desc(offs, op, "offs"),
        token_block, desc(out, op, "d"), stream_for(x_t),
    )
    return out


@_fp8_grouped_gemm_wgrad_blockwise_op.register_kernel("cuda")
def _(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block):
    check_grouped_wgrad_blockwise_args(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block)
    return triton_route.kernels().fp8_grouped_gemm_wgrad_blockwise(
        grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block
    )


@_fp8_grouped_gemm_wgrad_blockwise_op.register_fake
def _(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block):
    check_grouped_wgrad_blockwise_args(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block)
    return x_t.new_empty((offs.shape[0], grad_t.shape[0], x_t.shape[0]), dtype=out_dtype)


def fp8_grouped_gemm_wgrad_blockwise(
    grad_t: torch.Tensor,
    grad_t_scale_inv: torch.Tensor,
    x_t: torch.Tensor,
    x_t_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    token_block: int,
) -> torch.Tensor:
    """The block-scaled weight gradient of a grouped GEMM: out[g] = grad_t[:, tokens of g] @ x_t[:, tokens of g]ᵀ.

    The operands are grouped columnwise copies (formats.grouped_scaling; ops.grouped_quantize makes them):
    blocks of ``token_block`` tokens along each row that restart at each group's first token, so no
    block straddles two groups. Each block pair's fp32 partial sum is promoted with its two scales.
    Numerics: reference.grouped.fp8_grouped_gemm_wgrad_blockwise.

    Args:
        grad_t: contiguous FP8 (N, total_tokens): grad_output's grouped columnwise copy.
        grad_t_scale_inv: (N, total // token_block + G) float32 (128), float8_e8m0fnu (32), or (N, G)
            float32 (WHOLE: one scale per group).
        x_t: contiguous FP8 (K, total_tokens): the input's grouped columnwise copy.
        x_t_scale_inv: (K, ...) as grad_t_scale_inv.
        offs: contiguous int32 (G,) cumulative row ends.
        out_dtype: torch.float32, torch.bfloat16 or torch.float16.
        token_block: 128, 32 or 0 (WHOLE).

    Returns:
        (G, N, K) of out_dtype; an empty group's gradient is 0.

    Raises:
        TypeError: a non-tensor, another device, a wrong dtype.
        ValueError: a wrong shape, token block, scale value (CPU) or bad offs values (CPU).
    """
    check_grouped_wgrad_blockwise_args(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block)
    if triton_route.routes(x_t):
        return triton_route.kernels().fp8_grouped_gemm_wgrad_blockwise(
            grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype, token_block
        )
    return _fp8_grouped_gemm_wgrad_blockwise_op(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype,
                                                token_block)
