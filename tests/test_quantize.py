"""Quantize-family kernels held bitwise to transformer_linear.reference.

Every case runs on each CPU instruction-set path (the portable one forced
with ``_C.set_cpu_isa("generic")`` and the best one) and on CUDA when present.
Exhaustive cases use one tensor of all 65,536 16-bit patterns per call.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpu_paths import QUANTIZE_ISAS
from tolerances import assert_bitwise_equal, assert_close_to_reference
from transformer_linear import _C, ops
from transformer_linear import reference as ref

FP8 = list(ref.FP8_DTYPES)
HP = list(ref.HIGH_PRECISION_DTYPES)
SCALES = [1.0, 0.5, 3.7, 2.0**-10, 2.0**10, 1e30]
ISAS = QUANTIZE_ISAS


@pytest.fixture(params=ISAS)
def isa(request, device):
    """Force one CPU code path for the test; CUDA runs once (its path is not chosen here)."""
    if device == "cuda" and request.param != ISAS[-1]:
        pytest.skip("the CPU instruction set does not apply to CUDA")
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def all_bit_patterns(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Every 16-bit pattern of ``dtype`` as a (256, 256) tensor."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).reshape(256, 256).to(device)


def all_fp8(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(device)


def scale_tensor(s: float, device: str) -> torch.Tensor:
    return torch.tensor([s], dtype=torch.float32, device=device)


def check_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, what: str, any_nan: bool = False) -> None:
    """Every output of one delayed-scaling pass (row-wise, transposed, amax) against the reference.

    ``any_nan`` lets an FP8 NaN of either sign match (see test_edge_values).
    """
    q_ref, scale_inv_ref = ref.quantize(x, scale, dtype)
    q, scale_inv = ops.quantize(x, scale, dtype)
    assert_bitwise_equal(q, q_ref, f"{what} data", any_nan=any_nan)
    assert_bitwise_equal(scale_inv, scale_inv_ref, f"{what} scale_inv")
    q, _, x_amax = ops.quantize_with_amax(x, scale, dtype)
    assert_bitwise_equal(q, q_ref, f"{what} data (with amax)", any_nan=any_nan)
    assert_bitwise_equal(x_amax, ref.amax(x), f"{what} amax", any_nan=True)
    if x.dim() >= 1:
        out = ops.quantize_fused(x, dtype, scale, columnwise=True)
        assert_bitwise_equal(out.data, q_ref, f"{what} data (fused)", any_nan=any_nan)
        assert_bitwise_equal(out.data_t, ref.transpose_2d(q_ref), f"{what} data_t", any_nan=any_nan)
        assert_bitwise_equal(out.amax, ref.amax(x), f"{what} amax (fused)", any_nan=True)
        only_t = ops.quantize_fused(x, dtype, scale, rowwise=False, columnwise=True)
        assert_bitwise_equal(only_t.data_t, ref.transpose_2d(q_ref), f"{what} data_t only", any_nan=any_nan)


def check_current(x: torch.Tensor, dtype: torch.dtype, margin: int, what: str) -> None:
    expected = ref.quantize_current(x, dtype, margin)
    got = ops.quantize_current(x, dtype, margin)
    for name, g, e in zip(("data", "scale_inv", "amax"), got, expected):
        assert_bitwise_equal(g, e, f"{what} {name}", any_nan=name != "data")


# ---------------------------------------------------------------------------
# Exhaustive: every bf16 / fp16 input, every fp8 code
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern(device, isa, in_dtype, dtype, scale):
    x = all_bit_patterns(in_dtype, device)
    check_quantize(x, scale_tensor(scale, device), dtype, f"{in_dtype} scale={scale}")


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern_current_scaling(device, isa, in_dtype, dtype, margin):
    x = all_bit_patterns(in_dtype, device).flatten()
    finite = x[torch.isfinite(x)]
    # The whole range (amax = the format's max) and the values below 1, where
    # the scale is large and every input subnormal reaches the fp8 grid.
    for part, what in ((finite, "finite"), (finite[finite.abs() < 1], "below 1"), (x, "with NaN")):
        check_current(part, dtype, margin, f"{in_dtype} {what} margin={margin}")
    assert_bitwise_equal(ops.amax(finite), ref.amax(finite), "amax of every finite value")


@pytest.mark.parametrize("scale", [1.0, 3.7, 2.0**-10, 1e30])
@pytest.mark.parametrize("out_dtype", HP)
@pytest.mark.parametrize("dtype", FP8)
def test_dequantize_every_fp8_code(device, isa, dtype, out_dtype, scale):
    q = all_fp8(dtype, device)
    s = scale_tensor(scale, device)
    assert_bitwise_equal(ops.dequantize(q, s, out_dtype), ref.dequantize(q, s, out_dtype), any_nan=True)


# ---------------------------------------------------------------------------
# Random fp32 of many shapes, edge values
# ---------------------------------------------------------------------------

# (1000, 300): the transposing path splits rows across threads mid-stripe.
SHAPES = [(), (1,), (7, 33), (3, 5, 17), (1000, 1), (130, 70), (2, 65, 129), (1000, 300), (70_001,)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", HP)
def test_random(device, isa, in_dtype, dtype, shape):
    # Magnitudes over many binades, so saturation and fp8 subnormals occur.
    x = (torch.randn(shape) * torch.exp2(torch.randint(-20, 12, shape).float())).to(in_dtype).to(device)
    check_quantize(x, scale_tensor(3.7, device), dtype, f"{shape}")
    for margin in (0, 3):
        check_current(x, dtype, margin, f"{shape} margin={margin}")
    q, scale_inv, _ = ops.quantize_current(x, dtype)
    assert_bitwise_equal(ops.dequantize(q, scale_inv, in_dtype), ref.dequantize(q, scale_inv, in_dtype))


@pytest.mark.parametrize("dtype", FP8)
def test_large_tensor_streaming_path(device, isa, dtype):
    """Outputs beyond the cache use non-temporal stores and an aligned head."""
    x = torch.randn(8 * 2**20 + 19, device=device)[3:]
    check_current(x, dtype, 0, "8M elements")


def edge_values(in_dtype: torch.dtype) -> torch.Tensor:
    f32 = [
        0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0**-126,  # fp32 subnormals and FLT_MIN
        2.0**-24, 2.0**-25, 6e-8, 2.0**-133,  # fp16 / bf16 subnormals
        2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-16, 2.0**-17, 3 * 2.0**-17, 2.0**-7,  # fp8 subnormals, halfway
        448.0, -448.0, 464.0, 480.0, 449.0, 57344.0, 61440.0, 57345.0, -65536.0,  # max, halfway, above
        1e38, -3.4e38, math.inf, -math.inf, math.nan, 1.5, 1.0625, 1.125,
    ]
    x = torch.tensor(f32, dtype=torch.float32)
    nan_bits = torch.tensor([0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF], dtype=torch.int64)
    x = torch.cat([x, nan_bits.to(torch.int32).view(torch.float32)])
    x = torch.cat([x, -x]).to(in_dtype)
    if in_dtype != torch.float32:  # negative NaN and signalling NaN patterns of the 16-bit type
        x = torch.cat([x, torch.tensor([-1, 0x7C01, 0x7F81], dtype=torch.int16).view(in_dtype)])
    return x


@pytest.mark.parametrize("scale", [1.0, 3.7, 2.0**-10, 2.0**10])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", HP)
def test_edge_values(device, isa, in_dtype, dtype, scale):
    x = edge_values(in_dtype).to(device)
    # torch's scalar fp16 -> fp32 conversion (small tensors) drops a NaN's
    # sign, its vector one keeps it, as the kernels do; the exhaustive fp16
    # test holds the NaN bits exactly.
    any_nan = in_dtype == torch.float16
    check_quantize(x, scale_tensor(scale, device), dtype, f"edge scale={scale}", any_nan=any_nan)
    finite = x[torch.isfinite(x)]
    check_current(finite, dtype, 0, "finite edge values")


@pytest.mark.parametrize("in_dtype", HP)
def test_amax_propagates_nan(device, isa, in_dtype):
    n = 300_001  # several threads' chunks and a vector tail
    for where in (0, 1, 17, n // 2, n - 1):
        for bad in (math.nan, -math.nan):
            x = torch.randn(n).to(in_dtype)
            x[where] = bad
            x = x.to(device)
            assert torch.isnan(ops.amax(x)), f"NaN at {where} lost"
            _, _, x_amax = ops.quantize_with_amax(x, scale_tensor(1.0, device), torch.float8_e4m3fn)
            assert torch.isnan(x_amax), f"NaN at {where} lost by the fused amax"
        x = torch.randn(n).to(in_dtype)
        x[where] = -math.inf
        assert ops.amax(x.to(device)).item() == math.inf


@pytest.mark.parametrize("shape", [(0,), (0, 16), (16, 0), (3, 0, 5)], ids=str)
@pytest.mark.parametrize("in_dtype", HP)
def test_empty(device, isa, in_dtype, shape):
    x = torch.empty(shape, dtype=in_dtype, device=device)
    dtype = torch.float8_e4m3fn
    assert_bitwise_equal(ops.amax(x), ref.amax(x))
    check_current(x, dtype, 0, "empty")
    out = ops.quantize_fused(x, dtype, scale_tensor(2.0, device), columnwise=True, dbias_dtype=in_dtype)
    cols = shape[-1]
    assert out.data.shape == x.shape and out.data.dtype == dtype
    assert out.data_t.shape == (cols, x.numel() // cols if cols else math.prod(shape[:-1]))
    assert_bitwise_equal(out.amax, torch.zeros((), device=device))
    assert_bitwise_equal(out.dbias, torch.zeros(cols, dtype=in_dtype, device=device))
    assert ops.dequantize(out.data, out.scale_inv, in_dtype).shape == x.shape


# ---------------------------------------------------------------------------
# Scale rules, bias gradient
# ---------------------------------------------------------------------------

AMAXES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 1e-39, 2.0**-126, 1.0, 448.0, 3.7, 3e38]


@pytest.mark.parametrize("margin", [0, 1, 3, 126])
@pytest.mark.parametrize("dtype", FP8)
def test_compute_scale_rules(device, isa, dtype, margin):
    for a in AMAXES:
        # A one-element tensor's amax is |a|; NaN and inf give the fallback 1.
        x = torch.tensor([a], dtype=torch.float32, device=device)
        check_current(x, dtype, margin, f"amax={a} margin={margin}")
        expected = ref.compute_scale(ref.amax(x), ref.fp8_max(dtype), margin, 1.0)
        _, scale_inv, _ = ops.quantize_current(x, dtype, margin)
        assert_bitwise_equal(scale_inv, torch.reciprocal(expected).reshape(1), f"scale for amax={a}")


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("shape", [(1, 5), (300, 70), (1000, 33), (4, 3, 260)], ids=str)
@pytest.mark.parametrize("dbias_dtype", HP)
@pytest.mark.parametrize("in_dtype", HP)
def test_dbias(device, isa, in_dtype, dbias_dtype, shape, scaling):
    """The bias gradient beside each scaling's pass (on the CPU: current scaling's amax pass adds the rows up,
    delayed scaling's cast does)."""
    x = torch.randn(shape).to(in_dtype).to(device)
    scale = scale_tensor(1.0, device) if scaling == "delayed" else None
    out = ops.quantize_fused(x, torch.float8_e5m2, scale, dbias_dtype=dbias_dtype)
    exact = x.double().reshape(-1, shape[-1]).sum(0)
    assert_close_to_reference(out.dbias, exact, baseline=ref.bias_grad(x, dbias_dtype), what="dbias")
    if device == "cpu":  # the CPU sums in the reference's order
        assert_bitwise_equal(out.dbias, ref.bias_grad(x, dbias_dtype), "dbias")
    if scaling == "delayed":
        q_ref, _ = ref.quantize(x, scale, torch.float8_e5m2)
    else:
        q_ref, _, _ = ref.quantize_current(x, torch.float8_e5m2, 0)
    assert_bitwise_equal(out.data, q_ref, "data beside dbias")


def test_dbias_bits_do_not_depend_on_the_pass_or_the_threads(isa, restore_torch_threads):
    """The column sums are fixed 256-row blocks added in order, whichever pass adds the rows up (current
    scaling's amax pass, delayed scaling's cast, a pass of their own beside the cast + transpose)."""
    x = torch.randn(1100, 70) * 3
    first = None
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for scale in (None, scale_tensor(1.0, "cpu")):
            for columnwise in (False, True):
                dbias = ops.quantize_fused(x, torch.float8_e5m2, scale, columnwise=columnwise,
                                           dbias_dtype=torch.float32).dbias
                first = dbias if first is None else first
                what = f"{threads} threads, {'delayed' if scale is not None else 'current'}, columnwise={columnwise}"
                assert_bitwise_equal(dbias, first, what)
