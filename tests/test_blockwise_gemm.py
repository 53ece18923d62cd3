"""Block-scaled FP8 GEMM (CPU kernel) against the float64 reference, torch's _scaled_mm, and its error cases."""

from __future__ import annotations

import pytest
import torch
from blockwise_cases import (
    E4M3,
    E5M2,
    E8M0,
    FP8_FORMATS,
    GEMM_SCALINGS,
    MIXED_GEMM_SCALINGS,
    block_operands,
    dequantized_mm_fp32,
)
from cpu_paths import SUPPORTED_ISAS
from large_outputs import large_output_rows
from tolerances import assert_bitwise_equal, assert_close_to_reference

from transformer_linear import _C, ops, reference
from transformer_linear.formats.block_scaling import resolve_gemm_scalings

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=SUPPORTED_ISAS)
def cpu_isa(request):
    """Every CPU path this machine runs (packing, micro-kernel and promotion differ)."""
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def check_gemm(a, sa, b, sb, out_dtype, bias=None, what=""):
    d = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias)
    expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64, bias)
    baseline = dequantized_mm_fp32(a, sa, b, sb, out_dtype, bias)
    assert_close_to_reference(d, expected, baseline, what=what)


@pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 9, 300), (130, 70, 257), (33, 50, 1300), (64, 200, 128)])
def test_shapes(cpu_isa, scaling, m, n, k):
    """Odd shapes: K not a multiple of the block, K past one cache chunk, edge tiles."""
    a, sa, b, sb = block_operands(m, n, k, E4M3, E4M3, scaling)
    check_gemm(a, sa, b, sb, torch.float32, what=f"{cpu_isa} {scaling} {m}x{n}x{k}")


@pytest.mark.parametrize("operand", ["a", "b"])
def test_one_scale_not_a_power_of_two_among_many_rows(cpu_isa, operand):
    """Power-of-two scales fold into the packed operands; one that is not, among the last rows of
    either operand, must send the whole GEMM to the promotion path."""
    a, sa, b, sb = block_operands(300, 260, 512, E4M3, E4M3, "1x128_x_1x128")
    scale = sa if operand == "a" else sb
    scale[-3, 2] *= 0.75
    check_gemm(a, sa, b, sb, torch.float32, what=f"{cpu_isa}, {operand}'s scale [-3, 2] not a power of two")


@pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
@pytest.mark.parametrize("a_fmt, b_fmt", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_formats_and_output_dtypes(scaling, a_fmt, b_fmt, out_dtype):
    # Magnitudes that keep float16 outputs finite.
    a, sa, b, sb = block_operands(45, 38, 200, a_fmt, b_fmt, scaling, power_2=False, spread=3)
    bias = torch.randn(38).to(out_dtype)
    check_gemm(a, sa, b, sb, out_dtype, bias, what=f"{scaling} {a_fmt} x {b_fmt} -> {out_dtype}")


@pytest.mark.parametrize("scaling", ["1x128_x_128x128", "1x32_x_1x32_e8m0"])
def test_column_major_operands(scaling):
    """wgrad/dgrad pass transposed views; the kernel reads them in place."""
    a, sa, b, sb = block_operands(50, 60, 300, E4M3, E5M2, scaling)
    check_gemm(a.t().contiguous().t(), sa, b.t().contiguous().t(), sb, torch.bfloat16, what="column-major")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["1x128_x_128x128", "1x32_x_1x32_e8m0", "rowwise"])
def test_large_outputs_match_row_blocks(cpu_isa, scaling, out_dtype):
    """An output large enough to be streamed has the bits of the same rows computed as small GEMMs
    (a's scales are per row, so its row blocks are GEMMs of their own); N = 2049 leaves the rows'
    ends off a cache line."""
    n, k = 2049, 300
    m = large_output_rows(n, out_dtype)
    a, sa, b, sb = block_operands(m, n, k, E4M3, E4M3, scaling)
    bias = torch.randn(n).to(out_dtype)
    d = ops.fp8_gemm(a, sa, b, sb, out_dtype, bias)
    parts = zip(a.split(256), sa.split(256))
    rows = torch.cat([ops.fp8_gemm(a_part, sa_part, b, sb, out_dtype, bias) for a_part, sa_part in parts])
    what = f"{cpu_isa} {scaling} {m}x{n}x{k} -> {out_dtype}"
    assert_bitwise_equal(d, rows, what=what)
    expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64, bias)
    assert_close_to_reference(d, expected, dequantized_mm_fp32(a, sa, b, sb, out_dtype, bias), what=what)


def test_empty_k_gives_bias():
    a, b = torch.empty(3, 0, dtype=E4M3), torch.empty(4, 0, dtype=E4M3)
    bias = torch.randn(4)
    d = ops.fp8_gemm(a, torch.ones(3, 0), b, torch.ones(1, 0), torch.float32, bias)
    assert torch.equal(d, bias.expand(3, 4))


@pytest.mark.parametrize("a_fmt", FP8_FORMATS)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_matches_torch_scaled_mm(scaling, a_fmt):
    """torch implements TensorWise and RowWise on the CPU: same operands, same scales."""
    m, n, k = 33, 47, 200
    a_hp, b_hp = torch.randn(m, k), torch.randn(n, k)
    if scaling == "tensorwise":
        a, sa, _ = reference.quantize_current(a_hp, a_fmt)
        b, sb, _ = reference.quantize_current(b_hp, E4M3)
        torch_sa, torch_sb = sa.reshape(()), sb.reshape(())
    else:
        a, sa = reference.quantize_blockwise_ref(a_hp, a_fmt, (1, k), torch.float32, True)
        b, sb = reference.quantize_blockwise_ref(b_hp, E4M3, (1, k), torch.float32, True)
        torch_sa, torch_sb = sa, sb.t()
    ours = ops.fp8_gemm(a, sa, b, sb, torch.float32)
    theirs = torch._scaled_mm(a, b.t(), scale_a=torch_sa, scale_b=torch_sb, out_dtype=torch.float32)
    expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64)
    assert_close_to_reference(ours, expected, theirs, what=f"{scaling} vs torch._scaled_mm")


@pytest.mark.parametrize(
    "a_scale, b_scale, match",
    [
        (torch.ones(8, 8).to(E8M0), torch.ones(1), "unsupported scaling combination"),  # MX x TensorWise
        (torch.ones(8, 1), torch.ones(16, 8).to(E8M0), "unsupported scaling combination"),  # RowWise x MX
        (torch.ones(8, 8).to(E8M0), torch.ones(16, 2), "unsupported scaling combination"),  # MX x 1x128
        (torch.ones(8, 3), torch.ones(16, 2), "matches no scaling|unsupported"),  # wrong shape
    ],
)
def test_inconsistent_scalings_are_errors(a_scale, b_scale, match):
    a, b = torch.zeros(8, 256, dtype=E4M3), torch.zeros(16, 256, dtype=E4M3)
    with pytest.raises(ValueError, match=match):
        ops.fp8_gemm(a, a_scale, b, b_scale, torch.float32)


def test_scale_dtype_is_a_type_error():
    a, b = torch.zeros(8, 256, dtype=E4M3), torch.zeros(16, 256, dtype=E4M3)
    with pytest.raises(TypeError, match="'a_scale_inv' must be torch.float32 or torch.float8_e8m0fnu"):
        ops.fp8_gemm(a, torch.ones(8, 2, dtype=torch.float16), b, torch.ones(16, 2), torch.float32)


def test_scaling_table():
    k, rows = 300, 5
    s = reference.scaling_types
    assert set(s(torch.ones(1), rows, k)) == {"TensorWise"}
    assert set(s(torch.ones(rows, 1), rows, k)) == {"RowWise"}
    assert set(s(torch.ones(rows, 3), rows, k)) == {"BlockWise1x128"}
    assert set(s(torch.ones(1, 3), rows, k)) == {"BlockWise128x128"}
    assert set(s(torch.ones(rows, 10).to(E8M0), rows, k)) == {"BlockWise1x32"}
    assert ("BlockWise1x128", "BlockWise128x128") in ops.fp8_gemm_scalings()


@pytest.mark.parametrize("scaling", list(MIXED_GEMM_SCALINGS))
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 9, 300), (130, 70, 257), (33, 150, 128)])
def test_mixed_scalings(cpu_isa, scaling, m, n, k):
    """Operands of different scalings (a recipe whose roles differ: tensorwise activations, 128x128
    weights, rowwise gradients): each K-block's partial sum is promoted with both operands' scales."""
    a, sa, b, sb = block_operands(m, n, k, E4M3, E5M2, scaling)
    bias = torch.randn(n)
    check_gemm(a, sa, b, sb, torch.float32, bias, what=f"{cpu_isa} {scaling} {m}x{n}x{k}")
    if min(m, n) > 1 and k > 128:  # where no other pair's shapes fit too
        resolved = resolve_gemm_scalings(a, sa, b, sb)
        assert (resolved.a_scaling, resolved.b_scaling) == MIXED_GEMM_SCALINGS[scaling][2]


@pytest.mark.parametrize("scaling", list(MIXED_GEMM_SCALINGS))
def test_mixed_scalings_accumulate_and_column_major(scaling):
    """wgrad's column-major views and fp8_gemm_accumulate_ (fuse_wgrad_accumulation) take the mixed pairs."""
    a, sa, b, sb = block_operands(40, 24, 300, E4M3, E4M3, scaling)
    check_gemm(a.t().contiguous().t(), sa, b.t().contiguous().t(), sb, torch.bfloat16, what=f"{scaling} column-major")
    out = torch.randn(40, 24)
    expected = out.double() + reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64)
    ops.fp8_gemm_accumulate_(a, sa, b, sb, out)
    assert_close_to_reference(out, expected, what=f"{scaling} accumulate")


def test_existing_pairs_resolve_as_before():
    """The mixed pairs come after scaled_mm's: a shape that fits both keeps its earlier resolution."""
    pairs = ops.fp8_gemm_scalings()
    assert pairs[:6] == (
        ("TensorWise", "TensorWise"),
        ("RowWise", "RowWise"),
        ("BlockWise1x128", "BlockWise128x128"),
        ("BlockWise128x128", "BlockWise1x128"),
        ("BlockWise1x128", "BlockWise1x128"),
        ("BlockWise1x32", "BlockWise1x32"),
    )
    assert {tuple(v[2]) for v in MIXED_GEMM_SCALINGS.values()} == set(pairs[6:])
    # 1-element scales of a (1, 64) and a (3, 64) operand: TensorWise both, not TensorWise x RowWise.
    a, b = torch.zeros(1, 64, dtype=E4M3), torch.zeros(3, 64, dtype=E4M3)
    resolved = resolve_gemm_scalings(a, torch.ones(1, 1), b, torch.ones(1))
    assert resolved.tensorwise


@pytest.mark.parametrize("scaling", ["1x128_x_128x128", "1x32_x_1x32_e8m0"])
def test_opcheck(scaling):
    a, sa, b, sb = block_operands(20, 24, 160, E4M3, E4M3, scaling)
    a_scaling, a_block, b_scaling, b_block = ops.resolve_gemm_scalings(a, sa, b, sb)
    # test_schema compares inputs with arithmetic that FP8 tensors lack; the kernel's
    # inputs are read-only views (checked by test_operands_unchanged).
    torch.library.opcheck(
        torch.ops.transformer_linear.fp8_gemm_blockwise.default,
        (a, sa, b, sb, torch.bfloat16, None, list(a_block), list(b_block), a_scaling, b_scaling),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_operands_unchanged():
    a, sa, b, sb = block_operands(20, 24, 160, E4M3, E4M3, "1x32_x_1x32_e8m0")
    before = [t.clone() for t in (a, sa, b, sb)]
    ops.fp8_gemm(a, sa, b, sb, torch.float32)
    for t, u in zip((a, sa, b, sb), before):
        assert torch.equal(t.view(torch.uint8), u.view(torch.uint8))


# ---- accumulating GEMM (fused wgrad accumulation under the block recipes) ----


@pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(7, 9, 300), (130, 70, 257)])
def test_accumulate(cpu_isa, scaling, out_dtype, m, n, k):
    """out += a @ b.T: the sum is rounded once, like the reference's float64 sum of both."""
    a, sa, b, sb = block_operands(m, n, k, E4M3, E5M2, scaling, spread=3)
    out0 = (torch.randn(m, n) * 100).to(out_dtype)
    out = out0.clone()
    ops.fp8_gemm_accumulate_(a, sa, b, sb, out)
    expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64) + out0.double()
    baseline = (dequantized_mm_fp32(a, sa, b, sb, torch.float32) + out0.float()).to(out_dtype)
    assert_close_to_reference(out, expected, baseline, what=f"{cpu_isa} {scaling} accumulate -> {out_dtype}")


def test_accumulate_equals_gemm_plus_out():
    """Into float32: the same fp32 total as fp8_gemm's, added to out in float32."""
    a, sa, b, sb = block_operands(40, 50, 384, E4M3, E4M3, "1x128_x_128x128")
    out0 = torch.randn(40, 50)
    out = out0.clone()
    ops.fp8_gemm_accumulate_(a, sa, b, sb, out)
    assert torch.equal(out, out0 + ops.fp8_gemm(a, sa, b, sb, torch.float32))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda a, sa, b, sb: (a, sa, b, sb, torch.empty(3, 3)), ValueError, "'d'"),
        (lambda a, sa, b, sb: (a, sa, b, sb, torch.empty(20, 24, dtype=torch.int32)), TypeError, "'d'"),
        (lambda a, sa, b, sb: (a, sa, b, sb, torch.empty(24, 20).t()), ValueError, "'d'"),
        (lambda a, sa, b, sb: (a, sa, b, sb, "out"), TypeError, "'out'"),
    ],
    ids=["shape", "dtype", "layout", "not-a-tensor"],
)
def test_accumulate_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        ops.fp8_gemm_accumulate_(*make(*block_operands(20, 24, 160, E4M3, E4M3, "1x128_x_1x128")))


def test_accumulate_opcheck():
    a, sa, b, sb = block_operands(20, 24, 160, E4M3, E4M3, "1x32_x_1x32_e8m0")
    a_scaling, a_block, b_scaling, b_block = ops.resolve_gemm_scalings(a, sa, b, sb)
    torch.library.opcheck(
        torch.ops.transformer_linear.fp8_gemm_blockwise_accumulate.default,
        (a, sa, b, sb, torch.randn(20, 24), list(a_block), list(b_block), a_scaling, b_scaling),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
