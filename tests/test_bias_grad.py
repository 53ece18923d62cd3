"""The bias gradient on its own, ``ops.bias_grad`` (csrc/cpu/quantize_cpu.cpp): what the Linear's backward
computes where the gradient's quantizer does not fuse it (block scales, NVFP4). Bitwise
``reference.bias_grad``, whose float32 summation order (runs of 16 rows, blocks of 256) the tensorwise
quantize's fused ``dbias`` follows too, on every CPU path and thread count; within float32 summation's error
bound of the exact sums (opcheck: test_ops.py).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise_equal, assert_column_sums_close

from transformer_linear import _C, ops, reference
from transformer_linear.ops.descriptors import desc

HP = [torch.float32, torch.bfloat16, torch.float16]
# Runs of 16 and blocks of 256 rows whole and cut short (300, 1000 rows), one row, empty sizes.
SHAPES = [(1, 5), (300, 70), (1000, 33), (4, 3, 260), (512, 16), (0, 7), (6, 0)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("in_dtype", HP)
def test_bitwise_the_reference_and_the_fused_dbias(gemm_isa, in_dtype, dtype, shape):
    x = (torch.randn(shape) * 3).to(in_dtype)
    got = ops.bias_grad(x, dtype)
    assert_bitwise_equal(got, reference.bias_grad(x, dtype), "bias_grad against the reference")
    assert_column_sums_close(got, x, "dbias")
    if x.numel():
        fused = ops.quantize_fused(x, torch.float8_e4m3fn, None, dbias_dtype=dtype).dbias
        assert_bitwise_equal(got, fused, "bias_grad against quantize's dbias")


def test_a_0_dim_gradient_is_one_column():
    assert_bitwise_equal(ops.bias_grad(torch.tensor(3.0), torch.float32), torch.tensor([3.0]), "0-dim")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(restore_torch_threads, threads):
    x = torch.randn(1300, 90).to(torch.bfloat16)
    torch.set_num_threads(1)
    one = ops.bias_grad(x, torch.float32)
    torch.set_num_threads(threads)
    assert_bitwise_equal(ops.bias_grad(x, torch.float32), one, f"{threads} threads")


def test_non_contiguous_gradient_is_copied_first():
    x = torch.randn(40, 24)
    assert_bitwise_equal(ops.bias_grad(x.t(), torch.float32), ops.bias_grad(x.t().contiguous(), torch.float32))


def test_compiled_is_eager():
    x = torch.randn(300, 40)
    compiled = torch.compile(ops.bias_grad, fullgraph=True)
    assert_bitwise_equal(compiled(x, torch.bfloat16), ops.bias_grad(x, torch.bfloat16), "compiled")


def test_meta_input_gives_a_meta_result():
    out = ops.bias_grad(torch.empty(3, 5, 7, device="meta"), torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (7,) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ops.bias_grad(torch.ones(4, 4, dtype=torch.int32), torch.float32), TypeError,
         "bias_grad: argument 'grad_output' must be torch.float32"),
        (lambda: ops.bias_grad(torch.ones(4, 4), torch.int8), TypeError, "bias_grad: argument 'dtype'"),
        (lambda: ops.bias_grad(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.float32), TypeError,
         "argument 'grad_output'"),
        (lambda: ops.bias_grad("x", torch.float32), TypeError, "argument 'grad_output' must be a torch.Tensor"),
    ],
    ids=["int32", "int8_dtype", "fp8", "str"],
)
def test_bad_input_names_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    "dbias, match",
    [
        (lambda x: torch.empty(6), "argument 'dbias' must have shape"),
        (lambda x: torch.empty(5, dtype=torch.int32), "argument 'dbias'"),
        (lambda x: torch.empty(10)[::2], "'dbias' must be contiguous"),
        (lambda x: x.view(-1)[:5], "output 'dbias' shares memory with argument 'input'"),
    ],
    ids=["shape", "dtype", "strides", "overlaps_input"],
)
def test_kernel_checks_its_output(dbias, match):
    x = torch.randn(4, 5)
    with pytest.raises((TypeError, ValueError), match=match):
        _C.bias_grad(desc(x, "bias_grad", "input"), desc(dbias(x), "bias_grad", "dbias"), 0)
