"""NVFP4 on CUDA: the ops' CUDA kernels (Triton quantize; cuBLASLt's NVFP4 matmul or the Triton GEMM),
the routing decision and the scale layout cuBLASLt reads, and tl.Linear end to end on a GPU.

The decision and the layout are plain Python and torch, checked here on the CPU with fake capabilities
and versions. The GPU tests (marked ``cuda``) skip without a GPU and a CUDA build: on a GPU the quantize
must equal the CPU kernel bit for bit (same stochastic-rounding bits for the same seed), the GEMM stay
within tests/tolerances.py of the float64 product, and the Linear's outputs and gradients match the
CPU's (the same quantized operands; only the float32 accumulation order of the GEMMs differs).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise_equal, assert_nvfp4_gemm_close, relative_error

import transformer_linear as tl
from transformer_linear import _C, recipe
from transformer_linear.ops import gemm_block_cuda, nvfp4_cuda
from transformer_linear.ops import nvfp4 as ops
from transformer_linear.reference import nvfp4 as ref

HAS_CUDA_KERNELS = torch.cuda.is_available() and _C.built_with_cuda()
BUILD = {"runtime_version": 13000, "driver_version": 13000, "archs": "80,90-real,100-real"}


def build(header: int, library: int, **overrides) -> dict:
    return {**BUILD, "cublas_header_version": header, "cublaslt_version": library, **overrides}


@pytest.mark.parametrize(
    "capability,info,expected",
    [
        ((10, 0), build(120800, 120800), True),  # B200, cuBLAS 12.8
        ((10, 3), build(130100, 131000), True),
        ((12, 0), build(120900, 120900, archs="80,90-real"), True),  # PTX serves sm_120
        ((9, 0), build(130100, 130100), False),  # Hopper has no FP4 tensor cores
        ((10, 0), build(120700, 120900), False),  # headers older than 12.8
        ((10, 0), build(120900, 120700), False),  # an older libcublasLt loaded
        ((10, 0), None, False),  # a CPU-only build
        ((10, 0), build(130100, 130100, driver_version=12080), False),  # driver too old for the runtime
        ((10, 0), {**BUILD}, False),  # a build that reports no cuBLAS version
    ],
)
def test_cublaslt_nvfp4_decision(capability, info, expected):
    assert nvfp4_cuda.cublaslt_nvfp4_applies(capability, info) is expected


@pytest.mark.parametrize(
    "m,n,k,fits",
    [(128, 128, 128, True), (1, 16, 32, True), (7, 48, 96, True), (128, 128, 48, False), (128, 8, 64, False),
     (16, 16, 0, False)],
)
def test_cublaslt_nvfp4_operand_rules(m, n, k, fits):
    assert nvfp4_cuda.cublaslt_nvfp4_operands_fit(m, n, k) is fits


@pytest.mark.parametrize("rows,k_blocks", [(1, 1), (128, 4), (130, 5), (300, 7)])
def test_cublaslt_nvfp4_scales_are_128x4_tiles(rows, k_blocks):
    """VEC16_UE4M3 scales: E4M3 bits in the same 128x4 tiles as MXFP8's E8M0 scales (cuBLASLt's docs,
    "1D block scaling factors layout"), element (r, c) at tile * 512 + 16 * (r % 32) + 4 * (r % 128 // 32)
    + c % 4."""
    bits = torch.randint(0, 0x7E, (rows, k_blocks), dtype=torch.uint8)
    ours = nvfp4_cuda.cublaslt_nvfp4_scale(bits.view(torch.float8_e4m3fn))
    assert ours.dtype == torch.uint8 and ours.numel() == (-(-rows // 128) * 128) * (-(-k_blocks // 4) * 4)
    assert_bitwise_equal(ours, gemm_block_cuda.cublaslt_scale(bits.view(torch.float8_e8m0fnu), "BlockWise1x32", rows))
    tile_cols = -(-k_blocks // 4)
    for r, c in [(0, 0), (rows - 1, k_blocks - 1), (rows // 2, k_blocks // 2)]:
        offset = ((r // 128) * tile_cols + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
        assert int(ours[offset]) == int(bits[r, c]), (r, c)


@pytest.mark.parametrize("name", ["quantize_nvfp4", "nvfp4_gemm"])
def test_nvfp4_ops_have_a_cpu_and_a_cuda_kernel(name):
    qualified = f"transformer_linear::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")


@pytest.mark.skipif(_C.built_with_cuda(), reason="a CPU-only build's binding")
def test_cpu_only_build_has_no_cublaslt_nvfp4_matmul():
    with pytest.raises(TypeError, match="no CUDA kernels"):
        _C.nvfp4_gemm_cublaslt(None, None, None, None, None, None, 0)


# ---------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------

OPTIONS = {
    "rowwise": dict(),
    "rht": dict(columnwise=True, rht=True),
    "2d": dict(columnwise=True, scaling_2d=True),
    "sr_rht": dict(columnwise=True, rht=True, stochastic_rounding=True, seed=-7, offset=2**40),
}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and a CUDA build")
class TestNVFP4OnGPU:
    @pytest.mark.parametrize("option", sorted(OPTIONS))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("shape", [(256, 512), (48, 160), (1040, 272)], ids=str)
    def test_quantize_equals_the_cpu_kernel(self, shape, dtype, option):
        x = (torch.randn(shape) * 4).to(dtype)
        options = OPTIONS[option]
        amax, amax_t = ops.nvfp4_amax(x), ops.nvfp4_amax(x, rht=options.get("rht", False))
        cpu = ops.quantize_nvfp4(x, amax, amax_t, **options)
        gpu = ops.quantize_nvfp4(x.cuda(), amax.cuda(), amax_t.cuda(), **options)
        for field, c, g in zip(cpu._fields, cpu, gpu):
            if c is not None:
                c_bits = c.view(torch.uint8) if c.element_size() == 1 else c
                g_bits = g.view(torch.uint8) if g.element_size() == 1 else g
                assert_bitwise_equal(g_bits.cpu(), c_bits, f"{shape} {option} {field}")

    @pytest.mark.parametrize("m,n,k", [(256, 512, 1024), (136, 256, 384), (1001, 256, 512), (33, 40, 48)], ids=str)
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
    def test_gemm_within_tolerance_on_the_decided_path(self, m, n, k, out_dtype, with_bias):
        a, b = torch.randn(m, k) * 3, torch.randn(n, k)
        qa, qb = ref.quantize_nvfp4(a, a.abs().amax()), ref.quantize_nvfp4(b, b.abs().amax())
        bias = torch.randn(n).to(out_dtype) if with_bias else None
        args = [t.cuda() for t in (qa.data, qa.scale, qa.global_scale, qb.data, qb.scale, qb.global_scale)]
        d = ops.nvfp4_gemm(*args, out_dtype, None if bias is None else bias.cuda())
        one = torch.tensor(1.0)
        a_values, b_values = ref.dequantize_nvfp4(qa.data, qa.scale, one), ref.dequantize_nvfp4(qb.data, qb.scale, one)
        alpha = float(qa.global_scale) * float(qb.global_scale)
        assert_nvfp4_gemm_close(d.cpu(), a_values, b_values, alpha, bias)
        lt = nvfp4_cuda.nvfp4_gemm_cublaslt(*args, out_dtype, None if bias is None else bias.cuda())
        expect_lt = nvfp4_cuda.cublaslt_nvfp4_applies(
            torch.cuda.get_device_capability(), _C.cuda_build_info()
        ) and nvfp4_cuda.cublaslt_nvfp4_operands_fit(m, n, k)
        # Strict: where the decision says cuBLASLt, its declining is a finding about the decision.
        assert (lt is not None) == expect_lt
        if lt is not None:
            assert_nvfp4_gemm_close(lt.cpu(), a_values, b_values, alpha, bias)

    @pytest.mark.parametrize("variant", ["nvfp4", "no_sr"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_linear_fwd_bwd_matches_the_cpu(self, variant, dtype):
        r = recipe.from_name("nvfp4") if variant == "nvfp4" else recipe.NVFP4BlockScaling(
            disable_stochastic_rounding=True)
        torch.manual_seed(0)
        cpu_layer = tl.Linear(256, 128, recipe=r)
        gpu_layer = tl.Linear(256, 128, recipe=r, device="cuda")
        gpu_layer.load_state_dict(cpu_layer.state_dict())
        x, dy = torch.randn(64, 256).to(dtype), torch.randn(64, 128).to(dtype)
        results = []
        for layer, device in ((cpu_layer, "cpu"), (gpu_layer, "cuda")):
            xi = x.to(device).requires_grad_()
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                out = layer(xi)
            torch.manual_seed(1234)  # the same stochastic-rounding seed on both devices
            out.backward(dy.to(device))
            results.append([t.detach().float().cpu() for t in (out, xi.grad, layer.weight.grad, layer.bias.grad)])
        bound = 1e-5 if dtype == torch.float32 else 1e-2  # accumulation order (and bf16 rounding of it) only
        for name, c, g in zip(("out", "dx", "dW", "db"), *results):
            err = relative_error(g, c)
            assert err <= bound, f"{variant} {dtype} {name}: relative error {err:.3e} GPU vs CPU"

    @pytest.mark.parametrize("option", ["rowwise", "rht", "2d"])
    def test_opcheck_cuda_kernels(self, option):
        o = {"rowwise": True, "columnwise": False, "scaling_2d": False, "rht": False, **OPTIONS[option]}
        x = torch.randn(64, 96, device="cuda")
        amax, amax_t = ops.nvfp4_amax(x), ops.nvfp4_amax(x, rht=o["rht"])
        args = (x, amax, amax_t, o["rowwise"], o["columnwise"], o["scaling_2d"], o["rht"], False, 0, 0)
        torch.library.opcheck(torch.ops.transformer_linear.quantize_nvfp4.default, args)
        q = ops.quantize_nvfp4(x, amax)
        gemm_args = (q.data.view(torch.uint8), q.scale, q.global_scale, q.data.view(torch.uint8), q.scale,
                     q.global_scale, torch.bfloat16, None)
        torch.library.opcheck(torch.ops.transformer_linear.nvfp4_gemm.default, gemm_args)

    def test_linear_compiles_on_gpu(self):
        torch.manual_seed(0)
        layer = tl.Linear(128, 64, recipe=recipe.from_name("nvfp4"), device="cuda")
        x = torch.randn(32, 128, device="cuda")
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
        assert_bitwise_equal(compiled.cpu(), eager.cpu(), "compiled vs eager (forward: no stochastic rounding)")
