"""Grouped FP8 GEMMs (ops.grouped): the CPU kernel on every ISA path and the Triton kernels (under
TRITON_INTERPRET=1) against the float64 oracle (reference.grouped), over scalings, output dtypes
and routings; the ops under opcheck and torch.compile; no host read of ``offs``; bad input.

Triton: as in test_blockwise_triton.py, TRITON_INTERPRET=1 must be set before triton is imported,
so a normal run holds one test that runs this module again in a fresh interpreter with the
variable set, where only the Triton tests are defined.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from blockwise_cases import E4M3, E5M2, E8M0
from grouped_cases import PATTERNS, dequantized_grouped_fp32, host_reads_of, nothing, offsets, routing
from large_outputs import large_output_rows
from tolerances import assert_bitwise_equal, assert_close_to_reference, assert_grouped_close_to_reference
from triton_interpreted import run_interpreted

from transformer_linear import reference
from transformer_linear.reference import grouped as reference_grouped

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SCALINGS = ["tensorwise", "rowwise", "1x128_x_128x128", "mx"]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]




def _quantize(x: torch.Tensor, fmt, scaling: str, operand: str):
    """(q, scale_inv) of one 2-D operand ('a' or a weight 'b') under a grouped scaling."""
    if scaling == "tensorwise":
        q, s, _ = reference.quantize_current(x, fmt)
        return q, (s if operand == "a" else s.reshape(()))
    block, scale_dtype = {
        "rowwise": ((1, max(x.shape[1], 1)), torch.float32),
        "1x128_x_128x128": ((1, 128) if operand == "a" else (128, 128), torch.float32),
        "mx": ((1, 32), E8M0),
    }[scaling]
    return reference.quantize_blockwise_ref(x, fmt, block, scale_dtype, power_2_scale=scaling == "rowwise")


def grouped_operands(total, groups, n, k, scaling, a_fmt=E4M3, b_fmt=E4M3, spread=6):
    """(a, a_scale_inv, b, b_scale_inv): rows of a and columns of b over 2^-spread..2^spread."""
    a_hp = torch.randn(total, k) * torch.exp2(torch.randint(-spread, spread + 1, (total, 1)).float())
    b_hp = torch.randn(groups, n, k) * torch.exp2(torch.randint(-spread, spread + 1, (groups, 1, k)).float())
    a, sa = _quantize(a_hp, a_fmt, scaling, "a")
    weights = [_quantize(b_hp[g], b_fmt, scaling, "b") for g in range(groups)]
    b = torch.stack([q for q, _ in weights]) if groups else torch.empty(0, n, k, dtype=b_fmt)
    sb = torch.stack([s for _, s in weights]) if groups else torch.empty(0)
    return a, sa, b, sb


def check_grouped(fn, a, sa, b, sb, offs, out_dtype, bias=None, what=""):
    out = fn(a, sa, b, sb, offs, out_dtype, bias)
    assert out.dtype == out_dtype
    expected = reference_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float64, bias)
    baseline = dequantized_grouped_fp32(a, sa, b, sb, offs, out_dtype, bias)
    bounds = reference_grouped.group_bounds(offs, a.shape[0])
    assert_grouped_close_to_reference(out, expected, baseline, bounds, what=what)


def check_wgrad(fn, total, n, k, sizes, out_dtype, what=""):
    grad, s_grad = reference.quantize_current(torch.randn(total, n) * 4, E5M2)[:2]
    x, s_x = reference.quantize_current(torch.randn(total, k), E4M3)[:2]
    offs = offsets(sizes)
    out = fn(grad, s_grad, x, s_x, offs, out_dtype)
    expected = reference_grouped.fp8_grouped_gemm_wgrad(grad, s_grad, x, s_x, offs, torch.float64)
    assert out.shape == (len(sizes), n, k) and out.dtype == out_dtype
    x_deq = x.float() * s_x
    grad_deq = grad.float() * s_grad
    for g, (start, end) in enumerate(reference_grouped.group_bounds(offs, total)):
        baseline = (grad_deq[start:end].t() @ x_deq[start:end]).to(out_dtype)
        assert_close_to_reference(out[g], expected[g], baseline, what=f"{what} group {g}")


if not INTERPRETED:
    import torch._dynamo.testing
    from cpu_paths import SUPPORTED_ISAS

    from transformer_linear import _C
    from transformer_linear.ops import grouped as ops_grouped
    from transformer_linear.ops.descriptors import desc

    @pytest.fixture(params=SUPPORTED_ISAS)
    def cpu_isa(request):
        """Every CPU path this machine runs (packing, micro-kernel and promotion differ)."""
        _C.set_cpu_isa(request.param)
        yield request.param
        _C.set_cpu_isa("auto")

    @pytest.mark.parametrize("scaling", SCALINGS)
    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_cpu_matches_reference(cpu_isa, scaling, pattern):
        """K past one cache chunk and not a multiple of the blocks; N not a multiple of the tiles."""
        total, groups, n, k = 203, 5, 70, 600
        a, sa, b, sb = grouped_operands(total, groups, n, k, scaling)
        offs = offsets(routing(pattern, total, groups))
        check_grouped(ops_grouped.fp8_grouped_gemm, a, sa, b, sb, offs, torch.float32,
                      what=f"{cpu_isa} {scaling} {pattern}")

    @pytest.mark.parametrize("scaling", SCALINGS)
    @pytest.mark.parametrize("out_dtype", OUT_DTYPES)
    @pytest.mark.parametrize("a_fmt, b_fmt", [(E4M3, E4M3), (E5M2, E4M3)])
    def test_cpu_output_dtypes_formats_and_bias(scaling, out_dtype, a_fmt, b_fmt):
        total, groups, n, k = 150, 4, 130, 260
        # Magnitudes that keep float16 outputs finite.
        a, sa, b, sb = grouped_operands(total, groups, n, k, scaling, a_fmt, b_fmt, spread=2)
        bias = torch.randn(groups, n).to(out_dtype)
        offs = offsets(routing("skewed", total, groups))
        check_grouped(ops_grouped.fp8_grouped_gemm, a, sa, b, sb, offs, out_dtype, bias,
                      what=f"{scaling} {a_fmt} x {b_fmt} -> {out_dtype}")

    @pytest.mark.parametrize("scaling", SCALINGS)
    def test_cpu_wide_skewed_routing_spreads_over_threads(scaling):
        """One group with nearly every row and several threads: the same result as one thread,
        bit for bit (tiles change with the thread count, each element's sum order does not)."""
        total, groups, n, k = 700, 8, 96, 256
        a, sa, b, sb = grouped_operands(total, groups, n, k, scaling)
        offs = offsets([650] + [7] * 7)
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)
            torch.set_num_threads(4)
            four = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(one, four)
        check_grouped(ops_grouped.fp8_grouped_gemm, a, sa, b, sb, offs, torch.float32, what=scaling)

    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("scaling", ["tensorwise", "1x128_x_128x128"])
    def test_cpu_large_output_matches_each_group_alone(cpu_isa, scaling, out_dtype):
        """An output large enough to be streamed has the bits of each group's rows run as a grouped GEMM
        of one group (each element's sum order is the same); N = 2049 leaves the rows' ends off a line."""
        groups, n, k = 4, 2049, 300
        total = large_output_rows(n, out_dtype)
        a, sa, b, sb = grouped_operands(total, groups, n, k, scaling)
        offs = offsets(routing("uniform", total, groups))
        out = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, out_dtype)
        for g, (start, end) in enumerate(reference_grouped.group_bounds(offs, total)):
            sa_g = sa[start:end] if sa.dim() and sa.shape[0] == total else sa
            alone = ops_grouped.fp8_grouped_gemm(a[start:end], sa_g, b[g : g + 1], sb[g : g + 1],
                                                 offsets([end - start]), out_dtype)
            assert_bitwise_equal(out[start:end], alone, what=f"{cpu_isa} {scaling} group {g}")
        check_grouped(ops_grouped.fp8_grouped_gemm, a, sa, b, sb, offs, out_dtype, what=f"{cpu_isa} {scaling}")

    @pytest.mark.parametrize("total, groups, n, k", [(0, 3, 8, 64), (5, 0, 8, 64), (6, 3, 0, 64), (6, 3, 8, 0)])
    def test_cpu_empty_sizes(total, groups, n, k):
        """No tokens, no groups, no output columns, an empty contraction (out = bias per group)."""
        a, sa, b, sb = grouped_operands(total, groups, n, k, "tensorwise")
        sizes = routing("uniform", total, groups) if groups else []
        offs = offsets(sizes)
        bias = torch.randn(groups, n)
        out = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32, bias)
        expected = reference_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32, bias)
        assert out.shape == (total, n)
        assert torch.equal(out, expected)

    @pytest.mark.parametrize("pattern", PATTERNS)
    @pytest.mark.parametrize("out_dtype", OUT_DTYPES)
    def test_cpu_wgrad(cpu_isa, pattern, out_dtype):
        total, n, k = 300, 40, 72
        check_wgrad(ops_grouped.fp8_grouped_gemm_wgrad, total, n, k, routing(pattern, total, 4), out_dtype,
                    what=f"{cpu_isa} {pattern} -> {out_dtype}")

    def test_cpu_wgrad_long_groups():
        """Groups with more rows than one cache chunk of the contraction."""
        check_wgrad(ops_grouped.fp8_grouped_gemm_wgrad, 1100, 24, 40, [700, 0, 400], torch.float32)

    def _sample_inputs():
        a, sa, b, sb = grouped_operands(37, 4, 20, 96, "1x128_x_128x128")
        offs = offsets([10, 0, 20, 5])
        return a, sa, b, sb, offs

    # test_schema compares inputs with arithmetic that FP8 tensors lack; that the ops leave their
    # inputs unchanged is test_operands_unchanged's.
    _OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

    def test_opcheck_forward():
        a, sa, b, sb, offs = _sample_inputs()
        op = torch.ops.transformer_linear.fp8_grouped_gemm.default
        torch.library.opcheck(op, (a, sa, b, sb, offs, torch.bfloat16, None, [1, 128], [128, 128]),
                              test_utils=_OPCHECK_UTILS)
        bias = torch.randn(4, 20)
        a, sa, b, sb = grouped_operands(37, 4, 20, 96, "tensorwise")
        torch.library.opcheck(op, (a, sa, b, sb, offs, torch.float32, bias, [0, 0], [0, 0]), test_utils=_OPCHECK_UTILS)

    def test_operands_unchanged():
        a, sa, b, sb = grouped_operands(37, 4, 20, 96, "mx")
        offs = offsets([10, 0, 20, 5])
        inputs = (a, sa, b, sb, offs)
        before = [t.clone() for t in inputs]
        ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)
        ops_grouped.fp8_grouped_gemm_wgrad(a, torch.ones(1), a, torch.ones(1), offs, torch.float32)
        for t, saved in zip(inputs, before):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               saved.view(torch.uint8) if saved.element_size() == 1 else saved)

    def test_opcheck_wgrad():
        grad, s_grad = reference.quantize_current(torch.randn(40, 16), E5M2)[:2]
        x, s_x = reference.quantize_current(torch.randn(40, 24), E4M3)[:2]
        op = torch.ops.transformer_linear.fp8_grouped_gemm_wgrad.default
        args = (grad, s_grad, x, s_x, offsets([10, 0, 30]), torch.float32)
        torch.library.opcheck(op, args, test_utils=_OPCHECK_UTILS)

    def test_compile_changing_offs_no_recompile_no_graph_break():
        """One graph for every routing: offs values change, nothing recompiles, nothing breaks."""
        a, sa, b, sb = grouped_operands(64, 4, 24, 128, "mx")
        grad, s_grad = reference.quantize_current(torch.randn(64, 24), E5M2)[:2]

        def moe(a, sa, b, sb, offs, grad, s_grad):
            y = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)
            dw = ops_grouped.fp8_grouped_gemm_wgrad(grad, s_grad, a, torch.ones(1), offs, torch.float32)
            return y * 2, dw

        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(moe, backend=counter, fullgraph=True)
        for pattern in ["uniform", "skewed", "empty_groups", "one_group"]:
            offs = offsets(routing(pattern, 64, 4))
            with torch._dynamo.config.patch(error_on_recompile=True) if counter.frame_count else nothing():
                y, dw = compiled(a, sa, b, sb, offs, grad, s_grad)
            y_eager, dw_eager = moe(a, sa, b, sb, offs, grad, s_grad)
            assert torch.equal(y, y_eager) and torch.equal(dw, dw_eager), pattern
        assert counter.frame_count == 1

    @pytest.mark.parametrize("scaling", SCALINGS)
    def test_compile_dynamic_token_count_one_graph(scaling):
        """The token count is symbolic: the scale shapes are checked without guarding on it."""
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

        def moe(a, sa, b, sb, offs):
            return ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)

        compiled = torch.compile(moe, backend=counter, fullgraph=True, dynamic=True)
        for total in (64, 40, 130):
            a, sa, b, sb = grouped_operands(total, 4, 24, 128, scaling)
            offs = offsets(routing("skewed", total, 4))
            assert torch.equal(compiled(a, sa, b, sb, offs), moe(a, sa, b, sb, offs)), total
        assert counter.frame_count == 1

    @pytest.mark.parametrize("scaling", SCALINGS)
    def test_no_host_read_of_offs(scaling):
        a, sa, b, sb = grouped_operands(50, 4, 16, 64, scaling)
        offs = offsets([10, 0, 30, 5])
        grad, s_grad = reference.quantize_current(torch.randn(50, 16), E5M2)[:2]
        with host_reads_of(offs) as reads:
            ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16)
            ops_grouped.fp8_grouped_gemm_wgrad(grad, s_grad, a, torch.ones(1), offs, torch.float32)
        assert reads == []
        # The detector does see a host read: the oracle's.
        with host_reads_of(offs) as reads:
            reference_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)
        assert reads == ["tolist"]

    def _bad_forward_cases():
        a, sa, b, sb = grouped_operands(20, 3, 8, 64, "tensorwise")
        _, sa_blk, _, sb_blk = grouped_operands(20, 3, 8, 64, "1x128_x_128x128")
        offs = torch.tensor([5, 10, 20], dtype=torch.int32)
        ok = dict(a=a, a_scale_inv=sa, b=b, b_scale_inv=sb, offs=offs, out_dtype=torch.float32, bias=None)
        return ok, [
            ("a_not_tensor", dict(a=[1.0]), TypeError, "argument 'a' must be a torch.Tensor"),
            ("a_bf16", dict(a=a.to(torch.bfloat16)), TypeError, "argument 'a' must be torch.float8"),
            ("a_3d", dict(a=a.reshape(1, 20, 64)), ValueError, "argument 'a' must be 2-D"),
            ("b_2d", dict(b=b[0]), ValueError, "argument 'b' must be 3-D"),
            ("b_inner", dict(b=b[:, :, :32].contiguous()), ValueError, "inner dimensions differ"),
            ("offs_int64", dict(offs=offs.long()), TypeError, "argument 'offs' must have dtype torch.int32"),
            ("offs_2d", dict(offs=offs.reshape(1, 3)), ValueError, "argument 'offs' must be 1-D"),
            ("offs_length", dict(offs=offs[:2]), ValueError, "argument 'offs' must have one entry per group"),
            ("offs_meta", dict(offs=offs.to("meta")), TypeError, "argument 'offs' must be on cpu"),
            ("b_meta", dict(b=b.to("meta")), TypeError, "argument 'b' must be on cpu"),
            ("offs_decreasing", dict(offs=torch.tensor([10, 5, 20], dtype=torch.int32)), ValueError,
             "'offs' must be non-decreasing"),
            ("offs_negative", dict(offs=torch.tensor([-1, 10, 20], dtype=torch.int32)), ValueError,
             "'offs' must be non-decreasing and non-negative"),
            ("offs_past_rows", dict(offs=torch.tensor([5, 10, 21], dtype=torch.int32)), ValueError,
             "'offs' must not pass the 20 rows"),
            ("out_dtype", dict(out_dtype=torch.int32), TypeError, "argument 'out_dtype'"),
            ("bias_shape", dict(bias=torch.zeros(8)), ValueError, "argument 'bias' must be 2-D"),
            ("bias_dtype", dict(bias=torch.zeros(3, 8, dtype=torch.bfloat16)), TypeError, "argument 'bias'"),
            ("b_scale_shape", dict(b_scale_inv=sb[:2]), ValueError, "unsupported 'b_scale_inv'"),
            ("a_scale_for_blocks", dict(b_scale_inv=sb_blk), ValueError, "pairs with BlockWise1x128 'a_scale_inv'"),
            ("a_scale_rows", dict(a_scale_inv=sa_blk[:5], b_scale_inv=sb_blk), ValueError,
             "'a_scale_inv' of shape"),
            ("scale_uint8", dict(a_scale_inv=sa.to(torch.uint8)), TypeError, "argument 'a_scale_inv'"),
            ("scale_zero", dict(b_scale_inv=torch.tensor([1.0, 0.0, 1.0])), ValueError,
             "argument 'b_scale_inv' must be a positive finite scale"),
        ]

    _OK, _BAD = _bad_forward_cases()

    def test_bad_input_cases_start_from_a_valid_call():
        ok = _OK
        check_grouped(ops_grouped.fp8_grouped_gemm, ok["a"], ok["a_scale_inv"], ok["b"], ok["b_scale_inv"], ok["offs"],
                      torch.float32)

    @pytest.mark.parametrize("name, change, error, match", _BAD, ids=[case[0] for case in _BAD])
    def test_bad_input(name, change, error, match):
        with pytest.raises(error, match=match):
            ops_grouped.fp8_grouped_gemm(**{**_OK, **change})

    def test_bad_input_reaches_the_kernel_checks():
        """Called through torch.ops (no Python entry before it), the op still names the argument."""
        ok = _OK
        op = torch.ops.transformer_linear.fp8_grouped_gemm
        with pytest.raises(ValueError, match="'offs' must not pass"):
            op(ok["a"], ok["a_scale_inv"], ok["b"], ok["b_scale_inv"], torch.tensor([5, 10, 99], dtype=torch.int32),
               torch.float32, None, [0, 0], [0, 0])
        with pytest.raises(ValueError, match="argument 'a_scale_inv' must have shape \\[20, 1\\]"):
            op(ok["a"], ok["a_scale_inv"], ok["b"], ok["b_scale_inv"], ok["offs"], torch.float32, None,
               [1, 128], [128, 128])

    @pytest.mark.parametrize("scaling", SCALINGS)
    def test_scalings_given_by_the_caller(scaling):
        """A caller that knows the scalings (a Linear's quantizers) passes them: the same result; a wrong
        name is a ValueError listing the pairs."""
        a, sa, b, sb = grouped_operands(40, 3, 16, 160, scaling)
        offs = offsets([10, 0, 30])
        pair = {"tensorwise": ("TensorWise", "TensorWise"), "rowwise": ("RowWise", "RowWise"),
                "1x128_x_128x128": ("BlockWise1x128", "BlockWise128x128"), "mx": ("BlockWise1x32", "BlockWise1x32")}
        got = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32, scalings=pair[scaling])
        assert torch.equal(got, ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32))
        with pytest.raises(ValueError, match="scalings"):
            ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32, scalings=("RowWise", "TensorWise"))

    def _walk_arguments() -> dict[str, dict]:
        """Well-formed CPU arguments of each public function of ops_grouped."""
        a, sa, b, sb = grouped_operands(24, 3, 8, 128, "1x128_x_128x128")
        grad, s_grad = reference.quantize_current(torch.randn(24, 8), E5M2)[:2]
        offs = torch.tensor([4, 4, 20], dtype=torch.int32)
        return {
            "fp8_grouped_gemm": dict(a=a, a_scale_inv=sa, b=b, b_scale_inv=sb, offs=offs, out_dtype=torch.float32,
                                     bias=torch.zeros(3, 8)),
            "fp8_grouped_gemm_wgrad": dict(grad=grad, grad_scale_inv=s_grad, x=a, x_scale_inv=torch.ones(1),
                                           offs=offs, out_dtype=torch.float32),
            "fp8_grouped_gemm_wgrad_blockwise": dict(
                grad_t=grad.t().contiguous(), grad_t_scale_inv=torch.ones(8, 3).to(E8M0), x_t=a.t().contiguous(),
                x_t_scale_inv=torch.ones(128, 3).to(E8M0), offs=offs, out_dtype=torch.float32, token_block=32,
            ),
        }

    _WALK = [
        (op, arg, kind)
        for op, args in _walk_arguments().items()
        for arg, value in args.items()
        if isinstance(value, torch.Tensor)
        for kind in ("meta", "uint8")
    ]

    def test_every_public_function_is_walked():
        public = sorted(n for n in ops_grouped.__all__ if callable(getattr(ops_grouped, n)))
        assert public == sorted(_walk_arguments())

    @pytest.mark.parametrize("op, arg, kind", _WALK, ids=lambda v: v)
    def test_meta_or_uint8_argument_is_named(op, arg, kind):
        """As tests/test_bad_input.py holds for ops: a clear error naming the argument and the kind."""
        args = _walk_arguments()[op]
        t = args[arg]
        # uint8: the bytes of one-byte tensors (FP8 data, E8M0 scales), the values of others.
        as_uint8 = t.view(torch.uint8) if t.element_size() == 1 else t.to(torch.uint8)
        args[arg] = t.to("meta") if kind == "meta" else as_uint8
        with pytest.raises((TypeError, ValueError), match=rf"(?=.*'{arg}')(?=.*\b{kind}\b)"):
            getattr(ops_grouped, op)(**args)

    def test_more_rows_than_int32_offs_address():
        """offs is int32: the kernel refuses more token rows than it can address (checked from the
        descriptor's shape, before any memory is read)."""
        a, sa, b, sb = grouped_operands(4, 2, 8, 64, "tensorwise")
        offs = torch.tensor([2, 4], dtype=torch.int32)
        out = torch.empty(4, 8)
        rows = 2**31
        huge_a = (a.data_ptr(), 3, (rows, 64), (64, 1), 0, -1)  # a forged shape: never read
        with pytest.raises(ValueError, match="more than the int32 'offs' can address"):
            _C.fp8_grouped_gemm(huge_a, desc(sa.reshape(1, 1), "t", "sa"), desc(b, "t", "b"),
                                desc(sb.reshape(2, 1, 1), "t", "sb"), desc(offs, "t", "offs"), 0, 0, 0, 0, None,
                                desc(out, "t", "d"))
        huge_grad = (a.data_ptr(), 3, (rows, 64), (64, 1), 0, -1)
        with pytest.raises(ValueError, match="more than the int32 'offs' can address"):
            _C.fp8_grouped_gemm_wgrad(huge_grad, desc(sa, "t", "g"), huge_grad, desc(sa, "t", "x"),
                                      desc(offs, "t", "offs"), desc(torch.empty(2, 64, 64), "t", "d"))

    def test_bad_wgrad_input():
        grad, s_grad = reference.quantize_current(torch.randn(20, 8), E5M2)[:2]
        x, s_x = reference.quantize_current(torch.randn(20, 16), E4M3)[:2]
        offs = torch.tensor([5, 20], dtype=torch.int32)
        wgrad = ops_grouped.fp8_grouped_gemm_wgrad
        with pytest.raises(ValueError, match="tensorwise scales only"):
            wgrad(grad, torch.ones(20, 1), x, s_x, offs, torch.float32)
        with pytest.raises(ValueError, match="tensorwise scales only"):
            wgrad(grad, s_grad, x, torch.ones(20, 1, dtype=E8M0), offs, torch.float32)
        with pytest.raises(ValueError, match="same rows"):
            wgrad(grad, s_grad, x[:10], s_x, offs, torch.float32)
        with pytest.raises(TypeError, match="'offs' must have dtype torch.int32"):
            wgrad(grad, s_grad, x, s_x, offs.long(), torch.float32)
        with pytest.raises(ValueError, match="'offs' must be non-decreasing"):
            wgrad(grad, s_grad, x, s_x, torch.tensor([7, 3], dtype=torch.int32), torch.float32)
        with pytest.raises(TypeError, match="argument 'x' must be on cpu"):
            wgrad(grad, s_grad, x.to("meta"), s_x, offs, torch.float32)

    def test_meta_tensors_give_the_output_shape():
        a, sa, b, sb = (t.to("meta") for t in grouped_operands(33, 3, 8, 64, "rowwise"))
        out = ops_grouped.fp8_grouped_gemm(a, sa, b, sb, offsets([1, 2, 3]).to("meta"), torch.bfloat16)
        assert out.shape == (33, 8) and out.device.type == "meta" and out.dtype == torch.bfloat16

    @pytest.mark.parametrize("e8m0, a_type, out_type", [(False, "fp8e4nv", "bf16"), (True, "fp8e5", "fp32")])
    def test_triton_kernels_compile_for_hopper(e8m0, a_type, out_type):
        """The GPU compiler (no GPU needed) accepts what the interpreter runs: it types more strictly."""
        triton = pytest.importorskip("triton", reason="triton is in the 'test' extra")
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415 (optional dependency)
        from triton.compiler import ASTSource  # noqa: PLC0415

        # By module path: the package's attribute of that name is the function it re-exports.
        module = importlib.import_module("transformer_linear.ops.triton.gemm_grouped")
        target = GPUTarget("cuda", 90, 32)
        scale = "*u8" if e8m0 else "*fp32"
        pointers = {"a_ptr": f"*{a_type}", "b_ptr": "*fp8e4nv", "d_ptr": f"*{out_type}", "sa_ptr": scale,
                    "sb_ptr": scale, "bias_ptr": f"*{out_type}", "offs_ptr": "*i32"}
        consts = {"HAS_BIAS": True, "E8M0": e8m0, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}
        kernel = module._grouped_gemm_kernel
        signature = {name: pointers.get(name, "constexpr" if name in consts else "i32") for name in kernel.arg_names}
        assert triton.compile(ASTSource(kernel, signature, consts), target=target).asm["ptx"]
        consts = {"BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_R": 64}
        pointers = {"grad_ptr": f"*{a_type}", "x_ptr": "*fp8e4nv", "d_ptr": f"*{out_type}", "sg_ptr": "*fp32",
                    "sx_ptr": "*fp32", "offs_ptr": "*i32"}
        kernel = module._grouped_wgrad_kernel
        signature = {name: pointers.get(name, "constexpr" if name in consts else "i32") for name in kernel.arg_names}
        assert triton.compile(ASTSource(kernel, signature, consts), target=target).asm["ptx"]
        consts = {"E8M0": e8m0, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_R": 32 if e8m0 else 64}
        pointers = {"grad_ptr": f"*{a_type}", "x_ptr": "*fp8e4nv", "d_ptr": f"*{out_type}", "sg_ptr": scale,
                    "sx_ptr": scale, "offs_ptr": "*i32"}
        kernel = module._grouped_wgrad_blockwise_kernel
        signature = {name: pointers.get(name, "constexpr" if name in consts else "i32") for name in kernel.arg_names}
        assert triton.compile(ASTSource(kernel, signature, consts), target=target).asm["ptx"]

    def test_triton_kernels_interpreted(tmp_path):
        run_interpreted(__file__, tmp_path)

else:
    import transformer_linear.ops.triton as kernels

    @pytest.mark.parametrize("scaling", SCALINGS)
    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_triton_matches_reference(scaling, pattern):
        total, groups, n, k = 45, 4, 20, 160
        a, sa, b, sb = grouped_operands(total, groups, n, k, scaling)
        offs = offsets(routing(pattern, total, groups))
        check_grouped(kernels.fp8_grouped_gemm, a, sa, b, sb, offs, torch.float32, what=f"{scaling} {pattern}")

    @pytest.mark.parametrize("scaling", SCALINGS)
    @pytest.mark.parametrize("out_dtype", OUT_DTYPES)
    def test_triton_output_dtypes_and_bias(scaling, out_dtype):
        total, groups, n, k = 40, 3, 18, 96
        a, sa, b, sb = grouped_operands(total, groups, n, k, scaling, E5M2, E4M3, spread=2)
        bias = torch.randn(groups, n).to(out_dtype)
        offs = offsets(routing("skewed", total, groups))
        check_grouped(kernels.fp8_grouped_gemm, a, sa, b, sb, offs, out_dtype, bias, what=f"{scaling} {out_dtype}")

    def test_triton_empty_sizes():
        for total, groups, n, k in [(0, 3, 8, 32), (5, 0, 8, 32), (6, 3, 8, 0)]:
            a, sa, b, sb = grouped_operands(total, groups, n, k, "tensorwise")
            offs = offsets(routing("uniform", total, groups) if groups else [])
            bias = torch.randn(groups, n)
            out = kernels.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32, bias)
            assert torch.equal(out, reference_grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32, bias))

    def test_triton_bad_offs_stay_in_bounds():
        """offs past the rows are clamped (no check on the GPU: it would sync): the groups end at the rows."""
        a, sa, b, sb = grouped_operands(30, 3, 8, 32, "rowwise")
        out = kernels.fp8_grouped_gemm(a, sa, b, sb, torch.tensor([10, 20, 1000], dtype=torch.int32), torch.float32)
        expected = reference_grouped.fp8_grouped_gemm(a, sa, b, sb, offsets([10, 10, 10]), torch.float32)
        assert_close_to_reference(out, expected)

    @pytest.mark.parametrize("pattern", PATTERNS)
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    def test_triton_wgrad(pattern, out_dtype):
        total, n, k = 90, 20, 24
        check_wgrad(kernels.fp8_grouped_gemm_wgrad, total, n, k, routing(pattern, total, 4), out_dtype,
                    what=f"{pattern} {out_dtype}")
