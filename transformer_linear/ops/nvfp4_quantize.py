"""The NVFP4 quantize ops: :func:`quantize_nvfp4` (data, E4M3 block scales, float32 global scale), the
global amax it takes (:func:`nvfp4_amax`), and the Linear's form: :func:`quantize_nvfp4_packed` (global
and block scales packed, ops.nvfp4_packed_scales) with its stochastic-rounding seed (:func:`sr_seed`).

The CPU kernels are the extension's (csrc/cpu/quantize_nvfp4_cpu.cpp; the global amaxes, plain and of the
Hadamard-transformed columnwise copy, in one pass: quantize_nvfp4_cpu_amax.h); the CUDA kernel is registered
by ``ops.nvfp4_cuda``. The family's conventions: ops/nvfp4.py.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_linear import _C
from transformer_linear.formats.checks import check_host_tensor, check_hp_dtype, check_same_device, check_tensor
from transformer_linear.formats.nvfp4 import (
    BLOCK,
    FP4_DTYPE,
    check_quantize_shape,
    hadamard_amax_of_transpose,
    pad_rows,
    padded_rows,
)
from transformer_linear.ops import library, triton_route
from transformer_linear.ops.descriptors import desc, stream_for
from transformer_linear.ops.nvfp4_checks import INT64_MAX, INT64_MIN, check_device_type, check_int, check_scalar
from transformer_linear.ops.nvfp4_packed_scales import (
    GLOBAL_SCALE_ELEMENTS,
    pack_scales,
    packed_scale_numel,
    write_packed_global_scale,
)

__all__ = ["NVFP4Tensors", "nvfp4_amax", "quantize_nvfp4", "quantize_nvfp4_packed", "sr_seed"]


class NVFP4Tensors(NamedTuple):
    """The NVFP4 copies :func:`quantize_nvfp4` made; a copy not asked for is None.

    data: (M, K/2) float4_e2m1fn_x2; scale: (M, K/16) float8_e4m3fn block decode scales;
    global_scale: () float32 global decode scale. The ``_t`` fields: the columnwise copy,
    quantized from x.T: (K, M/2), (K, M/16), ().
    """

    data: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    global_scale: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_t: Optional[torch.Tensor]
    global_scale_t: Optional[torch.Tensor]


def _copy_shapes(m: int, k: int, rowwise: bool, columnwise: bool) -> list[tuple[int, int]]:
    """Shapes of (data, scale, data_t, scale_t); an absent copy gets (0, 0)."""
    none = (0, 0)
    row = [(m, k // 2), (m, k // BLOCK)] if rowwise else [none, none]
    col = [(k, m // 2), (k, m // BLOCK)] if columnwise else [none, none]
    return row + col


def _quantize_outputs(x: torch.Tensor, rowwise: bool, columnwise: bool) -> list[torch.Tensor]:
    """The op's six outputs; a copy not asked for has empty data and scales and a zero global scale."""
    m, k = x.shape
    data, scale, data_t, scale_t = _copy_shapes(m, k, rowwise, columnwise)
    return [
        x.new_empty(data, dtype=torch.uint8),
        x.new_empty(scale, dtype=torch.float8_e4m3fn),
        x.new_zeros((), dtype=torch.float32),
        x.new_empty(data_t, dtype=torch.uint8),
        x.new_empty(scale_t, dtype=torch.float8_e4m3fn),
        x.new_zeros((), dtype=torch.float32),
    ]


def _check_quantize_op(op, x, amax, amax_t, rowwise, columnwise, scaling_2d, rht):
    check_same_device(op, {"x": x, "amax": amax, "amax_t": amax_t}, optional=("amax_t",))
    check_hp_dtype(op, "x", x.dtype)
    check_quantize_shape(op, tuple(x.shape), rowwise, columnwise, scaling_2d, rht)


@library.custom_op("transformer_linear::quantize_nvfp4", mutates_args=(), device_types="cpu")
def _quantize_nvfp4_op(
    x: torch.Tensor,
    amax: torch.Tensor,
    amax_t: Optional[torch.Tensor],
    rowwise: bool,
    columnwise: bool,
    scaling_2d: bool,
    rht: bool,
    stochastic_rounding: bool,
    seed: int,
    offset: int,
) -> list[torch.Tensor]:
    op = "quantize_nvfp4"
    _check_quantize_op(op, x, amax, amax_t, rowwise, columnwise, scaling_2d, rht)
    x = x.contiguous()  # held here: the kernel reads it after desc() returns
    outs = _quantize_outputs(x, rowwise, columnwise)
    _run_quantize_kernel(op, x, amax, amax_t, outs, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed,
                         offset)
    return outs


def _run_quantize_kernel(op, x, amax, amax_t, copies, rowwise, columnwise, scaling_2d, rht, stochastic_rounding,
                         seed, offset) -> None:
    """``_C.quantize_nvfp4`` into ``copies``: (data, block scales, global scale) of the rowwise copy, then of
    the columnwise one; a copy not asked for is passed as absent."""
    names = ("output", "scale", "global_scale", "output_t", "scale_t", "global_scale_t")
    present = (rowwise,) * 3 + (columnwise,) * 3
    _C.quantize_nvfp4(
        desc(x, op, "x"),
        desc(amax, op, "amax"),
        desc(amax if amax_t is None else amax_t, op, "amax_t"),
        *(desc(t, op, name) if wanted else None for t, name, wanted in zip(copies, names, present)),
        scaling_2d,
        rht,
        stochastic_rounding,
        seed,
        offset,
        stream_for(x),
    )


@_quantize_nvfp4_op.register_fake
def _(x, amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, offset):
    _check_quantize_op("quantize_nvfp4", x, amax, amax_t, rowwise, columnwise, scaling_2d, rht)
    return _quantize_outputs(x, rowwise, columnwise)


def quantize_nvfp4(
    x: torch.Tensor,
    amax: torch.Tensor,
    amax_t: Optional[torch.Tensor] = None,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    scaling_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> NVFP4Tensors:
    """Quantize a 2-D tensor to NVFP4 (E2M1 data, E4M3 block scales, float32 global scale).

    Args:
        x: (M, K) float32, bfloat16 or float16 on the CPU or a GPU. The rowwise copy needs K % 16 == 0,
            the columnwise copy M % 16 == 0.
        amax: () or (1,) float32, finite, >= 0: the global amax of the rowwise copy (and of the
            16x16 columnwise copy); see :func:`nvfp4_amax`.
        amax_t: the global amax of the 1x16 columnwise copy (of its Hadamard transform with
            ``rht``); None: ``amax``.
        rowwise: make the rowwise copy (quantized along K).
        columnwise: make the columnwise copy (x.T quantized along M).
        scaling_2d: one scale per 16x16 tile (the columnwise copy is then the rowwise one transposed).
        rht: random Hadamard transform of the columnwise copy (1x16 only).
        stochastic_rounding: round stochastically with Philox4x32-10 bits from (seed, offset).
        seed: any int64.
        offset: in [0, 2^63).

    Returns:
        NVFP4Tensors, None in the fields of a copy not asked for.

    Raises:
        TypeError: a wrong dtype, or a tensor on another device than cpu or cuda (or mixed devices).
        ValueError: a shape the copies cannot take, a non-finite or negative amax, seed or offset
            out of range, no copy asked for, or rht with scaling_2d.
    """
    op = "quantize_nvfp4"
    check_tensor(op, "x", x)
    check_device_type(op, "x", x)
    check_tensor(op, "amax", amax, like=x, like_name="x")
    if amax_t is not None:
        check_tensor(op, "amax_t", amax_t, like=x, like_name="x")
    check_hp_dtype(op, "x", x.dtype)
    check_quantize_shape(op, tuple(x.shape), rowwise, columnwise, scaling_2d, rht)
    check_scalar(op, "amax", amax, "amax")
    if amax_t is not None:
        check_scalar(op, "amax_t", amax_t, "amax")
    check_int(op, "seed", seed, INT64_MIN, INT64_MAX)
    check_int(op, "offset", offset, 0, INT64_MAX)
    if triton_route.routes(x):
        outs = triton_route.kernels().quantize_nvfp4(
            x.contiguous(), amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, offset
        )
    else:
        outs = torch.ops.transformer_linear.quantize_nvfp4(
            x, amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, offset
        )
    data, scale, g, data_t, scale_t, g_t = outs
    row = [data.view(FP4_DTYPE), scale, g] if rowwise else [None] * 3
    col = [data_t.view(FP4_DTYPE), scale_t, g_t] if columnwise else [None] * 3
    return NVFP4Tensors(*row, *col)


def _amaxes_in_kernel(x: torch.Tensor) -> bool:
    """Whether x's amaxes come from the extension's CPU kernel: a real CPU tensor of a dtype it reads,
    outside tracing (fake and meta tensors, other devices and traced graphs take the torch ops)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not isinstance(x, torch._subclasses.FakeTensor)
        and not torch.compiler.is_compiling()
    )


def _amaxes(x: torch.Tensor, plain: bool, rht: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(max |x|, max |H(x.T)|), each () float32 or None where not asked for; x 2-D, not empty, detached.

    On the CPU one call of the extension's kernel (csrc/cpu/quantize_nvfp4_cpu_amax.h: one pass over x for
    both, bitwise the torch ops' result); elsewhere the extension's amax op and the torch form of the
    transform's amax (formats.nvfp4.hadamard_amax_of_transpose).
    """
    if _amaxes_in_kernel(x):
        x = x.contiguous()  # held here: the kernel reads it after desc() returns
        amax = torch.empty((), dtype=torch.float32) if plain else None
        amax_rht = torch.empty((), dtype=torch.float32) if rht else None
        op = "nvfp4_amax"
        _C.nvfp4_amax(
            desc(x, op, "x"),
            desc(amax, op, "amax"),
            desc(amax_rht, op, "amax_rht"),
            stream_for(x),
        )
        return amax, amax_rht
    # The extension's amax op (ops.amax; looked up by name: ops/__init__ imports this module): one pass,
    # no float32 and |x| copies, the same NaN-propagating max.
    amax = torch.ops.transformer_linear.amax(x.contiguous()) if plain else None
    return amax, hadamard_amax_of_transpose(x) if rht else None


def nvfp4_amax(x: torch.Tensor, rht: bool = False) -> torch.Tensor:
    """The global amax of x's NVFP4 copy: max |x|, or with ``rht`` of x.T's Hadamard transform.

    Args:
        x: (M, K) floating tensor (M % 16 == 0 with ``rht``).
        rht: the amax of the transformed columnwise copy, as ``quantize_nvfp4(..., rht=True)``
            quantizes it.

    Returns:
        () float32; 0 for an empty x; NaN if x holds a NaN.

    Raises:
        ValueError: ``rht`` with M not a multiple of 16.
    """
    if rht and (x.dim() != 2 or x.shape[0] % BLOCK):
        raise ValueError(f"nvfp4_amax: with 'rht' argument 'x' must be 2-D with rows a multiple of {BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if not rht and x.dim() != 2:
        x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    amax, amax_rht = _amaxes(x.detach(), not rht, rht)
    return amax_rht if rht else amax


# ---------------------------------------------------------------------------
# The Linear's form: global scales packed with the block scales, seeds as tensors
# ---------------------------------------------------------------------------
#
# The packed scales: ops.nvfp4_packed_scales.


def _packed_outputs(x: torch.Tensor, rowwise: bool, columnwise: bool) -> list[torch.Tensor]:
    """The packed op's four outputs: the rowwise copy of x's M rows, the columnwise copy of its padded tokens."""
    m, k = x.shape
    tokens = padded_rows(m)
    data = _copy_shapes(m, k, rowwise, False)[0]
    data_t = _copy_shapes(tokens, k, False, columnwise)[2]
    return [
        x.new_empty(data, dtype=torch.uint8),
        x.new_empty(packed_scale_numel(m, k) if rowwise else 0, dtype=torch.float8_e4m3fn),
        x.new_empty(data_t, dtype=torch.uint8),
        x.new_empty(packed_scale_numel(k, tokens) if columnwise else 0, dtype=torch.float8_e4m3fn),
    ]


def _check_packed_quantize(op, x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, amax):
    if seed is not None:
        check_host_tensor(op, "seed", seed, x, "x")  # sr_seed's draw, read on the host
    check_hp_dtype(op, "x", x.dtype)
    check_quantize_shape(op, tuple(x.shape), rowwise, columnwise, scaling_2d, rht, pad=True)
    if stochastic_rounding and (seed is None or seed.dtype != torch.int64 or seed.numel() != 1):
        raise ValueError(f"{op}: 'stochastic_rounding' needs 'seed', a one-element int64 tensor, got {seed!r}")
    if amax is None:
        return
    check_same_device(op, {"x": x, "amax": amax})
    if amax.dtype != torch.float32:
        raise TypeError(f"{op}: argument 'amax' must be a float32 tensor, got {amax.dtype}")
    if amax.numel() != 1 or amax.dim() > 1:
        raise ValueError(f"{op}: argument 'amax' must be a one-element tensor of shape [] or [1], got "
                         f"{list(amax.shape)}")
    if columnwise and rht:
        # The transformed copy's global amax is that of x.T's Hadamard transform, not max |x|.
        raise ValueError(f"{op}: argument 'amax' cannot be given with an RHT columnwise copy (its global amax is "
                         "the transformed copy's)")


def _quantize_cpu_packed(x, amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed):
    """The CPU kernel writing its block scales straight into the packed scale tensors (no copy to pack them);
    the same bits as :func:`quantize_nvfp4` then :func:`pack_scales`. x on the CPU, not empty."""
    op = "quantize_nvfp4_packed"
    x = x.contiguous()  # held here: the kernel reads it after desc() returns
    m, k = x.shape
    outs = _packed_outputs(x, rowwise, columnwise)
    g, g_t = torch.empty((), dtype=torch.float32), torch.empty((), dtype=torch.float32)
    scale = outs[1][GLOBAL_SCALE_ELEMENTS:].view(m, k // BLOCK) if rowwise else None
    scale_t = outs[3][GLOBAL_SCALE_ELEMENTS:].view(k, m // BLOCK) if columnwise else None
    copies = (outs[0], scale, g, outs[2], scale_t, g_t)
    _run_quantize_kernel(op, x, amax, amax_t, copies, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed,
                         0)
    if rowwise:
        write_packed_global_scale(outs[1], g)
    if columnwise:
        write_packed_global_scale(outs[3], g_t)
    return outs


@library.custom_op("transformer_linear::quantize_nvfp4_packed", mutates_args=(), device_types=("cpu", "cuda"))
def _quantize_packed_op(
    x: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    scaling_2d: bool,
    rht: bool,
    stochastic_rounding: bool,
    seed: Optional[torch.Tensor],
    amax: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    op = "quantize_nvfp4_packed"
    _check_packed_quantize(op, x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, amax)
    rows = x.shape[0]
    if columnwise:
        x = pad_rows(x)  # any token count: the columnwise copy's last block padded with zero tokens
    outs = _quantize_padded(x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, amax)
    if x.shape[0] != rows and rowwise:  # the rowwise copy of the real rows: a prefix of data and of block scales
        outs[0], outs[1] = outs[0][:rows], outs[1][: packed_scale_numel(rows, x.shape[1])]
    return outs


def _quantize_padded(x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, amax) -> list[torch.Tensor]:
    """The packed op's copies of an ``x`` whose rows (with a columnwise copy) are a multiple of 16."""
    if amax is not None:
        amax = amax_t = amax.reshape(())
    elif x.numel() == 0:
        amax = amax_t = torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        amax, amax_t = _amaxes(x.detach(), True, columnwise and rht)
    seed_value = int(seed.reshape(())) if stochastic_rounding else 0
    if x.device.type == "cpu" and x.numel() > 0:
        return _quantize_cpu_packed(x, amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding,
                                    seed_value)
    data, scale, g, data_t, scale_t, g_t = torch.ops.transformer_linear.quantize_nvfp4(
        x, amax, amax_t, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed_value, 0
    )
    outs = _packed_outputs(x, rowwise, columnwise)
    if rowwise:
        outs[0], outs[1] = data, pack_scales(scale, g)
    if columnwise:
        outs[2], outs[3] = data_t, pack_scales(scale_t, g_t)
    return outs


@_quantize_packed_op.register_fake
def _(x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, amax=None):
    _check_packed_quantize("quantize_nvfp4_packed", x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed,
                           amax)
    return _packed_outputs(x, rowwise, columnwise)


def quantize_nvfp4_packed(
    x: torch.Tensor,
    rowwise: bool = True,
    columnwise: bool = False,
    scaling_2d: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    seed: Optional[torch.Tensor] = None,
    amax: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """NVFP4 copies of a 2-D ``x`` with their global scales from its amaxes, as the Linear holds them.

    The amaxes are :func:`nvfp4_amax` of x (and of its transformed transpose for an RHT columnwise
    copy), or ``amax`` where given; the rest is :func:`quantize_nvfp4` with offset 0.

    Args:
        x: (M, K) float32, bfloat16 or float16 on the CPU or a GPU (the rowwise copy needs K % 16 == 0;
            the columnwise copy takes any M: its tokens are x's rows padded with zero rows to T, the next
            multiple of 16, formats.nvfp4.pad_rows, so two such copies contract over the tokens exactly).
        rowwise / columnwise / scaling_2d / rht / stochastic_rounding: as :func:`quantize_nvfp4`.
        seed: stochastic rounding: a one-element int64 tensor (see :func:`sr_seed`).
        amax: () or (1,) float32, finite, >= 0, on x's device: the global amax to quantize with instead of
            x's own (a shard of a tensor quantized with the whole tensor's amax, as FSDP2's NVFP4
            all-gather does); None: x's. Not with an RHT columnwise copy.

    Returns:
        [data (M, K/2) uint8, packed scales, data_t (K, T/2) uint8, packed scales_t] (see
        :func:`pack_scales`); a copy not asked for has empty tensors. The rowwise copy is that of x's M rows
        (where rows were padded, a prefix of the padded copy's: the same bits).

    Raises:
        TypeError: a wrong dtype or a tensor on another device than cpu or cuda (or than x's).
        ValueError: a shape the copies cannot take (naming the dimension), a missing seed, or an ``amax``
            that is not one finite non-negative float32 or comes with an RHT columnwise copy.
    """
    op = "quantize_nvfp4_packed"
    check_tensor(op, "x", x)
    check_device_type(op, "x", x)
    if amax is not None:
        check_tensor(op, "amax", amax, like=x, like_name="x")
        check_scalar(op, "amax", amax, "amax")
    return _quantize_packed_op(x, rowwise, columnwise, scaling_2d, rht, stochastic_rounding, seed, amax)


@library.custom_op("transformer_linear::nvfp4_sr_seed", mutates_args=(), device_types=("cpu", "cuda", "meta"))
def _sr_seed_op(like: torch.Tensor) -> torch.Tensor:
    # The default CPU generator, drawn here rather than by a traced torch.randint: inductor replaces traced
    # random ops by its own generator, so a compiled graph would round with other bits than eager.
    return torch.randint(INT64_MIN, INT64_MAX, (), dtype=torch.int64)


@_sr_seed_op.register_fake
def _(like):
    return torch.empty((), dtype=torch.int64, device="cpu")


def sr_seed(like: torch.Tensor) -> torch.Tensor:
    """A stochastic-rounding seed: a () int64 tensor drawn from torch's default CPU generator.

    A custom op, so eager and ``torch.compile`` draw it alike: the same ``torch.manual_seed`` gives the
    same seeds in the same order, compiled or not. ``like`` is the tensor about to be quantized: the
    draw depends on it, so a graph keeps the draws in the order of the tensors they round, and two draws
    are never merged into one.
    """
    check_tensor("sr_seed", "like", like)
    return _sr_seed_op(like)
