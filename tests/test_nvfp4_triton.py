"""The Triton NVFP4 kernels (quantize, GEMM), run on the CPU by Triton's interpreter.

As in test_blockwise_triton.py: TRITON_INTERPRET=1 must be set before triton is first imported, so a
normal run holds one test that runs this module again in a fresh interpreter with the variable set,
where the real tests are defined. The quantize is held bitwise to reference/nvfp4.py (and so to the
CPU kernel), the GEMM within tests/tolerances.py and to the CPU kernel's result within it too.
Shapes stay small (the interpreter runs each program in numpy) and include partial tiles.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreted import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    def test_triton_nvfp4_kernels_interpreted(tmp_path):
        run_interpreted(__file__, tmp_path)

else:
    from tolerances import assert_bitwise_equal, assert_nvfp4_gemm_close

    import transformer_linear.ops.triton as kernels
    from transformer_linear.ops import nvfp4 as ops
    from transformer_linear.reference import nvfp4 as ref

    OPTIONS = {
        "rowwise": dict(rowwise=True, columnwise=False),
        "both": dict(rowwise=True, columnwise=True),
        "columnwise": dict(rowwise=False, columnwise=True),
        "rht": dict(rowwise=True, columnwise=True, rht=True),
        "2d": dict(rowwise=True, columnwise=True, scaling_2d=True),
        "2d_columnwise": dict(rowwise=False, columnwise=True, scaling_2d=True),
        "sr": dict(rowwise=True, columnwise=True, stochastic_rounding=True, seed=1234, offset=5),
        "sr_rht": dict(rowwise=False, columnwise=True, rht=True, stochastic_rounding=True, seed=-7, offset=2**40),
        "sr_2d": dict(rowwise=True, columnwise=True, scaling_2d=True, stochastic_rounding=True, seed=2**62),
    }
    FIELDS = ("data", "scale", "global_scale", "data_t", "scale_t", "global_scale_t")

    def triton_quantize(x, amax, amax_t, options):
        o = {**dict(scaling_2d=False, rht=False, stochastic_rounding=False, seed=0, offset=0), **options}
        return kernels.quantize_nvfp4(
            x, amax, amax_t, o["rowwise"], o["columnwise"], o["scaling_2d"], o["rht"],
            o["stochastic_rounding"], o["seed"], o["offset"],
        )

    def assert_same_as_reference(x, amax, amax_t, options, what):
        got = triton_quantize(x, amax, amax_t, options)
        expected = ref.quantize_nvfp4(x, amax, amax_t, **options)
        for name, g, e in zip(FIELDS, got, expected):
            if e is None:
                assert g.numel() == 0 or name.startswith("global"), f"{what} {name}: a copy not asked for"
                continue
            g_bits = g.view(torch.uint8) if g.element_size() == 1 else g
            e_bits = e.view(torch.uint8) if e.element_size() == 1 else e
            assert_bitwise_equal(g_bits, e_bits, f"{what} {name}")

    def amaxes(x, options):
        return ops.nvfp4_amax(x), ops.nvfp4_amax(x, rht=options.get("rht", False))

    @pytest.mark.parametrize("option", sorted(OPTIONS))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("shape", [(16, 16), (32, 80), (48, 160), (0, 32)])
    def test_quantize_bitwise(shape, dtype, option):
        """Partial tiles: 80 and 160 columns are not multiples of the 128-column tile; 48 rows of 32."""
        torch.manual_seed(hash((shape, option)) % 2**31)
        x = (torch.randn(shape) * torch.rand(shape[0], 1) * 8).to(dtype)
        options = OPTIONS[option]
        amax, amax_t = amaxes(x, options)
        assert_same_as_reference(x, amax, amax_t, options, f"{shape} {dtype} {option}")

    @pytest.mark.parametrize("option", ["rowwise", "2d", "sr_2d"])
    def test_quantize_ragged_rows(option):
        """The rowwise copy takes any M (the last 16-row tile is partial)."""
        options = {**OPTIONS[option], "columnwise": False}
        x = torch.randn(37, 64)
        assert_same_as_reference(x, *amaxes(x, options), options, f"37x64 {option}")

    def test_quantize_columnwise_any_k():
        x = torch.randn(32, 19)
        assert_same_as_reference(x, *amaxes(x, OPTIONS["columnwise"]), OPTIONS["columnwise"], "32x19")

    @pytest.mark.parametrize("option", ["rowwise", "rht", "2d", "sr"])
    def test_quantize_special_values(option):
        """Zero blocks, NaN (NaN scale), +-inf (saturate), subnormal E4M3 scales, -0."""
        x = torch.randn(32, 64)
        x[0, :16] = 0.0
        x[1, 3] = float("nan")
        x[2, 5] = float("inf")
        x[3, 9] = -float("inf")
        x[4, 16:32] = 2e-4 * torch.linspace(-1, 1, 16)
        x[5, 0] = -1e-30
        amax = torch.tensor(10.0)
        assert_same_as_reference(x, amax, amax, OPTIONS[option], option)

    @pytest.mark.parametrize("amax", [0.0, 1e-45, 3.0])
    def test_quantize_global_scale_edges(amax):
        """amax 0 (s_enc 1), a tiny amax (s_enc FLT_MAX), a plain one."""
        x = torch.randn(16, 32) * 1e-3
        a = torch.tensor(amax)
        assert_same_as_reference(x, a, a, OPTIONS["both"], f"amax {amax}")

    def test_stochastic_rounding_depends_on_seed_and_offset():
        x = torch.randn(32, 64)
        amax = ops.nvfp4_amax(x)
        base = dict(rowwise=True, columnwise=False, stochastic_rounding=True)
        d0 = triton_quantize(x, amax, None, {**base, "seed": 1, "offset": 0})[0]
        d1 = triton_quantize(x, amax, None, {**base, "seed": 2, "offset": 0})[0]
        d2 = triton_quantize(x, amax, None, {**base, "seed": 1, "offset": 1})[0]
        assert not torch.equal(d0, d1) and not torch.equal(d0, d2)

    def operands(m, n, k, seed):
        torch.manual_seed(seed)
        a = torch.randn(m, k) * torch.rand(m, 1) * 4
        b = torch.randn(n, k) * torch.rand(1, k) * 2
        qa = ref.quantize_nvfp4(a, ops.nvfp4_amax(a))
        qb = ref.quantize_nvfp4(b, ops.nvfp4_amax(b))
        return qa, qb

    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("m, n, k", [(16, 16, 16), (7, 9, 48), (33, 20, 160), (5, 40, 64), (0, 8, 32), (4, 8, 0)])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_gemm(m, n, k, out_dtype, with_bias):
        qa, qb = operands(m, n, k, m * 100 + n + k)
        bias = torch.randn(n).to(out_dtype) if with_bias else None
        d = kernels.nvfp4_gemm(qa.data, qa.scale, qa.global_scale, qb.data, qb.scale, qb.global_scale,
                                  out_dtype, bias)
        assert d.shape == (m, n) and d.dtype == out_dtype
        one = torch.tensor(1.0)
        a_values = ref.dequantize_nvfp4(qa.data, qa.scale, one)
        b_values = ref.dequantize_nvfp4(qb.data, qb.scale, one)
        alpha = float(qa.global_scale) * float(qb.global_scale)
        assert_nvfp4_gemm_close(d, a_values, b_values, alpha, bias)
        cpu = ops.nvfp4_gemm(qa.data, qa.scale, qa.global_scale, qb.data, qb.scale, qb.global_scale, out_dtype, bias)
        assert_nvfp4_gemm_close(cpu, a_values, b_values, alpha, bias)

    def test_gemm_of_triton_quantized_operands_matches_the_cpu_ops():
        """Quantize with Triton, multiply with Triton; the CPU ops on the same input within tolerance."""
        x, w = torch.randn(24, 96), torch.randn(40, 96)
        qx = triton_quantize(x, ops.nvfp4_amax(x), None, OPTIONS["rowwise"])
        qw = triton_quantize(w, ops.nvfp4_amax(w), None, OPTIONS["rowwise"])
        d = kernels.nvfp4_gemm(qx[0], qx[1], qx[2], qw[0], qw[1], qw[2], torch.float32)
        expected = ref.nvfp4_gemm(qx[0].view(ref.FP4_DTYPE), qx[1], qx[2], qw[0].view(ref.FP4_DTYPE), qw[1], qw[2])
        one = torch.tensor(1.0)
        a_values = ref.dequantize_nvfp4(qx[0].view(ref.FP4_DTYPE), qx[1], one)
        b_values = ref.dequantize_nvfp4(qw[0].view(ref.FP4_DTYPE), qw[1], one)
        assert_nvfp4_gemm_close(d, a_values, b_values, float(qx[2]) * float(qw[2]))
        assert_nvfp4_gemm_close(expected, a_values, b_values, float(qx[2]) * float(qw[2]))
