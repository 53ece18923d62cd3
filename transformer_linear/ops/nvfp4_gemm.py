"""The NVFP4 block-scaled GEMM ops: :func:`nvfp4_gemm` (E4M3 block scales and float32 global scales as
separate tensors) and the Linear's form :func:`nvfp4_gemm_packed` (both packed in one 1-D tensor,
ops.nvfp4_packed_scales).

The CPU kernel is the extension's (csrc/cpu/gemm_nvfp4_cpu.cpp); the CUDA kernels are registered by
``ops.nvfp4_cuda`` (Triton, and cuBLASLt's NVFP4 matmul where the GPU and build have it). The family's
conventions: ops/nvfp4.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from transformer_linear import _C
from transformer_linear.formats.checks import check_hp_dtype, check_same_device, check_tensor
from transformer_linear.formats.nvfp4 import BLOCK, FP4_DTYPE
from transformer_linear.ops import library
from transformer_linear.ops.descriptors import desc, stream_for
from transformer_linear.ops.nvfp4_checks import check_device_type, check_scalar
from transformer_linear.ops.nvfp4_packed_scales import packed_scale_numel, unpack_scales

__all__ = ["nvfp4_gemm", "nvfp4_gemm_packed"]


def _check_gemm_op(op, a, a_scale, a_global_scale, b, b_scale, b_global_scale, bias, data_dtype=torch.uint8):
    check_same_device(
        op,
        {
            "a": a, "a_scale": a_scale, "a_global_scale": a_global_scale,
            "b": b, "b_scale": b_scale, "b_global_scale": b_global_scale, "bias": bias,
        },
        optional=("bias",),
    )
    for name, t, dtype in (("a", a, data_dtype), ("b", b, data_dtype), ("a_scale", a_scale, torch.float8_e4m3fn),
                           ("b_scale", b_scale, torch.float8_e4m3fn)):
        if t.dtype != dtype:
            raise TypeError(f"{op}: argument '{name}' must be {dtype}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{op}: argument '{name}' must be 2-D, got shape {list(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: the K dimensions of 'a' {list(a.shape)} and 'b' {list(b.shape)} differ")
    if (2 * a.shape[1]) % BLOCK:
        raise ValueError(f"{op}: K ({2 * a.shape[1]} FP4 values per row of 'a') must be a multiple of {BLOCK}")
    for name, data, scale in (("a_scale", a, a_scale), ("b_scale", b, b_scale)):
        want = [data.shape[0], 2 * data.shape[1] // BLOCK]
        if list(scale.shape) != want:
            raise ValueError(f"{op}: argument '{name}' must have shape {want}, got {list(scale.shape)}")


@library.custom_op("transformer_linear::nvfp4_gemm", mutates_args=(), device_types="cpu")
def _nvfp4_gemm_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_global_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_global_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    op = "nvfp4_gemm"
    _check_gemm_op(op, a, a_scale, a_global_scale, b, b_scale, b_global_scale, bias)
    check_hp_dtype(op, "out_dtype", out_dtype)
    out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    # Contiguous copies (where needed) held here: the kernel reads them after desc() returns.
    a, a_scale, b, b_scale = (t.contiguous() for t in (a, a_scale, b, b_scale))
    _C.nvfp4_gemm(
        desc(a, op, "a"),
        desc(a_scale, op, "a_scale"),
        desc(a_global_scale, op, "a_global_scale"),
        desc(b, op, "b"),
        desc(b_scale, op, "b_scale"),
        desc(b_global_scale, op, "b_global_scale"),
        desc(bias, op, "bias"),
        desc(out, op, "d"),
        stream_for(a),
    )
    return out


@_nvfp4_gemm_op.register_fake
def _(a, a_scale, a_global_scale, b, b_scale, b_global_scale, out_dtype, bias):
    _check_gemm_op("nvfp4_gemm", a, a_scale, a_global_scale, b, b_scale, b_global_scale, bias)
    check_hp_dtype("nvfp4_gemm", "out_dtype", out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def nvfp4_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_global_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_global_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(a @ b.T) * (a_global_scale * b_global_scale) [+ bias]`` of NVFP4 operands, float32 accumulation.

    Args:
        a: (M, K/2) float4_e2m1fn_x2 (e.g. ``quantize_nvfp4(x, ...).data``); K % 16 == 0.
        a_scale: (M, K/16) float8_e4m3fn block decode scales.
        a_global_scale: () or (1,) float32 global decode scale, finite.
        b, b_scale, b_global_scale: the same for b (N, K/2).
        out_dtype: float32, bfloat16 or float16.
        bias: (N,) of ``out_dtype``, or None.

    Returns:
        (M, N) tensor of ``out_dtype``.

    Raises:
        TypeError: a wrong dtype, or tensors on other devices than cpu or cuda (or mixed devices).
        ValueError: shapes that do not match, or a non-finite global scale.
    """
    op = "nvfp4_gemm"
    check_tensor(op, "a", a)
    check_device_type(op, "a", a)
    _check_gemm_op(op, a, a_scale, a_global_scale, b, b_scale, b_global_scale, bias, data_dtype=FP4_DTYPE)
    check_hp_dtype(op, "out_dtype", out_dtype)
    check_scalar(op, "a_global_scale", a_global_scale, "scale")
    check_scalar(op, "b_global_scale", b_global_scale, "scale")
    if bias is not None:
        if bias.dtype != out_dtype:
            raise TypeError(f"{op}: argument 'bias' must have the output dtype {out_dtype}, got {bias.dtype}")
        if list(bias.shape) != [b.shape[0]]:
            raise ValueError(f"{op}: argument 'bias' must have shape {[b.shape[0]]}, got {list(bias.shape)}")
    return torch.ops.transformer_linear.nvfp4_gemm(
        a.view(torch.uint8), a_scale, a_global_scale, b.view(torch.uint8), b_scale, b_global_scale, out_dtype, bias
    )


# ---------------------------------------------------------------------------
# The Linear's form: global scales packed with the block scales (ops.nvfp4_packed_scales)
# ---------------------------------------------------------------------------


def _check_packed_gemm(op, a, a_scale_inv, b, b_scale_inv, out_dtype, bias):
    check_same_device(op, {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv, "bias": bias},
                      optional=("bias",))
    for name, data, scale in (("a", a, a_scale_inv), ("b", b, b_scale_inv)):
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise TypeError(f"{op}: argument '{name}' must be 2-D uint8 (packed E2M1 pairs), got "
                            f"{data.dtype} {list(data.shape)}")
        if scale.dtype != torch.float8_e4m3fn or scale.dim() != 1:
            raise TypeError(f"{op}: argument '{name}_scale_inv' must be 1-D float8_e4m3fn (packed scales), got "
                            f"{scale.dtype} {list(scale.shape)}")
        if (2 * data.shape[1]) % BLOCK:
            raise ValueError(f"{op}: K ({2 * data.shape[1]} FP4 values per row of '{name}') must be a multiple "
                             f"of {BLOCK}")
        want, got = packed_scale_numel(data.shape[0], 2 * data.shape[1]), scale.shape[0]
        if isinstance(want, int) and isinstance(got, int):
            if want != got:
                raise ValueError(f"{op}: argument '{name}_scale_inv' must have {want} elements (packed scales), "
                                 f"got {got}")
        else:  # symbolic sizes (tracing): checked when the graph runs
            torch._check(got == want, lambda name=name: f"{op}: argument '{name}_scale_inv' has the wrong length")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: the K dimensions of 'a' {list(a.shape)} and 'b' {list(b.shape)} differ")
    check_hp_dtype(op, "out_dtype", out_dtype)


@library.custom_op("transformer_linear::nvfp4_gemm_packed", mutates_args=(), device_types=("cpu", "cuda"))
def _gemm_packed_op(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    _check_packed_gemm("nvfp4_gemm_packed", a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    a_scale, a_global = unpack_scales(a_scale_inv, a.shape[0], 2 * a.shape[1])
    b_scale, b_global = unpack_scales(b_scale_inv, b.shape[0], 2 * b.shape[1])
    return torch.ops.transformer_linear.nvfp4_gemm(a, a_scale, a_global, b, b_scale, b_global, out_dtype, bias)


@_gemm_packed_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias):
    _check_packed_gemm("nvfp4_gemm_packed", a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def nvfp4_gemm_packed(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`nvfp4_gemm` of operands as :func:`quantize_nvfp4_packed` returns them (scales packed).

    Args:
        a: (M, K/2) uint8; a_scale_inv: its packed scales (:func:`pack_scales`).
        b: (N, K/2) uint8; b_scale_inv: its packed scales.
        out_dtype: float32, bfloat16 or float16.
        bias: (N,) of ``out_dtype``, or None.

    Raises:
        TypeError: a wrong dtype or rank, or a tensor on another device than cpu or cuda.
        ValueError: mismatched shapes (K, or a packed scale's length).
    """
    op = "nvfp4_gemm_packed"
    check_tensor(op, "a", a)
    check_device_type(op, "a", a)
    if bias is not None and bias.dtype != out_dtype:
        raise TypeError(f"{op}: argument 'bias' must have the output dtype {out_dtype}, got {bias.dtype}")
    return _gemm_packed_op(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
