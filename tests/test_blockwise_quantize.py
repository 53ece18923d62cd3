"""Blockwise quantize (CPU kernel) held bitwise to reference.quantize_blockwise_ref, and the scale rules."""

from __future__ import annotations

import pytest
import torch
from blockwise_cases import (
    E4M3,
    E5M2,
    E8M0,
    FP8_FORMATS,
    SCALINGS,
    all_bit_patterns,
    block_shape_for,
    check_e8m0_rounding,
    check_quantize,
    special_blocks,
)
from cpu_paths import QUANTIZE_ISAS
from tolerances import assert_bitwise_equal

from transformer_linear import _C, ops, recipe, reference
from transformer_linear.formats.block_scaling import columnwise_block_shape

FLT_MAX = torch.finfo(torch.float32).max
ISAS = QUANTIZE_ISAS


@pytest.fixture(params=ISAS)
def cpu_isa(request):
    """The portable row kernels and the vector ones (they must agree bit for bit)."""
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted", "shuffled"])
def test_every_bit_pattern(cpu_isa, in_dtype, fmt, scaling, shuffle):
    check_quantize(ops.quantize_blockwise_fused, all_bit_patterns(in_dtype, shuffle), fmt, scaling)


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (130, 257), (129, 31)])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_edge_blocks(cpu_isa, in_dtype, shape, scaling):
    """Partial edge blocks use the amax of what they hold."""
    check_quantize(ops.quantize_blockwise_fused, torch.randn(shape).to(in_dtype) * 7, E4M3, scaling)


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_zero_nan_inf_blocks(cpu_isa, fmt, scaling):
    check_quantize(ops.quantize_blockwise_fused, special_blocks(dtype=torch.float32), fmt, scaling)


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("shape", [(300, 700), (1030, 40), (520, 129)])
@pytest.mark.parametrize("threads", [1, 3])
def test_tiles_and_threads(cpu_isa, threads, shape, scaling):
    """Inputs of many tiles, split over threads: the tiled one-pass walk, and rowwise
    scaling's transposed copy (a scale per column of a tall input) whose column amaxes
    are reduced across threads before the second pass."""
    x = torch.randn(shape) * 10
    x[shape[0] // 2 :] *= 1e-3  # row bands and thread chunks with different scales
    x[1, 3], x[-1, 0], x[:, -1] = float("nan"), float("inf"), 0.0
    x = x.to(torch.bfloat16)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_quantize(ops.quantize_blockwise_fused, x, E4M3, scaling)
        block, scale_dtype, power_2, _ = SCALINGS[scaling]
        block = block_shape_for(block, shape[1])
        both = ops.quantize_blockwise_fused(x, E4M3, block, scale_dtype, power_2, columnwise=True)
        alone = ops.quantize_blockwise_fused(x, E4M3, block, scale_dtype, power_2, rowwise=False, columnwise=True)
    finally:
        torch.set_num_threads(saved)
    # The columnwise copy alone (its own tiling and passes) equals the one made with the rowwise copy.
    assert_bitwise_equal(alone.data_t, both.data_t, "columnwise only", any_nan=True)
    assert_bitwise_equal(alone.scale_inv_t, both.scale_inv_t, "columnwise only")


@pytest.mark.parametrize("scaling", ["1x128_pow2", "128x128_pow2", "128x128_e8m0", "1x32_e8m0", "rowwise"])
@pytest.mark.parametrize("columnwise", [False, True], ids=["row", "row+col"])
def test_large_outputs(columnwise, scaling):
    """Outputs of 8 MiB and more take the streaming paths (non-temporal stores; on AVX2 the 128x128
    blocks go through a scratch tile when the transposed copy is wanted): every path against the
    reference on one such input (the reference computed once)."""
    torch.manual_seed(0)
    x = torch.randn(2048, 4096) * 4
    x[64:192] *= 1e-4  # row bands whose blocks' scales differ from their neighbours'
    x[5, 17], x[300, 4000] = float("nan"), float("-inf")
    x = x.to(torch.bfloat16)
    block, scale_dtype, power_2, rounding = SCALINGS[scaling]
    block = block_shape_for(block, x.shape[1])
    q, s = reference.quantize_blockwise_ref(x, E4M3, block, scale_dtype, power_2, rounding)
    if columnwise:
        block_t = columnwise_block_shape(block, *x.shape)
        q_t, s_t = reference.quantize_blockwise_ref(x.t(), E4M3, block_t, scale_dtype, power_2, rounding)
    try:
        for isa in ISAS:
            _C.set_cpu_isa(isa)
            out = ops.quantize_blockwise_fused(x, E4M3, block, scale_dtype, power_2, columnwise=columnwise,
                                               e8m0_rounding=rounding)
            what = f"{isa} {scaling}"
            assert_bitwise_equal(out.data, q, f"{what} data", any_nan=True)
            assert_bitwise_equal(out.scale_inv, s, f"{what} scale_inv")
            if columnwise:
                assert_bitwise_equal(out.data_t, q_t, f"{what} data_t", any_nan=True)
                assert_bitwise_equal(out.scale_inv_t, s_t, f"{what} scale_inv_t")
    finally:
        _C.set_cpu_isa("auto")


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_one_layout(rowwise, columnwise):
    x = torch.randn(70, 300)
    out = ops.quantize_blockwise_fused(x, E4M3, (1, 128), rowwise=rowwise, columnwise=columnwise)
    both = ops.quantize_blockwise_fused(x, E4M3, (1, 128), columnwise=True)
    assert (out.data.numel() > 0) == rowwise and (out.data_t.numel() > 0) == columnwise
    kept = ("data", "scale_inv") if rowwise else ("data_t", "scale_inv_t")
    for name in kept:
        assert torch.equal(getattr(out, name).view(torch.uint8), getattr(both, name).view(torch.uint8))


def test_quantize_blockwise_signature():
    x = torch.randn(5, 200, dtype=torch.bfloat16)
    q, s = ops.quantize_blockwise(x, E5M2, (1, 128))
    q_ref, s_ref = reference.quantize_blockwise_ref(x, E5M2, (1, 128))
    assert s.shape == (5, 2) and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


# ---- scale rules (reference) --------------------------------------------------

AMAXES = torch.tensor([0.0, float("nan"), float("inf"), 1e-45, 3e-39, 1e-30, 0.5, 448.0, 449.0, 3e38, FLT_MAX])


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("power_2", [False, True])
def test_float32_scales_are_finite_positive_normal(fmt, power_2):
    scale = reference.block_scale(AMAXES, reference.fp8_max(fmt), power_2)
    assert torch.isfinite(scale).all() and (scale >= torch.finfo(torch.float32).tiny).all()
    assert torch.isfinite(torch.reciprocal(scale)).all() and (torch.reciprocal(scale) > 0).all()
    assert scale[0] == 1 and scale[1] == 1 and scale[2] == 1
    if power_2:
        assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(scale.double()))).float())


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_e8m0_ceil_never_saturates(fmt):
    limit = reference.fp8_max(fmt)
    amax = torch.cat([AMAXES, torch.rand(1000) * torch.exp2(torch.randint(-120, 120, (1000,)).float())])
    e = reference.e8m0_exponent(amax, limit, "ceil")
    assert ((e >= -127) & (e <= 127)).all()
    valid = (amax > 0) & torch.isfinite(amax)
    scaled = amax.double() * torch.exp2(-e.double())
    assert (scaled[valid] <= limit * (1 + 2**-23)).all()
    assert (scaled[valid & (e > -127)] > limit / 2 * (1 - 2**-23)).all()  # the smallest such exponent
    assert (e[~valid] == 0).all()


def test_e8m0_floor_rule():
    e = reference.e8m0_exponent(torch.tensor([448.0, 511.0, 512.0, 1.0]), 448.0, "floor")
    assert e.tolist() == [0, 0, 1, -8]  # floor(log2(amax)) - 8


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_quantize_blockwise_takes_the_e8m0_rounding(cpu_isa, fmt, rounding):
    check_e8m0_rounding(ops.quantize_blockwise, fmt, rounding)


# Our E8M0 rounding -> the torchao ScaleCalculationMode it matches (torchao's CEIL, 2^ceil(log2(amax)) / 2^emax,
# is neither: it rounds amax, not amax / fp8_max, up).
TORCHAO_MODES = {"ceil": "RCEIL", "floor": "FLOOR"}


@pytest.mark.parametrize("rounding", list(TORCHAO_MODES))
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_e8m0_roundings_match_torchao_scale_calculation_modes(fmt, in_dtype, rounding):
    """MXTensor.to_mx with the matching mode gives the same E8M0 scales and FP8 data, bit for bit, for
    blocks whose amax is positive and finite (the rule for an all-zero, NaN or inf block differs:
    README, "Non-finite inputs")."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    g = torch.Generator().manual_seed(0)
    # Blocks of 32 over 2^-40 .. 2^40, so scales reach both ends of the roundings' differences.
    magnitudes = torch.exp2(torch.randint(-40, 41, (64, 8), generator=g).float()).repeat_interleave(32, 1)
    x = (torch.randn(64, 256, generator=g) * magnitudes).to(in_dtype)
    mode = getattr(config.ScaleCalculationMode, TORCHAO_MODES[rounding])
    expected = mx_tensor.MXTensor.to_mx(x, fmt, 32, scaling_mode=mode)
    q, s = ops.quantize_blockwise(x, fmt, (1, 32), E8M0, e8m0_rounding=rounding)
    assert_bitwise_equal(q, expected.qdata, f"data vs torchao {mode}")
    assert_bitwise_equal(s, expected.scale.reshape(s.shape), f"scale vs torchao {mode}")


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0])
def test_nan_stays_nan(scale_dtype):
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    q, s = ops.quantize_blockwise(x, E4M3, (1, 32), scale_dtype)
    assert torch.isnan(q.float()[0, 3]) and torch.isfinite(q.float()[1]).all()
    assert torch.isfinite(reference.e8m0_to_float(s) if scale_dtype == E8M0 else s).all()


# ---- errors and op registration -----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"x": torch.randn(2, 3, 4)}, ValueError, "must be 2-D"),
        ({"block_shape": (0, 128)}, ValueError, "block_shape"),
        ({"block_shape": (128,)}, ValueError, "block_shape"),
        ({"scale_dtype": torch.float16}, TypeError, "scale_dtype"),
        ({"dtype": torch.float16}, TypeError, "dtype"),
        ({"x": torch.randn(4, 4).to(torch.int32)}, TypeError, "'x'"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = {"x": torch.randn(4, 64), "dtype": E4M3, "block_shape": (1, 32), "scale_dtype": torch.float32}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ops.quantize_blockwise(**args)


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0])
def test_opcheck(scale_dtype):
    x = torch.randn(40, 96)
    torch.library.opcheck(
        torch.ops.transformer_linear.quantize_blockwise.default,
        (x, E4M3, [1, 32], scale_dtype, True, True, True, False),
    )


def test_compiles_fullgraph():
    fn = torch.compile(lambda x: ops.quantize_blockwise(x, E4M3, (1, 128), torch.float32, True), fullgraph=True)
    x = torch.randn(8, 256)
    assert torch.equal(fn(x)[1], ops.quantize_blockwise(x, E4M3, (1, 128), torch.float32, True)[1])


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (recipe.Float8BlockScaling, {"x_block_scaling_dim": 3}, "x_block_scaling_dim"),
        (recipe.Float8BlockScaling, {"x_block_scaling_dim": 2, "grad_block_scaling_dim": 2}, "both be 2"),
        (recipe.Float8BlockScaling, {"power_2_scale": 1}, "power_2_scale"),
        (recipe.Float8BlockScaling, {"fp8_format": "E4M3"}, "fp8_format"),
        (recipe.MXFP8BlockScaling, {"fp8_format": None}, "fp8_format"),
        (recipe.Float8RowwiseScaling, {"power_2_scale": "yes"}, "power_2_scale"),
    ],
)
def test_recipe_validation(cls, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        cls(**kwargs)


def test_recipe_names():
    r = recipe.Float8BlockScaling()
    assert (r.x_block_shape, r.w_block_shape, r.grad_block_shape) == ((1, 128), (128, 128), (1, 128))
    assert r.power_2_scale and r.fp8_format is recipe.Format.E4M3
    assert recipe.MXFP8BlockScaling().block_shape == (1, 32)
    assert recipe.Float8CurrentScaling is recipe.CurrentScaling
