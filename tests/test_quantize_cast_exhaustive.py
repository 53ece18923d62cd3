"""The vector FP8 casts bit for bit against the reference on every bf16 pattern and on fp32 values at and
around every FP8 rounding boundary, over scales that reach each of the casts' internal cases.

The AVX2 cast of 32 lanes at a time rounds by adding a magnitude-dependent float (exact for normals and
subnormals of the FP8 format), and takes e4m3 products pre-multiplied by 2^-8 (folded into the scale where
that product is exact, scales of 2^-118 and more, a separate path below): the scales here include both
sides of that limit, scales whose products land among float32 subnormals, and huge ones. Each case runs
on every CPU path (``_C.set_cpu_isa``) through the public ops: the tensorwise cast (with and without the
fused amax), the cast with its transposed copy, and the blockwise quantize (whose scales come from the
blocks' amaxes).
"""

from __future__ import annotations

import pytest
import torch
from blockwise_cases import check_quantize as check_blockwise
from cpu_paths import QUANTIZE_ISAS
from tolerances import assert_bitwise_equal

from transformer_linear import _C, ops
from transformer_linear import reference as ref

FP8 = list(ref.FP8_DTYPES)
FLT_MAX = torch.finfo(torch.float32).max
# Powers of two and others. e4m3's code-domain scale (times 2^-8) is a normal float for 2^-118 and
# 1.5 * 2^-118, an exact subnormal for 2^-120 and 3 * 2^-125, inexact for 1.1 * 2^-120 and 1e-38
# (itself a float32 subnormal).
SCALES = [1.0, 2.0**-8, 3.7, 0.1, 1 / 3, 2.0**-118, 1.5 * 2.0**-118, 2.0**-120, 3 * 2.0**-125,
          1.1 * 2.0**-120, 1e-38, 2.0**40, 1e30, FLT_MAX]
NAN_AND_INF_BITS = [0x7F800000, 0x7FC00000, 0x7F800001, 0x7FA00000, 0x7FE00000, 0x7FBFFFFF, 0x7FFFFFFF]


@pytest.fixture(params=QUANTIZE_ISAS)
def isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of the low 32 bits of int64 `bits`."""
    low = bits.to(torch.int64) & 0xFFFFFFFF
    return (low - ((low >> 31) << 32)).to(torch.int32).view(torch.float32)


def fp8_grid(fmt: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of fmt, ascending, as float32."""
    codes = torch.arange(128, dtype=torch.uint8).view(fmt).float()
    return codes[torch.isfinite(codes)]


def neighbours(x: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """x and the float32 values up to `ulps` steps either side (on the bit patterns of |x|)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.cat([from_bits(bits + d) for d in range(-ulps, ulps + 1)])


def fp32_sample(fmt: torch.dtype, scale: float) -> torch.Tensor:
    """float32 inputs whose products with `scale` fall on and around every rounding boundary of fmt
    (grid points, ties, saturation), plus random and float32-subnormal patterns, NaN and inf, both signs.
    The length is not a multiple of 32, so the vector kernels' tails run too."""
    gen = torch.Generator().manual_seed(0)
    grid = fp8_grid(fmt)
    top = grid[-1]
    ties = (grid[:-1] + grid[1:]) / 2  # exact in float32
    step = grid[-1] - grid[-2]
    edges = torch.cat([grid, ties, torch.stack([top + step / 2, top + step, 2 * top])])
    # Products near each edge: the quotient by the scale and its neighbours (exact edges for powers of two).
    near_edges = neighbours((edges.double() / scale).float())
    # Random magnitudes over the format's range and below, in the product domain.
    rand = (torch.rand(1 << 15, generator=gen) * 2 - 1) * torch.exp2(
        torch.randint(-30, 20, (1 << 15,), generator=gen).float())
    rand = (rand.double() / scale).float()
    patterns = torch.randint(0, 2**32, (1 << 16,), generator=gen, dtype=torch.int64)
    subnormals = torch.randint(0, 1 << 23, (1 << 12,), generator=gen, dtype=torch.int64)
    specials = torch.tensor(NAN_AND_INF_BITS + [0, 1, 0x7F7FFFFF, 0x00800000], dtype=torch.int64)
    x = torch.cat([near_edges, rand, from_bits(patterns), from_bits(subnormals), from_bits(specials)])
    x = torch.cat([x, -x])
    return x[torch.randperm(x.numel(), generator=gen)][: (x.numel() // 32 - 1) * 32 + 19]


def all_bf16() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def check_tensorwise(x: torch.Tensor, scale: float, fmt: torch.dtype, what: str) -> None:
    """quantize, quantize_with_amax and the cast with its transposed copy against the reference."""
    s = torch.tensor([scale], dtype=torch.float32)
    q_ref, _ = ref.quantize(x, s, fmt)
    q, _ = ops.quantize(x, s, fmt)
    assert_bitwise_equal(q, q_ref, f"{what} quantize")
    q, _, _ = ops.quantize_with_amax(x, s, fmt)
    assert_bitwise_equal(q, q_ref, f"{what} quantize_with_amax")
    cols = 64
    rows = x.numel() // cols
    x2 = x[: rows * cols].reshape(rows, cols)
    out = ops.quantize_fused(x2, fmt, s, columnwise=True)
    q2_ref = q_ref[: rows * cols].reshape(rows, cols)
    assert_bitwise_equal(out.data, q2_ref, f"{what} quantize_fused data")
    assert_bitwise_equal(out.data_t, ref.transpose_2d(q2_ref), f"{what} quantize_fused data_t")


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:.3g}")
@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_every_bf16_pattern(isa, fmt, scale):
    check_tensorwise(all_bf16(), scale, fmt, f"{isa} bf16 {fmt} scale={scale!r}")


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:.3g}")
@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_fp32_rounding_boundaries(isa, fmt, scale):
    check_tensorwise(fp32_sample(fmt, scale), scale, fmt, f"{isa} fp32 {fmt} scale={scale!r}")


@pytest.mark.parametrize("scaling", ["1x128", "128x128_pow2", "1x32_e8m0"])
@pytest.mark.parametrize("fmt", FP8, ids=str)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blockwise_rounding_boundaries(isa, in_dtype, fmt, scaling):
    """The block casts (a uniform scale per block, and one per lane for the transposed copy) on the
    boundary sample: sorted by magnitude (blocks of neighbours, each with a real scale) and as drawn."""
    x = fp32_sample(fmt, 1.0)
    x = x[: x.numel() // 256 * 256].to(in_dtype)
    for xs in (x[x.float().abs().argsort()], x):
        check_blockwise(ops.quantize_blockwise_fused, xs.reshape(-1, 256), fmt, scaling)
