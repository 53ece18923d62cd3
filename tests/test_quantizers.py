"""The quantizers of every built-in recipe declare what the Linear actually produces.

Each recipe's QuantizationSpec (quantization.py) is built from recipe.from_name; a tl.Linear under that
recipe runs one forward and backward with linear_fwd, linear_dgrad and the wgrad spied on, and every
tensor the ops produced is checked against its quantizer's declaration: data and scale dtypes, the
scale shapes of its blocks, the rowwise and columnwise usages, the amax it records, the ScalingType
each GEMM resolves to, and whether it reads the delayed-scaling state.
"""

from __future__ import annotations

import math

import pytest
import torch

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.formats.block_scaling import GemmScalings
from transformer_linear.formats.block_scaling import resolve_gemm_scalings as resolve_fp8_gemm_scalings
from transformer_linear.formats.dtypes import E8M0_DTYPE
from transformer_linear.modules import linear, linear_ops
from transformer_linear.ops import nvfp4, nvfp4_gemm
from transformer_linear.recipe.quantization import (
    DATA_DTYPES,
    QUANTIZER_SCALE_DTYPES,
    Quantized,
    TensorQuantizer,
    quantization_spec,
)

# Every size a multiple of every block (and above 128), so that each ScalingType has one reading.
M, K, N = 256, 256, 384


def _scale_shape(quantizer: TensorQuantizer, rows: int, cols: int) -> tuple[int, ...]:
    """The scale_inv shape a quantizer declares for a (rows, cols) tensor (as a GEMM reads it)."""
    if quantizer.is_nvfp4:  # block scales packed with the global scale (Quantized), 1-D
        return (nvfp4.packed_scale_numel(rows, cols),)
    return quantizer.scale_grid(rows, cols) if quantizer.blockwise else (1,)


def resolve_gemm_scalings(a, a_scale_inv, b, b_scale_inv):
    """The ScalingTypes ops.fp8_gemm resolves for its operands: FP8 pairs by block_scaling.py; NVFP4
    operands (uint8 data, packed scales) take the NVFP4 GEMM, their packed scales checked by its op."""
    if a.dtype == torch.uint8:
        nvfp4_gemm._check_packed_gemm("fp8_gemm", a, a_scale_inv, b, b_scale_inv, torch.float32, None)
        return GemmScalings("NVFP4", (1, 16), "NVFP4", (1, 16))
    return resolve_fp8_gemm_scalings(a, a_scale_inv, b, b_scale_inv)


def _run_linear(name: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    """One forward and backward of a tl.Linear under the named recipe, with what its ops produced."""
    torch.manual_seed(0)
    layer = tl.Linear(K, N, recipe=recipe.from_name(name))
    seen: dict = {}

    def spy(key, fn):
        def wrapper(args, *rest):
            seen[key] = args
            out = fn(args, *rest)
            seen[key + "_out"] = out
            return out

        return wrapper

    monkeypatch.setattr(linear, "linear_fwd", spy("fwd", linear.linear_fwd))
    monkeypatch.setattr(linear_ops, "linear_dgrad", spy("dgrad", linear_ops.linear_dgrad))
    monkeypatch.setattr(linear_ops, "compute_wgrad", spy("wgrad", linear_ops.compute_wgrad))
    x = torch.randn(M, K, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    seen["layer"] = layer
    return seen


@pytest.mark.parametrize("name", recipe.available_names())
def test_quantizers_declare_what_the_linear_produces(name, monkeypatch):
    spec = quantization_spec(recipe.from_name(name))
    seen = _run_linear(name, monkeypatch)
    a, o = seen["fwd"], seen["fwd_out"]
    assert a.quantization == spec, "the Linear quantizes with another spec than its recipe's"

    # The declarations are of the kinds a quantizer may hold.
    for q in (spec.input, spec.weight, spec.grad_output):
        assert q.dtype in DATA_DTYPES and q.scale_dtype in QUANTIZER_SCALE_DTYPES
        assert q.records_amax == (not q.blockwise) and q.columnwise_is_copy == q.blockwise

    # Weight: both usages, in its dtypes, with its block grid.
    assert o.weight_fp8.dtype == spec.weight.dtype and o.weight_fp8.shape == spec.weight.data_shape(N, K)
    assert o.weight_scale_inv.dtype == spec.weight.scale_dtype
    assert tuple(o.weight_scale_inv.shape) == _scale_shape(spec.weight, N, K)
    if spec.weight.columnwise_is_copy:
        assert o.weight_fp8_t.shape == spec.weight.data_shape(K, N) and o.weight_fp8_t.dtype == spec.weight.dtype
        assert tuple(o.weight_scale_inv_t.shape) == _scale_shape(spec.weight, K, N)
    else:
        assert o.weight_scale_inv_t.numel() == 0, "a per-tensor columnwise usage shares the rowwise scale"

    # Input: what autograd saves is its columnwise usage, the operand wgrad reads as (K, M).
    x_t = spec.input.columnwise_operand(o.inp_saved)
    assert x_t.shape == spec.input.data_shape(K, M) and x_t.dtype == spec.input.dtype
    assert o.inp_scale_inv.dtype == spec.input.scale_dtype
    assert o.inp_scale_inv.dim() == 1, "activation scales cross the graph 1-D"
    x_t_scale_inv = spec.input.scale_2d(o.inp_scale_inv, x_t)
    assert tuple(x_t_scale_inv.shape) == _scale_shape(spec.input, K, M)

    # Only per-tensor quantizers record amaxes; only those reading the delayed-scaling state get its args.
    assert o.amax.numel() == (2 if spec.input.records_amax else 0)
    assert (a.delayed is not None) == spec.scale_from_history
    assert (o.fwd_scales.numel() == 3) == spec.scale_from_history
    history = seen["layer"].fp8_amax_history
    assert bool(history.ne(0).any()) == spec.scale_from_history, "the state was (not) updated"

    # The forward GEMM: the input's rowwise usage against the weight's.
    qx = spec.input.quantize(seen["fwd"].inp.detach().contiguous(), rowwise=True, columnwise=False)
    assert qx.data.dtype == spec.input.dtype and isinstance(qx, Quantized)
    fwd = resolve_gemm_scalings(qx.data, qx.scale_inv, o.weight_fp8, o.weight_scale_inv)
    assert (fwd.a_scaling, fwd.b_scaling) == (spec.input.gemm_scaling, spec.weight.gemm_scaling)

    # dgrad: grad_output's rowwise usage against the weight's columnwise usage.
    b = seen["dgrad"]
    assert b.grad_output.dtype == spec.grad_output.dtype and b.grad_output.shape == spec.grad_output.data_shape(M, N)
    assert b.grad_output_scale_inv.dtype == spec.grad_output.scale_dtype
    g_scale_inv = spec.grad_output.scale_2d(b.grad_output_scale_inv, b.grad_output)
    assert tuple(g_scale_inv.shape) == _scale_shape(spec.grad_output, M, N)
    assert b.quantization == spec  # each saved operand becomes a GEMM operand by its own quantizer
    w_t = spec.weight.columnwise_operand(b.weight)
    assert w_t.shape == spec.weight.data_shape(K, N) and w_t.dtype == spec.weight.dtype
    dgrad = resolve_gemm_scalings(b.grad_output, g_scale_inv, w_t, b.weight_scale_inv)
    assert (dgrad.a_scaling, dgrad.b_scaling) == (spec.grad_output.gemm_scaling, spec.weight.gemm_scaling)

    # wgrad: grad_output's columnwise usage against the input's.
    w = seen["wgrad"]
    g_t = spec.grad_output.columnwise_operand(w.grad_output_t)
    assert g_t.shape == spec.grad_output.data_shape(N, M) and g_t.dtype == spec.grad_output.dtype
    g_t_scale_inv = spec.grad_output.scale_2d(w.grad_output_t_scale_inv, g_t)
    assert tuple(g_t_scale_inv.shape) == _scale_shape(spec.grad_output, N, M)
    wgrad = resolve_gemm_scalings(g_t, g_t_scale_inv, spec.input.columnwise_operand(w.inp),
                                  spec.input.scale_2d(w.inp_scale_inv, x_t))
    assert (wgrad.a_scaling, wgrad.b_scaling) == (spec.grad_output.gemm_scaling, spec.input.gemm_scaling)
    assert seen["layer"].weight.grad is not None and math.isfinite(float(seen["layer"].weight.grad.abs().sum()))


def test_a_quantizer_takes_any_data_dtype_and_checks_its_fields():
    fp4 = TensorQuantizer(torch.float4_e2m1fn_x2, [1, 16], torch.float8_e4m3fn, False)
    assert fp4.blockwise and fp4.scale_dtype == torch.float8_e4m3fn
    # FP4 is held as its storage dtype (torch.export cannot save float4 dtypes in an op's arguments).
    assert fp4.dtype == torch.uint8 and fp4.is_nvfp4
    assert fp4 == TensorQuantizer(torch.uint8, [1, 16], torch.float8_e4m3fn, False)
    with pytest.raises(ValueError, match=r"\[1, 16\] or \[16, 16\]"):
        TensorQuantizer(torch.float4_e2m1fn_x2, [1, 32], torch.float8_e4m3fn, False)
    with pytest.raises(ValueError, match="'rht' applies to \\[1, 16\\] blocks only"):
        TensorQuantizer(torch.uint8, [16, 16], torch.float8_e4m3fn, False, rht=True)
    with pytest.raises(ValueError, match="FP4 .* only"):
        TensorQuantizer(torch.float8_e4m3fn, [1, 32], E8M0_DTYPE, False, stochastic_rounding=True)
    with pytest.raises(TypeError, match="'rht' must be a bool"):
        TensorQuantizer(torch.uint8, [1, 16], torch.float8_e4m3fn, False, rht=1)
    with pytest.raises(TypeError, match="'dtype'"):
        TensorQuantizer(torch.bfloat16, [], torch.float32, False)
    with pytest.raises(TypeError, match="'scale_dtype'"):
        TensorQuantizer(torch.float8_e4m3fn, [1, 32], torch.float16, False)
    with pytest.raises(ValueError, match="'margin'"):
        TensorQuantizer(torch.float8_e4m3fn, [], torch.float32, False, margin=-1)
    with pytest.raises(ValueError, match="one scale per tensor only"):
        TensorQuantizer(torch.float8_e4m3fn, [1, 128], torch.float32, False, scale_from_history=True)
    for block_shape in (None, 128, [1.0, 128], [True, 128]):
        with pytest.raises(TypeError, match=r"'block_shape' must be a list of ints \(\[\] for one scale per tensor"):
            TensorQuantizer(torch.float8_e4m3fn, block_shape, torch.float32, False)


def test_per_tensor_and_block_quantizers_return_one_result_type():
    x = torch.randn(64, 256)
    per_tensor = TensorQuantizer(torch.float8_e4m3fn, [], torch.float32, False, margin=1)
    block = TensorQuantizer(torch.float8_e4m3fn, [1, 128], torch.float32, False)
    for quantizer in (per_tensor, block):
        q = quantizer.quantize(x, rowwise=True, columnwise=True)
        assert type(q) is Quantized and q.data.shape == (64, 256) and q.data.dtype == torch.float8_e4m3fn
        data_t, _ = quantizer.columnwise_usage(q)
        assert quantizer.columnwise_operand(data_t).shape == (256, 64)
    assert per_tensor.quantize(x).amax is not None and block.quantize(x).amax is None
    # A per-tensor quantizer's margin halves its scale per step: 2x the scale_inv of margin 0.
    no_margin = TensorQuantizer(torch.float8_e4m3fn, [], torch.float32, False)
    assert torch.equal(per_tensor.quantize(x).scale_inv, 2 * no_margin.quantize(x).scale_inv)
