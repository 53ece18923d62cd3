"""The FP8 transpose op ``transpose`` (ops/__init__.py, csrc/cpu/quantize_cpu.cpp): the columnwise copy of data
already quantized, bitwise ``reference.transpose_last2``, on every CPU path, every thread count, shapes with
partial tiles in both dimensions, stacks of matrices and empty sizes (opcheck: test_ops.py); what the square-block weight's
columnwise copy (``BlockKind.transpose_copy``) is made with.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise_equal

from transformer_linear import _C, ops, recipe, reference
from transformer_linear.ops.descriptors import desc
from transformer_linear.recipe.quantization import quantization_spec

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = {
    "square": (256, 256),
    "tiles_partial_both_ways": (300, 130),  # 256-row and 64-column units cut short, 16-byte blocks too
    "past_one_unit_each_way": (1000, 70),
    "wide": (17, 2049),
    "one_row": (1, 33),
    "one_column": (45, 1),
    "stack": (3, 40, 90),
    "no_rows": (0, 16),
    "no_columns": (16, 0),
    "no_matrices": (0, 4, 5),
}


def _fp8(shape, dtype=E4M3):
    # Every byte pattern, NaN codes included: the op moves bytes and must not touch them.
    return torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_bitwise_the_reference(gemm_isa, shape, dtype):
    q = _fp8(SHAPES[shape], dtype)
    out = ops.transpose(q)
    assert out.is_contiguous()
    assert_bitwise_equal(out, reference.transpose_last2(q), f"{gemm_isa} {shape}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(restore_torch_threads, threads):
    torch.set_num_threads(threads)
    q = _fp8((1100, 700))
    assert_bitwise_equal(ops.transpose(q), reference.transpose_last2(q), f"{threads} threads")


def test_a_non_contiguous_input_is_copied_first():
    q = _fp8((64, 48))
    assert_bitwise_equal(ops.transpose(q.t()), q, "transpose of a transposed view")


def test_square_block_weight_columnwise_copy_is_the_transpose(gemm_isa):
    """The 128x128-block weight's columnwise copy (made by this op) is the rowwise one transposed."""
    w = torch.randn(384, 200)
    quantizer = quantization_spec(recipe.Float8BlockScaling()).weight
    assert tuple(quantizer.block_shape) == (128, 128)
    q = quantizer.quantize(w, rowwise=True, columnwise=True)
    assert_bitwise_equal(q.data_t, reference.transpose_last2(q.data), "data_t")
    assert_bitwise_equal(q.scale_inv_t, reference.transpose_last2(q.scale_inv), "scale_inv_t")


def test_compiled_is_eager():
    q = _fp8((130, 70))
    compiled = torch.compile(ops.transpose, fullgraph=True)
    assert_bitwise_equal(compiled(q), ops.transpose(q), "compiled")


def test_meta_input_gives_a_meta_result():
    out = ops.transpose(torch.empty(3, 5, 7, dtype=E4M3, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 7, 5)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ops.transpose(torch.randn(4, 4)), TypeError, "transpose: argument 'input' must be float8"),
        (lambda: ops.transpose(torch.zeros(4, dtype=E4M3)), ValueError, "must be 2-D or 3-D"),
        (lambda: ops.transpose(torch.zeros(1, 2, 3, 4, dtype=E4M3)), ValueError, "must be 2-D or 3-D"),
        (lambda: ops.transpose([1, 2]), TypeError, "argument 'input' must be a torch.Tensor"),
    ],
    ids=["float32", "1-D", "4-D", "list"],
)
def test_bad_input_names_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _raw(q, out):
    _C.transpose(desc(q, "transpose", "input"), desc(out, "transpose", "output"), 0)


@pytest.mark.parametrize(
    "out, match",
    [
        (lambda q: torch.empty(5, 4, dtype=E5M2), "argument 'output'"),
        (lambda q: torch.empty(4, 5, dtype=E4M3), "argument 'output'"),
        (lambda q: torch.empty(5, 4, dtype=E4M3).t().contiguous().t(), "'output' must be contiguous"),
        (lambda q: q.view(5, 4), "output 'output' shares memory with argument 'input'"),
    ],
    ids=["dtype", "shape", "strides", "overlaps_input"],
)
def test_kernel_checks_its_output(out, match):
    q = _fp8((4, 5))
    with pytest.raises((TypeError, ValueError), match=match):
        _raw(q, out(q))
