"""cuBLASLt's grouped matmul as the tensorwise grouped FP8 GEMM on CUDA (csrc/cuda/gemm_grouped_cuda.cpp):
against the float64 oracle (reference.grouped) with each routing, output dtype and the bias; taken exactly
where the build, the loaded cuBLASLt (13.10+) and the GPU (sm_89+) have it, the Triton kernel otherwise; no
host read of offs. In a CPU-only build the binding names the missing CUDA build."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA_KERNELS
from grouped_cases import PATTERNS, host_reads_of, offsets, routing
from test_grouped_gemm import check_grouped, grouped_operands

from transformer_linear import _C
from transformer_linear.ops import grouped as ops_grouped
from transformer_linear.ops import torch_cuda
from transformer_linear.ops.descriptors import desc

cuda = pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and a CUDA build")


def _cublaslt_expected() -> bool:
    info = torch_cuda.build_info()
    return (info["cublas_header_version"] >= 131000 and info["cublaslt_version"] >= 131000
            and torch.cuda.get_device_capability() >= (8, 9))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_and_takes_cublaslt_where_it_can(pattern, out_dtype):
    total, groups, n, k = 200, 4, 64, 128
    a, sa, b, sb = grouped_operands(total, groups, n, k, "tensorwise")
    bias = torch.randn(groups, n).to(out_dtype)
    offs = offsets(routing(pattern, total, groups))
    before = _C.cublaslt_grouped_runs()

    def on_gpu(*args):
        out = ops_grouped.fp8_grouped_gemm(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args))
        return out.cpu()

    check_grouped(on_gpu, a, sa, b, sb, offs, out_dtype, bias, what=f"{pattern} {out_dtype}")
    assert _C.cublaslt_grouped_runs() - before == int(_cublaslt_expected())


@pytest.mark.cuda
@cuda
def test_shapes_cublaslt_declines_run_on_triton():
    """N not a multiple of 16: the Triton kernel, the same results."""
    a, sa, b, sb = grouped_operands(40, 3, 20, 96, "tensorwise")
    offs = offsets(routing("skewed", 40, 3))
    before = _C.cublaslt_grouped_runs()
    check_grouped(lambda *t: ops_grouped.fp8_grouped_gemm(*(x.cuda() if isinstance(x, torch.Tensor) else x
                                                              for x in t)).cpu(), a, sa, b, sb, offs, torch.float32)
    assert _C.cublaslt_grouped_runs() == before


@pytest.mark.cuda
@cuda
def test_no_host_read_of_offs():
    a, sa, b, sb = (t.cuda() for t in grouped_operands(64, 4, 32, 64, "tensorwise"))
    offs = offsets(routing("skewed", 64, 4)).cuda()
    with host_reads_of(offs) as reads:
        ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16, torch.zeros(4, 32, device="cuda",
                                                                                   dtype=torch.bfloat16))
    assert reads == []


@pytest.mark.skipif(_C.built_with_cuda(), reason="the CPU-only build's error")
def test_cpu_build_names_the_missing_cuda_build():
    assert _C.cublaslt_grouped_runs() == 0
    a, sa, b, sb = grouped_operands(8, 2, 16, 32, "tensorwise")
    op = "fp8_grouped_gemm"
    offs, d = offsets([4, 4]), torch.zeros(8, 16)
    with pytest.raises(Exception, match="CUDA"):
        _C.fp8_grouped_gemm_cublaslt(desc(a, op, "a"), desc(sa.reshape(1), op, "a_scale_inv"), desc(b, op, "b"),
                                     desc(sb, op, "b_scale_inv"), desc(offs, op, "offs"), desc(d, op, "d"),
                                     desc(None, op, "workspace"))
