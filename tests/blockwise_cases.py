"""Inputs and the expected-result helper shared by the block-scaling tests (CPU and Triton)."""

from __future__ import annotations

import torch
from tolerances import assert_bitwise_equal

from transformer_linear import reference
from transformer_linear.formats.block_scaling import columnwise_block_shape

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
FP8_FORMATS = [E4M3, E5M2]
# (block_shape, scale_dtype, power_2_scale, e8m0_rounding): each recipe's scales.
# A block_shape of (1, None) is one scale per row (the input's width).
SCALINGS = {
    "1x128": ((1, 128), torch.float32, False, "ceil"),
    "1x128_pow2": ((1, 128), torch.float32, True, "ceil"),
    "128x128_pow2": ((128, 128), torch.float32, True, "ceil"),
    "1x32_e8m0": ((1, 32), E8M0, False, "ceil"),
    "1x32_e8m0_floor": ((1, 32), E8M0, False, "floor"),
    "128x128_e8m0": ((128, 128), E8M0, False, "ceil"),
    "rowwise": ((1, None), torch.float32, True, "ceil"),
}


def block_shape_for(block: tuple, cols: int) -> tuple[int, int]:
    return (block[0], block[1] or max(cols, 1))


def all_bit_patterns(dtype: torch.dtype, shuffle: bool) -> torch.Tensor:
    """Every 16-bit pattern of bf16/fp16 as a (256, 256) matrix: sorted (each block holds
    neighbouring magnitudes, so each gets a real scale) or shuffled (blocks mix everything)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    if shuffle:
        bits = bits[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(1))]
    return bits.view(dtype).reshape(256, 256)


def special_blocks(rows: int = 40, cols: int = 300, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random values with an all-zero block, NaN, +-inf, subnormal-only rows and huge values."""
    x = torch.randn(rows, cols) * 10
    x[0, :128] = 0  # an all-zero 1x128 block
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, 200] = -float("inf")
    x[4, :] = 3e-39  # subnormal in fp32 and bf16: the scale overflows to FLT_MAX
    x[5, :] *= 1e30
    x[6:, 256:] = 0  # zero edge blocks
    return x.to(dtype)


def check_quantize(fn, x: torch.Tensor, fmt: torch.dtype, scaling: str, columnwise: bool = True) -> None:
    """fn(x, fmt, block, scale_dtype, power_2, columnwise=, e8m0_rounding=) equals the reference bitwise."""
    block, scale_dtype, power_2, rounding = SCALINGS[scaling]
    block = block_shape_for(block, x.shape[1])
    out = fn(x, fmt, block, scale_dtype, power_2, columnwise=columnwise, e8m0_rounding=rounding)
    q, s = reference.quantize_blockwise_ref(x, fmt, block, scale_dtype, power_2, rounding)
    what = f"{scaling} {fmt} {x.dtype} {tuple(x.shape)}"
    # NaN inputs stay NaN; torch's own casts disagree on a NaN's sign bit.
    assert_bitwise_equal(out.data, q, f"{what} data", any_nan=True)
    assert_bitwise_equal(out.scale_inv, s, f"{what} scale_inv")
    if columnwise:
        block_t = columnwise_block_shape(block, *x.shape)
        q_t, s_t = reference.quantize_blockwise_ref(x.t(), fmt, block_t, scale_dtype, power_2, rounding)
        assert_bitwise_equal(out.data_t, q_t, f"{what} data_t", any_nan=True)
        assert_bitwise_equal(out.scale_inv_t, s_t, f"{what} scale_inv_t")


def check_e8m0_rounding(quantize_blockwise, fmt: torch.dtype, rounding: str) -> None:
    """quantize_blockwise(x, fmt, (1, 32), E8M0, e8m0_rounding=rounding) (ops' or the Triton kernels')
    equals the reference bitwise, on every bf16 bit pattern and on special blocks; and the rounding
    reaches the kernel (the two rules give other scales there)."""
    for x in (all_bit_patterns(torch.bfloat16, False), special_blocks()):
        what = f"e8m0 {rounding} {fmt} {tuple(x.shape)}"
        q, s = quantize_blockwise(x, fmt, (1, 32), E8M0, e8m0_rounding=rounding)
        q_ref, s_ref = reference.quantize_blockwise_ref(x, fmt, (1, 32), E8M0, False, rounding)
        assert_bitwise_equal(q, q_ref, f"{what} data", any_nan=True)
        assert_bitwise_equal(s, s_ref, f"{what} scale_inv")
        other = "floor" if rounding == "ceil" else "ceil"
        s_other = reference.quantize_blockwise_ref(x, fmt, (1, 32), E8M0, False, other)[1]
        assert not torch.equal(s.view(torch.uint8), s_other.view(torch.uint8)), what


# (a scaling, b scaling) of each GEMM the recipes run, as (block_shape, scale_dtype) pairs.
GEMM_SCALINGS = {
    "1x128_x_128x128": (((1, 128), torch.float32), ((128, 128), torch.float32)),
    "128x128_x_1x128": (((128, 128), torch.float32), ((1, 128), torch.float32)),
    "1x128_x_1x128": (((1, 128), torch.float32), ((1, 128), torch.float32)),
    "1x32_x_1x32_e8m0": (((1, 32), E8M0), ((1, 32), E8M0)),
    "rowwise": (((1, None), torch.float32), ((1, None), torch.float32)),
}


# The mixed float32 pairs (a recipe whose roles differ in scaling): name -> (a scaling, b scaling, the
# ScalingTypes fp8_gemm resolves). A block of None is one scale per tensor (current scaling).
_MIXABLE = {
    "tensorwise": ((None, torch.float32), "TensorWise"),
    "rowwise": (((1, None), torch.float32), "RowWise"),
    "1x128": (((1, 128), torch.float32), "BlockWise1x128"),
    "128x128": (((128, 128), torch.float32), "BlockWise128x128"),
}
MIXED_GEMM_SCALINGS = {
    f"{a}_x_{b}": (_MIXABLE[a][0], _MIXABLE[b][0], (_MIXABLE[a][1], _MIXABLE[b][1]))
    for a in _MIXABLE
    for b in _MIXABLE
    if a != b and {a, b} != {"1x128", "128x128"}
}


def _quantize_operand(x: torch.Tensor, fmt, block, scale_dtype, power_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if block is None:
        return reference.quantize_current(x, fmt)[:2]
    return reference.quantize_blockwise_ref(x, fmt, block_shape_for(block, x.shape[1]), scale_dtype, power_2)


def block_operands(m: int, n: int, k: int, a_fmt, b_fmt, scaling: str, power_2: bool = True, spread: int = 8):
    """Quantized (a, a_scale_inv, b, b_scale_inv) with the given scaling (of GEMM_SCALINGS or
    MIXED_GEMM_SCALINGS), from the reference quantizers.

    Rows of a and columns of b get magnitudes over 2^-spread..2^spread so block scales really differ."""
    (a_block, a_sd), (b_block, b_sd) = (GEMM_SCALINGS.get(scaling) or MIXED_GEMM_SCALINGS[scaling])[:2]
    a_hp = torch.randn(m, k) * torch.exp2(torch.randint(-spread, spread + 1, (m, 1)).float())
    b_hp = torch.randn(n, k) * torch.exp2(torch.randint(-spread, spread + 1, (1, k)).float())
    a, sa = _quantize_operand(a_hp, a_fmt, a_block, a_sd, power_2)
    b, sb = _quantize_operand(b_hp, b_fmt, b_block, b_sd, power_2)
    return a, sa, b, sb


def dequantized_mm_fp32(a, sa, b, sb, out_dtype, bias=None):
    """Plain PyTorch at the kernels' precision: fp32 torch.mm of the dequantized operands (the error baseline)."""
    (m, k), n = a.shape, b.shape[0]
    a_deq = (a.double() * reference.expand_scale_inv(sa, reference.block_shape_of(sa, m, k), m, k)).float()
    b_deq = (b.double() * reference.expand_scale_inv(sb, reference.block_shape_of(sb, n, k), n, k)).float()
    out = a_deq @ b_deq.t()
    return (out if bias is None else out + bias.float()).to(out_dtype)
