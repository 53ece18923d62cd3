"""Grouped NVFP4 GEMMs (mixture-of-experts under NVFP4BlockScaling), with no host read of ``offs`` from Python.

CPU tensors run the extension's grouped NVFP4 GEMM (csrc/cpu/gemm_grouped_nvfp4_cpu.cpp), which reads
``offs`` in C++ (a CPU tensor: no device sync) and runs each expert's NVFP4 GEMM on its own rows only,
every row with the bits of ``ops.nvfp4.nvfp4_gemm_packed`` on that row and the expert's weight.

Other tensors (CUDA, meta) loop over the experts of the NVFP4 GEMM op: a loop of per-group slices would
need each group's size on the host (a device sync, and a recompile per routing under torch.compile), so
every expert's GEMM runs on all the tokens and each output row is taken from its own expert's result
(``torch.where`` on the row's group, found on the device): G times the FLOPs, the same bits.

The weight gradient contracts over tokens: each expert's operands are the tokens masked to its group
(zeros elsewhere), quantized into their columnwise NVFP4 copies (blocks of 16 tokens on the tensor's grid,
so groups need not be aligned to 16; a block shared with another group holds zeros for that group's
rows), which :func:`nvfp4_grouped_gemm_wgrad` multiplies expert by expert. Those copies are *compact*:
every block of a masked copy outside the 16-token bands holding its group's tokens is zero codes with zero
scales and adds nothing to the product, so group g's copy stores only its bands, tokens
[floor(start / 16) * 16, ceil(end / 16) * 16), at columns placed one group after another
(:func:`group_bands`, computed on the device here and from ``offs`` in C++ the same way) in a buffer of
:func:`compact_tokens` tokens, a size fixed by the shapes (no host read of ``offs``): about the input's FP4
size, not G times it. On the CPU the extension makes them (:func:`quantize_nvfp4_grouped_columnwise`: each
group's global amax over its own rows, its own stochastic-rounding seed, the random bits of each element's
index in the whole masked copy) and contracts each expert's bands: the bits of the masked path at 1/G of
its bytes and FLOPs. Elsewhere each masked copy is quantized whole and its bands gathered
(:func:`compact_columnwise`), and the wgrad expands them back (:func:`expand_columnwise`).

Operands are in the packed form of ops.nvfp4 (uint8 data, two E2M1 codes a byte; 1-D packed scales with
the float32 global scale), one stacked tensor per operand.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from transformer_linear import _C
from transformer_linear.formats.checks import check_host_tensor, check_hp_dtype, check_same_device
from transformer_linear.formats.nvfp4 import BLOCK, padded_rows
from transformer_linear.ops import library, nvfp4
from transformer_linear.ops.descriptors import desc, stream_for

__all__ = [
    "GroupBands",
    "compact_columnwise",
    "compact_tokens",
    "expand_columnwise",
    "group_bands",
    "group_of_rows",
    "nvfp4_grouped_gemm",
    "nvfp4_grouped_gemm_wgrad",
    "quantize_nvfp4_grouped_columnwise",
]

# A packed scale tensor starts with the float32 global decode scale as 8 elements (ops.nvfp4 pack_scales).
_GLOBAL_ELEMENTS = 8


def group_of_rows(rows: int, offs: Tensor) -> Tensor:
    """(rows,) the group of each row (``offs.shape[0]`` for rows past offs[-1]), on the device."""
    index = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, index, right=True)


def compact_tokens(total: int, groups: int) -> int:
    """Tokens a compact grouped copy of ``total`` tokens in ``groups`` groups holds: ``total + 16 (groups - 1)``
    (0 without groups), an upper bound of the groups' 16-token bands together (each boundary between two
    groups adds at most one band they share), fixed by the shapes."""
    return 0 if groups == 0 else total + BLOCK * (groups - 1)


class GroupBands(NamedTuple):
    """Each group's 16-token bands (int64 (G,) tensors on ``offs``' device)."""

    band_begin: Tensor
    """The group's first band token, ``floor(start / 16) * 16``."""
    width: Tensor
    """Its bands' tokens, ``ceil(end / 16) * 16 - band_begin`` (0 for an empty group)."""
    column: Tensor
    """Where its bands start in the compact copy: the widths of the groups before it, summed."""


def group_bands(offs: Tensor) -> GroupBands:
    """Each group's bands and compact column from the cumulative ends ``offs``, on the device (no host read)."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    band_begin = starts // BLOCK * BLOCK
    band_end = torch.where(ends > starts, (ends + BLOCK - 1) // BLOCK * BLOCK, band_begin)
    width = band_end - band_begin
    return GroupBands(band_begin, width, torch.cumsum(width, 0) - width)


def compact_columnwise(data_t: Tensor, scale_t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """The compact form of stacked masked columnwise copies: each group's bands, one group after another.

    Args:
        data_t: (G, R, M/2) uint8, each group's columnwise copy of the tokens masked to it.
        scale_t: (G, 8 + R * M/16) their packed scales.
        offs: (G,) int32 cumulative token ends (read on the device only).

    Returns:
        (data (R, C/2) uint8, scales (8 G + R * C/16) float8_e4m3fn: each group's packed global decode scale,
        then the (R, C/16) block scales), C = compact_tokens(M, G); zeros past the groups' bands.
    """
    groups, rows, total = data_t.shape[0], data_t.shape[1], 2 * data_t.shape[2]
    capacity = compact_tokens(total, groups)
    if groups == 0:
        return data_t.new_zeros((rows, 0)), scale_t.new_empty(0)
    bands = group_bands(offs)
    scale_bytes = scale_t.view(torch.uint8)

    def gather(blocks: Tensor, step: int) -> Tensor:
        # Compact column j (token j * step) is group g's band token band_begin[g] + (j * step - column[g]).
        token = torch.arange(0, capacity, step, device=offs.device)
        group = torch.searchsorted(bands.column + bands.width, token, right=True)
        valid = group < groups
        group = group.clamp(max=groups - 1)
        src = torch.where(valid, (bands.band_begin[group] + token - bands.column[group]) // step, 0)
        picked = blocks[group, :, src]  # (C / step, R)
        return torch.where(valid.unsqueeze(1), picked, torch.zeros((), dtype=picked.dtype, device=picked.device)).t()

    data = gather(data_t, 2).contiguous()
    block_scales = gather(scale_bytes[:, _GLOBAL_ELEMENTS:].reshape(groups, rows, total // BLOCK), BLOCK)
    scales = torch.cat([scale_bytes[:, :_GLOBAL_ELEMENTS].reshape(-1), block_scales.reshape(-1)])
    return data, scales.view(torch.float8_e4m3fn)


def expand_columnwise(data: Tensor, scales: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """The stacked masked copies (G, R, M/2), (G, 8 + R * M/16) of compact ones (:func:`compact_columnwise`'s
    inverse, zeros outside each group's bands; M from the capacity); on the device, no host read of offs."""
    groups, rows, capacity = offs.shape[0], data.shape[0], 2 * data.shape[1]
    total = capacity - BLOCK * (groups - 1) if groups else 0
    scale_bytes = scales.view(torch.uint8)
    if groups == 0:
        return (data.new_zeros((0, rows, 0)),
                scales.new_empty((0, nvfp4.packed_scale_numel(rows, 0))))
    bands = group_bands(offs)

    def scatter(compact: Tensor, step: int) -> Tensor:
        token = torch.arange(0, total, step, device=offs.device)
        offset = token - bands.band_begin.unsqueeze(1)  # (G, M / step)
        inside = (offset >= 0) & (offset < bands.width.unsqueeze(1))
        src = torch.where(inside, (bands.column.unsqueeze(1) + offset) // step, 0)
        picked = compact[:, src].permute(1, 0, 2)  # (G, R, M / step)
        zero = torch.zeros((), dtype=picked.dtype, device=picked.device)
        return torch.where(inside.unsqueeze(1), picked, zero)

    data_t = scatter(data, 2).contiguous()
    block_scales = scatter(scale_bytes[_GLOBAL_ELEMENTS * groups:].reshape(rows, capacity // BLOCK), BLOCK)
    scale_t = torch.cat([scale_bytes[:_GLOBAL_ELEMENTS * groups].reshape(groups, _GLOBAL_ELEMENTS),
                         block_scales.reshape(groups, -1)], dim=1)
    return data_t, scale_t.view(torch.float8_e4m3fn)


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
        offs: (G,) int32 cumulative row ends; never read on the host from Python (on the CPU the extension
            reads and checks it: a CPU tensor, no device sync).
        out_dtype: float32, bfloat16 or float16.
        bias: (G, N) of ``out_dtype``, or None.

    Raises:
        TypeError: a wrong dtype or rank.
        ValueError: ``b_scale_inv`` or ``offs`` not one per group, or (CPU) ``offs`` not nondecreasing within
            [0, M] (the NVFP4 GEMM checks the rest).
    """
    op = "nvfp4_grouped_gemm"
    _check_grouped_devices(op, a, a_scale_inv, b, b_scale_inv, offs, bias)
    _check(op, "a", a, torch.uint8, 2)
    _check(op, "b", b, torch.uint8, 3)
    _check(op, "b_scale_inv", b_scale_inv, torch.float8_e4m3fn, 2)
    _check(op, "offs", offs, torch.int32, 1)
    groups = b.shape[0]
    if b_scale_inv.shape[0] != groups or offs.shape[0] != groups:
        raise ValueError(f"{op}: 'b_scale_inv' and 'offs' must have one entry per group ({groups}), got "
                         f"{b_scale_inv.shape[0]} and {offs.shape[0]}")
    if a.device.type == "cpu":
        return _grouped_gemm_op(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    return _masked_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)


def _masked_grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias=None) -> Tensor:
    """Every expert's GEMM on all the tokens, each row taken from its own expert's (no host read of offs)."""
    group = group_of_rows(a.shape[0], offs).unsqueeze(1)
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    for g in range(b.shape[0]):
        expert_out = nvfp4.nvfp4_gemm_packed(a, a_scale_inv, b[g], b_scale_inv[g], out_dtype,
                                             None if bias is None else bias[g])
        out = torch.where(group == g, expert_out, out)
    return out


def _check_grouped_devices(op, a, a_scale_inv, b, b_scale_inv, offs, bias) -> None:
    check_same_device(op, {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv, "offs": offs,
                           "bias": bias}, optional=("bias",))


def _check_grouped_op(op, a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias) -> None:
    """What the custom op checks itself (it can be called through torch.ops); the kernel checks the rest."""
    _check_grouped_devices(op, a, a_scale_inv, b, b_scale_inv, offs, bias)
    _check(op, "a", a, torch.uint8, 2)
    _check(op, "a_scale_inv", a_scale_inv, torch.float8_e4m3fn, 1)
    _check(op, "b", b, torch.uint8, 3)
    _check(op, "b_scale_inv", b_scale_inv, torch.float8_e4m3fn, 2)
    _check(op, "offs", offs, torch.int32, 1)
    check_hp_dtype(op, "out_dtype", out_dtype)
    if a.shape[1] != b.shape[2]:
        raise ValueError(f"{op}: the K dimensions of 'a' {list(a.shape)} and 'b' {list(b.shape)} differ")
    if b_scale_inv.shape[0] != b.shape[0] or offs.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: 'b_scale_inv' and 'offs' must have one entry per group ({b.shape[0]}), got "
                         f"{b_scale_inv.shape[0]} and {offs.shape[0]}")
    if bias is not None and bias.dtype != out_dtype:
        raise TypeError(f"{op}: argument 'bias' must have the output dtype {out_dtype}, got {bias.dtype}")


@library.custom_op("transformer_linear::nvfp4_grouped_gemm", mutates_args=(), device_types="cpu")
def _grouped_gemm_op(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
) -> Tensor:
    op = "nvfp4_grouped_gemm"
    _check_grouped_op(op, a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    # Contiguous copies (where needed) held here: the kernel reads them after desc() returns.
    a, a_scale_inv, b, b_scale_inv, offs = (t.contiguous() for t in (a, a_scale_inv, b, b_scale_inv, offs))
    bias = None if bias is None else bias.contiguous()
    _C.nvfp4_grouped_gemm(
        desc(a, op, "a"), desc(a_scale_inv, op, "a_scale_inv"), desc(b, op, "b"), desc(b_scale_inv, op, "b_scale_inv"),
        desc(offs, op, "offs"), desc(bias, op, "bias"), desc(out, op, "d"), stream_for(a),
    )
    return out


@_grouped_gemm_op.register_fake
def _(a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias):
    _check_grouped_op("nvfp4_grouped_gemm", a, a_scale_inv, b, b_scale_inv, offs, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def nvfp4_grouped_gemm_wgrad(
    grad_t: Tensor,
    grad_t_scale_inv: Tensor,
    x_t: Tensor,
    x_t_scale_inv: Tensor,
    out_dtype: torch.dtype,
    offs: Tensor,
) -> Tensor:
    """(G, N, K): per group, its compact copies ``grad_t`` x ``x_t``ᵀ contracted over its bands' tokens.

    The operands are compact grouped columnwise copies (:func:`quantize_nvfp4_grouped_columnwise`): the bits
    of each masked copy's NVFP4 GEMM over all the tokens, from the group's bands only.

    Args:
        grad_t: (N, C/2) uint8: the compact copies of grad_output, C = compact_tokens(T, G) (T: the tokens
            padded to a multiple of 16, :func:`quantize_nvfp4_grouped_columnwise`).
        grad_t_scale_inv: (8 G + N * C/16) their scales (each group's packed global scale, the block scales).
        x_t: (K, C/2) uint8: the same of the input.
        x_t_scale_inv: (8 G + K * C/16) their scales.
        out_dtype: float32, bfloat16 or float16.
        offs: (G,) int32 cumulative token ends; read by the extension only (CPU), on the device elsewhere,
            never on the host from Python.

    Raises:
        TypeError: a wrong dtype or rank.
        ValueError: operands of different token capacities or not the capacity of G groups, or (on the CPU)
            ``offs`` not nondecreasing within [0, M] (the NVFP4 GEMM checks the rest).
    """
    op = "nvfp4_grouped_gemm_wgrad"
    _check_wgrad_shapes(op, grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs)
    if offs.shape[0] == 0:
        return grad_t.new_zeros((0, grad_t.shape[0], x_t.shape[0]), dtype=out_dtype)
    if grad_t.device.type == "cpu":
        return _grouped_wgrad_op(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype)
    return _expanded_wgrad(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype)


def _expanded_wgrad(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype) -> Tensor:
    """The compact copies expanded back to the masked ones (on the device), each expert's GEMM over all tokens."""
    return _looped_wgrad(*expand_columnwise(grad_t, grad_t_scale_inv, offs),
                         *expand_columnwise(x_t, x_t_scale_inv, offs), out_dtype)


def _looped_wgrad(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, out_dtype) -> Tensor:
    """Each expert's NVFP4 GEMM of its masked copies (G, R, M/2) over all the tokens."""
    return torch.stack([
        nvfp4.nvfp4_gemm_packed(grad_t[g], grad_t_scale_inv[g], x_t[g], x_t_scale_inv[g], out_dtype)
        for g in range(grad_t.shape[0])
    ])


def _check_wgrad_shapes(op, grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs) -> None:
    check_same_device(op, {"grad_t": grad_t, "grad_t_scale_inv": grad_t_scale_inv, "x_t": x_t,
                           "x_t_scale_inv": x_t_scale_inv, "offs": offs})
    for name, t in (("grad_t", grad_t), ("x_t", x_t)):
        _check(op, name, t, torch.uint8, 2)
    for name, t in (("grad_t_scale_inv", grad_t_scale_inv), ("x_t_scale_inv", x_t_scale_inv)):
        _check(op, name, t, torch.float8_e4m3fn, 1)
    _check(op, "offs", offs, torch.int32, 1)
    groups, capacity = offs.shape[0], 2 * grad_t.shape[1]
    if x_t.shape[1] != grad_t.shape[1]:
        raise ValueError(f"{op}: 'grad_t' {list(grad_t.shape)} and 'x_t' {list(x_t.shape)} must have the same tokens")
    total = capacity - BLOCK * (groups - 1) if groups else 0
    if capacity % BLOCK or total < 0 or compact_tokens(total, groups) != capacity:
        raise ValueError(f"{op}: the compact copies must hold M + 16 * (G - 1) tokens (M % 16 == 0) for the "
                         f"G = {groups} groups of argument 'offs', got {capacity}")
    for name, t, rows in (("grad_t_scale_inv", grad_t_scale_inv, grad_t.shape[0]),
                          ("x_t_scale_inv", x_t_scale_inv, x_t.shape[0])):
        want = _GLOBAL_ELEMENTS * groups + rows * (capacity // BLOCK)
        if t.shape[0] != want:
            raise ValueError(f"{op}: argument '{name}' must have 8 * G + rows * C / 16 = {want} elements for "
                             f"the G = {groups} groups of argument 'offs', got {t.shape[0]}")


def _check_wgrad_op(op, grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype) -> None:
    _check_wgrad_shapes(op, grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs)
    check_hp_dtype(op, "out_dtype", out_dtype)


@library.custom_op("transformer_linear::nvfp4_grouped_gemm_wgrad", mutates_args=(), device_types="cpu")
def _grouped_wgrad_op(
    grad_t: Tensor, grad_t_scale_inv: Tensor, x_t: Tensor, x_t_scale_inv: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    op = "nvfp4_grouped_gemm_wgrad"
    _check_wgrad_op(op, grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype)
    out = torch.empty((offs.shape[0], grad_t.shape[0], x_t.shape[0]), dtype=out_dtype, device=grad_t.device)
    grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs = (
        t.contiguous() for t in (grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs))
    _C.nvfp4_grouped_gemm_wgrad(
        desc(grad_t, op, "grad_t"), desc(grad_t_scale_inv, op, "grad_t_scale_inv"), desc(x_t, op, "x_t"),
        desc(x_t_scale_inv, op, "x_t_scale_inv"), desc(offs, op, "offs"), desc(out, op, "d"), stream_for(grad_t),
    )
    return out


@_grouped_wgrad_op.register_fake
def _(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype):
    _check_wgrad_op("nvfp4_grouped_gemm_wgrad", grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs, out_dtype)
    return grad_t.new_empty((offs.shape[0], grad_t.shape[0], x_t.shape[0]), dtype=out_dtype)


def quantize_nvfp4_grouped_columnwise(
    x: Tensor, offs: Tensor, rht: bool = False, stochastic_rounding: bool = False, seeds: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Each group's columnwise NVFP4 copy (1x16 blocks along the tokens) of ``x`` masked to its group, compact.

    Group g's masked copy is bitwise ``ops.nvfp4.quantize_nvfp4_packed(x masked to g, rowwise=False,
    columnwise=True, rht=rht, stochastic_rounding=stochastic_rounding, seed=seeds[g])``: its global amax is the
    masked tensor's, its blocks sit on the tensor's 16-token grid (a block shared with another group holds
    zeros for that group's rows), and its stochastic-rounding bits are those of each element's index in the
    copy. Only its bands (:func:`group_bands`) are kept, one group after another (:func:`compact_columnwise`
    of the stacked masked copies; :func:`expand_columnwise` gives them back).

    Args:
        x: (M, K) float32, bfloat16 or float16; any M: the tokens are x's rows padded with zero rows to T, the
            next multiple of 16 (formats.nvfp4.pad_rows; rows past offs[-1] belong to no group anyway).
        offs: (G,) int32 cumulative row ends; on the CPU read by the extension only, never on the host
            from Python; elsewhere never read on the host (every group masks and quantizes all the tokens).
        rht: the random Hadamard transform of each block (its global amax that of the transformed copy).
        stochastic_rounding: round stochastically, group g with ``seeds[g]``.
        seeds: (G,) int64 with ``stochastic_rounding`` (see ops.nvfp4.sr_seed), else None.

    Returns:
        (data_t (K, C/2) uint8, scales (8 G + K * C/16) float8_e4m3fn: each group's packed global decode scale,
        then the (K, C/16) block scales), C = compact_tokens(T, G) tokens.

    Raises:
        TypeError: a wrong dtype or rank.
        ValueError: a missing seed, ``offs`` not nondecreasing within [0, M] (CPU),
            or a non-finite global amax.
    """
    op = "quantize_nvfp4_grouped_columnwise"
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise TypeError(f"{op}: argument 'x' must be a 2-D torch.Tensor, got {x!r:.80}")
    _check_grouped_quantize(op, x, offs, stochastic_rounding, seeds)
    if x.device.type == "cpu":
        return tuple(_grouped_quantize_op(x, offs, rht, stochastic_rounding, seeds))
    return _compact_grouped_quantize(x, offs, rht, stochastic_rounding, seeds)


def _masked_grouped_quantize(x, offs, rht, stochastic_rounding, seeds) -> tuple[Tensor, Tensor]:
    """Each group's masked copy of all the tokens quantized, stacked (no host read of offs):
    (G, K, T/2), (G, 8 + K * T/16), T the tokens padded to a multiple of 16."""
    group = group_of_rows(x.shape[0], offs).unsqueeze(1)
    # Each copy's tokens padded to T (the packed quantize pads them): no group holds the padding rows.
    copies = [
        nvfp4.quantize_nvfp4_packed(torch.where(group == g, x, torch.zeros((), dtype=x.dtype, device=x.device)),
                                    rowwise=False, columnwise=True, rht=rht, stochastic_rounding=stochastic_rounding,
                                    seed=seeds[g] if stochastic_rounding else None)
        for g in range(offs.shape[0])
    ]
    m, k = padded_rows(x.shape[0]), x.shape[1]
    data_t = x.new_empty((offs.shape[0], k, m // 2), dtype=torch.uint8)
    scale_t = x.new_empty((offs.shape[0], nvfp4.packed_scale_numel(k, m)), dtype=torch.float8_e4m3fn)
    for g, copy in enumerate(copies):  # copied rather than stacked: torch.autocast's stack rejects FP8 scales
        data_t[g].copy_(copy[2])
        scale_t[g].copy_(copy[3])
    return data_t, scale_t


def _compact_grouped_quantize(x, offs, rht, stochastic_rounding, seeds) -> tuple[Tensor, Tensor]:
    """The masked copies quantized whole, their bands gathered (no host read of offs)."""
    return compact_columnwise(*_masked_grouped_quantize(x, offs, rht, stochastic_rounding, seeds), offs)


def _check_grouped_quantize(op, x, offs, stochastic_rounding, seeds) -> None:
    check_same_device(op, {"x": x, "offs": offs})
    if seeds is not None:
        check_host_tensor(op, "seeds", seeds, x, "x")  # sr_seed's draws, read on the host
    check_hp_dtype(op, "x", x.dtype)
    _check(op, "offs", offs, torch.int32, 1)
    if stochastic_rounding and (seeds is None or seeds.dtype != torch.int64 or list(seeds.shape) != [offs.shape[0]]):
        raise ValueError(f"{op}: 'stochastic_rounding' needs 'seeds', ({offs.shape[0]},) int64, got {seeds!r:.80}")


def _grouped_quantize_outputs(x: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    k = x.shape[1]
    capacity = compact_tokens(padded_rows(x.shape[0]), groups)
    return (x.new_empty((k, capacity // 2), dtype=torch.uint8),
            x.new_empty((_GLOBAL_ELEMENTS * groups + k * (capacity // BLOCK),), dtype=torch.float8_e4m3fn))


@library.custom_op("transformer_linear::quantize_nvfp4_grouped_columnwise", mutates_args=(), device_types="cpu")
def _grouped_quantize_op(
    x: Tensor, offs: Tensor, rht: bool, stochastic_rounding: bool, seeds: Optional[Tensor]
) -> list[Tensor]:
    op = "quantize_nvfp4_grouped_columnwise"
    _check_grouped_quantize(op, x, offs, stochastic_rounding, seeds)
    data_t, scale_t = _grouped_quantize_outputs(x, offs.shape[0])
    x, offs = x.contiguous(), offs.contiguous()  # the extension pads the rows to T (and checks offs against M)
    seeds = seeds.contiguous() if stochastic_rounding else None
    _C.quantize_nvfp4_grouped_columnwise(
        desc(x, op, "x"), desc(offs, op, "offs"), desc(seeds, op, "seeds"), desc(data_t, op, "output_t"),
        desc(scale_t, op, "scale_t"), rht, stochastic_rounding, stream_for(x),
    )
    return [data_t, scale_t]


@_grouped_quantize_op.register_fake
def _(x, offs, rht, stochastic_rounding, seeds):
    _check_grouped_quantize("quantize_nvfp4_grouped_columnwise", x, offs, stochastic_rounding, seeds)
    return list(_grouped_quantize_outputs(x, offs.shape[0]))
