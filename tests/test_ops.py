"""The custom ops under torch.library.opcheck and torch.compile."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo.testing
from test_triton_ops_traced import TRITON_OPS
from tolerances import assert_bitwise_equal

from transformer_linear import ops
from transformer_linear.ops import triton_route

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.transformer_linear


# torch's SchemaCheckMode compares inputs with arithmetic that float8 tensors
# lack, so ops taking FP8 inputs run the other checks and opcheck_fp8's own
# no-mutation check instead of test_schema.
FP8_INPUT_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_fp8(op, args, mutated=()):
    """opcheck without test_schema, plus a bitwise check that only ``mutated`` inputs change."""
    torch.library.opcheck(op, args, test_utils=FP8_INPUT_CHECKS)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    op(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor) and i not in mutated:
            assert_bitwise_equal(a, b, f"input {i} was modified")


def fp8_operand(shape, dtype, device):
    q, scale_inv, _ = ops.quantize_current(torch.randn(shape, device=device), dtype)
    return q, scale_inv


def test_every_op_is_covered():
    """New ops in the namespace must be added to the opcheck tests below."""
    triton_route.kernels()  # registers the Triton ops (imported on first GPU use)
    registered = {name for name in dir(OPS) if isinstance(getattr(OPS, name), torch._ops.OpOverloadPacket)}
    # in test_linear_compile.py:
    linear_ops = {"linear_fwd", "linear_dgrad", "linear_wgrad", "delayed_scaling_update", "delayed_scaling_flush"}
    linear_ops |= {"quantize_grad_output"}
    block_ops = {"quantize_blockwise", "fp8_gemm_blockwise", "fp8_gemm_blockwise_accumulate"}  # in test_blockwise_*.py
    block_ops |= {"quantize_blockwise_flat"}  # in test_linear_block_recipes.py
    nvfp4_ops = {"quantize_nvfp4", "nvfp4_gemm"}  # in test_nvfp4.py
    # in test_linear_nvfp4.py (nvfp4_sr_seed draws a new seed per call: tested for reproducibility, not opchecked)
    nvfp4_ops |= {"quantize_nvfp4_packed", "nvfp4_gemm_packed", "nvfp4_sr_seed"}
    grouped_ops = {"fp8_grouped_gemm", "fp8_grouped_gemm_wgrad"}  # in test_grouped_gemm.py
    grouped_ops |= {"fp8_grouped_gemm_wgrad_blockwise"}  # in test_grouped_wgrad_blockwise.py
    grouped_ops |= {"quantize_grouped_columnwise"}  # in test_grouped_quantize_cpu.py
    grouped_ops |= {"grouped_linear_fwd"}  # in test_grouped_linear.py
    grouped_ops |= {"grouped_mm_dgrad", "grouped_mm_wgrad"}  # in test_grouped_backward_override.py
    # in test_grouped_nvfp4_kernels.py:
    grouped_ops |= {"nvfp4_grouped_gemm", "nvfp4_grouped_gemm_wgrad", "quantize_nvfp4_grouped_columnwise"}
    expected = {"amax", "quantize", "dequantize", "fp8_gemm", "fp8_gemm_accumulate"} | linear_ops | block_ops
    expected |= {"fsdp_rowwise_copy"}  # in test_fsdp_fp8_all_gather.py
    expected |= {"quantize_fp8_gemm"}  # in test_quantize_gemm.py
    expected |= {"transpose", "bias_grad"}  # below; their kernels in test_transpose.py, test_bias_grad.py
    # The Triton ops: opchecked on a GPU, traced and refusing CPU tensors in test_triton_ops_traced.py, run
    # under the interpreter in test_blockwise_triton.py, test_grouped_gemm.py and test_nvfp4_triton.py.
    triton_ops = {f"triton_{name}" for name in TRITON_OPS}
    assert registered == expected | nvfp4_ops | grouped_ops | triton_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_amax(device, dtype):
    torch.library.opcheck(OPS.amax.default, (torch.randn(5, 7, device=device).to(dtype),))


QUANTIZE_FLAGS = [
    (delayed, rowwise, columnwise, dbias)
    for delayed, (rowwise, columnwise), dbias in itertools.product(
        (True, False), ((True, False), (False, True), (True, True)), (None, torch.bfloat16)
    )
]


@pytest.mark.parametrize("delayed, rowwise, columnwise, dbias_dtype", QUANTIZE_FLAGS, ids=str)
def test_opcheck_quantize(device, delayed, rowwise, columnwise, dbias_dtype):
    x = torch.randn(6, 10, device=device, dtype=torch.bfloat16)
    scale = torch.tensor([2.0], device=device) if delayed else None
    torch.library.opcheck(OPS.quantize.default, (x, scale, E5M2, 1, rowwise, columnwise, dbias_dtype))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_opcheck_dequantize(device, out_dtype):
    q, scale_inv = fp8_operand((4, 9), E4M3, device)
    opcheck_fp8(OPS.dequantize.default, (q, scale_inv, out_dtype))


@pytest.mark.parametrize("shape", [(6, 10), (2, 6, 10)])
def test_opcheck_transpose(device, shape):
    q, _ = fp8_operand(shape, E5M2, device)
    opcheck_fp8(OPS.transpose.default, (q,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_bias_grad(device, dtype):
    torch.library.opcheck(OPS.bias_grad.default, (torch.randn(2, 6, 10, device=device).to(dtype), torch.float32))


@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_fp8_gemm(device, with_bias):
    a, sa = fp8_operand((8, 32), E4M3, device)
    b, sb = fp8_operand((16, 32), E4M3, device)
    bias = torch.randn(16, device=device, dtype=torch.bfloat16) if with_bias else None
    opcheck_fp8(OPS.fp8_gemm.default, (a, sa, b, sb, torch.bfloat16, bias, False))


def test_opcheck_fp8_gemm_accumulate(device):
    a, sa = fp8_operand((8, 32), E4M3, device)
    b, sb = fp8_operand((16, 32), E5M2, device)
    out = torch.randn(8, 16, device=device)
    opcheck_fp8(OPS.fp8_gemm_accumulate.default, (a, sa, b, sb, out, True), mutated=(4,))


def fp8_pipeline(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every op once: current-scaled input, transposed weight, GEMM, accumulate, dequantize."""
    qx, sx, amax_x = ops.quantize_current(x, E4M3)
    w_out = ops.quantize_fused(w, E4M3, torch.ones(1, device=w.device), columnwise=True, dbias_dtype=torch.float32)
    y = ops.fp8_gemm(qx, sx, w_out.data, w_out.scale_inv, torch.float32, bias)
    acc = torch.ones(x.shape[0], w.shape[0], device=x.device)
    # data_t.t() is the weight again, as a column-major view.
    ops.fp8_gemm_accumulate_(qx, sx, w_out.data_t.t(), w_out.scale_inv, acc)
    return y, acc, ops.dequantize(qx, sx, torch.bfloat16), amax_x, ops.amax(w), w_out.dbias


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_matches_eager_bitwise(device, backend):
    x, w = torch.randn(16, 32, device=device), torch.randn(24, 32, device=device)
    bias = torch.randn(24, device=device)
    eager = fp8_pipeline(x, w, bias)
    compiled = torch.compile(fp8_pipeline, backend=backend, fullgraph=True)(x, w, bias)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert_bitwise_equal(c, e, f"output {i}")


def test_dynamic_shapes_do_not_recompile(device):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fp8_pipeline, backend=counter, fullgraph=True)
    w, bias = torch.randn(24, 32, device=device), torch.randn(24, device=device)
    for rows in (16, 48, 80):
        x = torch.randn(rows, 32, device=device)
        torch._dynamo.mark_dynamic(x, 0)
        for c, e in zip(compiled(x, w, bias), fp8_pipeline(x, w, bias)):
            assert_bitwise_equal(c, e)
    assert counter.frame_count == 1
