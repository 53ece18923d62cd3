"""The Triton block-scaling kernels, run on the CPU by Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton itself is imported (its standard
library is defined with @triton.jit at import), and other tests in a session
may import triton first (torch.compile does). So in a normal run this module
holds one test that runs the module again in a fresh interpreter with the
variable set, where the real tests below are defined; other tests never see
the variable. Shapes stay small: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreted import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    def test_triton_kernels_interpreted(tmp_path):
        run_interpreted(__file__, tmp_path)

else:
    from blockwise_cases import (
        E4M3,
        E5M2,
        FP8_FORMATS,
        GEMM_SCALINGS,
        MIXED_GEMM_SCALINGS,
        all_bit_patterns,
        block_operands,
        check_e8m0_rounding,
        check_quantize,
        dequantized_mm_fp32,
        special_blocks,
    )
    from tolerances import assert_close_to_reference

    import transformer_linear.ops.triton as kernels_module
    from transformer_linear import ops, reference

    @pytest.fixture
    def kernels():
        return kernels_module

    # Each block shape with each scale dtype, and rowwise.
    EXHAUSTIVE = ["1x128_pow2", "128x128_pow2", "1x32_e8m0", "128x128_e8m0", "rowwise"]


    @pytest.mark.parametrize("scaling", EXHAUSTIVE)
    @pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
    def test_quantize_every_bit_pattern(kernels, in_dtype, scaling):
        check_quantize(kernels.quantize_blockwise_fused, all_bit_patterns(in_dtype, False), E4M3, scaling)


    @pytest.mark.parametrize("scaling", ["1x128", "128x128_pow2", "1x32_e8m0", "1x32_e8m0_floor", "rowwise"])
    @pytest.mark.parametrize("fmt", FP8_FORMATS)
    def test_quantize_edge_zero_nan_inf_blocks(kernels, fmt, scaling):
        check_quantize(kernels.quantize_blockwise_fused, special_blocks(rows=40, cols=300), fmt, scaling)


    @pytest.mark.parametrize("rounding", ["ceil", "floor"])
    def test_quantize_blockwise_takes_the_e8m0_rounding(kernels, rounding):
        check_e8m0_rounding(kernels.quantize_blockwise, E4M3, rounding)


    def test_quantize_signature(kernels):
        x = torch.randn(3, 70)
        q, s = kernels.quantize_blockwise(x, E5M2, (1, 32), torch.float8_e8m0fnu)
        q_ref, s_ref = ops.quantize_blockwise(x, E5M2, (1, 32), torch.float8_e8m0fnu)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))


    @pytest.mark.parametrize("scaling", list(GEMM_SCALINGS))
    @pytest.mark.parametrize(
        "m, n, k, a_fmt, b_fmt, out_dtype",
        [
            (7, 9, 300, E4M3, E4M3, torch.float32),  # K not a multiple of the block
            (33, 20, 160, E4M3, E5M2, torch.bfloat16),
            (5, 40, 64, E5M2, E4M3, torch.float16),
        ],
    )
    def test_gemm(kernels, scaling, m, n, k, a_fmt, b_fmt, out_dtype):
        a, sa, b, sb = block_operands(m, n, k, a_fmt, b_fmt, scaling, spread=3)
        bias = torch.randn(n).to(out_dtype)
        d = kernels.fp8_gemm(a, sa, b, sb, out_dtype, bias)
        expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64, bias)
        baseline = dequantized_mm_fp32(a, sa, b, sb, out_dtype, bias)
        assert_close_to_reference(d, expected, baseline, what=f"triton {scaling} {m}x{n}x{k} -> {out_dtype}")


    @pytest.mark.parametrize("scaling", list(MIXED_GEMM_SCALINGS))
    def test_gemm_mixed_scalings(kernels, scaling):
        """Operands of different scalings (what ops.fp8_gemm runs on CUDA for pairs cuBLASLt lacks)."""
        a, sa, b, sb = block_operands(20, 24, 300, E4M3, E5M2, scaling, spread=3)
        bias = torch.randn(24)
        d = kernels.fp8_gemm(a, sa, b, sb, torch.float32, bias)
        expected = reference.fp8_gemm_blockwise(a, sa, b, sb, torch.float64, bias)
        baseline = dequantized_mm_fp32(a, sa, b, sb, torch.float32, bias)
        assert_close_to_reference(d, expected, baseline, what=f"triton {scaling}")

    def test_gemm_tensorwise_and_errors(kernels):
        a, sa, _ = reference.quantize_current(torch.randn(9, 50), E4M3)
        b, sb, _ = reference.quantize_current(torch.randn(6, 50), E4M3)
        d = kernels.fp8_gemm(a, sa, b, sb, torch.float32)
        assert_close_to_reference(d, reference.fp8_gemm(a, sa, b, sb, torch.float64), what="tensorwise")
        with pytest.raises(ValueError, match="unsupported scaling combination"):
            kernels.fp8_gemm(a, torch.ones(9, 1), b, torch.ones(6, 2).to(torch.float8_e8m0fnu), torch.float32)
