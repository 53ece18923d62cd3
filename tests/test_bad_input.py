"""Bad input to the public API: a TypeError or ValueError naming the argument, never a crash or garbage."""

from __future__ import annotations

import functools
import inspect
import math

import numpy as np
import pytest
import torch

import transformer_linear as tl
from transformer_linear import _C, ops, recipe
from transformer_linear import reference as ref
from transformer_linear.ops.descriptors import desc

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
        # quantize_blockwise names its argument 'x' (its parameter) in the kernel's errors too.
        (lambda: ops.quantize_blockwise(torch.ones(8, 64).t(), E4M3, (1, 32)), ValueError, "quantize_blockwise: argument 'x' must be contiguous"),
        # Past int64 (the op's SymInt[]): its own message, not the dispatcher's "Expected a value of type".
        (lambda: ops.quantize_blockwise(torch.ones(4, 8), E4M3, (1, 2**63)), ValueError, r"'block_shape' must be two ints in \[1, 2\*\*63 - 1\]"),
        (lambda: ops.quantize_blockwise_fused(torch.ones(4, 8), E4M3, (2**64, 1)), ValueError, r"'block_shape' must be two ints"),
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
# Every public function of ops: a meta or uint8 tensor in any tensor argument (issue 23 item 1)
# ---------------------------------------------------------------------------

# The public functions of ops: every function in its namespace without a leading underscore, so
# one added later (or a helper imported there without one) is walked, or fails the table check.
PUBLIC_OPS = sorted(
    name
    for name, value in vars(ops).items()
    if not name.startswith("_") and inspect.isfunction(value) and value.__module__.startswith("transformer_linear")
)
# Where the kernels' messages name an argument as TE's C API does: the input 'input', the GEMM output 'd'.
KERNEL_NAMES = {"x": ("x", "input"), "q": ("q", "input"), "out": ("out", "d")}


def public_op_arguments() -> dict[str, dict]:
    """Well-formed CPU arguments (by parameter name) of each public function of ops."""
    x = torch.randn(8, 256)
    a, a_scale_inv = ops.quantize_blockwise(x, E4M3, (1, 128))
    b, b_scale_inv = ops.quantize_blockwise(torch.randn(4, 256), E4M3, (1, 128))
    q, scale_inv = ops.quantize(x, one(), E4M3)
    gemm = {"a": a, "a_scale_inv": a_scale_inv, "b": b, "b_scale_inv": b_scale_inv}
    return {
        "amax": {"x": x},
        "quantize": {"x": x, "scale": one(), "dtype": E4M3},
        "quantize_with_amax": {"x": x, "scale": one(), "dtype": E4M3},
        "quantize_current": {"x": x, "dtype": E4M3},
        "quantize_fused": {"x": x, "dtype": E4M3, "scale": one()},
        "dequantize": {"q": q, "scale_inv": scale_inv, "out_dtype": torch.float32},
        "transpose": {"q": q},
        "bias_grad": {"grad_output": x, "dtype": torch.float32},
        "fp8_gemm": {**gemm, "out_dtype": torch.float32, "bias": torch.zeros(4)},
        "fp8_gemm_accumulate_": {**gemm, "out": torch.zeros(8, 4)},
        "quantize_fp8_gemm": {"x": x, "dtype": E4M3, "scale": one(), "b": q[:4], "b_scale_inv": scale_inv,
                              "out_dtype": torch.float32, "bias": torch.zeros(4)},
        "fp8_gemm_scalings": {},
        "resolve_gemm_scalings": gemm,
        "quantize_blockwise": {"x": x, "dtype": E4M3, "block_shape": (1, 128)},
        "quantize_blockwise_fused": {"x": x, "dtype": E4M3, "block_shape": (1, 128), "columnwise": True},
    }


def test_every_public_op_has_arguments_in_the_walk():
    assert PUBLIC_OPS == sorted(public_op_arguments())
    assert sorted(n for n in ops.__all__ if inspect.isfunction(getattr(ops, n))) == PUBLIC_OPS


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as uint8 where it has one-byte elements (FP8 data, E8M0 scales), else its values."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.to(torch.uint8)


WALK = [
    (op, arg, kind)
    for op, args in public_op_arguments().items()
    for arg, value in args.items()
    if isinstance(value, torch.Tensor)
    for kind in ("meta", "uint8")
]


def _outputs(out) -> list:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("op, arg, kind", WALK, ids=lambda v: v)
def test_every_public_op_rejects_a_meta_or_uint8_argument(op, arg, kind):
    """A clear error naming the argument: not the dispatcher's, not garbage (a meta tensor among CPU
    ones routes a call to the fake kernel: uninitialized memory, or a silent no-op), not a uint8 read
    as E8M0 bits. Where it is the only tensor, a meta tensor propagates shapes like torch's own ops
    (what a module on the meta device runs): every output is a meta tensor."""
    args = public_op_arguments()[op]
    tensors = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
    args[arg] = args[arg].to("meta") if kind == "meta" else _as_uint8(args[arg])
    call = functools.partial(getattr(ops, op), **args)
    if kind == "meta" and len(tensors) == 1:
        out = call()
        assert _outputs(out) and all(t.device.type == "meta" for t in _outputs(out))
        return
    names = "|".join(KERNEL_NAMES.get(arg, (arg,)))
    with pytest.raises((TypeError, ValueError), match=rf"(?=.*'({names})')(?=.*\b{kind}\b)") as info:
        call()
    assert "Expected a value of type" not in str(info.value)


@pytest.mark.parametrize("op", ["fp8_gemm_blockwise", "fp8_gemm_blockwise_accumulate"])
@pytest.mark.parametrize("arg", ["a", "a_scale_inv", "b", "b_scale_inv"])
@pytest.mark.parametrize("kind", ["meta", "uint8"])
def test_block_gemm_ops_check_their_own_arguments(op, arg, kind):
    """The registered ops too, called through torch.ops with no Python entry before them."""
    args = public_op_arguments()["resolve_gemm_scalings"]
    args[arg] = args[arg].to("meta") if kind == "meta" else _as_uint8(args[arg])
    rest = (torch.float32, None) if op == "fp8_gemm_blockwise" else (torch.zeros(8, 4),)
    with pytest.raises(TypeError, match=rf"(?=.*'{arg}')(?=.*\b{kind}\b)"):
        getattr(torch.ops.transformer_linear, op)(
            *args.values(), *rest, [1, 128], [1, 128], "BlockWise1x128", "BlockWise1x128"
        )


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


# (scaling, K, scale columns, scale dtype, bad value): every other E8M0 byte is a positive finite power of two.
BAD_BLOCK_SCALES = [(s, k, c, torch.float32, v) for s, k, c in (("rowwise", 64, 1), ("1x128", 256, 2)) for v in BAD_SCALES]
BAD_BLOCK_SCALES += [("1x32_e8m0", 64, 2, torch.float8_e8m0fnu, math.nan)]


@pytest.mark.parametrize("scaling, k, columns, scale_dtype, value", BAD_BLOCK_SCALES, ids=str)
def test_bad_block_scales_raise_naming_the_first_bad_element(scaling, k, columns, scale_dtype, value):
    """Block scales are checked element by element, like per-tensor ones (E8M0: its NaN byte)."""
    m, n = 4, 8
    a, b = torch.randn(m, k).to(E4M3), torch.randn(n, k).to(E4M3)
    a_scale_inv, b_scale_inv = torch.ones(m, columns).to(scale_dtype), torch.ones(n, columns).to(scale_dtype)
    if scale_dtype == torch.float32:
        b_scale_inv[2, -1] = value
    else:
        b_scale_inv.view(torch.uint8)[2, -1] = 0xFF
    with pytest.raises(ValueError, match=r"argument 'b_scale_inv' must be a positive finite scale .* at index \[2, "):
        ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32)


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
