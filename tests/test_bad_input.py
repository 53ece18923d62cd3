"""Bad input to the public API: a TypeError or ValueError naming the argument, never a crash or garbage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import transformer_linear as tl
from transformer_linear import _C, ops, recipe
from transformer_linear import reference as ref
from transformer_linear._tensor import desc

E4M3 = torch.float8_e4m3fn


def one() -> torch.Tensor:
    return torch.ones(1)


def raw(t: torch.Tensor, shape=None, strides=None, device: int = 0) -> tuple:
    """A descriptor tuple with hand-set fields (torch cannot make negative strides)."""
    d = desc(t, "test", "t")
    return (d[0], d[1], d[2] if shape is None else shape, d[3] if strides is None else strides, device, -1)


def call_quantize(x, output=None, output_t=None, scale=None, margin=0):
    """_C.quantize with well-formed defaults for every argument but the ones given."""
    x = x if isinstance(x, tuple) else desc(x, "test", "input")
    if output is None and output_t is None:
        output = desc(torch.empty(4, dtype=E4M3), "test", "output")
    return _C.quantize(
        x,
        scale if scale is not None else desc(one(), "test", "scale"),
        output,
        output_t,
        desc(torch.empty(1), "test", "scale_inv"),
        desc(torch.empty(()), "test", "amax"),
        None,
        False,
        margin,
    )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ops.quantize(torch.ones(4, dtype=torch.int32), one(), E4M3), TypeError, "'input' must have dtype"),
        (lambda: ops.quantize(torch.ones(4, dtype=torch.float64), one(), E4M3), TypeError, "'input' .*got float64"),
        (lambda: ops.quantize(torch.ones(4), one(), torch.float16), TypeError, "'dtype' must be torch.float8"),
        (lambda: ops.quantize(torch.ones(4), one(), "float8"), TypeError, "'dtype'"),
        (lambda: ops.quantize(torch.ones(4, 4).t(), one(), E4M3), ValueError, "'input' must be contiguous"),
        (lambda: ops.quantize(torch.ones(4, 8)[:, ::2], one(), E4M3), ValueError, "'input' must be contiguous"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(2), E4M3), ValueError, "'scale' must be a one-element"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(1, 1), E4M3), ValueError, "'scale' must be a one-element"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(1, dtype=torch.float64), E4M3), TypeError, "'scale' must have dtype float32"),
        (lambda: ops.quantize(torch.ones(4), torch.ones(1, device="meta"), E4M3), TypeError, "'scale' must be on cpu"),
        (lambda: ops.quantize([1.0, 2.0], one(), E4M3), TypeError, "'input' must be a torch.Tensor, got list"),
        (lambda: ops.quantize(torch.ones(4), 1.0, E4M3), TypeError, "'scale' must be a torch.Tensor, got float"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=-1), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=1.0), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=math.nan), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=127), ValueError, "'margin'"),
        (lambda: ops.quantize_current(torch.ones(4), E4M3, margin=True), ValueError, "'margin'"),
        (lambda: ops.quantize_fused(torch.ones(4), E4M3, rowwise=False), ValueError, "'rowwise' and 'columnwise'"),
        (lambda: ops.quantize_fused(torch.ones(4), E4M3, dbias_dtype=torch.int8), TypeError, "'dbias_dtype'"),
        (lambda: ops.quantize(torch.ones([1] * 9), one(), E4M3), ValueError, "rank 9 exceeds"),
        (lambda: ops.amax(torch.ones(4, dtype=torch.int64)), TypeError, "amax: argument 'input' must have dtype"),
        (lambda: ops.amax(3.0), TypeError, "amax: argument 'input' must be a torch.Tensor"),
        (lambda: ops.amax(torch.ones(4, 4).t()), ValueError, "amax: argument 'input' must be contiguous"),
        (lambda: ops.dequantize(torch.ones(4), one(), torch.float32), TypeError, "dequantize: argument 'input'"),
        (lambda: ops.dequantize(torch.ones(4).to(E4M3), one(), torch.int32), TypeError, "'out_dtype'"),
        (lambda: ops.dequantize(torch.ones(4).to(E4M3), torch.ones(3), torch.float32), ValueError, "'scale_inv'"),
        (lambda: ops.dequantize(torch.ones(4, 4).to(E4M3).t(), one(), torch.float32), ValueError, "'input' must be contiguous"),
        (lambda: ops.dequantize(torch.ones(4).to(E4M3), None, torch.float32), TypeError, "'scale_inv' must be a torch.Tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_public_functions_reject(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_meta_tensors_take_the_fake_path():
    """All-meta arguments trace shapes (torch.compile's fake tensors) rather than fail."""
    out = ops.quantize_fused(torch.ones(3, 4, device="meta"), E4M3, columnwise=True)
    assert out.data.device.type == "meta" and out.data_t.shape == (4, 3)


def test_meta_descriptor_reaching_the_kernel():
    with pytest.raises((TypeError, ValueError), match="'input'"):
        call_quantize(torch.ones(4, device="meta"))


def test_unknown_device_code():
    with pytest.raises(TypeError, match="'input' must be on cpu or cuda, got an unsupported device"):
        call_quantize(raw(torch.ones(4), device=2))


def test_negative_stride():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="'input' has a negative stride"):
        call_quantize(raw(x, strides=(-1,)))


def test_rank_above_eight_descriptor():
    x = torch.ones(1)
    with pytest.raises(ValueError, match="rank 9 exceeds"):
        call_quantize(raw(x, shape=(1,) * 9, strides=(1,) * 9))


def test_output_shape_mismatch():
    with pytest.raises(ValueError, match="'output' must have the shape of 'input'"):
        call_quantize(torch.ones(5))
    with pytest.raises(ValueError, match="'output_t' must have shape"):
        call_quantize(torch.ones(2, 3), output_t=desc(torch.empty(2, 3, dtype=E4M3), "t", "output_t"))


def test_margin_out_of_range_at_the_kernel():
    with pytest.raises(ValueError, match="'margin' must be in"):
        call_quantize(torch.ones(4), margin=-5)


def test_descriptor_that_is_not_a_tuple():
    with pytest.raises(TypeError):
        _C.amax([1, 2, 3], desc(torch.empty(()), "t", "amax"))


# ---------------------------------------------------------------------------
# One device for every argument (issue 11 item 4)
# ---------------------------------------------------------------------------


def gemm_operands(m: int = 4, n: int = 3, k: int = 8) -> dict:
    a, sa, _ = ops.quantize_current(torch.randn(m, k), E4M3)
    b, sb, _ = ops.quantize_current(torch.randn(n, k), E4M3)
    return {"a": a, "a_scale_inv": sa, "b": b, "b_scale_inv": sb}


def call_op(name: str, args: dict):
    """Call the public op ``name`` with its arguments by name (positional ones first)."""
    if name == "amax":
        return ops.amax(args["input"])
    if name == "quantize":
        return ops.quantize(args["input"], args["scale"], E4M3)
    if name == "dequantize":
        return ops.dequantize(args["input"], args["scale_inv"], torch.float32)
    if name == "fp8_gemm":
        return ops.fp8_gemm(*(args[k] for k in ("a", "a_scale_inv", "b", "b_scale_inv")), torch.float32, args.get("bias"))
    return ops.fp8_gemm_accumulate_(*(args[k] for k in ("a", "a_scale_inv", "b", "b_scale_inv", "out")))


def op_arguments(name: str) -> dict:
    """Well-formed CPU arguments of the public op ``name``."""
    if name == "amax":
        return {"input": torch.randn(4)}
    if name == "quantize":
        return {"input": torch.randn(4), "scale": one()}
    if name == "dequantize":
        return {"input": torch.randn(4).to(E4M3), "scale_inv": one()}
    if name == "fp8_gemm":
        return {**gemm_operands(), "bias": torch.randn(3)}
    return {**gemm_operands(), "out": torch.zeros(4, 3)}


ARGUMENTS = [
    (op, arg)
    for op in ("quantize", "dequantize", "fp8_gemm", "fp8_gemm_accumulate_")
    for arg in op_arguments(op)
    if arg not in ("input", "a")
]


@pytest.mark.parametrize("op, arg", ARGUMENTS, ids=lambda v: v)
def test_one_meta_argument_among_cpu_tensors_raises(op, arg):
    """A meta argument would route the CPU call to the fake kernel (uninitialized output, or a no-op)."""
    args = op_arguments(op)
    args[arg] = args[arg].to("meta")
    with pytest.raises(TypeError, match=f"{op.rstrip('_')}: argument '{arg}' must be on cpu like '.*', got meta"):
        call_op(op, args)


@pytest.mark.parametrize("op", ["amax", "quantize", "dequantize", "fp8_gemm", "fp8_gemm_accumulate_"])
def test_all_meta_arguments_take_the_fake_path(op):
    args = {k: v.to("meta") for k, v in op_arguments(op).items()}
    out = call_op(op, args)
    if out is not None:
        assert all(t.device.type == "meta" for t in (out if isinstance(out, tuple) else (out,)))


@pytest.mark.parametrize("op", ["fp8_gemm", "fp8_gemm_accumulate_"])
def test_gemm_rejects_non_tensors_by_name(op):
    args = op_arguments(op)
    args["b_scale_inv"] = 1.0
    with pytest.raises(TypeError, match="argument 'b_scale_inv' must be a torch.Tensor, got float"):
        call_op(op, args)


@pytest.mark.parametrize("where", ["parameters", "main_grad"])
def test_linear_checks_its_tensors_against_the_input(where):
    layer = tl.Linear(8, 3, device="meta" if where == "parameters" else None, recipe=recipe.CurrentScaling(),
                      fuse_wgrad_accumulation=where == "main_grad")
    if where == "main_grad":
        layer.weight.main_grad = torch.zeros(3, 8, device="meta")
    name = "weight" if where == "parameters" else "weight.main_grad"
    with pytest.raises(TypeError, match=f"Linear: argument '{name}' must be on cpu like 'inp', got meta"):
        layer(torch.randn(4, 8))


# ---------------------------------------------------------------------------
# Outputs that share memory with inputs (issue 11 item 5)
# ---------------------------------------------------------------------------


def test_accumulate_into_an_operand_raises():
    """out += a @ b.T with 'a' a view of out's bytes would read what it has already written."""
    args = gemm_operands(64, 48, 32)
    out = torch.zeros(64, 48)
    a = out.view(torch.uint8)[:, :32].view(E4M3)
    a.copy_(args["a"])
    with pytest.raises(ValueError, match="output 'd' shares memory with argument 'a'"):
        ops.fp8_gemm_accumulate_(a, args["a_scale_inv"], args["b"], args["b_scale_inv"], out)


@pytest.mark.parametrize("operand", ["a_scale_inv", "b", "b_scale_inv"])
def test_accumulate_rejects_every_overlapping_operand(operand):
    args = gemm_operands(4, 3, 8)
    out = torch.ones(4, 3)
    args[operand] = out.view(-1)[:1] if "scale" in operand else out.view(torch.uint8)[:3, :8].view(E4M3)
    with pytest.raises(ValueError, match=f"output 'd' shares memory with argument '{operand}'"):
        ops.fp8_gemm_accumulate_(*args.values(), out)


def test_raw_gemm_bias_aliasing_d_raises():
    args = gemm_operands(4, 3, 8)
    d = torch.zeros(4, 3)
    descs = [desc(t, "test", k) for k, t in args.items()]
    with pytest.raises(ValueError, match="output 'd' shares memory with argument 'bias'"):
        _C.fp8_gemm(*descs, desc(d[1], "test", "bias"), desc(d, "test", "d"), False, False, None, 0)


def test_raw_quantize_output_aliasing_input_raises():
    x, scale, scale_inv = torch.randn(16), one(), torch.empty(1)
    out = x.view(torch.uint8)[:16].view(E4M3)
    descs = [desc(t, "test", "t") for t in (x, scale, out)]
    with pytest.raises(ValueError, match="output 'output' shares memory with argument 'input'"):
        _C.quantize(*descs, None, desc(scale_inv, "test", "scale_inv"), None, None, False, 0)


def test_disjoint_views_of_one_buffer_are_accepted():
    """Neighbouring slices of one allocation do not overlap: no false alarm."""
    args = gemm_operands(4, 3, 8)
    buf = torch.zeros(2, 4, 3)
    ops.fp8_gemm_accumulate_(*args.values(), buf[1])
    expected = ref.fp8_gemm(*args.values(), torch.float32)
    assert torch.equal(buf[0], torch.zeros(4, 3))
    torch.testing.assert_close(buf[1], expected)


# ---------------------------------------------------------------------------
# Scale values (issue 11 item 12)
# ---------------------------------------------------------------------------

FLT_MIN, FLT_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
BAD_SCALES = [0.0, -0.0, -1.0, -FLT_MIN, math.inf, -math.inf, math.nan]
SCALE_ARGUMENTS = [("quantize", "scale"), ("dequantize", "scale_inv")] + [
    (op, s) for op in ("fp8_gemm", "fp8_gemm_accumulate_") for s in ("a_scale_inv", "b_scale_inv")
]


@pytest.mark.parametrize("value", BAD_SCALES, ids=str)
@pytest.mark.parametrize("op, arg", SCALE_ARGUMENTS, ids=lambda v: v)
def test_non_positive_or_non_finite_scales_raise(op, arg, value):
    args = op_arguments(op)
    args[arg] = torch.tensor([value])
    with pytest.raises(ValueError, match=f"argument '{arg}' must be a positive finite scale"):
        call_op(op, args)


@pytest.mark.parametrize("value", [1e-45, 2.0**-129, 2.0**-128])
def test_quantize_scale_with_an_infinite_reciprocal_raises(value):
    """quantize returns scale_inv = 1/scale: a tiny scale would make it inf (and dequantize NaN)."""
    with pytest.raises(ValueError, match="argument 'scale' must be a positive finite scale with a finite reciprocal"):
        ops.quantize(torch.randn(4), torch.tensor([value]), E4M3)


@pytest.mark.parametrize("value", [FLT_MIN, 2.0**-127, 1.0, FLT_MAX])
def test_extreme_valid_scales_are_accepted(value):
    """[FLT_MIN, FLT_MAX] holds every scale compute_scale gives; their reciprocals are valid scale_inv."""
    x, scale = torch.randn(8), torch.tensor([value])
    q, scale_inv = ops.quantize(x, scale, E4M3)
    ref_q, ref_scale_inv = ref.quantize(x, scale, E4M3)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale_inv, ref_scale_inv)
    assert torch.equal(ops.dequantize(q, scale_inv, torch.float32), ref.dequantize(q, scale_inv, torch.float32))


def test_scale_check_runs_in_compiled_graphs():
    """The check is inside the op's implementation: no graph break, and the same error compiled."""
    compiled = torch.compile(lambda x, s: ops.quantize(x, s, E4M3), backend="aot_eager", fullgraph=True)
    compiled(torch.randn(8), one())
    with pytest.raises(ValueError, match="argument 'scale' must be a positive finite scale"):
        compiled(torch.randn(8), torch.zeros(1))


def test_raw_kernel_keeps_its_documented_math():
    """_C (internal callers) still computes 1/0 = inf and NaN-producing products."""
    x, scale, q, scale_inv = torch.ones(3), torch.zeros(1), torch.empty(3, dtype=E4M3), torch.empty(1)
    descs = [desc(t, "test", "t") for t in (x, scale, q)]
    _C.quantize(*descs, None, desc(scale_inv, "test", "scale_inv"), None, None, False, 0)
    assert scale_inv.item() == math.inf and torch.equal(q.float(), torch.zeros(3))


# ---------------------------------------------------------------------------
# Recipes take integral types (issue 11 item 11)
# ---------------------------------------------------------------------------

INT_FIELDS = [(recipe.DelayedScaling, "margin", 3), (recipe.DelayedScaling, "amax_history_len", 4),
              (recipe.CurrentScaling, "margin", 2)]


@pytest.mark.parametrize("cls, field, value", INT_FIELDS, ids=str)
@pytest.mark.parametrize("integral", [np.int64, np.int32, np.uint8, torch.tensor], ids=lambda f: f.__name__)
def test_recipes_accept_integral_types(cls, field, value, integral):
    r = cls(**{field: integral(value)})
    assert getattr(r, field) == value and type(getattr(r, field)) is int


@pytest.mark.parametrize("cls, field, value", INT_FIELDS, ids=str)
@pytest.mark.parametrize("bad", [True, False, 4.0, np.float32(4), "4", None], ids=repr)
def test_recipes_reject_non_integral_types(cls, field, value, bad):
    with pytest.raises(TypeError, match=f"{cls.__name__}: '{field}' must be an integer"):
        cls(**{field: bad})
