"""Property-based fuzzing of every public op in ``tl.ops``.

Each example draws shapes (empty ones included), layouts (contiguous,
transposed, strided), dtypes, devices (all CPU, all meta, or one meta
argument among CPU ones), scales (0, inf, NaN, negative, tiny) and, for the
in-place GEMM, outputs sharing memory with an operand. The property: the call
raises a clear exception (TypeError, ValueError or NotImplementedError) that
names one of the op's arguments in quotes, or returns what
transformer_linear.reference computes (bitwise for the quantize family,
within tests/tolerances.py for GEMMs; shapes and dtypes only on meta).

The example budget is fixed and the search derandomized, so every run tries
the same cases in bounded time.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from test_gemm import fp32_baseline
from tolerances import assert_bitwise_equal, assert_close_to_reference
from transformer_linear import ops
from transformer_linear import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
HP = [torch.float32, torch.bfloat16, torch.float16]
NOT_ACCEPTED = [torch.float64, torch.int32, torch.bool]

FUZZ = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CLEAR_ERRORS = (TypeError, ValueError, NotImplementedError)

# Argument names an error may quote: the public names and the kernels' names of the same tensors.
QUANTIZE_NAMES = {"input", "scale", "dtype", "margin", "rowwise", "columnwise", "dbias_dtype"}
QUANTIZE_NAMES |= {"output", "output_t", "scale_inv", "amax", "dbias"}
GEMM_NAMES = {"a", "a_scale_inv", "b", "b_scale_inv", "out_dtype", "bias", "out", "d"}

# The first four are valid.
SCALE_VALUES = [1.0, 0.375, 2.0**-10, 1e30, 0.0, -0.0, -1.0, 1e-45, math.inf, -math.inf, math.nan]
# GEMM scale_invs stay where float32 products neither overflow nor underflow
# (the kernel multiplies acc * (sa * sb) in float32, the reference in float64).
SCALE_INV_VALUES = [1.0, 0.375, 2.0**-10, 3.0, 0.0, -1.0, math.inf, math.nan]
# The GEMM tests draw half their examples from well-formed arguments only
# ("clean"), so that the reference comparison is exercised as often as the errors.


@st.composite
def tensors(draw, shape: tuple[int, ...], good: list[torch.dtype], clean: bool = False) -> torch.Tensor:
    """A tensor of ``shape`` with random values, in a drawn dtype and layout.

    The dtype is mostly one of ``good``; ``clean`` draws only those, and no strided layout.
    """
    dtype = draw(st.sampled_from(good if clean else good * 6 + NOT_ACCEPTED))
    layout = draw(st.sampled_from(["contiguous", "transposed"] if clean else ["contiguous"] * 3 + ["transposed", "strided"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if layout == "transposed" and len(shape) == 2:
        return _values(shape[::-1], dtype, gen).t()
    if layout == "strided" and len(shape) >= 1:
        return _values((*shape[:-1], 2 * shape[-1]), dtype, gen)[..., ::2]
    return _values(shape, dtype, gen)


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        magnitudes = torch.exp2(torch.randint(-6, 6, shape, generator=gen).float())
        return (torch.randn(shape, generator=gen) * magnitudes).to(dtype)
    return torch.randint(0, 2, shape, generator=gen).to(dtype)


@st.composite
def scales(draw, values: list[float], clean: bool = False) -> object:
    """A scale: mostly a one-element float32 tensor, sometimes a wrong shape, dtype or a float.

    ``clean`` draws only one-element float32 tensors of valid values (the first four).
    """
    kind = draw(st.sampled_from(["tensor"] if clean else ["tensor"] * 16 + ["0-dim", "two", "float64", "python"]))
    value = draw(st.sampled_from(values[:4]) if clean else st.one_of(st.sampled_from(values[:4]), st.sampled_from(values)))
    if kind == "python":
        return value
    shape = {"0-dim": (), "two": (2,)}.get(kind, (1,))
    return torch.full(shape, value, dtype=torch.float64 if kind == "float64" else torch.float32)


def shapes(max_rank: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, 5), min_size=0, max_size=max_rank).map(tuple)


@st.composite
def devices(draw, args: dict[str, object], clean: bool = False) -> dict[str, object]:
    """Move all tensor arguments to meta, one of them (not when ``clean``), or none."""
    mode = draw(st.sampled_from(["cpu"] * 6 + ["meta"] + ([] if clean else ["mixed"])))
    names = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
    if mode == "cpu" or not names:
        return args
    meta = set(names) if mode == "meta" else {draw(st.sampled_from(names))}
    return {k: v.to("meta") if k in meta else v for k, v in args.items()}


def check(call: Callable[[], object], args: dict[str, object], names: set[str], expect: Callable) -> None:
    """The property: a clear, named error, or ``expect(result)`` holds."""
    on = {v.device.type for v in args.values() if isinstance(v, torch.Tensor)}
    try:
        result = call()
    except CLEAR_ERRORS as e:
        quoted = set(re.findall(r"'([\w.]+)'", str(e)))
        assert quoted & names, f"{type(e).__name__} names none of the arguments: {e}"
        event(f"{type(e).__name__} naming {sorted(quoted & names)}")
        return
    event(f"result on {'/'.join(sorted(on))}")
    assert on != {"cpu", "meta"}, "a call mixing cpu and meta tensors returned instead of raising"
    outputs = result if isinstance(result, tuple) else (result,)
    if on == {"meta"}:
        assert all(t.device.type == "meta" for t in outputs if isinstance(t, torch.Tensor))
        return
    expect(result)


def bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_bitwise_equal(actual, expected, what, any_nan=True)


# ---------------------------------------------------------------------------
# amax and the quantize family
# ---------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_amax(data):
    args = data.draw(devices({"input": data.draw(tensors(data.draw(shapes()), HP))}))
    check(lambda: ops.amax(args["input"]), args, {"input", "amax"},
          lambda out: bitwise(out, ref.amax(args["input"]), "amax"))


QUANTIZE_VARIANTS = ["quantize", "quantize_with_amax", "quantize_current", "quantize_fused"]


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize("variant", QUANTIZE_VARIANTS)
def test_quantize_family(variant, data):
    x = data.draw(tensors(data.draw(shapes()), HP))
    scale = None if variant == "quantize_current" else data.draw(scales(SCALE_VALUES))
    if variant == "quantize_fused" and data.draw(st.booleans()):
        scale = None
    args = data.draw(devices({"input": x, "scale": scale}))
    x, scale = args["input"], args["scale"]
    dtype = data.draw(st.sampled_from(FP8 * 4 + [torch.float16]))
    margin = data.draw(st.sampled_from([0, 0, 3, -1, 127, 1.5]))
    flags = {
        "rowwise": data.draw(st.booleans()),
        "columnwise": data.draw(st.booleans()),
        "dbias_dtype": data.draw(st.sampled_from([None, None, *HP, torch.int8])),
    }
    calls = {
        "quantize": lambda: ops.quantize(x, scale, dtype),
        "quantize_with_amax": lambda: ops.quantize_with_amax(x, scale, dtype),
        "quantize_current": lambda: ops.quantize_current(x, dtype, margin),
        "quantize_fused": lambda: ops.quantize_fused(x, dtype, scale, margin=margin, **flags),
    }

    def expect(out):
        if scale is None:
            q_ref, scale_inv_ref, amax_ref = ref.quantize_current(x, dtype, margin)
        else:
            (q_ref, scale_inv_ref), amax_ref = ref.quantize(x, scale, dtype), ref.amax(x)
        if variant == "quantize_fused":
            data_out, data_t, scale_inv, amax, dbias = out
            if flags["rowwise"]:
                bitwise(data_out, q_ref, "data")
            if flags["columnwise"]:
                bitwise(data_t, ref.transpose_2d(q_ref), "data_t")
            if flags["dbias_dtype"] is not None:
                exact = x.double().reshape(math.prod(x.shape[:-1]), x.shape[-1]).sum(0)
                assert_close_to_reference(dbias, exact, baseline=ref.bias_grad(x, flags["dbias_dtype"]), what="dbias")
            out = (None, scale_inv, amax)
        else:
            bitwise(out[0], q_ref, "data")
        bitwise(out[1], scale_inv_ref, "scale_inv")
        if len(out) == 3:
            bitwise(out[2], amax_ref, "amax")

    check(calls[variant], args, QUANTIZE_NAMES, expect)


@FUZZ
@given(data=st.data())
def test_dequantize(data):
    q = data.draw(tensors(data.draw(shapes()), FP8))
    args = data.draw(devices({"input": q, "scale_inv": data.draw(scales(SCALE_VALUES))}))
    out_dtype = data.draw(st.sampled_from(HP * 3 + [torch.float64]))
    check(lambda: ops.dequantize(args["input"], args["scale_inv"], out_dtype), args, QUANTIZE_NAMES | {"out_dtype"},
          lambda out: bitwise(out, ref.dequantize(args["input"], args["scale_inv"], out_dtype), "dequantize"))


# ---------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------


@st.composite
def gemm_dims(draw, clean: bool = False) -> tuple[int, int, int, int, int]:
    """(M, N, K) and the inner sizes of a and b: usually equal, sometimes not."""
    m, n, k = (draw(st.integers(0, 5)) for _ in range(3))
    kb = k if clean or draw(st.integers(0, 7)) else k + 1
    return m, n, k, k, kb


def gemm_reference(args: dict, out_dtype: torch.dtype, bias=None, accumulate_into=None):
    """The float64 reference and plain PyTorch's fp32 result (the tolerance's baseline)."""
    operands = [args[k] for k in ("a", "a_scale_inv", "b", "b_scale_inv")]
    exact = ref.fp8_gemm(*operands, torch.float64, bias, accumulate_into)
    return exact, fp32_baseline(*operands, out_dtype, bias, accumulate_into)


@FUZZ
@given(data=st.data())
def test_fp8_gemm(data):
    clean = data.draw(st.booleans())
    m, n, _, ka, kb = data.draw(gemm_dims(clean))
    a = data.draw(tensors((m, ka), FP8, clean))
    b = a if m == n and ka == kb and data.draw(st.booleans()) else data.draw(tensors((n, kb), FP8, clean))
    out_dtype = data.draw(st.sampled_from(HP if clean else HP * 3 + [torch.float64]))
    bias = data.draw(st.one_of(st.none(), tensors((n,), [out_dtype] if out_dtype in HP else HP, clean)))
    args = {"a": a, "a_scale_inv": data.draw(scales(SCALE_INV_VALUES, clean)), "b": b,
            "b_scale_inv": data.draw(scales(SCALE_INV_VALUES, clean)), "bias": bias}
    args = data.draw(devices(args, clean))

    def expect(out):
        exact, baseline = gemm_reference(args, out_dtype, args["bias"])
        assert out.dtype == out_dtype
        assert_close_to_reference(out, exact, baseline, "fp8_gemm")

    operands = [args[k] for k in ("a", "a_scale_inv", "b", "b_scale_inv")]
    check(lambda: ops.fp8_gemm(*operands, out_dtype, args["bias"]), args, GEMM_NAMES, expect)


@st.composite
def accumulate_operands(draw) -> tuple[dict, bool]:
    """Operands of fp8_gemm_accumulate_, where ``out`` may share memory with 'a', 'b' or a scale; and ``clean``."""
    clean = draw(st.booleans())
    m, n, _, ka, kb = draw(gemm_dims(clean))
    out_dtype = draw(st.sampled_from(HP if clean else HP * 3 + [torch.float64]))
    # One buffer holds out first, then room for a and b: they may be placed inside out or after it.
    buf = torch.zeros(m * n + 4 * (m * ka + n * kb) + 8, dtype=out_dtype)
    out = buf[: m * n].view(m, n)
    out.copy_(draw(tensors((m, n), [torch.float32])).to(out_dtype))
    raw, after = buf.view(torch.uint8), m * n * buf.element_size()
    alias = draw(st.sampled_from(["none", "disjoint", "a", "b", "scale"]))
    # Byte offsets into buf: inside out (aliasing it) or past its end (disjoint).
    starts = {"a": 0 if alias == "a" else after, "b": 0 if alias == "b" else after + m * ka}
    args = {}
    for name, rows, k in (("a", m, ka), ("b", n, kb)):
        t = draw(tensors((rows, k), FP8, clean))
        if alias in (name, "disjoint") and t.dtype in FP8:
            t = raw[starts[name] : starts[name] + rows * k].view(rows, k).view(t.dtype).copy_(t)
        args[name] = t
        args[f"{name}_scale_inv"] = draw(scales(SCALE_INV_VALUES, clean))
    if alias == "scale" and out_dtype == torch.float32 and out.numel():
        out.view(-1)[0] = 0.5
        args["b_scale_inv"] = out.view(-1)[:1]
    args["out"] = out
    return {k: args[k] for k in ("a", "a_scale_inv", "b", "b_scale_inv", "out")}, clean


@FUZZ
@given(data=st.data())
def test_fp8_gemm_accumulate(data):
    args, clean = data.draw(accumulate_operands())
    args = data.draw(devices(args, clean))
    out = args["out"]
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}

    def expect(_):
        exact, baseline = gemm_reference(before, out.dtype, accumulate_into=before["out"])
        assert_close_to_reference(out, exact, baseline, "fp8_gemm_accumulate_")

    check(lambda: ops.fp8_gemm_accumulate_(*args.values()), args, GEMM_NAMES, expect)
