"""Grouped NVFP4 GEMMs (mixture-of-experts under NVFP4BlockScaling), as a loop over the experts of the
NVFP4 GEMM op (ops.nvfp4.nvfp4_gemm_packed), with no host read of ``offs``.

A loop of per-group slices would need each group's size on the host (a device sync, and a recompile per
routing under torch.compile). Instead every expert's GEMM runs on all the tokens and each output row is
taken from its own expert's result (``torch.where`` on the row's group, found on the device): G times the
FLOPs of one grouped GEMM, which a grouped NVFP4 kernel would save. The weight gradient contracts over
tokens: each expert's operands are the tokens masked to its group (zeros elsewhere), quantized into their
columnwise NVFP4 copies (blocks of 16 tokens on the tensor's grid, so groups need not be aligned to 16; a
block shared with another group holds zeros for that group's rows), which :func:`nvfp4_grouped_gemm_wgrad`
multiplies expert by expert.

Operands are in the packed form of ops.nvfp4 (uint8 data, two E2M1 codes a byte; 1-D packed scales with
the float32 global scale), one stacked tensor per operand.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from transformer_linear.ops import nvfp4

__all__ = ["group_of_rows", "nvfp4_grouped_gemm", "nvfp4_grouped_gemm_wgrad"]


def group_of_rows(rows: int, offs: Tensor) -> Tensor:
    """(rows,) the group of each row (``offs.shape[0]`` for rows past offs[-1]), on the device."""
    index = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, index, right=True)


def _check(op: str, name: str, t: object, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != dim:
        raise TypeError(f"{op}: argument '{name}' must be a {dim}-D {dtype} tensor, got {t.dim()}-D {t.dtype}")


def nvfp4_grouped_gemm(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``out[rows of g] = a[rows of g] b[g]ᵀ (+ bias[g])`` in NVFP4; rows past offs[-1] are 0.

    Args:
        a: (M, K/2) uint8, the tokens of every group, quantized once (rowwise, packed).
        a_scale_inv: its packed scales (1-D float8_e4m3fn).
        b: (G, N, K/2) uint8, each group's weight (rowwise, packed).
        b_scale_inv: (G, S) each group's packed scales.
        offs: (G,) int32 cumulative row ends; never read on the host.
        out_dtype: float32, bfloat16 or float16.
        bias: (G, N) of ``out_dtype``, or None.

    Raises:
        TypeError: a wrong dtype or rank.
        ValueError: ``b_scale_inv`` or ``offs`` not one per group (the NVFP4 GEMM checks the rest).
    """
    op = "nvfp4_grouped_gemm"
    _check(op, "b", b, torch.uint8, 3)
    _check(op, "b_scale_inv", b_scale_inv, torch.float8_e4m3fn, 2)
    _check(op, "offs", offs, torch.int32, 1)
    groups = b.shape[0]
    if b_scale_inv.shape[0] != groups or offs.shape[0] != groups:
        raise ValueError(f"{op}: 'b_scale_inv' and 'offs' must have one entry per group ({groups}), got "
                         f"{b_scale_inv.shape[0]} and {offs.shape[0]}")
    group = group_of_rows(a.shape[0], offs).unsqueeze(1)
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    for g in range(groups):
        expert_out = nvfp4.nvfp4_gemm_packed(a, a_scale_inv, b[g], b_scale_inv[g], out_dtype,
                                             None if bias is None else bias[g])
        out = torch.where(group == g, expert_out, out)
    return out


def nvfp4_grouped_gemm_wgrad(
    grad_t: Tensor, grad_t_scale_inv: Tensor, x_t: Tensor, x_t_scale_inv: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """(G, N, K): ``grad_t[g] x_t[g]ᵀ`` per group, each contracting over the M tokens.

    Args:
        grad_t: (G, N, M/2) uint8: each group's columnwise copy of grad_output, its other groups' rows zero.
        grad_t_scale_inv: (G, S) their packed scales.
        x_t: (G, K, M/2) uint8: the same of the input.
        x_t_scale_inv: (G, S') their packed scales.
        out_dtype: float32, bfloat16 or float16.

    Raises:
        TypeError: a wrong dtype or rank.
        ValueError: operands of different group counts (the NVFP4 GEMM checks the rest).
    """
    op = "nvfp4_grouped_gemm_wgrad"
    for name, t in (("grad_t", grad_t), ("x_t", x_t)):
        _check(op, name, t, torch.uint8, 3)
    for name, t in (("grad_t_scale_inv", grad_t_scale_inv), ("x_t_scale_inv", x_t_scale_inv)):
        _check(op, name, t, torch.float8_e4m3fn, 2)
    groups = grad_t.shape[0]
    if not groups == x_t.shape[0] == grad_t_scale_inv.shape[0] == x_t_scale_inv.shape[0]:
        raise ValueError(f"{op}: the operands have different group counts: {grad_t.shape[0]}, {x_t.shape[0]}, "
                         f"{grad_t_scale_inv.shape[0]}, {x_t_scale_inv.shape[0]}")
    if groups == 0:
        return grad_t.new_zeros((0, grad_t.shape[1], x_t.shape[1]), dtype=out_dtype)
    return torch.stack([
        nvfp4.nvfp4_gemm_packed(grad_t[g], grad_t_scale_inv[g], x_t[g], x_t_scale_inv[g], out_dtype)
        for g in range(groups)
    ])
