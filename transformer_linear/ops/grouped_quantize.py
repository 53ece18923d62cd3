"""The grouped columnwise copy the block-scaled grouped weight gradient reads, made on the device.

The layout is described in ``transformer_linear.formats.grouped_scaling``: a (total, C) tensor
transposed into (C, total) FP8, quantized in blocks of ``token_block`` tokens that restart at every
group's first token, with the scales of group g's j-th block in column ``start_g // B + g + j`` of a
(C, total // B + G) grid. Made of PyTorch ops on whatever device the tensor is on: each token's
group comes from ``searchsorted`` over ``offs`` and each block's amax from a ``scatter_reduce``, so
``offs`` is never read on the host (no device sync, no data-dependent shape: one graph under
``torch.compile`` for every routing). Per block it computes what the block quantizers compute
(``reference.quantize_blockwise_ref``, checked bitwise in tests/test_grouped_gemm.py).

CPU tensors take the C++ kernel instead (csrc/cpu/quantize_grouped_cpu.cpp: ``offs`` read on the host,
which costs no sync there), bitwise the same numbers: called directly in eager, and traced as the op
``transformer_linear::quantize_grouped_columnwise``, opaque to the graph, so a compiled graph never
depends on the routing (and Inductor's CPU code, which has no E8M0 type, never computes E8M0 scales).
CUDA and meta tensors (and a CPU tensor subclass in eager) keep the PyTorch ops.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from transformer_linear import _C
from transformer_linear.formats.checks import check_fp8_dtype, check_hp_dtype, check_same_device
from transformer_linear.formats.dtypes import E8M0_DTYPE, fp8_max
from transformer_linear.formats.grouped_scaling import TOKEN_BLOCKS, WHOLE, check_offs, token_scale_cols
from transformer_linear.ops import library
from transformer_linear.ops.descriptors import desc, stream_for

__all__ = ["GroupedColumnwise", "quantize_grouped_columnwise"]

_FLOAT_MAX = torch.finfo(torch.float32).max
_FLOAT_MIN_NORMAL = torch.finfo(torch.float32).tiny
_E8M0_BIAS = 127


class GroupedColumnwise(NamedTuple):
    """A grouped columnwise copy (formats.grouped_scaling's layout)."""

    data_t: torch.Tensor
    """(C, total) FP8."""
    scale_inv_t: torch.Tensor
    """(C, token_scale_cols) scales."""


def _float32_scale(amax: torch.Tensor, limit: float, power_2_scale: bool) -> torch.Tensor:
    """limit / amax, FLT_MAX where that overflows, 1 where amax is 0 or not finite; rounded down to a
    power of two with ``power_2_scale`` (the block quantizers' rule)."""
    scale = torch.div(torch.full_like(amax, limit), amax)
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, _FLOAT_MAX))
    scale = torch.clamp(scale, min=_FLOAT_MIN_NORMAL)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))
    if power_2_scale:
        scale = (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)
    return scale


def _e8m0_exponent(amax: torch.Tensor, limit: float, rounding: str) -> torch.Tensor:
    """The unbiased exponent e of each block's E8M0 scale_inv 2^e (MX: "ceil" as TE, "floor" as OCP)."""
    valid = (amax > 0) & torch.isfinite(amax)
    if rounding == "ceil":
        bits = torch.div(amax, torch.full_like(amax, limit)).view(torch.int32)
        biased, mantissa = bits >> 23, bits & 0x7FFFFF
        up = torch.where(biased > 0, mantissa != 0, mantissa > 0x400000)
        e = biased - _E8M0_BIAS + up.int()
    else:
        e = torch.frexp(amax).exponent - 1 - math.floor(math.log2(limit))
    e = torch.clamp(e, -_E8M0_BIAS, _E8M0_BIAS)
    return torch.where(valid, e, torch.zeros_like(e)).int()


def _on_host(x: torch.Tensor) -> bool:
    """Whether ``x`` is a real (not fake, not traced) CPU tensor: one the C++ kernel can read."""
    return x.device.type == "cpu" and type(x) is torch.Tensor and not torch.compiler.is_compiling()


def _check_args(x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, token_block: int, e8m0_rounding: str) -> None:
    op = "quantize_grouped_columnwise"
    if isinstance(token_block, bool) or token_block not in TOKEN_BLOCKS:
        raise ValueError(f"{op}: argument 'token_block' must be 128, 32 or 0 (the whole group), got {token_block!r}")
    if e8m0_rounding not in ("ceil", "floor"):
        raise ValueError(f"{op}: argument 'e8m0_rounding' must be 'ceil' or 'floor', got {e8m0_rounding!r}")
    check_same_device(op, {"x": x, "offs": offs})
    check_hp_dtype(op, "x", x.dtype)
    check_fp8_dtype(op, "dtype", dtype)
    if x.dim() != 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D (total_tokens, C), got shape {list(x.shape)}")
    check_offs(op, offs, offs.shape[0])


def _traced_on_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CPU tensor that torch.compile / torch.export is tracing (a fake tensor)."""
    return x.device.type == "cpu" and torch.compiler.is_compiling()


@library.custom_op("transformer_linear::quantize_grouped_columnwise", mutates_args=(), device_types="cpu")
def _quantize_cpu_op(
    x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, token_block: int, power_2_scale: bool,
    e8m0_rounding: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ kernel's copy, as an op a traced graph holds."""
    _check_args(x, offs, dtype, token_block, e8m0_rounding)
    width = token_scale_cols(x.shape[0], offs.shape[0], token_block)
    return tuple(_quantize_cpu(x, offs, dtype, token_block, power_2_scale, e8m0_rounding, width))


@_quantize_cpu_op.register_fake
def _(x, offs, dtype, token_block, power_2_scale, e8m0_rounding):
    _check_args(x, offs, dtype, token_block, e8m0_rounding)  # a meta argument routes a real call here
    width = token_scale_cols(x.shape[0], offs.shape[0], token_block)
    scale_dtype = E8M0_DTYPE if TOKEN_BLOCKS[token_block] == E8M0_DTYPE else torch.float32
    return x.new_empty((x.shape[1], x.shape[0]), dtype=dtype), x.new_empty((x.shape[1], width), dtype=scale_dtype)


def _quantize_cpu(
    x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, token_block: int, power_2_scale: bool,
    e8m0_rounding: str, width: int,
) -> GroupedColumnwise:
    """The C++ kernel's copy (csrc/cpu/quantize_grouped_cpu.cpp); it checks the values of ``offs``."""
    op = "quantize_grouped_columnwise"
    total, cols = x.shape
    data_t = torch.empty((cols, total), dtype=dtype)
    e8m0 = TOKEN_BLOCKS[token_block] == E8M0_DTYPE
    scale_inv_t = torch.empty((cols, width), dtype=torch.uint8 if e8m0 else torch.float32)
    # Held here: a descriptor does not keep its tensor (a contiguous copy) alive.
    x_c, offs_c = x.detach().contiguous(), offs.contiguous()
    _C.quantize_grouped_columnwise(
        desc(x_c, op, "x"), desc(offs_c, op, "offs"), token_block, power_2_scale,
        e8m0_rounding == "floor", desc(data_t, op, "data_t"), desc(scale_inv_t, op, "scale_inv_t"), stream_for(x),
    )
    return GroupedColumnwise(data_t, scale_inv_t.view(E8M0_DTYPE) if e8m0 else scale_inv_t)


def quantize_grouped_columnwise(
    x: torch.Tensor,
    offs: torch.Tensor,
    dtype: torch.dtype,
    token_block: int,
    power_2_scale: bool = False,
    e8m0_rounding: str = "ceil",
) -> GroupedColumnwise:
    """Quantize ``x`` into its grouped columnwise copy (formats.grouped_scaling's layout).

    Args:
        x: (total, C) float32, bfloat16 or float16: the tokens of every group, group by group.
        offs: int32 (G,) cumulative row ends, on x's device (read on the host only for CPU tensors).
        dtype: the FP8 dtype.
        token_block: 128 (float32 scales), 32 (E8M0 scales) or WHOLE (one float32 scale per group).
        power_2_scale: round float32 scales down to powers of two.
        e8m0_rounding: "ceil" or "floor" (E8M0 scales).

    Returns:
        data_t (C, total) FP8, 0 for tokens past offs[-1]; scale_inv_t (C, token_scale_cols) of
        TOKEN_BLOCKS[token_block], 1 in the columns no block uses.

    Raises:
        TypeError: a wrong dtype or device.
        ValueError: a wrong rank or an unsupported token_block or rounding; on the CPU, ``offs`` not
            nondecreasing in [0, total].
    """
    _check_args(x, offs, dtype, token_block, e8m0_rounding)
    total, groups = x.shape[0], offs.shape[0]
    width = token_scale_cols(total, groups, token_block)
    if _on_host(x) and _on_host(offs):
        return _quantize_cpu(x, offs, dtype, token_block, power_2_scale, e8m0_rounding, width)
    if _traced_on_cpu(x) and _traced_on_cpu(offs):
        return GroupedColumnwise(*_quantize_cpu_op(x, offs, dtype, token_block, power_2_scale, e8m0_rounding))
    tokens = torch.arange(total, device=x.device, dtype=torch.int32)
    group = torch.searchsorted(offs, tokens, right=True)  # G past offs[-1]
    if token_block == WHOLE:
        column = group
    else:
        start = torch.cat([offs.new_zeros(1), offs])[group].long()
        column = torch.div(start, token_block, rounding_mode="floor") + group + torch.div(
            tokens.long() - start, token_block, rounding_mode="floor"
        )
    # Tokens of no group (and, with bad offs, out-of-range columns) go to a spare column, dropped.
    in_group = group < groups
    column = torch.where(in_group, column.clamp(0, width), torch.full_like(column, width))
    xf = x.float()
    index = column[:, None].expand(x.shape)
    amax = xf.new_zeros((width + 1, x.shape[1])).scatter_reduce(0, index, xf.abs(), "amax", include_self=True)
    limit = fp8_max(dtype)
    if TOKEN_BLOCKS[token_block] == E8M0_DTYPE:
        e = _e8m0_exponent(amax, limit, e8m0_rounding)
        scale = torch.ldexp(torch.ones_like(amax), -e)
        scale_inv = (e[:width] + _E8M0_BIAS).to(torch.uint8).view(E8M0_DTYPE)
    else:
        scale = _float32_scale(amax, limit, power_2_scale)
        scale_inv = torch.reciprocal(scale[:width])
    q = torch.clamp(xf * scale[column], -limit, limit)
    q = torch.where(in_group[:, None], q, torch.zeros_like(q)).to(dtype)
    return GroupedColumnwise(q.t().contiguous(), scale_inv.t().contiguous())
