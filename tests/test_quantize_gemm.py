"""The fused forward op ``quantize_fp8_gemm`` (ops/quantize_gemm.py, csrc/cpu/quantize_gemm_cpu.cpp): the
input's cast runs inside the FP8 GEMM, each block of rows cast by the thread about to pack it.

Its FP8 copy, scale_inv and amax are bitwise the reference quantize's; its product is bitwise the
``quantize`` op followed by ``fp8_gemm`` (whose own tests hold it to the reference GEMM), and within the
package tolerance of the reference. Every CPU path, both scalings, every input dtype, shapes that make the
GEMM cast in its units (rows in several blocks), all rows first (one block of rows cut among threads),
several K passes and NC blocks, empty dimensions, several thread counts.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_bitwise_equal, assert_close_to_reference

from transformer_linear import _C, ops, reference
from transformer_linear.ops.descriptors import desc

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.transformer_linear
SHAPES = {
    "small": (16, 64, 24),
    "rows_in_many_blocks": (600, 700, 300),  # several blocks of A rows: each cast by its unit
    "one_block_of_rows": (5, 300, 2600),  # the threads split one block's B panels: every row cast first
    "many_passes_and_nc_blocks": (200, 2100, 2100),  # K past the 256 of a pass, N past one NC block
    "no_rows": (0, 64, 24),
    "no_k": (16, 0, 24),
    "no_columns": (16, 64, 0),
}


def _operands(m, k, n, in_dtype, fp8_dtype=E4M3):
    torch.manual_seed(0)
    x = (torch.randn(m, k) * 4).to(in_dtype)
    w, w_scale_inv = ops.quantize(torch.randn(n, k), torch.tensor([32.0]), E4M3)
    return x, w, w_scale_inv


def _unfused(x, fp8_dtype, scale, w, w_scale_inv, out_dtype, bias, margin=0):
    q = ops.quantize_fused(x, fp8_dtype, scale, margin=margin)
    return ops.fp8_gemm(q.data, q.scale_inv, w, w_scale_inv, out_dtype, bias), q


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_bitwise_the_quantize_then_the_gemm(gemm_isa, shape, in_dtype, scaling):
    m, k, n = SHAPES[shape]
    x, w, w_scale_inv = _operands(m, k, n, in_dtype)
    scale = None if scaling == "current" else torch.tensor([0.75])
    bias = torch.randn(n).to(torch.bfloat16)
    fused = ops.quantize_fp8_gemm(x, E4M3, scale, w, w_scale_inv, torch.bfloat16, bias, margin=1)
    out, q = _unfused(x, E4M3, scale, w, w_scale_inv, torch.bfloat16, bias, margin=1)
    assert_bitwise_equal(fused.out, out, "out")
    if scaling == "current":
        expected_data, expected_scale_inv, expected_amax = reference.quantize_current(x, E4M3, 1)
    else:
        (expected_data, expected_scale_inv), expected_amax = reference.quantize(x, scale, E4M3), reference.amax(x)
    assert_bitwise_equal(fused.data, expected_data, "data")
    assert_bitwise_equal(fused.scale_inv, expected_scale_inv.reshape(1), "scale_inv")
    assert_bitwise_equal(fused.amax, expected_amax.reshape(()), "amax")
    assert_bitwise_equal(fused.data, q.data, "data vs the quantize op")


@pytest.mark.parametrize("shape", ["rows_in_many_blocks", "many_passes_and_nc_blocks"])
def test_close_to_the_reference_gemm(shape):
    m, k, n = SHAPES[shape]
    x, w, w_scale_inv = _operands(m, k, n, torch.float32)
    fused = ops.quantize_fp8_gemm(x, E5M2, None, w, w_scale_inv, torch.float32)
    exact = reference.fp8_gemm(fused.data, fused.scale_inv, w, w_scale_inv, torch.float64)
    assert_close_to_reference(fused.out, exact, what=shape)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", ["rows_in_many_blocks", "one_block_of_rows"])
def test_thread_counts_give_the_same_bits(shape, threads, restore_torch_threads):
    m, k, n = SHAPES[shape]
    x, w, w_scale_inv = _operands(m, k, n, torch.bfloat16)
    scale = torch.tensor([2.0])
    torch.set_num_threads(1)
    expected = ops.quantize_fp8_gemm(x, E4M3, scale, w, w_scale_inv, torch.float32)
    torch.set_num_threads(threads)
    actual = ops.quantize_fp8_gemm(x, E4M3, scale, w, w_scale_inv, torch.float32)
    for name, a, e in zip(expected._fields, actual, expected):
        assert_bitwise_equal(a, e, f"{name}, {threads} threads vs 1")


@pytest.mark.parametrize("row", [0, 299, 599])
def test_a_nan_in_any_block_of_rows_reaches_the_amax(row):
    """Delayed scaling's amax is gathered over the blocks the GEMM's threads cast."""
    m, k, n = SHAPES["rows_in_many_blocks"]
    x, w, w_scale_inv = _operands(m, k, n, torch.float32)
    x[row, k // 2] = float("nan")
    fused = ops.quantize_fp8_gemm(x, E4M3, torch.tensor([1.0]), w, w_scale_inv, torch.float32)
    assert torch.isnan(fused.amax)
    _, q = _unfused(x, E4M3, torch.tensor([1.0]), w, w_scale_inv, torch.float32, None)
    assert_bitwise_equal(fused.data, q.data, "data")


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck(scaling, with_bias, allclose_on_fp8):
    x, w, w_scale_inv = _operands(8, 32, 16, torch.bfloat16)
    scale = None if scaling == "current" else torch.tensor([2.0])
    bias = torch.randn(16, dtype=torch.bfloat16) if with_bias else None
    torch.library.opcheck(OPS.quantize_fp8_gemm.default, (x, scale, E5M2, 1, w, w_scale_inv, torch.bfloat16, bias,
                                                          False))


def test_compiled_matches_eager_bitwise():
    x, w, w_scale_inv = _operands(48, 64, 24, torch.float32)

    def forward(x):
        return ops.quantize_fp8_gemm(x, E4M3, None, w, w_scale_inv, torch.float32)

    eager = forward(x)
    compiled = torch.compile(forward, backend="inductor", fullgraph=True)(x)
    for name, c, e in zip(eager._fields, compiled, eager):
        assert_bitwise_equal(c, e, name)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda x, w, s: (x.t(), E4M3, None, w, s, torch.float32), ValueError, "'input' must be contiguous"),
        (lambda x, w, s: (x[0], E4M3, None, w, s, torch.float32), ValueError, "'input' and 'b' must be 2-D"),
        (lambda x, w, s: (x, E4M3, None, w[:, :8], s, torch.float32), ValueError, "inner dimensions"),
        (lambda x, w, s: (x, torch.float16, None, w, s, torch.float32), TypeError, "'dtype'"),
        (lambda x, w, s: (x, E4M3, None, w, s, torch.int32), TypeError, "'out_dtype'"),
        (lambda x, w, s: (x, E4M3, None, w, torch.ones(2), torch.float32), ValueError, "'b_scale_inv' must have one"),
        (lambda x, w, s: (x, E4M3, torch.tensor([float("inf")]), w, s, torch.float32), ValueError, "'scale'"),
        (lambda x, w, s: (x, E4M3, None, w, torch.tensor([0.0]), torch.float32), ValueError, "'b_scale_inv'"),
        (lambda x, w, s: (x, E4M3, None, w.to("meta"), s, torch.float32), TypeError, "'b'.*meta"),
    ],
)
def test_bad_input_is_named(make, error, message):
    x, w, w_scale_inv = _operands(8, 32, 16, torch.float32)
    with pytest.raises(error, match=message):
        ops.quantize_fp8_gemm(*make(x, w, w_scale_inv))


def _raw_call(x, scale, out, w, w_scale_inv, d, current):
    """_C.quantize_fp8_gemm on these tensors as they are (the C++ entry checks them again: it can be reached
    directly), with fresh scale_inv and amax outputs (held here: a descriptor does not keep its tensor)."""
    scale_inv, amax = torch.empty(1), torch.empty(())

    def describe(t, name):
        return desc(t, "test", name)

    _C.quantize_fp8_gemm(describe(x, "input"), describe(scale, "scale"), describe(out, "output"),
                         describe(scale_inv, "scale_inv"), describe(amax, "amax"), current, 0, describe(w, "b"),
                         describe(w_scale_inv, "b_scale_inv"), None, describe(d, "d"), False, None, 0)


@pytest.mark.parametrize(
    "case, match",
    [
        ("scratch scale in d", "'d' shares memory with output 'scale'|'scale' shares memory with output 'd'"),
        ("d over the input", "output 'd' shares memory with argument 'input'"),
        ("FP8 copy over the weight", "output 'output' shares memory with argument 'b'"),
    ],
    ids=lambda v: v if " " in v and "'" not in v else "",
)
def test_the_entry_refuses_outputs_over_other_tensors(case, match):
    """Current scaling writes its scale into the 'scale' tensor: it may overlap neither the GEMM's output
    nor anything else, and no output of the quantize half may overlap an input of the GEMM half."""
    x, w, w_scale_inv = _operands(8, 32, 16, torch.float32)
    scale, out, d = torch.empty(1), torch.empty(8, 32, dtype=E4M3), torch.empty(8, 16)
    if case == "scratch scale in d":
        scale = d.view(-1)[:1]
    elif case == "d over the input":
        d = x.view(-1)[: 8 * 16].view(8, 16)
    else:
        both = torch.empty(16, 32, dtype=E4M3)
        both.copy_(w)
        w, out = both, both[8:]
    with pytest.raises(ValueError, match=match):
        _raw_call(x, scale, out, w, w_scale_inv, d, current=True)
