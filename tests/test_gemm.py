"""FP8 GEMM against reference.fp8_gemm (float64), on every CPU instruction-set path.

Budget (tests/tolerances.py): at most 2x the error of fp32 torch.mm on the
dequantized operands, the same epilogue applied in fp32.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from large_outputs import large_output_rows
from tolerances import assert_bitwise_equal, assert_close_to_reference
from transformer_linear import _C, ops, reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_FORMATS = [E4M3, E5M2]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (set_cpu_isa name, AMX allowed): avx512_bf16 runs AMX tiles where the CPU
# has them, and vdpbf16ps with TL_CPU_AMX=0.
CPU_PATHS = {
    "generic": ("generic", True),
    "avx2": ("avx2", True),
    "avx512": ("avx512", True),
    "avx512_bf16": ("avx512_bf16", True),
    "avx512_bf16_no_amx": ("avx512_bf16", False),
}


@pytest.fixture(params=list(CPU_PATHS))
def cpu_isa(request, monkeypatch) -> str:
    """Force one CPU path for the test; restore the automatic choice afterwards.

    Skips only when the CPU lacks the path (asked explicitly); any error from
    forcing it, e.g. a renamed path, fails the test.
    """
    isa, amx = CPU_PATHS[request.param]
    if not _C.cpu_isa_supported(isa):
        pytest.skip(f"this CPU does not support {isa}")
    _C.set_cpu_isa(isa)
    if not amx:
        monkeypatch.setenv("TL_CPU_AMX", "0")
    yield request.param
    _C.set_cpu_isa("auto")


def test_cpu_paths_are_known():
    """Every path named above exists and every path the CPU runs is tested (none silently skipped)."""
    for isa, _ in CPU_PATHS.values():
        _C.cpu_isa_supported(isa)  # ValueError for a name the extension does not know
    assert set(_C.cpu_isa_info()["supported"]) <= {isa for isa, _ in CPU_PATHS.values()}


def fp8_operand(rows: int, cols: int, fmt: torch.dtype, column_major: bool = False) -> torch.Tensor:
    """A (rows, cols) FP8 matrix; column_major gives the transposed view of a contiguous (cols, rows)."""
    # Spread over a few binades so that sums cancel and the accumulation order matters.
    if column_major:
        return (torch.randn(cols, rows) * 4).to(fmt).t()
    return (torch.randn(rows, cols) * 4).to(fmt)


def scales() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0.375]), torch.tensor([1.25])


def fp32_baseline(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None, accumulate_into=None):
    """Plain PyTorch at the kernel's precision: fp32 mm of the dequantized operands."""
    v = torch.mm(a.float(), b.float().t()) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        v = v + bias.float()
    if accumulate_into is not None:
        v = accumulate_into.float() + v
    return v.to(out_dtype)


def run_and_check(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    with_bias: bool = False,
    accumulate: bool = False,
    what: str = "",
) -> None:
    """Run the kernel through the public op (or the full-contract entry point) and check it."""
    a_scale_inv, b_scale_inv = scales()
    n = b.shape[0]
    bias: Optional[torch.Tensor] = torch.randn(n).to(out_dtype) if with_bias else None
    if accumulate:
        d_old = torch.randn(a.shape[0], n).to(out_dtype)
        out = d_old.clone()
        if bias is None:
            ops.fp8_gemm_accumulate_(a, a_scale_inv, b, b_scale_inv, out)
        else:  # bias with accumulation is reachable only through the internal entry point
            ops._run_gemm(a, a_scale_inv, b, b_scale_inv, bias, out, True, False)
    else:
        d_old = None
        out = ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    assert out.dtype == out_dtype
    expected = reference.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float64, bias, d_old)
    baseline = fp32_baseline(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, d_old)
    assert_close_to_reference(out, expected, baseline, what=what)


SHAPES = [  # (M, N, K)
    (1, 1, 1),
    (1, 300, 77),  # a single token: the N dimension carries the threads
    (300, 1, 77),
    (7, 33, 1000),  # K over one KC block: partial sums through the scratch
    (33, 7, 5),
    (1000, 7, 33),
    (31, 65, 2049),  # odd K across several KC blocks
    (128, 1100, 64),  # N over one NC block of the generic path
    (256, 512, 1024),  # LLM-like: a short sequence through a projection
]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_shapes(cpu_isa, m, n, k):
    a, b = fp8_operand(m, k, E4M3), fp8_operand(n, k, E4M3)
    run_and_check(a, b, torch.float32, with_bias=True, what=f"{cpu_isa} {m}x{n}x{k}")


@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("b_fmt", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("a_fmt", FP8_FORMATS, ids=str)
def test_formats_dtypes_epilogue(cpu_isa, a_fmt, b_fmt, out_dtype, with_bias, accumulate):
    a, b = fp8_operand(37, 300, a_fmt), fp8_operand(50, 300, b_fmt)
    run_and_check(a, b, out_dtype, with_bias, accumulate, what=f"{cpu_isa} {a_fmt} x {b_fmt} -> {out_dtype}")


LAYOUT_SHAPES = [(45, 70, 600), (3, 40, 33)]


@pytest.mark.parametrize("m,n,k", LAYOUT_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in LAYOUT_SHAPES])
@pytest.mark.parametrize("b_col_major", [False, True], ids=["b_row", "b_col"])
@pytest.mark.parametrize("a_col_major", [False, True], ids=["a_row", "a_col"])
def test_operand_layouts(cpu_isa, a_col_major, b_col_major, m, n, k):
    """Column-major operands are the strided transposed views dgrad and wgrad pass."""
    a = fp8_operand(m, k, E5M2, column_major=a_col_major)
    b = fp8_operand(n, k, E4M3, column_major=b_col_major)
    run_and_check(a, b, torch.bfloat16, with_bias=True, what=f"{cpu_isa} layouts")


def test_row_slice_views(cpu_isa):
    """Row-major views with a row stride larger than K (slices of a wider matrix)."""
    a = fp8_operand(40, 90, E4M3)[:, 5:75]
    b = fp8_operand(33, 100, E4M3)[:, 10:80]
    run_and_check(a, b, torch.float32, what=f"{cpu_isa} sliced")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_large_outputs_match_row_blocks(cpu_isa, out_dtype, with_bias):
    """An output large enough to be streamed has the bits of the same rows computed as small GEMMs.

    K fits one pass, so every element's sum is the same whichever call computes it. N = 2049 leaves
    each output row's start and end off a cache line, the partial lines written with plain stores.
    """
    n, k = 2049, 40
    m = large_output_rows(n, out_dtype)
    a, b = fp8_operand(m, k, E4M3), fp8_operand(n, k, E5M2)
    a_scale_inv, b_scale_inv = scales()
    bias = torch.randn(n).to(out_dtype) if with_bias else None
    out = ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    rows = torch.cat([ops.fp8_gemm(part, a_scale_inv, b, b_scale_inv, out_dtype, bias) for part in a.split(256)])
    assert_bitwise_equal(out, rows, what=f"{cpu_isa} {m}x{n}x{k} -> {out_dtype}")
    expected = reference.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float64, bias)
    baseline = fp32_baseline(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    assert_close_to_reference(out, expected, baseline, what=f"{cpu_isa} {m}x{n}x{k} -> {out_dtype}")


EMPTY_SHAPES = [(0, 5, 7), (5, 0, 7), (5, 7, 0), (0, 0, 0)]


@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("m,n,k", EMPTY_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in EMPTY_SHAPES])
def test_empty(cpu_isa, m, n, k, accumulate):
    """K == 0 gives the bias (or D unchanged when accumulating); M or N == 0 gives nothing."""
    a, b = fp8_operand(m, k, E4M3), fp8_operand(n, k, E4M3)
    run_and_check(a, b, torch.float32, with_bias=True, accumulate=accumulate, what=f"{cpu_isa} empty")
    if k == 0 and accumulate:
        out = torch.randn(m, n)
        before = out.clone()
        ops.fp8_gemm_accumulate_(a, scales()[0], b, scales()[1], out)
        assert torch.equal(out, before)


def test_non_finite_inputs_propagate(cpu_isa):
    a, b = fp8_operand(20, 40, E4M3), fp8_operand(30, 40, E5M2)
    a[3, 7] = float("nan")
    b[5, 2] = float("inf")
    a_scale_inv, b_scale_inv = scales()
    out = ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32)
    expected = reference.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    assert_close_to_reference(out[finite], expected[finite].double(), what=f"{cpu_isa} finite part")


def test_thread_counts_agree():
    """One thread and two split the work differently; both stay within the budget."""
    a, b = fp8_operand(70, 600, E4M3), fp8_operand(90, 600, E4M3)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _C.set_num_threads(threads)
            run_and_check(a, b, torch.float32, what=f"{threads} threads")
    finally:
        torch.set_num_threads(saved)
        _C.set_num_threads(saved)


# ---------------------------------------------------------------------------
# Bad input: a clear TypeError / ValueError naming the argument.
# ---------------------------------------------------------------------------


def good_args() -> dict:
    a_scale_inv, b_scale_inv = scales()
    return dict(
        a=fp8_operand(8, 16, E4M3),
        a_scale_inv=a_scale_inv,
        b=fp8_operand(12, 16, E4M3),
        b_scale_inv=b_scale_inv,
        out_dtype=torch.float32,
        bias=None,
    )


BAD_INPUTS = {
    "a_dtype": (dict(a=torch.randn(8, 16)), TypeError, "'a'"),
    "b_dtype": (dict(b=torch.randn(12, 16).to(torch.bfloat16)), TypeError, "'b'"),
    "mismatched_k": (dict(b=fp8_operand(12, 17, E4M3)), ValueError, "inner dimensions"),
    "a_rank": (dict(a=fp8_operand(8, 16, E4M3).reshape(2, 4, 16)), ValueError, "2-D"),
    "b_rank": (dict(b=fp8_operand(12, 16, E4M3).reshape(-1)), ValueError, "2-D"),
    "a_strided_both": (dict(a=fp8_operand(16, 32, E4M3)[::2, ::2]), ValueError, "'a'"),
    "b_strided_both": (dict(b=fp8_operand(24, 32, E4M3)[::2, ::2]), ValueError, "'b'"),
    "a_scale_shape": (dict(a_scale_inv=torch.ones(2)), ValueError, "'a_scale_inv'"),
    "b_scale_dtype": (dict(b_scale_inv=torch.ones(1, dtype=torch.float64)), TypeError, "'b_scale_inv'"),
    "bias_shape": (dict(bias=torch.zeros(13)), ValueError, "'bias'"),
    "bias_dtype": (dict(bias=torch.zeros(12, dtype=torch.bfloat16)), TypeError, "'bias'"),
    "out_dtype": (dict(out_dtype=torch.int32), TypeError, "'out_dtype'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(case):
    changes, error, needle = BAD_INPUTS[case]
    args = {**good_args(), **changes}
    with pytest.raises(error, match=needle):
        ops.fp8_gemm(
            args["a"], args["a_scale_inv"], args["b"], args["b_scale_inv"], args["out_dtype"], args["bias"]
        )


def test_bad_accumulate_output():
    args = good_args()
    for out, error, needle in [
        (torch.zeros(12, 8).t(), ValueError, "contiguous"),
        (torch.zeros(8, 13), ValueError, "'d'"),
        (torch.zeros(8, 12, dtype=torch.float64), TypeError, "'d'"),
    ]:
        with pytest.raises(error, match=needle):
            ops.fp8_gemm_accumulate_(args["a"], args["a_scale_inv"], args["b"], args["b_scale_inv"], out)
