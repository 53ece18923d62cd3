"""Transformer Engine's ``backward_override`` (None / "high_precision" / "dequantized") on every recipe.

The recipe's QuantizationSpec carries it; the Linear's forward saves what its ``backward_operands`` names
and backward runs dgrad / wgrad in high precision from it. Checked against a hand-computed reference:
``"high_precision"``: dx = g W, dW = gᵀ x, db = Σ g from the original tensors; ``"dequantized"``: the
same GEMMs with x and W replaced by the forward's quantized copies dequantized here by hand (per-tensor,
per-block and NVFP4 scales expanded over their elements); grad_output is never quantized. Also: the
forward is unchanged, torch.compile(fullgraph=True), opcheck of the changed linear_fwd schema, bad input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_bitwise_equal

import transformer_linear as tl
from transformer_linear import reference
from transformer_linear.modules import linear_ops
from transformer_linear.ops import nvfp4 as ops_nvfp4
from transformer_linear.recipe.quantization import QuantizationSpec, TensorQuantizer, quantization_spec
from transformer_linear.reference import nvfp4 as ref_nvfp4


def _custom_factory(role):
    """128x128 block-scaled weight with tensorwise activations (a mixed CustomRecipe)."""
    if role == "linear_weight":
        return TensorQuantizer(torch.float8_e4m3fn, [128, 128], torch.float32, True)
    dtype = torch.float8_e5m2 if role == "linear_grad_output" else torch.float8_e4m3fn
    return TensorQuantizer(dtype, [], torch.float32, False)


RECIPES = {
    "current": lambda mode: tl.recipe.CurrentScaling(backward_override=mode),
    "block": lambda mode: tl.recipe.Float8BlockScaling(backward_override=mode),
    "mxfp8": lambda mode: tl.recipe.MXFP8BlockScaling(backward_override=mode),
    "rowwise": lambda mode: tl.recipe.Float8RowwiseScaling(backward_override=mode),
    "nvfp4": lambda mode: tl.recipe.NVFP4BlockScaling(backward_override=mode),
    "nvfp4_1d": lambda mode: tl.recipe.NVFP4BlockScaling(disable_2d_quantization=True, backward_override=mode),
    "custom": lambda mode: tl.recipe.CustomRecipe(_custom_factory, backward_override=mode),
}
MODES = ["high_precision", "dequantized"]
IN, OUT, BATCH = 64, 48, (2, 16)


def _expand(scale: torch.Tensor, rows: int, cols: int, bm: int, bk: int) -> torch.Tensor:
    return scale.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def hand_dequantize(quantizer: TensorQuantizer, x: torch.Tensor) -> torch.Tensor:
    """x quantized rowwise by ``quantizer`` (as the forward GEMM reads it), dequantized to float32 by hand."""
    q = quantizer.quantize(x.contiguous(), rowwise=True)
    rows, cols = x.shape
    if not quantizer.blockwise:
        return reference.dequantize(q.data, q.scale_inv, torch.float32)
    if quantizer.is_nvfp4:
        scale, global_scale = ops_nvfp4.unpack_scales(q.scale_inv, rows, cols)
        return ref_nvfp4.dequantize_nvfp4(q.data.view(ref_nvfp4.FP4_DTYPE), scale, global_scale)
    bm, bk = quantizer.block_shape
    bk = bk or cols  # [1, 0]: one scale per row
    scale = q.scale_inv.reshape(-(-rows // bm), -(-cols // bk))
    return q.data.float() * _expand(scale, rows, cols, bm, bk)


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _layer(recipe, dtype):
    torch.manual_seed(0)
    return tl.Linear(IN, OUT, recipe=recipe, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", RECIPES)
def test_backward_matches_hand_reference(name, mode, dtype):
    recipe = RECIPES[name](mode)
    layer = _layer(recipe, dtype)
    torch.manual_seed(1)
    x = torch.randn(*BATCH, IN, dtype=dtype)
    g = torch.randn(*BATCH, OUT, dtype=dtype)
    y, dx, dw, db = _run(layer, x, g)

    # The forward is the recipe's, unchanged by the override.
    quantized = _layer(RECIPES[name](None), dtype)
    y_default = quantized(x)
    assert_bitwise_equal(y, y_default.detach(), "forward output")

    x2d, g2d, w = x.reshape(-1, IN), g.reshape(-1, OUT), layer.weight.detach()
    if mode == "high_precision":
        x_ref, w_ref = x2d, w
    else:
        spec = quantization_spec(recipe)
        x_ref, w_ref = hand_dequantize(spec.input, x2d).to(dtype), hand_dequantize(spec.weight, w).to(dtype)
        assert not torch.equal(x_ref, x2d)  # really the quantized copy
    assert_bitwise_equal(dx, torch.mm(g2d, w_ref).reshape(x.shape), "dgrad")
    assert_bitwise_equal(dw, torch.mm(g2d.t(), x_ref), "wgrad")
    assert_bitwise_equal(db, g2d.sum(0), "bias grad")


@pytest.mark.parametrize("name", RECIPES)
def test_quantizer_dequantize_is_the_hand_reference(name):
    """TensorQuantizer.dequantize (what backward runs) against the hand-expanded scales, both roles."""
    spec = quantization_spec(RECIPES[name]("dequantized"))
    torch.manual_seed(2)
    for role, t in (("input", torch.randn(48, 64) * 3), ("weight", torch.randn(48, 64) / 7)):
        quantizer = getattr(spec, role)
        q = quantizer.quantize(t, rowwise=True)
        got = quantizer.dequantize(q.data, q.scale_inv, torch.float32)
        assert_bitwise_equal(got, hand_dequantize(quantizer, t), f"{name} {role}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["current", "nvfp4"])
def test_compile_fullgraph_equals_eager(name, mode):
    recipe = RECIPES[name](mode)
    eager = _layer(recipe, torch.float32)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    for rows in (32, 48):  # a new batch size must not break the graph either
        x = torch.randn(rows, IN)
        g = torch.randn(rows, OUT)
        expected = _run(eager, x, g)
        eager.weight.grad = eager.bias.grad = None
        got = _run(compiled, x, g)
        compiled_layer.weight.grad = compiled_layer.bias.grad = None
        for what, a, b in zip(("out", "dx", "dw", "db"), got, expected):
            assert_bitwise_equal(a, b, f"{name} {mode} {what}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["current", "nvfp4"])
def test_saved_tensors(name, mode):
    """high_precision keeps the original input and weight; dequantized the forward's quantized rowwise
    copies (FP8, or FP4 bytes: half the columns), never a high-precision activation."""
    layer = _layer(RECIPES[name](mode), torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(32, IN, requires_grad=True))
    big = sorted((tuple(t.shape), t.dtype) for t in saved if t.numel() > 64)
    if mode == "high_precision":
        assert big == sorted([((32, IN), torch.float32), ((OUT, IN), torch.float32)])
    elif name == "nvfp4":
        # Two E2M1 codes a byte; packed scales: 8 elements of global scale + one E4M3 per 16 values.
        packed = [((8 + n * IN // 16,), torch.float8_e4m3fn) for n in (32, OUT)]
        assert big == sorted([((32, IN // 2), torch.uint8), ((OUT, IN // 2), torch.uint8), *packed])
    else:
        assert big == sorted([((32, IN), torch.float8_e4m3fn), ((OUT, IN), torch.float8_e4m3fn)])


@pytest.mark.parametrize("mode", MODES)
def test_wgrad_options_and_weight_cache(mode):
    """delay_wgrad_compute, fuse_wgrad_accumulation and a cached weight give the plain layer's gradients."""
    recipe = RECIPES["nvfp4"](mode)
    torch.manual_seed(4)
    x, g = torch.randn(32, IN), torch.randn(32, OUT)
    base = _layer(recipe, torch.float32)
    expected = _run(base, x, g)
    delayed = tl.Linear(IN, OUT, recipe=recipe, delay_wgrad_compute=True)
    fused = tl.Linear(IN, OUT, recipe=recipe, fuse_wgrad_accumulation=True)
    cached = tl.Linear(IN, OUT, recipe=recipe)
    for layer in (delayed, fused, cached):
        layer.load_state_dict(base.state_dict())
    fused.weight.main_grad = torch.zeros(OUT, IN)
    _run(delayed, x, g)
    delayed.backward_dw()
    _run(fused, x, g)
    cached(x, is_first_microbatch=True)
    cached.weight.grad = cached.bias.grad = None
    xc = x.clone().requires_grad_(True)
    cached(xc, is_first_microbatch=False).backward(g)
    assert_bitwise_equal(delayed.weight.grad, expected[2], "delayed wgrad")
    assert_bitwise_equal(fused.weight.main_grad, expected[2], "main_grad")
    assert_bitwise_equal(xc.grad, expected[1], "cached-weight dgrad")
    assert_bitwise_equal(cached.weight.grad, expected[2], "cached-weight wgrad")


@pytest.mark.usefixtures("allclose_on_fp8")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_opcheck_linear_fwd(name, mode):
    """The override is one more leaf of linear_fwd's options string."""
    layer = _layer(RECIPES[name](mode), torch.float32)
    x = torch.randn(32, IN, requires_grad=True)
    args = layer._fwd_args(x, layer.recipe, None)
    assert args.quantization.backward_override == mode
    flat = linear_ops.linear_fwd.flatten(args)
    op = linear_ops.linear_fwd.op
    assert f",quantization.backward_override={mode}," in flat[-1]
    torch.library.opcheck(op, flat, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    detached = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in flat)
    torch.library.opcheck(op, detached, test_utils="test_aot_dispatch_dynamic")


def test_bad_values_raise():
    for cls in (tl.recipe.CurrentScaling, tl.recipe.MXFP8BlockScaling, tl.recipe.NVFP4BlockScaling):
        with pytest.raises(ValueError, match="'backward_override' must be None, 'high_precision' or 'dequantized'"):
            cls(backward_override="fp32")
    # As in TE, delayed scaling records grad_output's amax history in its quantize: only None.
    with pytest.raises(ValueError, match="DelayedScaling: 'backward_override' must be None"):
        tl.recipe.DelayedScaling(backward_override="dequantized")
    history_factory = lambda role: TensorQuantizer(torch.float8_e4m3fn, [], torch.float32, False,  # noqa: E731
                                                   scale_from_history=True)
    with pytest.raises(ValueError, match="amax history"):
        quantization_spec(tl.recipe.CustomRecipe(history_factory, backward_override="high_precision"))
    fp8 = TensorQuantizer(torch.float8_e4m3fn, [], torch.float32, False)
    with pytest.raises(ValueError, match="backward_override"):
        QuantizationSpec(fp8, fp8, fp8, backward_override="bf16")


def test_from_name_and_equality():
    a = tl.recipe.from_name("nvfp4", backward_override="dequantized")
    assert a == tl.recipe.NVFP4BlockScaling(backward_override="dequantized") != tl.recipe.NVFP4BlockScaling()
    c1 = tl.recipe.CustomRecipe(_custom_factory, backward_override="high_precision")
    c2 = tl.recipe.CustomRecipe(_custom_factory)
    assert c1 != c2 and hash(c1) != hash(c2)
    assert quantization_spec(c1).backward_operands == "high_precision"
    assert quantization_spec(c2).backward_operands == "quantized"
