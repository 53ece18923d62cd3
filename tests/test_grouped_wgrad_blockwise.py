"""The block-scaled weight gradient of the grouped GEMM: the grouped columnwise copies
(ops.grouped_quantize) bitwise against the oracle's, and the GEMM (ops.grouped, the CPU kernel on
every ISA path and the Triton kernel under TRITON_INTERPRET=1) against the float64 oracle
(reference.grouped), over token blocks (128, 32, whole group), routings and output dtypes; opcheck,
compile without recompiles, no host read of ``offs``, bad input.

Triton: as in test_grouped_gemm.py, a normal run holds one test that runs this module again in a
fresh interpreter with TRITON_INTERPRET=1, where only the Triton tests are defined.
"""

from __future__ import annotations

import os

import pytest
import torch
from blockwise_cases import E4M3, E5M2, E8M0
from grouped_cases import PATTERNS, host_reads_of, offsets, routing
from tolerances import assert_close_to_reference
from triton_interpreted import run_interpreted

from transformer_linear.formats.grouped_scaling import WHOLE
from transformer_linear.ops.grouped_quantize import quantize_grouped_columnwise
from transformer_linear.reference import e8m0_to_float
from transformer_linear.reference import grouped as reference_grouped

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOKEN_BLOCKS = [128, 32, WHOLE]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
    return f"first mismatch at {diff[0].tolist()}" if len(diff) else ""


def grouped_copies(total, n, k, sizes, token_block, spread=4):
    """(grad_t, grad_t_scale_inv, x_t, x_t_scale_inv, offs): the oracle's grouped columnwise copies of
    a grad_output and an input whose tokens range over 2^-spread..2^spread."""
    scales = torch.exp2(torch.randint(-spread, spread + 1, (total, 1)).float())
    grad = torch.randn(total, n) * scales
    x = torch.randn(total, k) * scales.flip(0)
    offs = offsets(sizes)
    grad_t, sg = reference_grouped.quantize_grouped_columnwise(grad, offs, E5M2, token_block)
    x_t, sx = reference_grouped.quantize_grouped_columnwise(x, offs, E4M3, token_block)
    return grad_t, sg, x_t, sx, offs


def _float(s):
    return e8m0_to_float(s) if s.dtype == E8M0 else s


def _dequantized_fp32(t, s, start, end, group, token_block):
    """float32 (C, tokens of the group) of a grouped columnwise copy."""
    block = max(end - start, 1) if token_block == WHOLE else token_block
    col0 = group if token_block == WHOLE else start // token_block + group
    count = -(-(end - start) // block)
    full = _float(s[:, col0 : col0 + count]).repeat_interleave(block, 1)[:, : end - start]
    return t[:, start:end].float() * full


def check_wgrad_blockwise(fn, total, n, k, sizes, token_block, out_dtype, what=""):
    grad_t, sg, x_t, sx, offs = grouped_copies(total, n, k, sizes, token_block)
    out = fn(grad_t, sg, x_t, sx, offs, out_dtype, token_block)
    expected = reference_grouped.fp8_grouped_gemm_wgrad_blockwise(grad_t, sg, x_t, sx, offs, torch.float64, token_block)
    assert out.shape == (len(sizes), n, k) and out.dtype == out_dtype
    for g, (start, end) in enumerate(reference_grouped.group_bounds(offs, total)):
        # The error baseline: fp32 products of the dequantized operands, one fp32 mm per group.
        grad_deq = _dequantized_fp32(grad_t, sg, start, end, g, token_block)
        x_deq = _dequantized_fp32(x_t, sx, start, end, g, token_block)
        baseline = (grad_deq @ x_deq.t()).to(out_dtype)
        assert_close_to_reference(out[g], expected[g], baseline, what=f"{what} group {g}")


if not INTERPRETED:
    import torch._dynamo.testing
    from cpu_paths import SUPPORTED_ISAS

    from transformer_linear import _C
    from transformer_linear.ops import grouped as ops_grouped

    @pytest.fixture(params=SUPPORTED_ISAS)
    def cpu_isa(request):
        """Every CPU path this machine runs (packing, micro-kernel and promotion differ)."""
        _C.set_cpu_isa(request.param)
        yield request.param
        _C.set_cpu_isa("auto")

    @pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
    @pytest.mark.parametrize("pattern", PATTERNS)
    @pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
    def test_grouped_columnwise_copy_matches_reference_bitwise(token_block, pattern, x_dtype):
        """Groups that start inside a token block; tokens past the last group are 0."""
        total, cols, groups = 301, 40, 5
        x = (torch.randn(total, cols) * torch.exp2(torch.randint(-8, 9, (total, 1)).float())).to(x_dtype)
        x[7, 3] = 0.0
        x[100:140] = 0.0  # an all-zero block: scale 1
        offs = offsets(routing(pattern, total, groups))
        got = quantize_grouped_columnwise(x, offs, E4M3, token_block)
        data_t, scale_inv_t = reference_grouped.quantize_grouped_columnwise(x, offs, E4M3, token_block)
        assert got.scale_inv_t.dtype == scale_inv_t.dtype and got.scale_inv_t.shape == scale_inv_t.shape
        assert torch.equal(got.data_t.view(torch.uint8), data_t.view(torch.uint8)), _first_mismatch(got.data_t, data_t)
        assert torch.equal(got.scale_inv_t.view(torch.uint8) if token_block == 32 else got.scale_inv_t,
                           scale_inv_t.view(torch.uint8) if token_block == 32 else scale_inv_t)

    @pytest.mark.parametrize("token_block, power_2_scale, rounding", [(128, True, "ceil"), (WHOLE, True, "ceil"),
                                                                      (32, False, "floor")])
    def test_grouped_columnwise_copy_scale_options(token_block, power_2_scale, rounding):
        x = torch.randn(150, 24) * 300
        offs = offsets([40, 0, 70, 40])
        got = quantize_grouped_columnwise(x, offs, E5M2, token_block, power_2_scale, rounding)
        want = reference_grouped.quantize_grouped_columnwise(x, offs, E5M2, token_block, power_2_scale, rounding)
        assert torch.equal(got.data_t.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got.scale_inv_t.view(torch.uint8), want[1].view(torch.uint8))

    @pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_cpu_matches_reference(cpu_isa, token_block, pattern):
        """Groups past one cache chunk of tokens, starting inside token blocks; N, K not tile multiples."""
        total, n, k = 700, 40, 72
        check_wgrad_blockwise(ops_grouped.fp8_grouped_gemm_wgrad_blockwise, total, n, k, routing(pattern, total, 4),
                              token_block, torch.float32, what=f"{cpu_isa} {token_block} {pattern}")

    @pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
    @pytest.mark.parametrize("out_dtype", OUT_DTYPES)
    def test_cpu_output_dtypes(token_block, out_dtype):
        check_wgrad_blockwise(ops_grouped.fp8_grouped_gemm_wgrad_blockwise, 130, 24, 40, [33, 0, 60, 37],
                              token_block, out_dtype, what=f"{token_block} {out_dtype}")

    def test_cpu_threads_give_the_same_bits():
        grad_t, sg, x_t, sx, offs = grouped_copies(900, 96, 128, [800, 30, 70], 128)
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = ops_grouped.fp8_grouped_gemm_wgrad_blockwise(grad_t, sg, x_t, sx, offs, torch.float32, 128)
            torch.set_num_threads(4)
            four = ops_grouped.fp8_grouped_gemm_wgrad_blockwise(grad_t, sg, x_t, sx, offs, torch.float32, 128)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(one, four)

    def test_cpu_empty_sizes():
        for total, n, k, sizes in [(0, 8, 16, [0, 0]), (10, 0, 16, [5, 5]), (10, 8, 0, [5, 5]), (10, 8, 16, [])]:
            grad_t, sg, x_t, sx, offs = grouped_copies(total, n, k, sizes, 32)
            out = ops_grouped.fp8_grouped_gemm_wgrad_blockwise(grad_t, sg, x_t, sx, offs, torch.float32, 32)
            assert out.shape == (len(sizes), n, k) and not out.any()

    _OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

    @pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
    def test_opcheck(token_block):
        grad_t, sg, x_t, sx, offs = grouped_copies(70, 16, 24, [20, 0, 50], token_block)
        op = torch.ops.transformer_linear.fp8_grouped_gemm_wgrad_blockwise.default
        torch.library.opcheck(op, (grad_t, sg, x_t, sx, offs, torch.float32, token_block), test_utils=_OPCHECK_UTILS)

    def test_compile_changing_offs_no_recompile_and_no_host_read():
        """Quantize + GEMM under torch.compile: one graph for every routing, offs never read on the host."""
        grad, x = torch.randn(96, 16), torch.randn(96, 24)

        def wgrad(grad, x, offs):
            g = quantize_grouped_columnwise(grad, offs, E5M2, 32)
            q = quantize_grouped_columnwise(x, offs, E4M3, 32)
            return ops_grouped.fp8_grouped_gemm_wgrad_blockwise(g.data_t, g.scale_inv_t, q.data_t, q.scale_inv_t,
                                                                offs, torch.float32, 32)

        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(wgrad, backend=counter, fullgraph=True)
        for sizes in ([30, 30, 36], [0, 90, 6], [5, 0, 60]):
            offs = offsets(sizes)
            with host_reads_of(offs) as reads:
                out = compiled(grad, x, offs)
            assert reads == []
            assert torch.equal(out, wgrad(grad, x, offs))
        assert counter.frame_count == 1

    _BAD = [
        ("token_block", lambda a: a.update(token_block=64), ValueError, "token_block"),
        ("scale dtype", lambda a: a.update(grad_t_scale_inv=a["grad_t_scale_inv"].float()), TypeError,
         "grad_t_scale_inv"),
        ("scale shape", lambda a: a.update(x_t_scale_inv=a["x_t_scale_inv"][:, :-1].contiguous()), ValueError,
         "x_t_scale_inv"),
        ("token count", lambda a: a.update(x_t=a["x_t"][:, :-1].contiguous()), ValueError, "same columns"),
        ("offs dtype", lambda a: a.update(offs=a["offs"].long()), TypeError, "offs"),
        ("hp operand", lambda a: a.update(grad_t=a["grad_t"].float()), TypeError, "grad_t"),
    ]

    @pytest.mark.parametrize("name, change, error, match", _BAD, ids=[case[0] for case in _BAD])
    def test_bad_input(name, change, error, match):
        grad_t, sg, x_t, sx, offs = grouped_copies(70, 16, 24, [20, 0, 50], 32)
        args = {"grad_t": grad_t, "grad_t_scale_inv": sg, "x_t": x_t, "x_t_scale_inv": sx, "offs": offs,
                "out_dtype": torch.float32, "token_block": 32}
        change(args)
        with pytest.raises(error, match=match):
            ops_grouped.fp8_grouped_gemm_wgrad_blockwise(**args)

    def test_bad_offs_values_are_named_by_the_kernel():
        grad_t, sg, x_t, sx, _ = grouped_copies(70, 16, 24, [20, 0, 50], 128)
        decreasing = torch.tensor([30, 20, 70], dtype=torch.int32)
        with pytest.raises(ValueError, match="offs"):
            ops_grouped.fp8_grouped_gemm_wgrad_blockwise(grad_t, sg, x_t, sx, decreasing, torch.float32, 128)

    def test_triton_kernels_interpreted(tmp_path):
        run_interpreted(__file__, tmp_path)

else:
    import transformer_linear.ops.triton as kernels

    @pytest.mark.parametrize("token_block", TOKEN_BLOCKS)
    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_triton_matches_reference(token_block, pattern):
        total, n, k = 150, 20, 24
        check_wgrad_blockwise(kernels.fp8_grouped_gemm_wgrad_blockwise, total, n, k, routing(pattern, total, 4),
                              token_block, torch.float32, what=f"{token_block} {pattern}")

    @pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
    def test_triton_output_dtypes(out_dtype):
        check_wgrad_blockwise(kernels.fp8_grouped_gemm_wgrad_blockwise, 90, 20, 18, [33, 0, 57], 32, out_dtype)
