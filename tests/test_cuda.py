"""CUDA-specific behaviour: streams, CUDA graphs, the cuBLASLt / fallback GEMM
split, vector and scalar kernel paths, and the CPU-only build's fallback.

The kernel-vs-reference tests of every op run on CUDA through the ``device``
fixture of conftest.py; this file covers what only the GPU path has. Its GPU
tests skip without a GPU and a CUDA build. The fallback used when a CPU-only
build meets CUDA tensors is plain torch, so its numerics are checked here on
CPU tensors too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tolerances import assert_bitwise_equal, assert_close_to_reference
from transformer_linear import _C, _cuda_fallback, ops, reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HAS_GPU = torch.cuda.is_available()
HAS_CUDA_KERNELS = HAS_GPU and _C.built_with_cuda()



def fp8_operand(rows: int, cols: int, fmt: torch.dtype, device: str, column_major: bool = False) -> torch.Tensor:
    """(rows, cols) FP8 matrix; column_major gives the transposed view of a contiguous (cols, rows)."""
    if column_major:
        return (torch.randn(cols, rows, device=device) * 4).to(fmt).t()
    return (torch.randn(rows, cols, device=device) * 4).to(fmt)


def gemm_baseline(a, sa, b, sb, out_dtype, bias=None, accumulate_into=None, fast_accum=False) -> torch.Tensor:
    """Plain PyTorch at the kernel's precision, fp32 epilogue.

    On FP8 tensor cores (what cuBLASLt runs) that is ``torch._scaled_mm``:
    their accumulation is not fp32-exact, even without fast accumulation.
    Elsewhere it is an fp32 mm of the decoded operands.
    """
    if _cuda_fallback._scaled_mm_applies(a, b):
        out = torch._scaled_mm(a, b.t(), sa.reshape(()), sb.reshape(()), out_dtype=torch.float32,
                               use_fast_accum=fast_accum)
    else:
        out = (a.float() @ b.float().t()) * (sa.float() * sb.float())
    if bias is not None:
        out = out + bias.float()
    if accumulate_into is not None:
        out = out + accumulate_into.float()
    return out.to(out_dtype)


def check_gemm(d, a, sa, b, sb, out_dtype, bias=None, accumulate_into=None, fast_accum=False, what=""):
    expected = reference.fp8_gemm(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float64,
                                  None if bias is None else bias.cpu(),
                                  None if accumulate_into is None else accumulate_into.cpu())
    baseline = gemm_baseline(a, sa, b, sb, out_dtype, bias, accumulate_into, fast_accum)
    assert_close_to_reference(d.cpu(), expected, baseline.cpu(), what=what)


def scales(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([0.5], device=device), torch.tensor([0.25], device=device))


# ---------------------------------------------------------------------------
# The fallback of a CPU-only build (plain torch: checked on any device)
# ---------------------------------------------------------------------------


def test_fallback_is_inactive_for_cpu_tensors():
    assert not _cuda_fallback.active(torch.ones(2))


@pytest.mark.parametrize("scale", [None, 64.0], ids=["current", "delayed"])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dbias_dtype", [None, torch.bfloat16])
def test_fallback_quantize_matches_the_op(scale, rowwise, columnwise, dbias_dtype):
    x = torch.randn(48, 40, dtype=torch.bfloat16) * 3
    s = None if scale is None else torch.tensor([scale])
    got = _cuda_fallback.quantize(x, s, E4M3, 0, rowwise, columnwise, dbias_dtype)
    want = ops.quantize_fused(x, E4M3, s, rowwise=rowwise, columnwise=columnwise, dbias_dtype=dbias_dtype)
    for name, g, w in zip(want._fields, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name == "dbias":
            assert_close_to_reference(g, w.double(), what=name)
        else:
            assert_bitwise_equal(g, w, what=name)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fallback_gemm_and_accumulate(out_dtype):
    a, b = fp8_operand(24, 40, E4M3, "cpu"), fp8_operand(16, 40, E5M2, "cpu")
    sa, sb = scales("cpu")
    bias = torch.randn(16, dtype=out_dtype)
    d = _cuda_fallback.fp8_gemm(a, sa, b, sb, out_dtype, bias, True)
    check_gemm(d, a, sa, b, sb, out_dtype, bias, what="fallback gemm")
    acc = torch.randn(24, 16)
    before = acc.clone()
    _cuda_fallback.fp8_gemm_accumulate_(a, sa, b, sb, acc)
    check_gemm(acc, a, sa, b, sb, torch.float32, accumulate_into=before, what="fallback accumulate")


@pytest.mark.skipif(not HAS_GPU or _C.built_with_cuda(), reason="needs a GPU and a CPU-only build")
def test_cpu_only_build_warns_once_and_works_on_cuda_tensors(monkeypatch):
    monkeypatch.setattr(_cuda_fallback, "_warned", False)
    x = torch.randn(64, 32, device="cuda")
    with pytest.warns(UserWarning, match="TL_CUDA=1"):
        q, scale_inv, x_amax = ops.quantize_current(x, E4M3)
    q_ref, scale_inv_ref, amax_ref = reference.quantize_current(x, E4M3)
    assert_bitwise_equal(q, q_ref)
    assert_bitwise_equal(scale_inv, scale_inv_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = ops.fp8_gemm(q, scale_inv, q, scale_inv, torch.bfloat16)
    check_gemm(d, q, scale_inv, q, scale_inv, torch.bfloat16)


# ---------------------------------------------------------------------------
# CUDA kernels
# ---------------------------------------------------------------------------

GEMM_SHAPES = [(64, 128, 256), (256, 48, 512), (33, 17, 45), (1, 64, 16), (96, 80, 0)]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and a CUDA build")
class TestCudaKernels:
    @pytest.mark.parametrize(
        "shape,offset",
        [((256, 512), 0), ((256, 512), 3), ((1000, 24), 0), ((33, 45), 0), ((7,), 0), ((3, 5, 16), 1)],
        ids=["vector", "misaligned", "tall", "odd", "1d", "3d-misaligned"],
    )
    @pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("fmt", [E4M3, E5M2])
    def test_vector_and_scalar_paths_are_bitwise(self, shape, offset, in_dtype, fmt):
        """Aligned tensors take the vector path; offset views and odd sizes the scalar one."""
        n = torch.Size(shape).numel()
        base = torch.randn(n + offset, device="cuda") * 200
        base[offset] = 6e4  # saturates both formats at scale 3
        x = base.to(in_dtype)[offset:].view(shape)
        scale = torch.tensor([3.0], device="cuda")
        out = ops.quantize_fused(x, fmt, scale, columnwise=True, dbias_dtype=torch.bfloat16)
        q_ref, scale_inv_ref = reference.quantize(x, scale, fmt)
        assert_bitwise_equal(out.data, q_ref, what="data")
        assert_bitwise_equal(out.data_t, reference.transpose_2d(q_ref), what="data_t")
        assert_bitwise_equal(out.scale_inv, scale_inv_ref, what="scale_inv")
        assert_bitwise_equal(out.amax, reference.amax(x), what="amax")
        dbias_ref = x.reshape(-1, x.shape[-1]).double().sum(0)
        assert_close_to_reference(out.dbias, dbias_ref, reference.bias_grad(x, torch.bfloat16), what="dbias")
        assert_bitwise_equal(ops.dequantize(out.data, out.scale_inv, in_dtype),
                             reference.dequantize(q_ref, scale_inv_ref, in_dtype), what="dequantize")

    def test_amax_propagates_nan_through_the_atomic_max(self):
        x = torch.randn(1 << 20, device="cuda")
        x[12345] = float("nan")
        x[5] = float("inf")
        assert torch.isnan(ops.amax(x))
        _, scale_inv, x_amax = ops.quantize_current(x, E4M3)
        assert torch.isnan(x_amax)
        assert_bitwise_equal(scale_inv, torch.ones(1, device="cuda"), what="scale 1 for a NaN amax")

    def test_ops_launch_on_the_current_stream(self):
        """The side stream is busy when the input is written: an op on any other stream reads stale data."""
        src = torch.randn(512, 1024, device="cuda") * 5
        x = torch.zeros_like(src)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            x.copy_(src)
            q, scale_inv, x_amax = ops.quantize_current(x, E4M3)
            d = ops.fp8_gemm(q, scale_inv, q, scale_inv, torch.float32, use_split_accumulator=True)
        side.synchronize()
        q_ref, scale_inv_ref, amax_ref = reference.quantize_current(src, E4M3)
        assert_bitwise_equal(q, q_ref)
        assert_bitwise_equal(x_amax, amax_ref)
        check_gemm(d, q_ref, scale_inv_ref, q_ref, scale_inv_ref, torch.float32)

    def test_hot_path_never_synchronizes(self):
        x = torch.randn(256, 512, device="cuda")
        w = torch.randn(128, 512, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            qx, sx, _ = ops.quantize_current(x, E4M3)
            qw, sw, _ = ops.quantize_current(w, E4M3)
            out = ops.quantize_fused(x, E5M2, columnwise=True, dbias_dtype=torch.float32)
            ops.fp8_gemm(qx, sx, qw, sw, torch.bfloat16)
            ops.dequantize(out.data, out.scale_inv, torch.float32)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def test_quantize_and_gemm_capture_in_a_cuda_graph(self):
        x = torch.randn(128, 256, device="cuda")
        w = torch.randn(64, 256, device="cuda")
        bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)

        def step():
            qx, sx, _ = ops.quantize_current(x, E4M3)
            qw, sw, _ = ops.quantize_current(w, E4M3)
            return ops.fp8_gemm(qx, sx, qw, sw, torch.bfloat16, bias)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: cuBLASLt handle and heuristic cache outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        x.copy_(torch.randn_like(x) * 7)  # a new input: the replay must recompute the scale on the device
        graph.replay()
        torch.cuda.synchronize()
        qx, sx, _ = reference.quantize_current(x, E4M3)
        qw, sw, _ = reference.quantize_current(w, E4M3)
        check_gemm(captured, qx, sx, qw, sw, torch.bfloat16, bias, what="graph replay")

    @pytest.mark.parametrize("m,n,k", GEMM_SHAPES, ids=lambda v: str(v))
    @pytest.mark.parametrize("fmt_a,fmt_b", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)])
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_cublaslt_and_fallback_paths_match_the_reference(self, m, n, k, fmt_a, fmt_b, out_dtype):
        """Row-major aligned operands may take cuBLASLt; column-major views of the same values,
        odd sizes, K == 0 and e5m2 x e5m2 take the tiled kernel. Both paths must hold."""
        sa, sb = scales("cuda")
        bias = torch.randn(n, device="cuda", dtype=out_dtype)
        a, b = fp8_operand(m, k, fmt_a, "cuda"), fp8_operand(n, k, fmt_b, "cuda")
        layouts = {"row-major": (a, b), "column-major": (a.t().contiguous().t(), b.t().contiguous().t())}
        for layout, (a_l, b_l) in layouts.items():
            d = ops.fp8_gemm(a_l, sa, b_l, sb, out_dtype, bias, use_split_accumulator=True)
            check_gemm(d, a, sa, b, sb, out_dtype, bias, what=layout)
            acc = torch.randn(m, n, device="cuda")
            before = acc.clone()
            ops.fp8_gemm_accumulate_(a_l, sa, b_l, sb, acc)
            check_gemm(acc, a, sa, b, sb, torch.float32, accumulate_into=before, what=f"{layout} accumulate")

    def test_fast_accumulation_stays_close(self):
        """The forward GEMM's fast accumulation, bf16 output: within the budget."""
        a, b = fp8_operand(256, 1024, E4M3, "cuda"), fp8_operand(256, 1024, E4M3, "cuda")
        sa, sb = scales("cuda")
        d = ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, use_split_accumulator=False)
        check_gemm(d, a, sa, b, sb, torch.bfloat16, fast_accum=True)
